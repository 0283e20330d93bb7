"""Fire drills: FleetWatch proves its own repair loop, on a schedule, without touching a
healthy training job.

A drill (``Drill``) picks a canary node (FLEETWATCH_DRILL_NODES, else any idle node), checks
that it runs no user job (if it does, the drill is skipped and says why), and injects a
synthetic fault through FleetWatch's own pipeline: a kernel XID 79 line for the canary, stored
by the ingest service a pushed signal goes through, marked as this drill's (``DRILL_MARK``,
with a secret a push cannot know). Diagnosis sets marked signals apart from the real ones and
diagnoses them on their own (incidents.diagnosing), the lifecycle opens the drill's incident
(``Incident.drill``) and the policy plans its remediation; the step engine runs the playbook
as a rehearsal (steps.Rehearsal): each outside call recorded as "would call" and not made, or,
in canary mode, the canary really drained and cordoned; the playbook ends at the provider. The
drill follows it (``drill_follow``, polled, and the watchdog ``drills_rescue``), times each
phase (signal stored, incident, first action, drain, requeue, replace, ...), cleans up (the
incident resolved, the canary put back as it was) and ends passed, failed (with the reason;
over its budget included) or skipped. A failed drill is announced on the on-call channels
(the delivery model) and on /metrics (the FleetWatchDrillFailed alert).

A drill's incident is marked everywhere, counted by no real-incident figure, safety budget
or storm brake, and pages nobody: the one page a drill sends is its own failure.

Thin tasks (incidents/tasks.py) call ``drill_begin``, ``drill_follow``, ``drill_alert``,
``drill_scheduled`` and ``drills_rescue``; the pages, the API and ``manage.py fleetwatch drill
run`` call ``drill_start``. One drill runs at a time (a database constraint): a second start
gets the running one.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from collectors import queueing
from collectors.clients import get_clients
from collectors.clients.base import (
    K8S_CORDON_REASON,
    K8S_CORDONED_BY,
    K8S_CORDONED_BY_FLEETWATCH,
    SLURM_REASON_PREFIX,
    ActionResult,
    ClientError,
    node_or_none,
)
from collectors.clients.notify import absolute_url
from collectors.models import Cluster, Node
from collectors.push import DRILL_MARK, PushRights
from collectors.roles import SYSTEM, actor_shown
from collectors.selectors import json_list_has
from collectors.services import IngestRejected, cluster_get, signals_ingest
from incidents.audit import audit_lock, audit_record
from incidents.models import AuditEntry, Drill, Incident, Remediation, Step
from incidents.phases import phase_durations
from incidents.remediation import policy
from incidents.remediation.steps import PHASES
from incidents.remediation.transitions import remediation_stop
from incidents.retry import retry_transient
from incidents.status import incident_resolve

log = logging.getLogger(__name__)

# The synthetic fault: the driver's "fallen off the bus" line for the canary's GPU 0, the
# fault whose repair (drain, requeue, cordon, replace) exercises the most of the loop.
DRILL_XID = 79
DRILL_GPU = 0
# Slurm job states that mean a user's work is on the node (the canary must have none).
JOB_ON_NODE = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED",
                         "RESIZING", "SIGNALING", "STAGE_OUT"})
# The phases a drill reports, in order (seconds each; steps.PHASES are the repair's own).
DRILL_PHASES = ("inject", "detect", "decide", "first_action", *PHASES, "cleanup", "total")
# A drill that has not injected its fault this long after starting lost its message (a killed
# worker, a restarted broker): the watchdog begins it again (beginning twice injects once).
BEGIN_LOST_SECONDS = 30.0


class DrillError(Exception):
    """A drill the configuration does not allow (no cluster to run it on)."""


@dataclass(frozen=True)
class DrillStart:
    drill: Drill
    created: bool  # False: one was running already, and this is it


def _event(what: str, detail: str = "", at: datetime | None = None) -> dict[str, str]:
    return {"at": (at or timezone.now()).isoformat(), "what": what, "detail": detail}


def _secs(a: datetime | None, b: datetime | None) -> float | None:
    return None if a is None or b is None else round((b - a).total_seconds(), 3)


# --- starting ---------------------------------------------------------------------------------


def _configured_nodes() -> list[tuple[str, str]]:
    """FLEETWATCH_DRILL_NODES as (cluster, node): ``NODE`` in the default cluster, or
    ``CLUSTER:NODE``."""
    out = []
    for item in settings.FLEETWATCH_DRILL_NODES:
        cluster, sep, node = item.rpartition(":")
        out.append((cluster if sep else settings.FLEETWATCH_CLUSTER, node))
    return out


def drill_start(*, trigger: str, actor: str) -> DrillStart:
    """Start a fire drill now, unless one is running: then that one (``created`` False), and
    nothing new. The drill's work runs in a worker (``drill_begin``, queued on commit): this
    only records it, so a page or an API call never waits on Slurm."""
    configured = _configured_nodes()
    try:
        cluster = cluster_get(configured[0][0] if configured else settings.FLEETWATCH_CLUSTER)
    except ClientError as exc:
        raise DrillError(f"FLEETWATCH_DRILL_NODES: {exc}") from None
    for _ in range(3):
        started = _drill_create(cluster, trigger, actor)
        if started is not None:
            return started
    raise RuntimeError("could not start a fire drill: drills kept starting and finishing")


@retry_transient
def _drill_create(cluster: Cluster, trigger: str, actor: str) -> DrillStart | None:
    """The new drill, or the running one; None when the running one finished meanwhile."""
    now = timezone.now()
    budget = float(settings.FLEETWATCH_DRILL_BUDGET_SECONDS)
    try:
        with transaction.atomic():
            audit_lock()  # before the drill's row: see incidents/audit.py
            drill = Drill.objects.create(
                cluster=cluster, mode=settings.FLEETWATCH_DRILL_MODE, trigger=trigger,
                requested_by=actor, budget_seconds=budget, started_at=now,
                deadline=now + timedelta(seconds=budget), nonce=secrets.token_hex(8),
                events=[_event("started", f"{Drill.Trigger(trigger).label}, by "
                                          f"{actor_shown(actor)}; {settings.FLEETWATCH_DRILL_MODE}"
                                          f" mode, budget {budget:g} s", now)])
            audit_record("drill.started", f"drill {drill.pk}", actor=actor,
                         result=f"{settings.FLEETWATCH_DRILL_MODE} mode, budget {budget:g} s",
                         data={"drill": drill.pk, "trigger": trigger})
            queueing.enqueue(queueing.DRILL_BEGIN, drill.pk)
    except IntegrityError:
        # The one-running constraint: another start won (a second press, the schedule).
        running = Drill.objects.filter(status=Drill.Status.RUNNING).first()
        return DrillStart(running, False) if running is not None else None
    return DrillStart(drill, True)


def drill_scheduled() -> str:
    """The beat's entry (FLEETWATCH_DRILL_SCHEDULE): start a drill, or say why not."""
    try:
        started = drill_start(trigger=Drill.Trigger.SCHEDULE, actor=SYSTEM)
    except DrillError as exc:
        log.error("scheduled fire drill not started: %s", exc)
        return str(exc)
    if not started.created:
        log.warning("scheduled fire drill not started: drill %s is still running",
                    started.drill.pk)
        return f"drill {started.drill.pk} is still running"
    return f"drill {started.drill.pk} started"


