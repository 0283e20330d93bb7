"""A loan's steps: the only code of lending that changes the outside world.

Each executor looks at the node as it is now and acts only where it must, so a run after a
crash or a duplicate delivery does nothing twice; every outside call goes through
``LoanContext.call`` (``OutsideCalls``, as remediation steps do): audited once, recorded in
the loan's ``done_calls`` the moment it returns, and not made again by a later run. An
executor records what it found and did in ``ctx.state`` (saved with its outcome) and answers
``Done``, ``Wait`` (check again later), ``Stop`` (a person must look: someone else's drain or
cordon, a refusal) or ``GiveBack`` (the lend is abandoned: run the return).

Lend: check the node is FleetWatch's to lend and note how it was; drain it in Slurm with
FleetWatch's reason; wait for its jobs to end (or the deadline); label and taint it for
inference (and mark it ``fleetwatch.io/lent``); under Slinky, evict its slurmd pod (the
labels keep the operator from placing it again); uncordon it if FleetWatch had cordoned it.

Return: check nobody else took the node meanwhile; cordon it; evict the inference pods
through the Eviction API (a PodDisruptionBudget that says "not now" is waited for, and said);
put the labels, taints and cordon back as they were; under Slinky, wait for the operator's
slurmd pod; the return-to-service gate when configured; resume it in Slurm.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from collectors.clients import Clients
from collectors.clients.base import (
    K8S_CORDONED_BY,
    K8S_CORDONED_BY_FLEETWATCH,
    K8S_LENT,
    SLURM_REASON_PREFIX,
    ActionResult,
    ClientError,
    EvictionBlocked,
    K8sNode,
    K8sPod,
    SlurmNode,
    Taint,
    node_or_none,
    taint_named,
)
from collectors.clock import SYSTEM_CLOCK, Clock
from collectors.knowledge.slurm import SLINKY_POD_NAME_LABEL, SLURM_OPERATOR_REASON_PREFIX
from incidents.remediation.steps import Done, OutsideCalls, Wait

# The value of the cordon annotation FleetWatch's own cordons carry (collectors' clients).
CORDONED_BY_FLEETWATCH = K8S_CORDONED_BY_FLEETWATCH
# Job states that still hold the node.
JOB_ON_NODE = ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED")


@dataclass
class Stop:
    """A person must look: the loan stops where it is. ``untouched``: nothing of FleetWatch's
    was changed yet (the lend is refused rather than stuck)."""

    reason: str
    untouched: bool = False


@dataclass
class GiveBack:
    """The lend is given up (its jobs outlived the deadline): the return runs."""

    reason: str


Outcome = Done | Wait | Stop | GiveBack


@dataclass(frozen=True)
class Marks:
    """How the site makes a node schedulable for inference (FLEETWATCH_LEND_*)."""

    labels: Mapping[str, str] = field(default_factory=dict)  # set while lent
    remove_labels: Sequence[str] = ()  # removed while lent, put back on return
    taints: Sequence[Taint] = ()  # added while lent
    remove_taints: Sequence[str] = ()  # removed while lent ("key" or "key:Effect"), put back


@dataclass(frozen=True)
class GateAnswer:
    """The return-to-service gate's verdict: passed (True), failed (False) or still running
    (None), with what it says."""

    passed: bool | None
    detail: str


@dataclass
class LoanContext(OutsideCalls):
    loan_id: int
    node: str
    clients: Clients
    state: dict[str, Any]  # the loan's record, read and written by the steps
    audit: Callable[[str, str, ActionResult | None, str | None, float | None], None]
    marks: Marks = field(default_factory=Marks)
    deadline: float | None = None  # epoch seconds: a lend's jobs must be gone by then
    gate: Callable[[str], GateAnswer] | None = None  # None: no gate configured
    evict_retry_seconds: float = 30.0
    done_calls: set[str] = field(default_factory=set)
    on_call_done: Callable[[str], None] | None = None
    clock: Clock = SYSTEM_CLOCK

    @property
    def reason(self) -> str:
        """The Slurm drain reason and Kubernetes cordon reason of this loan."""
        return f"{SLURM_REASON_PREFIX} lent to inference (loan {self.loan_id})"

    @property
    def return_reason(self) -> str:
        return f"{SLURM_REASON_PREFIX} returning to training (loan {self.loan_id})"


# --- reading the node ------------------------------------------------------------------------


def _slurm_node(ctx: LoanContext) -> SlurmNode | None:
    """The node as Slurm lists it now; None when Slurm does not list it (under Slinky a
    dynamic node whose slurmd pod is away)."""
    return node_or_none(ctx.clients.slurm, ctx.node)


def _drained(node: SlurmNode) -> bool:
    return "DRAIN" in node.flags or "DRAINED" in node.flags or node.state == "DOWN"


def _ours(node: SlurmNode, ctx: LoanContext) -> bool:
    """Drained by this loan (the reason names it)."""
    return node.reason.startswith(ctx.reason)


def _cordoned_by_other(node: K8sNode) -> bool:
    return node.unschedulable and node.annotations.get(K8S_CORDONED_BY) != CORDONED_BY_FLEETWATCH


def _whose(reason: str) -> str:
    if reason.startswith(SLURM_OPERATOR_REASON_PREFIX):
        return "slurm-operator"
    if reason.startswith(SLURM_REASON_PREFIX):
        return "FleetWatch (another repair or loan)"
    return "an administrator"


def _slurmd_pods(pods: Sequence[K8sPod]) -> list[K8sPod]:
    """Slinky's slurmd pods (a NodeSet's), by the label slurm-operator gives them."""
    return [p for p in pods if SLINKY_POD_NAME_LABEL in p.labels]


def _workload(pods: Sequence[K8sPod], before: Sequence[str]) -> list[K8sPod]:
    """The pods a return evicts: those that came during the loan (inference), not DaemonSet
    pods, mirror pods or Slinky's slurmd pod (as ``kubectl drain --ignore-daemonsets``
    leaves the first two), not those that ended."""
    there = set(before)
    return [p for p in pods if p.owner_kind != "DaemonSet" and not p.mirror
            and SLINKY_POD_NAME_LABEL not in p.labels and f"{p.namespace}/{p.name}" not in there
            and p.phase not in ("Succeeded", "Failed")]


# --- lend --------------------------------------------------------------------------------------


def lend_check(ctx: LoanContext) -> Outcome:
    """Refuse a node that is not FleetWatch's to lend; note how it is (restored on return)."""
    if "before" in ctx.state:
        return Done("checked already")
    slurm = _slurm_node(ctx)
    if slurm is None:
        return Stop(f"Slurm does not list {ctx.node}: nothing to lend", untouched=True)
    if _drained(slurm):
        return Stop(f"{ctx.node} is {slurm.state}{'+DRAIN' if 'DRAIN' in slurm.flags else ''} "
                    f"in Slurm, drained by {_whose(slurm.reason)} ({slurm.reason!r}): not "
                    "FleetWatch's to lend", untouched=True)
    k8s = ctx.clients.kubernetes.node(ctx.node)
    if _cordoned_by_other(k8s):
        return Stop(f"{ctx.node} was cordoned in Kubernetes by someone else: not FleetWatch's "
                    "to lend", untouched=True)
    if k8s.ready is not True:
        return Stop(f"{ctx.node} is not Ready in Kubernetes ({k8s.ready_reason or 'unknown'}):"
                    " nothing to lend", untouched=True)
    pods = ctx.clients.kubernetes.pods_on_node(ctx.node)
    slurmd = _slurmd_pods(pods)
    ctx.state["before"] = {
        # The pods already there (monitoring, a slurmd run as a pod): not inference, never
        # evicted by the return.
        "pods": sorted(f"{p.namespace}/{p.name}" for p in pods),
        "unschedulable": k8s.unschedulable,
        # The labels the lend changes, as they were (None: absent), and the taints it removes.
        "labels": {k: k8s.labels.get(k) for k in [*ctx.marks.labels, *ctx.marks.remove_labels]},
        "taints": [list(t) for t in k8s.taints
                   if any(taint_named(t, spec) for spec in ctx.marks.remove_taints)],
    }
    if slurmd:
        ctx.state["slurmd_pod"] = f"{slurmd[0].namespace}/{slurmd[0].name}"
    return Done(f"{ctx.node} is idle or busy in Slurm ({slurm.state}) and schedulable for "
                "FleetWatch to lend" + (f"; Slinky: slurmd pod {ctx.state['slurmd_pod']}"
                                        if slurmd else ""))


