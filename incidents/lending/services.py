"""Lending's services: lend a node, approve, decline, return, retry; the runner that takes a
loan through its steps; the beat's tick (the automatic policy) and the capacity snapshots.

Locks as everywhere (incidents/audit.py, "Lock order"): a transaction that changes a loan
takes the audit lock first, then the policy lock (so a lend and a remediation of the same
node, or two lends that together pass a floor, decide one after the other), then the loan's
row. The runner makes its outside calls outside any transaction, holding the loan's lease,
as the remediation engine does with a step.

Everything a loan does is in the audit trail: who asked (a person, a token, or the system
with the decision's reasons), every outside call once, and each turn (lent, returned,
stopped), each entry naming the loan in ``data.loan``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from collectors import queueing
from collectors.clients import get_clients
from collectors.clients.base import ActionResult, ClientError
from collectors.clock import SYSTEM_CLOCK, Clock
from collectors.knowledge.acceptance import Repair
from collectors.models import Cluster, Node
from collectors.roles import SYSTEM
from collectors.services import cluster_get
from collectors.sources import cluster_names
from incidents import gates
from incidents.audit import audit_lock, audit_record
from incidents.lending import decide, selectors
from incidents.lending.steps import (
    EXECUTORS,
    FIRST_LEND_STEP,
    FIRST_RETURN_STEP,
    GateAnswer,
    GiveBack,
    LoanContext,
    Marks,
    Outcome,
    Stop,
    next_step,
)
from incidents.models import CapacitySnapshot, GateRun, LendingState, Loan, Remediation
from incidents.remediation import policy
from incidents.remediation.steps import Done, Wait
from incidents.retry import retry_transient
from incidents.status import InvalidTransition

log = logging.getLogger(__name__)


class LendRefused(InvalidTransition):
    """A lend FleetWatch will not make (someone else's drain or cordon, the floor, the
    ceiling, a node in repair): the reason is the message."""


def _audit(verb: str, loan: Loan, *, actor: str = SYSTEM, result: str = "", call: str = "",
           ok: bool = True, data: dict[str, Any] | None = None,
           duration_ms: float | None = None) -> None:
    audit_record(verb, loan.node, actor=actor, call=call, ok=ok, result=result,
                 duration_ms=duration_ms, data={"loan": loan.pk, "pool": loan.pool,
                                                **(data or {})})


def loan_enqueue(loan_id: int, reason: str = "start", countdown: float = 0) -> None:
    """Queue a run of the loan's steps once the caller's transaction commits."""
    Loan.objects.filter(pk=loan_id).update(
        next_check_at=timezone.now() + timedelta(seconds=countdown))
    queueing.enqueue(queueing.LOAN_RUN, loan_id, reason, countdown=countdown)


def cluster_named(name: str | Cluster | None) -> Cluster:
    """The cluster (None or "": the default one); an unknown name is a ClientError."""
    if isinstance(name, Cluster):
        return name
    return cluster_get(name or settings.FLEETWATCH_CLUSTER)


def cluster_to_read(name: str | None) -> Cluster:
    """The cluster a page or a read of the API shows (None or "": the default one), without
    making its row: one not collected yet reads as empty (its stand-in, never saved, has an
    id no row has). An unknown name is a ClientError."""
    name = name or settings.FLEETWATCH_CLUSTER
    if name not in cluster_names():
        return cluster_get(name)  # raises, naming the clusters there are
    return Cluster.objects.filter(name=name).first() or Cluster(pk=0, name=name)


# --- a person's (or the policy's) actions ------------------------------------------------------


def _lend_refusal(cluster: Cluster, node: str, uses: list[selectors.NodeUse], *,
                  approving: int | None = None) -> str:
    """Why ``node`` may not be lent now, or "". ``approving``: the loan proposed for it,
    which the pool's figures already count as on its way out."""
    use = next((u for u in uses if u.name == node), None)
    if use is None:
        return f"{node} is not a node of cluster {cluster.name} in service"
    if use.loan is not None and use.loan != approving:
        return f"{node} is already in loan {use.loan} ({use.loan_status})"
    counted = approving is not None and use.loan == approving
    if not counted and use.use not in (decide.TRAINING_IDLE, decide.TRAINING_BUSY):
        return f"{node} is not training capacity FleetWatch may lend: {use.blocked or use.use}"
    if use.blocked:
        return f"{node} may not be lent: {use.blocked}"
    rules = selectors.policy_from_settings()
    figures = {f.pool: f for f in decide.pool_figures(selectors.decision_views(uses), rules)}
    fig = figures[use.pool]
    training, lent = (fig.training, fig.lent) if counted else (fig.training - 1, fig.lent + 1)
    if training < fig.floor:
        return (f"pool {use.pool or '-'} would keep {training} training node(s), below its "
                f"floor of {fig.floor} (FLEETWATCH_LEND_FLOOR)")
    if lent > fig.ceiling:
        return (f"pool {use.pool or '-'} would lend {lent} node(s), more than its ceiling of "
                f"{fig.ceiling} (FLEETWATCH_LEND_CEILING)")
    return ""