# --- choosing the canary and injecting the fault ------------------------------------------------


@dataclass
class _Canary:
    cluster: Cluster
    node: str
    before: dict[str, Any] = field(default_factory=dict)


def _real_incident_on(cluster: Cluster, node: str) -> Incident | None:
    return (Incident.objects.real().filter(cluster=cluster, nodes__icontains=json_list_has(node))
            .exclude(status=Incident.Status.RESOLVED).order_by("pk").first())


def _canary_choose(drill: Drill) -> tuple[_Canary | None, list[dict[str, str]]]:
    """The first candidate that is free, and what was found of each one looked at. Reads
    Slurm (and, in canary mode, Kubernetes) live: FleetWatch's own copy may be a collection
    old, and a job that started since must not be touched."""
    configured = _configured_nodes()
    if configured:
        candidates = configured
    else:
        # Observe mode only (settings refuse canary mode without nodes): any idle node will
        # do, since nothing is changed on it.
        candidates = [(drill.cluster.name, name) for name in Node.objects.filter(
            cluster=drill.cluster, in_service=True).order_by("name").values_list("name", flat=True)]
    if not candidates:
        return None, [_event("no candidate", "FleetWatch knows no node in service "
                                             "(FLEETWATCH_DRILL_NODES is not set)")]
    seen: list[dict[str, str]] = []
    slurm_read: dict[str, Any] = {}
    for cluster_name, node in candidates:
        try:
            cluster = cluster_get(cluster_name)
        except ClientError as exc:
            seen.append(_event("candidate refused", f"{node}: {exc}"))
            continue
        if cluster_name not in slurm_read:
            try:
                clients = get_clients(cluster_name)
                slurm_read[cluster_name] = (clients, {n.name: n for n in clients.slurm.nodes()},
                                            clients.slurm.jobs())
            except ClientError as exc:
                # A source that is down is not a free node: nothing is touched unchecked.
                slurm_read[cluster_name] = exc
        read = slurm_read[cluster_name]
        if isinstance(read, ClientError):
            seen.append(_event("candidate refused", f"{node}: cannot check it for jobs, Slurm "
                                                    f"of {cluster_name} is unreachable ({read})"))
            continue
        clients, slurm_nodes, jobs = read
        why = _canary_unfit(drill, cluster, node, slurm_nodes, jobs)
        if why:
            seen.append(_event("candidate refused", f"{node}: {why}"))
            continue
        canary = _Canary(cluster, node)
        if drill.mode == Drill.Mode.CANARY:
            try:
                canary.before = _canary_state(clients, node, slurm_nodes)
            except ClientError as exc:
                seen.append(_event("candidate refused", f"{node}: cannot read its Kubernetes "
                                                        f"node ({exc})"))
                continue
            owned = _others_hold(canary.before)
            if owned:
                seen.append(_event("candidate refused", f"{node}: {owned}"))
                continue
        seen.append(_event("canary chosen", f"{node} ({cluster.name}): no user job, no open "
                                            "incident"))
        return canary, seen
    return None, seen


