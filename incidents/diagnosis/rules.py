"""The rule catalogue: from a window's facts to root causes.

Rules run in causal order, and each later rule sees what the earlier ones explained:

1. sources: a collector that says it is unhealthy, or one source alone claiming a large part
   of the fleet stopped answering at once, is a source outage; its node-state evidence is set
   aside (a missing source is never a failed node);
2. GPUs: hardware, memory and NVLink XIDs (and DCGM's row-remap and ECC fields) blame the node
   that logged them; application-class XIDs blame the job unless they follow one GPU across
   jobs; XID 45 and 154 follow the XID before them;
3. links: most of a leaf's nodes losing their link within seconds is the switch; one node's
   link going down and up is that node;
4. thermal: sustained thermal clock slowdown at high temperature;
5. reachability: a node that stops answering with no GPU or NIC evidence of its own;
6. fail-slow: a node alive but slower than its job's peers (``slow``), where no fault above
   explains it;
7. jobs: application failures (CUDA OOM, exceptions, non-zero exits) of jobs that no fault
   above explains. NCCL timeouts and IB errors never blame the node that prints them.

Every diagnosis cites its evidence (lines, nodes, times) in plain words.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import incidents.diagnosis.clocks as clocks
import incidents.diagnosis.parsers as p
import incidents.diagnosis.slow as slow
from collectors.knowledge import dcgm
from collectors.knowledge import xid as x
from collectors.knowledge.causes import PLAYBOOK_FOR, RootCause
from collectors.knowledge.slurm import drained_by, index_ranges
from incidents.diagnosis.facts import (
    Facts,
    GpuLostFact,
    HwFact,
    JobFact,
    LinkFact,
    ReachFact,
    ThermalRun,
    XidFact,
    collector_sources,
)
from incidents.diagnosis.tools import tool_verdicts
from incidents.diagnosis.types import Diagnosis, JobInfo, Note

# Short names for the root-cause labels (collectors.knowledge.causes, with their playbooks).
GPU_HARDWARE, GPU_MEMORY = RootCause.GPU_HARDWARE, RootCause.GPU_MEMORY
NVLINK_FAULT = RootCause.NVLINK
NETWORK_FLAP, SWITCH_FAILURE = RootCause.NETWORK_FLAP, RootCause.SWITCH_FAILURE
THERMAL, NODE_UNREACHABLE = RootCause.THERMAL, RootCause.NODE_UNREACHABLE
APPLICATION_ERROR = RootCause.APPLICATION_ERROR
FAIL_SLOW = RootCause.FAIL_SLOW

# Thresholds, in seconds unless named otherwise. Each is the smallest value that still tells
# the fault from the noise around it in the scenario suite; see the comments where used.
SWITCH_BURST_S = 15.0        # link losses this close together are one event
SWITCH_MAJORITY = 0.5        # more than this share of a leaf's nodes: the leaf, not the nodes
SWITCH_SPREAD_S = 60.0       # a leaf node losing its link this close to the burst is in it
OUTAGE_GRACE_S = 120.0       # states just after a collector recovers are still catching up
MASS_SPAN_S = 120.0          # "at once", for one source claiming many nodes stopped answering
MASS_FRACTION = 0.5          # ... this share of the fleet ...
MASS_MIN_NODES = 3           # ... and at least this many nodes
CORROBORATE_S = 300.0        # another source agreeing within this long makes it real
REACH_BURST_S = 60.0         # nodes stopping answering this close together went together
REACH_SWITCH_MIN_NODES = 3   # ... and at least this many, for a leaf with no link evidence
RECOVERED_S = 60.0           # a node that answers again this soon did not stop answering
LIFE_AFTER_S = 5.0           # the node's own samples this long after it "stopped answering" ...
LIFE_SAMPLES = 2             # ... this many times: it did not
NIC_EXPLAINS_S = 300.0       # a link loss this long before a node stops answering explains it
THERMAL_SUSTAIN_S = 45.0     # four 15 s scrapes in a row; shorter is a GPU touching its limit
THERMAL_MIN_SAMPLES = 3      # ... and seen on at least this many scrapes
THERMAL_TEMP_SLACK_S = 30.0  # a temperature sample this close to the slowdown belongs to it
RECOVERY_TICKS = 5           # link_error_recovery ticks that make a link bad without a down
RECOVERY_WINDOW_S = 600.0    # ... within this long; a slow drift over hours is a healthy link
LINK_AFTER_GPU_S = 3600.0    # a node's link loss this soon after its GPU fault follows it
JOB_ACTIVE_SLACK_S = 60.0    # a job's output this close to an event places it in the job
APP_BEFORE_FAULT_S = 5.0     # an app failure this long before a fault in its job is its own
ABSORB_APP_XID_S = 60.0      # application XIDs this close to a hardware XID are its echo
AER_THEN_XID_S = 10.0        # an XID this soon after a fatal PCIe error is on the failed link
INIT_FAILED_XID = 143        # "GPU initialization failure": what a failed driver load reads as
HEALTHY_WORK_S = 120.0       # a job still writing output this long after a stale XID: it works
FAILED_JOB_STATES = frozenset({"FAILED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY"})
# How late each source may report a moment, where the window does not show its interval.
PROMETHEUS_SCRAPE_S = 15.0   # Prometheus's usual scrape interval
DCGM_COLLECT_S = 30.0        # dcgm-exporter's own collection interval (-c 30000), on top
SOURCE_LAG_S = {
    "slurm": 300.0,          # SlurmdTimeout's default: how long before a silent node is DOWN
    "kubernetes": 50.0,      # node-monitor-grace-period (40 s) and a status update (10 s)
}


def _when(at: datetime) -> str:
    # Formatted by hand: strftime took twice as long, for each of a storm's thousands of
    # diagnoses in every run.
    at = at.astimezone(UTC)
    return f"{at.hour:02d}:{at.minute:02d}:{at.second:02d}"


def _names(items: Iterable[str], limit: int = 6) -> str:
    ordered = sorted(set(items))
    if len(ordered) > limit:
        return ", ".join(ordered[:limit]) + f" and {len(ordered) - limit} more"
    return ", ".join(ordered)


def _ids(items: Iterable[object]) -> list[int]:
    return [i for i in (getattr(item, "id", None) for item in items) if i is not None]


def _densest(links: Sequence[LinkFact], kind: str, span: float) -> int:
    """The most ``kind`` events (summing their amounts) within any ``span`` seconds."""
    events = [f for f in links if f.kind == kind]
    best = total = start = 0
    for f in events:
        total += f.amount
        while f.t - events[start].t > span:
            total -= events[start].amount
            start += 1
        best = max(best, total)
    return best


def _window(events: Sequence[ReachFact], span: float) -> list[ReachFact]:
    """The largest run of events (one per node) within ``span`` seconds of each other."""
    ordered = sorted(events, key=lambda r: r.t)
    best: list[ReachFact] = []
    start = 0
    for end in range(len(ordered)):
        while ordered[end].t - ordered[start].t > span:
            start += 1
        if end + 1 - start > len(best):
            best = ordered[start:end + 1]
    return best


@dataclass
class _Cause:
    """A node-level fault found so far: later rules must not blame its symptoms elsewhere."""

    t: float
    nodes: frozenset[str]
    diagnosis: Diagnosis
    # The earliest the fault may have happened: a source that reads late (a scrape, Slurm's
    # ping timeout) saw it up to its lag after it.
    early: float = 0.0
    # Jobs on its node that Slurm says held other GPUs: the fault is not theirs.
    spared: frozenset[str] = frozenset()


def _first(item: tuple[int, JobFact]) -> int:
    return item[0]


def _most_nodes(events: Sequence[LinkFact | ReachFact], span: float,
                ) -> list[tuple[int, int, int]]:
    """For each event (in time order), the window of events within ``span`` seconds before
    it: (start, end, how many distinct nodes), end exclusive. Counted as the window slides,
    where counting each window afresh was quadratic in a burst's size."""
    out = []
    per_node: dict[str, int] = defaultdict(int)
    start = 0
    for end, event in enumerate(events):
        per_node[event.node] += 1
        while event.t - events[start].t > span:
            gone = events[start].node
            per_node[gone] -= 1
            if not per_node[gone]:
                del per_node[gone]
            start += 1
        out.append((start, end + 1, len(per_node)))
    return out


