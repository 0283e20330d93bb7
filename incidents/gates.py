"""The return-to-service gate as a service: plans from the settings, the record of each run,
and gates other code starts on a node outside any playbook.

Inside a playbook the ``prove_healthy`` step runs the gate (incidents/remediation/steps.py)
and the engine records each run here (``gate_record_for_step``). Outside one, other code
(giving a lent node back to Slurm, an operator's API call) asks::

    gate_id = node_gate_start("gpu-007", "back from Kubernetes", repair=Repair.LEND)
    gate_status(gate_id)   # incidents.selectors: {"status": "running", "detail": ..., ...}

``node_gate_start`` records a GateRun and queues ``gate_advance``, which polls the gate (one
Celery message per poll, leased as steps are) until its verdict: passed (the node is in
service, its reservation gone), failed or cannot_run (the node drained with a ``fleetwatch:``
reason, held), unchecked (no check configured for its pool after that repair: it is resumed,
and says so). The risk class ``return_to_service`` has its mode (FLEETWATCH_STEP_MODES): in
approve mode the gate waits for ``gate_approve``; in observe mode it only records what it would
run. Every outside call is audited (``gate`` in the entry's data names the run).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from collectors import queueing
from collectors.clients import get_clients
from collectors.clients.base import ActionResult, ClientError
from collectors.knowledge.acceptance import Repair, selection_for
from collectors.knowledge.causes import Risk
from collectors.models import Cluster, Node
from collectors.roles import SYSTEM
from incidents.audit import audit_lock, audit_record
from incidents.models import GateRun, Remediation, Step
from incidents.remediation import gate
from incidents.remediation.gate_k8s import lift_fleetwatch_cordon
from incidents.remediation.gate_plan import gate_plan, gate_poll
from incidents.remediation.policy import step_mode
from incidents.retry import retry_transient
from incidents.status import InvalidTransition

log = logging.getLogger(__name__)
WEEK = timedelta(days=7)


def node_pool(cluster_id: int, node: str) -> str:
    return Node.objects.filter(cluster_id=cluster_id, name=node).values_list(
        "pool", flat=True).first() or ""


def gate_failures(cluster_id: int, node: str) -> int:
    """The node's failed gates in the last week (the RMA count)."""
    return GateRun.objects.filter(cluster_id=cluster_id, node=node,
                                  status=GateRun.Status.FAILED,
                                  created_at__gte=timezone.now() - WEEK).count()


_STATUS = {gate.RUNNING: GateRun.Status.RUNNING, gate.PASSED: GateRun.Status.PASSED,
           gate.FAILED: GateRun.Status.FAILED, gate.CANNOT_RUN: GateRun.Status.CANNOT_RUN,
           gate.UNCHECKED: GateRun.Status.UNCHECKED}


@retry_transient
def gate_record_for_step(step_id: int, node: str, state: dict[str, Any]) -> None:
    """Keep a playbook gate's run (its state as the step left it) for the node's page and the
    RMA count; the verdict is audited once, when it first appears."""
    key = str(state.get("key") or "")
    if not key:
        return
    status = _STATUS.get(str(state.get("status")), GateRun.Status.RUNNING)
    with transaction.atomic():
        audit_lock()
        step = Step.objects.select_related("remediation__incident").get(pk=step_id)
        rem = step.remediation
        run, _ = GateRun.objects.select_for_update().get_or_create(
            key=key, defaults={"cluster_id": rem.incident.cluster_id, "node": node,
                               "repair": str(state.get("repair", "")), "remediation": rem,
                               "step": step, "mode": step.mode,
                               "requested_by": rem.requested_by,
                               "reason": f"incident {rem.incident_id}: {rem.playbook}"})
        before = run.status
        run.status, run.detail = status, str(state.get("detail", ""))[:4000]
        run.checks = list(state.get("checks") or [])
        run.state = {k: v for k, v in state.items() if k not in ("status", "detail", "checks")}
        if status in GateRun.FINAL and run.finished_at is None:
            run.finished_at = timezone.now()
        run.save()
        if status != before and status in GateRun.FINAL:
            _audit_verdict(run, remediation=rem, step=step)


def _audit_verdict(run: GateRun, **where: Any) -> None:
    """One audit entry per verdict, with each check's result and the end of its output."""
    results = [{k: r.get(k) for k in ("check", "job_id", "verdict", "state", "exit_code",
                                      "summary", "output_path", "output")}
               for r in run.results]
    audit_record(f"gate.{run.status}", run.node, ok=run.status in (
        GateRun.Status.PASSED, GateRun.Status.UNCHECKED), result=run.detail,
        data={"gate": run.key, "repair": run.repair, "checks": run.checks,
              "reservation": (run.state or {}).get("reservation", ""), "results": results},
        **where)


# --- gates outside a playbook -----------------------------------------------------------------