def _automatic_hold(cluster: Cluster) -> str:
    """Why an automatic lend waits for a person although its mode is auto: the remediation
    rails that would hold a repair (the storm brake, the fleet budget, counting the nodes in
    repair and those on their way in or out of a loan)."""
    storms = {cause: n for cause, n in policy.storm_by_cause(cluster.pk).items()
              if policy.storm_brake_on(n)}
    if storms:
        return (f"storm brake on ({', '.join(f'{n} {c}' for c, n in sorted(storms.items()))} "
                f"incidents in {settings.FLEETWATCH_STORM_MINUTES} min): automatic lending "
                "waits for a person")
    moving = Loan.objects.filter(cluster=cluster, status__in=Loan.RUNNING).count()
    busy = len(policy.nodes_in_remediation(cluster.pk)) + moving + 1
    if busy > settings.FLEETWATCH_BUDGET_MAX_NODES:
        return (f"fleet budget: {busy} nodes would be in repair or moving between training "
                f"and inference at once, more than {settings.FLEETWATCH_BUDGET_MAX_NODES} "
                "(FLEETWATCH_BUDGET_MAX_NODES)")
    return ""


@retry_transient
def loan_lend(cluster: str | Cluster | None, node: str, *, actor: str, reason: str = "",
              automatic: bool = False, mode: str = Remediation.Mode.AUTO) -> Loan:
    """Lend ``node`` to inference: a person's click (``mode`` auto: it starts now) or the
    policy's decision (``automatic``, in its pool's mode: approve waits for a person). Raises
    LendRefused with the reason when it may not be lent."""
    cluster = cluster_named(cluster)
    with transaction.atomic():
        policy.decisions_serialized()
        uses = selectors.node_uses(cluster)
        refusal = _lend_refusal(cluster, node, uses)
        if refusal:
            raise LendRefused(refusal)
        pool = next(u.pool for u in uses if u.name == node)
        hold = _automatic_hold(cluster) if automatic else ""
        waits = mode == Remediation.Mode.APPROVE or bool(hold)
        now = timezone.now()
        loan = Loan.objects.create(
            cluster=cluster, node=node, pool=pool, mode=mode, automatic=automatic,
            requested_by=actor, reason=reason or "lent by hand", hold_reason=hold,
            status=Loan.Status.PROPOSED if waits else Loan.Status.LENDING,
            step=FIRST_LEND_STEP, created_at=now,
            detail=hold or ("waiting for a person's approval" if waits else "starting"))
        _audit("loan.proposed" if waits else "loan.started", loan, actor=actor,
               result=f"lend {node} to inference: {loan.reason}" + (f"; held: {hold}"
                                                                   if hold else ""),
               data={"automatic": automatic, "mode": mode})
        if not waits:
            _loan_start(loan)
    return loan


def _loan_start(loan: Loan) -> None:
    """The lend's steps begin now (deadline from now); called in the caller's transaction."""
    now = timezone.now()
    loan.status, loan.step, loan.started_at = Loan.Status.LENDING, FIRST_LEND_STEP, now
    loan.deadline = now + timedelta(minutes=settings.FLEETWATCH_LEND_DRAIN_DEADLINE_MINUTES)
    loan.save()
    loan_enqueue(loan.pk)


