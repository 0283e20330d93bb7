"""One pass over a window's observations: raw signals in, the facts rules reason about out.

This is where gauges and counters are read correctly. dcgm-exporter's XID field is the value
of the *last* XID, so only a change is a new XID; NIC counters are running totals, so only a
rise is an event (the first reading is the baseline, whatever its value); a port that reads
DOWN is one event, not one per scrape. Everything downstream sees events, not samples.

The pass is linear in the number of observations and keeps telemetry cheap: a utilisation
sample is skipped at once, a temperature is kept only if it is hot, a clock-event sample only
while it shows or ends a thermal slowdown. That is what lets one cycle cover 100,000 GPUs.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from operator import attrgetter
from typing import Any

import incidents.diagnosis.parsers as p
import incidents.diagnosis.progress as progress
import incidents.diagnosis.slow as slow
from collectors.knowledge import dcgm
from collectors.knowledge import health_tools as ht
from incidents.diagnosis.types import Observation

# A GPU this hot while its clocks are held back for thermal reasons is overheating; a GPU this
# hot at full clocks is only warm. Data-centre GPUs slow down at about 85-90 C (H100: 87 C).
HOT_C = 80.0

LINK_DOWNED = "link_downed"
LINK_RECOVERY = "link_error_recovery"
# Thermal samples this close together belong to one slowdown even with normal scrapes between.
THERMAL_GAP_S = 60.0
PORT_DOWN = frozenset({"DOWN", "POLLING", "DISABLED"})
PORT_UP = frozenset({"ACTIVE", "LINKUP", "ACTIVE_DEFER"})
TERMINAL_JOB_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                                 "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
NODE_LOST_JOB_STATES = frozenset({"NODE_FAIL", "BOOT_FAIL"})
# Collector names as they appear in collector signals -> the sources they read.
COLLECTOR_SOURCES = {
    "slurm": ("slurm",), "slurmctld": ("slurm",), "slurmrestd": ("slurm",),
    "kubernetes": ("kubernetes",), "k8s": ("kubernetes",),
    "dcgm": ("dcgm",), "prometheus": ("dcgm",), "telemetry": ("dcgm",),
    "agent": ("kernel", "nic"), "node_agent": ("kernel", "nic"), "nvml": ("kernel", "nic"),
    "kernel": ("kernel",), "nic": ("nic",),
}
# Collectors are named by whoever deploys them ("kube-apiserver", "slurmrestd-east",
# "dcgm-exporter"): a name that is not above is matched on these words, in this order.
COLLECTOR_WORDS = (("slurm", ("slurm",)), ("kube", ("kubernetes",)), ("k8s", ("kubernetes",)),
                   ("dcgm", ("dcgm",)), ("prom", ("dcgm",)), ("nvml", ("kernel", "nic")),
                   ("agent", ("kernel", "nic")), ("kernel", ("kernel",)), ("dmesg", ("kernel",)),
                   ("journal", ("kernel",)), ("nic", ("nic",)))


def collector_sources(name: str) -> tuple[str, ...]:
    """The replay sources a collector reads, from its name."""
    key = name.strip().lower()
    if key in COLLECTOR_SOURCES:
        return COLLECTOR_SOURCES[key]
    for word, sources in COLLECTOR_WORDS:
        if word in key:
            return sources
    return (key,)


@dataclass(slots=True)
class XidFact:
    at: datetime
    t: float
    node: str
    gpu: str  # "GPU 5" (dcgm index) or "PCI 0000:9b:00" (kernel line)
    code: int
    text: str
    source: str
    id: int | None
    recovery_action: int | None = None
    # Empty for an XID the driver or DCGM reported as one; else the driver message that was
    # read as this XID, in words (the "fallen off the bus" message as XID 79, ...).
    via: str = ""
    instance: str = ""  # MIG: "GPU-I 5" (the fault is the physical GPU's; this is for people)
    stale: bool = False  # a dcgm gauge read non-zero at the window's first scrape


@dataclass(slots=True)
class HwFact:
    """A hardware fault a kernel line reports that is not an XID: a fatal PCIe error (AER) on
    a device, a fatal NVSwitch error (SXid). ``gpu_known``: the device is known to be a GPU
    (the agent matched its address to one, or the NVIDIA driver printed the line)."""

    at: datetime
    t: float
    node: str
    kind: str  # "aer" or "sxid"
    device: str  # "PCI 0000:3b:00", "GPU 3" or "nvidia-nvswitch1 (PCI 0000:06:00)"
    code: int
    text: str
    id: int | None
    gpu_known: bool = False


@dataclass(slots=True)
class GpuLostFact:
    """slurmctld drained a node because its slurmd registered fewer GPUs than configured."""

    at: datetime
    t: float
    node: str
    reported: int
    configured: int
    reason: str
    id: int | None


@dataclass(slots=True)
class LinkFact:
    at: datetime
    t: float
    node: str
    port: str
    kind: str  # down, up, downed (link_downed rose), recovery (link_error_recovery rose)
    amount: int
    text: str
    id: int | None
    source: str = "nic"  # "kernel": a kernel line, stamped by the node's own clock


@dataclass(slots=True)
class ReachFact:
    at: datetime
    t: float
    node: str
    source: str
    reachable: bool
    text: str
    id: int | None


@dataclass(slots=True)
class JobFact:
    at: datetime
    t: float
    job: str
    node: str
    kind: str  # a parsers.NCCL_* symptom or a parsers.APP_* failure
    text: str
    id: int | None


@dataclass(slots=True)
class MemFact:
    at: datetime
    t: float
    node: str
    gpu: str
    text: str
    id: int | None


@dataclass(slots=True)
class CollectorFact:
    at: datetime
    t: float
    name: str
    healthy: bool
    error: str
    id: int | None


@dataclass(slots=True)
class ToolFact:
    """Another health tool's verdict on a node (NVSentinel, gpud, Node Problem Detector). One
    that names an XID is also read as that XID (an XidFact); this keeps what the tool said."""

    at: datetime
    t: float
    node: str
    tool: str
    check: str
    claim: str   # collectors.knowledge.health_tools
    active: bool
    fatal: bool
    has_xid: bool
    text: str
    id: int | None


@dataclass(slots=True)
class ThermalRun:
    """A stretch of samples in which one GPU's clocks were held back for thermal reasons."""

    node: str
    gpu: str
    start: datetime
    t_start: float
    t_end: float
    mask: int
    closed: bool = False
    ids: list[int] = field(default_factory=list)
    samples: int = 0      # scrapes that showed the slowdown
    t_last: float = 0.0   # the last of them


