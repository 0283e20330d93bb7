"""Node clocks: put what a node stamps with its own clock on the cluster's clock.

A kernel line and a job's output carry the time of the node that wrote them; dcgm-exporter's
samples (through Prometheus), Slurm's and Kubernetes' records carry the time of a central
service. A node whose clock is minutes off makes a fault's consequences (the other ranks'
NCCL timeouts, Slurm ending the job) seem to come before their cause, and the rules, which
compare times across nodes and sources, then read the order backwards.

Each node's offset is bounded by what several sources say about one moment:

- one XID seen in the node's kernel log and by dcgm-exporter: the exporter reads it between
  the moment it happened and one scrape later, so the kernel's time minus the scrape's lies
  between the offset minus a scrape interval and the offset;
- one port going down, in the node's kernel log and in the NIC readings, likewise;
- one NCCL collective timing out on every rank of a job (the watchdog names it by its
  sequence number): the ranks' lines are seconds apart, so a node that disagrees with the
  other ranks by minutes is the one whose clock is off;
- a job's output on a node cannot come after Slurm (central) said the job ended.

A clock is assumed right unless the evidence rules that out; then the offset taken is the
middle of what the bounds allow (a scrape's delay leaves a range), or, with a bound on one side
only (a job's end), that bound: corrected by no more than it must be.
Pure: facts in, facts (re-stamped) and notes out.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from operator import attrgetter

import incidents.diagnosis.parsers as p
from incidents.diagnosis.facts import Facts, JobFact

# The sources whose records carry the time of the node that wrote them.
NODE_CLOCKED = frozenset({"kernel", "job_log"})
# dcgm-exporter's XID is read within a scrape of the driver logging it: Prometheus's
# interval (15 s usual) plus the exporter's own collection interval (30 s by default).
DEFAULT_SCRAPE_S = 45.0
# A source read less often than this is not scraping (a gauge read now and then, a counter
# sent on change): its gaps say nothing of how late it reads one moment.
MAX_SCRAPE_S = 90.0
ANCHOR_S = 900.0        # an XID in both sources this far apart is two XIDs, not one
RANKS_AGREE_S = 15.0    # one collective's watchdog fires on every rank within this long
MIN_RANKS = 3           # ... and a consensus needs this many ranks
JOB_END_SLACK_S = 5.0   # a line flushed this long after Slurm saw the job end is no sign
SKEW_MIN_S = 10.0       # a smaller correction than this is left alone
# Two sources' times of one moment differ by this much with right clocks (journald's flush,
# NVML's event before the log line): a clock is called off only beyond it.
JITTER_S = 10.0
_SEQ = re.compile(r"SeqNum=(\d+)")


@dataclass(frozen=True, slots=True)
class Skew:
    node: str
    offset: float  # seconds the node's clock is ahead of the cluster's (negative: behind)
    why: str
    spread: float = 0.0  # how far the offset may be off either way (half the bounds' width)


def estimate(facts: Facts) -> dict[str, Skew]:
    """Each node's clock offset that the window's evidence demands, where it demands one."""
    lo: dict[str, float] = defaultdict(lambda: -float("inf"))
    hi: dict[str, float] = defaultdict(lambda: float("inf"))
    why: dict[str, list[str]] = defaultdict(list)

    def bound(node: str, low: float, high: float, reason: str) -> None:
        if low > lo[node]:
            lo[node] = low
        if high < hi[node]:
            hi[node] = high
        why[node].append(reason)

    scrape = min(facts.intervals.get("dcgm", DEFAULT_SCRAPE_S), MAX_SCRAPE_S)
    kernel_xids: dict[tuple[str, int], list[float]] = defaultdict(list)
    dcgm_xids: dict[tuple[str, int], list[float]] = defaultdict(list)
    for f in facts.xids:
        if f.source == "dcgm" and not f.stale:
            dcgm_xids[(f.node, f.code)].append(f.t)
        elif f.source == "kernel":
            kernel_xids[(f.node, f.code)].append(f.t)
    for (node, code), seen in dcgm_xids.items():
        for diff in _pairs(kernel_xids.get((node, code), []), seen):
            bound(node, diff, diff + scrape,
                  f"XID {code} in its kernel log {_signed(diff)} from dcgm-exporter's reading")

    # One port going down, in the kernel's log and in the NIC readings (read centrally, at
    # the source's interval), is the same kind of anchor.
    nic = min(facts.intervals.get("nic", DEFAULT_SCRAPE_S), MAX_SCRAPE_S)
    nic_downs: dict[str, list[float]] = defaultdict(list)
    kernel_downs: dict[str, list[float]] = defaultdict(list)
    for link in facts.links:
        if link.source != "kernel" and link.kind in ("down", "downed"):
            nic_downs[link.node].append(link.t)
        elif link.source == "kernel" and link.kind == "down":
            kernel_downs[link.node].append(link.t)
    for node, seen in nic_downs.items():
        for diff in _pairs(kernel_downs.get(node, []), seen):
            bound(node, diff, diff + nic,
                  f"a link loss in its kernel log {_signed(diff)} from the NIC's reading")

    for node, low, high, reason in _rank_consensus(facts.job_lines):
        bound(node, low, high, reason)

    spans = facts.job_spans
    for (job, node), (_, last) in facts.job_activity.items():
        span = spans.get(job)
        if span is None or span.ended is None:
            continue
        late = last - span.ended - JOB_END_SLACK_S
        if late > 0:
            bound(node, late, float("inf"),
                  f"job {job}'s output {late + JOB_END_SLACK_S:.0f} s after Slurm saw it end")

    skews: dict[str, Skew] = {}
    for node in lo.keys() | hi.keys():
        low, high = lo[node], hi[node]
        if low > high + JITTER_S:
            continue  # the sources disagree (two events taken for one): no correction
        if low - JITTER_S <= 0 <= high + JITTER_S:
            continue  # a right clock fits what the sources say
        # The middle of what a scrape's delay leaves open; with a bound on one side only (a
        # job's end), that bound.
        offset = (low + high) / 2 if math.isfinite(low + high) else (
            low if math.isfinite(low) else high)
        if abs(offset) >= SKEW_MIN_S:
            spread = (high - low) / 2 if math.isfinite(high - low) else 0.0
            skews[node] = Skew(node, offset, "; ".join(dict.fromkeys(why[node])), spread)
    return skews


def _pairs(node_times: list[float], central_times: list[float]) -> list[float]:
    """Differences (node minus central) of the events the two sources share: each paired
    with at most one of the other's, nearest first. A repeated XID whose gauge did not
    change (it read 31 and still reads 31) has no central reading, and pairing it with the
    next one would invent an offset."""
    found = sorted((abs(k - c), k - c, i, j) for i, k in enumerate(node_times)
                   for j, c in enumerate(central_times) if abs(k - c) <= ANCHOR_S)
    used_k: set[int] = set()
    used_c: set[int] = set()
    out = []
    for _, diff, i, j in found:
        if i not in used_k and j not in used_c:
            used_k.add(i)
            used_c.add(j)
            out.append(diff)
    return out


def _rank_consensus(lines: Iterable[JobFact]) -> Iterable[tuple[str, float, float, str]]:
    """Bounds from one collective's watchdog lines on several ranks."""
    by_collective: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for f in lines:
        if f.kind != p.NCCL_TIMEOUT or not f.node:
            continue
        m = _SEQ.search(f.text)
        if m is None:
            continue
        first = by_collective[(f.job, m.group(1))]
        first.setdefault(f.node, f.t)
    for (job, seq), times in by_collective.items():
        if len(times) < MIN_RANKS:
            continue
        middle = statistics.median(times.values())
        for node, t in times.items():
            diff = t - middle
            if abs(diff) > RANKS_AGREE_S:
                yield (node, diff - RANKS_AGREE_S, diff + RANKS_AGREE_S,
                       f"job {job}'s collective {seq} timed out there {_signed(diff)} from "
                       "its other ranks")


