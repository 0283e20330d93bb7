"""Step executors: the only code that changes the outside world.

An executor looks at the current state first and acts only where it must, so running it again
after a crash or a duplicate delivery does nothing twice. It returns an outcome: ``Done`` (with a
result), ``Wait`` (check again later: a job still inside its grace period, a node still
provisioning) or ``Block`` (a person must decide). Every outside call goes through
``ctx.call``, which appends an audit entry for it, success or failure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from django.conf import settings

from collectors.clients import Clients
from collectors.clients.base import (
    NO_AUTO_REPLACE_LABEL,
    SLURM_REASON_PREFIX,
    ActionResult,
    ClientError,
    SlurmJob,
    node_or_none,
)
from collectors.clients.notify import owner_notify
from collectors.clock import SYSTEM_CLOCK, Clock
from collectors.knowledge import dcgm
from collectors.knowledge.acceptance import RESERVATION_PREFIX, Repair
from collectors.knowledge.xid import takes_gpu_out
from incidents.remediation import gate
from incidents.remediation.gate_k8s import lift_fleetwatch_cordon
from incidents.remediation.gate_plan import gate_plan, gate_poll, kubernetes_pool


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


@dataclass(frozen=True)
class Rehearsal:
    """A fire drill's run of a playbook (incidents.drills): every outside call is recorded as
    "would call" and not made, except ``real_verbs`` (a canary drill's drain and cordon, which
    the drill puts back). It ends at the provider: a drill never replaces, reboots or resets a
    node (nothing could put that back), and never pages anyone from its steps."""

    drill_id: int
    mode: str  # observe or canary (incidents.models.Drill.Mode)
    real_verbs: frozenset[str] = frozenset()


class RehearsalStop(Exception):  # not an error: where a drill's playbook ends
    """A drill's playbook reached the provider: the call is recorded as "would call" and the
    rehearsal is over (the engine finishes the remediation there)."""

    def __init__(self, verb: str, target: str, drill_id: int) -> None:
        super().__init__(f"fire drill {drill_id} stops at the provider: FleetWatch would call "
                         f"{verb} {target}; not called")
        self.verb, self.target = verb, target


class StepFailed(ClientError):
    """The step failed for good (permanent), with the result to keep: a person's retry starts
    from it (the gate then runs its checks afresh instead of reading the old verdict)."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message, permanent=True)
        self.result = result


@dataclass
class Facts:
    """Reads and records the engine offers executors (backed by the database)."""

    last_link_change: Callable[[str], float | None]  # epoch seconds of the node's last NIC signal
    mark_rma: Callable[[str, str], None]  # node, why
    # job -> (epoch seconds, step or None) of the last checkpoint its output says it wrote
    last_checkpoint: Callable[[str], tuple[float, int | None] | None] = lambda job_id: None
    # The return-to-service gate: the node's pool (FleetWatch's records), its gate run kept
    # for the node page and the counts (node, gate state), and its failed gates this week.
    node_pool: Callable[[str], str] = lambda node: ""
    gate_record: Callable[[str, dict[str, Any]], None] = lambda node, state: None
    gate_failures: Callable[[str], int] = lambda node: 0


class OutsideCalls:
    """``call``: make one outside call, audited once, and not again after a restart.

    What runs a sequence of outside calls that must survive a worker's death (a remediation's
    step, a node's loan: incidents/lending) keeps ``done_calls`` (the calls completed, saved by
    ``on_call_done`` as each returns) and hands ``audit`` its way of recording one."""

    # (verb, target, result, error, duration_ms of the outside call)
    audit: Callable[[str, str, ActionResult | None, str | None, float | None], None]
    done_calls: set[str]
    on_call_done: Callable[[str], None] | None

    def call(self, verb: str, target: str, fn: Callable[..., ActionResult],
             *args: Any) -> ActionResult:
        key = f"{verb} {target}"
        if key in self.done_calls:
            # Made by an earlier run that died before saving its result: not made again, not
            # audited again (its audit entry exists).
            return ActionResult(f"({verb} {target}: done before a restart)", False,
                                "done by an earlier run")
        # Timed around the outside call alone (monotonic: immune to clock steps), so the
        # audit shows how long Slurm, Kubernetes or the provider took, not our bookkeeping.
        started = time.monotonic()
        try:
            result = fn(*args)
        except Exception as exc:
            # A client bug or an unwrapped error is still an outside call with an unknown
            # outcome: it is audited like a ClientError, then raised for the engine to handle.
            error = str(exc) if isinstance(exc, ClientError) else f"{type(exc).__name__}: {exc}"
            # A provider that ran a program says what it ran and what came back.
            failed = (ActionResult(cast(Any, exc).call, False, error, dict(getattr(exc, "data", {})))
                      if getattr(exc, "call", "") else None)
            self.audit(verb, target, failed, error, (time.monotonic() - started) * 1000)
            raise
        # A call that reached nothing outside (no owner address to tell) has no time to show.
        self.audit(verb, target, result, None,
                   (time.monotonic() - started) * 1000 if result.call else None)
        self.done_calls.add(key)
        if self.on_call_done is not None:
            self.on_call_done(key)
        return result