def _canary_unfit(drill: Drill, cluster: Cluster, node: str, slurm_nodes: dict[str, Any],
                  jobs: list[Any]) -> str:
    """Why ``node`` cannot be this drill's canary; "" when it can."""
    if not Node.objects.filter(cluster=cluster, name=node).exists():
        return "FleetWatch has not collected it yet (unknown node)"
    seen = slurm_nodes.get(node)
    if seen is None:
        return "not in Slurm"
    if seen.state == "DOWN" or "NOT_RESPONDING" in seen.flags:
        return f"not healthy in Slurm ({seen.state} {' '.join(seen.flags)})".strip()
    busy = sorted(f"job {j.job_id} ({j.user or 'unknown user'}, {j.state})" for j in jobs
                  if node in j.nodes and j.state in JOB_ON_NODE)
    if busy:
        # Never touch a healthy training job: the drill waits for a free canary.
        return f"runs {', '.join(busy)}"
    incident = _real_incident_on(cluster, node)
    if incident is not None:
        return f"in open incident {incident.pk} ({incident.root_cause})"
    busy_with = policy.node_busy(cluster.pk, [node])
    if busy_with:
        return busy_with
    return ""


def _canary_state(clients: Any, node: str, slurm_nodes: dict[str, Any]) -> dict[str, Any]:
    """The canary's Slurm and Kubernetes state now (canary mode): what the clean-up puts back."""
    slurm = slurm_nodes[node]
    k8s = node_or_none(clients.kubernetes, node)
    return {"slurm_state": slurm.state, "slurm_flags": list(slurm.flags),
            "slurm_reason": slurm.reason, "k8s_known": k8s is not None,
            "k8s_unschedulable": bool(k8s.unschedulable) if k8s else False}


