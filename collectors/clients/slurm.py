"""The real Slurm client: the Slurm CLI's JSON output, and ``scontrol``/``scancel`` for actions.

Reads
    nodes()    ``sinfo --json`` on 22.05 and older (``scontrol`` has no ``--json`` there), and
               ``scontrol show nodes --json`` from 23.02 on (where ``sinfo --json`` groups nodes
               into summary records under one reason; such an answer is refused).
    node(name) ``scontrol show node NAME --json`` from 23.02 on (one node written out, an
               unknown name an empty list: NotFound); the whole list on 22.05.
    jobs()     ``squeue --all --states=all --json`` (finished jobs too; from 23.02 squeue's
               default state filter applies to ``--json`` as well).
    topology() ``scontrol show topology``: the leaf switches (level 0) and their nodes.

The JSON is read by the fields FleetWatch uses, never by its version. Every form seen from
Slurm 21.08 (openapi/v0.0.37) to 25.11 (data_parser/v0.0.44), CLI and slurmrestd, is read:

* a node's ``state`` a string (``"idle"``) with ``state_flags`` beside it (22.05), or a list
  (``["IDLE", "DRAIN"]``, 23.02+); its ``reason`` a string or, in 25.11's grouped sinfo,
  ``{"description": ...}``;
* a job's ``job_state`` a string or a list, ``exit_code`` the raw wait status or an object
  with ``status``, ``return_code`` and ``signal`` (23.11+), numbers plain or
  ``{"set": true, "infinite": false, "number": N}``; ``gres_detail`` (``"gpu:2(IDX:4-5)"``, one
  entry per allocated node) gives the GPUs the job holds on each node.

A version FleetWatch was never tested with is read all the same and reported in
``last_warnings`` (so on the Slurm source's collector run). A record that does not parse is
skipped and reported while the rest of the answer is kept; an answer of which no record can be
read is refused (``ClientError(permanent=True)``) naming the field that did not fit, never taken
for an empty cluster.

Actions read the current state first, so a retried step does nothing twice, and only undo what
FleetWatch did: every reason FleetWatch sets starts with ``fleetwatch:``, and resume() refuses a
node whose reason does not.

Semantics found on a real 22.05 cluster (tests/harness/slurm_cluster.py, tests/integration/
test_slurm.py), which decide how cancel() and requeue() work:

* ``scancel --signal=TERM --full JOBID`` only delivers SIGTERM: a job that ignores it (a hung
  NCCL collective never reaches its handler) keeps RUNNING forever, and KillWait never applies.
* Plain ``scancel JOBID`` sends SIGCONT+SIGTERM to every process of the job, batch script
  included, waits KillWait seconds, then SIGKILLs what is left; the job is CANCELLED (shown as
  COMPLETING until its processes are gone). That is "SIGTERM with a grace" — so cancel(TERM)
  uses it.
* ``scontrol requeue JOBID`` on a RUNNING job does the same SIGTERM/KillWait stop and requeues
  it; on a CANCELLED/COMPLETED/FAILED job still in slurmctld's memory (MinJobAge) it requeues
  it too, even while it is COMPLETING. A requeued job is PENDING (reason BeginTime) for
  AuthInfo's cred_expire seconds (default 120), then runs again with restart_cnt + 1. Asked
  again while the requeue is in progress, Slurm answers "Job is pending execution".
* ``scontrol requeue`` is not idempotent by itself: on a job that was requeued and is RUNNING
  again it requeues it again. So requeue() requeues only a job that has stopped (the remediation
  flow is cancel(), wait for the job to leave RUNNING, requeue()), exactly as the simulation
  does; for a running job it changes nothing.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import hostlist
import orjson

from collectors.clients.base import (
    SLURM_NAME_PREFIX,
    SLURM_REASON_PREFIX,
    ActionResult,
    CheckJob,
    CheckJobSpec,
    ClientError,
    NotFound,
    SlurmJob,
    SlurmNode,
    SlurmReservation,
    job_comment,
    job_comment_check,
)
from collectors.knowledge.acceptance import CHECK_JOB_PREFIX, RESERVATION_PREFIX

# --- versions ------------------------------------------------------------------------------------

# The JSON each Slurm release writes by default, and the releases FleetWatch was tested with
# (fixtures in tests/fixtures/slurm/, real 22.05 and 25.11 clusters in the integration tests).
# The answer is read by its fields, never by its version: a version missing here is read all
# the same, with a warning that it was never tested.
TESTED_PARSERS = {
    "v0.0.37": "21.08", "v0.0.38": "22.05", "v0.0.39": "23.02", "v0.0.40": "23.11",
    "v0.0.41": "24.05", "v0.0.42": "24.11", "v0.0.43": "25.05", "v0.0.44": "25.11",
}
TESTED_RELEASES = frozenset(tuple(int(p) for p in r.split(".")) for r in TESTED_PARSERS.values())

NODE_BASE_STATES = frozenset({"UNKNOWN", "DOWN", "IDLE", "ALLOCATED", "ERROR", "MIXED", "FUTURE",
                              "END"})
# 22.05's job_state_string() prints a state flag in place of the base state, in this order; the
# list shapes name both, so they are folded the same way and every version reads alike.
JOB_STATE_FLAG_ORDER = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED",
                        "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED",
                        "RESV_DEL_HOLD", "SIGNALING")
ACTIVE_JOB_STATES = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED", "SIGNALING", "STOPPED"})

_VERSION_RE = re.compile(r"v0\.0\.\d+")


def payload_version(payload: Any) -> tuple[str, str | None]:
    """What ``payload`` says it is ("data_parser/v0.0.44", "Slurm 22.05") and, when that is
    a version FleetWatch was never tested with, a warning saying so.

    Only a payload that is not a JSON object is refused here: whether the answer can be read
    is decided by its fields (``parse_nodes``/``parse_jobs``), so a new Slurm release whose
    fields did not change keeps working, and one whose fields did is refused naming the field.
    """
    if not isinstance(payload, Mapping):
        raise ClientError(f"Slurm JSON is a {type(payload).__name__}, not an object", permanent=True)
    meta = payload.get("meta")
    if not isinstance(meta, Mapping):
        return "no meta", "Slurm JSON has no meta object: its version is unknown; read by its fields"
    plugin = found if isinstance(found := meta.get("plugin"), Mapping) else {}
    for key in ("data_parser", "type"):
        value = plugin.get(key)
        match = _VERSION_RE.search(value) if isinstance(value, str) else None
        if match:
            if match.group(0) in TESTED_PARSERS:
                return str(value), None
            return str(value), (f"Slurm JSON {value} was never tested with FleetWatch (tested: "
                                f"v0.0.37 to v0.0.44, Slurm 21.08 to 25.11); read by its fields")
    slurm = meta.get("slurm") if isinstance(meta.get("slurm"), Mapping) else meta.get("Slurm")
    version = slurm.get("version") if isinstance(slurm, Mapping) else None
    if isinstance(version, Mapping):
        try:
            release = (int(version["major"]), int(version["minor"]))
        except (KeyError, TypeError, ValueError):
            release = None
        if release is not None:
            label = f"Slurm {release[0]}.{release[1]:02d}"
            if release in TESTED_RELEASES:
                return label, None
            return label, f"{label} was never tested with FleetWatch; read by its fields"
    return "unknown", "Slurm JSON names no version in its meta; read by its fields"


# --- field helpers -------------------------------------------------------------------------------


def number(value: Any) -> int | None:
    """A plain number, or 23.02+'s ``{"set": ..., "infinite": ..., "number": N}``; None when
    unset or infinite."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        return number(value.get("number"))
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"not a number: {value!r}")


