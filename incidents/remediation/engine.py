"""The step engine: run a remediation's steps, one Celery message per run.

A step is queued (``step_enqueue``, on commit, so a worker never sees a step before the row that
describes it is committed), leased to the worker that takes it, run through its executor
(incidents/remediation/steps.py), and its outcome applied: done (the next step is queued, or
the remediation succeeded and the incident is resolved), waiting (polled again), blocked or
gated (a person decides), failed (retried while attempts last). Running a step twice is safe:
leased, and each executor checks the outside state first. ``steps_rescue`` (the beat) and
``steps_resume_all`` (a single-worker start) queue again the steps whose message was lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import cast

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from collectors import queueing
from collectors.clients import get_clients
from collectors.clients.base import ActionResult, ClientError
from collectors.models import Job, Node, Signal
from incidents import gates
from incidents.audit import audit_lock, audit_record
from incidents.diagnosis.progress import parse_checkpoint
from incidents.models import Drill, Incident, Remediation, Step
from incidents.remediation.steps import (
    EXECUTORS,
    Block,
    Done,
    Facts,
    Outcome,
    Rehearsal,
    RehearsalStop,
    StepContext,
    StepFailed,
    Wait,
    step_timeout,
)
from incidents.retry import retry_transient
from incidents.status import incident_event, incident_resolve, incident_status
from incidents.why import fault_summary, job_link

log = logging.getLogger(__name__)


def step_enqueue(step_id: int, reason: str = "start", countdown: float = 0) -> None:
    """Queue a run of the step (once the caller's transaction commits), ``countdown`` seconds
    from now."""
    # Recorded with the step (in the caller's transaction), so the watchdog knows when it is
    # overdue if the message never arrives.
    Step.objects.filter(pk=step_id).update(
        next_check_at=timezone.now() + timedelta(seconds=countdown))
    queueing.enqueue(queueing.RUN_STEP, step_id, reason, countdown=countdown)


def person_page_enqueue(remediation: Remediation) -> None:
    """Page the on-call channels once the remediation, waiting for a person, is committed."""
    queueing.enqueue(queueing.PAGE_PERSON, remediation.pk)


def person_page(remediation_id: int) -> str:
    """Tell the on-call channels that a remediation waits for a person from the start: its
    playbook runs in approve mode, or a safety rail held it. Its own notify step runs only
    after the approval, so without this page the person who must approve would hear of it
    only from a webhook subscription, if any, or the dashboard; in a storm, where the fleet
    budget holds every new repair, that is every fault. The call is audited like a step's
    (an outside call) and recorded as a delivery per channel; a failed page is recorded and
    not retried here (the incident waits on the dashboard, and the webhook event of the wait
    has its own retries)."""
    rem = Remediation.objects.select_related("incident__cluster").get(pk=remediation_id)
    if rem.status != Remediation.Status.AWAITING_APPROVAL:
        return f"remediation {rem.pk} is {rem.status}: nobody to page"
    incident = rem.incident
    why = rem.hold_reason or f"the {rem.playbook} playbook runs in approve mode"
    subject = (f"FleetWatch incident {incident.pk}: {incident.root_cause} on "
               f"{', '.join(incident.nodes) or incident.switch or 'no node'} waits for a "
               "person's approval")
    payload = {"incident": incident.pk, "remediation": rem.pk,
               "root_cause": incident.root_cause, "nodes": list(incident.nodes),
               "waiting_for": "approval", "why": why,
               "delivery_key": f"incident-{incident.pk}-remediation-{rem.pk}-approval"}
    started = time.monotonic()
    try:
        result = get_clients(incident.cluster.name).notifier.notify(
            subject, f"{why}. {incident.explanation}", payload)
    except ClientError as exc:
        audit_record("notify", "on-call", remediation=rem, ok=False, result=str(exc),
                     data={"page": "approval"},
                     duration_ms=(time.monotonic() - started) * 1000)
        return f"page failed: {exc}"
    audit_record("notify", "on-call", remediation=rem, call=result.call, result=result.detail,
                 data={"page": "approval", "changed": result.changed, **result.data},
                 duration_ms=(time.monotonic() - started) * 1000)
    return result.detail


def steps_rescue() -> list[int]:
    """Queue again the steps whose message was lost: due a while ago, nobody holding their
    lease, their remediation still running. Running a step twice is safe (leased, and each
    executor checks the outside state first), so erring towards a re-queue costs a no-op."""
    now = timezone.now()
    overdue = queueing.lost_before(now)
    stuck = list(Step.objects.filter(
        remediation__status=Remediation.Status.RUNNING,
        status__in=[Step.Status.PENDING, Step.Status.RUNNING, Step.Status.WAITING],
        next_check_at__lt=overdue).filter(Q(lease_until=None) | Q(lease_until__lt=now))
        .values_list("pk", flat=True))
    for step_id in stuck:
        with transaction.atomic():
            step_enqueue(step_id, "watchdog")
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
            held = cast(datetime, step.lease_until)  # the query left out steps without one
            audit_record("step.lease_released", step.kind, remediation=step.remediation, step=step,
                         result=f"held until {held.isoformat()} by a worker that has "
                                "stopped; the step resumes, skipping the calls it completed")
        Step.objects.exclude(lease_until=None).update(lease_until=None)
        # Only steps that were queued (next_check_at is set then): a later step of the
        # playbook is queued by the one before it when that one is done.
        for step_id, due in Step.objects.filter(
                remediation__status=Remediation.Status.RUNNING,
                status__in=[Step.Status.PENDING, Step.Status.RUNNING, Step.Status.WAITING],
                next_check_at__isnull=False).order_by("pk").values_list("pk", "next_check_at"):
            # A waiting step keeps its next poll time; a cut-off or lost one runs now.
            # due is set: the query takes only steps with next_check_at.
            step_enqueue(step_id, "restart",
                         max(0.0, (cast(datetime, due) - now).total_seconds()))
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
        outcome: Outcome | ClientError | DatabaseFault | RehearsalStop = EXECUTORS[step.kind](ctx)
    except RehearsalStop as stop:
        outcome = stop
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
            step.deadline = now + timedelta(seconds=step_timeout(step.kind))
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
def _step_finish(step_id: int,
                 outcome: Outcome | ClientError | DatabaseFault | RehearsalStop) -> str:
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
            step_enqueue(step.pk, "recheck", DATABASE_RETRY_SECONDS)
            return "database error; queued again"
        if isinstance(outcome, RehearsalStop):
            return _rehearsal_end(step, outcome)
        return _step_apply(step, outcome)


# Verbs a canary drill makes for real: what its clean-up can put back exactly (a drain and a
# cordon FleetWatch set itself). Evictions, replacements, reboots, resets and notifications
# stay "would call" in every drill.
CANARY_REAL_VERBS = frozenset({"slurm.drain", "k8s.cordon"})


def _rehearsal(incident: Incident) -> Rehearsal | None:
    """How a fire drill's incident runs its playbook (None: a real incident's repair)."""
    if incident.drill_id is None:
        return None
    mode = Drill.objects.filter(pk=incident.drill_id).values_list("mode", flat=True).first()
    canary = mode == Drill.Mode.CANARY
    return Rehearsal(incident.drill_id, str(mode or Drill.Mode.OBSERVE),
                     CANARY_REAL_VERBS if canary else frozenset())


def _rehearsed(rem: Remediation, detail: str) -> str:
    """A drill's step says what it did as if it had (the executor's words), and that it was a
    rehearsal: which of its calls were only recorded."""
    rehearsal = _rehearsal(rem.incident)
    if rehearsal is None:
        return detail
    made = (f"only {', '.join(sorted(rehearsal.real_verbs))} made for real"
            if rehearsal.real_verbs else "no call made")
    return f"Rehearsed by fire drill {rehearsal.drill_id} ({made}): {detail}"


def _rehearsal_end(step: Step, stop: RehearsalStop) -> str:
    """A drill's playbook reached the provider: that step is done (its call recorded as
    "would call"), the steps after it are not run, and the remediation is over: succeeded as
    a rehearsal. Called with the step row locked."""
    rem, now = step.remediation, timezone.now()
    step.status, step.finished_at, step.detail = Step.Status.SUCCEEDED, now, str(stop)
    step.result = {**step.result, "rehearsal_stop": f"{stop.verb} {stop.target}"}
    step.error = ""
    step.save()
    audit_record("step.succeeded", step.kind, remediation=rem, step=step, result=str(stop))
    rem.steps.filter(order__gt=step.order).exclude(status__in=Step.DONE).update(
        status=Step.Status.SKIPPED, finished_at=now,
        detail="fire drill: not run past the provider")
    rem.status, rem.finished_at = Remediation.Status.SUCCEEDED, now
    rem.save()
    audit_record("remediation.rehearsed", f"incident {rem.incident_id}", remediation=rem,
                 result=f"fire drill: the playbook ran up to the provider ({stop.verb} "
                        f"{stop.target} would be next)")
    incident_resolve(rem.incident, rem)
    return "rehearsed"


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
        incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
        incident_event("remediation.awaiting_approval", rem.incident, rem)
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
        incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
        incident_event("remediation.awaiting_approval", rem.incident, rem)
        return "observed"
    return ""


def _step_context(step: Step) -> StepContext:
    rem, incident = step.remediation, step.remediation.incident
    previous = {s.kind: s.result for s in rem.steps.filter(order__lt=step.order)}
    rehearsal = _rehearsal(incident)

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
        explanation=incident.explanation, nodes=list(incident.nodes),
        clients=get_clients(incident.cluster.name),
        grace_seconds=settings.FLEETWATCH_SLURM_GRACE_SECONDS, state=dict(step.result),
        previous=previous, audit=audit, remediation_id=rem.pk, gpus=_incident_gpus(incident),
        done_calls=set(step.done_calls), on_call_done=lambda key: _step_call_done(step.pk, key),
        jobs=_incident_job_owners(incident), switch=incident.switch,
        fault=fault_summary(incident).text,
        job_link=lambda job_id: job_link(incident.cluster.name, job_id),
        facts=Facts(last_link_change=lambda node: _last_link_change(incident, node),
                    mark_rma=lambda node, why: node_mark_rma(node, why, rem, rehearsal),
                    last_checkpoint=lambda job_id: _last_checkpoint(incident, job_id),
                    node_pool=lambda node: gates.node_pool(incident.cluster_id, node),
                    gate_record=lambda node, state: gates.gate_record_for_step(
                        step.pk, node, state),
                    gate_failures=lambda node: gates.gate_failures(incident.cluster_id, node)),
        rehearsal=rehearsal,
    )


@retry_transient
def _step_call_done(step_id: int, key: str) -> None:
    """Save at once (autocommit: the executor runs outside any transaction) that this call
    completed, so a run after a crash skips it. The step is leased to this worker."""
    done = list(Step.objects.filter(pk=step_id).values_list("done_calls", flat=True).first()
                or [])
    Step.objects.filter(pk=step_id).update(done_calls=[*done, key])


def _incident_gpus(incident: Incident) -> list[int]:
    return sorted({cast(int, g) for g in incident.signals.exclude(gpu_index=None).values_list(
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


def _last_checkpoint(incident: Incident, job_id: str) -> tuple[float, int | None] | None:
    """When the job last said it wrote a checkpoint (its output, stored as job_log signals),
    and at which step where it says: (epoch seconds, step)."""
    lines = (Signal.objects.filter(cluster=incident.cluster, source=Signal.Source.JOB_LOG,
                                   job_id=job_id)
             .filter(Q(message__icontains="checkpoint") | Q(message__icontains="saving model"))
             .order_by("-observed_at").values_list("observed_at", "message")[:50])
    for at, message in lines:
        saved = parse_checkpoint(message)
        if saved is not None:
            return at.timestamp(), saved.step
    return None


def _step_apply(step: Step, outcome: Outcome | ClientError) -> str:
    rem = step.remediation
    now = timezone.now()
    if isinstance(outcome, Done):
        step.status, step.finished_at = Step.Status.SUCCEEDED, now
        step.result, step.detail, step.error = outcome.result, _rehearsed(rem, outcome.detail), ""
        step.save()
        audit_record("step.succeeded", step.kind, remediation=rem, step=step,
                     result=outcome.detail)
        step_advance(step)
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
        step_enqueue(step.pk, "poll", settings.FLEETWATCH_STEP_POLL_SECONDS)
        return "waiting"
    if isinstance(outcome, Block):
        step.status, step.result, step.detail = Step.Status.BLOCKED, outcome.result, outcome.reason
        step.save()
        rem.status, rem.blocked_reason = Remediation.Status.BLOCKED, outcome.reason
        rem.save()
        audit_record("remediation.blocked", step.kind, remediation=rem, step=step,
                     result=outcome.reason)
        incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
        # Stopped for a person's go-ahead: to a subscriber, that is waiting for approval.
        incident_event("remediation.awaiting_approval", rem.incident, rem)
        return "blocked"
    error = str(outcome)
    if isinstance(outcome, StepFailed):
        step.result = outcome.result  # what a person's retry starts from
    if not outcome.permanent and step.attempts < settings.FLEETWATCH_STEP_MAX_ATTEMPTS:
        step.error, step.status = error, Step.Status.RUNNING
        step.detail = f"attempt {step.attempts} failed, retrying: {error}"
        step.save()
        step_enqueue(step.pk, "retry", min(60.0, 2.0 ** step.attempts))
        return "retrying"
    return _step_fail(step, error)


def _step_fail(step: Step, error: str) -> str:
    rem, now = step.remediation, timezone.now()
    step.status, step.error, step.finished_at = Step.Status.FAILED, error, now
    step.save()
    rem.status, rem.finished_at = Remediation.Status.FAILED, now
    rem.save()
    audit_record("step.failed", step.kind, remediation=rem, step=step, ok=False, result=error)
    incident_status(rem.incident, Incident.Status.NEEDS_ATTENTION)
    return "failed"


def step_advance(step: Step) -> None:
    rem = step.remediation
    following = rem.steps.filter(order__gt=step.order).order_by("order").first()
    if following is not None:
        step_enqueue(following.pk)
        return
    now = timezone.now()
    rem.status, rem.finished_at = Remediation.Status.SUCCEEDED, now
    rem.save()
    audit_record("remediation.succeeded", f"incident {rem.incident_id}", remediation=rem)
    incident_resolve(rem.incident, rem)


def node_mark_rma(node: str, why: str, remediation: Remediation,
                  rehearsal: Rehearsal | None = None) -> None:
    """Take the node out of the pools FleetWatch replaces from, and say so. A fire drill
    marks nothing: it records that it would."""
    if rehearsal is not None:
        audit_record("node.rma", node, remediation=remediation,
                     data={"would_call": True, "drill": rehearsal.drill_id},
                     result=f"fire drill {rehearsal.drill_id}: would mark {node} for RMA ({why})")
        return
    Node.objects.filter(name=node, cluster=remediation.incident.cluster).update(pool="rma")
    audit_record("node.rma", node, remediation=remediation, result=why)