def lend_drain(ctx: LoanContext) -> Outcome:
    result = ctx.call("slurm.drain", ctx.node, ctx.clients.slurm.drain, ctx.node, ctx.reason)
    if not result.changed and not ctx.state.get("drained"):
        slurm = _slurm_node(ctx)
        if slurm is None or not _ours(slurm, ctx):
            # Someone drained it between the check and the drain: theirs, not a loan.
            reason = slurm.reason if slurm else "not listed"
            return Stop(f"{ctx.node} was drained by {_whose(reason)} meanwhile ({reason!r}): "
                        "not lent", untouched=True)
    ctx.state["drained"] = True
    return Done(f"{ctx.node} drained in Slurm: {ctx.reason}")


def lend_wait_jobs(ctx: LoanContext) -> Outcome:
    running = sorted(j.job_id for j in ctx.clients.slurm.jobs()
                     if j.state in JOB_ON_NODE and ctx.node in j.nodes)
    if not running:
        return Done(f"no job runs on {ctx.node}")
    if ctx.deadline is not None and ctx.clock.now() >= ctx.deadline:
        return GiveBack(f"job(s) {', '.join(running)} still run on {ctx.node} past the "
                        "deadline (FLEETWATCH_LEND_DRAIN_DEADLINE_MINUTES): lend abandoned, "
                        "the node goes back to training")
    until = (f" (deadline {time.strftime('%H:%M UTC', time.gmtime(ctx.deadline))})"
             if ctx.deadline is not None else "")
    return Wait(f"waiting for job(s) {', '.join(running)} to finish on {ctx.node}{until}")