def _locked(loan_id: int) -> Loan:
    audit_lock()  # before any row lock: see incidents/audit.py
    return Loan.objects.select_for_update().get(pk=loan_id)


@retry_transient
def loan_approve(loan_id: int, *, actor: str) -> Loan:
    """A person says yes to what the policy proposed: the lend, or the return."""
    with transaction.atomic():
        policy.decisions_serialized()
        loan = _locked(loan_id)
        if loan.status == Loan.Status.PROPOSED:
            # Checked again: the floor or the node may have changed since it was proposed.
            refusal = _lend_refusal(loan.cluster, loan.node,
                                    selectors.node_uses(loan.cluster), approving=loan.pk)
            if refusal:
                raise LendRefused(refusal)
            loan.approved_by = actor
            _audit("loan.approved", loan, actor=actor, result=f"lend {loan.node}")
            _loan_start(loan)
            return loan
        if loan.status == Loan.Status.RETURN_PROPOSED:
            loan.approved_by = actor
            _audit("loan.approved", loan, actor=actor, result=f"return {loan.node}")
            _return_start(loan)
            return loan
    raise InvalidTransition(f"loan {loan.pk} is {loan.get_status_display()}: nothing waits "
                            "for approval")


@retry_transient
def loan_decline(loan_id: int, *, actor: str) -> Loan:
    """A person says no: a proposed lend is cancelled; a proposed return leaves it lent."""
    with transaction.atomic():
        loan = _locked(loan_id)
        if loan.status == Loan.Status.PROPOSED:
            loan.status, loan.finished_at = Loan.Status.CANCELLED, timezone.now()
            loan.detail = f"declined by {actor}"
        elif loan.status == Loan.Status.RETURN_PROPOSED:
            loan.status, loan.detail = Loan.Status.LENT, f"return declined by {actor}"
        else:
            raise InvalidTransition(f"loan {loan.pk} is {loan.get_status_display()}: nothing "
                                    "to decline")
        loan.save()
        _audit("loan.declined", loan, actor=actor, result=loan.detail)
    return loan


@retry_transient
def loan_return(loan_id: int, *, actor: str, reason: str = "", automatic: bool = False,
                mode: str = Remediation.Mode.AUTO) -> Loan:
    """Bring the node back to training: from lent, from half-way out (the lend stops where it
    is and the return undoes what it did), or from a loan stopped for a person. A lend only
    proposed is simply cancelled. ``mode`` approve: the return waits for a person."""
    with transaction.atomic():
        loan = _locked(loan_id)
        if loan.status == Loan.Status.PROPOSED:
            loan.status, loan.finished_at = Loan.Status.CANCELLED, timezone.now()
            loan.detail = f"withdrawn: {reason or 'returned before it was lent'}"
            loan.save()
            _audit("loan.withdrawn", loan, actor=actor, result=loan.detail)
            return loan
        if loan.status not in (Loan.Status.LENT, Loan.Status.LENDING, Loan.Status.FAILED,
                               Loan.Status.RETURN_PROPOSED):
            raise InvalidTransition(f"loan {loan.pk} is {loan.get_status_display()}: nothing "
                                    "to return")
        loan.return_requested_by, loan.return_automatic = actor, automatic
        loan.return_reason = reason or "returned by hand"
        loan.return_requested_at = timezone.now()
        if mode == Remediation.Mode.APPROVE and loan.status == Loan.Status.LENT:
            loan.status, loan.detail = Loan.Status.RETURN_PROPOSED, (
                f"waiting for a person's approval to return: {loan.return_reason}")
            loan.save()
            _audit("loan.return_proposed", loan, actor=actor, result=loan.return_reason)
            return loan
        _audit("loan.returning", loan, actor=actor, result=loan.return_reason,
               data={"automatic": automatic, "from": loan.status})
        _return_start(loan)
    return loan


def _return_start(loan: Loan) -> None:
    loan.status, loan.step, loan.attempts = Loan.Status.RETURNING, FIRST_RETURN_STEP, 0
    loan.error, loan.detail = "", "returning"
    loan.save()
    loan_enqueue(loan.pk)