def node_gate_start(node: str, reason: str, *, cluster: str | None = None,
                    repair: str = Repair.MANUAL, requested_by: str = SYSTEM) -> int:
    """Gate ``node`` (a machine name) before it goes back to Slurm service; the GateRun's id.

    Idempotent per node: while a gate of this node is live (running or awaiting approval), its
    id is returned and no second one starts. ``repair`` (collectors.knowledge.acceptance.Repair)
    chooses the checks with the node's pool (FLEETWATCH_GATE_CHECKS). The gate's mode is the
    ``return_to_service`` risk class's (FLEETWATCH_STEP_MODES, else FLEETWATCH_POLICY_MODE)."""
    if repair not in tuple(Repair):
        raise ValueError(f"no repair {repair!r} (one of {', '.join(Repair)})")
    with transaction.atomic():
        audit_lock()
        target = Cluster.objects.get(name=cluster or settings.FLEETWATCH_CLUSTER)
        # Serialized per cluster: two callers at once start one gate.
        Cluster.objects.select_for_update().filter(pk=target.pk).first()
        live = GateRun.objects.filter(cluster=target, node=node, status__in=[
            GateRun.Status.RUNNING, GateRun.Status.AWAITING_APPROVAL]).first()
        if live is not None:
            return live.pk
        mode = step_mode(Risk.RETURN_TO_SERVICE, settings.FLEETWATCH_POLICY_MODE)
        status = (GateRun.Status.AWAITING_APPROVAL if mode == Remediation.Mode.APPROVE
                  else GateRun.Status.OBSERVED if mode == Remediation.Mode.OBSERVE
                  else GateRun.Status.RUNNING)
        run = GateRun.objects.create(cluster=target, node=node, key=f"pending-{time.time_ns()}",
                                     repair=str(repair), reason=reason, mode=mode,
                                     status=status, requested_by=requested_by)
        run.key = f"g{run.pk}"
        names, entry = selection_for(settings.FLEETWATCH_GATE_CHECKS, node_pool(target.pk, node),
                                     str(repair))
        run.checks = list(names)
        if status == GateRun.Status.OBSERVED:
            run.detail = (f"observe mode (FLEETWATCH_STEP_MODES return_to_service): FleetWatch "
                          f"would run {', '.join(names) or 'no check'} on {node} "
                          f"({entry or 'nothing configured'}) before resuming it, and did nothing")
            run.finished_at = timezone.now()
        elif status == GateRun.Status.AWAITING_APPROVAL:
            run.detail = (f"waits for a person's approval (FLEETWATCH_STEP_MODES "
                          f"return_to_service=approve) to run {', '.join(names) or 'no check'}")
        run.save()
        audit_record("gate.requested", node, actor=requested_by, result=reason,
                     data={"gate": run.key, "repair": str(repair), "mode": mode,
                           "checks": list(names)})
        if status == GateRun.Status.RUNNING:
            _gate_enqueue(run, 0)
        return run.pk


def _gate_enqueue(run: GateRun, countdown: float) -> None:
    GateRun.objects.filter(pk=run.pk).update(
        next_check_at=timezone.now() + timedelta(seconds=countdown))
    queueing.enqueue(queueing.GATE_ADVANCE, run.pk, countdown=countdown)


@retry_transient
def gate_approve(gate_id: int, actor: str) -> GateRun:
    """A person lets a gate waiting in approve mode run."""
    with transaction.atomic():
        audit_lock()
        run = GateRun.objects.select_for_update().get(pk=gate_id)
        if run.status != GateRun.Status.AWAITING_APPROVAL:
            raise InvalidTransition(f"gate {run.key} is {run.get_status_display()}; nothing to "
                                    "approve")
        run.status, run.detail = GateRun.Status.RUNNING, f"approved by {actor}"
        run.save()
        audit_record("gate.approved", run.node, actor=actor, data={"gate": run.key})
        _gate_enqueue(run, 0)
        return run


@retry_transient
def gate_cancel(gate_id: int, actor: str) -> GateRun:
    """Stop polling a gate. What it did stays (a node it held stays held: its reservation and
    drain are FleetWatch's, named after it, for a person to lift or a new gate to adopt)."""
    with transaction.atomic():
        audit_lock()
        run = GateRun.objects.select_for_update().get(pk=gate_id)
        if run.status not in (GateRun.Status.RUNNING, GateRun.Status.AWAITING_APPROVAL):
            raise InvalidTransition(f"gate {run.key} is {run.get_status_display()}; nothing to "
                                    "cancel")
        run.status, run.finished_at = GateRun.Status.CANCELLED, timezone.now()
        run.detail = f"cancelled by {actor}; {gate.held_words(run.state or {}, run.node)}"
        run.save()
        audit_record("gate.cancelled", run.node, actor=actor, result=run.detail,
                     data={"gate": run.key})
        return run


@retry_transient
def _gate_take(gate_id: int) -> GateRun | None:
    with transaction.atomic():
        run = GateRun.objects.select_for_update().select_related("cluster").get(pk=gate_id)
        now = timezone.now()
        if run.status != GateRun.Status.RUNNING or (run.lease_until and run.lease_until > now):
            return None
        run.lease_until = now + timedelta(seconds=settings.FLEETWATCH_STEP_LEASE_SECONDS)
        run.save(update_fields=["lease_until"])
        return run


