"""The simulated fleet: a small GPU cluster whose state lives in one JSON file.

It stands in for Slurm, Kubernetes, dcgm-exporter behind Prometheus and a node provider, behind
the same interfaces as the real clients (``collectors.clients.base``). The file is shared by the
web process, the Celery workers and the ``fleetwatch inject`` command; every access takes an
exclusive ``flock`` and advances the simulation to "now" first, so all processes see one fleet.

Time is compressed by ``speed``: a duration of N simulated seconds (a SIGTERM grace period, a
node's provisioning) takes N / speed real seconds. Training jobs take a step every
``STEP_SECONDS`` simulated seconds, checkpoint every ``CHECKPOINT_EVERY`` steps and on SIGTERM,
and resume from their latest checkpoint when Slurm starts them again. A job whose node loses a
GPU hangs (as NCCL does): it makes no more progress and cannot checkpoint on SIGTERM.

The node provider (``SimProvider``) replaces nodes from a spare pool, reboots them and resets
their GPUs. Its model of what a repair fixes is deliberately simple:

- a reboot, asked for as Slurm's ``scontrol reboot ASAP nextstate=RESUME`` would, drains the
  node at once and starts when no job runs on it; the node is down (Kubernetes NotReady, Slurm
  ``REBOOT_ISSUED``) for ``REBOOT_SECONDS`` simulated seconds, then comes back with every XID
  cleared except on a GPU that has fallen off the bus (XID 79): the sim treats that as dead
  hardware, which no reboot brings back. A node that still has such a GPU stays drained after
  its reboot (as a boot-time node health check would leave it); any other node is resumed;
- a GPU reset (``nvidia-smi --gpu-reset``) clears any fault of a GPU that is still on the bus
  (ECC/row-remap, NVLink, GSP timeouts: the classes a reset is documented to recover) and is
  refused for a fallen-off GPU, which the driver can no longer reach. It takes no simulated
  time, and needs the GPU idle: no running job on the node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import shlex
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from collectors.clients.base import (
    K8S_ANNOTATION_PREFIX,
    K8S_CORDON_REASON,
    K8S_CORDONED_BY,
    K8S_CORDONED_BY_FLEETWATCH,
    K8S_GATE,
    SLURM_NAME_PREFIX,
    SLURM_REASON_PREFIX,
    ActionResult,
    CheckJob,
    CheckJobSpec,
    ClientError,
    EventChanges,
    GpuFieldHistory,
    GpuHistory,
    GpuMetric,
    K8sNode,
    K8sPod,
    NicPort,
    NodeChanges,
    NotFound,
    PodCheckSpec,
    ProviderStatus,
    Replacement,
    SlurmJob,
    SlurmNode,
    SlurmReservation,
    Taint,
    TelemetryChanges,
    job_comment,
    job_comment_check,
    relabel_call,
    relabelled,
)
from collectors.clock import SYSTEM_CLOCK, Clock
from collectors.knowledge import dcgm
from collectors.knowledge.acceptance import CHECK_JOB_PREFIX, EXIT_CANNOT_RUN
from collectors.knowledge.xid import takes_gpu_out

State = dict[str, Any]

FORMAT = "fleetwatch-sim/1"
STEP_SECONDS = 6.0
CHECKPOINT_EVERY = 10
SIGTERM_EXIT_SECONDS = 10.0  # a healthy job saves its checkpoint and exits this fast
PROVISION_SECONDS = 120.0
REBOOT_SECONDS = 90.0  # POST, kernel, driver, kubelet and slurmd back up
LINK_FLAP_SECONDS = 5.0
SWITCH_DOWN_SECONDS = 30.0
# Test hook for the chaos tests: "k8s.evict=4,provider.replace=4" (and k8s.relabel) makes those actions sleep
# that many real seconds BEFORE they change anything (and before taking the fleet's lock), so
# a test can kill the worker inside the outside call, when the change has not happened yet.
ACTION_DELAY_ENV = "FLEETWATCH_SIM_ACTION_DELAY"
GPUS_PER_NODE = 8
# How long a simulated acceptance check runs (simulated seconds).
CHECK_SECONDS = 60.0

DEFAULT_JOBS: list[dict[str, Any]] = [
    {"id": "3001", "name": "llama-70b-pretrain", "user": "alice", "num_nodes": 8},
    {"id": "3002", "name": "moe-finetune", "user": "bob", "num_nodes": 4},
    {"id": "3003", "name": "vit-sweep", "user": "carol", "num_nodes": 4},
]


# --- the state file -------------------------------------------------------------------------


def _state_load(data: bytes) -> State:
    """The state file's contents. orjson: every call of every process reads the whole file,
    and at 5,000 nodes the json module's decoding was most of a remediation step's CPU (a
    storm's). The json module reads what orjson refuses (a file written before orjson wrote
    them, with NaN or integers past 64 bits), as it did then."""
    try:
        state = orjson.loads(data)
    except orjson.JSONDecodeError:
        state = json.loads(data)
    if not isinstance(state, dict):
        raise ClientError("the simulated fleet's state file holds no fleet", permanent=True)
    return state


class SimFleet:
    """Access to the shared state file. Every method is one locked read-advance-write.

    ``clock``: where "now" comes from. A test hands in a ``ManualClock`` and advances it
    instead of sleeping; everything else uses the machine's clock."""

    def __init__(self, path: Path, speed: float = 20.0, clock: Clock = SYSTEM_CLOCK) -> None:
        self.path = Path(path)
        self.speed = speed
        self.clock = clock

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the fleet's exclusive lock (a sibling ``.lock`` file, so the state file itself
        can be replaced atomically while it is held)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(self.path.suffix + ".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, state: State) -> None:
        # Every call of every process reads and rewrites the whole file: at 5,000 nodes
        # (7 MB) the json module's encoding took 80 ms of each, orjson's 13.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(state, option=orjson.OPT_SORT_KEYS
                                     | orjson.OPT_NON_STR_KEYS))
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[State]:
        with self._locked():
            if not self.path.exists():
                raise ClientError(
                    f"simulated fleet not seeded at {self.path}: run `manage.py fleetwatch seed`",
                    permanent=True,
                )
            state = _state_load(self.path.read_bytes())
            if state.get("format") != FORMAT:
                raise ClientError(f"{self.path} is not a {FORMAT} file", permanent=True)
            advance(state, self.clock.now(), self.speed)
            yield state
            self._write(state)

    def seed(self, *, nodes: int = 16, spares: int = 3, reset: bool = False) -> bool:
        """Create the fleet unless it exists. Returns True when a new fleet was written."""
        with self._locked():
            if self.path.exists() and not reset:
                return False
            now = self.clock.now()
            state = new_fleet(now, nodes=nodes, spares=spares)
            advance(state, now, self.speed)
            self._write(state)
            return True

    def snapshot(self) -> State:
        with self.transaction() as state:
            pass
        return state  # read for this call alone: written back as it is, no one else holds it