def _others_hold(before: dict[str, Any]) -> str:
    """A canary someone else drained or cordoned stays theirs: a drill could not put it back
    as it was without undoing them, so it is not used."""
    if "DRAIN" in before["slurm_flags"] or before["slurm_reason"]:
        return f"drained in Slurm ({before['slurm_reason'] or 'no reason'}): not the drill's"
    if before["k8s_unschedulable"]:
        return "cordoned in Kubernetes: not the drill's"
    return ""


def drill_record(drill: Drill, node: str) -> dict[str, Any]:
    """The synthetic fault as a pushed record (the replay format's): a kernel XID 79 line for
    the canary's GPU 0, marked as this drill's."""
    return {"at": timezone.now(), "source": "kernel", "node": node, "gpu": DRILL_GPU,
            "message": f"NVRM: Xid (PCI:0000:00:00): {DRILL_XID}, pid='<unknown>', "
                       "name=<unknown>, GPU has fallen off the bus. "
                       f"(FleetWatch fire drill {drill.pk}: a synthetic fault)",
            DRILL_MARK: f"{drill.pk}:{drill.nonce}"}


def drill_begin(drill_id: int) -> str:
    """Choose the canary and inject the fault (the task's body). Safe to run twice: a drill
    that has its fault already is left as it is."""
    drill = Drill.objects.select_related("cluster").filter(pk=drill_id).first()
    if drill is None or drill.status != Drill.Status.RUNNING:
        return f"drill {drill_id} is not running"
    if drill.signal_id is not None:
        return f"drill {drill_id} has its fault already"
    canary, seen = _canary_choose(drill)
    if canary is None:
        refused = "; ".join(e["detail"] for e in seen[:5])
        drill_finish(drill_id, Drill.Status.SKIPPED, f"no canary free: {refused}", events=seen)
        return "skipped"
    with transaction.atomic():
        audit_lock()  # before the drill's row: see incidents/audit.py
        drill = Drill.objects.select_for_update().get(pk=drill_id)
        if drill.status != Drill.Status.RUNNING or drill.signal_id is not None:
            return f"drill {drill_id} began elsewhere"
        rights = PushRights(f"fire drill {drill.pk}", frozenset({"kernel"}), canary.node,
                            drill=True)
        try:
            ids = signals_ingest(canary.cluster, [drill_record(drill, canary.node)],
                                 rights=rights).ids
        except IngestRejected as exc:
            # Not expected (the canary is known, the record is FleetWatch's own): said plainly.
            drill.events = [*drill.events, *seen]
            drill.save(update_fields=["events"])
            why = f"the fault could not be stored: {exc}"
            transaction.on_commit(lambda: drill_finish(drill_id, Drill.Status.FAILED, why))
            return "failed"
        drill.cluster, drill.node, drill.signal_id = canary.cluster, canary.node, ids[0]
        drill.canary_before = canary.before
        drill.events = [*drill.events, *seen,
                        _event("fault injected", f"XID {DRILL_XID} on {canary.node} GPU "
                                                 f"{DRILL_GPU} (signal {ids[0]}), through the "
                                                 "ingest service")]
        drill.save(update_fields=["cluster", "node", "signal", "canary_before", "events"])
        audit_record("drill.injected", canary.node, result=f"fire drill {drill.pk}: XID "
                     f"{DRILL_XID} on {canary.node} GPU {DRILL_GPU}, signal {ids[0]}",
                     data={"drill": drill.pk, "signal": ids[0]})
        _follow_later(drill.pk)
    return "injected"


def _follow_later(drill_id: int) -> None:
    queueing.enqueue(queueing.DRILL_FOLLOW, drill_id,
                     countdown=settings.FLEETWATCH_STEP_POLL_SECONDS)