def _signed(seconds: float) -> str:
    return f"{abs(seconds):.0f} s {'later' if seconds >= 0 else 'earlier'}"


def align(facts: Facts, skews: dict[str, Skew]) -> None:
    """Re-stamp the node-clocked facts of the skewed nodes on the cluster's clock, in place,
    and put every list back in time order."""
    if not skews:
        return
    facts.clock_spread = {node: skew.spread for node, skew in skews.items()}
    for f in facts.xids:
        if f.source == "kernel" and f.node in skews:
            f.t -= skews[f.node].offset
            f.at -= timedelta(seconds=skews[f.node].offset)
    for h in facts.hardware:
        if h.node in skews:
            h.t -= skews[h.node].offset
            h.at -= timedelta(seconds=skews[h.node].offset)
    for link in facts.links:
        if link.source == "kernel" and link.node in skews:
            link.t -= skews[link.node].offset
            link.at -= timedelta(seconds=skews[link.node].offset)
    for j in facts.job_lines:
        if j.node in skews:  # job_log lines; Slurm's job records name no node
            j.t -= skews[j.node].offset
            j.at -= timedelta(seconds=skews[j.node].offset)
    for (_, node), span in facts.job_activity.items():
        if node in skews:
            span[0] -= skews[node].offset
            span[1] -= skews[node].offset
    facts.xids.sort(key=_T)
    facts.hardware.sort(key=_T)
    facts.links.sort(key=_T)
    facts.job_lines.sort(key=_T)


_T = attrgetter("t")
