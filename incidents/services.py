"""Incident and remediation services: the one place where judgement turns into state.

Views, API endpoints and tasks call these; they never change incidents or remediations
themselves. Remediation steps run as Celery tasks, queued with ``transaction.on_commit`` so a
worker never sees a step before the row that describes it is committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.db.models import Min, Q
from django.utils import timezone

from collectors.clients import get_clients
from collectors.clients.base import ActionResult, ClientError
from collectors.models import Cluster, Job, Node, Signal
from collectors.roles import actor_name
from incidents import selectors
from incidents.audit import SYSTEM, audit_lock, audit_record
from incidents.diagnosis import Diagnosis, diagnose
from incidents.models import AuditEntry, DiagnosisState, Evidence, Incident, Remediation, Step
from incidents.remediation import policy
from incidents.remediation.steps import (
    EXECUTORS,
    Block,
    Done,
    Facts,
    Outcome,
    StepContext,
    Wait,
)
from incidents.retry import retry_transient

log = logging.getLogger(__name__)

# Below this a diagnosis opens an incident for a person to read, but no remediation.
AUTO_REMEDIATION_MIN_CONFIDENCE = 0.8


class InvalidTransition(Exception):
    """The action does not fit the current state (approve a finished remediation, ...)."""


# --- diagnosis -> incidents -----------------------------------------------------------------


def diagnose_signals(signal_ids: list[int]) -> list[Incident]:
    """Diagnose the window around newly ingested signals; open or extend incidents.

    The live pipeline goes through diagnosis_run (coalesced per cluster); this is for callers
    holding the ids (tests, the agent's local check)."""
    fresh = list(Signal.objects.filter(pk__in=signal_ids).select_related("cluster"))
    if not fresh:
        return []
    return _diagnose_from(fresh[0].cluster_id, min(s.observed_at for s in fresh))


def _diagnose_from(cluster_id: int, earliest: datetime) -> list[Incident]:
    """Diagnose the cluster's window from ``earliest`` (less the diagnosis window) to now."""
    cluster = Cluster.objects.get(pk=cluster_id)
    window = timedelta(minutes=settings.FLEETWATCH_DIAGNOSIS_WINDOW_MINUTES)
    observations = selectors.observations_between(cluster, earliest - window, timezone.now())
    diagnoses = diagnose(observations, selectors.topology(cluster), selectors.jobs_info(cluster))
    incidents = []
    for diagnosis in diagnoses:
        incident, _ = incident_record(cluster.pk, diagnosis)
        incidents.append(incident)
    return incidents


# --- coalesced diagnosis ----------------------------------------------------------------------
#
# One task per push let a burst starve detection: 2,000 batches queued 2,000 diagnoses, each
# re-reading the same window, and a new fault waited behind all of them. Instead each cluster
# has one DiagnosisState row, and:
#
# - storing signals marks it *in the storing transaction* (diagnosis_request, the listener of
#   collectors' signals_stored): pending_since = the earliest new observation. Committed with
#   the signals or not at all, so a stored signal is never left unannounced, whatever happens
#   to the process or the broker afterwards;
# - a task is sent only when none is queued and no run holds the row: a burst adds nothing
#   to the queue, whatever the push rate (at most one queued and one running per cluster);
# - a run (diagnosis_run) claims everything pending at once, diagnoses the window from the
#   earliest claimed observation to now (what the per-batch runs did for their earliest
#   batch: the same verdicts), and on finishing queues the next run if more arrived meanwhile.
#   A fault stored during a run is diagnosed by the next one.
#
# A database row rather than the cache: the mark must commit with the signals (a cache write
# cannot), and the embedded default's file cache has no atomic operations. Row locks
# (select_for_update; on SQLite every transaction takes the write lock up front) make the
# read-and-set steps safe with several workers. Lost messages and killed workers: a run's
# claim is a lease (the task's hard time limit), given back when the run fails; a beat entry
# (diagnosis_rescue) and the next announcement re-send a task whose message was lost or whose
# run died, and claim what the dead run had claimed.


def _lease() -> timedelta:
    """No run outlives the task's hard time limit: past it, a run that holds the row is dead."""
    return timedelta(seconds=settings.CELERY_TASK_TIME_LIMIT + 10)


def _diagnosis_state(cluster_id: int) -> DiagnosisState:
    """The cluster's row, locked for the rest of the transaction."""
    state, _ = DiagnosisState.objects.select_for_update().get_or_create(cluster_id=cluster_id)
    return state


def _diagnosis_queue(state: DiagnosisState, now: datetime, *, force: bool = False) -> None:
    """Send a run for the (locked) state unless one is queued or running. ``force``: the
    message of the queued one may have been lost (the rescue)."""
    running = state.running_since is not None and state.running_since > now - _lease()
    if running or (state.queued_at is not None and not force):
        return
    from incidents import tasks  # tasks import services: keep the cycle out of module load

    state.queued_at = now
    cluster_id = state.cluster_id
    transaction.on_commit(lambda: tasks.diagnose_cluster.delay(cluster_id))


def diagnosis_request(signal_ids: Collection[int]) -> None:
    """Mark diagnosis due for these (just stored) signals' clusters; queue a run if none is."""
    if not signal_ids:
        return
    # Rows of one bulk insert have neighbouring ids: a range reads no long IN list. Rows of
    # other pushes in the range only make the window start earlier, never later.
    earliest = (Signal.objects.filter(pk__range=(min(signal_ids), max(signal_ids)))
                .values("cluster_id").annotate(at=Min("observed_at")).order_by("cluster_id"))
    now = timezone.now()
    with transaction.atomic():
        for row in earliest:
            state = _diagnosis_state(row["cluster_id"])
            if state.pending_since is None or row["at"] < state.pending_since:
                state.pending_since = row["at"]
            _diagnosis_queue(state, now, force=state.queued_at is not None
                             and state.queued_at < now - _lease())
            state.save()


def signals_stored_received(sender: object, signal_ids: list[int], **_: object) -> None:
    """collectors.services.signals_stored's listener (connected in apps.py)."""
    diagnosis_request(signal_ids)


def diagnosis_run(cluster_id: int) -> list[Incident]:
    """Diagnose everything stored for the cluster since the last run (the task's body)."""
    now = timezone.now()
    with transaction.atomic():
        state = _diagnosis_state(cluster_id)
        state.queued_at = None  # this is the queued run: announcements may queue the next
        if state.running_since is not None and state.running_since > now - _lease():
            state.save()  # another worker's run holds it and will look again when done
            return []
        # A run that died (lease expired) gives back what it claimed.
        earliest = min((t for t in (state.pending_since, state.running_from) if t is not None),
                       default=None)
        state.pending_since = None
        state.running_from = earliest
        state.running_since = now if earliest is not None else None
        state.save()
    if earliest is None:
        return []
    started = time.monotonic()
    try:
        incidents = _diagnose_from(cluster_id, earliest)
    except BaseException:
        _diagnosis_release(cluster_id, now, started, failed=True)
        raise
    _diagnosis_release(cluster_id, now, started)
    return incidents


def _diagnosis_release(cluster_id: int, claimed_at: datetime, started: float, *,
                       failed: bool = False) -> None:
    with transaction.atomic():
        state = _diagnosis_state(cluster_id)
        if state.running_since != claimed_at:
            return  # our lease expired and another run took the claim over
        if failed and state.running_from is not None:
            # Not diagnosed: pending again, for the retry or the next announcement.
            state.pending_since = min(t for t in (state.pending_since, state.running_from) if t)
        else:
            state.runs += 1
            state.last_run_at = timezone.now()
            state.last_run_ms = (time.monotonic() - started) * 1000
        state.running_since = state.running_from = None
        if state.pending_since is not None and not failed:
            _diagnosis_queue(state, timezone.now())  # what arrived during this run
        state.save()


def diagnosis_rescue() -> int:
    """Re-send runs whose message was lost (queued too long) or whose worker died (lease
    expired) while diagnosis is due; the beat runs this. Returns how many were sent."""
    now = timezone.now()
    stale = now - _lease()
    due = DiagnosisState.objects.filter(
        Q(pending_since__isnull=False) | Q(running_from__isnull=False)).filter(
        Q(queued_at__isnull=True) | Q(queued_at__lt=stale)).filter(
        Q(running_since__isnull=True) | Q(running_since__lt=stale))
    sent = 0
    for cluster_id in due.values_list("cluster_id", flat=True):
        with transaction.atomic():
            state = _diagnosis_state(cluster_id)
            if state.queued_at is None or state.queued_at < stale:
                before = state.queued_at
                _diagnosis_queue(state, now, force=True)
                if state.queued_at != before:
                    sent += 1
                    log.warning("diagnosis of cluster %s was due and nothing was queued (a lost "
                                "message or a dead worker): queued a run", cluster_id)
                state.save()
    return sent


@retry_transient
def incident_record(cluster_id: int, diagnosis: Diagnosis) -> tuple[Incident, bool]:
    """Open an incident for a diagnosis, or extend the one already open for the same fault.

    A fault that keeps showing (a gauge re-read, the same XID injected twice, a second
    diagnosis run) is one incident with more evidence, never a second remediation.
    """
    for _ in range(3):
        try:
            with transaction.atomic():
                audit_lock()  # before the incident's row lock: see incidents/audit.py
                return _incident_record(cluster_id, diagnosis)
        except IntegrityError:
            continue  # another worker opened it between our lookup and insert: extend that
    raise RuntimeError(f"could not record incident {diagnosis.fingerprint}")


def _incident_record(cluster_id: int, diagnosis: Diagnosis) -> tuple[Incident, bool]:
    now = timezone.now()
    recent = now - timedelta(minutes=settings.FLEETWATCH_DEDUPE_MINUTES)
    existing = (
        Incident.objects.select_for_update()
        .filter(cluster_id=cluster_id, fingerprint=diagnosis.fingerprint)
        .filter(~Q(status=Incident.Status.RESOLVED) | Q(resolved_at__gte=recent))
        .order_by("-opened_at")
        .first()
    )
    if existing is None and diagnosis.root_cause == "node_unreachable":
        # A node FleetWatch is repairing (draining, rebooting, replacing) stops answering
        # because of the repair: that is the repair's evidence, not a new incident.
        holding = policy.remediation_holding(diagnosis.nodes)
        if holding is not None:
            existing = Incident.objects.select_for_update().get(pk=holding.incident_id)
    if existing is not None:
        added = _evidence_add(existing, diagnosis.evidence)
        if added:
            audit_record("incident.extended", f"incident {existing.pk}", incident=existing,
                         result=f"{added} more signal(s) for the same fault")
        return existing, False
    incident = Incident.objects.create(
        cluster_id=cluster_id, root_cause=diagnosis.root_cause, confidence=diagnosis.confidence,
        explanation=diagnosis.explanation, playbook=diagnosis.playbook,
        fingerprint=diagnosis.fingerprint, nodes=list(diagnosis.nodes),
        jobs=list(diagnosis.jobs), switch=diagnosis.switch or "",
        detected_at=diagnosis.detected_at, opened_at=now,
    )
    _evidence_add(incident, diagnosis.evidence)
    audit_record("incident.opened", f"incident {incident.pk}", incident=incident,
                 result=diagnosis.explanation,
                 data={"root_cause": diagnosis.root_cause, "confidence": diagnosis.confidence})
    _event("incident.opened", incident)
    if diagnosis.confidence >= AUTO_REMEDIATION_MIN_CONFIDENCE and policy.playbook_choose(
            incident)[0] is not None:
        remediation_open(incident, actor=SYSTEM, automatic=True)
    return incident, True


def _evidence_add(incident: Incident, signal_ids: tuple[int, ...]) -> int:
    have = set(incident.evidence.values_list("signal_id", flat=True))
    new = [Evidence(incident=incident, signal_id=sid) for sid in signal_ids if sid not in have]
    Evidence.objects.bulk_create(new, ignore_conflicts=True)
    return len(new)


# --- remediations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Opened:
    remediation: Remediation
    created: bool


@retry_transient
def remediation_open(
    incident: Incident,
    *,
    actor: str,
    user: AbstractBaseUser | None = None,
    automatic: bool = False,
) -> Opened:
    """Create the remediation for an incident, unless one is live or already succeeded.

    ``automatic`` (FleetWatch itself): the playbook's mode applies (auto starts at once,
    approve waits for a person, observe records what it would do) and the safety rails may
    hold it for a person. A person pressing "start" has made the decision: it runs in auto,
    and only a node already in another remediation makes it wait. Risky steps keep their own
    modes either way (policy.step_mode).
    """
    with transaction.atomic():
        policy.decisions_serialized()
        incident = Incident.objects.select_for_update().get(pk=incident.pk)
        current = incident.remediations.filter(
            status__in=[*Remediation.ACTIVE, Remediation.Status.SUCCEEDED]
        ).first()
        if current is not None:
            return Opened(current, False)  # healed already, or under way: nothing new
        if incident.status == Incident.Status.RESOLVED:
            raise InvalidTransition(f"incident {incident.pk} is resolved; nothing to remediate")
        try:
            decision = policy.decide(incident, automatic=automatic)
        except LookupError as exc:
            raise InvalidTransition(str(exc)) from exc
        playbook, mode = decision.playbook, decision.mode
        if mode == Remediation.Mode.OBSERVE:
            status = Remediation.Status.OBSERVED
        elif mode == Remediation.Mode.APPROVE or decision.hold_reason:
            status = Remediation.Status.AWAITING_APPROVAL
        else:
            status = Remediation.Status.RUNNING
        now = timezone.now()
        remediation = Remediation.objects.create(
            incident=incident, playbook=playbook.name, mode=mode, status=status,
            requested_by=actor, requested_by_user=user,
            nodes=list(incident.nodes) if playbook.touches_nodes else [],
            hold_reason=decision.hold_reason,
            started_at=now if status == Remediation.Status.RUNNING else None,
            finished_at=now if status == Remediation.Status.OBSERVED else None,
        )
        observe = status == Remediation.Status.OBSERVED
        Step.objects.bulk_create([
            Step(remediation=remediation, order=i, kind=spec.kind, title=spec.title,
                 mode=decision.step_modes.get(spec.risk, mode) if spec.risk else
                 (Remediation.Mode.OBSERVE if observe else Remediation.Mode.AUTO),
                 status=Step.Status.SKIPPED if observe else Step.Status.PENDING,
                 detail=f"observe mode: would {spec.title[0].lower()}{spec.title[1:]}"
                 if observe else "")
            for i, spec in enumerate(playbook.steps, start=1)
        ])
        if playbook.name != incident.playbook:
            incident.playbook = playbook.name
            incident.save(update_fields=["playbook"])
        audit_record(f"remediation.{'observed' if observe else 'created'}",
                     f"incident {incident.pk}", actor=actor, remediation=remediation,
                     result=f"{playbook.name} in {mode} mode"
                     + (f"; {decision.escalation}" if decision.escalation else ""),
                     data={"step_modes": decision.step_modes})
        if decision.hold_reason:
            audit_record("remediation.held", f"incident {incident.pk}", actor=SYSTEM,
                         remediation=remediation, result=decision.hold_reason)
            _incident_status(incident, Incident.Status.NEEDS_ATTENTION)
        if decision.rma:
            for node in incident.nodes:
                _node_mark_rma(node, decision.hold_reason, remediation)
        if status == Remediation.Status.RUNNING:
            _incident_status(incident, Incident.Status.REMEDIATING)
            _step_enqueue(remediation.steps.get(order=1).pk)
        elif status == Remediation.Status.AWAITING_APPROVAL:
            _event("remediation.awaiting_approval", incident, remediation)
        return Opened(remediation, True)


def _node_mark_rma(node: str, why: str, remediation: Remediation) -> None:
    """Take the node out of the pools FleetWatch replaces from, and say so."""
    Node.objects.filter(name=node, cluster=remediation.incident.cluster).update(pool="rma")
    audit_record("node.rma", node, remediation=remediation, result=why)


@retry_transient
def remediation_approve(remediation_id: int, user: AbstractBaseUser | None,
                        actor: str | None = None) -> Remediation:
    """Approve a remediation waiting for a person: the whole of it (approve mode, or held by
    a safety rail) or the risky step it stopped at. Two people approving at once: the row lock
    lets one through and the other is told it is no longer waiting.

    A remediation stopped for a person at a check (a pod that opts out of automatic
    replacement, a risky step in observe mode) is waiting for the same go-ahead: approving it
    is continuing it, so a program that only knows "approve" is not left with a 409."""
    actor = actor or actor_name(user)
    with transaction.atomic():
        policy.decisions_serialized()
        rem = Remediation.objects.select_for_update().select_related("incident").get(
            pk=remediation_id)
        if rem.status == Remediation.Status.BLOCKED:
            return remediation_continue(remediation_id, user, actor=actor)
        if rem.status != Remediation.Status.AWAITING_APPROVAL:
            who = f" by {rem.approved_by}" if rem.approved_by else ""
            raise InvalidTransition(f"remediation {rem.pk} is {rem.get_status_display()}"
                                    f"{who}; nothing to approve")
        _refuse_if_resolved(rem)
        busy = policy.node_busy(rem.nodes, exclude_incident=rem.incident_id)
        if busy:
            raise InvalidTransition(f"cannot start yet: {busy}")
        now = timezone.now()
        step = rem.steps.select_for_update().filter(
            status=Step.Status.AWAITING_APPROVAL).first()
        if step is not None:
            step.status, step.approved_by, step.approved_at = Step.Status.PENDING, actor, now
            step.detail = f"approved by {actor}"
            step.save()
            rem.status, rem.hold_reason = Remediation.Status.RUNNING, ""
            rem.save()
            audit_record("step.approved", step.kind, actor=actor, remediation=rem, step=step,
                         result=step.title)
            _incident_status(rem.incident, Incident.Status.REMEDIATING)
            _step_enqueue(step.pk)
            return rem
        rem.status, rem.approved_by, rem.approved_at, rem.started_at = (
            Remediation.Status.RUNNING, actor, now, now)
        held, rem.hold_reason = rem.hold_reason, ""
        rem.save()
        audit_record("remediation.approved", f"incident {rem.incident_id}", actor=actor,
                     remediation=rem, result=f"overriding: {held}" if held else "")
        _incident_status(rem.incident, Incident.Status.REMEDIATING)
        _step_enqueue(rem.steps.get(order=1).pk)
        return rem


def _refuse_if_resolved(rem: Remediation) -> None:
    """Nothing acts for an incident that is over (resolved by hand while this remediation
    waited, or a stale button pressed on an old page)."""
    if rem.incident.status == Incident.Status.RESOLVED:
        raise InvalidTransition(f"incident {rem.incident_id} is resolved; remediation "
                                f"{rem.pk} is {rem.get_status_display()} and stays so")


@retry_transient
def remediation_continue(remediation_id: int, user: AbstractBaseUser | None,
                         actor: str | None = None) -> Remediation:
    """A person overrides a blocking check (no-auto-replace) and lets the playbook go on."""
    actor = actor or actor_name(user)
    with transaction.atomic():
        audit_lock()  # before any row lock: see incidents/audit.py
        rem = Remediation.objects.select_for_update().select_related("incident").get(
            pk=remediation_id)
        if rem.status != Remediation.Status.BLOCKED:
            raise InvalidTransition(f"remediation {rem.pk} is {rem.get_status_display()}, "
                                    "not waiting for a person")
        _refuse_if_resolved(rem)
        step = rem.steps.select_for_update().get(status=Step.Status.BLOCKED)
        if step.mode == Remediation.Mode.OBSERVE and step.result.get("observed"):
            # A risky step in observe mode stopped to say what it would do: continuing is a
            # person's decision to let it do that now.
            step.status, step.mode = Step.Status.PENDING, Remediation.Mode.AUTO
            step.approved_by, step.approved_at = actor, timezone.now()
            step.detail = f"{step.detail} Continued by {actor}: running it."
            step.save()
            rem.status, rem.blocked_reason = Remediation.Status.RUNNING, ""
            rem.save()
            audit_record("remediation.continued", f"incident {rem.incident_id}", actor=actor,
                         remediation=rem, step=step, result=f"run {step.kind} now")
            _incident_status(rem.incident, Incident.Status.REMEDIATING)
            _step_enqueue(step.pk)
            return rem
        step.status, step.finished_at = Step.Status.SUCCEEDED, timezone.now()
        step.result = {**step.result, "overridden_by": actor}
        step.detail = f"{step.detail} Continued by {actor}."
        step.save()
        rem.status, rem.blocked_reason = Remediation.Status.RUNNING, ""
        rem.save()
        audit_record("remediation.continued", f"incident {rem.incident_id}", actor=actor,
                     remediation=rem, step=step, result=f"override of {step.kind}")
        _incident_status(rem.incident, Incident.Status.REMEDIATING)
        _step_advance(step)
        return rem


@retry_transient
def remediation_retry(remediation_id: int, user: AbstractBaseUser | None,
                      actor: str | None = None) -> Remediation:
    """Run a failed remediation's failed step again (a person fixed what stopped it). The
    calls that step completed before it failed are not made again."""
    actor = actor or actor_name(user)
    with transaction.atomic():
        policy.decisions_serialized()
        rem = Remediation.objects.select_for_update().select_related("incident").get(
            pk=remediation_id)
        step = rem.steps.select_for_update().filter(status=Step.Status.FAILED).first()
        if rem.status != Remediation.Status.FAILED or step is None:
            raise InvalidTransition(f"remediation {rem.pk} is {rem.get_status_display()}; "
                                    "no failed step to retry")
        _refuse_if_resolved(rem)
        newer = rem.incident.remediations.filter(status__in=Remediation.ACTIVE).exclude(
            pk=rem.pk).first()
        if newer is not None:
            # One live remediation per incident (a database constraint): the newer one is
            # the incident's repair now.
            raise InvalidTransition(
                f"remediation {newer.pk} of incident {rem.incident_id} is "
                f"{newer.get_status_display()}; cancel it or let it finish before retrying "
                f"remediation {rem.pk}")
        busy = policy.node_busy(rem.nodes, exclude_incident=rem.incident_id)
        if busy:
            raise InvalidTransition(f"cannot retry yet: {busy}")
        failed_with = step.error
        step.status, step.attempts, step.checks = Step.Status.PENDING, 0, 0
        step.finished_at, step.started_at, step.lease_until = None, None, None
        step.detail = f"retried by {actor} after: {failed_with}"[:2000]
        step.error = ""
        step.save()
        rem.status, rem.finished_at = Remediation.Status.RUNNING, None
        try:
            with transaction.atomic():  # a savepoint: the refusal below needs a live transaction
                rem.save()
        except IntegrityError:
            # Another remediation of this incident went live despite the check above (a
            # database without the policy lock): refuse as the check would have.
            raise InvalidTransition(f"another remediation of incident {rem.incident_id} is "
                                    f"live; remediation {rem.pk} stays failed") from None
        audit_record("step.retried", step.kind, actor=actor, remediation=rem, step=step,
                     result=f"failed with: {failed_with}")
        _incident_status(rem.incident, Incident.Status.REMEDIATING)
        _step_enqueue(step.pk)
        return rem


@retry_transient
def remediation_cancel(remediation_id: int, user: AbstractBaseUser | None,
                       actor: str | None = None) -> Remediation:
    actor = actor or actor_name(user)
    with transaction.atomic():
        audit_lock()  # before any row lock: see incidents/audit.py
        rem = Remediation.objects.select_for_update().select_related("incident").get(
            pk=remediation_id)
        if not rem.is_active:
            raise InvalidTransition(f"remediation {rem.pk} is {rem.get_status_display()}; "
                                    "nothing to cancel")
        _remediation_stop(rem, actor, "what was done stays done; nothing more will run")
        _incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
        return rem


def _remediation_stop(rem: Remediation, actor: str, why: str) -> None:
    """Cancel a live remediation (its row locked): its unfinished steps will not run."""
    now = timezone.now()
    rem.status, rem.finished_at = Remediation.Status.CANCELLED, now
    rem.save()
    rem.steps.exclude(status__in=Step.DONE).update(
        status=Step.Status.CANCELLED, finished_at=now, lease_until=None)
    audit_record("remediation.cancelled", f"incident {rem.incident_id}", actor=actor,
                 remediation=rem, result=why)


def _incident_status(incident: Incident, status: str) -> None:
    if incident.status != status:
        Incident.objects.filter(pk=incident.pk).update(status=status)
        incident.status = status
        if status != Incident.Status.RESOLVED:  # resolving sends its own event
            _event("incident.updated", incident)


def _event(event: str, incident: Incident, remediation: Remediation | None = None) -> None:
    """Tell the webhook subscribers, once the change is committed (a rolled-back change was
    never news)."""
    from incidents import webhooks

    incident_id, remediation_id = incident.pk, remediation.pk if remediation else None
    transaction.on_commit(lambda: webhooks.event_emit(event, incident_id, remediation_id))


# --- incidents: a person's actions ----------------------------------------------------------


@retry_transient
def incident_acknowledge(incident_id: int, *, actor: str) -> Incident:
    """Someone has it. Once per incident: a second acknowledgement says who was first."""
    with transaction.atomic():
        audit_lock()  # before any row lock: see incidents/audit.py
        incident = Incident.objects.select_for_update().get(pk=incident_id)
        if incident.status == Incident.Status.RESOLVED:
            raise InvalidTransition(f"incident {incident.pk} is resolved; nothing to "
                                    "acknowledge")
        if incident.acknowledged_at is not None:
            raise InvalidTransition(
                f"incident {incident.pk} was acknowledged by {incident.acknowledged_by} at "
                f"{incident.acknowledged_at.isoformat()}")
        incident.acknowledged_by, incident.acknowledged_at = actor, timezone.now()
        incident.save(update_fields=["acknowledged_by", "acknowledged_at"])
        audit_record("incident.acknowledged", f"incident {incident.pk}", actor=actor,
                     incident=incident)
        _event("incident.updated", incident)
    return incident


@retry_transient
def incident_resolve_by_hand(incident_id: int, *, actor: str, note: str = "") -> Incident:
    """A person says it is over (fixed by hand, or not a fault after all). Refused while a
    remediation is still acting: cancel it first, so nothing acts on a resolved incident. One
    that only waits for a person is cancelled with it.

    Locks in the order the remediation actions take them (policy, remediation, incident), so
    a resolve and an approve at the same moment queue rather than deadlock: whichever is
    second sees what the first did."""
    with transaction.atomic():
        policy.decisions_serialized()
        live = list(Remediation.objects.select_for_update().filter(
            incident_id=incident_id, status__in=Remediation.ACTIVE))
        incident = Incident.objects.select_for_update().get(pk=incident_id)
        if incident.status == Incident.Status.RESOLVED:
            raise InvalidTransition(f"incident {incident.pk} is already resolved")
        acting = [r for r in live if r.status != Remediation.Status.AWAITING_APPROVAL]
        if acting:
            raise InvalidTransition(
                f"remediation {acting[0].pk} is {acting[0].status}; cancel it before resolving")
        for rem in live:  # nobody approved it and nobody will now
            _remediation_stop(rem, actor, "the incident was resolved by hand")
        audit_record("incident.resolved_by_hand", f"incident {incident.pk}", actor=actor,
                     incident=incident, result=note[:500])
        incident_resolve(incident)
    return incident


# --- steps ----------------------------------------------------------------------------------


def _step_enqueue(step_id: int, reason: str = "start", countdown: float = 0) -> None:
    from incidents import tasks  # tasks import services: keep the cycle out of module load

    # Recorded with the step (in the caller's transaction), so the watchdog knows when it is
    # overdue if the message never arrives.
    Step.objects.filter(pk=step_id).update(
        next_check_at=timezone.now() + timedelta(seconds=countdown))
    transaction.on_commit(
        lambda: tasks.run_step.apply_async(args=[step_id, reason], countdown=countdown or None)
    )


def steps_rescue() -> list[int]:
    """Queue again the steps whose message was lost: due a while ago, nobody holding their
    lease, their remediation still running. Running a step twice is safe (leased, and each
    executor checks the outside state first), so erring towards a re-queue costs a no-op."""
    now = timezone.now()
    overdue = now - timedelta(seconds=max(settings.FLEETWATCH_WATCHDOG_SECONDS,
                                          settings.FLEETWATCH_STEP_POLL_SECONDS * 3))
    stuck = list(Step.objects.filter(
        remediation__status=Remediation.Status.RUNNING,
        status__in=[Step.Status.PENDING, Step.Status.RUNNING, Step.Status.WAITING],
        next_check_at__lt=overdue).filter(Q(lease_until=None) | Q(lease_until__lt=now))
        .values_list("pk", flat=True))
    for step_id in stuck:
        with transaction.atomic():
            _step_enqueue(step_id, "watchdog")
    if stuck:
        log.warning("watchdog: re-queued step(s) %s", stuck)
    return stuck


def steps_resume_all() -> list[int]:
    """At the start of a stack with one worker (``make run``), before that worker starts:
    release every step lease and queue again every step of a running remediation. A step cut
    off mid-call by the last stop then resumes at once instead of after its lease (two
    minutes), and a poll whose message died with the last worker is not left to the watchdog.
    The calls a cut-off step completed are in its done_calls and are not made again.

    Only safe when no worker can be running a step: every lease is taken for a dead one's.
    Several workers sharing a database leave leases to expire (steps_rescue)."""
    now = timezone.now()
    resumed: list[int] = []
    with transaction.atomic():
        audit_lock()  # before any row lock: see incidents/audit.py
        cut_off = list(Step.objects.exclude(lease_until=None)
                       .select_related("remediation__incident").order_by("pk"))
        for step in cut_off:
            audit_record("step.lease_released", step.kind, remediation=step.remediation, step=step,
                         result=f"held until {step.lease_until.isoformat()} by a worker that has "
                                "stopped; the step resumes, skipping the calls it completed")
        Step.objects.exclude(lease_until=None).update(lease_until=None)
        # Only steps that were queued (next_check_at is set then): a later step of the
        # playbook is queued by the one before it when that one is done.
        for step_id, due in Step.objects.filter(
                remediation__status=Remediation.Status.RUNNING,
                status__in=[Step.Status.PENDING, Step.Status.RUNNING, Step.Status.WAITING],
                next_check_at__isnull=False).order_by("pk").values_list("pk", "next_check_at"):
            # A waiting step keeps its next poll time; a cut-off or lost one runs now.
            _step_enqueue(step_id, "restart", max(0.0, (due - now).total_seconds()))
            resumed.append(step_id)
    if resumed:
        log.warning("start-up: released %d step lease(s), queued step(s) %s", len(cut_off), resumed)
    return resumed


def step_run(step_id: int, reason: str = "start") -> str:
    """Run (or re-check) one step. Safe to call any number of times for the same step."""
    step = _step_take(step_id, reason)
    if isinstance(step, str):
        return step

    # The step row says "running" (committed) before any outside call is made.
    try:
        ctx = _step_context(step)
        outcome: Outcome | ClientError | DatabaseFault = EXECUTORS[step.kind](ctx)
    except ClientError as exc:
        outcome = exc
    except SoftTimeLimitExceeded:
        # A source or provider slower than the task's time limit: try again later, as any
        # transient failure (the calls it completed are recorded and not made twice).
        outcome = ClientError("the step ran past the task time limit "
                              "(FLEETWATCH_TASK_SOFT_TIME_LIMIT); retrying", permanent=False)
    except (OperationalError, InterfaceError) as exc:
        # Our own database (a deadlock lost while recording a call, a dropped connection),
        # not the step's target: never a reason to fail the repair. (IntegrityError and the
        # like are bugs, and fail the step below as any other.)
        log.warning("step %s: database error, running it again: %s", step.pk, exc)
        connection.close_if_unusable_or_obsolete()
        outcome = DatabaseFault(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except Exception as exc:  # a bug in an executor must not leave the step leased forever
        log.exception("step %s crashed", step.pk)
        outcome = ClientError(f"{type(exc).__name__}: {exc}", permanent=True)
    return _step_finish(step_id, outcome)


@retry_transient
def _step_take(step_id: int, reason: str) -> Step | str:
    """Lease the step to this worker (and mark it started): the step, or why not to run it."""
    now = timezone.now()
    with transaction.atomic():
        audit_lock()  # before the step's row lock: see incidents/audit.py
        step = (Step.objects.select_for_update(of=("self",))
                .select_related("remediation__incident").get(pk=step_id))
        rem = step.remediation
        if step.status in (*Step.DONE, Step.Status.BLOCKED):
            return f"step already {step.status}"
        if rem.status != Remediation.Status.RUNNING:
            return f"remediation is {rem.status}"
        if step.lease_until and step.lease_until > now:
            return "step is being run by another worker"
        if step.status == Step.Status.AWAITING_APPROVAL:
            return "step awaits approval"
        if step.status == Step.Status.PENDING and not step.approved_by:
            gate = _step_gate(step, rem)
            if gate:
                return gate
        if step.status == Step.Status.PENDING:
            step.status, step.started_at, step.attempts = Step.Status.RUNNING, now, 1
            step.deadline = now + timedelta(seconds=_step_timeout(step.kind))
            audit_record("step.started", step.kind, remediation=rem, step=step,
                         result=step.title)
        elif reason == "retry":
            step.attempts += 1
        else:
            step.checks += 1
        step.lease_until = now + timedelta(seconds=settings.FLEETWATCH_STEP_LEASE_SECONDS)
        step.save()
    return step


# How long a step whose run met a database error waits before it runs again.
DATABASE_RETRY_SECONDS = 5.0


@dataclass(frozen=True)
class DatabaseFault:
    """A step's run stopped by our own database (transient), not by the step's target."""

    error: str


@retry_transient
def _step_finish(step_id: int, outcome: Outcome | ClientError | DatabaseFault) -> str:
    with transaction.atomic():
        audit_lock()  # before the step's row lock: see incidents/audit.py
        step = (Step.objects.select_for_update(of=("self",))
                .select_related("remediation__incident").get(pk=step_id))
        step.lease_until = None
        if step.status in Step.DONE:  # cancelled while we were out
            step.save()
            return f"step {step.status} meanwhile"
        if isinstance(outcome, DatabaseFault):
            # Run it again soon as a re-check: it spends none of the step's attempts.
            step.detail = f"database error, running again: {outcome.error}"[:2000]
            step.save()
            _step_enqueue(step.pk, "recheck", DATABASE_RETRY_SECONDS)
            return "database error; queued again"
        return _step_apply(step, outcome)


def _step_gate(step: Step, rem: Remediation) -> str:
    """A risky step whose own mode is approve waits for a click; one in observe mode records
    what it would do and stops for a person. Called with the step row locked."""
    if step.mode == Remediation.Mode.APPROVE:
        step.status, step.detail = Step.Status.AWAITING_APPROVAL, (
            f"{step.title}: this step needs a person's approval (FLEETWATCH_STEP_MODES)")
        step.save()
        rem.status, rem.hold_reason = Remediation.Status.AWAITING_APPROVAL, step.detail
        rem.save()
        audit_record("step.awaiting_approval", step.kind, remediation=rem, step=step,
                     result=step.detail)
        _incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
        _event("remediation.awaiting_approval", rem.incident, rem)
        return "awaiting approval"
    if step.mode == Remediation.Mode.OBSERVE:
        nodes = ", ".join(rem.nodes)
        reason = (f"observe mode for this step: FleetWatch would {step.title[0].lower()}"
                  f"{step.title[1:]} ({nodes}) and did nothing. Do it by hand and stop "
                  "here, or continue to let FleetWatch do it now.")
        step.status, step.detail, step.result = Step.Status.BLOCKED, reason, {"observed": True}
        step.save()
        rem.status, rem.blocked_reason = Remediation.Status.BLOCKED, reason
        rem.save()
        audit_record("step.observed", step.kind, remediation=rem, step=step, result=reason)
        _incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
        _event("remediation.awaiting_approval", rem.incident, rem)
        return "observed"
    return ""


# Steps that wait on the physical world (a job to end and the GPUs to cool, a link to stay
# up, a switch to be fixed, a node to come back) get longer than the others before they fail.
LONG_WAITS = {"wait_cool": 24 * 3600.0, "wait_link_stable": 24 * 3600.0,
              "wait_switch_healthy": 24 * 3600.0}


def _step_timeout(kind: str) -> float:
    if kind == "wait_node_back":
        return settings.FLEETWATCH_NODE_BACK_MINUTES * 60.0 + settings.FLEETWATCH_STEP_TIMEOUT_SECONDS
    return max(LONG_WAITS.get(kind, 0.0), float(settings.FLEETWATCH_STEP_TIMEOUT_SECONDS))


def _step_context(step: Step) -> StepContext:
    rem, incident = step.remediation, step.remediation.incident
    previous = {s.kind: s.result for s in rem.steps.filter(order__lt=step.order)}

    # Retried on its own (a deadlock lost here must not leave a call made but unrecorded,
    # which a re-run would make again).
    @retry_transient
    def audit(verb: str, target: str, result: ActionResult | None, error: str | None,
              duration_ms: float | None = None) -> None:
        audit_record(verb, target, remediation=rem, step=step, ok=error is None,
                     call=result.call if result else "",
                     result=error or (result.detail if result else ""),
                     data={"changed": result.changed, **result.data} if result else {},
                     duration_ms=duration_ms)

    return StepContext(
        incident_id=incident.pk, root_cause=incident.root_cause,
        explanation=incident.explanation, nodes=list(incident.nodes), clients=get_clients(),
        grace_seconds=settings.FLEETWATCH_SLURM_GRACE_SECONDS, state=dict(step.result),
        previous=previous, audit=audit, remediation_id=rem.pk, gpus=_incident_gpus(incident),
        done_calls=set(step.done_calls), on_call_done=lambda key: _step_call_done(step.pk, key),
        jobs=_incident_job_owners(incident), switch=incident.switch,
        facts=Facts(last_link_change=lambda node: _last_link_change(incident, node),
                    mark_rma=lambda node, why: _node_mark_rma(node, why, rem)),
    )


@retry_transient
def _step_call_done(step_id: int, key: str) -> None:
    """Save at once (autocommit: the executor runs outside any transaction) that this call
    completed, so a run after a crash skips it. The step is leased to this worker."""
    done = list(Step.objects.filter(pk=step_id).values_list("done_calls", flat=True).first()
                or [])
    Step.objects.filter(pk=step_id).update(done_calls=[*done, key])


def _incident_gpus(incident: Incident) -> list[int]:
    return sorted({g for g in incident.signals.exclude(gpu_index=None).values_list(
        "gpu_index", flat=True)})


def _incident_job_owners(incident: Incident) -> dict[str, str]:
    owners = dict(Job.objects.filter(cluster=incident.cluster, slurm_id__in=incident.jobs)
                  .values_list("slurm_id", "user"))
    return {job: owners.get(job, "") for job in incident.jobs}


def _last_link_change(incident: Incident, node: str) -> float | None:
    """When the node's link last changed, as the collectors recorded it (NIC signals)."""
    at = (Signal.objects.filter(cluster=incident.cluster, node_name=node, source="nic")
          .order_by("-observed_at").values_list("observed_at", flat=True).first())
    return at.timestamp() if at else None


def _step_apply(step: Step, outcome: Outcome | ClientError) -> str:
    rem = step.remediation
    now = timezone.now()
    if isinstance(outcome, Done):
        step.status, step.finished_at = Step.Status.SUCCEEDED, now
        step.result, step.detail, step.error = outcome.result, outcome.detail, ""
        step.save()
        audit_record("step.succeeded", step.kind, remediation=rem, step=step,
                     result=outcome.detail)
        _step_advance(step)
        return "succeeded"
    if isinstance(outcome, Wait):
        # Attempts count failures in a row: a step that waits for an hour may meet a few
        # source blips without failing the repair.
        step.attempts = 1
        step.result, step.detail = outcome.result, outcome.detail
        if step.deadline and now > step.deadline:
            return _step_fail(step, f"timed out: {outcome.detail}")
        step.status = Step.Status.WAITING
        step.save()
        _step_enqueue(step.pk, "poll", settings.FLEETWATCH_STEP_POLL_SECONDS)
        return "waiting"
    if isinstance(outcome, Block):
        step.status, step.result, step.detail = Step.Status.BLOCKED, outcome.result, outcome.reason
        step.save()
        rem.status, rem.blocked_reason = Remediation.Status.BLOCKED, outcome.reason
        rem.save()
        audit_record("remediation.blocked", step.kind, remediation=rem, step=step,
                     result=outcome.reason)
        _incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
        # Stopped for a person's go-ahead: to a subscriber, that is waiting for approval.
        _event("remediation.awaiting_approval", rem.incident, rem)
        return "blocked"
    error = str(outcome)
    if not outcome.permanent and step.attempts < settings.FLEETWATCH_STEP_MAX_ATTEMPTS:
        step.error, step.status = error, Step.Status.RUNNING
        step.detail = f"attempt {step.attempts} failed, retrying: {error}"
        step.save()
        _step_enqueue(step.pk, "retry", min(60.0, 2.0 ** step.attempts))
        return "retrying"
    return _step_fail(step, error)


def _step_fail(step: Step, error: str) -> str:
    rem, now = step.remediation, timezone.now()
    step.status, step.error, step.finished_at = Step.Status.FAILED, error, now
    step.save()
    rem.status, rem.finished_at = Remediation.Status.FAILED, now
    rem.save()
    audit_record("step.failed", step.kind, remediation=rem, step=step, ok=False, result=error)
    _incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
    return "failed"


def _step_advance(step: Step) -> None:
    rem = step.remediation
    following = rem.steps.filter(order__gt=step.order).order_by("order").first()
    if following is not None:
        _step_enqueue(following.pk)
        return
    now = timezone.now()
    rem.status, rem.finished_at = Remediation.Status.SUCCEEDED, now
    rem.save()
    audit_record("remediation.succeeded", f"incident {rem.incident_id}", remediation=rem)
    incident_resolve(rem.incident, rem)


def incident_resolve(incident: Incident, remediation: Remediation | None = None) -> None:
    now = timezone.now()
    incident.status, incident.resolved_at = Incident.Status.RESOLVED, now
    incident.phases = phase_durations(incident, remediation, now)
    incident.repaired_by = _repaired_by(incident)
    incident.save(update_fields=["status", "resolved_at", "phases", "repaired_by"])
    audit_record("incident.resolved", f"incident {incident.pk}", incident=incident,
                 result=", ".join(f"{k} {v:.1f}s" for k, v in incident.phases.items()))
    _event("incident.resolved", incident, remediation)


def _repaired_by(incident: Incident) -> str:
    """"person" when anyone approved, continued or started something; else "automation"."""
    people = incident.audit.exclude(actor=SYSTEM).exists() or AuditEntry.objects.filter(
        remediation__incident=incident).exclude(actor=SYSTEM).exists()
    return "person" if people else "automation"


# Step kinds by the phase of a repair they belong to.
PHASE_OF_STEP = {
    "drain_and_cancel": "drain", "drain": "drain", "down_node": "drain",
    "hold_switch_nodes": "drain", "cordon_and_drain": "drain",
    "requeue": "requeue", "requeue_dead_jobs": "requeue",
    "replace_node": "replace", "replace_if_not_back": "replace", "reboot": "replace",
    "reset_or_reboot": "replace", "mark_rma": "replace",
    "resume": "resume", "resume_node": "resume", "release_switch_nodes": "resume",
    "verify_fault_cleared": "resume", "wait_link_stable": "resume",
    "wait_switch_healthy": "resume", "wait_cool": "resume", "wait_node_back": "resume",
}


def phase_durations(
    incident: Incident, remediation: Remediation | None, now: Any
) -> dict[str, float]:
    """Seconds per phase: detection, waiting for approval, each step, and the whole repair."""
    def secs(a: Any, b: Any) -> float:
        return round((b - a).total_seconds(), 3)

    phases = {"detect": secs(incident.detected_at, incident.opened_at)}
    if remediation is not None:
        if remediation.approved_at:
            phases["approval"] = secs(remediation.created_at, remediation.approved_at)
        steps = list(remediation.steps.order_by("order"))
        first = next((st.started_at for st in steps if st.started_at), None)
        if first is not None:
            # Decide: from the incident opening to the first step running (approval included).
            phases["decide"] = secs(incident.opened_at, first)
        grouped: dict[str, float] = {}
        for step in steps:
            if step.started_at and step.finished_at:
                phases[step.kind] = secs(step.started_at, step.finished_at)
                phase = PHASE_OF_STEP.get(step.kind)
                if phase:
                    grouped[phase] = round(grouped.get(phase, 0.0) + phases[step.kind], 3)
        # The repair's phases (drain, requeue, replace, resume) sum their steps; a step
        # named like its phase ("requeue") is that phase's total.
        phases.update(grouped)
        first_call = remediation.audit.exclude(call="").order_by("at").first()
        if first_call is not None:
            phases["first_action"] = secs(incident.detected_at, first_call.at)
    phases["total"] = secs(incident.detected_at, now)
    return phases