# --- following it ------------------------------------------------------------------------------


def _drill_incident(drill: Drill) -> Incident | None:
    return drill.incidents.order_by("pk").first()


def _remediation_of(incident: Incident | None) -> Remediation | None:
    return incident.remediations.order_by("-created_at", "-pk").first() if incident else None


def _verdict(incident: Incident | None, rem: Remediation | None) -> tuple[str, str] | None:
    """(status, reason) once the drill's outcome is known; None while it is still going."""
    if incident is None:
        return None
    if rem is None:
        # The remediation is opened in the incident's own transaction: none now, none ever.
        return (Drill.Status.FAILED, f"incident {incident.pk} opened with no remediation "
                f"(confidence {incident.confidence:.2f}, playbook "
                f"{incident.playbook or 'none'}): the loop stopped at diagnosis")
    status = rem.status
    if status == Remediation.Status.SUCCEEDED:
        return Drill.Status.PASSED, ""
    if status == Remediation.Status.RUNNING:
        return None
    step = rem.steps.exclude(status__in=[Step.Status.SUCCEEDED, Step.Status.SKIPPED,
                                         Step.Status.PENDING]).order_by("order").first()
    at = f" at step {step.order} {step.kind}" if step is not None else ""
    if status == Remediation.Status.FAILED:
        return (Drill.Status.FAILED, f"remediation {rem.pk} failed{at}: "
                f"{step.error if step is not None else 'no failed step recorded'}")
    if status == Remediation.Status.BLOCKED:
        return (Drill.Status.FAILED, f"remediation {rem.pk} stopped for a person{at}: "
                f"{rem.blocked_reason}")
    if status == Remediation.Status.AWAITING_APPROVAL:
        return (Drill.Status.FAILED, f"remediation {rem.pk} held for a person{at}: "
                f"{rem.hold_reason or 'approval'}")
    by = (rem.audit.filter(verb="remediation.cancelled").values_list("actor", flat=True)
          .first() or "")
    return (Drill.Status.FAILED, f"remediation {rem.pk} is {rem.get_status_display()}"
            + (f" by {actor_shown(by)}" if by else ""))


def _where(drill: Drill, incident: Incident | None, rem: Remediation | None) -> str:
    """Where a drill that ran out of time was, for its reason."""
    if drill.signal_id is None:
        return "it never injected its fault (no free canary was checked in time)"
    if incident is None:
        return "the fault was stored but no incident opened (is diagnosis running?)"
    if rem is None:
        return f"incident {incident.pk} has no remediation"
    step = rem.steps.exclude(status__in=Step.DONE).order_by("order").first()
    if step is None:
        return f"remediation {rem.pk} is {rem.get_status_display()}"
    return (f"remediation {rem.pk} at step {step.order} {step.kind} ({step.get_status_display()}"
            + (f": {step.detail}" if step.detail else "") + ")")


def drill_follow(drill_id: int) -> str:
    """Look at a running drill: finish it when its outcome is known or its budget is spent,
    else look again shortly (the task's body, and the watchdog's)."""
    drill = Drill.objects.select_related("signal").filter(pk=drill_id).first()
    if drill is None or drill.status != Drill.Status.RUNNING:
        return f"drill {drill_id} is not running"
    now = timezone.now()
    Drill.objects.filter(pk=drill_id).update(checked_at=now)
    incident = _drill_incident(drill)
    rem = _remediation_of(incident)
    verdict = _verdict(incident, rem) if drill.signal_id is not None else None
    if verdict is not None:
        status, reason = verdict
        # Over budget when the loop itself finished late (the remediation's end), not when
        # this look came late.
        done_at = (rem.finished_at if rem is not None and rem.finished_at else now)
        late = done_at > drill.deadline
        if late:
            took = (done_at - drill.started_at).total_seconds()
            over = (f"took {took:.1f} s, over its budget of {drill.budget_seconds:g} s "
                    "(FLEETWATCH_DRILL_BUDGET_SECONDS)")
            reason = f"{over}; {reason}" if reason else over
            status = Drill.Status.FAILED
        return drill_finish(drill_id, status, reason, over_budget=late)
    if now >= drill.deadline:
        return drill_finish(
            drill_id, Drill.Status.FAILED,
            f"not done within its budget of {drill.budget_seconds:g} s "
            f"(FLEETWATCH_DRILL_BUDGET_SECONDS): {_where(drill, incident, rem)}", over_budget=True)
    if drill.signal_id is not None:
        _follow_later(drill_id)
    return "following"