def lend_label(ctx: LoanContext) -> Outcome:
    marks = ctx.marks
    labels: dict[str, str | None] = {**{k: None for k in marks.remove_labels},
                                     **marks.labels}
    result = ctx.call("k8s.relabel", ctx.node, ctx.clients.kubernetes.relabel, ctx.node,
                      labels, list(marks.taints), list(marks.remove_taints),
                      {K8S_LENT: f"loan {ctx.loan_id}"})
    ctx.state["k8s"] = True
    return Done(f"{ctx.node} labelled for inference: {result.call}")


def lend_slurmd_away(ctx: LoanContext) -> Outcome:
    """Slinky: the node's slurmd pod holds its GPUs; with the NodeSet's label gone the
    operator does not place it again once it is evicted (its NodeSet's PDB is honoured)."""
    pod = ctx.state.get("slurmd_pod")
    if not pod:
        return Done("no slurmd pod on the node (Slurm and Kubernetes side by side)")
    still = _slurmd_pods(ctx.clients.kubernetes.pods_on_node(ctx.node))
    if not still:
        return Done(f"slurmd pod {pod} scaled away from {ctx.node}")
    outcome = _evict(ctx, [p for p in still if f"{p.namespace}/{p.name}" == pod] or still)
    if outcome is not None:
        return outcome
    return Wait(f"waiting for slurmd pod(s) {', '.join(f'{p.namespace}/{p.name}' for p in still)}"
                f" to leave {ctx.node}")


def lend_uncordon(ctx: LoanContext) -> Outcome:
    k8s = ctx.clients.kubernetes.node(ctx.node)
    if not k8s.unschedulable:
        return Done(f"{ctx.node} is schedulable for inference")
    if _cordoned_by_other(k8s):
        return Stop(f"{ctx.node} was cordoned in Kubernetes by someone else during the lend; "
                    "FleetWatch leaves it to them (return the loan to put it back in training)")
    ctx.call("k8s.uncordon", ctx.node, ctx.clients.kubernetes.uncordon, ctx.node)
    ctx.state["uncordoned"] = True
    return Done(f"{ctx.node} uncordoned: schedulable for inference")


# --- return ------------------------------------------------------------------------------------


def return_check(ctx: LoanContext) -> Outcome:
    """A node an administrator drained or cordoned during the loan is theirs now."""
    if ctx.state.get("return_checked"):
        return Done("checked already")
    slurm = _slurm_node(ctx)
    if slurm is not None and _drained(slurm) and not _ours(slurm, ctx) \
            and not slurm.reason.startswith(SLURM_OPERATOR_REASON_PREFIX) \
            and not ctx.state.get("handover"):
        return Stop(f"{ctx.node} was drained in Slurm by {_whose(slurm.reason)} during the "
                    f"loan ({slurm.reason!r}): FleetWatch leaves it to them")
    k8s = ctx.clients.kubernetes.node(ctx.node)
    if _cordoned_by_other(k8s):
        return Stop(f"{ctx.node} was cordoned in Kubernetes by someone else during the loan: "
                    "FleetWatch leaves it to them")
    ctx.state["return_checked"] = True
    return Done(f"{ctx.node} is still FleetWatch's to return")


def _lent_in_k8s(ctx: LoanContext) -> bool:
    return bool(ctx.state.get("k8s") or ctx.state.get("uncordoned"))


def return_cordon(ctx: LoanContext) -> Outcome:
    if not _lent_in_k8s(ctx):
        return Done("never made schedulable for inference: nothing to cordon")
    if ctx.state.get("handover"):
        return Done("handed to a repair: its playbook cordons and drains the node")
    ctx.call("k8s.cordon", ctx.node, ctx.clients.kubernetes.cordon, ctx.node, ctx.return_reason)
    ctx.state["return_cordoned"] = True
    return Done(f"{ctx.node} cordoned: no new inference pod lands")