def _gpu_index(gpu: str | None) -> int | None:
    """5 for "GPU 5" (dcgm's index); None for a PCI address or nothing."""
    if gpu and gpu.startswith("GPU ") and gpu[4:].strip().isdigit():
        return int(gpu[4:])
    return None


@dataclass
class Engine:
    facts: Facts
    topology: Mapping[str, Sequence[str]]
    jobs: Sequence[JobInfo]
    diagnoses: list[Diagnosis] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    causes: list[_Cause] = field(default_factory=list)
    gpu_nodes: dict[str, float] = field(default_factory=dict)   # node -> first GPU fault
    nic_nodes: dict[str, list[float]] = field(default_factory=dict)  # node -> link-loss times

    def __post_init__(self) -> None:
        self.job_nodes: dict[str, set[str]] = defaultdict(set)
        self.job_user: dict[str, str] = {}
        # job -> node -> GPU indices it held there: Slurm's word in the window first, the
        # stored job (the collector's last read) where the window has none.
        self.job_gpus: dict[str, dict[str, tuple[int, ...]]] = {}
        for job in self.jobs:
            self.job_nodes[job.id].update(job.nodes)
            self.job_user[job.id] = job.user
            if job.gpus:
                self.job_gpus[job.id] = dict(job.gpus)
        for job_id, nodes in self.facts.job_nodes.items():
            self.job_nodes[job_id].update(nodes)
        for job_id, held in self.facts.job_gpus.items():
            self.job_gpus.setdefault(job_id, {}).update(held)
        self.jobs_of: dict[str, set[str]] = defaultdict(set)
        for job_id, nodes in self.job_nodes.items():
            for node in nodes:
                self.jobs_of[node].add(job_id)
        self.fleet = set(self.facts.nodes_seen) | {n for ns in self.topology.values() for n in ns}
        self.fleet |= {n for ns in self.job_nodes.values() for n in ns}
        self.last_t = self.facts.last.timestamp() if self.facts.last else 0.0
        self.admin_drained: dict[str, tuple[float, str]] = {}
        for at, node, reason in self.facts.admin_drains:
            self.admin_drained.setdefault(node, (at.timestamp(), reason))
        # Indexes built once, so that no rule scans a fleet-wide list once per node, leaf or
        # diagnosis: with faults, leaves and log lines all growing with the fleet, such scans
        # made a 100,000-GPU cycle's rules take 20 times as long as 10,000 GPUs'.
        # node -> the leaves it sits under (usually one).
        self.leaves_of: dict[str, list[str]] = defaultdict(list)
        for leaf, members in self.topology.items():
            for node in dict.fromkeys(members):
                self.leaves_of[node].append(leaf)
        # job -> its NCCL/network symptom lines, with their place in facts.job_lines.
        self.symptom_lines: dict[str, list[tuple[int, JobFact]]] = defaultdict(list)
        for i, f in enumerate(self.facts.job_lines):
            if f.kind in p.SYMPTOMS:
                self.symptom_lines[f.job].append((i, f))

    # --- helpers ---------------------------------------------------------------------------

    def add(self, diagnosis: Diagnosis, t: float, source: str = "kernel",
            spared: Iterable[str] = ()) -> None:
        """Record a fault found at ``t`` by ``source`` (whose lag says how much earlier it may
        have happened); ``spared``: jobs on its node on other GPUs."""
        self.diagnoses.append(diagnosis)
        self.causes.append(_Cause(t, frozenset(diagnosis.nodes), diagnosis,
                                  t - self.lag(source), frozenset(spared)))

    def lag(self, source: str) -> float:
        """How long after a moment ``source`` may report it."""
        if source == "dcgm":
            return self.facts.intervals.get("dcgm", PROMETHEUS_SCRAPE_S) + DCGM_COLLECT_S
        if source == "nic":
            return self.facts.intervals.get("nic", PROMETHEUS_SCRAPE_S)
        return SOURCE_LAG_S.get(source, 0.0)

    def note(self, kind: str, text: str, at: datetime, **kw: object) -> None:
        self.notes.append(Note(kind, text, at, **kw))  # type: ignore[arg-type]

    def job_at(self, node: str, t: float, gpu: str | None = None) -> str | None:
        """The job running on a node (on ``gpu``, where Slurm said which GPUs each job held)
        at a time, when the window says so unambiguously."""
        candidates = set(self.on_gpu(node, gpu, self.jobs_of.get(node, set()))[0])
        if len(candidates) <= 1:
            return next(iter(candidates), None)
        spans = self.facts.job_spans
        # The `is None` tests guard the comparisons; mypy does not narrow through spans[j].
        timed = [
            j for j in candidates
            if j in spans and (spans[j].first_running is None
                               or spans[j].first_running <= t)  # type: ignore[operator]
            and (spans[j].ended is None or spans[j].ended >= t)  # type: ignore[operator]
        ]
        if len(timed) == 1:
            return timed[0]
        # Slurm did not settle it: the job that was writing output on this node around then.
        activity = self.facts.job_activity
        writing = [
            j for j in (timed or candidates)
            if (node_span := activity.get((j, node))) is not None
            and node_span[0] - JOB_ACTIVE_SLACK_S <= t <= node_span[1] + JOB_ACTIVE_SLACK_S
        ]
        if len(writing) == 1:
            return writing[0]
        return None

    def on_gpu(self, node: str, gpu: str | None,
               jobs: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Of ``jobs`` on ``node``, (those that held ``gpu``, those Slurm says held others).

        On a node shared by several jobs a fault on one GPU is the fault of the job on that
        GPU only. A job whose GPUs on the node Slurm did not say, or a fault whose GPU index is
        not known (a kernel line naming a PCI address), keeps today's reading: every job there.
        """
        index = _gpu_index(gpu)
        if index is None and gpu and gpu.startswith("PCI "):
            index = self.facts.pci_gpus.get((node, gpu[4:]))
        held, others = [], []
        for job in sorted(jobs):
            gpus = self.job_gpus.get(job, {}).get(node)
            if index is None or gpus is None or index in gpus:
                held.append(job)
            else:
                others.append(job)
        return tuple(held), tuple(others)

    def spared_text(self, node: str, spared: Sequence[str]) -> str:
        if not spared:
            return ""
        parts = [f"{j} (GPU {index_ranges(self.job_gpus[j][node])})" for j in spared]
        return (f" Also on {node}, on other GPUs: job {', '.join(parts)}; not affected by this "
                "GPU, left running.")

    def symptoms_after(self, jobs: Iterable[str], t: float, exclude: set[str]) -> list[JobFact]:
        """The jobs' symptom lines from ``t`` on, not from ``exclude``, in the window's order."""
        found = [(i, f) for job in set(jobs) for i, f in self.symptom_lines.get(job, ())
                 if f.t >= t - 1 and f.node not in exclude]
        found.sort(key=_first)
        return [f for _, f in found]

    def victims_text(self, jobs: Sequence[str], t: float, blamed: set[str]) -> tuple[str, list[int]]:
        symptoms = self.symptoms_after(jobs, t, blamed)
        peers = {f.node for f in symptoms if f.node}
        if not symptoms:
            others = {n for j in jobs for n in self.job_nodes.get(j, ())} - blamed
            if others:
                return (f" Job {_names(jobs)} also ran on {_names(others)}: those nodes are "
                        "victims, not faulty."), []
            return "", []
        kinds = sorted({f.kind.replace("nccl_", "NCCL ").replace("_", " ") for f in symptoms})
        return (f" The {', '.join(kinds)} lines on {_names(peers) or 'the other ranks'} "
                f"(job {_names(jobs)}, from {_when(symptoms[0].at)}) came after it and name no "
                "other fault: symptoms, not causes."), _ids(symptoms)

    # --- 1. sources ------------------------------------------------------------------------

    def source_outages(self) -> list[ReachFact]:
        """Node-state evidence that can be trusted; the rest is set aside with a note."""
        windows: dict[str, list[tuple[float, float]]] = defaultdict(list)
        down_since: dict[str, tuple[float, str]] = {}
        for c in self.facts.collectors:
            sources = collector_sources(c.name)
            for source in sources:
                if not c.healthy and source not in down_since:
                    down_since[source] = (c.t, c.error)
                    self.note("source_outage", f"collector {c.name} unhealthy since "
                              f"{_when(c.at)}: {c.error or 'no detail'}; its node states are "
                              "not read as node failures", c.at, source=source)
                elif c.healthy and source in down_since:
                    start, _ = down_since.pop(source)
                    windows[source].append((start, c.t + OUTAGE_GRACE_S))
        for source, (start, _) in down_since.items():
            windows[source].append((start, math.inf))

        trusted: list[ReachFact] = []
        set_aside = 0
        for r in self.facts.reach:
            if not r.reachable and any(a <= r.t <= b for a, b in windows.get(r.source, ())):
                set_aside += 1
                continue
            trusted.append(r)
        if set_aside:
            self.note("suppressed", f"{set_aside} node-state report(s) during a collector "
                      "outage set aside", self.facts.last or datetime.now(UTC))
        return self._mass_claims(trusted)

    def _mass_claims(self, reach: list[ReachFact]) -> list[ReachFact]:
        """One source alone saying a large part of the fleet stopped answering at once is
        that source (slurmctld restarting, the API server lagging), not the fleet."""
        threshold = max(MASS_MIN_NODES, math.ceil(MASS_FRACTION * len(self.fleet)))
        down = [r for r in reach if not r.reachable]
        by_source: dict[str, list[ReachFact]] = defaultdict(list)
        for r in down:
            by_source[r.source].append(r)
        dropped: set[int] = set()
        for source, events in by_source.items():
            events.sort(key=lambda r: r.t)
            # Mark every report that sits in some MASS_SPAN_S window naming enough nodes ...
            marked: set[int] = set()
            upto = 0  # windows only move forward: what is marked before this already is
            for start, end, count in _most_nodes(events, MASS_SPAN_S):
                if count >= threshold:
                    marked.update(range(max(start, upto), end))
                    upto = end
            # ... then treat each run of marked reports as one claim, and one note.
            bursts: list[list[ReachFact]] = []
            for i in sorted(marked):
                if bursts and events[i].t - bursts[-1][-1].t <= MASS_SPAN_S:
                    bursts[-1].append(events[i])
                else:
                    bursts.append([events[i]])
            for burst in bursts:
                claimed: dict[str, list[float]] = defaultdict(list)
                for b in burst:
                    claimed[b.node].append(b.t)
                nodes = set(claimed)
                corroborated = {
                    r.node for r in down if r.source != source and r.node in claimed
                    and any(abs(r.t - t) <= CORROBORATE_S for t in claimed[r.node])
                }
                lonely = [r for r in burst if r.node not in corroborated]
                if not lonely:
                    continue
                dropped.update(id(r) for r in lonely)
                self.note("source_outage",
                          f"{source} alone reported {len(nodes)} of {len(self.fleet)} nodes not "
                          f"responding from {_when(burst[0].at)} to {_when(burst[-1].at)}, with "
                          f"no other source agreeing: treated as a {source} outage, not "
                          f"{len(nodes)} failed nodes", burst[0].at, source=source,
                          nodes=tuple(sorted({r.node for r in lonely})))
        return [r for r in reach if id(r) not in dropped]

    # --- 2. GPUs ---------------------------------------------------------------------------

    def gpu_faults(self) -> None:
        by_node: dict[str, list[XidFact]] = defaultdict(list)
        for f in self.facts.xids:
            if f.stale and not self._troubled(f.node) and self._working(f.node, f.t):
                self.note("symptom", f"{f.text} already at the window's first scrape "
                          f"({_when(f.at)}), while its node's jobs kept working and nothing "
                          "went wrong: the last XID since the exporter started, not a new one",
                          f.at, nodes=(f.node,))
                continue
            by_node[f.node].append(f)
        memory_by_node: dict[str, list] = defaultdict(list)
        for m in self.facts.memory:
            memory_by_node[m.node].append(m)
        hw_by_node: dict[str, list[HwFact]] = defaultdict(list)
        for h in self.facts.hardware:
            hw_by_node[h.node].append(h)
        app_xids: list[XidFact] = []
        for node in sorted(set(by_node) | set(memory_by_node) | set(hw_by_node)):
            app_xids += self._node_gpu(node, by_node.get(node, []), memory_by_node.get(node, []),
                                       self._hardware(node, hw_by_node.get(node, []),
                                                      by_node.get(node, [])))
        self._application_xids(app_xids)
        self._gpus_lost()

    def _troubled(self, node: str) -> bool:
        """Whether the window shows anything going wrong on or around a node: another XID or
        hardware line, a report that it stopped answering, its jobs' errors or failed ends."""
        if any(f.node == node and not f.stale for f in self.facts.xids) or any(
                h.node == node for h in self.facts.hardware) or node in self.facts.claimed_down:
            return True
        for job in self.jobs_of.get(node, ()):
            span = self.facts.job_spans.get(job)
            if span is not None and span.state in FAILED_JOB_STATES:
                return True
            if any(f.job == job for f in self.facts.job_lines):
                return True
        return False

    def _working(self, node: str, t: float) -> bool:
        """Whether a job on the node completed, or kept writing output (on any of its nodes)
        for a while after ``t``: the GPUs there did their work."""
        jobs = self.jobs_of.get(node, set())
        for job in jobs:
            span = self.facts.job_spans.get(job)
            if span is not None and span.state == "COMPLETED":
                return True
        # A job's output is often its first rank's alone: any of its nodes will do.
        return any(job in jobs and last - t >= HEALTHY_WORK_S
                   for (job, _), (_, last) in self.facts.job_activity.items())

    def _hardware(self, node: str, hardware: list[HwFact], xids: list[XidFact]) -> list[HwFact]:
        """Of a node's fatal AER and SXid lines, those that are its GPUs' or NVSwitches'.

        A fatal PCIe error counts against the node's GPUs only where its device is known to be
        one: the agent matched the address to a GPU, the NVIDIA driver printed the line, or an
        NVRM line in the window names the same address. A NIC's or a disk's fatal error is
        shown, not blamed on the GPUs."""
        gpus = {f.gpu for f in xids}
        kept = []
        for h in hardware:
            # A fatal error on a port followed at once by an XID on the node: the port is the
            # one above that GPU (a root or switch port), and the GPU's work stopped with it.
            followed = any(0 <= f.t - h.t <= AER_THEN_XID_S for f in xids)
            if h.kind == "aer" and not (h.gpu_known or h.device in gpus or followed):
                self.note("symptom", f"fatal PCIe error (AER) on {node} {h.device} at "
                          f"{_when(h.at)}: not known to be a GPU; shown, not acted on", h.at,
                          nodes=(node,))
                continue
            kept.append(h)
        return kept

    def _gpus_lost(self) -> None:
        """slurmctld drained a node that registered fewer GPUs than configured: a GPU is lost
        (fallen off the bus, or not found at boot). Some GPUs missing is a fault of the node;
        none at all is as often a slurmd that cannot see any (no NVML, no gres.conf, the driver
        not loaded), so it is blamed with a confidence that waits for a person."""
        seen: dict[str, GpuLostFact] = {}
        for f in self.facts.gpus_lost:
            seen.setdefault(f.node, f)
        for node, f in sorted(seen.items()):
            if node in self.gpu_nodes:
                continue  # an XID or a kernel line already says which GPU and why
            read = self.facts.gpus_read.get(node, set())
            if len(read) >= f.configured:
                # dcgm-exporter reads every GPU the node should have: slurmd is what cannot
                # see them (built without NVML, no gres.conf, a File= that does not match).
                self.note("symptom", f"slurmctld drained {node} at {_when(f.at)}: '{f.reason}', "
                          f"but dcgm-exporter reads all {len(read)} of its GPUs: slurmd's GPU "
                          "configuration, not lost GPUs; not a hardware fault", f.at,
                          nodes=(node,))
                continue
            partial = 0 < f.reported < f.configured
            confidence = 0.85 if partial else 0.6
            why = (f"{f.configured - f.reported} of its {f.configured} GPUs are gone"
                   if partial else "slurmd sees none of its GPUs: the driver, NVML or "
                   "gres.conf may be at fault as well as the GPUs; check before acting")
            jobs = tuple(sorted(j for j in self.jobs_of.get(node, ()) if self.job_alive(j, f.t)))
            victims, victim_ids = self.victims_text(jobs, f.t, {node})
            self.gpu_nodes[node] = f.t
            self.add(Diagnosis(
                GPU_HARDWARE, (node,), confidence, PLAYBOOK_FOR[GPU_HARDWARE],
                f"slurmctld drained {node} at {_when(f.at)}: '{f.reason}' ({f.reported} GPUs "
                f"registered, {f.configured} configured): {why}." + victims,
                f.at, jobs=jobs, evidence=tuple(_ids([f]) + victim_ids)), f.t, "slurm")

    def _node_gpu(self, node: str, xids: list[XidFact], memory: list,
                  hardware: list[HwFact]) -> list[XidFact]:
        counts: dict[tuple[str, int], int] = defaultdict(int)
        cause: XidFact | None = None
        supporting: list[XidFact] = []
        recovery: list[XidFact] = []
        app: list[XidFact] = []
        for f in xids:
            info = x.xid_info(f.code)
            if info is None:
                self.note("symptom", f"XID {f.code} on {node} {f.gpu} at {_when(f.at)} is not in "
                          "the catalogue; shown, not acted on", f.at, nodes=(node,))
                continue
            if info.klass in (x.HARDWARE, x.MEMORY, x.NVLINK, x.DRIVER):
                counts[(f.gpu, f.code)] += 1
                if cause is None and info.opens and counts[(f.gpu, f.code)] >= info.repeat:
                    cause = f
                else:
                    supporting.append(f)
            elif info.klass == x.RECOVERY:
                recovery.append(f)
            elif info.klass == x.APPLICATION:
                app.append(f)
            else:
                supporting.append(f)  # XID 45: follows whatever came before it

        label: RootCause | None = None
        confidence = 0.0
        lead_text = ""
        evidence = _ids(xids) + _ids(memory) + _ids(hardware)
        first_at = None
        if cause is not None:
            info = x.xid_info(cause.code)
            assert info is not None
            label = GPU_HARDWARE if info.klass == x.DRIVER else RootCause(info.klass)
            confidence = {x.HARDWARE: 0.97, x.MEMORY: 0.95, x.NVLINK: 0.93, x.DRIVER: 0.6}[
                info.klass]
            where = cause.gpu + (f" ({cause.instance})" if cause.instance else "")
            if info.repeat > 1:
                confidence = 0.9
                lead_text = (f"XID {cause.code} ({info.meaning}) {counts[(cause.gpu, cause.code)]}"
                             f" times on {node} {where}, from {_when(xids[0].at)}")
            elif cause.via:
                lead_text = (f"{cause.via[0].upper()}{cause.via[1:]} on {node} {where} at "
                             f"{_when(cause.at)}, read as XID {cause.code} ({info.meaning})")
            else:
                lead_text = f"XID {cause.code} ({info.meaning}) on {node} {where} at " \
                            f"{_when(cause.at)}"
            if cause.code == INIT_FAILED_XID and cause.via:
                # The driver failing to start a GPU is also what a driver or firmware that does
                # not match the GPU looks like (GSP firmware, a vGPU host): a person looks.
                confidence = 0.75
            if info.klass == x.DRIVER:
                lead_text += " (a driver or firmware fault: check before acting)"
            lead_text += f"; NVIDIA: {info.advice}"
            first_at = cause.at
        faults = [r for r in recovery if r.recovery_action in x.RECOVERY_FAULTS]
        if label is None and faults:
            r = faults[0]
            label, confidence, first_at = GPU_HARDWARE, 0.88, r.at
            earlier = [s for s in supporting if s.t <= r.t]
            after = f", after XID {earlier[0].code} at {_when(earlier[0].at)}" if earlier else ""
            lead_text = (f"XID 154 on {node} {r.gpu} at {_when(r.at)}: the driver now asks for "
                         f"'{p.recovery_action_name(r.recovery_action)}'{after}")
        if label is None and memory:
            m = memory[0]
            label, confidence, first_at = GPU_MEMORY, 0.9, m.at
            lead_text = f"{m.text} at {_when(m.at)}: uncorrectable GPU memory error"
        hw_cause: HwFact | None = None
        if label is None and hardware:
            # A fatal NVSwitch error is the node's NVLink fabric; a fatal PCIe error on a GPU
            # takes the GPU off the bus.
            hw_cause = hardware[0]
            first_at = hw_cause.at
            if hw_cause.kind == "sxid":
                label, confidence = NVLINK_FAULT, 0.9
                lead_text = (f"Fatal NVSwitch error SXid {hw_cause.code} on {node} "
                             f"{hw_cause.device} at {_when(hw_cause.at)}: NVLink traffic "
                             "through the switch stops until the node's GPUs and NVSwitches "
                             "are reset (reboot the node)")
            else:
                label, confidence = GPU_HARDWARE, 0.9
                lead_text = (f"Fatal uncorrectable PCIe error (AER) on {node} {hw_cause.device}"
                             f" at {_when(hw_cause.at)}: the GPU's link failed")
        if label is None:
            for s in supporting:
                self.note("symptom", f"XID {s.code} on {node} {s.gpu} at {_when(s.at)} alone is "
                          "not a fault (it needs repeating or follows another error)", s.at,
                          nodes=(node,))
            return app

        assert first_at is not None
        extras = []
        for h in hardware:
            if h is not hw_cause:
                what = f"SXid {h.code}" if h.kind == "sxid" else "fatal PCIe error (AER)"
                extras.append(f"{what} on {h.device} at {_when(h.at)}")
                break
        later = [s for s in supporting if s is not cause and s.t >= first_at.timestamp()]
        if later:
            extras.append("then " + ", ".join(
                f"{s.via or f'XID {s.code}'} at {_when(s.at)}" for s in later[:4]))
        for r in recovery:
            if r.recovery_action is not None:
                extras.append(f"XID 154 asks for '{p.recovery_action_name(r.recovery_action)}'")
                break
        if memory and label == GPU_MEMORY and cause is not None:
            extras.append(f"DCGM agrees: {memory[0].text}")
        t = first_at.timestamp()
        jobs, spared = self.on_gpu(
            node, cause.gpu if cause is not None else (
                memory[0].gpu if memory else (hw_cause.device if hw_cause else None)),
            (j for j in self.jobs_of.get(node, ()) if self.job_alive(j, t)))
        victims, victim_ids = self.victims_text(jobs, t, {node})
        explanation = (lead_text + (f" ({'; '.join(extras)})" if extras else "") + "." + victims
                       + self.spared_text(node, spared))
        self.gpu_nodes[node] = min(self.gpu_nodes.get(node, t), t)
        read_by = cause.source if cause is not None else ("dcgm" if memory and hw_cause is None
                                                          and label == GPU_MEMORY else "kernel")
        self.add(Diagnosis(label, (node,), confidence, PLAYBOOK_FOR[label], explanation,
                           first_at, jobs=jobs, evidence=tuple(evidence + victim_ids)), t,
                 read_by, spared)
        # Application XIDs right around a hardware fault on the same node are its echo.
        return [a for a in app if abs(a.t - t) > ABSORB_APP_XID_S]

    def job_alive(self, job: str, t: float) -> bool:
        span = self.facts.job_spans.get(job)
        if span is None:
            return True
        if span.ended is not None and span.ended < t - 1 and span.state in (
                "COMPLETED", "CANCELLED"):
            return False
        return span.first_running is None or span.first_running <= t + 60

    def _application_xids(self, app: list[XidFact]) -> None:
        """An application XID blames its job, unless it follows one GPU across jobs."""
        by_gpu: dict[tuple[str, str, int], list[tuple[XidFact, str | None]]] = defaultdict(list)
        for f in app:
            # On a MIG GPU each instance is its own device to the jobs on it, and jobs on
            # different instances run side by side: the same application XID in two of them
            # is two jobs' bugs, not one GPU following them.
            where = f"{f.gpu} {f.instance}" if f.instance else f.gpu
            by_gpu[(f.node, where, f.code)].append((f, self.job_at(f.node, f.t, f.gpu)))
        self.app_xid_jobs: dict[str, list[XidFact]] = defaultdict(list)
        for (node, gpu, code), seen in sorted(by_gpu.items()):
            jobs = {j for _, j in seen if j}
            if len(jobs) >= 2:
                if node in self.gpu_nodes:
                    continue
                info = x.xid_info(code)
                first = seen[0][0]
                t = first.t
                spared = self.on_gpu(node, first.gpu, self.jobs_of.get(node, ()))[1]
                self.gpu_nodes[node] = t
                self.add(Diagnosis(
                    GPU_HARDWARE, (node,), 0.8, PLAYBOOK_FOR[GPU_HARDWARE],
                    f"XID {code} ({info.meaning if info else ''}) on {node} {gpu} under "
                    f"{len(jobs)} different jobs ({_names(jobs)}) from {_when(first.at)}: an "
                    "application XID that follows one GPU from job to job points at the GPU.",
                    first.at, jobs=tuple(sorted(jobs)), evidence=tuple(_ids(f for f, _ in seen))),
                    t, first.source, spared)
                continue
            for f, job in seen:
                if job:
                    self.app_xid_jobs[job].append(f)
                else:
                    self.note("symptom", f"XID {code} on {node} {gpu} at {_when(f.at)}: an "
                              "application XID with no known job; shown, not acted on", f.at,
                              nodes=(node,))

    # --- 3. links --------------------------------------------------------------------------

    def link_faults(self) -> None:
        losses = [f for f in self.facts.links if f.kind in ("down", "downed")]
        losses.sort(key=lambda f: f.t)
        loss_t = [f.t for f in losses]
        # Each leaf's link facts, in the order above, sorted out once rather than per leaf.
        losses_of: dict[str, list[LinkFact]] = defaultdict(list)
        for f in losses:
            for leaf in self.leaves_of.get(f.node, ()):
                losses_of[leaf].append(f)
        links_of: dict[str, list[LinkFact]] = defaultdict(list)
        for f in self.facts.links:
            for leaf in self.leaves_of.get(f.node, ()):
                links_of[leaf].append(f)
        absorbed: set[int] = set()
        for leaf in sorted(self.topology):
            members = set(self.topology[leaf])
            if len(members) < 2:
                continue
            mine = losses_of.get(leaf, [])
            burst = self._burst(mine, len(members))
            if burst is None:
                continue
            b0, b1 = burst[0].t, burst[-1].t
            hit = [f for f in mine if b0 - SWITCH_SPREAD_S <= f.t <= b1 + SWITCH_SPREAD_S]
            nodes = sorted({f.node for f in hit})
            related = [f for f in links_of.get(leaf, ())
                       if b0 - SWITCH_SPREAD_S <= f.t <= b1 + 10 * SWITCH_SPREAD_S]
            absorbed.update(id(f) for f in related)
            ups = [f for f in related if f.kind == "up"]
            back = f"; links back from {_when(ups[0].at)}" if ups else "; links still down"
            # The leaves with a loss near the burst: the losses are in time order, so only
            # those about SWITCH_SPREAD_S from it are looked at (a second wider, then the
            # exact test, so rounding cannot move one across the edge).
            near = {other for f in losses[bisect_left(loss_t, b0 - SWITCH_SPREAD_S - 1):
                                          bisect_right(loss_t, b0 + SWITCH_SPREAD_S + 1)]
                    if abs(f.t - b0) <= SWITCH_SPREAD_S
                    for other in self.leaves_of.get(f.node, ())}
            clean = [other for other in self.topology if other != leaf and other not in near]
            jobs = tuple(sorted({j for n in nodes for j in self.jobs_of.get(n, ())}))
            # Every node under a dead leaf is cut off, including one whose own link report
            # was missed: its going quiet is the switch, not the node.
            for n in members:
                self.nic_nodes.setdefault(n, []).append(b0)
            explanation = (
                f"{len(nodes)} of the {len(members)} nodes under {leaf} ({_names(nodes)}) lost "
                f"their link within {max(b1 - b0, 1):.0f} s from {_when(burst[0].at)}{back}"
                + (f", while {_names(clean)} stayed clean" if clean else "")
                + ": the switch, not the nodes, is at fault; no node is blamed."
            )
            self.add(Diagnosis(SWITCH_FAILURE, tuple(nodes), 0.9, PLAYBOOK_FOR[SWITCH_FAILURE],
                               explanation, burst[0].at, switch=leaf, jobs=jobs,
                               evidence=tuple(_ids(related))), b0, burst[0].source)
        by_node: dict[str, list[LinkFact]] = defaultdict(list)
        for f in self.facts.links:
            if id(f) not in absorbed:
                by_node[f.node].append(f)
        for node in sorted(by_node):
            self._node_link(node, by_node[node])

    def _burst(self, losses: list[LinkFact], size: int) -> list[LinkFact] | None:
        """The largest set of this leaf's nodes losing their link at once, if it is most of
        the leaf. "At once" is SWITCH_BURST_S, or the NIC source's interval where it reads
        more slowly: each node's loss is seen at its own scrape, and with scrapes a minute
        apart one moment is reported over most of that minute. Three or more nodes, most of
        the leaf, within SWITCH_SPREAD_S are one event too, whatever the interval."""
        nic = self.facts.intervals.get("nic", 0.0)
        for span, least in ((max(SWITCH_BURST_S, min(SWITCH_SPREAD_S, nic * 1.1)), 2),
                            (SWITCH_SPREAD_S, REACH_SWITCH_MIN_NODES)):
            best: list[LinkFact] = []
            best_nodes = 0
            for start, end, count in _most_nodes(losses, span):
                if count > best_nodes:
                    best, best_nodes = losses[start:end], count
            if best_nodes >= least and best_nodes > SWITCH_MAJORITY * size:
                return best
        return None

    def _node_link(self, node: str, links: list[LinkFact]) -> None:
        drained = self.admin_drained.get(node)
        losses = [f for f in links if f.kind in ("down", "downed")]
        ticks = _densest(links, "recovery", RECOVERY_WINDOW_S)
        slack = self.facts.clock_spread.get(node, 0.0) if losses and losses[0].source == (
            "kernel") else 0.0
        if drained and losses and drained[0] <= losses[0].t + slack:
            self.note("suppressed", f"{node}'s link went down after {drained_by(drained[1])} "
                      f"drained it ({drained[1]}): maintenance, not a fault", losses[0].at,
                      nodes=(node,))
            return
        gpu_t = self.gpu_nodes.get(node)
        if gpu_t is not None and losses and gpu_t - 1 <= losses[0].t <= gpu_t + LINK_AFTER_GPU_S:
            # A node whose GPU failed is rebooted, crashes or is pulled: its link goes down
            # with it. That is the GPU fault's consequence, not a second fault.
            self.note("symptom", f"{node}'s link went down at {_when(losses[0].at)}, after its "
                      "GPU fault: the node going down, not a link fault", losses[0].at,
                      nodes=(node,))
            return
        if not losses:
            if ticks >= RECOVERY_TICKS:
                first = next(f for f in links if f.kind == "recovery")
                self._flap(node, links, first, 0.6,
                           f"{node}'s link recovered from errors {ticks} times from "
                           f"{_when(first.at)} (link_error_recovery) without going down")
            elif ticks:
                first = links[0]
                self.note("symptom", f"{node}: link_error_recovery rose by {ticks} at "
                          f"{_when(first.at)}; a single recovery is not an incident", first.at,
                          nodes=(node,))
            return
        ups = [f for f in links if f.kind == "up"]
        first = losses[0]
        downs = sum(f.amount for f in losses if f.kind == "downed") or len(
            [f for f in losses if f.kind == "down"])
        how = "; ".join(dict.fromkeys(f.text for f in (losses[:2] + ups[:1])))
        text = (f"{node}'s link went down at {_when(first.at)}" +
                (f" and came back at {_when(ups[0].at)}" if ups else " and stayed down") +
                f" ({downs} time(s): {how})")
        self._flap(node, links, first, 0.9 if ups or downs > 1 else 0.8, text)

    def _flap(self, node: str, links: list[LinkFact], first: LinkFact, confidence: float,
              text: str) -> None:
        t = first.t
        jobs = tuple(sorted(j for j in self.jobs_of.get(node, ()) if self.job_alive(j, t)))
        # Some leaf does not hold this node (the index spares a scan of every leaf's list).
        others = len(self.topology) > len(self.leaves_of.get(node, ()))
        victims, victim_ids = self.victims_text(jobs, t, {node})
        clean = " Its leaf's other nodes show no link loss." if others else ""
        self.nic_nodes.setdefault(node, []).append(t)
        self.add(Diagnosis(NETWORK_FLAP, (node,), confidence, PLAYBOOK_FOR[NETWORK_FLAP],
                           text + "." + clean + victims, first.at, jobs=jobs,
                           evidence=tuple(_ids(links) + victim_ids)), t, first.source)

    # --- 4. thermal ------------------------------------------------------------------------

    def thermal_faults(self) -> None:
        by_node: dict[str, list[tuple[ThermalRun, float, float]]] = defaultdict(list)
        for run in self.facts.thermal_runs:
            end = run.t_end if run.closed else max(run.t_end, self.last_t)
            if end - run.t_start < THERMAL_SUSTAIN_S or run.samples < THERMAL_MIN_SAMPLES:
                continue  # GPUs touch their thermal limit briefly all the time
            temps = self.facts.hot.get((run.node, run.gpu), [])
            near = [c for t, c in temps
                    if run.t_start - THERMAL_TEMP_SLACK_S <= t <= end + THERMAL_TEMP_SLACK_S]
            if not near:
                continue  # held back but not hot: a power or clock setting, not heat
            by_node[run.node].append((run, end - run.t_start, max(near)))
        for node in sorted(by_node):
            if node in self.gpu_nodes:
                continue
            runs = sorted(by_node[node], key=lambda r: r[0].t_start)
            first = runs[0][0]
            # The reasons that slow a GPU down (thermal, HW slowdown, power brake).
            reasons = sorted({n for r, _, _ in runs for n in dcgm.clock_event_reasons(
                r.mask & (dcgm.SLOW_BITS | dcgm.POWER_BRAKE))})
            explanation = (
                f"{node} {_names({r.gpu for r, _, _ in runs})}: clocks held back "
                f"({', '.join(reasons)}) for {max(d for _, d, _ in runs):.0f} s from "
                f"{_when(first.start)} at up to {max(c for _, _, c in runs):.0f} C: sustained "
                "thermal slowdown, not a warm GPU at full speed."
            )
            jobs = tuple(sorted(self.jobs_of.get(node, ())))
            ids = [i for r, _, _ in runs for i in r.ids][:50]
            self.gpu_nodes.setdefault(node, first.t_start)
            self.add(Diagnosis(THERMAL, (node,), 0.85, PLAYBOOK_FOR[THERMAL], explanation,
                               first.start, jobs=jobs, evidence=tuple(ids)), first.t_start,
                     "dcgm")

    # --- 5. reachability -------------------------------------------------------------------

    def unreachable_nodes(self, reach: list[ReachFact]) -> None:
        by_node: dict[str, list[ReachFact]] = defaultdict(list)
        for r in reach:
            by_node[r.node].append(r)
        self._leaves_unreachable(by_node)
        for node in sorted(by_node):
            events = sorted(by_node[node], key=lambda r: r.t)
            down = [r for r in events if not r.reachable]
            if not down:
                continue
            first = down[0]
            back = [r for r in events if r.reachable and r.source == first.source
                    and first.t < r.t <= first.t + RECOVERED_S]
            if back:
                self.note("symptom", f"{node} stopped answering {first.source} at "
                          f"{_when(first.at)} and answered again at {_when(back[0].at)}",
                          first.at, nodes=(node,))
                continue
            later = [r for r in events if r.reachable and r.source == first.source
                     and r.t > first.t]
            life = [t for t in self.facts.alive.get(node, ())
                    if first.t + LIFE_AFTER_S < t <= (later[0].t if later else -math.inf)]
            if len(life) >= LIFE_SAMPLES and {r.source for r in down} == {first.source}:
                # The kubelet or slurmd stopped reporting for a while and came back, and the
                # node itself never stopped: its GPUs' samples, its kernel or its job kept
                # coming all along (through other paths than the claim's).
                self.note("symptom", f"{node}: {first.source} said it stopped answering at "
                          f"{_when(first.at)} ({first.text}), but the node itself kept reporting"
                          f" (GPU samples, kernel or job output) {len(life)} time(s) until it was "
                          f"back at {_when(later[0].at)}: the reporting agent, not the node; "
                          "not acted on", first.at, nodes=(node,))
                continue
            if node in self.gpu_nodes:
                continue  # the GPU fault is the cause; its diagnosis says so
            if any(first.t - NIC_EXPLAINS_S <= t <= first.t + RECOVERED_S
                   for t in self.nic_nodes.get(node, ())):
                continue
            drained = self.admin_drained.get(node)
            if drained and drained[0] <= first.t:
                self.note("suppressed", f"{node} stopped answering after "
                          f"{drained_by(drained[1])} drained it ({drained[1]})", first.at,
                          nodes=(node,))
                continue
            sources = sorted({r.source for r in down})
            t = first.t
            jobs = tuple(sorted(j for j in self.jobs_of.get(node, ()) if self.job_alive(j, t)))
            victims, victim_ids = self.victims_text(jobs, t, {node})
            said = "; ".join(dict.fromkeys(r.text for r in down[:3]))
            explanation = (f"{node} stopped answering at {_when(first.at)} ({said}) and shows no "
                           f"GPU or NIC fault of its own." + victims)
            self.add(Diagnosis(NODE_UNREACHABLE, (node,), 0.85 if len(sources) > 1 else 0.75,
                               PLAYBOOK_FOR[NODE_UNREACHABLE], explanation, first.at, jobs=jobs,
                               evidence=tuple(_ids(down) + victim_ids)), t,
                     first.source)

    def _leaves_unreachable(self, by_node: Mapping[str, list[ReachFact]]) -> None:
        """Most of one leaf's nodes stopping answering together, while the other leaves keep
        answering, is the leaf switch even when no NIC counter said so (the NIC telemetry
        travels through the same switch, or is not collected)."""
        if len(self.topology) < 2:
            return
        first_down: dict[str, ReachFact] = {}
        for node, events in by_node.items():
            if node in self.gpu_nodes or node in self.nic_nodes:
                continue
            events = sorted(events, key=lambda r: r.t)
            down = [r for r in events if not r.reachable]
            if not down:
                continue
            first = down[0]
            if any(r.reachable and r.source == first.source
                   and first.t < r.t <= first.t + RECOVERED_S for r in events):
                continue
            first_down[node] = first
        if len(first_down) < REACH_SWITCH_MIN_NODES:
            return
        switched = {d.switch for d in self.diagnoses if d.switch}
        # Each leaf's quiet nodes' times, for leaves that have any: the test below, whether
        # other leaves went quiet too, then looks at those leaves only, not every leaf's list.
        quiet: dict[str, list[float]] = {}
        for leaf, listed in self.topology.items():
            times = [first_down[n].t for n in listed if n in first_down]
            if times:
                quiet[leaf] = times
        for leaf in sorted(self.topology):
            members = set(self.topology[leaf])
            if leaf in switched or len(members) < REACH_SWITCH_MIN_NODES:
                continue
            burst = _window([first_down[n] for n in members if n in first_down], REACH_BURST_S)
            if len(burst) < REACH_SWITCH_MIN_NODES or len(burst) <= SWITCH_MAJORITY * len(members):
                continue
            b0 = burst[0].t
            busy = any(other != leaf and sum(1 for t in times if abs(t - b0) <= REACH_BURST_S)
                       > SWITCH_MAJORITY * len(self.topology[other])
                       for other, times in quiet.items())
            if busy:
                continue  # several leaves at once is not one switch; the nodes decide
            nodes = sorted(r.node for r in burst)
            for n in members:
                self.nic_nodes.setdefault(n, []).append(b0)
            clean = sorted(o for o in self.topology if o != leaf)
            said = "; ".join(dict.fromkeys(r.text for r in burst[:3]))
            jobs = tuple(sorted({j for n in nodes for j in self.jobs_of.get(n, ())
                                 if self.job_alive(j, b0)}))
            self.add(Diagnosis(
                SWITCH_FAILURE, tuple(nodes), 0.7, PLAYBOOK_FOR[SWITCH_FAILURE],
                f"{len(nodes)} of the {len(members)} nodes under {leaf} ({_names(nodes)}) "
                f"stopped answering within {max(burst[-1].t - b0, 1):.0f} s from "
                f"{_when(burst[0].at)} ({said}), while {_names(clean)} kept answering and none "
                "of them shows a GPU fault: the switch they share, not the nodes, is the likely "
                "cause; no node is blamed.", burst[0].at, switch=leaf, jobs=jobs,
                evidence=tuple(_ids(burst))), b0, burst[0].source)

    # --- 6. fail-slow ----------------------------------------------------------------------

    def fail_slow(self) -> None:
        """Nodes slower than their jobs' peers (incidents.diagnosis.slow), unless a fault
        found above explains it: a GPU fault, a link, heat, a node gone (a harder fault
        slows a node too, and its own repair comes first)."""
        f = self.facts
        if not f.slow_seen:
            return
        jobs = [JobInfo(j, self.job_user.get(j, ""), tuple(sorted(nodes)),
                        self.job_gpus.get(j, {}))
                for j, nodes in sorted(self.job_nodes.items())]
        spans = {j: (s.first_running, s.ended) for j, s in f.job_spans.items()}
        result = slow.analyse(slow.Window(jobs, f.readings, f.paces, f.reports, f.downtrains,
                                          spans))
        faulty = set(self.gpu_nodes) | set(self.nic_nodes) | {
            n for c in self.causes for n in c.nodes}
        for note in result.notes:
            self.note("symptom", note.text, datetime.fromtimestamp(note.at, UTC),
                      nodes=(note.node,))
        for found in result.findings:
            at = datetime.fromtimestamp(found.start, UTC)
            if found.node in faulty:
                self.note("symptom", f"{found.node} was also slower than its job's peers; the "
                          "fault found on it explains that", at, nodes=(found.node,))
                continue
            drained = self.admin_drained.get(found.node)
            if drained is not None:
                self.note("suppressed", f"{found.node} is slower than its job's peers, and "
                          f"{drained_by(drained[1])} drained it ({drained[1]}): theirs to "
                          "handle", at, nodes=(found.node,))
                continue
            self.add(Diagnosis(FAIL_SLOW, (found.node,), found.confidence,
                               PLAYBOOK_FOR[FAIL_SLOW], found.explanation, at, jobs=found.jobs,
                               evidence=found.evidence), found.start, "dcgm")

    # --- 7. jobs ---------------------------------------------------------------------------

    def job_failures(self) -> None:
        per_job: dict[str, list[JobFact]] = defaultdict(list)
        for f in self.facts.job_lines:
            if f.job:
                per_job[f.job].append(f)
        app_xid_jobs = getattr(self, "app_xid_jobs", {})
        # The faults found above, by the nodes and jobs they name: a job looks up its own
        # rather than going through every fault.
        causes_at: dict[str, list[_Cause]] = defaultdict(list)
        causes_of: dict[str, list[_Cause]] = defaultdict(list)
        for c in self.causes:
            # A slow node holds its job back, it does not kill it: a job that fails while a
            # node of it is slow failed of its own (or of another fault's) doing.
            if c.diagnosis.root_cause in (APPLICATION_ERROR, FAIL_SLOW):
                continue
            for node in c.nodes:
                causes_at[node].append(c)
            for j in c.diagnosis.jobs:
                causes_of[j].append(c)
        for job in sorted(set(per_job) | set(app_xid_jobs)):
            lines = per_job.get(job, [])
            xids = app_xid_jobs.get(job, [])
            span = self.facts.job_spans.get(job)
            if span is not None and span.state in ("COMPLETED", "CANCELLED", "PREEMPTED",
                                                   "TIMEOUT") and not xids:
                continue  # it ended the way jobs end; its last words are not a fault
            failures = [f for f in lines if f.kind not in p.SYMPTOMS]
            strong = [f for f in failures if f.kind in p.APP_STRONG]
            symptoms = [f for f in lines if f.kind in p.SYMPTOMS]
            nodes = self.job_nodes.get(job, set())
            # A fault may be listed twice here: only whether there is one, and the earliest
            # time, are read.
            touching = [c for n in nodes for c in causes_at.get(n, ()) if job not in c.spared]
            touching += causes_of.get(job, ())
            if not failures and not xids:
                if symptoms and not touching:
                    self.note("symptom", f"job {job}: {len(symptoms)} NCCL/network error line(s) "
                              f"from {_when(symptoms[0].at)} with no fault found behind them",
                              symptoms[0].at, job=job)
                continue
            first_own = min((f.t for f in strong), default=None)
            first_xid = min((f.t for f in xids), default=None)
            own = min((t for t in (first_own, first_xid) if t is not None), default=None)
            if touching:
                fault_t = min(c.early for c in touching)
                if own is None or own >= fault_t - APP_BEFORE_FAULT_S:
                    continue  # the job died of the fault above, not of its own bug
                if symptoms and first_own is not None and (first_xid is None or first_xid >= (
                        symptoms[0].t)) and first_own >= symptoms[0].t - APP_BEFORE_FAULT_S:
                    # Its ranks lost each other first and failed after: how a job dies of a
                    # fault, whatever the faulty node's clock or its source's delay said.
                    continue
            self._application_error(job, failures, strong, xids, symptoms)

    def _application_error(self, job: str, failures: list[JobFact], strong: list[JobFact],
                           xids: list[XidFact], symptoms: list[JobFact]) -> None:
        parts = []
        ids: list[int] = []
        if xids:
            gpus = {f"{f.node} {f.gpu}" for f in xids}
            codes = sorted({f.code for f in xids})
            names = [f"{c} ({x.XID_TABLE[c].meaning})" for c in codes]
            scope = (" on every GPU reported" if len(gpus) > 1 else "")
            parts.append(f"application XID {', '.join(names)} on {_names(gpus, 4)}{scope}")
            ids += _ids(xids)
        if strong:
            parts.append(f"'{strong[0].text.strip()[:120]}' at {_when(strong[0].at)}")
        elif failures:
            parts.append(f"{failures[0].text.strip()[:120]} at {_when(failures[0].at)}")
        ids += _ids(failures)
        confidence = 0.9 if (strong or xids) else (0.6 if symptoms else 0.75)
        first = min([f.at for f in failures] + [f.at for f in xids])
        user = self.job_user.get(job)
        explanation = (f"Job {job}" + (f" ({user})" if user else "") + " failed in its own "
                       "code: " + "; ".join(parts) + ". No GPU, link or node fault explains it, "
                       "so no node is blamed; its owner is told.")
        self.diagnoses.append(Diagnosis(
            APPLICATION_ERROR, (), confidence, PLAYBOOK_FOR[APPLICATION_ERROR], explanation,
            first, job=job, jobs=(job,), evidence=tuple(ids)))


def run(facts: Facts, topology: Mapping[str, Sequence[str]],
        jobs: Sequence[JobInfo]) -> tuple[list[Diagnosis], list[Note]]:
    skews = clocks.estimate(facts)
    clocks.align(facts, skews)
    engine = Engine(facts, topology, jobs)
    for skew in sorted(skews.values(), key=lambda s: s.node):
        engine.note("clock", f"{skew.node}'s clock reads {abs(skew.offset):.0f} s "
                    f"{'ahead' if skew.offset > 0 else 'behind'} ({skew.why}): its kernel lines "
                    "and job output are read on the cluster's clock",
                    facts.first or datetime.now(UTC), nodes=(skew.node,))
    reach = engine.source_outages()
    engine.gpu_faults()
    engine.link_faults()
    engine.thermal_faults()
    tool_verdicts(engine)  # other health tools' verdicts with no XID: incidents.diagnosis.tools
    engine.unreachable_nodes(reach)
    engine.fail_slow()
    engine.job_failures()
    for at, node, reason in facts.admin_drains:
        engine.note("suppressed", f"{node} drained by {drained_by(reason)} ({reason}): not a "
                    "fault", at, nodes=(node,))
    return engine.diagnoses, engine.notes
