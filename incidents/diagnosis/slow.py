"""Fail-slow: a node alive but slower than its job's peers (pure: no Django, no database).

One slow GPU, a PCIe link trained at a lower speed or width, a GPU held at a power cap or a
degraded NIC slows a whole synchronous job: every rank waits for the slowest at each
collective. Nothing fails, no XID is logged; the job just runs at the straggler's pace.

The analysis compares each node with its own job's peers, doing the same work at the same
time, figure by figure:

- Each GPU figure (SM clock, power, memory bandwidth, NVLink and PCIe traffic) is averaged per
  GPU over short buckets of time. In each bucket, a GPU of a multi-node job is compared with
  the GPUs of the job's *other* nodes (a GPU of a one-node job with its node-mates): their
  median and their spread (the median absolute deviation, MAD). A GPU is slower in that
  bucket when it is beyond the figure's threshold on the slow side of the median *and*
  beyond ``z`` robust deviations, so a job whose GPUs legitimately spread (pipeline stages
  doing different work) needs a larger gap before anything counts.
- Only buckets where the job works are compared: a job idling, saving a checkpoint or ending
  (its median utilisation low, or past its end) is not, and neither is a GPU that is idle
  itself while its peers work (a rank finishing early is not slow).
- A figure counts when its slow buckets last ``sustain_s`` with few interruptions: a GPU that
  touches its power limit for a minute is not a straggler.
- Direct evidence: a PCIe link below its maximum generation or width while the GPU works
  (GPUs lower their link speed when idle, so an idle reading proves nothing), and the
  kernel's ``limited by 8.0 GT/s PCIe x8 link`` line. Alone it is noted, not an incident: a
  narrower link slows only a job that uses it; with any sign that the node holds its job
  back, it opens one.
- Explanation: the clock-event reasons of a slow GPU (power cap, thermal or hardware
  slowdown, an application clock setting), its utilisation against its peers' (a straggler
  computes while its peers wait for it), the job's own iteration time before and after, and
  the job's straggler report where it prints one.
- Iteration times the job reports per node (a one-line log or a push) are a figure like the
  others; where only one rank reports (the usual case), they say how much the job slowed.

A node whose whole job is slow is nobody's straggler (its peers are as slow); a node with a
harder fault (an XID, a link down, heat) is the other rules' (``rules.Engine.fail_slow``
leaves those nodes out).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from collectors.knowledge import dcgm
from collectors.knowledge.slurm import index_ranges
from incidents.diagnosis.progress import Pace, RankScore
from incidents.diagnosis.types import JobInfo

# (time in epoch seconds, value, the observation's id where it has one)
Sample = tuple[float, float, "int | None"]
GpuKey = tuple[str, int]  # (node, GPU index)


@dataclass(frozen=True)
class Figure:
    """A figure compared with the peers. ``threshold``: the relative gap that counts;
    ``trigger``: it can find a straggler on its own (utilisation and PCIe traffic only
    support: a straggler is often the *busiest* GPU, and traffic is bursty)."""

    field: str
    label: str
    unit: str
    threshold: float
    trigger: bool = True
    lower_is_slower: bool = True
    scale: float = 1.0      # reading -> the unit shown
    digits: int = 0


# The thresholds. Busy GPUs of one model hold their boost clocks within a few percent of each
# other, so 8 % below the peers is a GPU held back (a 10 % straggler must be caught). Power and
# memory traffic follow the work, and the nodes of a pipeline-parallel job do different work
# (10-15 % apart for good): 20 %. NVLink traffic is evened out by the collectives themselves (a
# rank that moves its bytes slowly makes its peers wait and move theirs as slowly): 20 %, and it
# mostly confirms. PCIe traffic comes in bursts (data loading, checkpoints): support only.
SM_CLOCK = Figure(dcgm.SM_CLOCK, "SM clock", "MHz", 0.08)
POWER = Figure(dcgm.POWER_USAGE, "power", "W", 0.20)
DRAM = Figure(dcgm.PROF_DRAM_ACTIVE, "memory bandwidth (DRAM active)", "%", 0.20, scale=100.0)
NVLINK = Figure(dcgm.NVLINK_BANDWIDTH_TOTAL, "NVLink traffic", "GB/s", 0.20, scale=1e-9,
                digits=1)
PCIE_TX = Figure(dcgm.PROF_PCIE_TX_BYTES, "PCIe TX", "GB/s", 0.40, trigger=False, scale=1e-9,
                 digits=1)
PCIE_RX = Figure(dcgm.PROF_PCIE_RX_BYTES, "PCIe RX", "GB/s", 0.40, trigger=False, scale=1e-9,
                 digits=1)
FIGURES: tuple[Figure, ...] = (SM_CLOCK, POWER, DRAM, NVLINK, PCIE_TX, PCIE_RX)
# The job's own pace, where it reports one per node: higher is slower.
ITERATION = "iteration_time"
PACE = Figure(ITERATION, "iteration time", "", 0.10, lower_is_slower=False)


@dataclass(frozen=True)
class Thresholds:
    bucket_s: float = 60.0       # readings are averaged per GPU over this long
    sustain_s: float = 300.0     # a figure must stay slow this long ...
    share: float = 0.75          # ... in this share of its buckets at least
    min_buckets: int = 3         # ... and at least this many of them
    z: float = 3.0               # robust deviations (1.4826 MAD) beyond the peers' median
    noise: float = 0.01          # the smallest spread assumed (1 % of the median)
    active_util: float = 30.0    # a job whose median utilisation is below this is not working
    idle_util: float = 5.0       # a GPU below this is idle, not slow
    min_peers: int = 3           # GPUs (or reporting nodes) to compare with, at least
    ending_s: float = 120.0      # the last minutes of a job that ended are not compared
    busy_gap: float = 10.0       # utilisation points above its peers: "computes while they wait"
    report_score: float = 0.85   # a straggler report's score at or below this names the node
    # ... and at or below this once is the job's own verdict: nvidia-resiliency-ext's default
    # gpu_relative_perf_threshold, below which it calls a rank a straggler itself
    report_straggler: float = 0.7
    pace_change: float = 0.05    # the job's iteration time rising this much is worth saying


DEFAULT = Thresholds()


@dataclass(frozen=True)
class Downtrain:
    """The kernel's ``63.012 Gb/s available PCIe bandwidth, limited by 16.0 GT/s PCIe x4 link
    at 0000:5b:01.0 (capable of 252.048 Gb/s with 16.0 GT/s PCIe x16 link)``: a device whose
    link trained below what it and its slot can do."""

    at: float
    node: str
    device: str       # "GPU 3", "NIC 0000:0c:00.0", "PCI 0000:5d:00.0"
    gpu: int | None
    gen: int | None
    width: int
    cap_gen: int | None
    cap_width: int
    text: str
    id: int | None = None

    @property
    def shown(self) -> str:
        return (f"{self.device}: PCIe {_link(self.gen, self.width)} (capable of "
                f"{_link(self.cap_gen, self.cap_width)}), as the kernel reported at "
                f"{_when(self.at)}")


# Linux's pcie_print_link_status() (drivers/pci/pci.c), printed when a device's driver probes
# it: "nvidia 0000:5d:00.0: 63.012 Gb/s available PCIe bandwidth, limited by 16.0 GT/s PCIe
# x4 link at 0000:5b:01.0 (capable of 252.048 Gb/s with 16.0 GT/s PCIe x16 link)". Kernels
# before 5.x print the speed without "PCIe" ("8 GT/s x8"), and "Unknown" for a speed they do
# not know.
_DOWNTRAIN = re.compile(
    r"(?:(?P<driver>[\w.-]+) (?P<pci>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d):\s*)?"
    r"[\d.]+ Gb/s available PCIe bandwidth, limited by (?P<speed>[\d.]+ GT/s|Unknown)(?: PCIe)? "
    r"x(?P<width>\d+) link at \S+ \(capable of [\d.]+ Gb/s with (?P<cap>[\d.]+ GT/s|Unknown)"
    r"(?: PCIe)? x(?P<capwidth>\d+) link\)")
_GEN_OF_GTS = {gts: gen for gen, gts in dcgm.PCIE_GT_PER_GEN.items()}
# Drivers whose devices are GPUs, or NICs: a narrow NIC link slows the node's traffic too.
_GPU_DRIVERS = ("nvidia",)
_NIC_DRIVERS = ("mlx5_core", "mlx4_core", "bnxt_en", "ice", "irdma", "efa")


@dataclass(frozen=True)
class DowntrainLine:
    driver: str
    pci: str
    gen: int | None
    width: int
    cap_gen: int | None
    cap_width: int


def parse_downtrain(message: str) -> DowntrainLine | None:
    """The kernel's line for a PCIe link below what its device and slot can do, or None
    (also None for a link at its best: the kernel prints the line then too, without
    "limited by")."""
    if "available PCIe bandwidth" not in message:
        return None
    m = _DOWNTRAIN.search(message)
    if m is None:
        return None
    gen = _gen(m.group("speed"))
    cap_gen = _gen(m.group("cap"))
    width, cap_width = int(m.group("width")), int(m.group("capwidth"))
    if (gen is not None and cap_gen is not None and gen >= cap_gen) and width >= cap_width:
        return None
    return DowntrainLine(m.group("driver") or "", m.group("pci") or "", gen, width, cap_gen,
                         cap_width)


def _gen(speed: str) -> int | None:
    try:
        return _GEN_OF_GTS.get(float(speed.split()[0]))
    except ValueError:
        return None


def device_name(driver: str, pci: str, gpu: int | None) -> str:
    """"GPU 3" (its index known), "GPU 0000:5d:00.0" (a GPU's driver printed it), "NIC ...",
    "PCI ..." (another device)."""
    if gpu is not None:
        return f"GPU {gpu}"
    if driver in _NIC_DRIVERS:
        return f"NIC {pci}"
    if driver in _GPU_DRIVERS:
        return f"GPU {pci}"
    return f"PCI {pci}" if pci else "a device"


@dataclass(frozen=True)
class Report:
    """One straggler report (nvidia-resiliency-ext) of a job: ranks' scores, section
    ``relative`` or unknown (an ``individual`` section says nothing about peers)."""

    at: float
    job: str
    scores: tuple[RankScore, ...]
    id: int | None = None


@dataclass
class Window:
    """What the analysis reads: a slice of time over some jobs' nodes."""

    jobs: Sequence[JobInfo]
    # (node, GPU) -> dcgm field -> samples in time order
    readings: Mapping[GpuKey, Mapping[str, Sequence[Sample]]]
    # (job, node) -> the job's pace as that node's output reports it
    paces: Mapping[tuple[str, str], Sequence[tuple[float, Pace, int | None]]] = field(
        default_factory=dict)
    reports: Sequence[Report] = ()
    downtrains: Sequence[Downtrain] = ()
    # job -> (running since, ended at): None where not known
    spans: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class Deviation:
    """One figure of one node, slower than its peers for a while."""

    field: str
    label: str
    gpus: tuple[int, ...]     # empty for a node's own figure (its iteration time)
    value: float              # the node's (its GPUs' median), in the figure's shown unit
    peers: float              # its peers' median, likewise
    change: float             # value / peers - 1 (negative: lower)
    start: float
    seconds: float
    trigger: bool
    text: str
    ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finding:
    node: str
    jobs: tuple[str, ...]
    gpus: tuple[int, ...]
    start: float
    seconds: float
    confidence: float
    explanation: str
    deviations: tuple[Deviation, ...]
    links: tuple[str, ...]
    evidence: tuple[int, ...]


@dataclass(frozen=True)
class SlowNote:
    at: float
    node: str
    text: str


@dataclass
class Result:
    findings: list[Finding]
    notes: list[SlowNote]


# --- helpers ----------------------------------------------------------------------------------


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M")


def _link(gen: int | None, width: int | None) -> str:
    parts = []
    if gen:
        parts.append(f"Gen{gen}")
    if width:
        parts.append(f"x{width}")
    return " ".join(parts) or "?"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


def _number(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def _shown(figure: Figure, value: float) -> str:
    return f"{_number(value, figure.digits)}{' ' if figure.unit and figure.unit != '%' else ''}" \
           f"{figure.unit}"


def _gpus(gpus: Iterable[int]) -> str:
    ordered = sorted(set(gpus))
    return f"GPU {ordered[0]}" if len(ordered) == 1 else f"GPUs {index_ranges(ordered)}"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _series(samples: Sequence[Sample], counter: bool) -> list[Sample]:
    """A counter's rate between readings (a drop is a reset: skipped); a gauge as it is. A
    "counter" field whose readings go up and down is a gauge written by hand (a replay): read
    as one."""
    if not counter or len(samples) < 2:
        return list(samples) if not counter else []
    drops = sum(1 for a, b in itertools.pairwise(samples) if b[1] < a[1])
    if drops > 0.1 * (len(samples) - 1):
        return list(samples)
    out: list[Sample] = []
    for a, b in itertools.pairwise(samples):
        dt = b[0] - a[0]
        if dt > 0 and b[1] >= a[1]:
            out.append((b[0], (b[1] - a[1]) / dt, b[2]))
    return out


class _Buckets:
    """Readings averaged per bucket of time: bucket -> (mean, ids)."""

    def __init__(self, t0: float, width: float) -> None:
        self.t0, self.width = t0, width

    def index(self, t: float) -> int:
        return int((t - self.t0) // self.width)

    def start(self, b: int) -> float:
        return self.t0 + b * self.width

    def means(self, samples: Iterable[Sample]) -> dict[int, tuple[float, list[int]]]:
        sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        ids: dict[int, list[int]] = defaultdict(list)
        for t, v, i in samples:
            if v != v or math.isinf(v):
                continue
            b = self.index(t)
            acc = sums[b]
            acc[0] += v
            acc[1] += 1
            if i is not None:
                ids[b].append(i)
        return {b: (s / n, ids.get(b, [])) for b, (s, n) in sums.items() if n}


@dataclass
class _Run:
    first: int
    last: int
    values: list[float] = field(default_factory=list)
    peers: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    misses: int = 0


def _best_run(states: Mapping[int, tuple[bool, float, float, list[int]]],
              limits: Thresholds) -> _Run | None:
    """The longest stretch of slow buckets, one quiet bucket in a row tolerated (buckets with
    no comparison are passed over), that holds ``limits.share`` slow buckets and lasts
    ``limits.sustain_s``."""
    best: _Run | None = None

    def keep(run: _Run) -> None:
        nonlocal best
        flagged = len(run.values)
        span = (run.last - run.first + 1) * limits.bucket_s
        if (flagged >= limits.min_buckets and span >= limits.sustain_s
                and flagged >= limits.share * (flagged + run.misses)
                and (best is None or flagged > len(best.values))):
            best = run

    run: _Run | None = None
    quiet = 0
    for b in sorted(states):
        slow, value, peers, ids = states[b]
        if slow:
            if run is None:
                run = _Run(b, b)
            run.misses += quiet  # quiet buckets between slow ones are in the run
            quiet = 0
            run.last = b
            run.values.append(value)
            run.peers.append(peers)
            run.ids.extend(ids)
        elif run is not None:
            quiet += 1
            if quiet > 1:
                keep(run)
                run, quiet = None, 0
    if run is not None:
        keep(run)
    return best


# --- the analysis ------------------------------------------------------------------------------


def analyse(window: Window, limits: Thresholds = DEFAULT) -> Result:
    """Findings (one per node held back, with its evidence) and notes (what was seen but is
    no finding: a narrow link with no slowdown to show)."""
    analysis = _Analysis(window, limits)
    return analysis.run()


@dataclass
class _NodeCase:
    """What the analysis found on one node, over its jobs, before it is judged."""

    node: str
    jobs: set[str] = field(default_factory=set)
    deviations: list[Deviation] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    link_gpus: set[int] = field(default_factory=set)
    link_ids: list[int] = field(default_factory=list)
    link_at: float | None = None
    link_sustained: bool = False
    reports: list[str] = field(default_factory=list)
    reported: bool = False  # the job's own report calls it a straggler (see Thresholds)
    report_ids: list[int] = field(default_factory=list)
    report_at: float | None = None
    pace_ids: list[int] = field(default_factory=list)
    pace_kind: str = "time"
    peers: int = 0          # the other nodes of its job (or node-mates, in a one-node job)
    one_node: bool = False  # compared with its node-mates: its job runs on this node alone


Comparable = Callable[[GpuKey, int], bool]
BucketMeans = Mapping[int, tuple[float, list[int]]]


class _Analysis:
    def __init__(self, window: Window, limits: Thresholds) -> None:
        self.w, self.limits = window, limits
        self.cases: dict[str, _NodeCase] = {}
        self.notes: list[SlowNote] = []
        # job -> its pace readings, one list per form of line (see node_paces)
        self.job_pace: dict[str, list[list[tuple[float, Pace, int | None]]]] = {}
        times = [samples[0][0] for series in window.readings.values()
                 for samples in series.values() if samples]
        times += [series[0][0] for series in window.paces.values() if series]
        t0 = min(times) if times else 0.0
        self.buckets = _Buckets(math.floor(t0 / limits.bucket_s) * limits.bucket_s,
                                limits.bucket_s)
        self.by_node: dict[str, list[int]] = defaultdict(list)
        for node, gpu in window.readings:
            self.by_node[node].append(gpu)

    def case(self, node: str, job: JobInfo, *, one_node: bool, peers: int) -> _NodeCase:
        c = self.cases.setdefault(node, _NodeCase(node))
        c.jobs.add(job.id)
        c.one_node = c.one_node or one_node
        c.peers = max(c.peers, peers)
        return c

    def run(self) -> Result:
        for job in self.w.jobs:
            self.job(job)
        findings = [f for f in (self.finding(c) for c in self.cases.values()) if f is not None]
        findings.sort(key=lambda f: (f.start, f.node))
        return Result(findings, sorted(self.notes, key=lambda n: (n.at, n.node)))

    # --- one job ---

    def job(self, job: JobInfo) -> None:
        nodes = list(dict.fromkeys(job.nodes))
        units: dict[str, list[int]] = {}
        for node in nodes:
            held = job.gpus.get(node)
            gpus = [g for g in sorted(self.by_node.get(node, ())) if held is None or g in held]
            if gpus:
                units[node] = gpus
        keys = [(n, g) for n, gs in units.items() for g in gs]
        multi_node = len(nodes) >= 2
        if not multi_node and len(keys) < 2:
            return  # one GPU, or nothing read: nobody to compare with
        peers = len(nodes) - 1 if multi_node else len(keys) - 1
        start, ended = self.w.spans.get(job.id, (None, None))
        stop = ended - self.limits.ending_s if ended is not None else None
        util = {k: self.buckets.means(self.w.readings[k].get(dcgm.GPU_UTIL, ())) for k in keys}
        # Buckets where the job works: its GPUs' median utilisation is high (unknown: yes).
        per_bucket: dict[int, list[float]] = defaultdict(list)
        for k in keys:
            for b, (u, _) in util[k].items():
                per_bucket[b].append(u)
        idle_job = {b for b, us in per_bucket.items() if _median(us) < self.limits.active_util}
        width = self.limits.bucket_s

        def comparable(k: GpuKey, b: int) -> bool:
            t = self.buckets.start(b)
            if b in idle_job or (start is not None and t + width <= start) or (
                    stop is not None and t >= stop):
                return False
            u = util[k].get(b)
            return u is None or u[0] >= self.limits.idle_util

        # Peers: the GPUs of the job's other nodes; in a one-node job, the node's other GPUs.
        group_of = {k: (k[0] if multi_node else f"{k[0]}/{k[1]}") for k in keys}
        for figure in FIGURES:
            counter = figure.field in dcgm.COUNTER_FIELDS
            values = {k: self.buckets.means(_series(self.w.readings[k].get(figure.field, ()),
                                                    counter)) for k in keys}
            if sum(1 for v in values.values() if v) > self.limits.min_peers:
                self.compare(job, figure, values, group_of, comparable, multi_node, peers)
        self.links(job, keys, util, multi_node, peers)
        self.node_paces(job, nodes)
        self.reports(job, nodes)
        self.busy(job, keys, util, comparable, multi_node)

    def compare(self, job: JobInfo, figure: Figure, values: Mapping[GpuKey, BucketMeans],
                group_of: Mapping[GpuKey, str], comparable: Comparable, multi_node: bool,
                peer_count: int) -> None:
        """Each unit against its peers, bucket by bucket; a sustained slow run is a
        deviation of its node."""
        limits = self.limits
        buckets = sorted({b for v in values.values() for b in v})
        states: dict[GpuKey, dict[int, tuple[bool, float, float, list[int]]]] = defaultdict(dict)
        for b in buckets:
            present = {k: v[b] for k, v in values.items() if b in v and comparable(k, b)}
            if len(present) <= limits.min_peers:
                continue
            everyone = [value for value, _ in present.values()]
            # A node's own GPUs barely move a large job's median: one median serves all.
            large = len({group_of[k] for k in present}) > 16
            stats: dict[str, tuple[float, float] | None] = {}
            for k, (value, ids) in present.items():
                g = group_of[k]
                if g not in stats:
                    peers = everyone if large else [
                        v for k2, (v, _) in present.items() if group_of[k2] != g]
                    stat = None
                    if len(peers) >= limits.min_peers:
                        med = _median(peers)
                        mad = _median([abs(v - med) for v in peers])
                        stat = (med, max(1.4826 * mad, limits.noise * abs(med)))
                    stats[g] = stat
                found = stats[g]
                if found is None or found[0] <= 0:
                    continue
                med, spread = found
                gap = (med - value) if figure.lower_is_slower else (value - med)
                slow = gap / med >= figure.threshold and gap / spread >= limits.z
                states[k][b] = (slow, value, med, ids)
        for k, per in states.items():
            run = _best_run(per, limits)
            if run is None:
                continue
            value, peers = _median(run.values), _median(run.peers)
            c = self.case(k[0], job, one_node=not multi_node, peers=peer_count)
            c.deviations.append(Deviation(
                figure.field, figure.label, (k[1],) if k[1] >= 0 else (), value * figure.scale,
                peers * figure.scale, value / peers - 1, self.buckets.start(run.first),
                (run.last - run.first + 1) * limits.bucket_s, figure.trigger, "",
                tuple(run.ids[:20])))

    def links(self, job: JobInfo, keys: list[GpuKey], util: Mapping[GpuKey, BucketMeans],
              multi_node: bool, peer_count: int) -> None:
        """PCIe links below their maximum (or their peers') while the GPU works, and the
        kernel's downtrain lines of the job's nodes."""
        readings = self.w.readings
        working: dict[GpuKey, dict[str, list[Sample]]] = {}
        for k in keys:
            got: dict[str, list[Sample]] = {}
            for name in (dcgm.PCIE_LINK_GEN, dcgm.PCIE_LINK_WIDTH):
                kept = []
                for sample in readings[k].get(name, ()):
                    b = self.buckets.index(sample[0])
                    near = [util[k][x][0] for x in (b - 1, b, b + 1) if x in util[k]]
                    # GPUs lower their link speed when idle or lightly loaded: only a busy
                    # GPU's reading says what its link can do (no utilisation: taken as busy).
                    if not near or max(near) >= self.limits.active_util:
                        kept.append(sample)
                if kept:
                    got[name] = kept
            if got:
                working[k] = got
        for k, got in working.items():
            current: dict[str, int] = {}
            best: dict[str, int] = {}
            below = False
            ids: list[int] = []
            for name, max_name in ((dcgm.PCIE_LINK_GEN, dcgm.PCIE_MAX_LINK_GEN),
                                   (dcgm.PCIE_LINK_WIDTH, dcgm.PCIE_MAX_LINK_WIDTH)):
                mine = got.get(name)
                if not mine:
                    continue
                now = int(max(v for _, v, _ in mine))  # the best it reached while working
                current[name] = now
                maxima = [v for _, v, _ in readings[k].get(max_name, ())]
                others = [_median([v for _, v, _ in other[name]])
                          for k2, other in working.items() if k2 != k and name in other]
                peer_level = int(_median(others)) if others else None
                limit = int(max(maxima)) if maxima else peer_level
                if limit is None:
                    continue
                best[name] = limit
                if now < limit and (peer_level is None or now < peer_level):
                    below = True
                    ids += [i for _, _, i in mine if i is not None]
            if not below:
                continue
            gen, width = current.get(dcgm.PCIE_LINK_GEN), current.get(dcgm.PCIE_LINK_WIDTH)
            said_max = any(readings[k].get(n) for n in (dcgm.PCIE_MAX_LINK_GEN,
                                                         dcgm.PCIE_MAX_LINK_WIDTH))
            top = _link(best.get(dcgm.PCIE_LINK_GEN, gen), best.get(dcgm.PCIE_LINK_WIDTH, width))
            c = self.case(k[0], job, one_node=not multi_node, peers=peer_count)
            c.links.append(f"GPU {k[1]}: PCIe {_link(gen, width)} while working "
                           f"({'max' if said_max else 'its peers'} {top})")
            c.link_gpus.add(k[1])
            c.link_ids += ids[:10]
            first = min(s[0] for series in got.values() for s in series)
            c.link_at = first if c.link_at is None else min(c.link_at, first)
            # Read narrow twice, a minute apart or more: a link trained that way, not a
            # reading caught while it changed speed.
            below_at = sorted(t for series in got.values() for t, _, _ in series)
            c.link_sustained = c.link_sustained or (
                len(below_at) >= 2 and below_at[-1] - below_at[0] >= 60)
        for d in self.w.downtrains:
            if d.node not in job.nodes:
                continue
            c = self.case(d.node, job, one_node=not multi_node, peers=peer_count)
            c.links.append(d.shown)
            c.link_sustained = True  # trained so at the driver's probe: it stays so
            if d.gpu is not None:
                c.link_gpus.add(d.gpu)
            if d.id is not None:
                c.link_ids.append(d.id)
            c.link_at = d.at if c.link_at is None else min(c.link_at, d.at)

    def busy(self, job: JobInfo, keys: list[GpuKey], util: Mapping[GpuKey, BucketMeans],
             comparable: Comparable, multi_node: bool) -> None:
        """Utilisation against the peers' while the node is slow (from its narrow link on,
        where that is all there is): a straggler computes while its peers wait for it at the
        next collective."""
        for node in {k[0] for k in keys}:
            c = self.cases.get(node)
            if c is None or job.id not in c.jobs or not (c.deviations or c.links):
                continue
            if c.deviations:
                b0 = self.buckets.index(min(d.start for d in c.deviations))
                b1 = self.buckets.index(max(d.start + d.seconds for d in c.deviations) - 1)
            else:
                b0 = self.buckets.index(c.link_at) if c.link_at is not None else -math.inf
                b1 = math.inf
            slow_gpus = {g for d in c.deviations for g in d.gpus} | c.link_gpus
            if not any(util[(node, g)] for g in slow_gpus if (node, g) in util):
                slow_gpus = set()  # their utilisation not read: the node's as a whole
            mine: list[float] = []
            theirs: list[float] = []
            for k in keys:
                # The slow GPUs (all of the node's where none is known or read) against the
                # peers they are compared with; the node's other GPUs in neither.
                own = k[0] == node and (not slow_gpus or k[1] in slow_gpus)
                if k[0] == node and not own and multi_node:
                    continue
                for b, (u, _) in util[k].items():
                    if b0 <= b <= b1 and comparable(k, b):
                        (mine if own else theirs).append(u)
            if mine and len(theirs) >= self.limits.min_peers:
                m, t = _median(mine), _median(theirs)
                if m - t >= self.limits.busy_gap:
                    c.busy.append(f"it works at {m:.0f}% utilisation while its peers wait for "
                                  f"it at {t:.0f}%")

    def node_paces(self, job: JobInfo, nodes: list[str]) -> None:
        """The job's iteration time: per node where several nodes report it (a figure like the
        others), and how much the job as a whole slowed (said with any finding). Readings
        compare within one form of line: rank 0 often prints the whole iteration's time
        beside its own step's, and the two are not the same figure."""
        groups: dict[tuple[str, str], dict[str, list[tuple[float, Pace, int | None]]]] = {}
        for n in nodes:
            for reading in self.w.paces.get((job.id, n), ()):
                pace = reading[1]
                groups.setdefault((pace.kind, pace.form), {}).setdefault(n, []).append(reading)
        if not groups:
            return
        # The job's own pace: a form one node prints (rank 0's) first, then the most read.
        self.job_pace[job.id] = [
            sorted((x for s in by_node.values() for x in s), key=lambda x: x[0])
            for _, by_node in sorted(groups.items(), key=lambda kv: (
                len(kv[1]), -sum(len(s) for s in kv[1].values())))]
        (kind, _), series = max(groups.items(), key=lambda kv: (len(kv[1]), sum(
            len(s) for s in kv[1].values())))
        if len(series) <= self.limits.min_peers - 1:
            return
        values = {(n, -1): self.buckets.means([(t, p.cost, i) for t, p, i in s])
                  for n, s in series.items()}
        self.compare(job, PACE, values, {k: k[0] for k in values}, lambda k, b: True, True,
                     len(nodes) - 1)
        for n in series:
            if n in self.cases:
                self.cases[n].pace_kind = kind

    def reports(self, job: JobInfo, nodes: list[str]) -> None:
        """nvidia-resiliency-ext's relative scores: a node is named when its ranks score low
        and the report does not score the job's other nodes as low (the whole job slowing)."""
        members = set(nodes)
        named: dict[str, list[tuple[float, float, int | None]]] = defaultdict(list)
        for r in self.w.reports:
            if r.job != job.id:
                continue
            low_nodes = {s.node for s in r.scores if s.score <= self.limits.report_score}
            for node in low_nodes & members:
                own = min(s.score for s in r.scores if s.node == node)
                others = [s.score for s in r.scores if s.node != node]
                if len(low_nodes) == 1 or (others and own <= _median(others) - 0.1):
                    named[node].append((r.at, own, r.id))
        for node, seen in named.items():
            c = self.case(node, job, one_node=len(nodes) < 2, peers=len(nodes) - 1)
            c.reports.append(f"the job's own straggler report scores its ranks as low as "
                             f"{min(s for _, s, _ in seen):.2f} ({len(seen)} report"
                             f"{'s' if len(seen) > 1 else ''}; 1.00: as fast as the fastest)")
            c.reported = c.reported or (
                min(s for _, s, _ in seen) <= self.limits.report_straggler
                or (len(seen) >= 2 and seen[-1][0] - seen[0][0] >= 60))
            c.report_ids += [i for _, _, i in seen if i is not None]
            c.report_at = min(t for t, _, _ in seen) if c.report_at is None else min(
                c.report_at, *(t for t, _, _ in seen))

    # --- a node's finding ---

    def finding(self, c: _NodeCase) -> Finding | None:
        triggers = [d for d in c.deviations if d.trigger]
        support = [d for d in c.deviations if not d.trigger]
        link = bool(c.links)
        held_back = link and (c.busy or c.reports or self._job_slowed(c, c.link_at))
        # A link trained below its speed or width while the GPU works is direct evidence: the
        # GPU can move less than its peers, whatever the window shows of its job.
        if not triggers and not c.reported and not held_back and not c.link_sustained:
            if link:
                self.notes.append(SlowNote(c.link_at or 0.0, c.node, (
                    f"{c.node}: {'; '.join(dict.fromkeys(c.links))}, read once: noted, not "
                    "an incident")))
            return None
        # The slow stretch: the trigger figures' (else the link's, or the reports').
        spans = triggers or support
        if spans:
            start = min(d.start for d in spans)
            seconds = max(d.start + d.seconds for d in spans) - start
        else:
            first = [t for t in (c.link_at, c.report_at) if t is not None]
            start, seconds = (min(first) if first else self.buckets.t0), 0.0
        slowed = self._job_slowed(c, start)
        gpus = sorted({g for d in c.deviations for g in d.gpus} | c.link_gpus)
        confidence = self._confidence(c, triggers, link, slowed)
        explanation, merged = self._explain(c, triggers + support, slowed, gpus)
        ids = [i for d in merged for i in d.ids] + c.link_ids + c.report_ids + c.pace_ids
        return Finding(c.node, tuple(sorted(c.jobs)), tuple(gpus), start, seconds, confidence,
                       explanation, tuple(merged), tuple(dict.fromkeys(c.links)),
                       tuple(dict.fromkeys(ids))[:60])

    def _confidence(self, c: _NodeCase, triggers: list[Deviation], link: bool,
                    slowed: str) -> float:
        """Below automatic repair (0.8) on one figure alone; strong evidence (figures that
        agree, a narrow link, the job's own report naming it) reaches it."""
        if triggers:
            confidence = 0.6
            if len({d.field for d in triggers}) >= 2:
                confidence += 0.1
            if link:
                confidence += 0.1
        else:  # a narrow link and/or the job's own report: how much it costs the job is less sure
            confidence = 0.5 + (0.05 if link else 0.0) + (0.1 if c.busy else 0.0)
        if c.reports:
            confidence += 0.1
        if slowed:
            confidence += 0.05
        if any(abs(d.change) >= 0.25 and d.seconds >= 2 * self.limits.sustain_s
               for d in triggers):
            confidence += 0.05
        return round(min(confidence, 0.9), 2)

    def _job_slowed(self, c: _NodeCase, start: float | None) -> str:
        """How much the node's job slowed from ``start`` on, by its own iteration times ("":
        it reports none, or did not slow)."""
        if start is None:
            return ""
        for job, readings in ((j, r) for j in sorted(c.jobs) for r in self.job_pace.get(j, [])):
            before = [p for t, p, _ in readings if t < start]
            after = [p for t, p, _ in readings if t >= start + 30]
            if not before or not after:
                continue
            b = _median([p.cost for p in before])
            a = _median([p.cost for p in after])
            if b <= 0 or a / b - 1 < self.limits.pace_change:
                continue
            c.pace_ids += [i for _, _, i in readings if i is not None][:10]
            kind = before[0].kind
            if kind == "time":
                return (f"job {job}'s iteration time went from {_pace_shown(kind, b)} to "
                        f"{_pace_shown(kind, a)} ({(a / b - 1) * 100:+.0f}%) around then")
            return (f"job {job}'s throughput went from {_pace_shown(kind, b)} to "
                    f"{_pace_shown(kind, a)} ({(b / a - 1) * 100:+.0f}%) around then")
        return ""

    def _explain(self, c: _NodeCase, deviations: list[Deviation], slowed: str,
                 gpus: list[int]) -> tuple[str, list[Deviation]]:
        job = sorted(c.jobs)[0]
        user = next((j.user for j in self.w.jobs if j.id == job), "")
        whose = f"job {job}" + (f" ({user})" if user else "")
        if c.one_node:
            head = f"{c.node} {_gpus(gpus)} is slower than its node-mates in {whose}" if gpus \
                else f"{c.node} is slower than its node-mates in {whose}"
        else:
            head = f"{c.node} is slower than the other {c.peers} nodes of {whose}"
        merged = _merge(deviations, c.pace_kind)
        parts = [d.text for d in merged]
        reasons = self._reasons(c.node, [d for d in merged if d.field == dcgm.SM_CLOCK])
        if reasons:
            parts.append(reasons)
        parts += list(dict.fromkeys(c.links))
        text = head + (": " + "; ".join(parts) if parts else "")
        extra = c.busy[:1] + ([slowed] if slowed else []) + c.reports[:1]
        if extra:
            text += ". " + ". ".join(x[0].upper() + x[1:] for x in extra)
        elif not deviations:
            text += (". Nothing else in the window shows how much it holds the job back (its "
                     "traffic over that link decides)")
        text += (". Alive, with no XID or other fault: the whole job runs at its pace; replace "
                 "it at the job's next checkpoint.")
        return text, merged

    def _reasons(self, node: str, clock: list[Deviation]) -> str:
        """The clock-event reasons a slow GPU reported while slow: why its clock is held."""
        mask, seen = 0, False
        for d in clock:
            for gpu in d.gpus:
                series = self.w.readings.get((node, gpu), {})
                for name in dcgm.CLOCK_REASONS:
                    for t, v, _ in series.get(name, ()):
                        if d.start <= t <= d.start + d.seconds:
                            seen = True
                            mask |= int(v)
        names = dcgm.clock_event_reasons(mask & ~dcgm.GPU_IDLE)
        if names:
            return f"clock-event reasons: {', '.join(names)}"
        if seen:
            return ("no clock-event reason reported (clocks held lower by a setting, or a "
                    "failing GPU)")
        return ""


def _pace_shown(kind: str, cost: float) -> str:
    return Pace(kind, cost, cost if kind == "time" else 1.0 / cost).shown


def _merge(deviations: list[Deviation], pace_kind: str) -> list[Deviation]:
    """One line per figure: the node's slow GPUs together (their median), the longest run."""
    by_field: dict[str, list[Deviation]] = defaultdict(list)
    for d in deviations:
        by_field[d.field].append(d)
    order = [f.field for f in (*FIGURES, PACE)]
    out = []
    for name in sorted(by_field, key=lambda f: order.index(f) if f in order else len(order)):
        group = by_field[name]
        figure = next(f for f in (*FIGURES, PACE) if f.field == name)
        gpus = tuple(sorted({g for d in group for g in d.gpus}))
        value = _median([d.value for d in group])
        peers = _median([d.peers for d in group])
        change = value / peers - 1 if peers else 0.0
        start = min(d.start for d in group)
        end = max(d.start + d.seconds for d in group)
        when = f"for {_duration(end - start)} from {_when(start)}"
        if name == ITERATION:
            # value and peers are costs: seconds per iteration, or 1 / a rate
            shown = (f"its own iteration time {_pace_shown(pace_kind, value)} vs its peers' "
                     f"median {_pace_shown(pace_kind, peers)} ({change * 100:+.0f}%) {when}")
        else:
            where = f"{_gpus(gpus)}: " if gpus else ""
            shown = (f"{where}{figure.label} {_shown(figure, value)} vs its peers' median "
                     f"{_shown(figure, peers)} ({change * 100:+.0f}%) {when}")
        out.append(Deviation(name, figure.label, gpus, value, peers, change, start, end - start,
                             any(d.trigger for d in group), shown,
                             tuple(i for d in group for i in d.ids)[:30]))
    return out