def _evict(ctx: LoanContext, pods: Sequence[K8sPod]) -> Wait | None:
    """Evict ``pods`` (each once; a blocked one again after FLEETWATCH_LEND_EVICT_RETRY_SECONDS);
    a Wait naming the budgets that hold some back, or None."""
    now = ctx.clock.now()
    blocked: dict[str, Any] = ctx.state.setdefault("blocked", {})
    waiting = []
    for pod in pods:
        key = f"{pod.namespace}/{pod.name}"
        if pod.terminating:
            continue
        held = blocked.get(key)
        if held and now < held["retry_at"]:
            waiting.append((key, held))
            continue
        try:
            ctx.call("k8s.evict", key, ctx.clients.kubernetes.evict, pod.namespace, pod.name)
        except EvictionBlocked as exc:
            held = {"since": held["since"] if held else now, "tries": (held or {}).get(
                "tries", 0) + 1, "why": str(exc)[:300], "retry_at": now + ctx.evict_retry_seconds}
            blocked[key] = held
            waiting.append((key, held))
            continue
        blocked.pop(key, None)
        ctx.state.setdefault("evicted", []).append(key)
    if not waiting:
        return None
    return Wait("; ".join(
        f"eviction of {key} blocked by its PodDisruptionBudget for "
        f"{max(0.0, now - held['since']):.0f}s ({held['tries']} tries; next in "
        f"{max(0.0, held['retry_at'] - now):.0f}s): {held['why']}" for key, held in waiting))


def return_evict(ctx: LoanContext) -> Outcome:
    if not _lent_in_k8s(ctx) or ctx.state.get("handover"):
        return Done("no inference pods of FleetWatch's making to evict")
    before = (ctx.state.get("before") or {}).get("pods") or []
    left = _workload(ctx.clients.kubernetes.pods_on_node(ctx.node), before)
    if not left:
        evicted = ctx.state.get("evicted", [])
        return Done(f"{ctx.node} has no inference pods left"
                    + (f" (evicted {', '.join(evicted)})" if evicted else ""))
    waiting = _evict(ctx, left)
    if waiting is not None:
        return waiting
    left = _workload(ctx.clients.kubernetes.pods_on_node(ctx.node), before)
    if left:
        return Wait(f"waiting for pod(s) {', '.join(f'{p.namespace}/{p.name}' for p in left)} "
                    f"to leave {ctx.node}")
    return Done(f"evicted {', '.join(ctx.state.get('evicted', []))} from {ctx.node}")


def return_restore(ctx: LoanContext) -> Outcome:
    """The labels, taints and cordon as they were before the lend."""
    before = ctx.state.get("before") or {}
    if ctx.state.get("k8s"):
        marks = ctx.marks
        labels: dict[str, str | None] = {k: None for k in marks.labels}
        labels.update(before.get("labels") or {})
        taints = [tuple(t) for t in before.get("taints") or []]
        ctx.call("k8s.unlabel", ctx.node, ctx.clients.kubernetes.relabel, ctx.node, labels,
                 taints, [f"{k}:{e}" for k, _, e in marks.taints], {K8S_LENT: None})
    if ctx.state.get("handover"):
        return Done(f"{ctx.node}'s inference labels removed; its repair holds the cordon")
    k8s = ctx.clients.kubernetes.node(ctx.node)
    if k8s.unschedulable and not before.get("unschedulable", False) \
            and not _cordoned_by_other(k8s):
        ctx.call("k8s.uncordon", ctx.node, ctx.clients.kubernetes.uncordon, ctx.node)
    return Done(f"{ctx.node} labelled, tainted and "
                f"{'cordoned' if before.get('unschedulable') else 'schedulable'} as before "
                "the loan")


def return_slurmd_back(ctx: LoanContext) -> Outcome:
    pod = ctx.state.get("slurmd_pod")
    if not pod:
        return Done("no slurmd pod to wait for (Slurm and Kubernetes side by side)")
    running = [p for p in _slurmd_pods(ctx.clients.kubernetes.pods_on_node(ctx.node))
               if p.phase == "Running" and not p.terminating]
    if not running:
        return Wait(f"waiting for slurm-operator to bring a slurmd pod back to {ctx.node} "
                    f"(it ran {pod} before the loan)")
    return Done(f"slurmd pod {running[0].namespace}/{running[0].name} runs on {ctx.node} again")