@dataclass
class StepContext(OutsideCalls):
    incident_id: int
    root_cause: str
    explanation: str
    nodes: list[str]
    clients: Clients
    grace_seconds: int
    state: dict[str, Any]  # this step's saved result so far (survives polls and retries)
    previous: dict[str, dict[str, Any]]  # earlier steps' results, by kind
    # (verb, target, result, error, duration_ms of the outside call)
    audit: Callable[[str, str, ActionResult | None, str | None, float | None], None]
    # What the engine read from FleetWatch's own records for this step (executors never touch
    # the database themselves): the faulty GPUs named by the evidence, the incident's jobs
    # and their owners, the switch, and the history of the node's link.
    remediation_id: int = 0
    gpus: list[int] = field(default_factory=list)
    jobs: dict[str, str] = field(default_factory=dict)
    switch: str = ""
    facts: Facts | None = None
    # The calls this step already completed in an earlier run, and how to record one more.
    done_calls: set[str] = field(default_factory=set)
    on_call_done: Callable[[str], None] | None = None
    # Where the waits' "now" comes from (a test hands in a ManualClock instead of sleeping).
    clock: Clock = SYSTEM_CLOCK
    # What stopped the jobs, in one line ("XID 79 (GPU has fallen off the bus) on gpu-003
    # GPU 5"), and where a job's page is: what the job's Slurm comment and its owner are told.
    fault: str = ""
    job_link: Callable[[str], str] = lambda job_id: ""
    # A fire drill's run: which calls are only recorded (see Rehearsal); None for a repair.
    rehearsal: Rehearsal | None = None

    @property
    def node(self) -> str:
        return self.nodes[0]

    def call(self, verb: str, target: str, fn: Callable[..., ActionResult],
             *args: Any) -> ActionResult:
        """``OutsideCalls.call``, and a fire drill's rehearsal: a call it does not make for
        real is recorded as "would call" instead (see ``Rehearsal``)."""
        key = f"{verb} {target}"
        if self.rehearsal is not None:
            if key in self.done_calls and verb.startswith(PROVIDER_VERB_PREFIX):
                # A drill's run cut off after its would-call at the provider: still the end.
                raise RehearsalStop(verb, target, self.rehearsal.drill_id)
            if key not in self.done_calls and verb not in self.rehearsal.real_verbs:
                return self._would_call(verb, target, key, self.rehearsal)
        return super().call(verb, target, fn, *args)

    def _call_done(self, key: str) -> None:
        self.done_calls.add(key)
        if self.on_call_done is not None:
            self.on_call_done(key)

    def _would_call(self, verb: str, target: str, key: str, drill: Rehearsal) -> ActionResult:
        """A drill's call: audited as what FleetWatch would have called (no call made, so no
        ``call`` and no duration), remembered as done like a real one."""
        result = ActionResult("", False, f"fire drill {drill.drill_id} ({drill.mode} mode): "
                              f"would call {verb} {target}; not called",
                              {"would_call": True, "drill": drill.drill_id})
        self.audit(verb, target, result, None, None)
        self._call_done(key)
        if verb.startswith(PROVIDER_VERB_PREFIX):
            raise RehearsalStop(verb, target, drill.drill_id)
        return result


# The node provider's calls (replace, reboot, reset): where a drill's playbook ends.
PROVIDER_VERB_PREFIX = "provider."


def _reason(ctx: StepContext) -> str:
    return f"{SLURM_REASON_PREFIX} incident {ctx.incident_id} {ctx.root_cause}"


# --- telling the job: its Slurm comment and its owner ------------------------------------------


def _job_story(ctx: StepContext, job_id: str, what: str) -> str:
    """``fleetwatch: requeued after XID 79 (...) on gpu-003 GPU 5, incident 12, https://...``"""
    parts = [f"{SLURM_REASON_PREFIX} {what} after {ctx.fault or ctx.root_cause}",
             f"incident {ctx.incident_id}"]
    link = ctx.job_link(job_id)
    return ", ".join([*parts, link] if link else parts)


def _job_comment(ctx: StepContext, job_id: str, what: str) -> None:
    """Write why into the job itself in Slurm (FLEETWATCH_SLURM_COMMENT_FIELD), audited like
    every outside call. A comment that cannot be written is recorded and the repair goes on:
    the job's page and its owner's message still tell."""
    field = settings.FLEETWATCH_SLURM_COMMENT_FIELD
    if field == "none":
        return
    with contextlib.suppress(ClientError):  # audited by ctx.call, with Slurm's answer
        ctx.call("slurm.comment", f"job {job_id} {what}", ctx.clients.slurm.set_comment, job_id,
                 _job_story(ctx, job_id, what), field)


def _owner_told(ctx: StepContext, job_id: str) -> None:
    """The job's owner gets the story once, with a link to the job's page (a retried step or
    a second requeue of the same job for the same incident tells no one twice)."""
    subject = f"Your Slurm job {job_id} was requeued after {ctx.fault or ctx.root_cause}"
    body = (f"FleetWatch stopped your job {job_id} after {ctx.fault or ctx.root_cause} "
            f"(incident {ctx.incident_id}) and put it back in the queue; it resumes from its "
            "last checkpoint. Nothing in your job caused this.")
    _owner_message(ctx, job_id, subject, body, "job.requeued")


def _owner_message(ctx: StepContext, job_id: str, subject: str, body: str, event: str) -> None:
    user = ctx.jobs.get(job_id, "")
    if not user:
        return
    link = ctx.job_link(job_id)
    # Recorded (audit, deliveries) when it fails; the repair does not wait on a mail server.
    with contextlib.suppress(ClientError):
        ctx.call("notify.owner", f"{user} job {job_id}", owner_notify, user, subject,
                 body + (f" The whole story: {link}" if link else ""),
                 {"incident": ctx.incident_id, "job": job_id, "root_cause": ctx.root_cause,
                  "nodes": ctx.nodes, "event": event,
                  "delivery_key": f"incident-{ctx.incident_id}-job-{job_id}-owner"})


def _requeue_job(ctx: StepContext, job_id: str) -> None:
    ctx.call("slurm.requeue", f"job {job_id}", ctx.clients.slurm.requeue, job_id)
    _job_comment(ctx, job_id, "requeued")
    _owner_told(ctx, job_id)


def _cancel_job(ctx: StepContext, job_id: str) -> None:
    # The comment first: Slurm refuses to update a job that has ended ("Job has already
    # finished", seen on 25.11), and a job that catches SIGTERM ends at once; written while it
    # runs, the reason stays on the cancelled job's record (sacct).
    _job_comment(ctx, job_id, "stopped")
    ctx.call("slurm.cancel", f"job {job_id}", ctx.clients.slurm.cancel, job_id, "TERM",
             ctx.grace_seconds)


def notify(ctx: StepContext) -> Outcome:
    if ctx.state.get("sent"):
        return Done("already notified", ctx.state)
    subject = f"FleetWatch incident {ctx.incident_id}: {ctx.root_cause} on {', '.join(ctx.nodes)}"
    try:
        result = _notify_call(ctx, subject)
    except ClientError as exc:
        # Every channel failed: recorded (audit, deliveries) and shown, but a notification
        # outage must not hold back the repair of a dead node.
        return Done(f"notification failed, repair goes on: {exc}", {"sent": False,
                                                                   "error": str(exc)})
    return Done(result.detail, {"sent": True, "call": result.call})