@retry_transient
def loan_retry(loan_id: int, *, actor: str) -> Loan:
    """Run the step a loan stopped at again, once a person has seen to what stopped it."""
    with transaction.atomic():
        loan = _locked(loan_id)
        if loan.status != Loan.Status.FAILED:
            raise InvalidTransition(f"loan {loan.pk} is {loan.get_status_display()}: only a "
                                    "stopped loan is retried")
        loan.status = Loan.Status.RETURNING if loan.direction == "return" else Loan.Status.LENDING
        loan.attempts, loan.error = 0, ""
        loan.save()
        _audit("loan.retried", loan, actor=actor, result=f"step {loan.step} again")
        loan_enqueue(loan.pk)
    return loan


@retry_transient
def loan_handover(loan_id: int, remediation: Remediation) -> None:
    """A lent node went into repair: its playbook owns the node now (it cordons, evicts,
    replaces or resumes it). The return only takes the inference labels off, so the node
    comes back from its repair as a training node."""
    with transaction.atomic():
        loan = _locked(loan_id)
        if loan.status not in (Loan.Status.LENT, Loan.Status.LENDING,
                               Loan.Status.RETURN_PROPOSED) or loan.state.get("handover"):
            return
        loan.state = {**loan.state, "handover": remediation.pk}
        loan.return_requested_by = SYSTEM
        loan.return_reason = (f"{loan.node} is in repair (remediation {remediation.pk}, "
                              f"incident {remediation.incident_id}): handed to its playbook")
        loan.return_requested_at, loan.return_automatic = timezone.now(), True
        _audit("loan.handed_over", loan, result=loan.return_reason,
               data={"remediation": remediation.pk})
        _return_start(loan)


# --- the runner ------------------------------------------------------------------------------

# How long one run keeps going from step to step before it queues itself again (a third of
# the task's soft time limit: the step under way still has room to finish).
def _run_budget() -> float:
    return settings.CELERY_TASK_SOFT_TIME_LIMIT / 3


def loan_run(loan_id: int, reason: str = "start", clock: Clock = SYSTEM_CLOCK) -> str:
    """Run the loan's steps from where it stands, until one waits or it ends. Safe to call any
    number of times: leased, and every executor checks the outside state first."""
    started = time.monotonic()
    said = ""
    while True:
        taken = _loan_take(loan_id)
        if isinstance(taken, str):
            return said or taken
        loan = taken
        step = loan.step
        ctx = _loan_context(loan, clock)
        try:
            outcome: Outcome | ClientError | _DatabaseFault = EXECUTORS[step](ctx)
        except ClientError as exc:
            outcome = exc
        except SoftTimeLimitExceeded:
            outcome = ClientError("the step ran past the task time limit; retrying")
        except (OperationalError, InterfaceError) as exc:
            connection.close_if_unusable_or_obsolete()
            outcome = _DatabaseFault(str(exc).splitlines()[0] if str(exc) else repr(exc))
        except Exception as exc:  # a bug in an executor must not leave the loan leased
            log.exception("loan %s step %s crashed", loan_id, step)
            outcome = ClientError(f"{type(exc).__name__}: {exc}", permanent=True)
        said, again = _loan_finish(loan_id, step, outcome, ctx.state)
        if not again:
            return said
        if time.monotonic() - started > _run_budget():
            with transaction.atomic():
                loan_enqueue(loan_id, "continue")
            return f"{said}; continuing in a new run"


class _DatabaseFault(Exception):
    pass


@retry_transient
def _loan_take(loan_id: int) -> Loan | str:
    now = timezone.now()
    with transaction.atomic():
        loan = _locked(loan_id)
        if loan.status not in Loan.RUNNING:
            return f"loan is {loan.status}"
        if loan.lease_until and loan.lease_until > now:
            return "loan is being run by another worker"
        loan.lease_until = now + timedelta(seconds=settings.FLEETWATCH_STEP_LEASE_SECONDS)
        loan.save(update_fields=["lease_until"])
    return loan