def gate_advance(gate_id: int) -> str:
    """One poll of a gate started by ``node_gate_start`` (the GATE_ADVANCE task): safe to run
    any number of times (leased; the gate checks Slurm before acting)."""
    run = _gate_take(gate_id)
    if run is None:
        return "not running, or another worker has it"
    clients = get_clients(run.cluster.name)
    state = dict(run.state or {})
    done = set(run.done_calls or [])

    def call(verb: str, target: str, fn: Any, *args: Any) -> ActionResult:
        key = f"{verb} {target}"
        if key in done:
            return ActionResult(f"({key}: done before a restart)", False,
                                "done by an earlier poll of this gate")
        started = time.monotonic()
        try:
            result: ActionResult = fn(*args)
        except Exception as exc:
            _audit_call(run, verb, target, None, str(exc), time.monotonic() - started)
            raise
        _audit_call(run, verb, target, result, None, time.monotonic() - started)
        done.add(key)
        GateRun.objects.filter(pk=run.pk).update(done_calls=sorted(done))
        return result

    try:
        plan = gate_plan(run.node, run.repair, run.key, node_pool(run.cluster_id, run.node),
                         clients, known_model=str(state.get("gpu_model") or ""))
        state["gpu_model"] = plan.gpu_model
        progress = gate_poll(clients, plan, state, call, time.time())
        if progress.status == gate.UNCHECKED and not state.get("resumed_unchecked"):
            # No check configured for it: the gate is how it goes back, so it resumes it (in
            # Kubernetes: lifts FleetWatch's cordon), and the verdict says it went unchecked.
            if plan.scheduler == gate.KUBERNETES:
                lift_fleetwatch_cordon(clients.kubernetes, run.node, call,
                                       f"{run.node} (unchecked)")
            else:
                call("slurm.resume", f"{run.node} (unchecked)", clients.slurm.resume, run.node)
            state["resumed_unchecked"] = True
    except ClientError as exc:  # refused before the gate could hold the node (a bad plan)
        progress = gate.Progress(gate.CANNOT_RUN, str(exc))
    except Exception as exc:  # a bug must not leave the gate leased and silent
        log.exception("gate %s crashed", run.key)
        progress = gate.Progress(gate.CANNOT_RUN, f"{type(exc).__name__}: {exc}")
    return _gate_save(run.pk, state, progress)


@retry_transient
def _gate_save(gate_id: int, state: dict[str, Any], progress: gate.Progress) -> str:
    with transaction.atomic():
        audit_lock()
        run = GateRun.objects.select_for_update().get(pk=gate_id)
        run.lease_until = None
        if run.status != GateRun.Status.RUNNING:  # cancelled meanwhile
            run.save(update_fields=["lease_until"])
            return f"gate {run.status} meanwhile"
        run.state, run.detail = state, progress.detail[:4000]
        run.status = _STATUS[progress.status]
        if progress.final:
            # A gate that could not clean up (Slurm down) is final too: the node stays held
            # and the detail says so; a new gate adopts what it left.
            run.finished_at = timezone.now()
        run.save()
        if not progress.final:
            _gate_enqueue(run, settings.FLEETWATCH_STEP_POLL_SECONDS)
            return "waiting"
        _audit_verdict(run)
        if run.status == GateRun.Status.FAILED:
            failures = gate_failures(run.cluster_id, run.node)
            if failures >= settings.FLEETWATCH_GATE_RMA_AFTER:
                Node.objects.filter(cluster_id=run.cluster_id, name=run.node).update(pool="rma")
                audit_record("node.rma", run.node, result=(
                    f"failed its acceptance checks {failures} times this week "
                    f"(FLEETWATCH_GATE_RMA_AFTER={settings.FLEETWATCH_GATE_RMA_AFTER})"),
                    data={"gate": run.key})
        return str(run.status)


def _audit_call(run: GateRun, verb: str, target: str, result: ActionResult | None,
                error: str | None, seconds: float) -> None:
    retry_transient(audit_record)(
        verb, target, ok=error is None, call=result.call if result else "",
        result=error or (result.detail if result else ""),
        data={"gate": run.key, **({"changed": result.changed, **result.data} if result else {})},
        duration_ms=seconds * 1000)


def gates_rescue() -> list[int]:
    """Queue again the polls of running gates whose message was lost (as steps_rescue)."""
    now = timezone.now()
    overdue = queueing.lost_before(now)
    stuck = list(GateRun.objects.filter(status=GateRun.Status.RUNNING, step__isnull=True,
                                        next_check_at__lt=overdue)
                 .filter(Q(lease_until=None) | Q(lease_until__lt=now))
                 .values_list("pk", flat=True))
    for gate_id in stuck:
        with transaction.atomic():
            _gate_enqueue(GateRun.objects.get(pk=gate_id), 0)
    return stuck
