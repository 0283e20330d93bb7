"""Step executors: the only code that changes the outside world.

An executor looks at the current state first and acts only where it must, so running it again
after a crash or a duplicate delivery does nothing twice. It returns an outcome: ``Done`` (with a
result), ``Wait`` (check again later: a job still inside its grace period, a node still
provisioning) or ``Block`` (a person must decide). Every outside call goes through
``ctx.call``, which appends an audit entry for it, success or failure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collectors.clients import Clients
from collectors.clients.base import (
    NO_AUTO_REPLACE_LABEL,
    SLURM_REASON_PREFIX,
    ActionResult,
    ClientError,
)


@dataclass
class Done:
    detail: str
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class Wait:
    detail: str
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class Block:
    reason: str
    result: dict[str, Any] = field(default_factory=dict)


Outcome = Done | Wait | Block


@dataclass
class StepContext:
    incident_id: int
    root_cause: str
    explanation: str
    nodes: list[str]
    clients: Clients
    grace_seconds: int
    state: dict[str, Any]  # this step's saved result so far (survives polls and retries)
    previous: dict[str, dict[str, Any]]  # earlier steps' results, by kind
    audit: Callable[[str, str, ActionResult | None, str | None], None]

    @property
    def node(self) -> str:
        return self.nodes[0]

    def call(self, verb: str, target: str, fn: Callable[..., ActionResult],
             *args: Any) -> ActionResult:
        try:
            result = fn(*args)
        except ClientError as exc:
            self.audit(verb, target, None, str(exc))
            raise
        self.audit(verb, target, result, None)
        return result


def _reason(ctx: StepContext) -> str:
    return f"{SLURM_REASON_PREFIX} incident {ctx.incident_id} {ctx.root_cause}"


def notify(ctx: StepContext) -> Outcome:
    if ctx.state.get("sent"):
        return Done("already notified", ctx.state)
    subject = f"FleetWatch incident {ctx.incident_id}: {ctx.root_cause} on {', '.join(ctx.nodes)}"
    result = ctx.call("notify", "on-call", ctx.clients.notifier.notify, subject, ctx.explanation,
                      {"incident": ctx.incident_id, "root_cause": ctx.root_cause,
                       "nodes": ctx.nodes})
    return Done(result.detail, {"sent": True, "call": result.call})


def drain_and_cancel(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    if not state.get("drained"):
        ctx.call("slurm.drain", ctx.node, ctx.clients.slurm.drain, ctx.node, _reason(ctx))
        state["drained"] = True
    jobs = {j.job_id: j for j in ctx.clients.slurm.jobs()}
    if "jobs" not in state:
        # Remember which jobs were on the node when we acted: those are the ones to requeue.
        state["jobs"] = sorted(j.job_id for j in jobs.values()
                               if j.state == "RUNNING" and ctx.node in j.nodes)
        state["checkpoint_before"] = {j: jobs[j].checkpoint_step for j in state["jobs"]}
    for job_id in state["jobs"]:
        if job_id not in state.setdefault("signalled", []):
            ctx.call("slurm.cancel", f"job {job_id}", ctx.clients.slurm.cancel, job_id, "TERM",
                     ctx.grace_seconds)
            state["signalled"].append(job_id)
    still = [j for j in state["jobs"] if jobs.get(j) and jobs[j].state == "RUNNING"]
    if still:
        return Wait(f"waiting for job(s) {', '.join(still)} to exit "
                    f"(SIGTERM, {ctx.grace_seconds}s grace)", state)
    state["checkpoints"] = {j: jobs[j].checkpoint_step for j in state["jobs"] if j in jobs}
    if not state["jobs"]:
        return Done(f"{ctx.node} drained; no jobs were running on it", state)
    return Done(f"{ctx.node} drained; job(s) {', '.join(state['jobs'])} stopped", state)


def requeue(ctx: StepContext) -> Outcome:
    cancelled = ctx.previous.get("drain_and_cancel", {}).get("jobs", [])
    state = dict(ctx.state)
    done = state.setdefault("requeued", [])
    for job_id in cancelled:
        if job_id not in done:
            ctx.call("slurm.requeue", f"job {job_id}", ctx.clients.slurm.requeue, job_id)
            done.append(job_id)
    if not cancelled:
        return Done("no jobs to requeue", state)
    return Done(f"requeued job(s) {', '.join(done)}", state)


def check_no_auto_replace(ctx: StepContext) -> Outcome:
    pods = ctx.clients.kubernetes.pods_on_node(ctx.node)
    opted_out = [f"{p.namespace}/{p.name}" for p in pods
                 if p.labels.get(NO_AUTO_REPLACE_LABEL, "").lower() == "true"]
    if opted_out:
        return Block(
            f"pod(s) {', '.join(opted_out)} on {ctx.node} carry {NO_AUTO_REPLACE_LABEL}=true: "
            "automatic cordon and replacement stopped. The node stays drained in Slurm; "
            "continue to cordon and replace it anyway, or stop here.",
            {"opted_out": opted_out},
        )
    return Done(f"no pod on {ctx.node} opts out of replacement", {"pods": len(pods)})


def cordon_and_drain(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    if not state.get("cordoned"):
        ctx.call("k8s.cordon", ctx.node, ctx.clients.kubernetes.cordon, ctx.node, _reason(ctx))
        state["cordoned"] = True
    evicted = state.setdefault("evicted", [])
    skipped = []
    for pod in ctx.clients.kubernetes.pods_on_node(ctx.node):
        key = f"{pod.namespace}/{pod.name}"
        if pod.owner_kind == "DaemonSet" or pod.mirror:
            # DaemonSet pods belong on every node and mirror pods are the kubelet's: evicting
            # either is pointless (kubectl drain --ignore-daemonsets skips them too).
            skipped.append(key)
            continue
        if key not in evicted:
            ctx.call("k8s.evict", key, ctx.clients.kubernetes.evict, pod.namespace, pod.name)
            evicted.append(key)
    state["skipped"] = skipped
    return Done(f"{ctx.node} cordoned; evicted {len(evicted)} pod(s), "
                f"left {len(skipped)} DaemonSet pod(s)", state)


def replace_node(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    provider = ctx.clients.provider
    if "new_node" not in state:
        result = ctx.call("provider.replace", ctx.node, _replace_call(provider), ctx.node)
        state["new_node"] = result.data["new_node"]
    status = provider.replacement_status(ctx.node)
    if status is None:
        raise ClientError(f"the provider lost the replacement for {ctx.node}")
    if not status.ready:
        return Wait(f"{state['new_node']} provisioning ({status.detail})", state)
    return Done(f"{state['new_node']} provisioned to replace {ctx.node}", state)


def _replace_call(provider: Any) -> Callable[[str], ActionResult]:
    def call(node: str) -> ActionResult:
        r = provider.replace(node)
        return ActionResult(f"provider replace {node}", True, r.detail,
                            {"new_node": r.new_node})
    return call


def resume(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    new = ctx.previous.get("replace_node", {}).get("new_node")
    if not new:
        raise ClientError("no replacement node recorded", permanent=True)
    if not state.get("resumed"):
        problems = _health_problems(ctx, new)
        if problems:
            return Wait(f"waiting for {new} to be healthy: {'; '.join(problems)}", state)
        ctx.call("slurm.resume", new, ctx.clients.slurm.resume, new)
        state["resumed"] = True
    requeued = ctx.previous.get("requeue", {}).get("requeued", [])
    jobs = {j.job_id: j for j in ctx.clients.slurm.jobs()}
    waiting = [j for j in requeued if jobs.get(j) is None or jobs[j].state != "RUNNING"]
    if waiting:
        return Wait(f"{new} resumed; waiting for job(s) {', '.join(waiting)} to run again",
                    state)
    state["jobs"] = {
        j: {"nodes": list(jobs[j].nodes), "restart_count": jobs[j].restart_count,
            "resumed_from_step": jobs[j].resumed_from_step}
        for j in requeued
    }
    running = ", ".join(f"job {j} from step {jobs[j].resumed_from_step}" for j in requeued)
    return Done(f"{new} in service" + (f"; {running}" if running else ""), state)


def _health_problems(ctx: StepContext, node: str) -> list[str]:
    problems = []
    slurm = {n.name: n for n in ctx.clients.slurm.nodes()}
    if node not in slurm:
        problems.append("not registered in Slurm")
    elif slurm[node].state == "DOWN":
        problems.append("Slurm reports it DOWN")
    k8s = {n.name: n for n in ctx.clients.kubernetes.nodes()}
    if node not in k8s or k8s[node].ready is not True:
        problems.append("Kubernetes node not Ready")
    gpus = [m for m in ctx.clients.telemetry.gpu_metrics() if m.node == node]
    if not gpus:
        problems.append("no GPU telemetry yet")
    elif any(m.utilization is None or m.last_xid for m in gpus):
        problems.append("a GPU reports an XID or is missing")
    return problems


EXECUTORS: dict[str, Callable[[StepContext], Outcome]] = {
    "notify": notify,
    "drain_and_cancel": drain_and_cancel,
    "requeue": requeue,
    "check_no_auto_replace": check_no_auto_replace,
    "cordon_and_drain": cordon_and_drain,
    "replace_node": replace_node,
    "resume": resume,
}