def _gate_before_resume(ctx: LoanContext) -> GateAnswer:
    """The return-to-service gate (FLEETWATCH_LEND_GATE), run on the node before Slurm gets
    it back. The gate itself is incidents.remediation's (``node_gate_start``): this is the one
    place lending asks it."""
    if ctx.gate is None:
        return GateAnswer(True, "no return-to-service gate configured (FLEETWATCH_LEND_GATE)")
    return ctx.gate(ctx.node)


def return_gate(ctx: LoanContext) -> Outcome:
    if ctx.state.get("handover"):
        return Done("handed to a repair: its playbook decides when the node is healthy")
    answer = _gate_before_resume(ctx)
    if answer.passed is None:
        return Wait(f"return-to-service gate running on {ctx.node}: {answer.detail}")
    if not answer.passed:
        return Stop(f"{ctx.node} failed the return-to-service gate: {answer.detail}; it stays "
                    "drained in Slurm")
    return Done(answer.detail)


def return_resume(ctx: LoanContext) -> Outcome:
    if ctx.state.get("handover"):
        return Done("handed to a repair: its playbook resumes the node once healthy")
    if not ctx.state.get("drained"):
        return Done(f"{ctx.node} was never drained by this loan: nothing to resume")
    slurm = _slurm_node(ctx)
    if slurm is None:
        return Wait(f"waiting for Slurm to list {ctx.node} again")
    if not _drained(slurm):
        return Done(f"{ctx.node} is back in Slurm ({slurm.state})")
    if slurm.reason.startswith(SLURM_OPERATOR_REASON_PREFIX):
        return Wait(f"{ctx.node} is drained by slurm-operator ({slurm.reason!r}), which lifts "
                    "its own drain once its slurmd pod is ready")
    if not _ours(slurm, ctx):
        return Stop(f"{ctx.node} was drained in Slurm by {_whose(slurm.reason)} "
                    f"({slurm.reason!r}): FleetWatch leaves it to them")
    try:
        ctx.call("slurm.resume", ctx.node, ctx.clients.slurm.resume, ctx.node)
    except ClientError as exc:
        if exc.permanent:
            return Stop(str(exc))
        raise
    return Done(f"{ctx.node} resumed in Slurm: back in training")


LEND_STEPS: dict[str, Callable[[LoanContext], Outcome]] = {
    "lend_check": lend_check,
    "lend_drain": lend_drain,
    "lend_wait_jobs": lend_wait_jobs,
    "lend_label": lend_label,
    "lend_slurmd_away": lend_slurmd_away,
    "lend_uncordon": lend_uncordon,
}
RETURN_STEPS: dict[str, Callable[[LoanContext], Outcome]] = {
    "return_check": return_check,
    "return_cordon": return_cordon,
    "return_evict": return_evict,
    "return_restore": return_restore,
    "return_slurmd_back": return_slurmd_back,
    "return_gate": return_gate,
    "return_resume": return_resume,
}
# Every step, by name: what the runner looks up (tests patch entries in it).
EXECUTORS: dict[str, Callable[[LoanContext], Outcome]] = {**LEND_STEPS, **RETURN_STEPS}
# What each step does, in a person's words (the confirmation before a click, the loan's page).
TITLES = {
    "lend_check": "check the node is FleetWatch's to lend (no administrator's drain or cordon)",
    "lend_drain": "drain it in Slurm with FleetWatch's reason",
    "lend_wait_jobs": "wait for the jobs running on it to finish (or give up at the deadline)",
    "lend_label": "label and taint it for inference in Kubernetes",
    "lend_slurmd_away": "under Slinky, evict its slurmd pod",
    "lend_uncordon": "uncordon it if FleetWatch had cordoned it",
    "return_check": "check nobody else drained or cordoned it meanwhile",
    "return_cordon": "cordon it in Kubernetes",
    "return_evict": "evict its inference pods through the Eviction API, honouring their "
                    "PodDisruptionBudgets",
    "return_restore": "put its labels, taints and cordon back as they were",
    "return_slurmd_back": "under Slinky, wait for its slurmd pod to come back",
    "return_gate": "run the return-to-service gate (when FLEETWATCH_LEND_GATE is on)",
    "return_resume": "resume it in Slurm",
}
assert set(TITLES) == set(EXECUTORS)


def next_step(step: str) -> str | None:
    """The step after ``step`` in its direction; None after the last."""
    order = list(LEND_STEPS if step in LEND_STEPS else RETURN_STEPS)
    at = order.index(step)
    return order[at + 1] if at + 1 < len(order) else None


FIRST_LEND_STEP = next(iter(LEND_STEPS))
FIRST_RETURN_STEP = next(iter(RETURN_STEPS))