def _marks(loan: Loan) -> Marks:
    """The labels and taints this loan applies: the ones it recorded at its lend (a setting
    changed meanwhile must not leave its own marks behind on return), else the settings'."""
    used = loan.state.get("marks")
    if isinstance(used, dict):
        return Marks(dict(used.get("labels") or {}), list(used.get("remove_labels") or []),
                     [(str(k), str(v), str(e)) for k, v, e in used.get("taints") or []],
                     list(used.get("remove_taints") or []))
    return Marks(dict(settings.FLEETWATCH_LEND_LABELS), list(settings.FLEETWATCH_LEND_REMOVE_LABELS),
                 list(settings.FLEETWATCH_LEND_TAINTS), list(settings.FLEETWATCH_LEND_REMOVE_TAINTS))


def _gate_before_resume(loan: Loan, state: dict[str, Any]
                        ) -> Callable[[str], GateAnswer] | None:
    """The return-to-service gate (incidents.gates), run on a node coming back from inference
    before Slurm gets it (FLEETWATCH_LEND_GATE). Off: None (no gate). The gate's id is kept in
    the loan's state (saved with the step's outcome), so a step run again after a worker's
    death follows the same gate; a gate that has ended is not started again."""
    if not settings.FLEETWATCH_LEND_GATE:
        return None

    def gate(node: str) -> GateAnswer:
        gate_id = state.get("gate_id")
        if gate_id is None:
            gate_id = gates.node_gate_start(
                node, f"back from inference (loan {loan.pk})", cluster=loan.cluster.name,
                repair=Repair.LEND, requested_by=SYSTEM)
            state["gate_id"] = gate_id
        run = GateRun.objects.get(pk=gate_id)
        said = run.detail or run.get_status_display()
        if run.status == GateRun.Status.PASSED or run.status == GateRun.Status.UNCHECKED:
            return GateAnswer(True, f"return-to-service gate {run.key}: {said}")
        if run.status in (GateRun.Status.RUNNING, GateRun.Status.AWAITING_APPROVAL):
            return GateAnswer(None, f"gate {run.key} {run.get_status_display()}: {said}")
        # Failed, could not run, cancelled, or observe mode (which checks nothing): the node
        # is not put back unchecked; a person looks.
        return GateAnswer(False, f"gate {run.key} {run.get_status_display()}: {said}")

    return gate


def _loan_context(loan: Loan, clock: Clock) -> LoanContext:
    marks = _marks(loan)
    state = dict(loan.state)
    state.setdefault("marks", {"labels": dict(marks.labels),
                               "remove_labels": list(marks.remove_labels),
                               "taints": [list(t) for t in marks.taints],
                               "remove_taints": list(marks.remove_taints)})

    @retry_transient
    def audit(verb: str, target: str, result: ActionResult | None, error: str | None,
              duration_ms: float | None = None) -> None:
        _audit(verb, loan, ok=error is None, call=result.call if result else "",
               result=error or (result.detail if result else ""), duration_ms=duration_ms,
               data={"step": loan.step, **({"changed": result.changed, **result.data}
                                          if result else {})})

    return LoanContext(
        loan_id=loan.pk, node=loan.node, clients=get_clients(loan.cluster.name), state=state,
        audit=audit, marks=marks,
        deadline=loan.deadline.timestamp() if loan.deadline else None,
        gate=_gate_before_resume(loan, state),
        evict_retry_seconds=settings.FLEETWATCH_LEND_EVICT_RETRY_SECONDS,
        done_calls=set(loan.done_calls), on_call_done=lambda key: _call_done(loan.pk, key),
        clock=clock)


@retry_transient
def _call_done(loan_id: int, key: str) -> None:
    """Saved at once (autocommit), so a run after a crash skips the call."""
    done = list(Loan.objects.filter(pk=loan_id).values_list("done_calls", flat=True).first()
                or [])
    Loan.objects.filter(pk=loan_id).update(done_calls=[*done, key])