@dataclass(slots=True)
class JobSpan:
    first_running: float | None = None
    ended: float | None = None
    state: str = ""


@dataclass(slots=True)
class Facts:
    xids: list[XidFact] = field(default_factory=list)
    hardware: list[HwFact] = field(default_factory=list)
    gpus_lost: list[GpuLostFact] = field(default_factory=list)
    links: list[LinkFact] = field(default_factory=list)
    reach: list[ReachFact] = field(default_factory=list)
    job_lines: list[JobFact] = field(default_factory=list)
    memory: list[MemFact] = field(default_factory=list)
    collectors: list[CollectorFact] = field(default_factory=list)
    tools: list[ToolFact] = field(default_factory=list)
    thermal_runs: list[ThermalRun] = field(default_factory=list)
    hot: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)
    job_spans: dict[str, JobSpan] = field(default_factory=dict)
    job_nodes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # job -> node -> the GPU indices it held there, as Slurm last said (gres_detail).
    job_gpus: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    admin_drains: list[tuple[datetime, str, str]] = field(default_factory=list)
    # (job, node) -> [first, last] time the job wrote any output line there: when Slurm says
    # nothing about a job, this is when it ran.
    job_activity: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    nodes_seen: set[str] = field(default_factory=set)
    # node -> times a source that reads the node itself (its GPUs' samples, its kernel, its
    # job's output) heard from it after a report that it stopped answering: life, whatever
    # the kubelet or slurmctld says. Kept only for nodes with such a report, so it is short.
    alive: dict[str, list[float]] = field(default_factory=dict)
    claimed_down: set[str] = field(default_factory=set)
    # node -> how far its re-stamped times may still be off (clocks.align): comparisons with
    # another clock's times allow that much.
    clock_spread: dict[str, float] = field(default_factory=dict)
    # Nodes whose NIC ports a source read in the window (a reading says the port's state).
    nic_read: set[str] = field(default_factory=set)
    # node -> the GPU indices dcgm-exporter read there, for nodes Slurm says lost GPUs only.
    gpus_read: dict[str, set[int]] = field(default_factory=dict)
    # (node, "0000:ba:00") -> the GPU's index, from dcgm-exporter's pci_bus_id label.
    pci_gpus: dict[tuple[str, str], int] = field(default_factory=dict)
    # source -> how often it reads a node (the median gap between one series' readings), where
    # the window shows it: a scrape every 60 s spreads one moment's event over a minute.
    intervals: dict[str, float] = field(default_factory=dict)
    # (node, tool check) -> the (XID, PCI) pairs already read from it (see tool_verdict).
    tool_xids_seen: dict[tuple[str, str], set[tuple[int, str]]] = field(default_factory=dict)
    # Fail-slow (incidents.diagnosis.slow): whether the window holds anything of the kind (a
    # figure it compares, a job's pace or straggler report, a kernel PCIe downtrain line);
    # only then are the GPUs' readings gathered, in a second pass (_slow_readings).
    slow_seen: bool = False
    readings: dict[tuple[str, int], dict[str, list[slow.Sample]]] = field(default_factory=dict)
    paces: dict[tuple[str, str], list[tuple[float, progress.Pace, int | None]]] = field(
        default_factory=dict)
    reports: list[slow.Report] = field(default_factory=list)
    downtrains: list[slow.Downtrain] = field(default_factory=list)
    # job -> the straggler report section its last header line opened ("relative", ...)
    report_sections: dict[str, str] = field(default_factory=dict)
    first: datetime | None = None
    last: datetime | None = None