def _text(value: Any, field: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise ValueError(f"{field} is {type(value).__name__}, not a string")


def _names(value: Any, field: str) -> list[str]:
    """A state: a string (22.05) or a list of strings (23.02+), upper-cased."""
    if isinstance(value, str) and value:
        return [value.upper()]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [v.upper() for v in value]
    raise ValueError(f"{field} is {value!r}")


def exit_return_code(value: Any) -> int | None:
    """The job's return code from any shape; 128+N for a job killed by signal N (as a shell
    reports it). 22.05/23.02 give the raw wait status, 23.11+ an object."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, Mapping) and ("return_code" in value or "status" in value):
        signal = value.get("signal")
        sig = number(signal.get("id", signal.get("signal_id"))) if isinstance(signal, Mapping) else None
        if sig:
            return 128 + sig
        return number(value.get("return_code"))
    status = number(value)  # an int, or 23.02's uint32_no_val object
    if status is None:
        return None
    if status & 0x7F:  # WIFSIGNALED
        return 128 + (status & 0x7F)
    return status >> 8


# Shown first in a skipped record's excerpt: what an operator needs to find it in Slurm.
EXCERPT_KEYS = ("job_id", "name", "user_name", "job_state", "state", "state_flags", "nodes",
                "reason")


def _loads(text: str) -> Any:
    """JSON text as Python: orjson (``sinfo --json`` for 12,500 nodes is megabytes, a large
    share of a poll), or the json module for what orjson refuses and it reads (NaN, integers
    past 64 bits), so no answer read before is refused now."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def _excerpt(record: Any, limit: int = 240) -> str:
    if isinstance(record, Mapping):
        first = {k: record[k] for k in EXCERPT_KEYS if k in record}
        record = first | {k: v for k, v in record.items() if k not in first}
    try:
        text = json.dumps(record, default=str)
    except (TypeError, ValueError):
        text = repr(record)
    return text if len(text) <= limit else text[:limit] + "..."


def _records(payload: Mapping[str, Any], key: str) -> list[Any]:
    records = payload.get(key)
    if not isinstance(records, list):
        raise ClientError(f"Slurm JSON has no {key!r} list (keys: {sorted(payload)[:12]})",
                          permanent=True)
    return records


def payload_errors(payload: Any) -> str | None:
    """The failures Slurm lists in a payload's ``errors`` (exit status 0 on some versions)."""
    errors = payload.get("errors") if isinstance(payload, Mapping) else None
    if not errors or not isinstance(errors, list):
        return None
    messages = []
    for err in errors:
        if isinstance(err, Mapping):
            parts = [str(err[k]) for k in ("source", "description", "error") if err.get(k)]
            messages.append(": ".join(parts) or _excerpt(err))
        else:
            messages.append(str(err))
    return "; ".join(messages)


def _payload_errors(payload: Mapping[str, Any]) -> None:
    message = payload_errors(payload)
    if message is not None:
        raise ClientError(f"Slurm reported: {message}", permanent=classify(message) is True)


# --- pure parsers --------------------------------------------------------------------------------


def _reason(value: Any) -> str:
    """A node's reason: a string, or 25.11 sinfo's ``{"description", "time", "user"}``."""
    if isinstance(value, Mapping):
        return _text(value.get("description"), "reason.description")
    return _text(value, "reason")


def _node_state(record: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The base state and flags, from whichever form the record has: 22.05's string
    ("idle", sometimes "IDLE+DRAIN") with ``state_flags`` beside it, or 23.02+'s list
    (``["IDLE", "DRAIN"]``: the base state first, flags after)."""
    raw = record.get("state")
    if isinstance(raw, str) and raw:
        parts = [p.upper() for p in raw.split("+") if p]
        extra = record.get("state_flags") or []
        if not isinstance(extra, list):
            raise ValueError(f"state_flags is {extra!r}")
        return parts[0], tuple(parts[1:] + [str(f).upper() for f in extra])
    states = _names(raw, "state")
    bases = [s for s in states if s in NODE_BASE_STATES]
    base = bases[0] if bases else states[0]
    return base, tuple(s for s in states if s != base)


# The states and flags under which a node's reason says why it is out now. Slurm 23.11+ keep
# the reason after a RESUME and after ReturnToService brings a DOWN node back (25.11: an IDLE
# node still reads "XID 79 ..." or "Not responding"): on a node in none of these, the reason is
# history, not a fault, and is read as no reason, as 22.05 (which clears it) always showed.
REASON_STATES = frozenset({"DOWN", "ERROR"})
REASON_FLAGS = frozenset({"DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
                          "REBOOT_REQUESTED", "REBOOT_ISSUED", "MAINTENANCE", "POWERING_DOWN",
                          "POWERED_DOWN", "INVALID_REG"})


def current_reason(base: str, flags: tuple[str, ...], reason: str) -> str:
    """``reason`` while it explains the node's state, else "" (a stale one, see above)."""
    return reason if base in REASON_STATES or REASON_FLAGS & set(flags) else ""


def parse_node(record: Any) -> SlurmNode:
    if not isinstance(record, Mapping):
        raise ValueError(f"node record is a {type(record).__name__}")
    name = record.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("node record has no name")
    base, flags = _node_state(record)
    partitions = record.get("partitions") or []
    if isinstance(partitions, str):
        partitions = [partitions]
    return SlurmNode(name=name, state=base, flags=flags,
                     reason=current_reason(base, flags, _reason(record.get("reason"))),
                     partition=",".join(str(p) for p in partitions),
                     gpus=gres_gpus(record.get("gres")))


def parse_sinfo_group(record: Any) -> list[SlurmNode]:
    """One record of 23.02+'s ``sinfo -N --json`` (``nodes.nodes`` names the one node; plain
    ``sinfo --json`` merges several, which parse_nodes refuses)."""
    if not isinstance(record, Mapping):
        raise ValueError(f"sinfo record is a {type(record).__name__}")
    group = record.get("nodes")
    names = group.get("nodes") if isinstance(group, Mapping) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"nodes.nodes is {names!r}")
    node = record.get("node")
    if not isinstance(node, Mapping):
        raise ValueError(f"node is {node!r}")
    base, flags = _node_state(node)
    partition = record.get("partition")
    part_name = partition.get("name") if isinstance(partition, Mapping) else partition
    reason = current_reason(base, flags, _reason(record.get("reason")))
    gres = record.get("gres")
    gpus = gres_gpus(gres.get("total") if isinstance(gres, Mapping) else gres)
    return [SlurmNode(name=n, state=base, flags=flags, reason=reason,
                      partition=_text(part_name, "partition.name"), gpus=gpus)
            for n in hostlist.expand_hostlist(",".join(names))]


_GRES_COUNT_RE = re.compile(r"^gpu(?::[^:(,]+)*:(\d+)")


def gres_gpus(value: Any) -> int | None:
    """The GPUs in a node's ``gres`` ("gpu:8", "gpu:h100:8(S:0-1)", "gpu:a100:4,gpu:t4:2");
    None where it names no GPU or does not parse (never "no GPU": Slurm did not say)."""
    if not isinstance(value, str) or not value:
        return None
    total, seen = 0, False
    # Entries are comma-separated, but a socket list "(S:0-1)" may hold commas too.
    for entry in re.split(r",(?![^(]*\))", value):
        match = _GRES_COUNT_RE.match(entry.strip())
        if match:
            total, seen = total + int(match.group(1)), True
    return total if seen else None


T = TypeVar("T")


def _parse_all(payload: Any, key: str,
               parse: Callable[[Any], list[T]]) -> tuple[list[T], list[str]]:
    """Every record under ``key``, parsed by its fields.

    A malformed record is skipped with a warning (the error and an excerpt) and the rest are
    kept. When no record at all can be read, the answer does not fit what FleetWatch reads (a
    field renamed in a new release, say): it is refused whole, naming the field, rather than
    taken for an empty cluster. A payload reporting errors is refused too.
    """
    version, warning = payload_version(payload)
    _payload_errors(payload)
    out: list[T] = []
    warnings = [warning] if warning else []
    records = _records(payload, key)
    failures: list[str] = []
    for i, record in enumerate(records):
        try:
            out.extend(parse(record))
        except (KeyError, TypeError, ValueError, hostlist.BadHostlist) as exc:
            failures.append(str(exc))
            warnings.append(f"skipped {key.rstrip('s')} record {i}: {exc}: {_excerpt(record)}")
    if records and not out:
        raise ClientError(f"Slurm JSON ({version}) does not fit: no {key} record could be read "
                          f"({failures[0]})", permanent=True)
    return out, warnings


def parse_nodes(payload: Any) -> tuple[list[SlurmNode], list[str]]:
    """Nodes from ``sinfo --json`` (22.05), ``scontrol show nodes --json``, ``sinfo -N --json``
    or slurmrestd's ``nodes``; 23.02+'s grouped ``sinfo --json`` is refused (see below)."""
    if isinstance(payload, Mapping) and "nodes" not in payload and "sinfo" in payload:
        merged = [r for r in payload["sinfo"] if isinstance(r, Mapping)
                  and isinstance(r.get("nodes"), Mapping)
                  and len(hostlist.expand_hostlist(",".join(r["nodes"].get("nodes") or []))) > 1]
        if merged:
            # Plain `sinfo --json` (23.02+) merges nodes of one state into a summary record
            # under one reason (a real 25.11 put an administrator's drain under FleetWatch's
            # reason): each node's own reason cannot be told, and keeping the other records
            # alone would read the merged nodes as gone.
            raise ClientError("Slurm JSON holds sinfo summary records merging several nodes "
                              f"({_excerpt(merged[0].get('nodes'), 80)}): read `sinfo -N --json` "
                              "or `scontrol show nodes --json` instead", permanent=True)
        return _parse_all(payload, "sinfo", parse_sinfo_group)
    return _parse_all(payload, "nodes", lambda record: [parse_node(record)])


def job_state(value: Any) -> str:
    states = _names(value, "job_state")
    if len(states) == 1:
        return states[0]
    for flag in JOB_STATE_FLAG_ORDER:
        if flag in states:
            return flag
    return states[0]


# A node's GPUs in gres_detail: "gpu:2(IDX:4-5)", "gpu:a100:2(IDX:0,3)", "gpu(IDX:N/A)", next
# to other GRES ("gpu:4(IDX:0-3),nic:1(IDX:0)"); the index list may itself hold commas.
_GRES_GPU_RE = re.compile(r"(?:^|,)gpu(?::[^,(]*)*\(IDX:([^)]*)\)")


def gpu_indices(detail: str) -> tuple[int, ...] | None:
    """The GPU indices in one node's gres_detail entry; None when it names none (N/A, no GPU
    GRES), which means "not said", never "no GPU"."""
    found: list[int] = []
    matched = False
    for match in _GRES_GPU_RE.finditer(detail):
        text = match.group(1).strip()
        if not text or text.upper() == "N/A":
            continue
        matched = True
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            if not lo.strip().isdigit() or (hi and not hi.strip().isdigit()):
                raise ValueError(f"gres_detail index {part!r} in {detail!r}")
            found.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(found))) if matched else None