def _notify_call(ctx: StepContext, subject: str) -> ActionResult:
    return ctx.call("notify", "on-call", ctx.clients.notifier.notify, subject, ctx.explanation,
                      {"incident": ctx.incident_id, "root_cause": ctx.root_cause,
                       "nodes": ctx.nodes,
                       # A retried step does not notify the channels that already got it.
                       "delivery_key": f"incident-{ctx.incident_id}-remediation-"
                                       f"{ctx.remediation_id}-notify"})


def _slurm_less(ctx: StepContext, node: str) -> str:
    """Why the playbook's Slurm steps pass over ``node`` ("" when they do not): it is in a pool
    Kubernetes schedules (FLEETWATCH_KUBERNETES_POOLS) and Slurm does not know it. A node of
    any other pool missing from Slurm is still waited for (it may be registering), and Slurm
    not answering raises as ever: a missing source is never read as a missing node."""
    pool = _node_pool(ctx, node)
    if not kubernetes_pool(pool) or node_or_none(ctx.clients.slurm, node) is not None:
        return ""
    return f"{node} is not a Slurm node (pool {pool}, which Kubernetes schedules)"


def _k8s_resume(ctx: StepContext, node: str, outside: str) -> str:
    """A node of a Kubernetes pool goes into service in Kubernetes: FleetWatch's own cordon is
    lifted (the gate lifts it when its checks pass; this is the case where none ran); a cordon
    of someone else's stays theirs."""
    lift_fleetwatch_cordon(ctx.clients.kubernetes, node, ctx.call, f"{node} (resume)")
    return f"{outside}: {node} in service in Kubernetes"


def _node_pool(ctx: StepContext, node: str) -> str:
    if ctx.facts is None:
        return ""
    # A replacement not yet recorded joins the pool of the node it replaces.
    return ctx.facts.node_pool(node) or (ctx.facts.node_pool(ctx.node) if node != ctx.node
                                         else "")