@retry_transient
def _loan_finish(loan_id: int, step: str, outcome: Outcome | ClientError | _DatabaseFault,
                 state: dict[str, Any]) -> tuple[str, bool]:
    """Apply one step's outcome; (what happened, whether to run the next step now)."""
    now = timezone.now()
    with transaction.atomic():
        loan = _locked(loan_id)
        loan.lease_until = None
        # What the step found and did is kept whatever happens next: the return reads it.
        loan.state = {**loan.state, **{k: v for k, v in state.items()
                                       if k != "handover" or "handover" not in loan.state}}
        if loan.status not in Loan.RUNNING or loan.step != step:
            # A person (or the policy) turned the loan meanwhile: its new course runs.
            loan.save()
            if loan.status in Loan.RUNNING:
                loan_enqueue(loan.pk, "turned")
            return f"loan turned to {loan.status} meanwhile", False
        if isinstance(outcome, _DatabaseFault):
            loan.detail = f"database error, running again: {outcome}"
            loan.save()
            loan_enqueue(loan.pk, "recheck", 5.0)
            return "database error; queued again", False
        if isinstance(outcome, ClientError):
            loan.attempts += 1
            loan.error = str(outcome)
            if outcome.permanent or loan.attempts >= settings.FLEETWATCH_STEP_MAX_ATTEMPTS:
                return _loan_stop(loan, f"{step}: {outcome}"), False
            loan.detail = f"attempt {loan.attempts} failed, retrying: {outcome}"
            loan.save()
            loan_enqueue(loan.pk, "retry", min(60.0, 2.0 ** loan.attempts))
            return "retrying", False
        loan.attempts = 0
        if isinstance(outcome, Wait):
            loan.detail = outcome.detail
            loan.save()
            loan_enqueue(loan.pk, "poll", settings.FLEETWATCH_STEP_POLL_SECONDS)
            return "waiting", False
        if isinstance(outcome, Stop):
            if outcome.untouched:
                loan.status, loan.finished_at, loan.step = Loan.Status.CANCELLED, now, ""
                loan.detail = f"refused: {outcome.reason}"
                loan.save()
                _audit("loan.refused", loan, ok=False, result=outcome.reason)
                return "refused", False
            return _loan_stop(loan, outcome.reason), False
        if isinstance(outcome, GiveBack):
            loan.return_reason, loan.return_requested_at = outcome.reason, now
            loan.return_requested_by, loan.return_automatic = SYSTEM, True
            _audit("loan.given_back", loan, result=outcome.reason)
            _return_start(loan)
            return "lend given up; returning", False
        assert isinstance(outcome, Done)
        loan.detail = outcome.detail
        following = next_step(step)
        if following is not None:
            loan.step = following
            loan.save()
            return f"{step} done", True
        loan.step = ""
        if loan.status == Loan.Status.LENDING:
            loan.status, loan.lent_at = Loan.Status.LENT, now
            loan.detail = f"{loan.node} serves inference"
            loan.save()
            _audit("loan.lent", loan, result=loan.detail)
            return "lent", False
        loan.status, loan.returned_at, loan.finished_at = Loan.Status.RETURNED, now, now
        handover = loan.state.get("handover")
        loan.detail = (f"handed to remediation {handover}" if handover
                       else f"{loan.node} back in training")
        loan.save()
        _audit("loan.returned", loan, result=loan.detail)
        return "returned", False


def _loan_stop(loan: Loan, reason: str) -> str:
    loan.status, loan.detail, loan.error = Loan.Status.FAILED, reason, reason
    loan.save()
    _audit("loan.stopped", loan, ok=False, result=reason)
    return "stopped for a person"


def loans_rescue() -> list[int]:
    """Queue again the loans whose message was lost (a killed worker, a restarted broker):
    running, due a while ago, nobody holding their lease."""
    now = timezone.now()
    overdue = queueing.lost_before(now)
    stuck = list(Loan.objects.filter(status__in=Loan.RUNNING).filter(
        Q(next_check_at__lt=overdue) | Q(next_check_at=None)).filter(
        Q(lease_until=None) | Q(lease_until__lt=now)).values_list("pk", flat=True))
    for loan_id in stuck:
        with transaction.atomic():
            loan_enqueue(loan_id, "watchdog")
    if stuck:
        log.warning("watchdog: re-queued loan(s) %s", stuck)
    return stuck


# --- the automatic policy: the beat's tick ------------------------------------------------------