def job_gpus(nodes: tuple[str, ...], details: Any) -> dict[str, tuple[int, ...]]:
    """{node: GPU indices} from ``gres_detail``, one entry per allocated node, in the order of
    the job's node list (Slurm writes them so, 22.05 through 25.11)."""
    if not details:
        return {}
    if not isinstance(details, list) or not all(isinstance(d, str) for d in details):
        raise ValueError(f"gres_detail is {details!r}")
    if len(details) != len(nodes):
        # Which entry is which node cannot be told: the GPUs are unknown (never "none"), and
        # the job itself is still read.
        return {}
    out = {}
    for node, detail in zip(nodes, details, strict=True):
        indices = gpu_indices(detail)
        if indices is not None:
            out[node] = indices
    return out


# One GPU entry of a TRES string: "gres:gpu:8" (22.05), "gres/gpu:2", "gres/gpu:a100:2" (23.02+),
# or "gres/gpu=2" / "gres/gpu:a100=2" in tres_req_str; a TRES string lists several, with commas.
_TRES_GPU_RE = re.compile(r"^(?:gres[:/])?gpu(?::[^:=,]+)?[:=](\d+)$")


def tres_gpus(text: str) -> int | None:
    """The GPUs a TRES string names (summed over GPU types); None when it names none."""
    found = [int(m.group(1)) for part in text.split(",")
             if (m := _TRES_GPU_RE.match(part.strip()))]
    return sum(found) if found else None