def drain_and_cancel(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    outside = _slurm_less(ctx, ctx.node) if not state.get("drained") else ""
    if outside:
        return Done(f"{outside}: nothing to drain in Slurm", {"jobs": [], "slurm": False})
    if not state.get("drained"):
        ctx.call("slurm.drain", ctx.node, ctx.clients.slurm.drain, ctx.node, _reason(ctx))
        state["drained"] = True
    jobs = {j.job_id: j for j in ctx.clients.slurm.jobs()}
    if "jobs" not in state:
        # Remember which jobs were on the node when we acted: those are the ones to requeue.
        # After a crash the ones already cancelled are no longer RUNNING: the record of the
        # cancels made brings them back.
        running = [j for j in jobs.values() if j.state == "RUNNING" and ctx.node in j.nodes]
        # On a node shared by several jobs, only those holding the faulty GPU are stopped;
        # the others run on, on their own GPUs, while the drain keeps new work away.
        state["spared"] = sorted(j.job_id for j in running if not _holds(j, ctx.node, ctx.gpus))
        state["jobs"] = sorted({j.job_id for j in running if _holds(j, ctx.node, ctx.gpus)}
                               | _cancelled_before(ctx))
        state["checkpoint_before"] = {j: jobs[j].checkpoint_step for j in state["jobs"]}
    for job_id in state["jobs"]:
        if job_id not in state.setdefault("signalled", []):
            _cancel_job(ctx, job_id)
            state["signalled"].append(job_id)
    still = [j for j in state["jobs"] if jobs.get(j) and jobs[j].state == "RUNNING"]
    if still:
        return Wait(f"waiting for job(s) {', '.join(still)} to exit "
                    f"(SIGTERM, {ctx.grace_seconds}s grace)", state)
    state["checkpoints"] = {j: jobs[j].checkpoint_step for j in state["jobs"] if j in jobs}
    # The training step each job had reached when it stopped: the job's page counts the
    # steps lost against the checkpoint it resumes from.
    state["steps_at_stop"] = {j: jobs[j].step for j in state["jobs"] if j in jobs}
    spared = (f"; job(s) {', '.join(state['spared'])} on other GPUs left running"
              if state.get("spared") else "")
    if not state["jobs"]:
        return Done(f"{ctx.node} drained; no jobs were running on it{spared}"
                    if not spared else f"{ctx.node} drained{spared}", state)
    return Done(f"{ctx.node} drained; job(s) {', '.join(state['jobs'])} stopped{spared}", state)


def _holds(job: SlurmJob, node: str, faulty: list[int]) -> bool:
    """Whether ``job`` holds one of the ``faulty`` GPUs of ``node``; True when either is not
    known (no GPU named by the evidence, or Slurm did not say which GPUs the job has)."""
    held = job.gpus.get(node)
    return not faulty or held is None or bool(set(held) & set(faulty))


def requeue(ctx: StepContext) -> Outcome:
    cancelled = ctx.previous.get("drain_and_cancel", {}).get("jobs", [])
    state = dict(ctx.state)
    done = state.setdefault("requeued", [])
    for job_id in cancelled:
        if job_id not in done:
            _requeue_job(ctx, job_id)
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
    if "requested" not in state:
        result = ctx.call("provider.replace", ctx.node, _replace_call(provider), ctx.node)
        state["requested"] = True
        state["new_node"] = result.data.get("new_node") or ""
        state["provider_data"] = result.data.get("provider_data") or {}
    status = provider.replacement_status(ctx.node, state.get("provider_data") or None)
    if status is None:
        raise ClientError(f"the provider lost the replacement for {ctx.node}")
    # A node pool names the new node only once it has come; a spare is named at once.
    state["new_node"] = status.new_node or state.get("new_node", "")
    if not status.ready:
        return Wait(f"{state['new_node'] or 'a new node'} provisioning ({status.detail})", state)
    return Done(f"{state['new_node']} provisioned to replace {ctx.node}", state)


def _replace_call(provider: Any) -> Callable[[str], ActionResult]:
    def call(node: str) -> ActionResult:
        r = provider.replace(node)
        return ActionResult(r.call or f"provider replace {node}", True, r.detail,
                            {"new_node": r.new_node, "provider_data": dict(r.data)})
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
        outside = _slurm_less(ctx, new)
        if outside:
            return Done(_k8s_resume(ctx, new, outside), {**state, "resumed": True})
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
    # Only the simulation knows a job's training step; real Slurm reports none (not "None").
    running = ", ".join(f"job {j} running again" if jobs[j].resumed_from_step is None
                        else f"job {j} from step {jobs[j].resumed_from_step}" for j in requeued)
    return Done(f"{new} in service" + (f"; {running}" if running else ""), state)


def _health_problems(ctx: StepContext, node: str, *, slurm_down_ok: bool = False) -> list[str]:
    """What keeps a node from service. ``slurm_down_ok``: FleetWatch marked it DOWN itself,
    so DOWN alone is not a problem (NOT_RESPONDING still is)."""
    problems = []
    seen = node_or_none(ctx.clients.slurm, node)
    if seen is None:
        if not kubernetes_pool(_node_pool(ctx, node)):
            problems.append("not registered in Slurm")
    elif "NOT_RESPONDING" in seen.flags:
        problems.append("Slurm says it is not responding")
    elif seen.state == "DOWN" and not (
            slurm_down_ok and seen.reason.startswith(SLURM_REASON_PREFIX)):
        problems.append("Slurm reports it DOWN")
    k8s = node_or_none(ctx.clients.kubernetes, node)
    if k8s is None or k8s.ready is not True:
        problems.append("Kubernetes node not Ready")
    gpus = ctx.clients.telemetry.gpu_metrics([node])
    if not gpus:
        problems.append("no GPU telemetry yet")
    elif any(m.utilization is None or m.last_xid for m in gpus):
        problems.append("a GPU reports an XID or is missing")
    return problems


# --- the other playbooks' steps -------------------------------------------------------------

# GPUs at or above this are not "back to normal" after a thermal slowdown.
THERMAL_NORMAL_C = 80.0


def _stable_seconds() -> float:
    return float(settings.FLEETWATCH_RECOVERY_STABLE_MINUTES) * 60.0


def _running_on(ctx: StepContext, nodes: list[str]) -> list[str]:
    # One node and a faulty GPU named: only the jobs on that GPU (see drain_and_cancel).
    return sorted(j.job_id for j in ctx.clients.slurm.jobs()
                  if j.state == "RUNNING" and set(j.nodes) & set(nodes)
                  and (len(nodes) != 1 or _holds(j, nodes[0], ctx.gpus)))


def _cancelled_before(ctx: StepContext) -> set[str]:
    """Jobs an earlier run of this step cancelled (from its record of completed calls)."""
    return {key.removeprefix("slurm.cancel job ") for key in ctx.done_calls
            if key.startswith("slurm.cancel job ")}


def _stop_and_requeue(ctx: StepContext, state: dict[str, Any], nodes: list[str]) -> Outcome | None:
    """Cancel (SIGTERM, the cluster's grace) the jobs running on ``nodes`` when first seen, wait
    for them to stop, requeue them. None when done; a Wait while a job is still stopping."""
    if "jobs" not in state:
        state["jobs"] = sorted(set(_running_on(ctx, nodes)) | _cancelled_before(ctx))
    for job_id in state["jobs"]:
        if job_id not in state.setdefault("signalled", []):
            _cancel_job(ctx, job_id)
            state["signalled"].append(job_id)
    jobs = {j.job_id: j for j in ctx.clients.slurm.jobs()}
    still = [j for j in state["jobs"] if jobs.get(j) and jobs[j].state == "RUNNING"]
    if still:
        return Wait(f"waiting for job(s) {', '.join(still)} to exit (SIGTERM)", state)
    state.setdefault("steps_at_stop", {}).update(
        {j: jobs[j].step for j in state["jobs"] if j in jobs and j not in state.get("requeued", [])})
    for job_id in state["jobs"]:
        if job_id not in state.setdefault("requeued", []):
            _requeue_job(ctx, job_id)
            state["requeued"].append(job_id)
    return None


def drain(ctx: StepContext) -> Outcome:
    """Drain only: running work finishes, nothing new starts (thermal)."""
    if ctx.state.get("drained"):
        return Done(f"{ctx.node} drained", ctx.state)
    ctx.call("slurm.drain", ctx.node, ctx.clients.slurm.drain, ctx.node, _reason(ctx))
    return Done(f"{ctx.node} drained; running jobs finish, no new ones start",
                {"drained": True})


def down_node(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    if not state.get("down"):
        # The simulation has no DOWN state: its down() drains, which holds work off as well.
        ctx.call("slurm.down", ctx.node, ctx.clients.slurm.down, ctx.node, _reason(ctx))
        # With ReturnToService=2 a DOWN node is back in service the moment its slurmd
        # registers again: held until its acceptance checks.
        _gate_hold(ctx, ctx.node, Repair.RECOVER)
        state["down"] = True
    waiting = _stop_and_requeue(ctx, state, [ctx.node])
    if waiting is not None:
        return waiting
    jobs = state["requeued"]
    return Done(f"{ctx.node} marked down; " + (f"requeued job(s) {', '.join(jobs)}" if jobs
                                               else "no jobs were running on it"), state)


def _provider_ready(ctx: StepContext, node: str) -> tuple[bool, str]:
    status = ctx.clients.provider.status(node)
    return status.state == "ready", f"{status.state}{': ' + status.detail if status.detail else ''}"


def reboot(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    if not state.get("requested"):
        _gate_hold(ctx, ctx.node, Repair.REBOOT)
        ctx.call("provider.reboot", ctx.node, ctx.clients.provider.reboot, ctx.node,
                 _reason(ctx))
        state["requested"] = True
    ready, status = _provider_ready(ctx, ctx.node)
    if not ready:
        return Wait(f"{ctx.node} rebooting ({status})", state)
    return Done(f"{ctx.node} rebooted and back ({status})", state)


def reboot_request(ctx: StepContext) -> Outcome:
    """Ask for a reboot of a node that stopped answering and move on: whether it comes back
    is the next step's question. A provider that cannot reboot an unresponsive node (Slurm
    reboots through the node's own slurmd) is noted, not fatal: the replacement follows."""
    if ctx.state.get("requested") or ctx.state.get("refused"):
        return Done("reboot already requested", dict(ctx.state))
    try:
        ctx.call("provider.reboot", ctx.node, ctx.clients.provider.reboot, ctx.node,
                 _reason(ctx))
    except ClientError as exc:
        if not exc.permanent:
            raise
        return Done(f"reboot refused ({exc}); waiting to see whether {ctx.node} comes back",
                    {"refused": str(exc)})
    return Done(f"reboot of {ctx.node} requested", {"requested": True})


def reset_or_reboot(ctx: StepContext) -> Outcome:
    """Reset the faulty GPU when the fault allows it; when the provider says a reset cannot
    help (the GPU is unreachable, or resets are not supported), reboot the node instead."""
    state = dict(ctx.state)
    provider = ctx.clients.provider
    if "action" not in state:
        gpu = ctx.gpus[0] if ctx.gpus else None
        try:
            ctx.call("provider.reset_gpu", f"{ctx.node} GPU {gpu}", provider.reset_gpu,
                     ctx.node, gpu)
            state["action"] = "reset"
        except ClientError as exc:
            if not exc.permanent:
                raise
            _gate_hold(ctx, ctx.node, Repair.REBOOT)
            ctx.call("provider.reboot", ctx.node, provider.reboot, ctx.node, _reason(ctx))
            state["action"], state["reset_refused"] = "reboot", str(exc)
    ready, status = _provider_ready(ctx, ctx.node)
    if not ready:
        return Wait(f"{ctx.node}: {state['action']} under way ({status})", state)
    return Done(f"{ctx.node}: {'GPU reset' if state['action'] == 'reset' else 'rebooted'}",
                state)


def verify_fault_cleared(ctx: StepContext) -> Outcome:
    gpus = ctx.clients.telemetry.gpu_metrics([ctx.node])
    if not gpus:
        return Wait(f"waiting for {ctx.node}'s GPU telemetry", dict(ctx.state))
    bad = [f"GPU {m.gpu}: XID {m.last_xid}" for m in gpus if takes_gpu_out(m.last_xid)]
    bad += [f"GPU {m.gpu}: row remap failure" for m in gpus if m.row_remap_failure]
    bad += [f"GPU {m.gpu}: no readings" for m in gpus
            if m.utilization is None and m.temperature is None]
    if bad:
        # Waits until the step's deadline, then fails: the fault survived the repair and a
        # person decides (the next fault on this node escalates to a replacement).
        return Wait(f"fault still present on {ctx.node}: {'; '.join(bad)}", dict(ctx.state))
    return Done(f"{ctx.node}: all {len(gpus)} GPUs report healthy", dict(ctx.state))


def _link_quiet_for(ctx: StepContext, node: str) -> float | None:
    """Seconds since the node's link last changed; None when it changed just now or never
    reported a change (then the NIC state alone decides)."""
    if ctx.facts is None:
        return None
    last = ctx.facts.last_link_change(node)
    return None if last is None else max(0.0, time.time() - last)


def _links_down(ctx: StepContext, nodes: list[str]) -> list[str]:
    wanted = set(nodes)
    return sorted({f"{p.node} {p.device}/{p.port}" for p in ctx.clients.telemetry.nic_ports()
                   if p.node in wanted and p.state != "ACTIVE"})


def _links_stable(ctx: StepContext, nodes: list[str]) -> tuple[bool, str]:
    down = _links_down(ctx, nodes)
    if down:
        return False, f"link(s) down: {', '.join(down[:5])}"
    need = _stable_seconds()
    for node in nodes:
        quiet = _link_quiet_for(ctx, node)
        if quiet is not None and quiet < need:
            return False, f"{node}'s link up {quiet:.0f}s of the {need:.0f}s it must stay up"
    return True, f"links up and stable for {need:.0f}s"


def wait_link_stable(ctx: StepContext) -> Outcome:
    stable, detail = _links_stable(ctx, [ctx.node])
    return Done(detail, dict(ctx.state)) if stable else Wait(detail, dict(ctx.state))


def resume_node(ctx: StepContext) -> Outcome:
    """Put the node (or the one that replaced it) back into service once it is healthy, then
    wait for the jobs FleetWatch requeued to run again."""
    state = dict(ctx.state)
    node = ctx.previous.get("replace_if_not_back", {}).get("new_node") or ctx.node
    if not state.get("resumed"):
        problems = _health_problems(ctx, node, slurm_down_ok=True)
        if problems:
            return Wait(f"waiting for {node} to be healthy: {'; '.join(problems)}", state)
        outside = _slurm_less(ctx, node)
        if outside:
            return Done(_k8s_resume(ctx, node, outside), {**state, "resumed": True, "node": node})
        ctx.call("slurm.resume", node, ctx.clients.slurm.resume, node)
        state["resumed"], state["node"] = True, node
    requeued = [j for kind in ("requeue", "down_node", "requeue_dead_jobs")
                for j in ctx.previous.get(kind, {}).get("requeued", [])]
    jobs = {j.job_id: j for j in ctx.clients.slurm.jobs()}
    waiting = [j for j in requeued if jobs.get(j) is None or jobs[j].state != "RUNNING"]
    if waiting:
        return Wait(f"{node} resumed; waiting for job(s) {', '.join(waiting)} to run again",
                    state)
    return Done(f"{node} back in service" + (f"; job(s) {', '.join(requeued)} running again"
                                             if requeued else ""), state)


# --- the return-to-service gate ---------------------------------------------------------------


def _gate_target(ctx: StepContext) -> tuple[str, Repair]:
    """The node that goes back into service and what was done to it, from the steps before."""
    new = (ctx.previous.get("replace_node", {}).get("new_node")
           or ctx.previous.get("replace_if_not_back", {}).get("new_node"))
    if new:
        return new, Repair.REPLACE
    if "reset_or_reboot" in ctx.previous:
        action = ctx.previous["reset_or_reboot"].get("action")
        return ctx.node, Repair.RESET if action == "reset" else Repair.REBOOT
    if "reboot" in ctx.previous:
        return ctx.node, Repair.REBOOT
    if "wait_node_back" in ctx.previous:
        return ctx.node, Repair.RECOVER
    if "wait_link_stable" in ctx.previous:
        return ctx.node, Repair.LINK
    if "wait_cool" in ctx.previous:
        return ctx.node, Repair.COOL
    return ctx.node, Repair.MANUAL


def _gate_plan(ctx: StepContext, node: str, repair: Repair, key: str, *,
               known_model: str = "") -> gate.GatePlan:
    return gate_plan(node, repair, key, _node_pool(ctx, node), ctx.clients,
                     known_model=known_model)


def _gate_hold(ctx: StepContext, node: str, repair: Repair) -> None:
    """Before a repair that can put the node back into Slurm service by itself (a Slurm reboot:
    22.05 lifts the drain once the node is back, whatever nextstate says; a DOWN node under
    ReturnToService=2), hold it in a reservation of its own: nothing but the acceptance checks
    starts there; the gate adopts it. Nothing when no check would run after this repair."""
    plan = _gate_plan(ctx, node, repair, f"r{ctx.remediation_id}-hold")
    if not plan.checks or plan.scheduler == gate.KUBERNETES:
        return  # (Kubernetes keeps a node's cordon through its reboot: the hold is that)
    current = ctx.clients.slurm.reservations()
    if any(r.name.startswith(RESERVATION_PREFIX) and r.nodes == (node,) for r in current):
        return  # held already (an earlier run of this step, a gate cut off)
    ctx.call("slurm.reserve", f"{node} ({plan.reservation})", ctx.clients.slurm.reserve,
             plan.reservation, node)


def prove_healthy(ctx: StepContext) -> Outcome:
    """The return-to-service gate (incidents/remediation/gate.py): acceptance checks on the
    repaired node as Slurm jobs in a reservation holding it; passed, it is in service.

    Failed: the node is drained again, the output recorded (audit trail, node page), and the
    step fails: the repair goes back to a person with the checks' verdict (a retry runs the
    checks again, from scratch); FLEETWATCH_GATE_RMA_AFTER failed gates of the node in a
    week mark it for RMA. Could not run: the node is held (drained) and the step fails saying
    why. Either way the resume step after this one never runs."""
    state = dict(ctx.state)
    node, repair = _gate_target(ctx)
    # Replaced after all (recover_node): a hold on the old node stays. It was marked DOWN,
    # and with ReturnToService=2 a DOWN node is back in service the moment its slurmd
    # registers: the reservation keeps it out until a gate (node_gate_start) adopts it.
    run = int(state.get("run", 0))
    current = dict(state.get("gate") or {})
    if not current or (current.get("done") and current.get("verdict") not in (gate.PASSED,
                                                                              gate.UNCHECKED)):
        # The first run, or a person's retry after a gate that did not pass: checks afresh.
        if current:
            state.setdefault("earlier", []).append(
                {k: current.get(k) for k in ("key", "verdict", "why")})
        run += 1
        current = {}
    key = f"r{ctx.remediation_id}-{run}"
    # The model an earlier poll found for this node (the state's node is always this one).
    known = str(state.get("gpu_model") or "") if state.get("node") == node else ""
    plan = _gate_plan(ctx, node, repair, key, known_model=known)
    progress = gate_poll(ctx.clients, plan, current, ctx.call, ctx.clock.now())
    state.update(run=run, gate=current, node=node, repair=str(repair),
                 checks=[c.name for c in plan.checks], chosen_by=plan.chosen_by,
                 gpu_model=plan.gpu_model)
    if ctx.facts is not None:
        ctx.facts.gate_record(node, {**current, "repair": str(repair), "status": progress.status,
                                     "detail": progress.detail,
                                     "checks": [c.name for c in plan.checks]})
    if progress.status == gate.RUNNING:
        return Wait(progress.detail, state)
    if progress.status in (gate.PASSED, gate.UNCHECKED):
        return Done(progress.detail, state)
    message = progress.detail
    if progress.status == gate.FAILED:
        failures = ctx.facts.gate_failures(node) if ctx.facts is not None else 1
        limit = int(settings.FLEETWATCH_GATE_RMA_AFTER)
        if failures >= limit and ctx.facts is not None and not current.get("rma"):
            ctx.facts.mark_rma(node, f"failed its acceptance checks {failures} times this week "
                               f"(FLEETWATCH_GATE_RMA_AFTER={limit}): {progress.detail}")
            current["rma"] = True
        message += (f"; {node} is drained and marked for RMA ({failures} failed gates this week)"
                    if current.get("rma") else
                    f"; {node} is drained ({failures} of {limit} failed gates before RMA); "
                    "repair it and retry this step to check it again")
    raise StepFailed(message, state)


def hold_switch_nodes(ctx: StepContext) -> Outcome:
    """Drain the switch's nodes so no new work lands where the network is gone. A node
    someone else already drained is left as it is, and is not FleetWatch's to release."""
    state = dict(ctx.state)
    held = state.setdefault("held", [])
    left = state.setdefault("already_drained", [])
    slurm = {n.name: n for n in ctx.clients.slurm.nodes()}
    for node in ctx.nodes:
        if node in held or node in left:
            continue
        seen = slurm.get(node)
        if seen is not None and seen.reason:
            # Drained already, by a person or by another FleetWatch repair (a node whose GPU
            # died stays drained after its replacement): not this incident's to release.
            left.append(node)
            continue
        result = ctx.call("slurm.drain", node, ctx.clients.slurm.drain, node,
                          f"{_reason(ctx)} {ctx.switch}".strip())
        (held if result.changed else left).append(node)
    return Done(f"holding new work off {len(held)} node(s) under {ctx.switch or 'the switch'}"
                + (f"; {len(left)} already drained (left as they are)" if left else ""), state)


def requeue_dead_jobs(ctx: StepContext) -> Outcome:
    """The jobs on the switch's nodes cannot talk any more: stop what still runs (it hangs in
    NCCL), requeue them and the ones that died."""
    state = dict(ctx.state)
    if "dead" not in state:
        state["dead"] = sorted(j.job_id for j in ctx.clients.slurm.jobs()
                               if j.state in ("NODE_FAIL", "FAILED", "TIMEOUT")
                               and set(j.nodes) & set(ctx.nodes))
    waiting = _stop_and_requeue(ctx, state, ctx.nodes)
    if waiting is not None:
        return waiting
    for job_id in state["dead"]:
        if job_id not in state["requeued"]:
            _requeue_job(ctx, job_id)
            state["requeued"].append(job_id)
    jobs = state["requeued"]
    return Done(f"requeued job(s) {', '.join(jobs)}" if jobs else "no jobs to requeue", state)


def wait_switch_healthy(ctx: StepContext) -> Outcome:
    stable, detail = _links_stable(ctx, ctx.nodes)
    return Done(detail, dict(ctx.state)) if stable else Wait(detail, dict(ctx.state))


def release_switch_nodes(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    held = ctx.previous.get("hold_switch_nodes", {}).get("held", [])
    done = state.setdefault("released", [])
    for node in held:
        if node not in done:
            ctx.call("slurm.resume", node, ctx.clients.slurm.resume, node)
            done.append(node)
    return Done(f"released {len(done)} node(s)", state)


def wait_cool(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    gpus = ctx.clients.telemetry.gpu_metrics([ctx.node])
    hot = [f"GPU {m.gpu} {m.temperature:.0f}C" for m in gpus
           if m.temperature is not None and m.temperature >= THERMAL_NORMAL_C]
    slowed = [f"GPU {m.gpu}" for m in gpus if m.clock_event_reasons & dcgm.THERMAL_BITS]
    if not gpus or hot or slowed:
        state.pop("cool_since", None)
        why = "no telemetry yet" if not gpus else "; ".join(
            ([f"hot: {', '.join(hot)}"] if hot else [])
            + ([f"thermal slowdown: {', '.join(slowed)}"] if slowed else []))
        return Wait(f"{ctx.node} not cool yet ({why})", state)
    state.setdefault("cool_since", ctx.clock.now())
    cool_for, need = ctx.clock.now() - state["cool_since"], _stable_seconds()
    if cool_for < need:
        return Wait(f"{ctx.node} cool for {cool_for:.0f}s of {need:.0f}s", state)
    return Done(f"{ctx.node}'s GPUs are back to normal temperatures", state)


def wait_node_back(ctx: StepContext) -> Outcome:
    state = dict(ctx.state)
    state.setdefault("since", ctx.clock.now())
    problems = _health_problems(ctx, ctx.node, slurm_down_ok=True)
    if not problems:
        return Done(f"{ctx.node} is back", {**state, "came_back": True})
    waited = ctx.clock.now() - state["since"]
    if waited >= float(settings.FLEETWATCH_NODE_BACK_MINUTES) * 60.0:
        return Done(f"{ctx.node} did not come back in {waited:.0f}s ({'; '.join(problems)})",
                    {**state, "came_back": False})
    return Wait(f"waiting for {ctx.node} to come back: {'; '.join(problems)}", state)


def replace_if_not_back(ctx: StepContext) -> Outcome:
    if ctx.previous.get("wait_node_back", {}).get("came_back", True):
        return Done(f"{ctx.node} came back: no replacement needed", {"replaced": False})
    return replace_node(ctx)


def notify_owner(ctx: StepContext) -> Outcome:
    if ctx.state.get("sent"):
        return Done("already notified", ctx.state)
    owners = sorted(set(ctx.jobs.values()) - {""})
    jobs = ", ".join(sorted(ctx.jobs)) or "a job"
    subject = f"FleetWatch incident {ctx.incident_id}: job {jobs} failed in its own code"
    result = ctx.call("notify", ", ".join(owners) or "on-call", ctx.clients.notifier.notify,
                      subject, ctx.explanation,
                      {"incident": ctx.incident_id, "root_cause": ctx.root_cause,
                       "jobs": sorted(ctx.jobs), "owners": owners,
                       "delivery_key": f"incident-{ctx.incident_id}-remediation-"
                                       f"{ctx.remediation_id}-owner"})
    # Each owner on their own channel too, with the job's page (their code, said plainly).
    for job_id in sorted(ctx.jobs):
        _owner_message(ctx, job_id, f"Your Slurm job {job_id} failed in its own code",
                       f"Job {job_id} stopped on an application error ({ctx.explanation}); the "
                       f"fleet was healthy (incident {ctx.incident_id}). FleetWatch did not "
                       "requeue it.", "job.failed")
    return Done(f"told {', '.join(owners) or 'the on-call channel'}: {result.detail}",
                {"sent": True, "owners": owners})


def mark_rma(ctx: StepContext) -> Outcome:
    if ctx.state.get("marked"):
        return Done(f"{ctx.node} marked for RMA", ctx.state)
    why = f"incident {ctx.incident_id}: {ctx.root_cause} again"
    if ctx.facts is not None:
        ctx.facts.mark_rma(ctx.node, why)
    return Done(f"{ctx.node} marked for RMA ({why})", {"marked": True})


def wait_checkpoint(ctx: StepContext) -> Outcome:
    """Wait for the next checkpoint of the jobs on the node (fail-slow: the job still makes
    progress, so the node is taken out right after it saved its work, not in the middle of an
    interval). A checkpoint is known from the job's own report (the training step of its last
    checkpoint, where the scheduler's client reads one) or from its output (a checkpoint line
    in the job log). The wait is bounded (FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES): past it,
    or when no job runs there, the repair goes on and says why."""
    state = dict(ctx.state)
    now = ctx.clock.now()
    state.setdefault("since", now)
    jobs = {j.job_id: j for j in ctx.clients.slurm.jobs()}
    if "jobs" not in state:
        running = [j for j in jobs.values()
                   if j.state == "RUNNING" and ctx.node in j.nodes and _holds(j, ctx.node, ctx.gpus)]
        state["jobs"] = sorted(j.job_id for j in running)
        state["checkpoint_before"] = {j.job_id: j.checkpoint_step for j in running}
    if not state["jobs"]:
        return Done(f"no job runs on {ctx.node}: nothing to wait for", state)
    facts = ctx.facts
    saved = dict(state.get("saved", {}))
    for job_id in state["jobs"]:
        if job_id in saved:
            continue
        job = jobs.get(job_id)
        before = state["checkpoint_before"].get(job_id)
        logged = facts.last_checkpoint(job_id) if facts is not None else None
        if job is None or job.state != "RUNNING":
            saved[job_id] = f"job {job_id} is no longer running"
        elif job.checkpoint_step is not None and before is not None \
                and job.checkpoint_step > before:
            saved[job_id] = f"job {job_id} saved its checkpoint at step {job.checkpoint_step}"
        elif logged is not None and logged[0] >= state["since"]:
            step = f" (step {logged[1]})" if logged[1] is not None else ""
            saved[job_id] = f"job {job_id} wrote a checkpoint{step}, as its output says"
    state["saved"] = saved
    left = [j for j in state["jobs"] if j not in saved]
    if not left:
        return Done("; ".join(saved[j] for j in state["jobs"]) + f": taking {ctx.node} out now",
                    state)
    limit = float(settings.FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES) * 60.0
    waited = now - state["since"]
    if waited >= limit:
        state["timed_out"] = True
        return Done(f"no checkpoint from job {', '.join(left)} in {waited / 60:.0f} min "
                    "(FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES): taking "
                    f"{ctx.node} out now; the job resumes from its last checkpoint and repeats "
                    "the steps since", state)
    known = [j for j in left if (jobs[j].checkpoint_step is not None if j in jobs else False)]
    how = ("the scheduler reports the step of its last checkpoint" if known else
           "watching its output for a checkpoint line")
    last = ", ".join(f"job {j} last at step {state['checkpoint_before'].get(j)}" for j in known)
    return Wait(f"waiting for the next checkpoint of job {', '.join(left)} ({how}"
                f"{'; ' + last if last else ''}); {max(0.0, limit - waited) / 60:.0f} min left "
                "before it goes on without one", state)


@dataclass(frozen=True)
class StepKindSpec:
    """Everything about a step kind, in one place: adding a kind is one entry here.

    ``phase`` is the part of a repair its time counts towards (``incidents.phases``): drain,
    requeue, replace or resume; None for steps outside the repair's phases (notifications,
    checks). ``longest_wait`` is how long the step may keep waiting before it fails, in
    seconds, when that is longer than the ordinary step timeout (a job ending and GPUs cooling,
    a link staying up, a switch being fixed); None: the ordinary timeout.
    ``waits_for_node`` steps wait for a rebooted node to come back: their limit is the
    configured node-back time (FLEETWATCH_NODE_BACK_MINUTES) plus the ordinary timeout.
    """

    run: Callable[[StepContext], Outcome]
    phase: str | None = None
    longest_wait: float | None = None
    waits_for_node: bool = False


DRAIN, REQUEUE, REPLACE, RESUME = "drain", "requeue", "replace", "resume"
PHASES = (DRAIN, REQUEUE, REPLACE, RESUME)
DAY_S = 24 * 3600.0

STEP_KINDS: dict[str, StepKindSpec] = {
    "notify": StepKindSpec(notify),
    "drain_and_cancel": StepKindSpec(drain_and_cancel, DRAIN),
    "requeue": StepKindSpec(requeue, REQUEUE),
    "check_no_auto_replace": StepKindSpec(check_no_auto_replace),
    "cordon_and_drain": StepKindSpec(cordon_and_drain, DRAIN),
    "replace_node": StepKindSpec(replace_node, REPLACE),
    "resume": StepKindSpec(resume, RESUME),
    "drain": StepKindSpec(drain, DRAIN),
    "down_node": StepKindSpec(down_node, DRAIN),
    "reboot": StepKindSpec(reboot, REPLACE),
    "reboot_request": StepKindSpec(reboot_request, REPLACE),
    "reset_or_reboot": StepKindSpec(reset_or_reboot, REPLACE),
    "verify_fault_cleared": StepKindSpec(verify_fault_cleared, RESUME),
    "wait_link_stable": StepKindSpec(wait_link_stable, RESUME, longest_wait=DAY_S),
    "resume_node": StepKindSpec(resume_node, RESUME),
    "hold_switch_nodes": StepKindSpec(hold_switch_nodes, DRAIN),
    "requeue_dead_jobs": StepKindSpec(requeue_dead_jobs, REQUEUE),
    "wait_switch_healthy": StepKindSpec(wait_switch_healthy, RESUME, longest_wait=DAY_S),
    "release_switch_nodes": StepKindSpec(release_switch_nodes, RESUME),
    "wait_cool": StepKindSpec(wait_cool, RESUME, longest_wait=DAY_S),
    "wait_node_back": StepKindSpec(wait_node_back, RESUME, waits_for_node=True),
    "replace_if_not_back": StepKindSpec(replace_if_not_back, REPLACE),
    "notify_owner": StepKindSpec(notify_owner),
    "mark_rma": StepKindSpec(mark_rma, REPLACE),
    # Bounded by FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES itself (at most a day).
    "wait_checkpoint": StepKindSpec(wait_checkpoint, longest_wait=DAY_S),
    # The gate keeps its own clocks (a check job's time limit, FLEETWATCH_GATE_START_MINUTES).
    "prove_healthy": StepKindSpec(prove_healthy, RESUME, longest_wait=DAY_S),
}
assert all(spec.phase in (None, *PHASES) for spec in STEP_KINDS.values())

# The executor of each kind: a plain dict the engine looks up (tests patch entries in it).
EXECUTORS: dict[str, Callable[[StepContext], Outcome]] = {k: s.run for k, s in STEP_KINDS.items()}


def phase_of(kind: str) -> str | None:
    """The repair phase a step kind's time counts towards, or None."""
    spec = STEP_KINDS.get(kind)
    return spec.phase if spec else None


def step_timeout(kind: str) -> float:
    """Seconds a step of this kind may run (waiting included) before it fails."""
    spec = STEP_KINDS.get(kind)
    if spec is not None and spec.waits_for_node:
        return settings.FLEETWATCH_NODE_BACK_MINUTES * 60.0 + settings.FLEETWATCH_STEP_TIMEOUT_SECONDS
    longest = spec.longest_wait if spec is not None and spec.longest_wait is not None else 0.0
    return max(longest, float(settings.FLEETWATCH_STEP_TIMEOUT_SECONDS))