def lending_tick(cluster: str | Cluster | None = None, now: float | None = None,
                 ) -> decide.Decision:
    """Decide for one cluster (demand and idle history from the database, the rules from
    the settings) and act on it in each pool's mode; repairs take over lent nodes."""
    cluster = cluster_named(cluster)
    now = time.time() if now is None else now
    uses = selectors.node_uses(cluster)
    demand = selectors.pending_demand(cluster)
    state, _ = LendingState.objects.get_or_create(cluster=cluster)
    memory = decide.Memory.from_json(state.memory)
    decision = decide.decide(selectors.decision_views(uses), demand.gpus if demand.known
                             else None, memory, selectors.policy_from_settings(), now)
    _handovers(cluster)
    observed_before = set((state.last_decision or {}).get("observed") or [])
    observed: list[str] = []
    live = {u.name: u.loan for u in uses if u.loan is not None}
    for move in decision.bring_back:
        loan_id = live.get(move.node)
        mode = selectors.pool_mode(move.pool)
        if loan_id is None:
            continue
        if mode == Remediation.Mode.OBSERVE:
            observed.append(f"return {move.node}")
            if f"return {move.node}" not in observed_before:
                audit_record("lending.observed", move.node, result=f"would return {move.node} "
                             f"to training: {move.why}", data={"pool": move.pool})
            continue
        try:
            loan_return(loan_id, actor=SYSTEM, reason=move.why, automatic=True, mode=mode)
        except InvalidTransition as exc:
            log.info("lending: not returning %s: %s", move.node, exc)
    for move in decision.lend:
        mode = selectors.pool_mode(move.pool)
        if mode == Remediation.Mode.OBSERVE:
            observed.append(f"lend {move.node}")
            if f"lend {move.node}" not in observed_before:
                audit_record("lending.observed", move.node, result=f"would lend {move.node} "
                             f"to inference: {move.why}", data={"pool": move.pool})
            continue
        try:
            loan_lend(cluster, move.node, actor=SYSTEM, reason=move.why, automatic=True,
                      mode=mode)
        except InvalidTransition as exc:
            log.info("lending: not lending %s: %s", move.node, exc)
    state.memory = decision.memory.to_json()
    state.last_decision = {**decision.to_json(), "observed": observed,
                           "demand": {"known": demand.known, "gpus": demand.gpus,
                                      "jobs": demand.jobs, "why_unknown": demand.why_unknown}}
    state.decided_at = timezone.now()
    state.save()
    return decision


def _handovers(cluster: Cluster) -> None:
    """Lent nodes now in a repair are its playbook's (see ``loan_handover``)."""
    busy = policy.nodes_in_remediation(cluster.pk)
    if not busy:
        return
    for loan in Loan.objects.filter(cluster=cluster, node__in=busy, status__in=[
            Loan.Status.LENT, Loan.Status.LENDING, Loan.Status.RETURN_PROPOSED]):
        holder = policy.remediation_holding(cluster.pk, [loan.node])
        if holder is not None:
            loan_handover(loan.pk, holder)


def lending_tick_all() -> None:
    """The beat's: every cluster's decision."""
    for name in cluster_names():
        try:
            lending_tick(name)
        except Exception:  # one cluster's trouble must not stop the others' decisions
            log.exception("lending tick of cluster %s failed", name)


# --- capacity snapshots --------------------------------------------------------------------------


def capacity_snapshot(cluster: str | Cluster | None = None,
                      at: datetime | None = None) -> list[CapacitySnapshot]:
    """One row per pool: GPUs by use, nodes lent, the cluster's pending demand. Old rows
    (FLEETWATCH_CAPACITY_RETENTION_DAYS) go."""
    cluster = cluster_named(cluster)
    at = at or timezone.now()
    counts = selectors.capacity_counts(selectors.node_uses(cluster),
                                       selectors.pending_demand(cluster))
    rows = CapacitySnapshot.objects.bulk_create(
        [CapacitySnapshot(cluster=cluster, pool=pool, at=at, counts=row)
         for pool, row in counts.items()])
    CapacitySnapshot.objects.filter(
        cluster=cluster,
        at__lt=at - timedelta(days=settings.FLEETWATCH_CAPACITY_RETENTION_DAYS)).delete()
    return rows


def capacity_snapshot_all() -> None:
    for name in cluster_names():
        if Cluster.objects.filter(name=name).exists() and Node.objects.filter(
                cluster__name=name).exists():
            capacity_snapshot(name)