def _nodes(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        if "[" in value:
            import hostlist  # python-hostlist, Slurm's own hostlist syntax

            return tuple(hostlist.expand_hostlist(value))
        return tuple(n for n in value.replace(" ", ",").split(",") if n)
    if isinstance(value, list | tuple):
        return tuple(str(n) for n in value)
    return ()


def _port_state(value: Any) -> str:
    # sysfs prints "4: ACTIVE"; the replay format and the NIC collector say "ACTIVE".
    return str(value).rpartition(":")[2].strip().upper().replace(" ", "_")


_AT = attrgetter("at")


# Sources that hear from a node itself: a sample or a line from it is the node alive.
_LIFE = frozenset({"dcgm", "kernel", "nic", "job_log"})
# The sources extract reads; any other observation only names a node and a time.
_READ = frozenset({"dcgm", "kernel", "nic", "job_log", "slurm", "kubernetes", "collector",
                   "gpud"})


class _OutOfOrder(Exception):
    """The window is not in time order: it has to be sorted and read again."""


# What extract does with each dcgm field; a field not here (utilisation, clocks, power, memory
# use) only says that its node is alive, and is passed over after one dictionary look-up.
_XID, _CLOCKS, _TEMP, _MEMORY, _SLOW = 1, 2, 3, 4, 5
_DCGM_KIND: dict[str, int] = {
    # The fail-slow figures (utilisation aside: every window has it) only flag the window.
    **dict.fromkeys(set(dcgm.FAIL_SLOW_FIELDS) - {dcgm.GPU_UTIL, *dcgm.CLOCK_REASONS}, _SLOW),
    dcgm.XID_ERRORS: _XID, **dict.fromkeys(dcgm.CLOCK_REASONS, _CLOCKS),
    **dict.fromkeys(dcgm.TEMPERATURES, _TEMP),
    **dict.fromkeys((dcgm.ROW_REMAP_FAILURE, *dcgm.MEMORY_COUNTERS), _MEMORY),
}


def extract(observations: Sequence[Observation]) -> Facts:
    """Read a window once. Observations need not have ids.

    Sources send in time order, and then the window is read as it is; one that is not (a
    replay file written by hand) is sorted and read again, unless all that is out of order is
    observations of no source read here (the live window's stand-ins), which need no order.
    Checking costs next to nothing, where sorting 1.6 million observations that were already
    in order cost a fifth of a 100,000-GPU cycle, and the list it built, 1.6 million references
    long, was walked again by every garbage collection that ran before the cycle ended.
    """
    try:
        return _extract(observations)
    except _OutOfOrder:
        return _extract(sorted(observations, key=_AT))


def _extract(observations: Sequence[Observation]) -> Facts:
    facts = Facts()
    if not observations:
        return facts
    first = observations[0].at
    seen = facts.nodes_seen
    xid_last: dict[tuple[str, int], int] = {}
    # Nodes that ever had a non-zero XID gauge: a zero elsewhere changes nothing, and most
    # samples are zeros, so they are passed over without building a key.
    xid_nodes: set[str] = set()
    gauges: dict[tuple[str, int, str], float] = {}
    counters: dict[tuple[str, str, str], float] = {}
    ports: dict[tuple[str, str], str] = {}
    # node -> (time, PCI address) of the last "NVRM: The NVIDIA GPU <address>" line alone: the
    # head of a message split over lines, which names the GPU its last line is about.
    headers: dict[str, tuple[float, str]] = {}
    runs: dict[tuple[str, int], ThermalRun] = {}
    # Nodes that ever had a thermal run: only there can a quiet clock sample close one.
    run_nodes: set[str] = set()
    hot = facts.hot
    kind_of = _DCGM_KIND.get
    slow_bits, thermal_mask, hot_c = dcgm.SLOW_BITS, dcgm.thermal_mask, HOT_C
    seen_add = seen.add
    # Consecutive observations usually share a node and a time (one exporter's scrape): the
    # identity tests skip the set insert and the time comparison for all but the first.
    last_node: str | None = None
    prev_at = observations[0].at
    # How often each source reads a node, from one node's readings (the first it names):
    # looked at only where the node changes from one observation to the next, so it costs
    # next to nothing per sample.
    # Nodes some source said stopped answering: from then on their own sources' signs of
    # life are noted (in the branch below, once per run of one node's observations).
    claimed = facts.claimed_down
    alive = facts.alive
    probes: dict[str, str] = {}
    first_of: dict[str, datetime] = {}  # source -> its first observation (near enough)
    probe_at: dict[str, float] = {}
    gaps: dict[str, list[float]] = defaultdict(list)

    for obs in observations:
        at = obs.at
        if at is not prev_at:
            if at < prev_at:
                if obs.source in _READ:
                    raise _OutOfOrder
                # A source this pass does not read says only that its node exists and when:
                # neither depends on order. The live window appends such stand-ins (one pair
                # per node for the idle samples the database summed up) after its ordered
                # rows; they cost no sort and no second pass.
                if obs.node:
                    seen_add(obs.node)
                first = min(first, at)
                continue
            prev_at = at
        source, node = obs.source, obs.node
        if node is not last_node:
            last_node = node
            if node:
                seen_add(node)
                if node in claimed and source in _LIFE:
                    alive.setdefault(node, []).append(at.timestamp())
                probe = probes.get(source)
                if probe is None:
                    probes[source] = node
                    probe_at[source] = at.timestamp()
                    first_of[source] = at
                elif probe == node:
                    t_probe = at.timestamp()
                    if t_probe - probe_at[source] >= MIN_GAP_S:
                        gaps[source].append(t_probe - probe_at[source])
                        probe_at[source] = t_probe
        if source == "dcgm":
            value = obs.value
            if value is None:
                continue
            kind = kind_of(obs.metric)
            if kind is None:
                continue
            # Temperatures and clock events first: with utilisation, nearly every sample. The
            # GPU index is read only where a sample says something.
            if kind == _TEMP:
                if value >= hot_c:
                    gpu = obs.gpu if obs.gpu is not None else -1
                    hot.setdefault((node, f"GPU {gpu}"), []).append((at.timestamp(), value))
            elif kind == _CLOCKS:
                mask = int(value) if value else 0
                # Most samples read 0: test the bits inline before the full check.
                if mask & slow_bits:
                    gpu = obs.gpu if obs.gpu is not None else -1
                    key = (node, gpu)
                    run = runs.get(key)
                    if not thermal_mask(mask, run is not None and not run.closed):
                        if run is not None and not run.closed:
                            run.t_end, run.closed = at.timestamp(), True
                        continue
                    t = at.timestamp()
                    # A GPU bouncing off its limit (slowed, released for a scrape, slowed
                    # again) is one slowdown, not many blips.
                    if run is None or (run.closed and t - run.t_last > THERMAL_GAP_S):
                        run = runs[key] = ThermalRun(node, f"GPU {gpu}", at, t, t, mask)
                        facts.thermal_runs.append(run)
                        run_nodes.add(node)
                    run.t_end = run.t_last = t
                    run.mask |= mask
                    run.closed = False
                    run.samples += 1
                    if obs.id is not None:
                        run.ids.append(obs.id)
                elif node in run_nodes:
                    run = runs.get((node, obs.gpu if obs.gpu is not None else -1))
                    if run is not None and not run.closed:
                        run.t_end, run.closed = at.timestamp(), True
            elif kind == _SLOW:
                facts.slow_seen = True
            elif kind == _XID:
                code = int(value)
                if not code and node not in xid_nodes:
                    continue  # a zero where no XID was seen: nothing changed
                gpu = obs.gpu if obs.gpu is not None else -1
                key = (node, gpu)
                last = xid_last.get(key)
                if code and (bus := obs.fields.get("pci_bus_id")):
                    # dcgm-exporter labels each GPU with its address: what ties a kernel
                    # line's "PCI:0000:ba:00" to Slurm's GPU index on a shared node.
                    facts.pci_gpus[(node, p.pci_address(str(bus)))] = gpu
                if last is None:
                    before = obs.fields.get("previous")
                    if isinstance(before, int | float) and not isinstance(before, bool):
                        last = int(before)
                    elif code and at <= first_of.get(source, at) + STALE_XID:
                        # The gauge is the last XID since the exporter started: read already
                        # at the window's first scrape, it may be old news. The rules decide,
                        # from whether anything went wrong around it.
                        xid_last[key] = code
                        xid_nodes.add(node)
                        facts.xids.append(XidFact(
                            at, at.timestamp(), node, f"GPU {gpu}", code,
                            f"{dcgm.XID_ERRORS}={code} on {node} GPU {gpu}", "dcgm", obs.id,
                            stale=True))
                        continue
                    else:
                        last = 0
                if code != last:
                    xid_last[key] = code
                    if code:
                        xid_nodes.add(node)
                        facts.xids.append(XidFact(
                            at, at.timestamp(), node, f"GPU {gpu}", code,
                            f"{dcgm.XID_ERRORS}={code} on {node} GPU {gpu}", "dcgm", obs.id))
            else:
                metric = obs.metric
                gpu = obs.gpu if obs.gpu is not None else -1
                key3 = (node, gpu, metric)
                # The live collector sends changes with the reading before them.
                previous = gauges.get(key3, obs.fields.get("previous"))
                if not isinstance(previous, int | float) or isinstance(previous, bool):
                    previous = None
                gauges[key3] = value
                if metric == dcgm.ROW_REMAP_FAILURE:  # a flag: 0 -> 1 (or first seen at 1)
                    rose = value > 0 and not previous
                else:  # a running total: the first reading is the baseline
                    rose = previous is not None and value > previous
                if rose:
                    facts.memory.append(MemFact(at, at.timestamp(), node, f"GPU {gpu}",
                                                f"{metric}={value:g} on {node} GPU {gpu}", obs.id))
            continue
        if source == "kernel":
            _kernel(obs, facts, ports, headers)
            continue
        if source == "nic":
            _nic(obs, facts, counters, ports)
            continue
        if source == "job_log":
            t = obs.at.timestamp()
            seen_at = facts.job_activity.get((obs.job, node))
            if seen_at is None:
                facts.job_activity[(obs.job, node)] = [t, t]
            else:
                seen_at[1] = t
            line = p.parse_job_line(obs.message)
            if line is not None:
                facts.job_lines.append(JobFact(obs.at, obs.at.timestamp(), obs.job, node,
                                               line.kind, obs.message, obs.id))
            else:
                _job_pace(obs, facts)
            continue
        if source == "slurm":
            _slurm(obs, facts)
            continue
        if source == "kubernetes":
            _kubernetes(obs, facts)
            continue
        if source == "gpud":
            tool_verdict(obs, facts, p.parse_gpud_event(obs.fields, obs.message))
            continue
        if source == "collector":
            f = obs.fields
            healthy = f.get("healthy")
            if isinstance(healthy, str):
                healthy = healthy.strip().lower() in ("true", "1", "yes")
            facts.collectors.append(CollectorFact(
                obs.at, obs.at.timestamp(), str(f.get("name") or ""), bool(healthy),
                str(f.get("error") or ""), obs.id))
    # The last time in order; a stand-in out of order can only lie before it.
    facts.first, facts.last = first, prev_at
    facts.intervals = {source: statistics.median(found) for source, found in gaps.items()
                       if len(found) >= MIN_GAPS}
    if facts.tools:
        _drop_tool_xid_twins(facts)
    if facts.gpus_lost:
        _gpus_read(observations, facts)
    if facts.slow_seen:
        _slow_readings(observations, facts)
        # The GPU a kernel line's PCI address is, now that the exporter's labels are read.
        facts.downtrains = [
            d if d.gpu is not None or not d.device.startswith("GPU ") else replace(
                d, gpu=(gpu := facts.pci_gpus.get((d.node, p.pci_address(d.device[4:])))),
                device=f"GPU {gpu}" if gpu is not None else d.device)
            for d in facts.downtrains]
    return facts


# Lines of one straggler report printed one rank per line, this close together, are one report.
REPORT_LINES_S = 5.0


def _job_pace(obs: Observation, facts: Facts) -> None:
    """A job's output line that is no failure: its pace (an iteration time or a rate) or a
    straggler report, for the fail-slow analysis."""
    message = obs.message
    pace = progress.parse_pace(message)
    t = obs.at.timestamp()
    if pace is not None:
        facts.paces.setdefault((obs.job, obs.node), []).append((t, pace, obs.id))
        facts.slow_seen = True
        return
    report = progress.parse_straggler_report(message)
    if report is None:
        return
    header = progress.straggler_header(message)
    if header and not report.scores:
        facts.report_sections[obs.job] = header  # the rank lines that follow are its
        return
    section = report.section or facts.report_sections.get(obs.job, "")
    if section == progress.INDIVIDUAL:
        return  # each rank against its own best: a whole job slowing looks the same
    facts.slow_seen = True
    last = facts.reports[-1] if facts.reports else None
    if (not report.section and last is not None and last.job == obs.job
            and t - last.at <= REPORT_LINES_S):
        facts.reports[-1] = slow.Report(last.at, last.job, last.scores + report.scores, last.id)
        return
    facts.reports.append(slow.Report(t, obs.job, report.scores, obs.id))


def _slow_readings(observations: Sequence[Observation], facts: Facts) -> None:
    """The GPUs' fail-slow figures, for the analysis: a second look at the window, made only
    when the first found something of the kind (most windows have none, and gathering every
    utilisation sample of 100,000 GPUs would cost every cycle)."""
    wanted = frozenset(dcgm.FAIL_SLOW_FIELDS)
    readings = facts.readings
    pci = facts.pci_gpus
    for obs in observations:
        if obs.source != "dcgm" or obs.gpu is None or obs.value is None \
                or obs.metric not in wanted:
            continue
        readings.setdefault((obs.node, obs.gpu), {}).setdefault(obs.metric, []).append(
            (obs.at.timestamp(), obs.value, obs.id))
        if (bus := obs.fields.get("pci_bus_id")) and (obs.node, p.pci_address(str(bus))) not in pci:
            pci[(obs.node, p.pci_address(str(bus)))] = obs.gpu


def _gpus_read(observations: Sequence[Observation], facts: Facts) -> None:
    """Which GPUs dcgm-exporter read on the nodes Slurm says registered too few: a second
    look at the window, for those nodes only (such drains are rare; tracking every node's GPUs
    in the pass above would cost every cycle)."""
    lost = {f.node: f.t for f in facts.gpus_lost}
    seen = facts.gpus_read
    for obs in observations:
        if obs.source == "dcgm" and obs.gpu is not None and obs.node in lost:
            seen.setdefault(obs.node, set()).add(obs.gpu)


# Readings of one node this close together are one reading (a scrape's samples carry one
# time; a second node's in between does not make two); a source's interval is told from at
# least this many gaps.
MIN_GAP_S = 0.5
# A dcgm XID gauge read non-zero this soon after dcgm's first sample in the window, with
# nothing before it, held that value already: the window's first scrape round.
STALE_XID = timedelta(seconds=60)
MIN_GAPS = 2

# A split message's lines are printed together: the head this close before its last line.
HEADER_S = 5.0


def _kernel(obs: Observation, facts: Facts, ports: dict[tuple[str, str], str],
            headers: dict[str, tuple[float, str]]) -> None:
    parsed = p.parse_kernel(obs.message)
    if parsed is None:
        line = slow.parse_downtrain(obs.message)
        if line is not None:
            facts.downtrains.append(slow.Downtrain(
                obs.at.timestamp(), obs.node, slow.device_name(line.driver, line.pci, obs.gpu),
                obs.gpu, line.gen, line.width, line.cap_gen, line.cap_width, obs.message,
                obs.id))
            facts.slow_seen = True
        return
    node, at = obs.node, obs.at
    if isinstance(parsed, p.KernelXid):
        pci = parsed.pci
        if not pci and (head := headers.get(node)) and at.timestamp() - head[0] <= HEADER_S:
            pci = head[1]
        # With no address the node still lost a GPU; which one, the line does not say.
        gpu = f"PCI {pci}" if pci else "a GPU (address not printed)"
        instance = ""
        if parsed.gpu_instance is not None:
            instance = f"GPU-I {parsed.gpu_instance}" + (
                f" GPU-CI {parsed.compute_instance}" if parsed.compute_instance is not None
                else "")
        facts.xids.append(XidFact(at, at.timestamp(), node, gpu, parsed.code, obs.message,
                                  "kernel", obs.id, parsed.recovery_action, parsed.via,
                                  instance))
    elif isinstance(parsed, p.NvrmGpuHeader):
        headers[node] = (at.timestamp(), parsed.pci)
    elif isinstance(parsed, p.NetdevLink):
        facts.links.append(LinkFact(at, at.timestamp(), node, parsed.device,
                                    "up" if parsed.up else "down", 1, obs.message, obs.id,
                                    "kernel"))
    elif isinstance(parsed, p.IbPortState):
        up = parsed.up
        if up is None:
            return  # INIT, ARMED: a port on its way up; ACTIVE says when it got there
        # Named as the NIC source names ports ("mlx5_0/1"), and read as transitions like its
        # state readings, so the agent's reading and the kernel's line of one change are one.
        port = f"{parsed.device}/{parsed.port}"
        previous = ports.get((node, port))
        ports[(node, port)] = parsed.state
        if not up and previous not in PORT_DOWN:
            facts.links.append(LinkFact(at, at.timestamp(), node, port, "down", 1, obs.message,
                                        obs.id, "kernel"))
        elif up and previous in PORT_DOWN:
            facts.links.append(LinkFact(at, at.timestamp(), node, port, "up", 1, obs.message,
                                        obs.id, "kernel"))
    elif isinstance(parsed, p.NvswitchSxid):
        # Non-fatal SXids are corrected or contained by the switch and the traffic goes on;
        # detail lines repeat the error before them. Only a fatal one stops NVLink traffic.
        if parsed.fatal:
            facts.hardware.append(HwFact(
                at, at.timestamp(), node, "sxid",
                f"{parsed.switch or 'NVSwitch'} (PCI {parsed.pci})", parsed.code, obs.message,
                obs.id))
    # Corrected AER errors are the link retrying a transfer, and it worked: noise, never an
    # incident. Uncorrected non-fatal ones are reported to the device's driver, which recovers
    # the transaction; if the GPU is hurt its driver says so with an XID. A fatal one takes
    # the link down and the device with it.
    elif isinstance(parsed, p.PcieAer) and parsed.severity == p.AER_FATAL:
        known = obs.gpu is not None or parsed.from_gpu_driver
        device = f"GPU {obs.gpu}" if obs.gpu is not None else f"PCI {parsed.pci}"
        facts.hardware.append(HwFact(at, at.timestamp(), node, "aer", device, 0, obs.message,
                                     obs.id, known))


def _nic(obs: Observation, facts: Facts, counters: dict[tuple[str, str, str], float],
         ports: dict[tuple[str, str], str]) -> None:
    f = obs.fields
    facts.nic_read.add(obs.node)
    port = f"{f.get('device', '')}/{f.get('port', '')}"
    if "state" in f:
        state = _port_state(f["state"])
        previous = ports.get((obs.node, port))
        ports[(obs.node, port)] = state
        if state in PORT_DOWN and previous not in PORT_DOWN:
            facts.links.append(LinkFact(obs.at, obs.at.timestamp(), obs.node, port, "down", 1,
                                        f"{port} state {previous or '?'} -> {state}", obs.id))
        elif state in PORT_UP and previous in PORT_DOWN:
            facts.links.append(LinkFact(obs.at, obs.at.timestamp(), obs.node, port, "up", 1,
                                        f"{port} state {previous} -> {state}", obs.id))
        return
    if obs.value is None or obs.metric not in (LINK_DOWNED, LINK_RECOVERY):
        return
    key = (obs.node, port, obs.metric)
    # The first reading in the window is the baseline, unless the signal carries the reading
    # before it (the live collector sends only changes, with what they changed from).
    previous_total = counters.get(key, f.get("previous"))
    if not isinstance(previous_total, int | float) or isinstance(previous_total, bool):
        previous_total = None
    counters[key] = obs.value
    if previous_total is None or obs.value <= previous_total:
        return  # the first reading is a baseline; a drop is a counter reset
    kind = "downed" if obs.metric == LINK_DOWNED else "recovery"
    facts.links.append(LinkFact(
        obs.at, obs.at.timestamp(), obs.node, port, kind, int(obs.value - previous_total),
        f"{port} {obs.metric} {previous_total:g} -> {obs.value:g}", obs.id))


def _slurm(obs: Observation, facts: Facts) -> None:
    f = obs.fields
    if obs.job:
        state = p.slurm_job_state(f.get("job_state"))
        nodes = _nodes(f.get("nodes")) or facts.job_nodes.get(obs.job, ())
        if nodes:
            facts.job_nodes[obs.job] = nodes
            facts.nodes_seen.update(nodes)
        gpus = f.get("gpus")
        if isinstance(gpus, Mapping):
            held = {str(n): tuple(g for g in v if isinstance(g, int))
                    for n, v in gpus.items() if isinstance(v, list)}
            if held:
                facts.job_gpus[obs.job] = held
        t = obs.at.timestamp()
        span = facts.job_spans.setdefault(obs.job, JobSpan())
        span.state = state
        if state == "RUNNING" and span.first_running is None:
            span.first_running = t
        if state in TERMINAL_JOB_STATES:
            span.ended = t
        reason = str(f.get("state_reason") or "")
        if state in NODE_LOST_JOB_STATES:
            # A symptom: the record lists the job's nodes, and one of them (or none, if a
            # switch died) failed. The node-level evidence says which.
            facts.job_lines.append(JobFact(obs.at, t, obs.job, "", p.JOB_NODE_FAIL,
                                           f"job {obs.job} {state}", obs.id))
        elif state == "OUT_OF_MEMORY":
            facts.job_lines.append(JobFact(obs.at, t, obs.job, "", p.APP_OOM,
                                           f"job {obs.job} OUT_OF_MEMORY", obs.id))
        elif state == "FAILED":
            code = p.slurm_exit_code(f.get("exit_code"))
            if code is None or code.failed:
                shown = f"exit code {code.return_code}" if code else reason or "no exit code"
                facts.job_lines.append(JobFact(obs.at, t, obs.job, "", p.APP_EXIT,
                                               f"job {obs.job} FAILED ({shown})", obs.id))
        return
    if not obs.node:
        return
    tokens = p.slurm_node_state(f.get("node_state", f.get("state")))
    tokens |= p.slurm_node_state(f.get("state_flags"))
    reason = str(f.get("reason") or "")
    t = obs.at.timestamp()
    shown = "+".join(sorted(tokens))
    if tokens & p.SLURM_PLANNED:
        # `scontrol reboot`, a maintenance reservation, power saving: someone meant it, and a
        # node that goes quiet or loses its link now is being worked on.
        facts.admin_drains.append((obs.at, obs.node, reason or f"Slurm {shown}"))
        return
    out = tokens & {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL"}
    if p.NOT_RESPONDING in tokens and not out and reason \
            and not reason.lower().startswith("not responding"):
        # Back in service with the reason of its time out (Slurm 23.11+ keep it after a
        # RESUME) and not yet pinged: 25.11 shows a node it just resumed as IDLE+NOT_RESPONDING
        # until slurmctld's next ping. Not a node that stopped answering; one that really
        # does is set DOWN ("Not responding") after SlurmdTimeout, and Kubernetes sees it too.
        return
    if p.NOT_RESPONDING in tokens or ("DOWN" in tokens and reason.lower().startswith(
            "not responding")):
        facts.reach.append(ReachFact(obs.at, t, obs.node, "slurm", False,
                                     f"Slurm: {obs.node} {shown} ({reason or 'no reason'})", obs.id))
        facts.claimed_down.add(obs.node)
        return
    if tokens & {"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "INVALID_REG", "INVAL"} and (
            lost := p.slurm_gpus_lost(reason)) is not None:
        # slurmctld's own drain (INVALID_REG: its registration was refused), and a fault: the
        # node registered fewer GPUs than it has.
        facts.gpus_lost.append(GpuLostFact(obs.at, t, obs.node, lost[0], lost[1], reason,
                                           obs.id))
        return
    if tokens & {"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL"}:
        if reason and not reason.startswith("fleetwatch:"):
            facts.admin_drains.append((obs.at, obs.node, reason))
        return
    if tokens & {"IDLE", "ALLOCATED", "MIXED", "COMPLETING"}:
        facts.reach.append(ReachFact(obs.at, t, obs.node, "slurm", True,
                                     f"Slurm: {obs.node} {shown}", obs.id))


def _kubernetes(obs: Observation, facts: Facts) -> None:
    f = obs.fields
    t = obs.at.timestamp()
    ready = p.k8s_ready(f.get("condition"), f.get("status"))
    if ready is not None:
        facts.reach.append(ReachFact(
            obs.at, t, obs.node, "kubernetes", ready,
            f"Kubernetes: {obs.node} Ready={f.get('status')} ({f.get('reason', '')})", obs.id))
        if not ready:
            facts.claimed_down.add(obs.node)
        return
    reason = str(f.get("event_reason") or f.get("reason") or "")
    if reason in p.UNREACHABLE_EVENTS or reason in p.REACHABLE_EVENTS:
        facts.reach.append(ReachFact(
            obs.at, t, obs.node, "kubernetes", reason in p.REACHABLE_EVENTS,
            f"Kubernetes event {reason} on {obs.node}: {obs.message}".rstrip(": "), obs.id))
        if reason in p.UNREACHABLE_EVENTS:
            facts.claimed_down.add(obs.node)
        return
    if reason in p.CORDONED_EVENTS or f.get("unschedulable") is True:
        # A cordon (kubectl cordon or drain, kured before a reboot): the node is being taken
        # out of service on purpose, like a drain in Slurm.
        facts.admin_drains.append((obs.at, obs.node, "cordoned in Kubernetes"))
        return
    tool_verdict(obs, facts, p.parse_tool_verdict(f, obs.message))


# A tool's XID this close to the same XID from the kernel or DCGM on the same node is that one
# XID, seen twice: NVSentinel's syslog monitor reads the kernel line within seconds, gpud too.
TOOL_TWIN_S = 120.0


def _drop_tool_xid_twins(facts: Facts) -> None:
    """Keep one XidFact per XID: a tool's reading of an XID that the kernel or DCGM also
    reported is dropped, whichever came first, so an XID that counts only when repeated (119)
    is not counted twice for being seen by two programs. Two PCI addresses that differ are two
    GPUs (and so are two indices), not twins."""
    own: dict[tuple[str, int], list[XidFact]] = {}
    for f in facts.xids:
        if f.source not in ht.TOOLS:
            own.setdefault((f.node, f.code), []).append(f)
    if not own:
        return

    def other_gpu(a: str, b: str) -> bool:
        # Both named the same way (two PCI addresses, two indices) and differently.
        return a != b and a[:4] == b[:4] and a[:4] in ("PCI ", "GPU ")

    def twin(f: XidFact) -> bool:
        return any(abs(o.t - f.t) <= TOOL_TWIN_S and not other_gpu(o.gpu, f.gpu)
                   for o in own.get((f.node, f.code), ()))

    facts.xids = [f for f in facts.xids if f.source not in ht.TOOLS or not twin(f)]


def tool_verdict(obs: Observation, facts: Facts, verdict: p.ToolVerdict | None) -> None:
    """A health tool's verdict: kept as a ToolFact, and each XID it names read as that XID.

    NVSentinel rewrites its condition's whole message on every change (each fault it still
    holds, joined), so an XID already read from a node's condition is not read again until the
    condition clears: one fault, one XidFact, however often the message is rewritten."""
    if verdict is None or not obs.node:
        return
    node, at = obs.node, obs.at
    seen = facts.tool_xids_seen.setdefault((node, verdict.check), set())
    if not verdict.active and verdict.fatal:
        seen.clear()  # the condition cleared: a later XID is a new one
    for x in verdict.xids:
        key = (x.code, x.pci or str(x.gpu))
        if key in seen:
            continue
        seen.add(key)
        gpu = (f"PCI {x.pci}" if x.pci else f"GPU {x.gpu}" if x.gpu is not None
               else "a GPU (address not given)")
        facts.xids.append(XidFact(at, at.timestamp(), node, gpu, x.code, verdict.text,
                                  verdict.tool, obs.id, via=f"the {verdict.tool} verdict {verdict.check}"))
    facts.tools.append(ToolFact(at, at.timestamp(), node, verdict.tool, verdict.check,
                                verdict.claim, verdict.active, verdict.fatal,
                                bool(verdict.xids), verdict.text, obs.id))
