"""The return-to-service gate: acceptance checks on a node before it goes back to Slurm service.

A GPU that passes an idle health check can still fail under load, so after a repair (a
replacement, a reboot, a GPU reset, a node that came back, a link or a temperature back to
normal, a lending) FleetWatch runs acceptance checks on the node and puts it back into service
only if they pass. How, as found on real Slurm 22.05 and 25.11 (tests/integration/test_gate.py):

1. **Hold.** A reservation ``fleetwatch-gate-<key>`` holding the node alone, for FleetWatch's
   own user (``SlurmClient.reserve``: flags MAINT, IGNORE_JOBS, no end). A DRAINED node runs no
   job, not even in a reservation, so the node is then resumed: from now on only jobs that name
   the reservation start there (a user job asking for that node stays PENDING, "ReqNodeNotAvail,
   May be reserved for other job"). A gate reservation already holding exactly this node is
   adopted (one a reboot step made to hold the node through its reboot, or one a gate cut off by
   a crash left). A node still in service is drained first (its jobs finish); a node drained by
   someone else is theirs, and the gate cannot run.
2. **Check.** Each check of the plan, one after the other, as a batch job in the reservation on
   the node alone (``--exclusive``, every GPU), its output into a file; the exit status is the
   verdict (0 passed; 77, 126, 127: could not check; anything else, a time limit or a node
   failure: failed). The first that does not pass ends the checks.
3. **Verdict.** Passed: the reservation is deleted, and the node, already resumed, is in
   service. Failed or could not run: the node is drained (again) (``fleetwatch: acceptance
   check ... failed``) *before* the reservation is deleted (nothing lands in between; a node
   drained already keeps its reason), and the checks' output goes into the audit trail and
   onto the node's page.

On a pool Kubernetes schedules (FLEETWATCH_KUBERNETES_POOLS) the same three steps run with
Kubernetes instead (incidents/remediation/gate_k8s.py: a cordon and a taint hold the node, the
checks are Jobs pinned to it, passed lifts the cordon); what does not depend on the scheduler
(the checks one after the other, the verdicts, the give-up limits, an outage) is here, behind
``Runner``.

A check that cannot run never resumes the node: Slurm unreachable, the node not answering, a
check job that does not start within ``start_seconds`` or a check program missing on the node
all end in "cannot_run" with the reason, the node held (drained, or still in its reservation
while Slurm is down).

Pure: no Django and no database. The caller hands in the Slurm client, a plan and the state
dict it keeps between polls (a step's result, a GateRun row), and ``call``: how an outside call
is made and audited (``StepContext.call``, or the gate service's own). Each poll is
idempotent: a call made before a crash is not made again (``call`` remembers it), a check job
is found again by its name, a reservation by its.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from collectors.clients.base import (
    SLURM_REASON_PREFIX,
    ActionResult,
    CheckJob,
    CheckJobSpec,
    ClientError,
    SlurmClient,
    node_or_none,
)
from collectors.knowledge.acceptance import (
    CHECK_JOB_PREFIX,
    EXITS_CANNOT_RUN,
    RESERVATION_PREFIX,
    threshold_env,
)

SLURM, KUBERNETES = "slurm", "kubernetes"
PASSED, FAILED, CANNOT_RUN, RUNNING, UNCHECKED = (
    "passed", "failed", "cannot_run", "running", "unchecked")
VERDICTS = (PASSED, FAILED, CANNOT_RUN, UNCHECKED)

# Job states that mean it is still to run or running (the rest have ended).
QUEUED = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD"})
ACTIVE = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "SIGNALING", "STOPPED",
                    "STAGE_OUT", "RESIZING"})
# How much of a check's output the gate keeps (the audit trail, the node's page).
OUTPUT_KEPT = 4000
# What the check job's PATH is: the script sets its own (FleetWatch's never goes along).
CHECK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Call = Callable[..., ActionResult]  # (verb, target, fn, *args) -> ActionResult, audited


@dataclass(frozen=True)
class PlannedCheck:
    name: str
    command: str  # the shell command line, {check_dir} already filled in
    minutes: int
    description: str = ""


@dataclass(frozen=True)
class GatePlan:
    """What one gate run does. ``key`` names its reservation and its jobs, so a run found
    again after a crash is recognised: unique per run (the step's or the GateRun's)."""

    key: str
    node: str
    repair: str
    checks: tuple[PlannedCheck, ...]
    chosen_by: str = ""  # the FLEETWATCH_GATE_CHECKS entry that chose them
    pool: str = ""
    output_dir: str = "/tmp"
    start_seconds: float = 1800.0  # a check job queued, or Slurm unreachable, this long: give up
    gpu_model: str = ""
    thresholds: Mapping[str, float] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=dict)  # FLEETWATCH_GATE_ENV
    # Where the checks run: SLURM, or KUBERNETES for a pool Kubernetes schedules
    # (FLEETWATCH_KUBERNETES_POOLS): then as Jobs of ``image`` in ``namespace``.
    scheduler: str = SLURM
    namespace: str = ""
    image: str = ""

    @property
    def reservation(self) -> str:
        return f"{RESERVATION_PREFIX}{self.key}"

    def job_name(self, check: str) -> str:
        return f"{CHECK_JOB_PREFIX}{self.key}-{check}"

    def output(self, check: str) -> str:
        return f"{self.output_dir.rstrip('/')}/{self.job_name(check)}-%j.out"


@dataclass(frozen=True)
class Progress:
    status: str  # running, passed, failed, cannot_run, unchecked
    detail: str

    @property
    def final(self) -> bool:
        return self.status != RUNNING


def check_script(plan: PlannedCheck, gate: GatePlan, gpus: int | None) -> str:
    """The batch script of one check: what it is in a comment, then the environment the check
    reads (its name, the node, the GPUs Slurm expects, the GPU model's thresholds, the site's
    FLEETWATCH_GATE_ENV), then its command; the command's exit status is the job's."""
    env = {"PATH": CHECK_PATH, "FLEETWATCH_CHECK": plan.name, "FLEETWATCH_NODE": gate.node,
           "FLEETWATCH_GATE": gate.key, "FLEETWATCH_REPAIR": gate.repair}
    if gpus:
        env["FLEETWATCH_EXPECT_GPUS"] = str(gpus)
    if gate.gpu_model:
        env["FLEETWATCH_GPU_MODEL"] = gate.gpu_model
    env |= threshold_env(gate.thresholds)
    env |= dict(gate.environment)
    lines = ["#!/bin/sh",
             f"# FleetWatch acceptance check {plan.name} on {gate.node} (gate {gate.key}, "
             f"after {gate.repair})"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += [plan.command, ""]
    return "\n".join(lines)


def result_line(output: str | None) -> dict[str, Any]:
    """The check's verdict line: the last line of its output that is a JSON object."""
    for line in reversed((output or "").splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return {}


def _summary(job: CheckJob, found: Mapping[str, Any]) -> str:
    failures = found.get("failures")
    if isinstance(failures, list) and failures:
        return "; ".join(str(f) for f in failures[:4])[:300]
    if job.state == "TIMEOUT":
        return "ran past its time limit (a check that hangs under load is a failure)"
    if job.exit_code in (126, 127):
        return f"exit {job.exit_code}: the check program is missing or not executable on the node"
    last = [line for line in (job.output or "").splitlines() if line.strip()]
    tail = last[-1].strip()[:200] if last else ""
    code = f"exit {job.exit_code}" if job.exit_code is not None else job.state
    return f"{job.state}, {code}" + (f": {tail}" if tail else "")


def check_verdict(job: CheckJob) -> str:
    if job.state == "COMPLETED" and job.exit_code == 0:
        return PASSED
    if job.exit_code in EXITS_CANNOT_RUN:
        return CANNOT_RUN
    if job.state in ("CANCELLED", "PREEMPTED", "DEADLINE", "BOOT_FAIL"):
        return CANNOT_RUN  # stopped by someone or something else: it said nothing of the node
    return FAILED


class Wait(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def held_words(state: Mapping[str, Any], node: str) -> str:
    if state.get("reservation") and state.get("reserved") and not state.get("unreserved"):
        return f"{node} held in reservation {state['reservation']}"
    return f"{node} stays drained"


class Runner(Protocol):
    """Where the checks run: Slurm (a reservation, batch jobs) or Kubernetes (a cordon and a
    taint, Jobs; incidents/remediation/gate_k8s.py). Each method is one idempotent part of a
    poll; ``Wait`` means "not yet", a ClientError that Slurm or the API server is down
    (transient) or that the gate cannot run (permanent)."""

    scheduler: str  # "Slurm", "Kubernetes": in what the gate says

    def hold(self, plan: GatePlan, state: dict[str, Any], now: float) -> None: ...
    def submit(self, plan: GatePlan, check: PlannedCheck, state: dict[str, Any]) -> str: ...
    def read(self, plan: GatePlan, check: PlannedCheck, job_id: str) -> CheckJob | None: ...
    def forgotten(self, job_id: str) -> str: ...
    def output_at(self, plan: GatePlan, check: PlannedCheck, job_id: str) -> str: ...
    def finish(self, plan: GatePlan, state: dict[str, Any]) -> None: ...
    def held(self, state: Mapping[str, Any], node: str) -> str: ...


def gate_poll(slurm: SlurmClient, plan: GatePlan, state: dict[str, Any], call: Call,
              now: float) -> Progress:
    """Advance the gate on Slurm as far as it goes now; ``state`` is updated in place (save
    it)."""
    return poll(SlurmRunner(slurm, call), plan, state, now)


def poll(runner: Runner, plan: GatePlan, state: dict[str, Any], now: float) -> Progress:
    """Advance the gate as far as it goes now, wherever ``runner`` runs its checks."""
    if state.get("done"):
        return Progress(state["verdict"], state["why"])
    state.setdefault("started_at", now)
    state.setdefault("key", plan.key)
    if not plan.checks:
        state.update(verdict=UNCHECKED, done=True, why=(
            f"no acceptance check is configured for pool {plan.pool or '(none)'} after "
            f"{plan.repair} (FLEETWATCH_GATE_CHECKS{': ' + plan.chosen_by if plan.chosen_by else ''})"
            f": {plan.node} goes back unchecked"))
        return Progress(UNCHECKED, state["why"])
    try:
        if not state.get("verdict"):
            try:
                runner.hold(plan, state, now)
                _check(runner, plan, state, now)
            except Wait as wait:
                state.pop("unreachable_since", None)
                return Progress(RUNNING, wait.detail)
        runner.finish(plan, state)
        state.pop("unreachable_since", None)
        state["done"] = True
        return Progress(state["verdict"], state["why"])
    except ClientError as exc:
        if not exc.permanent:
            since = state.setdefault("unreachable_since", now)
            waited = now - since
            if waited < plan.start_seconds:
                return Progress(RUNNING, f"{runner.scheduler} did not answer ({exc}); "
                                f"{runner.held(state, plan.node)}; trying again "
                                f"({waited:.0f}s of {plan.start_seconds:.0f}s)")
            if not state.get("verdict"):
                _conclude(state, CANNOT_RUN, f"{runner.scheduler} did not answer for "
                          f"{waited:.0f}s ({exc})")
            # Even checks that passed leave the node held until their hold is lifted.
            return Progress(CANNOT_RUN, f"{state['why']}; not cleaned up yet: "
                            f"{runner.held(state, plan.node)}")
        if not state.get("verdict"):
            _conclude(state, CANNOT_RUN, str(exc))
            try:
                runner.finish(plan, state)
            except ClientError as again:
                return Progress(CANNOT_RUN, f"{state['why']}; clean-up failed ({again}): "
                                f"{runner.held(state, plan.node)}")
            state["done"] = True
            return Progress(state["verdict"], state["why"])
        # Refused while cleaning up: whatever the checks said, the node is not in service.
        return Progress(CANNOT_RUN, f"{state['why']}; clean-up refused ({exc}): "
                        f"{runner.held(state, plan.node)}")


def _conclude(state: dict[str, Any], verdict: str, why: str) -> None:
    state["verdict"], state["why"] = verdict, why


def give_up_after(plan: GatePlan, state: dict[str, Any], now: float, what: str) -> None:
    waited = now - float(state["started_at"])
    if waited >= plan.start_seconds:
        raise ClientError(f"{what} for {waited:.0f}s (FLEETWATCH_GATE_START_MINUTES)",
                          permanent=True)
    raise Wait(f"{what} ({waited:.0f}s of {plan.start_seconds:.0f}s)")


class SlurmRunner:
    """The checks as Slurm batch jobs in a reservation holding the node alone."""

    scheduler = "Slurm"

    def __init__(self, slurm: SlurmClient, call: Call) -> None:
        self.slurm, self.call = slurm, call

    def hold(self, plan: GatePlan, state: dict[str, Any], now: float) -> None:
        _hold(self.slurm, plan, state, self.call, now)

    def submit(self, plan: GatePlan, check: PlannedCheck, state: dict[str, Any]) -> str:
        name = plan.job_name(check.name)
        spec = CheckJobSpec(name=name, node=plan.node, reservation=state["reservation"],
                            script=check_script(check, plan, state.get("gpus")),
                            minutes=check.minutes, output=plan.output(check.name),
                            partition=state.get("partition", ""), gpus=state.get("gpus"))
        result = self.call("slurm.submit_check", f"{plan.node} {name}", self.slurm.submit_check,
                           spec)
        job_id = str(result.data.get("job_id") or "")
        if not job_id:  # made before a crash (skipped by call): found again by its name
            job_id = next((j.job_id for j in self.slurm.jobs() if j.name == name), "")
        return job_id

    def read(self, plan: GatePlan, check: PlannedCheck, job_id: str) -> CheckJob | None:
        return self.slurm.check_job(job_id, plan.output(check.name))

    def forgotten(self, job_id: str) -> str:
        return f"job {job_id} ended and slurmctld forgot it (MinJobAge) before its result was read"

    def output_at(self, plan: GatePlan, check: PlannedCheck, job_id: str) -> str:
        return plan.output(check.name).replace("%j", job_id)

    def finish(self, plan: GatePlan, state: dict[str, Any]) -> None:
        _finish(self.slurm, plan, state, self.call)

    def held(self, state: Mapping[str, Any], node: str) -> str:
        return held_words(state, node)


def _hold(slurm: SlurmClient, plan: GatePlan, state: dict[str, Any], call: Call,
          now: float) -> None:
    """Step 1: the node in a reservation of its own, and taking jobs there."""
    if state.get("resumed"):
        return
    node = node_or_none(slurm, plan.node)
    if node is None:
        give_up_after(plan, state, now, f"waiting for {plan.node} to register with Slurm")
        return
    flags = set(node.flags)
    ours = node.reason.startswith(SLURM_REASON_PREFIX)
    if "NOT_RESPONDING" in flags or (node.state == "DOWN" and not ours) or \
            node.state in ("FUTURE", "UNKNOWN"):
        give_up_after(plan, state, now, f"waiting for {plan.node} to answer Slurm "
                       f"({'+'.join((node.state, *node.flags))})")
    if "DRAIN" in flags and not ours:
        raise ClientError(f"{plan.node} was drained by someone else ({node.reason!r}): theirs "
                          "to release; no acceptance check runs on it", permanent=True)
    if not state.get("reservation"):
        mine = [r for r in slurm.reservations()
                if r.name.startswith(RESERVATION_PREFIX) and r.nodes == (plan.node,)]
        names = [r.name for r in mine]
        # Adopted: the hold a reboot step made, or one a gate cut off by a crash left.
        state["reservation"] = plan.reservation if plan.reservation in names or not names \
            else names[0]
        state["adopted"] = bool(names) and state["reservation"] != plan.reservation
        state["reserved"] = bool(names)
    reservation = state["reservation"]
    if not state.get("reserved"):
        if "DRAIN" not in flags and node.state != "DOWN":
            # In service: drain it first, so its jobs finish and no new one starts.
            call("slurm.drain", f"{plan.node} ({reservation})", slurm.drain, plan.node,
                 f"{SLURM_REASON_PREFIX} acceptance checks before service (gate {plan.key})")
            state["drained_by_gate"] = True
        running = sorted(j.job_id for j in slurm.jobs()
                         if plan.node in j.nodes and j.state in ACTIVE
                         and not j.name.startswith(CHECK_JOB_PREFIX))
        if running:
            raise Wait(f"waiting for job(s) {', '.join(running)} on {plan.node} to end "
                        "before its acceptance checks")
        call("slurm.reserve", f"{plan.node} ({reservation})", slurm.reserve, reservation,
             plan.node)
        state["reserved"] = True
    if "DRAIN" in flags or node.state == "DOWN" or state.get("drained_by_gate"):
        # Only reservation jobs may start now: a drained node would run none of them.
        call("slurm.resume", f"{plan.node} ({reservation})", slurm.resume, plan.node)
    state["resumed"] = True
    state.setdefault("partition", node.partition.split(",")[0] if node.partition else "")
    state.setdefault("gpus", node.gpus)


def _check(runner: Runner, plan: GatePlan, state: dict[str, Any], now: float) -> None:
    """Step 2: each check as a job on the held node, one after the other."""
    jobs: dict[str, str] = state.setdefault("jobs", {})
    submitted: dict[str, float] = state.setdefault("submitted", {})
    results: list[dict[str, Any]] = state.setdefault("results", [])
    done = {r["check"] for r in results}
    for check in plan.checks:
        if check.name in done:
            continue
        if check.name not in jobs:
            job_id = runner.submit(plan, check, state)
            if not job_id:
                raise ClientError(f"check job {plan.job_name(check.name)} was submitted but "
                                  f"{runner.scheduler} no longer holds it", permanent=True)
            jobs[check.name], submitted[check.name] = job_id, now
        job_id = jobs[check.name]
        job = runner.read(plan, check, job_id)
        if job is None:
            results.append({"check": check.name, "job_id": job_id, "verdict": CANNOT_RUN,
                            "summary": runner.forgotten(job_id)})
        elif job.state in QUEUED:
            waited = now - submitted.get(check.name, now)
            if waited >= plan.start_seconds:
                results.append({"check": check.name, "job_id": job_id, "verdict": CANNOT_RUN,
                                "state": job.state, "summary": (
                                    f"job {job_id} did not start in {waited:.0f}s "
                                    f"({job.state_reason or job.state}; "
                                    "FLEETWATCH_GATE_START_MINUTES)")})
            else:
                raise Wait(f"check {check.name} queued on {plan.node} (job {job_id}: "
                            f"{job.state_reason or job.state})")
        elif job.state in ACTIVE:
            raise Wait(f"check {check.name} running on {plan.node} (job {job_id}, up to "
                        f"{check.minutes} min)")
        else:
            found = result_line(job.output)
            verdict = check_verdict(job)
            results.append({
                "check": check.name, "job_id": job_id, "verdict": verdict, "state": job.state,
                "exit_code": job.exit_code, "summary": "passed" if verdict == PASSED
                else _summary(job, found),
                "result": found, "output": (job.output or "")[-OUTPUT_KEPT:],
                "output_readable": job.output is not None,
                "output_path": runner.output_at(plan, check, job_id)})
        last = results[-1]
        if last["verdict"] != PASSED:
            word = "failed" if last["verdict"] == FAILED else "could not run"
            _conclude(state, last["verdict"], f"acceptance check {check.name} {word} on "
                      f"{plan.node}: {last['summary']}")
            return
    _conclude(state, PASSED, f"{plan.node} passed {len(results)} acceptance check(s): "
              f"{', '.join(r['check'] for r in results)}")


def _finish(slurm: SlurmClient, plan: GatePlan, state: dict[str, Any], call: Call) -> None:
    """Step 3: passed, the reservation goes and the node is in service; otherwise the node is
    drained again first, then the reservation goes."""
    reservation = state.get("reservation", plan.reservation)
    # Drained whether or not the gate resumed it: a DOWN node (ReturnToService) or one a
    # reboot put back would otherwise be in service once its reservation is gone.
    if state["verdict"] != PASSED and not state.get("redrained"):
        why = " ".join(state["why"].split())[:220]
        call("slurm.drain", f"{plan.node} ({reservation}) after the checks", slurm.drain,
             plan.node, f"{SLURM_REASON_PREFIX} {why} (gate {plan.key})")
        state["redrained"] = True
    if state.get("reserved") and not state.get("unreserved"):
        call("slurm.unreserve", f"{plan.node} ({reservation})", slurm.unreserve, reservation)
        state["unreserved"] = True