def job_gpus_requested(record: Mapping[str, Any]) -> int | None:
    """How many GPUs the job asks for in all: ``--gpus`` (tres_per_job), else ``--gres=gpu:N``
    or ``--gpus-per-node`` (tres_per_node) times its node count, else what tres_req_str says.
    0 when the job names no GPU anywhere; None when it asks per node and the node count is
    not said."""
    per_job = tres_gpus(_text(record.get("tres_per_job"), "tres_per_job"))
    if per_job is not None:
        return per_job
    per_node = tres_gpus(_text(record.get("tres_per_node"), "tres_per_node"))
    if per_node is not None:
        nodes = number(record.get("node_count"))
        return None if nodes is None else per_node * nodes
    requested = tres_gpus(_text(record.get("tres_req_str"), "tres_req_str"))
    return requested if requested is not None else 0


def parse_job(record: Any) -> SlurmJob:
    if not isinstance(record, Mapping):
        raise ValueError(f"job record is a {type(record).__name__}")
    job_id = number(record.get("job_id"))
    if job_id is None:
        raise ValueError("job record has no job_id")
    state = job_state(record.get("job_state"))
    node_list = _text(record.get("nodes"), "nodes")
    try:
        nodes = tuple(hostlist.expand_hostlist(node_list)) if node_list else ()
    except hostlist.BadHostlist as exc:
        raise ValueError(f"bad hostlist {node_list!r}: {exc}") from exc
    start = number(record.get("start_time"))
    submit = number(record.get("submit_time"))
    reason = _text(record.get("state_reason"), "state_reason")
    ended = state not in ACTIVE_JOB_STATES and state != "PENDING"
    return SlurmJob(
        job_id=str(job_id),
        name=_text(record.get("name"), "name"),
        user=_text(record.get("user_name"), "user_name") or str(record.get("user_id", "")),
        state=state,
        nodes=nodes,
        restart_count=number(record.get("restart_cnt")) or 0,
        # A pending job's start_time is only the scheduler's estimate.
        started_at=float(start) if start and state != "PENDING" else None,
        exit_code=exit_return_code(record.get("exit_code")) if ended else None,
        state_reason="" if reason == "None" else reason,
        # A pending job holds no GPU; its gres_detail (if any) is stale.
        gpus=job_gpus(nodes, record.get("gres_detail")) if state != "PENDING" else {},
        submitted_at=float(submit) if submit else None,
        admin_comment=_text(record.get("admin_comment"), "admin_comment"),
        comment=_text(record.get("comment"), "comment"),
        gpus_requested=job_gpus_requested(record),
    )


def parse_jobs(payload: Any) -> tuple[list[SlurmJob], list[str]]:
    """Jobs from ``squeue --json``, ``scontrol show jobs --json`` or slurmrestd's ``jobs``."""
    return _parse_all(payload, "jobs", lambda record: [parse_job(record)])


def parse_topology(text: str) -> dict[str, list[str]]:
    """``scontrol show topology`` -> {leaf switch: [nodes]}; only the leaves (level 0, no
    ``Switches=``), as the topology rules reason about the switch a node hangs off."""
    leaves: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        name = fields.get("SwitchName")
        if not name:
            continue
        if fields.get("Switches") or fields.get("Level", "0") != "0":
            continue
        nodes = fields.get("Nodes", "")
        try:
            leaves[name] = hostlist.expand_hostlist(nodes) if nodes and nodes != "(null)" else []
        except hostlist.BadHostlist as exc:
            raise ClientError(f"bad hostlist in topology line {line!r}: {exc}", permanent=True) from exc
    return leaves


def slurm_release(version_output: str) -> tuple[int, int] | None:
    """``scontrol --version`` ("slurm-wlm 22.05.8", "slurm 23.11.4") -> (22, 5)."""
    match = re.search(r"(\d+)\.(\d+)(?:\.\d+)?", version_output)
    return (int(match.group(1)), int(match.group(2))) if match else None


# --- reservations (the return-to-service gate) ---------------------------------------------------


def _csv(value: Any, field: str) -> tuple[str, ...]:
    """A list, or a comma-separated string (22.05's text, 25.11's CLI JSON: "root,alice")."""
    if value is None or value == "" or value == "(null)":
        return ()
    if isinstance(value, str):
        return tuple(v for v in (p.strip() for p in value.split(",")) if v)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"{field} is {value!r}")


def parse_reservation(record: Any) -> list[SlurmReservation]:
    """One reservation of ``scontrol show reservation --json`` (23.02+) or slurmrestd's
    ``reservations`` (a node list a string there, a list in a v0.0.43+ create answer)."""
    if not isinstance(record, Mapping):
        raise ValueError(f"reservation record is a {type(record).__name__}")
    name = record.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("reservation record has no name")
    nodes = _csv(record.get("node_list"), "node_list")
    try:
        expanded = tuple(n for part in nodes for n in hostlist.expand_hostlist(part))
    except hostlist.BadHostlist as exc:
        raise ValueError(f"bad node_list {nodes!r}: {exc}") from exc
    end = number(record.get("end_time"))
    return [SlurmReservation(name=name, nodes=expanded, users=_csv(record.get("users"), "users"),
                             flags=tuple(str(f).upper() for f in _csv(record.get("flags"),
                                                                      "flags")),
                             end_time=float(end) if end is not None else None)]


def parse_reservations(payload: Any) -> tuple[list[SlurmReservation], list[str]]:
    return _parse_all(payload, "reservations", parse_reservation)


def parse_reservations_text(text: str) -> list[SlurmReservation]:
    """``scontrol show reservation`` as 22.05 prints it (it has no ``--json``): one block per
    reservation, ``Key=Value`` fields; "No reservations in the system" when there are none."""
    found: list[SlurmReservation] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        fields: dict[str, str] = {}
        for part in block.split():
            key, sep, value = part.partition("=")
            if sep:
                fields.setdefault(key, value)
        name = fields.get("ReservationName")
        if not name:
            continue
        nodes = fields.get("Nodes", "")
        try:
            expanded = tuple(hostlist.expand_hostlist(nodes)) if nodes and nodes != "(null)" else ()
        except hostlist.BadHostlist as exc:
            raise ClientError(f"bad Nodes={nodes!r} in reservation {name}: {exc}",
                              permanent=True) from exc
        found.append(SlurmReservation(
            name=name, nodes=expanded, users=_csv(fields.get("Users"), "Users"),
            flags=tuple(f.upper() for f in _csv(fields.get("Flags"), "Flags"))))
    return found