def drills_rescue() -> list[int]:
    """The watchdog (beat): a running drill whose messages died with a worker or a broker
    still finishes (failed, past its budget) instead of staying "running" forever; one that
    lost its first message begins again, one whose follow-ups stopped is followed again (a
    live chain of follow-ups is left alone). Returns the drills it acted on."""
    acted = []
    now = timezone.now()
    stale = now - timedelta(seconds=BEGIN_LOST_SECONDS)
    lost = now - timedelta(seconds=max(settings.FLEETWATCH_WATCHDOG_SECONDS,
                                       settings.FLEETWATCH_STEP_POLL_SECONDS * 5))
    for drill_id, injected, started, deadline, checked in Drill.objects.filter(
            status=Drill.Status.RUNNING).values_list("pk", "signal_id", "started_at",
                                                     "deadline", "checked_at"):
        if injected is None and started < stale and now < deadline:
            log.warning("fire drill %s: its start was lost; beginning it again", drill_id)
            drill_begin(drill_id)
            acted.append(drill_id)
        elif now >= deadline or (injected is not None and (checked is None or checked < lost)):
            drill_follow(drill_id)
            acted.append(drill_id)
    return acted


# --- finishing: clean-up, result, alert ----------------------------------------------------------


def _canary_restore(drill: Drill, incident: Incident | None) -> tuple[list[dict[str, str]], str]:
    """Canary mode: put the canary back as it was. Undoes only what this drill's incident did
    (its drain reason, its cordon annotation) and what was not there before; each call
    audited. Returns the events and, if the canary could not be put back, why."""
    if drill.mode != Drill.Mode.CANARY or not drill.node or incident is None:
        return [], ""
    before, node = drill.canary_before or {}, drill.node
    ours = f"{SLURM_REASON_PREFIX} incident {incident.pk} "
    events: list[dict[str, str]] = []
    real = _real_incident_on(drill.cluster, node)
    if real is not None or policy.node_busy(drill.cluster_id, [node]):
        # A real fault came to the canary meanwhile: its repair owns the node now (it may
        # rely on the drain the drill set), so the drill undoes nothing.
        why = (f"in real incident {real.pk} now" if real is not None
               else policy.node_busy(drill.cluster_id, [node]))
        events.append(_event("canary left for a real repair", f"{node}: {why}"))
        return events, (f"the canary {node} was not put back: {why}; its repair decides "
                        "when it goes back")
    try:
        clients = get_clients(drill.cluster.name)
        slurm = node_or_none(clients.slurm, node)
        if slurm is not None and slurm.reason.startswith(ours) and not before.get("slurm_reason"):
            events.append(_restore_call(drill, incident, "slurm.resume", node,
                                        lambda: clients.slurm.resume(node)))
        k8s = node_or_none(clients.kubernetes, node)
        if (k8s is not None and k8s.unschedulable and not before.get("k8s_unschedulable")
                and k8s.annotations.get(K8S_CORDONED_BY) == K8S_CORDONED_BY_FLEETWATCH
                and k8s.annotations.get(K8S_CORDON_REASON, "").startswith(ours)):
            events.append(_restore_call(drill, incident, "k8s.uncordon", node,
                                        lambda: clients.kubernetes.uncordon(node)))
    except ClientError as exc:
        events.append(_event("canary not put back", str(exc)))
        return events, f"the canary {node} could not be put back as it was: {exc}"
    if not events:
        events.append(_event("canary as it was", f"{node}: nothing of this drill left on it"))
    return events, ""


