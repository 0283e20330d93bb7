"""A remediation's transitions: open it for an incident, and a person's approve, continue,
retry and cancel. Each takes its locks in one order (audit, policy, remediation, step,
incident: see incidents/audit.py) and hands the steps it releases to the step engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from django.contrib.auth.models import AnonymousUser, User
from django.db import IntegrityError, transaction
from django.utils import timezone

from collectors.roles import SYSTEM, actor_name
from incidents.audit import audit_lock, audit_record
from incidents.models import Incident, Remediation, Step
from incidents.remediation import engine, policy
from incidents.retry import retry_transient
from incidents.status import InvalidTransition, incident_event, incident_status


@dataclass(frozen=True)
class Opened:
    remediation: Remediation
    created: bool


@retry_transient
def remediation_open(
    incident: Incident,
    *,
    actor: str,
    user: User | AnonymousUser | None = None,
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
            # Operators only reach here (the views check the role): a User, never anonymous.
            requested_by=actor, requested_by_user=cast("User | None", user),
            nodes=list(incident.nodes) if playbook.touches_nodes else [],
            hold_reason=decision.hold_reason,
            started_at=now if status == Remediation.Status.RUNNING else None,
            finished_at=now if status == Remediation.Status.OBSERVED else None,
        )
        observe = status == Remediation.Status.OBSERVED
        _steps_create(remediation, decision, observe=observe)
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
            incident_status(incident, Incident.Status.NEEDS_ATTENTION)
        if decision.rma:
            for node in incident.nodes:
                engine.node_mark_rma(node, decision.hold_reason, remediation)
        if status == Remediation.Status.RUNNING:
            incident_status(incident, Incident.Status.REMEDIATING)
            engine.step_enqueue(remediation.steps.get(order=1).pk)
        elif status == Remediation.Status.AWAITING_APPROVAL:
            incident_event("remediation.awaiting_approval", incident, remediation)
            # A person who pressed "start" needs no page about it, and a fire drill pages
            # nobody (it fails, and says why, if its remediation cannot run).
            if automatic and incident.drill_id is None:
                engine.person_page_enqueue(remediation)
        return Opened(remediation, True)


def _steps_create(remediation: Remediation, decision: policy.Decision, *, observe: bool) -> None:
    """The playbook's steps, in order: each risky one in its own mode, the rest in auto (or
    skipped, saying what they would do, when the remediation only observes)."""
    mode = decision.mode
    Step.objects.bulk_create([
        Step(remediation=remediation, order=i, kind=spec.kind, title=spec.title,
             mode=decision.step_modes.get(spec.risk, mode) if spec.risk else
             (Remediation.Mode.OBSERVE if observe else Remediation.Mode.AUTO),
             status=Step.Status.SKIPPED if observe else Step.Status.PENDING,
             detail=f"observe mode: would {spec.title[0].lower()}{spec.title[1:]}"
             if observe else "")
        for i, spec in enumerate(decision.playbook.steps, start=1)
    ])


@retry_transient
def remediation_approve(remediation_id: int, user: User | AnonymousUser | None,
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
        busy = policy.node_busy(rem.incident.cluster_id, rem.nodes,
                                exclude_incident=rem.incident_id)
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
            incident_status(rem.incident, Incident.Status.REMEDIATING)
            engine.step_enqueue(step.pk)
            return rem
        rem.status, rem.approved_by, rem.approved_at, rem.started_at = (
            Remediation.Status.RUNNING, actor, now, now)
        held, rem.hold_reason = rem.hold_reason, ""
        rem.save()
        audit_record("remediation.approved", f"incident {rem.incident_id}", actor=actor,
                     remediation=rem, result=f"overriding: {held}" if held else "")
        incident_status(rem.incident, Incident.Status.REMEDIATING)
        engine.step_enqueue(rem.steps.get(order=1).pk)
        return rem


def _refuse_if_resolved(rem: Remediation) -> None:
    """Nothing acts for an incident that is over (resolved by hand while this remediation
    waited, or a stale button pressed on an old page)."""
    if rem.incident.status == Incident.Status.RESOLVED:
        raise InvalidTransition(f"incident {rem.incident_id} is resolved; remediation "
                                f"{rem.pk} is {rem.get_status_display()} and stays so")


@retry_transient
def remediation_continue(remediation_id: int, user: User | AnonymousUser | None,
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
            incident_status(rem.incident, Incident.Status.REMEDIATING)
            engine.step_enqueue(step.pk)
            return rem
        step.status, step.finished_at = Step.Status.SUCCEEDED, timezone.now()
        step.result = {**step.result, "overridden_by": actor}
        step.detail = f"{step.detail} Continued by {actor}."
        step.save()
        rem.status, rem.blocked_reason = Remediation.Status.RUNNING, ""
        rem.save()
        audit_record("remediation.continued", f"incident {rem.incident_id}", actor=actor,
                     remediation=rem, step=step, result=f"override of {step.kind}")
        incident_status(rem.incident, Incident.Status.REMEDIATING)
        engine.step_advance(step)
        return rem


@retry_transient
def remediation_retry(remediation_id: int, user: User | AnonymousUser | None,
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
        busy = policy.node_busy(rem.incident.cluster_id, rem.nodes,
                                exclude_incident=rem.incident_id)
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
        incident_status(rem.incident, Incident.Status.REMEDIATING)
        engine.step_enqueue(step.pk)
        return rem


@retry_transient
def remediation_cancel(remediation_id: int, user: User | AnonymousUser | None,
                       actor: str | None = None) -> Remediation:
    actor = actor or actor_name(user)
    with transaction.atomic():
        audit_lock()  # before any row lock: see incidents/audit.py
        rem = Remediation.objects.select_for_update().select_related("incident").get(
            pk=remediation_id)
        if not rem.is_active:
            raise InvalidTransition(f"remediation {rem.pk} is {rem.get_status_display()}; "
                                    "nothing to cancel")
        remediation_stop(rem, actor, "what was done stays done; nothing more will run")
        incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
        return rem


def remediation_stop(rem: Remediation, actor: str, why: str) -> None:
    """Cancel a live remediation (its row locked): its unfinished steps will not run."""
    now = timezone.now()
    rem.status, rem.finished_at = Remediation.Status.CANCELLED, now
    rem.save()
    rem.steps.exclude(status__in=Step.DONE).update(
        status=Step.Status.CANCELLED, finished_at=now, lease_until=None)
    audit_record("remediation.cancelled", f"incident {rem.incident_id}", actor=actor,
                 remediation=rem, result=why)