def owned_reservation(name: str) -> None:
    """Only FleetWatch's reservations are FleetWatch's to create or delete."""
    if not name.startswith(SLURM_NAME_PREFIX):
        raise ClientError(f"reservation {name!r} is not FleetWatch's (its names start "
                          f"{SLURM_NAME_PREFIX}); not touching it", permanent=True)


def reservation_held(current: list[SlurmReservation], name: str, node: str,
                     call: str) -> ActionResult | None:
    """An unchanged result when ``name`` already holds ``node`` alone; an error when it holds
    something else; None when it does not exist."""
    for found in current:
        if found.name == name:
            if found.nodes == (node,):
                return ActionResult(call, False, f"reservation {name} already holds {node}")
            raise ClientError(f"reservation {name} exists holding {', '.join(found.nodes) or 'no node'}"
                              f", not {node}", permanent=True)
    return None


def check_jobs_of(jobs: list[SlurmJob], reservation: str) -> list[SlurmJob]:
    """FleetWatch's check jobs of a gate reservation that are queued or running (they keep
    slurmctld from deleting it: "Requested reservation is in use")."""
    key = reservation.removeprefix(RESERVATION_PREFIX)
    return [j for j in jobs if j.name.startswith(f"{CHECK_JOB_PREFIX}{key}-")
            and (j.state == "PENDING" or j.state in ACTIVE_JOB_STATES)]


# What a check job's output file may hold that FleetWatch keeps (its end: the verdict line).
OUTPUT_LIMIT = 8000


def output_read(path: str, job_id: str) -> str | None:
    """A check job's output file (``%j`` expanded), its last OUTPUT_LIMIT characters, where
    this machine can read it (a shared file system, or FleetWatch on the node); None where not."""
    if not path:
        return None
    path = path.replace("%j", str(job_id))
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - OUTPUT_LIMIT))
            return handle.read().decode(errors="replace")
    except OSError:
        return None


def check_job_from(job: SlurmJob | None, output: str) -> CheckJob | None:
    if job is None:
        return None
    ended = job.state not in ACTIVE_JOB_STATES and job.state != "PENDING"
    return CheckJob(job.job_id, job.name, job.state, job.exit_code, job.state_reason, job.nodes,
                    output_read(output, job.job_id) if ended else None)


def check_job_args(spec: CheckJobSpec) -> list[str]:
    """``sbatch`` for a check job: the node alone (``-w``, ``--exclusive``), in its reservation,
    its GPUs asked for (a job that asks for none cannot see them under Slurm's device cgroup)."""
    args = ["sbatch", "--parsable", f"--job-name={spec.name}", f"--reservation={spec.reservation}",
            f"--nodelist={spec.node}", "--nodes=1", "--exclusive", f"--time={spec.minutes}",
            f"--output={spec.output}", "--no-requeue"]
    if spec.partition:
        args.append(f"--partition={spec.partition}")
    if spec.gpus:
        args.append(f"--gres=gpu:{spec.gpus}")
    return args


# What a check job inherits from FleetWatch's own environment: only what Slurm's commands need
# (never FleetWatch's secrets: sbatch exports its environment into the job).
CHECK_ENV_KEYS = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "SLURM_CONF")


# --- errors --------------------------------------------------------------------------------------

TRANSIENT_PATTERNS = (
    "unable to contact slurm controller", "connection refused", "connect failure",
    "socket timed out", "timed out", "zero bytes were transmitted", "resource temporarily unavailable",
    "communication connection failure", "slurm backup controller in standby",
    "slurmctld is not responding", "try again", "transient", "munge", "temporarily",
)
PERMANENT_PATTERNS = (
    "invalid job id", "invalid node name", "invalid user", "invalid partition",
    "access/permission denied", "permission denied", "only batch jobs are accepted",
    "requested operation is presently disabled", "invalid node state", "unrecognized option",
    "invalid option", "job is no longer pending", "requested operation not supported",
    "invalid job state", "invalid signal",
)


def classify(message: str) -> bool | None:
    """True: permanent (not worth retrying); False: transient; None: not recognised."""
    low = message.lower()
    if any(p in low for p in PERMANENT_PATTERNS):
        return True
    if any(p in low for p in TRANSIENT_PATTERNS):
        return False
    return None


SIGNAL_NAMES = {
    "1": "HUP", "2": "INT", "3": "QUIT", "9": "KILL", "10": "USR1", "12": "USR2", "15": "TERM",
    "18": "CONT", "19": "STOP",
}


def signal_name(signal: str | int) -> str:
    text = str(signal).strip().upper()
    text = SIGNAL_NAMES.get(text, text)
    return text[3:] if text.startswith("SIG") else text


def owned_reason(reason: str) -> str:
    """FleetWatch's reasons start with ``fleetwatch:`` (DESIGN.md, Ownership)."""
    reason = " ".join(reason.split())  # scontrol takes one line
    if reason.startswith(SLURM_REASON_PREFIX):
        return reason
    return f"{SLURM_REASON_PREFIX} {reason}".rstrip()


# --- the client ----------------------------------------------------------------------------------