def _restore_call(drill: Drill, incident: Incident, verb: str, node: str,
                  fn: Any) -> dict[str, str]:
    """One clean-up call, audited like a step's (the record after the call, with its time)."""
    started = time.monotonic()
    try:
        result: ActionResult = fn()
    except ClientError as exc:
        audit_record(verb, node, incident=incident, ok=False, result=str(exc),
                     duration_ms=(time.monotonic() - started) * 1000,
                     data={"drill": drill.pk, "cleanup": True})
        raise
    audit_record(verb, node, incident=incident, call=result.call, result=result.detail,
                 duration_ms=(time.monotonic() - started) * 1000,
                 data={"drill": drill.pk, "cleanup": True, "changed": result.changed})
    return _event("canary put back", f"{verb} {node}: {result.detail}")


def drill_phases(drill: Drill, incident: Incident | None, rem: Remediation | None,
                 end: datetime) -> dict[str, float]:
    """Seconds per phase (DRILL_PHASES), as far as the drill got: from the start to the
    fault stored (inject), to its incident (detect), to the first step (decide) and the first
    outside call, would-be or real (first_action, from the fault stored); the repair's own
    phases (drain, requeue, replace, resume: incidents.phases); the clean-up; the whole."""
    out: dict[str, float | None] = {}
    stored = drill.signal.ingested_at if drill.signal is not None else None
    out["inject"] = _secs(drill.started_at, stored)
    if incident is not None:
        out["detect"] = _secs(stored, incident.opened_at)
    if incident is not None and rem is not None:
        repair = phase_durations(incident, rem, end)
        out["decide"] = repair.get("decide")
        first = (AuditEntry.objects.filter(remediation=rem)
                 .filter(~Q(call="") | Q(data__would_call=True)).order_by("at", "pk")
                 .values_list("at", flat=True).first())
        out["first_action"] = _secs(stored, first)
        for phase in PHASES:
            out[phase] = repair.get(phase)
        if drill.finished_at is not None and rem.finished_at is not None:
            out["cleanup"] = _secs(rem.finished_at, drill.finished_at)
    out["total"] = _secs(drill.started_at, drill.finished_at or end)
    return {k: v for k, v in out.items() if v is not None}


def drill_finish(drill_id: int, status: str, reason: str, *, over_budget: bool = False,
                 events: list[dict[str, str]] | None = None) -> str:
    """End a running drill: put the canary back (canary mode), stop what still runs of its
    remediation, resolve its incident, keep its phases and result; a failed one is announced
    (``drill_alert``, queued on commit). Once: a drill finished meanwhile is left as it is."""
    drill = Drill.objects.select_related("cluster", "signal").filter(pk=drill_id).first()
    if drill is None or drill.status != Drill.Status.RUNNING:
        return f"drill {drill_id} is not running"
    incident = _drill_incident(drill)
    # Outside calls first, outside any transaction (none holds a lock while Slurm answers).
    restored, restore_failed = _canary_restore(drill, incident)
    if restore_failed:
        status = Drill.Status.FAILED
        reason = f"{reason}; {restore_failed}" if reason else restore_failed
    return _drill_close(drill_id, status, reason, over_budget, [*(events or []), *restored])