def new_fleet(now: float, *, nodes: int = 16, spares: int = 3) -> State:
    state: State = {
        "format": FORMAT,
        "created_at": now,
        "nodes": {},
        "pods": [],
        "jobs": {},
        "replacements": {},
        "down_sources": [],
        "next_job_id": 4001,
    }
    rng = random.Random(7)
    total = nodes + spares
    for i in range(1, total + 1):
        name = f"gpu-{i:03d}"
        spare = i > nodes
        leaf = "leaf-a" if (i <= nodes // 2 or (spare and i % 2)) else "leaf-b"
        state["nodes"][name] = {
            "leaf": leaf,
            "pool": "spare" if spare else "gpu",
            "in_service": not spare,
            "drained": False,
            "down": False,
            "reason": "",
            "unschedulable": False,
            "annotations": {},
            "ready": not spare,
            "provisioning_until": None,
            "nic": {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "link_downed": 0,
                    "up_at": None},
            "gpus": [
                {
                    "index": g,
                    "uuid": f"GPU-{rng.getrandbits(32):08x}-{i:03d}{g}",
                    "last_xid": 0,
                    "xid_at": None,
                    "fault_at": None,
                    "fallen_off": False,
                }
                for g in range(GPUS_PER_NODE)
            ],
        }
        if not spare:
            state["pods"].extend(_node_pods(name))
    for job in DEFAULT_JOBS:
        state["jobs"][job["id"]] = _new_job(job["id"], job["name"], job["user"], job["num_nodes"])
    return state


def _node_pods(node: str) -> list[dict[str, Any]]:
    return [
        {"namespace": "slurm", "name": f"slurmd-{node}", "node": node,
         "labels": {"app": "slurmd"}, "owner_kind": "StatefulSet"},
        {"namespace": "gpu-operator", "name": f"dcgm-exporter-{node}", "node": node,
         "labels": {"app": "dcgm-exporter"}, "owner_kind": "DaemonSet"},
    ]


def _new_job(job_id: str, name: str, user: str, num_nodes: int,
             gpus_per_node: int = GPUS_PER_NODE) -> dict[str, Any]:
    return {
        "id": job_id, "name": name, "user": user, "num_nodes": num_nodes,
        # Fewer GPUs than a node has: the job shares its node with others, as under Slurm's
        # --gres=gpu:N; "gpus" holds the indices it got on each node (gres_detail).
        "gpus_per_node": gpus_per_node, "gpus": {},
        "state": "PENDING", "nodes": [], "restart_count": 0,
        "started_at": None, "start_step": 0, "final_step": 0, "checkpoint_step": 0,
        "resumed_from_step": None, "stalled_at": None, "stopped_at": None, "exit_at": None, "exit_state": None,
        "history": [],
    }


# --- the simulation itself --------------------------------------------------------------------


def job_step(job: State, now: float, speed: float) -> int:
    if job["state"] != "RUNNING" or job["started_at"] is None:
        return int(job["final_step"])
    # A hung job stops at its fault; a signalled one stops training to write its checkpoint.
    end = min(t for t in (now, job["stalled_at"], job.get("stopped_at")) if t is not None)
    elapsed = max(0.0, end - job["started_at"]) * speed
    return int(job["start_step"] + elapsed // STEP_SECONDS)


def job_checkpoint(job: State, now: float, speed: float) -> int:
    """The latest checkpoint on disk: periodic ones, plus the one written on SIGTERM."""
    step = job_step(job, now, speed)
    periodic = (step // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
    return max(int(job["checkpoint_step"]), periodic if step > job["start_step"] else 0)


def advance(state: State, now: float, speed: float) -> None:
    nodes = state["nodes"]
    for name, node in nodes.items():
        until = node.get("provisioning_until")
        if until is not None and until <= now:
            _finish_provisioning(state, name, now)
        nic = node["nic"]
        if nic["up_at"] is not None and nic["up_at"] <= now:
            nic["state"], nic["up_at"] = "ACTIVE", None

    for job in state["jobs"].values():
        if job["state"] != "RUNNING":
            continue
        if job["stalled_at"] is None:
            fault = _earliest_fault(state, job)
            if fault is not None:
                job["stalled_at"] = max(fault, job["started_at"])
        if job["exit_at"] is not None and job["exit_at"] <= now:
            job["final_step"] = job_step(job, job["exit_at"], speed)
            job["checkpoint_step"] = job_checkpoint(job, job["exit_at"], speed)
            job["state"] = job["exit_state"] or "CANCELLED"
            job["history"].append({"at": job["exit_at"], "event": job["state"],
                                   "step": job["final_step"],
                                   "checkpoint": job["checkpoint_step"]})
            job["exit_at"] = job["exit_state"] = None
            job["stalled_at"] = job["stopped_at"] = None

    _advance_reboots(state, now, speed)
    _advance_checks(state, now, speed)
    _advance_pod_checks(state, now, speed)
    _schedule(state, now)


def _advance_reboots(state: State, now: float, speed: float) -> None:
    """Start requested reboots on nodes whose jobs have ended (ASAP), finish due ones."""
    busy: set[str] | None = None
    for name, node in state["nodes"].items():
        reboot = node.get("reboot")  # absent in fleets seeded before reboots existed
        if not reboot:
            continue
        if reboot["started_at"] is None:
            if busy is None:
                busy = _busy_nodes(state)
            if name in busy:
                continue  # ASAP: the node is drained meanwhile, its jobs finish first
            reboot["started_at"] = now
            reboot["until"] = now + REBOOT_SECONDS / speed
            node["ready"] = False  # the kubelet goes down with the machine
        if reboot["until"] is not None and reboot["until"] <= now:
            _finish_reboot(state, name)


def _finish_reboot(state: State, name: str) -> None:
    node = state["nodes"][name]
    reboot = node.pop("reboot")
    dead = []
    for g in node["gpus"]:
        if g["fallen_off"]:
            dead.append(g["index"])  # dead hardware: its XID 79 and its fault stay
            continue
        g["last_xid"], g["xid_at"], g["fault_at"] = 0, None, None
    node["ready"] = True
    node["reboots"] = node.get("reboots", 0) + 1
    node["last_reboot"] = {"reason": reboot["reason"], "finished_at": reboot["until"],
                           "dead_gpus": dead}
    if dead:
        # A boot-time health check finds the GPU missing: nextstate=RESUME does not happen.
        node["reason"] = (f"{SLURM_REASON_PREFIX} GPU {', '.join(map(str, dead))} still off "
                          "the bus after reboot")
    elif node["reason"] == reboot["reason"]:
        # nextstate=RESUME: back in service, from a drain or from DOWN alike.
        node["drained"] = node["down"] = False
        node["reason"] = ""


def _earliest_fault(state: State, job: State) -> float | None:
    """The first fault on a GPU the job holds (all of a node's when it took the whole node)."""
    held = job.get("gpus") or {}
    faults = [
        gpu["fault_at"]
        for name in job["nodes"]
        for gpu in state["nodes"][name]["gpus"]
        if gpu["fault_at"] is not None and (name not in held or gpu["index"] in held[name])
    ]
    return min(faults) if faults else None


def submit_job(state: State, name: str, user: str, *, num_nodes: int = 1,
               gpus_per_node: int = GPUS_PER_NODE) -> str:
    """Queue a job (it starts at the next advance() where GPUs are free)."""
    if not 1 <= gpus_per_node <= GPUS_PER_NODE:
        raise ClientError(f"gpus_per_node must be 1..{GPUS_PER_NODE}", permanent=True)
    job_id = str(state["next_job_id"])
    state["next_job_id"] += 1
    state["jobs"][job_id] = _new_job(job_id, name, user, num_nodes, gpus_per_node)
    return job_id


def _busy_nodes(state: State) -> set[str]:
    return {n for job in state["jobs"].values() if job["state"] == "RUNNING" for n in job["nodes"]}


def _used_gpus(state: State) -> dict[str, set[int]]:
    """The GPU indices the running jobs hold, per node."""
    used: dict[str, set[int]] = {}
    for job in state["jobs"].values():
        if job["state"] != "RUNNING":
            continue
        for n in job["nodes"]:
            held = (job.get("gpus") or {}).get(n)
            used.setdefault(n, set()).update(held if held is not None else range(GPUS_PER_NODE))
    return used


def _schedulable(node: State) -> bool:
    # A reserved node takes only its reservation's jobs (FleetWatch's acceptance checks).
    return (node["in_service"] and not node["drained"] and not node["down"]
            and not node.get("reserved_by"))


# --- acceptance checks: reservations and check jobs --------------------------------------------


def _advance_checks(state: State, now: float, speed: float) -> None:
    """Start a check job once its node takes jobs (in service, not drained, in the job's
    reservation, no job of anyone else on it); end it CHECK_SECONDS later with the verdict the
    node's GPUs give: a GPU with a fault (an XID that takes it out, fallen off the bus) fails
    it, as a burn-in would; ``set_check_verdict`` forces one for a test."""
    busy = _busy_nodes(state)
    for job in state.get("check_jobs", {}).values():
        node = state["nodes"].get(job["node"])
        if job["state"] == "PENDING" and node is not None:
            if (node["in_service"] and not node["drained"] and not node["down"]
                    and node.get("reserved_by") == job["reservation"]
                    and not node.get("reboot") and job["node"] not in busy):
                job.update(state="RUNNING", started_at=now, ends_at=now + CHECK_SECONDS / speed,
                           state_reason="")
            elif node.get("reserved_by") != job["reservation"]:
                job["state_reason"] = "ReqNodeNotAvail, May be reserved for other job"
            else:
                job["state_reason"] = f"ReqNodeNotAvail, UnavailableNodes:{job['node']}"
        if job["state"] == "RUNNING" and job["ends_at"] is not None and job["ends_at"] <= now:
            _check_verdict(job, node)


def _advance_pod_checks(state: State, now: float, speed: float) -> None:
    """The Kubernetes check Jobs (SimKubernetes.submit_check): a pod starts once its node is
    Ready and no other pod holds a GPU there, and tolerates every NoSchedule taint (a cordon
    included); it ends CHECK_SECONDS later with the verdict the Slurm check jobs give."""
    for job in state.get("pod_checks", {}).values():
        node = state["nodes"].get(job["node"])
        if job["state"] == "PENDING":
            if node is None or not node["in_service"]:
                job["state_reason"] = (f"Unschedulable: 0/{len(state['nodes'])} nodes are "
                                       f"available: node {job['node']} not found")
            elif not node["ready"]:
                job["state_reason"] = ("Unschedulable: 1 node(s) had untolerated taint "
                                       "{node.kubernetes.io/not-ready: }")
            elif any(p["node"] == job["node"] and p.get("gpus") for p in state["pods"]):
                job["state_reason"] = "Unschedulable: 1 Insufficient nvidia.com/gpu"
            else:
                job.update(state="RUNNING", started_at=now, ends_at=now + CHECK_SECONDS / speed,
                           state_reason="")
        if job["state"] == "RUNNING" and job["ends_at"] is not None and job["ends_at"] <= now:
            _check_verdict(job, node)
            job["state_reason"] = "" if job["exit_code"] == 0 else "BackoffLimitExceeded"


def _check_job_of(job: State | None) -> CheckJob | None:
    """A simulated check job (Slurm's or a Kubernetes Job) as the clients report it: its
    output only once it has ended."""
    if job is None:
        return None
    ended = job["state"] not in ("PENDING", "RUNNING")
    return CheckJob(job["id"], job["name"], job["state"], job["exit_code"], job["state_reason"],
                    (job["node"],) if job["started_at"] else (),
                    job["output"] if ended else None)


def _check_verdict(job: State, node: State | None) -> None:
    check = job["name"].rpartition("-")[2] if job["name"].startswith(CHECK_JOB_PREFIX) else ""
    bad = [] if node is None else [
        f"GPU {g['index']}: " + ("fallen off the bus" if g["fallen_off"] else
                                f"XID {g['last_xid']}")
        for g in node["gpus"] if g["fallen_off"] or takes_gpu_out(g["last_xid"])]
    forced = (node or {}).get("check_verdict", "")
    if forced == "cannot_run":
        code, failures = EXIT_CANNOT_RUN, ["the simulated check program could not run"]
    elif forced == "fail" or bad:
        code, failures = 1, bad or ["simulated burn-in below the GPU model's figures"]
    else:
        code, failures = 0, []
    result = {"check": check, "node": job["node"], "ok": code == 0, "simulated": True,
              "gpus": GPUS_PER_NODE - len(bad), "failures": failures}
    job.update(state="COMPLETED" if code == 0 else "FAILED", exit_code=code,
               state_reason="" if code == 0 else "NonZeroExitCode",
               output=f"simulated acceptance check on {job['node']}\n{json.dumps(result)}\n")


def set_check_verdict(state: State, node: str, verdict: str) -> str:
    """Make the node's next acceptance checks pass (""), fail ("fail") or find themselves
    unable to run ("cannot_run"), whatever its GPUs say (a test's hook)."""
    if verdict not in ("", "fail", "cannot_run"):
        raise ClientError(f"no check verdict {verdict!r} (\"\", fail, cannot_run)",
                          permanent=True)
    _node(state, node)["check_verdict"] = verdict
    return f"acceptance checks on {node} will {verdict or 'pass'}"


def _schedule(state: State, now: float) -> None:
    """Slurm's backfill in miniature: start pending jobs, oldest first, where enough GPUs are
    free (the lowest free indices, as Slurm's GRES selection gives them)."""
    used = _used_gpus(state)
    for job_id in sorted(state["jobs"], key=int):
        job = state["jobs"][job_id]
        if job["state"] != "PENDING" or job.get("held"):
            continue
        want = int(job.get("gpus_per_node", GPUS_PER_NODE))
        free = {n: [g for g in range(GPUS_PER_NODE) if g not in used.get(n, set())]
                for n, node in sorted(state["nodes"].items()) if _schedulable(node)}
        fits = [n for n, idle in free.items() if len(idle) >= want]
        if len(fits) < job["num_nodes"]:
            continue
        chosen = fits[: job["num_nodes"]]
        gpus = {n: free[n][:want] for n in chosen}
        resume = int(job["checkpoint_step"])
        job.update(state="RUNNING", nodes=chosen, gpus=gpus, started_at=now, start_step=resume,
                   final_step=resume, stalled_at=None, stopped_at=None, exit_at=None)
        job["resumed_from_step"] = resume if job["restart_count"] else None
        if job.get("submitted_at") is None:  # queued by the seed: submitted when it started
            job["submitted_at"] = now
        job["history"].append({"at": now, "event": "RUNNING", "nodes": chosen,
                               "resumed_from": resume})
        for n in chosen:
            used.setdefault(n, set()).update(gpus[n])


def _finish_provisioning(state: State, name: str, now: float) -> None:
    node = state["nodes"][name]
    replaces = node.get("replaces", "")
    node.update(
        provisioning_until=None, in_service=True, pool="gpu", ready=True, drained=True,
        reason=f"{SLURM_REASON_PREFIX} replacement for {replaces}, awaiting health check",
    )
    state["pods"].extend(_node_pods(name))
    if replaces in state["replacements"]:
        state["replacements"][replaces]["ready_at"] = now


# --- fault injection ------------------------------------------------------------------------


def inject_xid(state: State, node: str, gpu: int, code: int, now: float) -> str:
    target = _node(state, node)
    if not 0 <= gpu < len(target["gpus"]):
        raise ClientError(f"{node} has no GPU {gpu}", permanent=True)
    g = target["gpus"][gpu]
    g["last_xid"], g["xid_at"] = code, now
    if takes_gpu_out(code) and g["fault_at"] is None:  # the job on it hangs
        g["fault_at"] = now
    if code == 79:
        g["fallen_off"] = True
    return f"XID {code} on {node} GPU {gpu}"


def inject_link_flap(state: State, node: str, count: int, now: float, speed: float) -> str:
    nic = _node(state, node)["nic"]
    nic["link_downed"] += count
    nic["state"], nic["up_at"] = "DOWN", now + LINK_FLAP_SECONDS / speed
    return f"{node} {nic['device']} port {nic['port']} flapped {count} time(s)"


def inject_switch_down(state: State, switch: str, now: float, speed: float) -> str:
    members = [n for n, node in state["nodes"].items()
               if node["leaf"] == switch and node["in_service"]]
    if not members:
        raise ClientError(f"no in-service nodes under switch {switch!r}", permanent=True)
    for name in members:
        nic = state["nodes"][name]["nic"]
        nic["link_downed"] += 1
        nic["state"], nic["up_at"] = "DOWN", now + SWITCH_DOWN_SECONDS / speed
    return f"{switch} down: {len(members)} nodes lost their link"


def finish_job(state: State, job_id: str, now: float) -> str:
    """A running job ends on its own (its training done): its nodes fall idle. The demo's way
    to free a node, e.g. a canary for the fire drills."""
    job = state["jobs"].get(job_id)
    if job is None:
        raise ClientError(f"unknown job {job_id!r}", permanent=True)
    if job["state"] != "RUNNING":
        raise ClientError(f"job {job_id} is {job['state']}, not running", permanent=True)
    job["exit_at"], job["exit_state"] = now, "COMPLETED"
    return f"job {job_id} finished; {', '.join(job['nodes'])} idle"


def inject_slow(state: State, node: str, gpu: int, how: str, percent: float, now: float,
                minutes_ago: float = 0.0) -> str:
    """A GPU (``gpu`` -1: every GPU of the node) alive but slower than its peers from now on
    (or from ``minutes_ago`` minutes ago, so a demo need not wait for the slowness to count
    as sustained): see ``SLOW_KINDS``."""
    target = _node(state, node)
    if not (math.isfinite(percent) and math.isfinite(minutes_ago)):
        # (The state file would keep it as null, which no later read takes.)
        raise ClientError("--percent and --minutes-ago must be numbers", permanent=True)
    if how not in SLOW_KINDS:
        raise ClientError(f"unknown slowness {how!r} (one of {', '.join(SLOW_KINDS)})",
                          permanent=True)
    if how in ("clock", "power-cap", "nvlink-bandwidth") and not 0 < percent < 100:
        raise ClientError(f"--percent must be between 0 and 100, not {percent:g}",
                          permanent=True)
    if gpu >= len(target["gpus"]):
        raise ClientError(f"{node} has no GPU {gpu}", permanent=True)
    gpus = target["gpus"] if gpu < 0 else [target["gpus"][gpu]]
    for g in gpus:
        g["slow"] = {"kind": how, "percent": percent, "since": now - minutes_ago * 60.0}
    where = f"{node} GPU {gpu}" if gpu >= 0 else f"every GPU of {node}"
    return f"{where} slow: {_slow_words(how, percent)}" + (
        f", since {minutes_ago:g} min ago" if minutes_ago else "")


def _slow_words(how: str, percent: float) -> str:
    return {"clock": f"SM clock {percent:g}% lower", "power-cap": f"power capped {percent:g}% "
            "lower", "pcie-gen": "PCIe link trained at Gen3", "pcie-width":
            "PCIe link trained at x8", "nvlink-bandwidth": f"NVLink traffic {percent:g}% lower"}[how]


def set_no_auto_replace(state: State, node: str, enabled: bool) -> str:
    _node(state, node)
    for pod in state["pods"]:
        if pod["node"] == node and pod["owner_kind"] != "DaemonSet":
            if enabled:
                pod["labels"]["fleetwatch.io/no-auto-replace"] = "true"
            else:
                pod["labels"].pop("fleetwatch.io/no-auto-replace", None)
    return f"no-auto-replace {'set' if enabled else 'cleared'} on the pods of {node}"


def set_source_down(state: State, source: str, down: bool) -> str:
    sources = set(state["down_sources"])
    (sources.add if down else sources.discard)(source)
    state["down_sources"] = sorted(sources)
    return f"source {source} {'down' if down else 'up'}"


def _node_labels(node: State) -> dict[str, str]:
    """The node's Kubernetes labels: the pool and zone the fleet gives it, with what
    ``relabel`` set and removed (absent in fleets written before labels could change)."""
    labels = {"fleetwatch.io/pool": node["pool"], "topology.kubernetes.io/zone": node["leaf"]}
    for key in node.get("labels_removed") or []:
        labels.pop(key, None)
    return {**labels, **(node.get("labels") or {})}


def _node_taints(node: State) -> tuple[Taint, ...]:
    return tuple((str(k), str(v), str(e)) for k, v, e in node.get("taints") or [])


def _node(state: State, name: str) -> State:
    try:
        return state["nodes"][name]
    except KeyError:
        raise ClientError(f"unknown node {name!r}", permanent=True) from None


def _action_delay(action: str, clock: Clock) -> None:
    """Sleep as FLEETWATCH_SIM_ACTION_DELAY asks for ``action`` (see ACTION_DELAY_ENV)."""
    for item in os.environ.get(ACTION_DELAY_ENV, "").split(","):
        name, _, seconds = item.partition("=")
        if name.strip() == action and seconds.strip():
            clock.sleep(float(seconds))


def _check_source(state: State, source: str) -> None:
    if source in state["down_sources"]:
        raise ClientError(f"{source} unreachable (simulated outage)")


def _reboot(state: State, node: str, reason: str, now: float, speed: float) -> ActionResult:
    """``scontrol reboot ASAP nextstate=RESUME``, as Slurm and the node provider both ask for
    it: drained at once, rebooted once no job runs on it, resumed when it is back."""
    reason = " ".join(reason.split())
    if not reason.startswith(SLURM_REASON_PREFIX):
        reason = f"{SLURM_REASON_PREFIX} {reason}".rstrip()
    call = (f"scontrol reboot ASAP nextstate=RESUME {shlex.quote(f'reason={reason}')} "
            f"{node}")
    target = _node(state, node)
    pending = target.get("reboot")
    if pending:  # idempotent: one reboot at a time, a retry reports its progress
        what = "in progress" if pending["started_at"] is not None else "requested"
        return ActionResult(call, False, f"{node} reboot already {what}",
                            {"reason": pending["reason"]})
    if not target["in_service"]:
        raise ClientError(f"{node} is not in service ({target['pool']}): nothing to "
                          "reboot", permanent=True)
    held = target["drained"] or target["down"]
    if held and not target["reason"].startswith(SLURM_REASON_PREFIX):
        # nextstate=RESUME would undo a person's drain: that is theirs to lift.
        raise ClientError(f"{node} was drained by someone else ({target['reason']!r}); "
                          "not rebooting it with nextstate=RESUME", permanent=True)
    target["reboot"] = {"reason": reason, "requested_at": now, "started_at": None,
                        "until": None}
    target["drained"], target["reason"] = True, reason  # ASAP drains at once
    _advance_reboots(state, now, speed)
    started = target["reboot"]["started_at"] is not None
    return ActionResult(call, True, f"{node} rebooting" if started else
                        f"{node} reboot requested: waiting for its jobs to end",
                        {"reboot_seconds": REBOOT_SECONDS})


# --- every GPU's figures, and stragglers (fail-slow) -------------------------------------------
#
# What dcgm-exporter would report of each GPU at a time: clocks, power, utilisation, memory
# and NVLink traffic, the PCIe link. Derived from the state (which job ran there since when,
# an injected slowness since when), so any time in the past has its reading, the same at every
# call: a scrape's values are seeded by the GPU and the 15 s slot. A slow GPU holds its whole
# job back: its peers wait for it at every collective, so their utilisation and traffic drop
# while it stays busy. An idle GPU runs its clocks down and its PCIe link at Gen1 (power
# saving), as real ones do.

NOMINAL_SM_CLOCK = 1980.0   # an H100 SXM's SM clock under load, MHz
IDLE_SM_CLOCK = 345.0
NOMINAL_POWER_W = 660.0  # under load; never above the 700 W limit (H100_POWER_LIMIT_W)
IDLE_POWER_W = 70.0
NVLINK_BYTES_PER_S = 180e9
PCIE_BYTES_PER_S = 12e9
DRAM_ACTIVE = 0.58
PCIE_MAX_GEN, PCIE_MAX_WIDTH = 5, 16
SCRAPE_SLOT_S = 15.0
# What ``inject slow --how`` can make a GPU: its SM clock held lower, a power cap (clocks
# follow, and the GPU says so in its clock-event reasons), a PCIe link trained at Gen3 or x8,
# NVLink traffic lower (links down, say).
SLOW_KINDS = ("clock", "power-cap", "pcie-gen", "pcie-width", "nvlink-bandwidth")
FIGURE_FIELDS = (dcgm.SM_CLOCK, dcgm.POWER_USAGE, dcgm.GPU_UTIL, dcgm.PROF_DRAM_ACTIVE,
                 dcgm.NVLINK_BANDWIDTH_TOTAL, dcgm.PROF_PCIE_TX_BYTES, dcgm.PROF_PCIE_RX_BYTES,
                 dcgm.PCIE_LINK_GEN, dcgm.PCIE_LINK_WIDTH, dcgm.PCIE_MAX_LINK_GEN,
                 dcgm.PCIE_MAX_LINK_WIDTH, dcgm.CLOCKS_EVENT_REASONS)


def slow_effect(slow: Mapping[str, Any]) -> dict[str, float]:
    """How an injected slowness changes its GPU's readings (factors and levels), and how much
    it slows the GPU's job (``pace``: the share of time its peers spend waiting for it)."""
    p = float(slow.get("percent", 30.0)) / 100.0
    kind = slow.get("kind")
    if kind == "clock":
        return {"clock": 1 - p, "power": 1 - 0.6 * p, "pace": 0.8 * p}
    if kind == "power-cap":
        return {"power": 1 - p, "clock": 1 - 0.55 * p, "reasons": dcgm.SW_POWER_CAP,
                "pace": 0.45 * p}
    if kind == "pcie-gen":
        return {"gen": 3, "pace": 0.15}
    if kind == "pcie-width":
        return {"width": 8, "pace": 0.15}
    if kind == "nvlink-bandwidth":
        return {"nvlink_rate": 1 - p, "pace": 0.5 * p}
    return {}


class _GpuLife:
    """One GPU's working life (the runs of the jobs that held it, from their history) and the
    slowness of it and of its current job's other GPUs: read from the state once, then asked
    at many times."""

    def __init__(self, state: State, name: str, gpu: State) -> None:
        self.uuid = str(gpu["uuid"])
        self.slow = gpu.get("slow")
        self.peers: list[Mapping[str, Any]] = []
        # (start, end) of each run of a job on this GPU; end None: still running.
        self.runs: list[tuple[float, float | None]] = []
        for job in state["jobs"].values():
            held = (job.get("gpus") or {}).get(name)
            current = job["state"] == "RUNNING" and name in job["nodes"] and (
                held is None or gpu["index"] in held)
            start: float | None = None
            for event in job["history"]:
                if event["event"] == "RUNNING":
                    start = event["at"] if name in event.get("nodes", ()) else None
                elif start is not None and "checkpoint" in event:  # the run ended
                    self.runs.append((start, event["at"]))
                    start = None
            if current and start is not None:
                # A job hung on a fault stops working at it (as NCCL does).
                self.runs.append((start, job["stalled_at"]))
                for other in job["nodes"]:
                    mine = (job.get("gpus") or {}).get(other)
                    self.peers += [g["slow"] for g in state["nodes"][other]["gpus"]
                                   if g.get("slow") and g is not gpu
                                   and (mine is None or g["index"] in mine)]
        self.runs.sort(key=lambda r: r[0])
        rng = random.Random(self.uuid)
        self.nvlink_base = rng.uniform(1e12, 9e12)

    def busy(self, t: float) -> bool:
        return any(start <= t and (end is None or t < end) for start, end in self.runs)

    def busy_seconds(self, t: float, since: float | None = None) -> float:
        """Seconds it worked up to ``t`` (from ``since`` on)."""
        total = 0.0
        for start, end in self.runs:
            begin = max(start, since) if since is not None else start
            stop = t if end is None else min(t, end)
            total += max(0.0, stop - begin)
        return total

    def at(self, t: float) -> dict[str, float]:
        rng = random.Random(f"{self.uuid}/{int(t // SCRAPE_SLOT_S)}")
        slow = self.slow if self.slow and self.slow["since"] <= t else None
        if not self.busy(t):
            return {dcgm.SM_CLOCK: IDLE_SM_CLOCK, dcgm.POWER_USAGE: round(
                IDLE_POWER_W + rng.uniform(-3, 3), 1), dcgm.GPU_UTIL: 0.0,
                dcgm.PROF_DRAM_ACTIVE: 0.0, dcgm.PROF_PCIE_TX_BYTES: 0.0,
                dcgm.PROF_PCIE_RX_BYTES: 0.0, dcgm.NVLINK_BANDWIDTH_TOTAL: self._nvlink(t),
                dcgm.PCIE_LINK_GEN: 1.0, dcgm.PCIE_LINK_WIDTH: float(PCIE_MAX_WIDTH),
                dcgm.PCIE_MAX_LINK_GEN: float(PCIE_MAX_GEN),
                dcgm.PCIE_MAX_LINK_WIDTH: float(PCIE_MAX_WIDTH),
                dcgm.CLOCKS_EVENT_REASONS: float(dcgm.GPU_IDLE)}
        fx = slow_effect(slow) if slow else {}
        # The peers of a straggler wait for it: the slowest one active sets the pace.
        wait = 0.0 if fx else max((slow_effect(s)["pace"] for s in self.peers
                                   if s["since"] <= t), default=0.0)
        clock = rng.choice((1950.0, 1965.0, 1980.0, 1980.0)) * fx.get("clock", 1.0)
        return {
            dcgm.SM_CLOCK: round(clock / 15) * 15.0,
            dcgm.POWER_USAGE: round(NOMINAL_POWER_W * rng.uniform(0.96, 1.05)
                                    * fx.get("power", 1.0) * (1 - 0.5 * wait), 1),
            dcgm.GPU_UTIL: float(round(min(100.0, rng.uniform(93, 99) + (3 if fx else 0))
                                       - 40 * wait)),
            dcgm.PROF_DRAM_ACTIVE: round(DRAM_ACTIVE * rng.uniform(0.96, 1.04) * (1 - wait), 3),
            dcgm.PROF_PCIE_TX_BYTES: round(PCIE_BYTES_PER_S * rng.uniform(0.9, 1.1)
                                           * (1 - wait)),
            dcgm.PROF_PCIE_RX_BYTES: round(PCIE_BYTES_PER_S * rng.uniform(0.9, 1.1)
                                           * (1 - wait)),
            dcgm.NVLINK_BANDWIDTH_TOTAL: self._nvlink(t),
            dcgm.PCIE_LINK_GEN: float(fx.get("gen", PCIE_MAX_GEN)),
            dcgm.PCIE_LINK_WIDTH: float(fx.get("width", PCIE_MAX_WIDTH)),
            dcgm.PCIE_MAX_LINK_GEN: float(PCIE_MAX_GEN),
            dcgm.PCIE_MAX_LINK_WIDTH: float(PCIE_MAX_WIDTH),
            dcgm.CLOCKS_EVENT_REASONS: float(fx.get("reasons", 0)),
        }

    def _nvlink(self, t: float) -> float:
        """The running total of NVLink traffic: its rate over the time the GPU worked, less
        what a slowness of its own took away since it began."""
        total = self.nvlink_base + NVLINK_BYTES_PER_S * self.busy_seconds(t)
        if self.slow and self.slow.get("kind") == "nvlink-bandwidth" and self.slow["since"] <= t:
            lost = 1.0 - slow_effect(self.slow).get("nvlink_rate", 1.0)
            total -= lost * NVLINK_BYTES_PER_S * self.busy_seconds(t, self.slow["since"])
        return float(round(total))


def gpu_figures(state: State, nodes: Iterable[str] | None, t: float
                ) -> dict[tuple[str, int], dict[str, float]]:
    """Every in-service GPU's figures at ``t`` (of ``nodes``, or all): what the simulated
    exporter prints beside the fields ``gpu_metrics`` has."""
    wanted = None if nodes is None else set(nodes)
    out = {}
    for name, node in sorted(state["nodes"].items()):
        if not node["in_service"] or (wanted is not None and name not in wanted):
            continue
        for g in node["gpus"]:
            if not g["fallen_off"]:
                out[(name, g["index"])] = _GpuLife(state, name, g).at(t)
    return out


# --- the clients ----------------------------------------------------------------------------


class _SimClient:
    source = ""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    @property
    def last_warnings(self) -> list[str]:
        return []  # the simulation's records always parse

    @contextlib.contextmanager
    def _state(self) -> Iterator[State]:
        with self.fleet.transaction() as state:
            _check_source(state, self.source)
            yield state


def _slurm_node(name: str, node: State, used: dict[str, set[int]]) -> SlurmNode:
    """A node of the state as Slurm would show it."""
    held = used.get(name, set())
    base = "DOWN" if node["down"] else (
        "ALLOCATED" if len(held) >= GPUS_PER_NODE else "MIXED" if held else "IDLE")
    flags: tuple[str, ...] = ("DRAIN",) if node["drained"] else ()
    reboot = node.get("reboot")
    if reboot:
        flags += ("REBOOT_ISSUED",) if reboot["started_at"] is not None \
            else ("REBOOT_REQUESTED",)
    if node.get("reserved_by"):
        flags += ("MAINTENANCE", "RESERVED")  # as Slurm shows a MAINT reservation
    return SlurmNode(name, base, flags, node["reason"], "gpu", GPUS_PER_NODE)


class SimSlurm(_SimClient):
    source = "slurm"

    def nodes(self) -> list[SlurmNode]:
        with self._state() as state:
            used = _used_gpus(state)
            return [_slurm_node(name, node, used) for name, node in sorted(state["nodes"].items())
                    if node["in_service"]]

    def node(self, name: str) -> SlurmNode:
        with self._state() as state:
            node = state["nodes"].get(name)
            if node is None or not node["in_service"]:  # a spare is no Slurm node yet
                raise NotFound(f"Invalid node name specified: {name} is not a node of this "
                               "cluster", permanent=True)
            return _slurm_node(name, node, _used_gpus(state))

    def topology(self) -> dict[str, list[str]]:
        with self._state() as state:
            leaves: dict[str, list[str]] = {}
            for name, node in sorted(state["nodes"].items()):
                leaves.setdefault(node["leaf"], []).append(name)
            return leaves

    def jobs(self) -> list[SlurmJob]:
        now, speed = self.fleet.clock.now(), self.fleet.speed
        with self._state() as state:
            return [
                SlurmJob(
                    job_id=job["id"], name=job["name"], user=job["user"], state=job["state"],
                    nodes=tuple(job["nodes"]), restart_count=job["restart_count"],
                    step=job_step(job, now, speed),
                    checkpoint_step=job_checkpoint(job, now, speed),
                    resumed_from_step=job["resumed_from_step"], started_at=job["started_at"],
                    state_reason="JobHeldUser" if job.get("held") else "",
                    gpus={n: tuple(g) for n, g in (job.get("gpus") or {}).items()}
                    if job["state"] != "PENDING" else {},
                    submitted_at=job.get("submitted_at"),
                    admin_comment=job.get("admin_comment", ""), comment=job.get("comment", ""),
                    gpus_requested=int(job["num_nodes"])
                    * int(job.get("gpus_per_node", GPUS_PER_NODE)),
                )
                for job in sorted(state["jobs"].values(), key=lambda j: int(j["id"]))
            ] + [
                # FleetWatch's check jobs, listed as squeue lists them.
                SlurmJob(job_id=job["id"], name=job["name"], user=job["user"],
                         state=job["state"], nodes=(job["node"],) if job["started_at"] else (),
                         started_at=job["started_at"], exit_code=job["exit_code"],
                         state_reason=job["state_reason"], submitted_at=job["submitted_at"])
                for job in sorted(state.get("check_jobs", {}).values(), key=lambda j: int(j["id"]))
            ]

    def drain(self, node: str, reason: str) -> ActionResult:
        call = f"scontrol update nodename={node} state=DRAIN reason={shlex.quote(reason)}"
        with self._state() as state:
            target = _node(state, node)
            if target["drained"]:
                return ActionResult(call, False, f"{node} already drained: {target['reason']}")
            target["drained"], target["reason"] = True, reason
            return ActionResult(call, True, f"{node} drained")

    def down(self, node: str, reason: str) -> ActionResult:
        """The simulated scheduler has no DOWN state of its own: a drain holds new work off
        just as well, and the step stops and requeues the node's jobs itself. The result names
        the drain it made."""
        result = self.drain(node, reason)
        return ActionResult(result.call, result.changed,
                            f"{result.detail} (the simulation drains for DOWN)", result.data)

    def resume(self, node: str) -> ActionResult:
        call = f"scontrol update nodename={node} state=RESUME"
        with self._state() as state:
            target = _node(state, node)
            if not target["drained"]:
                return ActionResult(call, False, f"{node} is not drained")
            if not target["reason"].startswith(SLURM_REASON_PREFIX):
                # Ownership: an administrator's drain is theirs to undo.
                raise ClientError(
                    f"{node} was drained by someone else ({target['reason']!r}); not resuming",
                    permanent=True,
                )
            target["drained"], target["reason"] = False, ""
            _schedule(state, self.fleet.clock.now())
            return ActionResult(call, True, f"{node} resumed")

    def reboot(self, node: str, reason: str) -> ActionResult:
        with self._state() as state:
            return _reboot(state, node, reason, self.fleet.clock.now(), self.fleet.speed)

    def cancel(self, job_id: str, signal: str, grace_seconds: int) -> ActionResult:
        call = f"scancel --signal={signal} --full {job_id}  # SIGKILL after {grace_seconds}s"
        now, speed = self.fleet.clock.now(), self.fleet.speed
        with self._state() as state:
            job = state["jobs"].get(job_id)
            if job is None:
                raise ClientError(f"unknown job {job_id}", permanent=True)
            if job["state"] != "RUNNING":
                return ActionResult(call, False, f"job {job_id} is {job['state']}")
            if job["exit_at"] is not None:
                return ActionResult(call, False, f"job {job_id} already signalled")
            if job["stalled_at"] is None:
                # A healthy loop catches SIGTERM, writes a checkpoint and exits promptly.
                job["checkpoint_step"] = job_step(job, now, speed)
                job["stopped_at"] = now
                exit_in = min(float(grace_seconds), SIGTERM_EXIT_SECONDS)
                detail = f"job {job_id} checkpointing at step {job['checkpoint_step']}"
            else:
                # A hung job never reaches its handler: Slurm kills it when the grace ends.
                exit_in = float(grace_seconds)
                detail = f"job {job_id} is hung; SIGKILL after the {grace_seconds}s grace"
            job["exit_at"], job["exit_state"] = now + exit_in / speed, "CANCELLED"
            job["history"].append({"at": now, "event": f"SIG{signal}", "grace": grace_seconds})
            return ActionResult(call, True, detail, {"exit_in_seconds": exit_in})

    def requeue(self, job_id: str) -> ActionResult:
        call = f"scontrol requeue {job_id}"
        now = self.fleet.clock.now()
        with self._state() as state:
            job = state["jobs"].get(job_id)
            if job is None:
                raise ClientError(f"unknown job {job_id}", permanent=True)
            if job["state"] in {"PENDING", "RUNNING"}:
                return ActionResult(call, False, f"job {job_id} is already {job['state']}")
            job["state"], job["nodes"], job["gpus"] = "PENDING", [], {}
            job["restart_count"] += 1
            job["submitted_at"] = now  # as Slurm does: a requeued job is submitted anew
            job["history"].append({"at": now, "event": "REQUEUED"})
            _schedule(state, now)
            return ActionResult(call, True, f"job {job_id} requeued "
                                f"(restart {job['restart_count']}, checkpoint step "
                                f"{job['checkpoint_step']})")

    def requeue_hold(self, job_id: str) -> ActionResult:
        """Requeue the job held: it waits, PENDING (reason JobHeldUser), and the simulated
        scheduler starts it no more (a person would ``scontrol release`` it)."""
        call = f"scontrol requeuehold {job_id}"
        now = self.fleet.clock.now()
        with self._state() as state:
            job = state["jobs"].get(job_id)
            if job is None:
                raise ClientError(f"unknown job {job_id}", permanent=True)
            if job.get("held"):
                return ActionResult(call, False, f"job {job_id} already held")
            if job["state"] == "RUNNING":
                return ActionResult(call, False, f"job {job_id} is already RUNNING")
            if job["state"] == "PENDING":
                job["held"] = True
                job["history"].append({"at": now, "event": "HELD"})
                return ActionResult(f"scontrol hold {job_id}", True, f"job {job_id} held")
            job["state"], job["nodes"], job["gpus"], job["held"] = "PENDING", [], {}, True
            job["restart_count"] += 1
            job["submitted_at"] = now
            job["history"].append({"at": now, "event": "REQUEUED_HELD"})
            return ActionResult(call, True, f"job {job_id} requeued and held")

    def set_comment(self, job_id: str, text: str, field: str) -> ActionResult:
        job_comment_check(field)
        key = "admincomment" if field == "admin_comment" else "comment"
        with self._state() as state:
            job = state["jobs"].get(job_id)
            if job is None:
                raise ClientError(f"unknown job {job_id}", permanent=True)
            wanted = job_comment(job.get(field, ""), text)
            call = f"scontrol update jobid={job_id} {key}={shlex.quote(wanted)}"
            if job.get(field, "") == wanted:
                return ActionResult(call, False, f"job {job_id} {field} already says it")
            job[field] = wanted
            return ActionResult(call, True, f"job {job_id} {field}: {wanted}",
                                {"field": field, "comment": wanted})


    # --- the return-to-service gate ------------------------------------------------------------

    def reservations(self) -> list[SlurmReservation]:
        with self._state() as state:
            return [SlurmReservation(name, (r["node"],), (r["user"],), ("MAINT", "IGNORE_JOBS"))
                    for name, r in sorted(state.get("reservations", {}).items())]

    def reserve(self, name: str, node: str) -> ActionResult:
        call = (f"scontrol create reservation ReservationName={name} Nodes={node} StartTime=now "
                "Duration=UNLIMITED Users=fleetwatch Flags=MAINT,IGNORE_JOBS")
        if not name.startswith(SLURM_NAME_PREFIX):
            raise ClientError(f"reservation {name!r} is not FleetWatch's; not touching it",
                              permanent=True)
        with self._state() as state:
            target = _node(state, node)
            reservations = state.setdefault("reservations", {})
            if name in reservations:
                if reservations[name]["node"] == node:
                    return ActionResult(call, False, f"reservation {name} already holds {node}")
                raise ClientError(f"reservation {name} exists holding {reservations[name]['node']}"
                                  f", not {node}", permanent=True)
            if target.get("reserved_by"):
                raise ClientError(f"{node} is already in reservation {target['reserved_by']}",
                                  permanent=True)
            reservations[name] = {"node": node, "user": "fleetwatch"}
            target["reserved_by"] = name
            return ActionResult(call, True, f"reservation {name} holds {node} (only "
                                "fleetwatch's jobs run there)")

    def unreserve(self, name: str) -> ActionResult:
        call = f"scontrol delete reservation={name}"
        if not name.startswith(SLURM_NAME_PREFIX):
            raise ClientError(f"reservation {name!r} is not FleetWatch's; not touching it",
                              permanent=True)
        with self._state() as state:
            found = state.setdefault("reservations", {}).pop(name, None)
            if found is None:
                return ActionResult(call, False, f"reservation {name} is gone already")
            cancelled = []
            for job in state.get("check_jobs", {}).values():
                if job["reservation"] == name and job["state"] in ("PENDING", "RUNNING"):
                    job.update(state="CANCELLED", exit_code=None, state_reason="")
                    cancelled.append(job["id"])
            node = state["nodes"].get(found["node"])
            if node is not None and node.get("reserved_by") == name:
                node["reserved_by"] = None
            _schedule(state, self.fleet.clock.now())
            return ActionResult(call, True, f"reservation {name} deleted" + (
                f"; check job(s) {', '.join(cancelled)} cancelled" if cancelled else ""))

    def submit_check(self, spec: CheckJobSpec) -> ActionResult:
        call = (f"sbatch --parsable --job-name={spec.name} --reservation={spec.reservation} "
                f"--nodelist={spec.node} --nodes=1 --exclusive --time={spec.minutes}")
        now = self.fleet.clock.now()
        with self._state() as state:
            _node(state, spec.node)
            checks = state.setdefault("check_jobs", {})
            for job in checks.values():
                if job["name"] == spec.name:
                    return ActionResult(call, False, f"check job {job['id']} ({spec.name}) "
                                        "already submitted", {"job_id": job["id"]})
            job_id = str(state["next_job_id"])
            state["next_job_id"] += 1
            checks[job_id] = {"id": job_id, "name": spec.name, "user": "fleetwatch",
                              "node": spec.node, "reservation": spec.reservation,
                              "minutes": spec.minutes, "state": "PENDING", "submitted_at": now,
                              "started_at": None, "ends_at": None, "exit_code": None,
                              "state_reason": "", "output": ""}
            _advance_checks(state, now, self.fleet.speed)
            return ActionResult(call, True, f"check job {job_id} submitted ({spec.name} on "
                                f"{spec.node})", {"job_id": job_id})

    def check_job(self, job_id: str, output: str = "") -> CheckJob | None:
        with self._state() as state:
            return _check_job_of(state.get("check_jobs", {}).get(str(job_id)))


class SimKubernetes(_SimClient):
    """Nodes and pods as the API would list them. No change feeds (no resourceVersions, no
    events): the collector lists the nodes each run."""

    source = "kubernetes"

    def node_changes(self, cursor: str | None, timeout_seconds: float) -> NodeChanges | None:
        return None

    def event_changes(self, cursor: dict[str, Any] | None,
                      timeout_seconds: float) -> EventChanges | None:
        return None

    def nodes(self) -> list[K8sNode]:
        with self._state() as state:
            return [
                K8sNode(name, node["ready"], node["unschedulable"], dict(node["annotations"]),
                        _node_labels(node), taints=_node_taints(node), gpus=len(node["gpus"]))
                for name, node in sorted(state["nodes"].items())
                if node["in_service"]
            ]

    def node(self, name: str) -> K8sNode:
        for node in self.nodes():
            if node.name == name:
                return node
        raise NotFound(f'nodes "{name}" not found', permanent=True)

    def slurm_nodes(self) -> None:
        return None  # the simulated fleet's Slurm and Kubernetes names are the same

    def pods_on_node(self, node: str) -> list[K8sPod]:
        with self._state() as state:
            # Running, and ready while their node is (the kubelet of a NotReady node stops
            # reporting; its pods' Ready turns False).
            ready = bool(_node(state, node)["ready"])
            return [
                K8sPod(p["namespace"], p["name"], p["node"], dict(p["labels"]), p["owner_kind"],
                       ready=ready, gpus=int(p.get("gpus", 0)))
                for p in state["pods"]
                if p["node"] == node
            ]

    def cordon(self, node: str, reason: str) -> ActionResult:
        call = (f"kubectl cordon {node} && kubectl annotate node {node} "
                f"{K8S_CORDONED_BY}=fleetwatch {K8S_CORDON_REASON}={shlex.quote(reason)}")
        with self._state() as state:
            target = _node(state, node)
            if target["unschedulable"]:
                return ActionResult(call, False, f"{node} already cordoned")
            target["unschedulable"] = True
            target["annotations"][K8S_CORDONED_BY] = K8S_CORDONED_BY_FLEETWATCH
            target["annotations"][K8S_CORDON_REASON] = reason
            return ActionResult(call, True, f"{node} cordoned")

    def uncordon(self, node: str) -> ActionResult:
        call = f"kubectl uncordon {node}"
        with self._state() as state:
            target = _node(state, node)
            if not target["unschedulable"]:
                return ActionResult(call, False, f"{node} is not cordoned")
            if target["annotations"].get(K8S_CORDONED_BY) != K8S_CORDONED_BY_FLEETWATCH:
                raise ClientError(f"{node} was cordoned by someone else; not uncordoning",
                                  permanent=True)
            target["unschedulable"] = False
            for key in [k for k in target["annotations"] if k.startswith(K8S_ANNOTATION_PREFIX)]:
                del target["annotations"][key]
            return ActionResult(call, True, f"{node} uncordoned")

    def relabel(self, node: str, labels: Mapping[str, str | None],
                add_taints: Sequence[Taint], remove_taints: Sequence[str],
                annotations: Mapping[str, str | None]) -> ActionResult:
        call = relabel_call(node, labels, add_taints, remove_taints, annotations)
        _action_delay("k8s.relabel", self.fleet.clock)
        with self._state() as state:
            target = _node(state, node)
            now = (_node_labels(target), _node_taints(target), dict(target["annotations"]))
            new_labels, new_taints, new_annotations = relabelled(
                *now, labels, add_taints, remove_taints, annotations)
            if (new_labels, new_taints, new_annotations) == now:
                return ActionResult(call, False, f"{node} already labelled and tainted so")
            # The pool and zone labels are the fleet's own: only what differs is kept.
            base = _node_labels({**target, "labels": {}, "labels_removed": []})
            target["labels"] = {k: v for k, v in new_labels.items() if base.get(k) != v}
            target["labels_removed"] = sorted(set(base) - set(new_labels))
            target["taints"] = [list(t) for t in new_taints]
            target["annotations"] = new_annotations
            return ActionResult(call, True, f"{node} labelled and tainted")

    def submit_check(self, spec: PodCheckSpec) -> ActionResult:
        call = f"kubectl create -n {spec.namespace} job {spec.name}  # on {spec.node}"
        now = self.fleet.clock.now()
        with self._state() as state:
            checks = state.setdefault("pod_checks", {})
            key = f"{spec.namespace}/{spec.name}"
            if key in checks:
                return ActionResult(call, False, f"check Job {key} exists already",
                                    {"job_id": spec.name})
            checks[key] = {"id": spec.name, "name": spec.name, "node": spec.node,
                           "labels": dict(spec.labels), "minutes": spec.minutes,
                           "state": "PENDING", "submitted_at": now, "started_at": None,
                           "ends_at": None, "exit_code": None, "state_reason": "no pod yet",
                           "output": ""}
            _advance_pod_checks(state, now, self.fleet.speed)
            return ActionResult(call, True, f"check Job {key} created on {spec.node}",
                                {"job_id": spec.name})

    def check_job(self, namespace: str, name: str) -> CheckJob | None:
        with self._state() as state:
            _advance_pod_checks(state, self.fleet.clock.now(), self.fleet.speed)
            return _check_job_of(state.get("pod_checks", {}).get(f"{namespace}/{name}"))

    def cancel_check(self, namespace: str, name: str) -> ActionResult:
        call = f"kubectl delete job -n {namespace} {name} --cascade=background"
        with self._state() as state:
            job = state.get("pod_checks", {}).get(f"{namespace}/{name}")
            if job is None:
                return ActionResult(call, False, f"check Job {namespace}/{name} is gone already")
            if K8S_GATE not in job["labels"]:
                raise ClientError(f"Job {namespace}/{name} is not FleetWatch's", permanent=True)
            del state["pod_checks"][f"{namespace}/{name}"]
            return ActionResult(call, True, f"check Job {namespace}/{name} deleted with its pod")

    def evict(self, namespace: str, pod: str) -> ActionResult:
        call = f"POST /api/v1/namespaces/{namespace}/pods/{pod}/eviction"
        _action_delay("k8s.evict", self.fleet.clock)
        with self._state() as state:
            for i, p in enumerate(state["pods"]):
                if p["namespace"] == namespace and p["name"] == pod:
                    if p["owner_kind"] == "DaemonSet":
                        raise ClientError(f"{namespace}/{pod} is a DaemonSet pod", permanent=True)
                    del state["pods"][i]
                    return ActionResult(call, True, f"{namespace}/{pod} evicted")
            return ActionResult(call, False, f"{namespace}/{pod} already gone")


class SimTelemetry(_SimClient):
    """dcgm-exporter's GPU fields as a PromQL query would return them, plus NIC counters."""

    source = "telemetry"

    def gpu_metrics(self, nodes: Sequence[str] | None = None) -> list[GpuMetric]:
        now = self.fleet.clock.now()
        wanted = None if nodes is None else set(nodes)
        with self._state() as state:
            running = {n: job for job in state["jobs"].values() if job["state"] == "RUNNING"
                       for n in job["nodes"]}
            rng = random.Random(int(now * 10))
            metrics = []
            for name, node in sorted(state["nodes"].items()):
                if not node["in_service"] or (wanted is not None and name not in wanted):
                    continue
                job = running.get(name)
                working = job is not None and job["stalled_at"] is None
                for g in node["gpus"]:
                    if g["fallen_off"]:
                        util, temp = None, None
                    else:
                        util = round(rng.uniform(88, 100), 1) if working else 0.0
                        temp = round(34 + (util or 0) * 0.35 + rng.uniform(-2, 2), 1)
                    metric = GpuMetric(name, g["index"], g["uuid"], util, temp,
                                       int(g["last_xid"]))
                    if g.get("slow") and working and not g["fallen_off"]:
                        # A straggler's power and clock-event reasons, as its history says.
                        figures = _GpuLife(state, name, g).at(now)
                        metric.power_w = figures[dcgm.POWER_USAGE]
                        metric.clock_event_reasons = int(figures[dcgm.CLOCKS_EVENT_REASONS])
                    metrics.append(metric)
            return metrics

    def nic_ports(self) -> list[NicPort]:
        with self._state() as state:
            return [
                NicPort(name, node["nic"]["device"], node["nic"]["port"], node["nic"]["state"],
                        int(node["nic"]["link_downed"]))
                for name, node in sorted(state["nodes"].items())
                if node["in_service"]
            ]

    def changes(self, cursor: Mapping[str, Any] | None,
                watch: Iterable[str] = ()) -> TelemetryChanges | None:
        return None  # no change feed: every poll reads the whole fleet

    def gpu_history(self, nodes: Sequence[str], start: datetime, end: datetime,
                    step_seconds: float = 15.0) -> GpuHistory:
        return {}  # the simulation keeps no history: a chart gets no points

    def gpu_readings(self, nodes: Sequence[str],
                     fields: Sequence[str]) -> dict[tuple[str, int], dict[str, float]]:
        """What dcgm-exporter would report now of these fields for the nodes' GPUs: the
        figures the GPU's history gives now (``_GpuLife``: clocks, power, PCIe link and
        traffic, a straggler's included), the rest as ``gpu_readings_of`` has them. Unknown
        and out-of-service nodes, and GPUs off the bus, have none."""
        wanted = set(nodes)
        now = self.fleet.clock.now()
        with self._state() as state:
            running = {n: job for job in state["jobs"].values() if job["state"] == "RUNNING"
                       for n in job["nodes"]}
            readings = {}
            for name in sorted(wanted & set(state["nodes"])):
                node = state["nodes"][name]
                if not node["in_service"]:
                    continue
                job = running.get(name)
                for g in node["gpus"]:
                    values = gpu_readings_of(g, job is not None, job is not None
                                             and job["stalled_at"] is None)
                    if values:
                        values.update(_GpuLife(state, name, g).at(now))
                    picked = {f: values[f] for f in fields if f in values}
                    if picked:
                        readings[(name, g["index"])] = picked
            return readings

    def gpu_field_history(self, nodes: Sequence[str], fields: Sequence[str], start: datetime,
                          end: datetime, step_seconds: float) -> GpuFieldHistory:
        """Derived from the state (see ``_GpuLife``), one point per step from ``start`` to
        ``end`` but never past now or before the fleet was made; a GPU off the bus and a node
        out of service (a spare) have none."""
        t0, t1 = start.timestamp(), end.timestamp()
        if t1 <= t0:
            raise ClientError(f"empty time range {start} .. {end}", permanent=True)
        step = max(float(step_seconds), (t1 - t0) / 11_000, 1.0)
        wanted = [f for f in dict.fromkeys(fields) if f in FIGURE_FIELDS]
        now = self.fleet.clock.now()
        history: GpuFieldHistory = {}
        with self._state() as state:
            first = max(t0, float(state["created_at"]))
            last = min(t1, now)
            for name in dict.fromkeys(nodes):
                node = state["nodes"].get(name)
                if node is None or not node["in_service"]:
                    continue
                for g in node["gpus"]:
                    if g["fallen_off"]:
                        continue
                    life = _GpuLife(state, name, g)
                    series: dict[str, list[tuple[float, float]]] = {f: [] for f in wanted}
                    t = math.ceil(first / step) * step
                    while t <= last:
                        values = life.at(t)
                        for f in wanted:
                            series[f].append((t, values[f]))
                        t += step
                    if any(series.values()):
                        history[(name, g["index"])] = {f: v for f, v in series.items() if v}
        return history


class SimProvider(_SimClient):
    """Spare capacity, reboots and GPU resets (see the module docstring for what each fixes).

    ``reboot`` stands in for Slurm's own reboot and names its call that way; ``reset_gpu``
    for ``nvidia-smi --gpu-reset`` run on the node."""

    source = "provider"

    def replace(self, node: str) -> Replacement:
        _action_delay("provider.replace", self.fleet.clock)
        now = self.fleet.clock.now()
        with self._state() as state:
            _node(state, node)
            existing = state["replacements"].get(node)
            if existing is not None:  # idempotent: one replacement per failed node
                new = existing["new_node"]
                return Replacement(node, new, state["nodes"][new]["provisioning_until"] is None,
                                   f"replacement {new} already requested")
            spares = [n for n, s in sorted(state["nodes"].items())
                      if s["pool"] == "spare" and s["provisioning_until"] is None]
            if not spares:
                raise ClientError("no spare capacity left")
            new = spares[0]
            spare = state["nodes"][new]
            spare.update(pool="provisioning", replaces=node,
                         provisioning_until=now + PROVISION_SECONDS / self.fleet.speed)
            state["nodes"][node]["pool"] = "rma"
            state["replacements"][node] = {"new_node": new, "requested_at": now,
                                           "ready_at": None}
            return Replacement(node, new, False, f"provisioning {new} from the spare pool")

    def replacement_status(self, node: str,
                           data: Mapping[str, object] | None = None) -> Replacement | None:
        with self._state() as state:
            existing = state["replacements"].get(node)
            if existing is None:
                return None
            new = existing["new_node"]
            ready = state["nodes"][new]["provisioning_until"] is None
            return Replacement(node, new, ready, "ready" if ready else "provisioning")

    def reboot(self, node: str, reason: str) -> ActionResult:
        with self._state() as state:
            return _reboot(state, node, reason, self.fleet.clock.now(), self.fleet.speed)

    def reset_gpu(self, node: str, gpu: int | None) -> ActionResult:
        call = (f"nvidia-smi --gpu-reset{'' if gpu is None else f' -i {gpu}'}  # on {node}")
        with self._state() as state:
            target = _node(state, node)
            if gpu is None:
                gpus = target["gpus"]
            elif 0 <= gpu < len(target["gpus"]):
                gpus = [target["gpus"][gpu]]
            else:
                raise ClientError(f"{node} has no GPU {gpu}", permanent=True)
            fallen = [g["index"] for g in gpus if g["fallen_off"]]
            if fallen:
                raise ClientError(f"GPU has fallen off the bus: reset cannot reach it ({node} GPU "
                                  f"{', '.join(map(str, fallen))})", permanent=True)
            if target.get("reboot"):
                raise ClientError(f"{node} is rebooting; reset its GPU once it is back")
            busy = [j["id"] for j in state["jobs"].values()
                    if j["state"] == "RUNNING" and node in j["nodes"]]
            if busy:
                # nvidia-smi refuses a GPU with processes on it: the job has to go first.
                raise ClientError(f"{node} GPU in use by job(s) {', '.join(busy)}: drain and "
                                  "requeue before a reset")
            faulty = [g for g in gpus if g["last_xid"] or g["fault_at"] is not None]
            if not faulty:
                return ActionResult(call, False, f"{node}: no GPU fault to reset")
            cleared = {str(g["index"]): g["last_xid"] for g in faulty}
            for g in faulty:
                g["last_xid"], g["xid_at"], g["fault_at"] = 0, None, None
            return ActionResult(call, True, f"{node}: reset GPU "
                                f"{', '.join(cleared)}; fault cleared", {"cleared_xids": cleared})

    def status(self, node: str) -> ProviderStatus:
        with self._state() as state:
            target = _node(state, node)
            reboot = target.get("reboot")
            if reboot:
                what = "in progress" if reboot["started_at"] is not None else \
                    "requested, waiting for jobs to end"
                return ProviderStatus(node, "rebooting", f"reboot {what}: {reboot['reason']}")
            if target["provisioning_until"] is not None:
                return ProviderStatus(node, "provisioning",
                                      f"provisioning to replace {target.get('replaces', '')}")
            replaced = state["replacements"].get(node)
            if replaced is not None:
                return ProviderStatus(node, "replaced", f"replaced by {replaced['new_node']}")
            fallen = [str(g["index"]) for g in target["gpus"] if g["fallen_off"]]
            if fallen:
                return ProviderStatus(node, "failed",
                                      f"GPU {', '.join(fallen)} fallen off the bus")
            faults = [f"GPU {g['index']} XID {g['last_xid']}" for g in target["gpus"]
                      if g["fault_at"] is not None]
            if faults:
                return ProviderStatus(node, "failed", "; ".join(faults))
            if not target["in_service"]:
                return ProviderStatus(node, "ready", "spare capacity, not in service")
            last = target.get("last_reboot")
            return ProviderStatus(node, "ready", f"up (rebooted {target.get('reboots', 0)} "
                                  f"time(s))" if last else "up")


# --- what dcgm-exporter reports of a simulated GPU ------------------------------------------

# An H100 SXM5 80GB (HBM3) on an HGX board: its power limit, boost and idle SM clocks, memory
# clock, usable framebuffer (MiB, less the driver's reservation) and PCIe link.
H100_POWER_LIMIT_W = 700.0
H100_SM_CLOCK_MHZ = (1980.0, 345.0)  # busy, idle
H100_MEM_CLOCK_MHZ = 2619.0
H100_FB_MIB = 81_030.0
H100_PCIE = (5.0, 16.0)  # generation, lanes
NVLINK_BUSY_BYTES = 120e9  # per direction, an all-reduce-heavy training job


def gpu_readings_of(gpu: State, holds_memory: bool, working: bool) -> dict[str, float]:
    """The dcgm-exporter fields a simulated GPU reports now (every ``NODE_PAGE_FIELDS`` name
    but the pre-3.2 clock field and the raw NVLink bandwidth counter): an H100 at work
    (``working``: a job making progress), idle, or holding a hung job's memory
    (``holds_memory``). A GPU off the bus (XID 79) reports nothing, as DCGM does. The error
    counters read 0, as the simulated exporter prints them (the simulation models faults as
    XIDs), so the page and a poll through Prometheus agree. Stable for a GPU in a given state
    (seeded by its UUID): two reads of a quiet fleet agree."""
    if gpu["fallen_off"]:
        return {}
    rng = random.Random(gpu["uuid"])
    power = 560 + rng.uniform(0, 110) if working else 68 + rng.uniform(0, 8)
    used = float(round(70_000 + rng.uniform(0, 9_000))) if holds_memory else 0.0
    nvlink = [round(NVLINK_BUSY_BYTES * rng.uniform(0.9, 1.1)) if working else 0.0
              for _ in range(2)]
    busy_sm, idle_sm = H100_SM_CLOCK_MHZ
    zero = (dcgm.ECC_SBE_VOL_TOTAL, dcgm.ECC_DBE_VOL_TOTAL, dcgm.CORRECTABLE_REMAPPED_ROWS,
            dcgm.UNCORRECTABLE_REMAPPED_ROWS, dcgm.ROW_REMAP_PENDING, dcgm.ROW_REMAP_FAILURE,
            *dcgm.NVLINK_ERROR_COUNTERS, dcgm.PCIE_REPLAY_COUNTER)
    return {
        dcgm.POWER_USAGE: round(power, 3),
        dcgm.POWER_MGMT_LIMIT: H100_POWER_LIMIT_W,
        dcgm.SM_CLOCK: busy_sm if working else idle_sm,
        dcgm.MEM_CLOCK: H100_MEM_CLOCK_MHZ,
        dcgm.FB_USED: used,
        dcgm.FB_FREE: H100_FB_MIB - used,
        **dict.fromkeys(zero, 0.0),
        dcgm.PROF_NVLINK_TX_BYTES: float(nvlink[0]),
        dcgm.PROF_NVLINK_RX_BYTES: float(nvlink[1]),
        dcgm.PCIE_LINK_GEN: H100_PCIE[0],
        dcgm.PCIE_MAX_LINK_GEN: H100_PCIE[0],
        dcgm.PCIE_LINK_WIDTH: H100_PCIE[1],
        dcgm.PCIE_MAX_LINK_WIDTH: H100_PCIE[1],
        # Idle clocks run down, and say why (as the simulated exporter prints it).
        dcgm.CLOCKS_EVENT_REASONS: 0.0 if working else float(dcgm.GPU_IDLE),
    }


# --- a summary for people (``manage.py fleetwatch sim --show``) ------------------------------

# A node's states, in the order the summary lists them (node_state picks one per node).
NODE_STATES = ("busy", "idle", "link down", "cordoned", "drained", "rebooting", "provisioning",
               "rma", "spare")


def node_state(node: State, busy: bool) -> str:
    """One word for a node as a person looking at the fleet would put it."""
    if node.get("provisioning_until") is not None:
        return "provisioning"
    if (node.get("reboot") or {}).get("started_at") is not None:
        return "rebooting"
    if node["pool"] == "rma":  # replaced: out of the fleet, kept for the record
        return "rma"
    if not node["in_service"]:
        return "spare"
    if node["drained"] or node["down"]:
        return "drained"
    if node["unschedulable"]:
        return "cordoned"
    if node["nic"]["state"] != "ACTIVE":
        return "link down"
    return "busy" if busy else "idle"


def gpu_health(gpu: State) -> str:
    if gpu["fallen_off"]:
        return "off the bus"
    if gpu["fault_at"] is not None:
        return "failed"
    if gpu["last_xid"]:
        return "xid"
    return "healthy"


def fleet_summary(state: State, now: float, speed: float) -> State:
    """Counts of nodes by state and in-service GPUs by health, the faults standing now (XIDs,
    links down), the jobs and the sources made unreachable: what ``sim --show`` prints."""
    busy = _busy_nodes(state)
    nodes: dict[str, list[str]] = {}
    gpus: dict[str, int] = {}
    faults: list[str] = []
    for name, node in sorted(state["nodes"].items()):
        nodes.setdefault(node_state(node, name in busy), []).append(name)
        for g in node["gpus"]:
            if node["in_service"] and node["pool"] != "rma":
                health = gpu_health(g)
                gpus[health] = gpus.get(health, 0) + 1
            if g["last_xid"]:
                faults.append(f"XID {g['last_xid']} on {name} GPU {g['index']}"
                              + (" (off the bus)" if g["fallen_off"] else ""))
            if g.get("slow") and node["pool"] != "rma":
                faults.append(f"{name} GPU {g['index']} slow: "
                              f"{_slow_words(g['slow']['kind'], g['slow']['percent'])}")
        if node["nic"]["state"] != "ACTIVE":
            faults.append(f"{name} {node['nic']['device']} link down ({node['leaf']})")
    jobs = [{"id": job["id"], "name": job["name"], "user": job["user"], "state": job["state"],
             "nodes": len(job["nodes"]) or job["num_nodes"], "step": job_step(job, now, speed),
             "restarts": job["restart_count"]}
            for job in sorted(state["jobs"].values(), key=lambda j: int(j["id"]))]
    return {"nodes": {s: nodes[s] for s in NODE_STATES if s in nodes}, "gpus": gpus,
            "faults": faults, "jobs": jobs, "down_sources": list(state["down_sources"])}