class SlurmCli:
    """``SlurmClient`` over the Slurm command line of the machine it runs on.

    ``bin_dir`` is where the Slurm commands live (default: ``PATH``); ``env`` is merged over
    ``os.environ`` for every command, which is how ``SLURM_CONF`` reaches them. Each command
    runs with ``timeout`` seconds; transient failures (controller unreachable, timeouts) are
    retried ``retries`` more times with a doubling backoff, permanent ones are not.
    """

    source = "slurm"
    last_warnings: list[str]

    def __init__(self, bin_dir: str | None = None, timeout: float = 10.0,
                 env: dict[str, str] | None = None, retries: int = 2,
                 backoff: float = 0.5, user: str = "") -> None:
        self.bin_dir = bin_dir
        # Who FleetWatch is to Slurm: the user its commands run as (its check jobs' owner, the
        # one user its reservations admit).
        self.user = user or pwd.getpwuid(os.getuid()).pw_name
        self.timeout = timeout
        self.env = {**os.environ, **(env or {})}
        self.retries = retries
        self.backoff = backoff
        self.last_warnings: list[str] = []
        self._release: tuple[int, int] | None = None
        self._kill_wait: int | None = None

    # --- running commands ----------------------------------------------------------------------

    def _argv(self, args: Sequence[str]) -> list[str]:
        if self.bin_dir:
            return [os.path.join(self.bin_dir, args[0]), *args[1:]]
        return list(args)

    def _run(self, *args: str, retry: bool = True, stdin: str | None = None,
             env: dict[str, str] | None = None) -> str:
        """Run one Slurm command; its stdout, or ClientError with its stderr. ``stdin``: what
        to feed it (sbatch reads its script there); ``env``: instead of ``self.env``."""
        command = shlex.join(args)
        attempts = 1 + (self.retries if retry else 0)
        last: ClientError | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                proc = subprocess.run(self._argv(args), env=env or self.env, capture_output=True,
                                      text=True, timeout=self.timeout, input=stdin,
                                      stdin=None if stdin is not None else subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                last = ClientError(f"`{command}` timed out after {self.timeout:g}s", permanent=False)
                continue
            except FileNotFoundError as exc:
                raise ClientError(f"`{command}`: {exc.strerror}: {exc.filename} "
                                  "(is the Slurm client installed?)", permanent=True) from exc
            # Some commands report failure on stderr with status 0 (22.05's
            # `scontrol show topology` with slurmctld down): a recognised error there counts.
            if proc.returncode == 0 and (not proc.stderr.strip() or classify(proc.stderr) is None):
                return proc.stdout
            message = (proc.stderr.strip() or proc.stdout.strip()
                       or f"exit status {proc.returncode}")
            kind = classify(message)
            last = ClientError(f"`{command}` failed: {message}", permanent=kind is True)
            if kind is not False:
                # Permanent, or not recognised: retrying blindly here could repeat a change;
                # the caller (a Celery step with its own budget) decides on unknown errors.
                raise last
        assert last is not None
        raise last

    def _json(self, *args: str) -> Any:
        """Run a ``--json`` command and load its output.

        With slurmctld down, 22.05's ``sinfo --json``/``squeue --json`` exit 0 and print an
        empty list with ``errors: [{"error": "Unspecified error"}]``: read naively that is "no
        nodes". Any ``errors`` entry fails the read; ``scontrol ping`` then says whether the
        controller is down (transient, retried) or the request itself was refused.
        """
        command = shlex.join(args)
        for attempt in range(1 + self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            out = self._run(*args)
            try:
                payload = _loads(out)
            except json.JSONDecodeError as exc:
                raise ClientError(f"`{command}` printed no JSON ({exc}): {out[:200]!r}",
                                  permanent=False) from exc
            message = payload_errors(payload)
            if message is None:
                return payload
            down = self._controller_down()
            if down is None:
                raise ClientError(f"`{command}` reported: {message}",
                                  permanent=classify(message) is True)
        raise ClientError(f"`{command}` reported: {message}; slurmctld is not answering "
                          f"(`scontrol ping`: {down})", permanent=False)

    def _controller_down(self) -> str | None:
        """``scontrol ping``'s answer when a controller is DOWN, else None."""
        try:
            proc = subprocess.run(self._argv(["scontrol", "ping"]), env=self.env,
                                  capture_output=True, text=True, timeout=self.timeout,
                                  stdin=subprocess.DEVNULL)
        except (subprocess.TimeoutExpired, OSError) as exc:
            return f"scontrol ping failed: {exc}"
        answer = " ".join((proc.stdout + proc.stderr).split())
        return answer if "DOWN" in answer or proc.returncode != 0 else None

    def release(self) -> tuple[int, int] | None:
        """The Slurm release the CLI belongs to, e.g. (22, 5); asked once."""
        if self._release is None:
            self._release = slurm_release(self._run("scontrol", "--version"))
        return self._release

    def kill_wait(self) -> int | None:
        """The cluster's KillWait: seconds between SIGTERM and SIGKILL when a job is stopped."""
        if self._kill_wait is None:
            out = self._run("scontrol", "show", "config")
            match = re.search(r"^KillWait\s*=\s*(\d+)", out, re.MULTILINE)
            self._kill_wait = int(match.group(1)) if match else None
        return self._kill_wait

    # --- reads ---------------------------------------------------------------------------------

    def nodes(self) -> list[SlurmNode]:
        release = self.release()
        if release is not None and release < (23, 2):
            payload = self._json("sinfo", "--json")
        else:
            payload = self._json("scontrol", "show", "nodes", "--json")
        nodes, self.last_warnings = parse_nodes(payload)
        return nodes

    def node(self, name: str) -> SlurmNode:
        release = self.release()
        if release is not None and release < (23, 2):
            return node_named(self.nodes(), name)  # 22.05's scontrol has no --json
        if (not name or name.startswith("-") or any(c.isspace() for c in name)
                or any(c in name for c in "[],")):
            # scontrol would take it for an option, for more than one argument, or for a
            # host list (no node's own name holds brackets or commas).
            raise NotFound(f"Invalid node name specified: {name!r} is not a node name",
                           permanent=True)
        # scontrol still loads every node from slurmctld, but writes (and we decode) only
        # this one: at 12,500 nodes the whole list is megabytes of JSON. A name it does not
        # know is an empty list (25.11), and a host list expression (gpu-[1-2]) names no
        # node of its own: node_named says NotFound for both. slurmctld away is an error, as
        # in every read.
        try:
            payload = self._json("scontrol", "show", "node", name, "--json")
        except ClientError as exc:
            if _NODE_UNKNOWN.search(str(exc)):
                raise NotFound(f"Invalid node name specified: {name} is not a node of this "
                               f"cluster ({exc})", permanent=True) from exc
            raise
        nodes, self.last_warnings = parse_nodes(payload)
        return node_named(nodes, name)

    def jobs(self) -> list[SlurmJob]:
        # 22.05 ignores squeue's filters with --json: every job slurmctld still holds comes back.
        # --states=all: 23.02+ apply squeue's default filter to --json too and leave out the
        # jobs that ended (22.05 ignores filters with --json and lists them anyway).
        payload = self._json("squeue", "--all", "--states=all", "--json")
        jobs, self.last_warnings = parse_jobs(payload)
        return jobs

    def topology(self) -> dict[str, list[str]]:
        try:
            out = self._run("scontrol", "show", "topology")
        except ClientError as exc:
            if "not configured" in str(exc).lower() or "no switches" in str(exc).lower():
                return {}  # topology/none: no switch information at all
            raise
        return parse_topology(out)

    def _job(self, job_id: str) -> SlurmJob:
        return job_with_id(self.jobs(), job_id)

    def _act(self, args: list[str], changed_detail: str,
             data: dict[str, object] | None = None) -> ActionResult:
        # No automatic retry for a change: the state check above makes a retried *step* safe,
        # and scontrol's answers ("Job is pending execution") are handled by the caller.
        self._run(*args, retry=False)
        return ActionResult(shlex.join(args), True, changed_detail, data or {})

    # --- node actions --------------------------------------------------------------------------

    def drain(self, node: str, reason: str) -> ActionResult:
        reason = owned_reason(reason)
        args = ["scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}"]
        current = self.node(node)
        if "DRAIN" in current.flags:
            # Drained already, by us or by someone else: their reason stays as it is.
            return ActionResult(shlex.join(args), False,
                                f"{node} already drained: {current.reason}")
        return self._act(args, f"{node} drained")

    def down(self, node: str, reason: str) -> ActionResult:
        """Mark a node DOWN: Slurm kills (and, where allowed, requeues) the jobs on it."""
        reason = owned_reason(reason)
        args = ["scontrol", "update", f"nodename={node}", "state=DOWN", f"reason={reason}"]
        current = self.node(node)
        if current.state == "DOWN":
            return ActionResult(shlex.join(args), False, f"{node} already down: {current.reason}")
        return self._act(args, f"{node} down")

    def resume(self, node: str) -> ActionResult:
        args = ["scontrol", "update", f"nodename={node}", "state=RESUME"]
        current = self.node(node)
        if "DRAIN" not in current.flags and current.state != "DOWN":
            return ActionResult(shlex.join(args), False, f"{node} is not drained or down")
        if not current.reason.startswith(SLURM_REASON_PREFIX):
            # Ownership: an administrator's drain (or slurmctld's own "Not responding") is not
            # FleetWatch's to undo.
            raise ClientError(f"{node} was drained by someone else ({current.reason!r}); "
                              "not resuming", permanent=True)
        return self._act(args, f"{node} resumed")

    def reboot(self, node: str, reason: str) -> ActionResult:
        """Reboot once its jobs are done (ASAP drains it meanwhile), then resume it."""
        reason = owned_reason(reason)
        args = ["scontrol", "reboot", "ASAP", "nextstate=RESUME", f"reason={reason}", node]
        current = self.node(node)
        pending = {"REBOOT_REQUESTED", "REBOOT_ISSUED"} & set(current.flags)
        if pending:
            return ActionResult(shlex.join(args), False,
                                f"{node} reboot already {sorted(pending)[0].lower()}")
        return self._act(args, f"{node} reboot requested (ASAP, then RESUME)")

    # --- job actions ---------------------------------------------------------------------------

    def cancel(self, job_id: str, signal: str, grace_seconds: int) -> ActionResult:
        """Stop a running job with ``signal``.

        SIGTERM is Slurm's own stop: ``scancel JOBID`` sends SIGTERM to every process of the
        job (batch script and steps), waits KillWait seconds, then SIGKILLs the rest, so a hung
        job still ends. ``grace_seconds`` cannot be set per job on a real cluster: the grace is
        the cluster's KillWait (slurm.conf), reported in ``data``; set KillWait to at least the
        time a checkpoint takes. Any other signal is only delivered
        (``scancel --signal=SIG --full``, batch script included) and the job runs on unless it
        exits.
        """
        sig = signal_name(signal)
        job = self._job(job_id)
        kill_wait = self.kill_wait()
        data: dict[str, object] = {"signal": sig, "requested_grace_seconds": grace_seconds,
                                   "kill_wait_seconds": kill_wait}
        if sig == "TERM":
            args = ["scancel", str(job_id)]
            data["exit_in_seconds"] = kill_wait
        else:
            args = ["scancel", f"--signal={sig}", "--full", str(job_id)]
        if job.state not in ACTIVE_JOB_STATES:
            # CANCELLED/COMPLETING after an earlier call, ended, or still PENDING: nothing runs.
            return ActionResult(shlex.join(args), False, f"job {job_id} is {job.state}", data)
        if sig == "TERM":
            detail = f"job {job_id} sent SIGTERM; SIGKILL after KillWait={kill_wait}s"
            if kill_wait is not None and kill_wait != grace_seconds:
                detail += f" (cluster config; {grace_seconds}s was asked for)"
        else:
            detail = f"job {job_id} sent SIG{sig}"
        return self._act(args, detail, data)

    def requeue(self, job_id: str) -> ActionResult:
        """Put a job that has stopped (cancelled, failed, completed) back in the queue."""
        return requeue_stopped(self._job(job_id), self._scontrol)

    def requeue_hold(self, job_id: str) -> ActionResult:
        """Requeue a job held (priority 0) so it waits for a person to release it."""
        return requeue_held(self._job(job_id), self._scontrol,
                            lambda: self._act(["scontrol", "hold", str(job_id)],
                                              f"job {job_id} held"))

    def set_comment(self, job_id: str, text: str, field: str) -> ActionResult:
        """``scontrol update jobid=N admincomment=...`` (or ``comment=``): the same on 22.05
        and 25.11. The admin comment needs an operator or SlurmUser, as FleetWatch runs."""
        return comment_update(self._job(job_id), text, field, self._scontrol)

    def _scontrol(self, args: list[str]) -> object:
        return self._run(*args, retry=False)

    # --- the return-to-service gate ------------------------------------------------------------

    def reservations(self) -> list[SlurmReservation]:
        """``scontrol show reservation --json`` (23.02+); 22.05's scontrol has no ``--json``,
        so its text is read there."""
        release = self.release()
        if release is not None and release < (23, 2):
            out = self._run("scontrol", "show", "reservation")
            if "no reservations in the system" in out.lower():
                return []
            return parse_reservations_text(out)
        found, self.last_warnings = parse_reservations(
            self._json("scontrol", "show", "reservation", "--json"))
        return found

    def reserve(self, name: str, node: str) -> ActionResult:
        """``scontrol create reservation``: the node alone, from now, without end (Slurm 22.05
        makes that 365 days), for FleetWatch's user only. MAINT: Slurm accounts the time as
        maintenance and the reservation may overlap a site's own; IGNORE_JOBS: a job still
        completing on the node does not refuse it (found on 22.05: "Requested nodes are
        busy")."""
        owned_reservation(name)
        args = ["scontrol", "create", "reservation", f"ReservationName={name}", f"Nodes={node}",
                "StartTime=now", "Duration=UNLIMITED", f"Users={self.user}",
                "Flags=MAINT,IGNORE_JOBS"]
        held = reservation_held(self.reservations(), name, node, shlex.join(args))
        if held is not None:
            return held
        return self._act(args, f"reservation {name} holds {node} (only {self.user}'s jobs "
                               "run there)")

    def unreserve(self, name: str) -> ActionResult:
        """``scontrol delete reservation=NAME``, after cancelling FleetWatch's check jobs still
        queued or running in it (slurmctld refuses to delete a reservation a job uses)."""
        owned_reservation(name)
        args = ["scontrol", "delete", f"reservation={name}"]
        if not any(r.name == name for r in self.reservations()):
            return ActionResult(shlex.join(args), False, f"reservation {name} is gone already")
        cancelled = [j.job_id for j in check_jobs_of(self.jobs(), name)]
        for job_id in cancelled:
            self._run("scancel", job_id, retry=False)
        result = self._act(args, f"reservation {name} deleted")
        if cancelled:
            return ActionResult(result.call, True, f"{result.detail}; check job(s) "
                                f"{', '.join(cancelled)} cancelled", {"cancelled": cancelled})
        return result

    def submit_check(self, spec: CheckJobSpec) -> ActionResult:
        """``sbatch`` with the script on its standard input. Its environment is FleetWatch's
        pared down to what Slurm's commands need (sbatch exports it into the job: FleetWatch's
        secrets must not go along); the script sets what the check reads itself."""
        args = check_job_args(spec)
        for job in self.jobs():
            if job.name == spec.name:
                return ActionResult(shlex.join(args), False,
                                    f"check job {job.job_id} ({spec.name}) already submitted",
                                    {"job_id": job.job_id})
        env = {k: v for k, v in self.env.items() if k in CHECK_ENV_KEYS}
        out = self._run(*args, retry=False, stdin=spec.script, env=env)
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise ClientError(f"`{shlex.join(args)}` printed no job id: {out[:200]!r}",
                              permanent=True)
        return ActionResult(shlex.join(args), True, f"check job {job_id} submitted "
                            f"({spec.name} on {spec.node})", {"job_id": job_id})

    def check_job(self, job_id: str, output: str = "") -> CheckJob | None:
        release = self.release()
        if release is not None and release < (23, 2):
            jobs = self.jobs()  # 22.05's squeue ignores filters with --json
        else:
            try:
                jobs, self.last_warnings = parse_jobs(
                    self._json("scontrol", "show", "job", str(job_id), "--json"))
            except ClientError as exc:
                if "invalid job id" in str(exc).lower():
                    return None  # ended more than MinJobAge ago
                raise
        return check_job_from(next((j for j in jobs if j.job_id == str(job_id)), None), output)


# --- what every transport shares ----------------------------------------------------------------


# How a Slurm release may say it has no such node (scontrol's text output; the error string of
# ESLURM_INVALID_NODE_NAME): only these, never any "not found" (a missing slurm.conf is one).
_NODE_UNKNOWN = re.compile(r"\bNode \S+ not found\b|Invalid node name specified")


def node_named(nodes: list[SlurmNode], name: str) -> SlurmNode:
    """The node called ``name``; an unknown name is NotFound (permanent), never "no state"."""
    for node in nodes:
        if node.name == name:
            return node
    raise NotFound(f"Invalid node name specified: {name} is not a node of this cluster",
                   permanent=True)


def job_with_id(jobs: list[SlurmJob], job_id: str) -> SlurmJob:
    for job in jobs:
        if job.job_id == str(job_id):
            return job
    raise ClientError(f"Invalid job id specified: job {job_id} is unknown to slurmctld "
                      "(never existed, or ended more than MinJobAge ago)", permanent=True)


# --- a job's comment, the same rules whatever writes it --------------------------------------------

SCONTROL_COMMENT_KEYS = {"admin_comment": "admincomment", "comment": "comment"}


def comment_update(job: SlurmJob, text: str, field: str,
                   scontrol: Callable[[list[str]], object]) -> ActionResult:
    """Write FleetWatch's ``text`` into the job's comment ``field`` with ``scontrol update``;
    nothing when it says that already (a retried step)."""
    job_comment_check(field)
    current = job.admin_comment if field == "admin_comment" else job.comment
    wanted = job_comment(current, text)
    args = ["scontrol", "update", f"jobid={job.job_id}",
            f"{SCONTROL_COMMENT_KEYS[field]}={wanted}"]
    if current == wanted:
        return ActionResult(shlex.join(args), False, f"job {job.job_id} {field} already says it")
    scontrol(args)
    return ActionResult(shlex.join(args), True, f"job {job.job_id} {field}: {wanted}",
                        {"field": field, "comment": wanted})


# --- requeue, the same rules whatever runs the command -------------------------------------------


def requeue_stopped(job: SlurmJob, scontrol: Callable[[list[str]], object]) -> ActionResult:
    """``scontrol requeue`` for a job that has stopped; nothing for one PENDING already, or
    RUNNING (maybe requeued and started again: requeueing would restart it twice)."""
    args = ["scontrol", "requeue", job.job_id]
    if job.state == "PENDING":
        return ActionResult(shlex.join(args), False, f"job {job.job_id} is already PENDING")
    if job.state in ACTIVE_JOB_STATES:
        return ActionResult(shlex.join(args), False,
                            f"job {job.job_id} is {job.state}; cancel it first to requeue it")
    return _requeue_run(job, args, scontrol,
                        f"job {job.job_id} requeued (restart {job.restart_count + 1})")


def requeue_held(job: SlurmJob, scontrol: Callable[[list[str]], object],
                 hold: Callable[[], ActionResult]) -> ActionResult:
    """``scontrol requeuehold``; a job still PENDING is only held (``hold``), once."""
    args = ["scontrol", "requeuehold", job.job_id]
    if job.state == "PENDING":
        if _held(job):
            return ActionResult(shlex.join(args), False, f"job {job.job_id} already held")
        return hold()
    return _requeue_run(job, args, scontrol, f"job {job.job_id} requeued and held")


def _requeue_run(job: SlurmJob, args: list[str], scontrol: Callable[[list[str]], object],
                 done: str) -> ActionResult:
    try:
        scontrol(args)
    except ClientError as exc:
        # Asked again while the requeue is in progress (a retried step).
        if "pending execution" in str(exc).lower():
            return ActionResult(shlex.join(args), False, f"job {job.job_id} already requeued")
        raise
    return ActionResult(shlex.join(args), True, done)


def _held(job: SlurmJob) -> bool:
    reason = job.state_reason.lower()
    return reason.startswith("jobheld") or "held" in reason