@retry_transient
def _drill_close(drill_id: int, status: str, reason: str, over_budget: bool,
                 events: list[dict[str, str]]) -> str:
    with transaction.atomic():
        audit_lock()  # then policy, remediation, incident, drill: see incidents/audit.py
        policy.decisions_serialized()
        drill = Drill.objects.select_related("cluster", "signal").get(pk=drill_id)
        incident = _drill_incident(drill)
        live = list(Remediation.objects.select_for_update().filter(
            incident=incident, status__in=Remediation.ACTIVE)) if incident else []
        if incident is not None:
            incident = Incident.objects.select_for_update().get(pk=incident.pk)
        drill = (Drill.objects.select_for_update(of=("self",))
                 .select_related("cluster", "signal").get(pk=drill_id))
        if drill.status != Drill.Status.RUNNING:
            return f"drill {drill_id} finished meanwhile ({drill.status})"
        now = timezone.now()
        for rem in live:
            remediation_stop(rem, SYSTEM, f"fire drill {drill.pk} over ({status})")
        rem = _remediation_of(incident)
        if incident is not None and incident.status != Incident.Status.RESOLVED:
            incident_resolve(incident, rem)
            events = [*events, _event("incident resolved", f"incident {incident.pk}: the "
                                                           "drill's clean-up")]
        drill.status, drill.reason, drill.over_budget = status, reason, over_budget
        drill.finished_at = now
        drill.phases = drill_phases(drill, incident, rem, now)
        label = {Drill.Status.PASSED: "passed", Drill.Status.FAILED: "failed",
                 Drill.Status.SKIPPED: "skipped"}[Drill.Status(status)]
        drill.events = [*drill.events, *events, _event(label, reason)]
        drill.save()
        audit_record(f"drill.{label}", f"drill {drill.pk}", incident=incident,
                     ok=status != Drill.Status.FAILED,
                     result=reason or f"the loop ran up to the provider in "
                                      f"{drill.phases.get('total', 0):.1f} s",
                     data={"drill": drill.pk, "phases": drill.phases, "node": drill.node})
        if status == Drill.Status.FAILED:
            queueing.enqueue(queueing.DRILL_ALERT, drill.pk)
    log.log(logging.WARNING if status == Drill.Status.FAILED else logging.INFO,
            "fire drill %s %s%s", drill_id, label, f": {reason}" if reason else "")
    return label


def drill_url(drill_id: int) -> str:
    return absolute_url(f"/drills/{drill_id}/")


def drill_alert(drill_id: int) -> str:
    """Tell the on-call channels that a drill failed (the one page a drill sends): one
    delivery per channel (incidents.deliveries), audited like a step's notification. Once:
    ``alerted_at`` records it."""
    drill = Drill.objects.select_related("cluster").filter(pk=drill_id).first()
    if drill is None or drill.status != Drill.Status.FAILED or drill.alerted_at is not None:
        return "nothing to tell"
    incident = _drill_incident(drill)
    subject = (f"FleetWatch fire drill {drill.pk} failed"
               + (f" on {drill.node}" if drill.node else "")
               + (" (over its budget)" if drill.over_budget else ""))
    body = (f"FleetWatch's own repair loop did not prove itself: {drill.reason}. The drill's "
            f"report: {drill_url(drill.pk)}")
    payload: dict[str, object] = {
        "event": "drill.failed", "drill": drill.pk, "node": drill.node, "mode": drill.mode,
        "reason": drill.reason, "over_budget": drill.over_budget, "phases": drill.phases,
        "drill_url": drill_url(drill.pk), "delivery_key": f"drill-{drill.pk}-failed"}
    if incident is not None:
        payload["incident"] = incident.pk
    started = time.monotonic()
    try:
        result = get_clients(drill.cluster.name).notifier.notify(subject, body, payload)
    except ClientError as exc:
        audit_record("notify", "on-call", incident=incident, ok=False, result=str(exc),
                     duration_ms=(time.monotonic() - started) * 1000,
                     data={"drill": drill.pk, "page": "drill.failed"})
        outcome = f"alert failed: {exc}"
    else:
        audit_record("notify", "on-call", incident=incident, call=result.call,
                     result=result.detail, duration_ms=(time.monotonic() - started) * 1000,
                     data={"drill": drill.pk, "page": "drill.failed", "changed": result.changed,
                           **result.data})
        outcome = f"alert sent: {result.detail}"
    now = timezone.now()
    with transaction.atomic():
        row = Drill.objects.select_for_update().get(pk=drill.pk)
        row.alerted_at = now
        row.events = [*row.events, _event("alert", outcome, now)]
        row.save(update_fields=["alerted_at", "events"])
    return outcome
