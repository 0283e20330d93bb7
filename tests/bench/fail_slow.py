"""Benchmark: fail-slow detection on simulated fleets (``make bench``, issue 21).

Each fleet is a set of multi-node training jobs (8 GPUs a node) over half an hour, every GPU
scraped every minute (SM clock, power, utilisation, clock-event reasons, memory and NVLink
traffic, the PCIe link), rank 0's iteration time in the job's output, as a replay window. In
some jobs one node is made a straggler, of one kind and magnitude:

- ``clock``: one GPU's SM clock lower by 10, 20 or 40 %;
- ``power-cap``: every GPU of the node capped 20 or 40 % lower in power (clocks follow, the
  clock-event reasons say sw power cap);
- ``pcie-gen`` / ``pcie-width``: one GPU's link at Gen3 (max Gen5), or x8 / x4 (max x16);
- ``nvlink``: two GPUs' NVLink traffic lower by 25 or 50 %;
- ``iteration``: the job logs each node's own step time, and one node's is 10, 15 or 25 %
  longer (nothing in its telemetry).

A straggler holds its job back: the job's other GPUs wait for it (their utilisation and power
drop in proportion), and rank 0's iteration time rises. Every job also carries healthy noise,
and some a look-alike: the whole job capped at once (a rack's power), evaluation and checkpoint
phases (every GPU drops together), the job ending unevenly (nodes idle one after the other),
pipeline stages (nodes doing different work, 10-12 % apart in power and memory traffic for
good), a blip (one GPU 30-40 % down for 2-3 minutes), idle links at Gen1 between phases, a
GPU a few percent slower for good (silicon), a late start.

Every window goes through ``diagnose_window`` (the replay engine, as ``manage.py fleetwatch
diagnose`` reads a file), and each ``fail_slow`` diagnosis is scored per node: a straggler
found is a true positive, a straggler missed a false negative, any other node blamed a
healthy node flagged (false positive). Precision and recall per kind and magnitude, the
healthy nodes flagged per look-alike, and how long a fleet's diagnosis took, into
``bench-fail-slow.md`` and ``.json`` under ``--out``.

    .venv/bin/python -m tests.bench.fail_slow --out reports [--fleets 3] [--jobs 36] [--seed 21]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from collectors.knowledge import RootCause, dcgm
from incidents.diagnosis import JobInfo, Observation, diagnose_window

GPUS = 8
MINUTES = 30
SCRAPE_S = 60.0
T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC).timestamp()

# Kinds of straggler and their magnitudes (a percent, or a link).
STRAGGLERS: list[tuple[str, str]] = [
    ("clock", "-10%"), ("clock", "-20%"), ("clock", "-40%"),
    ("power-cap", "-20%"), ("power-cap", "-40%"),
    ("pcie-gen", "Gen5->Gen3"), ("pcie-width", "x16->x8"), ("pcie-width", "x16->x4"),
    ("nvlink", "-25%"), ("nvlink", "-50%"),
    ("iteration", "+10%"), ("iteration", "+15%"), ("iteration", "+25%"),
]
LOOK_ALIKES = ("none", "whole-job-capped", "phases", "ending", "pipeline-stages", "blip",
               "idle-gen1", "silicon", "late-start")


@dataclass
class Gpu:
    """One GPU's state at a minute: factors on its readings and levels."""

    clock: float = 1.0
    power: float = 1.0
    util: float = 0.0  # points added
    dram: float = 1.0
    nvlink: float = 1.0
    reasons: int = 0
    gen: int = 5
    width: int = 16
    idle: bool = False


@dataclass
class Job:
    id: str
    nodes: list[str]
    straggler: str | None = None          # node
    kind: tuple[str, str] | None = None   # (kind, magnitude)
    look_alike: str = "none"
    onset: int = 0                        # minute
    per_node_steps: bool = False
    effects: list[Callable[[str, int, int, Gpu], None]] = field(default_factory=list)
    pace: Callable[[int], float] = lambda minute: 0.0  # the share of time peers wait


def _percent(magnitude: str) -> float:
    return abs(float(magnitude.rstrip("%"))) / 100.0


def _straggler(job: Job, rng: random.Random) -> None:
    kind, magnitude = job.kind or ("", "")
    node = job.straggler
    onset = job.onset
    gpu = rng.randrange(GPUS)
    pair = {gpu, (gpu + 1) % GPUS}

    def when(m: int) -> bool:
        return m >= onset

    if kind == "clock":
        p = _percent(magnitude)

        def clock(n: str, g: int, m: int, s: Gpu) -> None:
            if n == node and g == gpu and when(m):
                s.clock *= 1 - p
                s.power *= 1 - 0.6 * p
                s.util += 3
        job.effects.append(clock)
        wait = 0.8 * p
    elif kind == "power-cap":
        p = _percent(magnitude)

        def cap(n: str, g: int, m: int, s: Gpu) -> None:
            if n == node and when(m):
                s.power *= 1 - p
                s.clock *= 1 - 0.55 * p
                s.reasons |= dcgm.SW_POWER_CAP
                s.util += 3
        job.effects.append(cap)
        wait = 0.45 * p
    elif kind in ("pcie-gen", "pcie-width"):
        level = int(magnitude.rsplit("x", 1)[-1]) if kind == "pcie-width" else 3

        def link(n: str, g: int, m: int, s: Gpu) -> None:
            if n == node and g == gpu:  # trained that way at boot: the whole window
                if kind == "pcie-gen":
                    s.gen = level
                else:
                    s.width = level
                s.util += 4
        job.effects.append(link)
        onset = job.onset = 0
        wait = 0.12 if kind == "pcie-gen" or level == 8 else 0.2
    elif kind == "nvlink":
        p = _percent(magnitude)

        def nvlink(n: str, g: int, m: int, s: Gpu) -> None:
            if n == node and g in pair and when(m):
                s.nvlink *= 1 - p
                s.util += 2
        job.effects.append(nvlink)
        wait = 0.5 * p
    else:  # iteration: the job logs each node's step time; nothing in the telemetry
        job.per_node_steps = True
        wait = _percent(magnitude)
    job.pace = lambda m: wait if m >= onset else 0.0


def _look_alike(job: Job, rng: random.Random) -> None:
    kind = job.look_alike
    if kind == "whole-job-capped":
        at = rng.randrange(5, 20)

        def capped(n: str, g: int, m: int, s: Gpu) -> None:
            if m >= at:
                s.clock *= 0.75
                s.power *= 0.62
                s.reasons |= dcgm.SW_POWER_CAP
        job.effects.append(capped)
    elif kind == "phases":
        every, offset = rng.choice((5, 6, 8)), rng.randrange(5)

        def phases(n: str, g: int, m: int, s: Gpu) -> None:
            phase = (m + offset) % every
            if phase == every - 1:  # checkpoint: idle
                s.idle = True
            elif phase == every - 2:  # evaluation: less to compute, clocks wander
                s.util -= 60
                s.clock *= 0.8 + 0.2 * random.Random(f"{n}/{g}/{m}").random()
                s.power *= 0.5
        job.effects.append(phases)
    elif kind == "ending":
        end = {n: rng.randrange(20, 28) for n in job.nodes}

        def ending(n: str, g: int, m: int, s: Gpu) -> None:
            if m >= end[n]:
                s.idle = True
        job.effects.append(ending)
    elif kind == "pipeline-stages":
        stage = {n: (rng.uniform(0.88, 1.0), rng.uniform(0.88, 1.0)) for n in job.nodes}

        def stages(n: str, g: int, m: int, s: Gpu) -> None:
            s.power *= stage[n][0]
            s.dram *= stage[n][1]
        job.effects.append(stages)
    elif kind == "blip":
        node, gpu, at = rng.choice(job.nodes), rng.randrange(GPUS), rng.randrange(3, 25)
        length, depth = rng.choice((2, 3)), rng.uniform(0.3, 0.4)

        def blip(n: str, g: int, m: int, s: Gpu) -> None:
            if n == node and g == gpu and at <= m < at + length:
                s.clock *= 1 - depth
        job.effects.append(blip)
    elif kind == "idle-gen1":
        nodes, at = set(rng.sample(job.nodes, 2)), rng.randrange(5, 20)

        def idle_gen1(n: str, g: int, m: int, s: Gpu) -> None:
            if n in nodes and at <= m < at + 4:
                s.idle = True
        job.effects.append(idle_gen1)
    elif kind == "silicon":
        node, gpu = rng.choice(job.nodes), rng.randrange(GPUS)

        def silicon(n: str, g: int, m: int, s: Gpu) -> None:
            if n == node and g == gpu:
                s.clock *= 0.96
        job.effects.append(silicon)
    elif kind == "late-start":
        start = rng.randrange(3, 12)

        def late(n: str, g: int, m: int, s: Gpu) -> None:
            if m < start:
                s.idle = True
        job.effects.append(late)


def fleet(seed: int, jobs: int) -> tuple[list[Observation], list[Job]]:
    """One fleet's window: its jobs' GPUs, every minute, and rank 0's output."""
    rng = random.Random(seed)
    planned: list[Job] = []
    counter = 0
    for j in range(jobs):
        size = rng.choice((4, 4, 6, 8, 8, 12, 16))
        nodes = [f"f{seed}-n{counter + i:04d}" for i in range(size)]
        counter += size
        job = Job(f"{seed}{j:03d}", nodes)
        if rng.random() < 0.45:
            job.kind = rng.choice(STRAGGLERS)
            job.straggler = rng.choice(nodes)
            job.onset = rng.randrange(2, 15)
            _straggler(job, rng)
        job.look_alike = rng.choice(LOOK_ALIKES)
        _look_alike(job, rng)
        planned.append(job)
    observations: list[Observation] = []
    for job in planned:
        observations += _job_window(job, rng)
    observations.sort(key=lambda o: o.at)
    return observations, planned


def _at(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _job_window(job: Job, rng: random.Random) -> list[Observation]:
    out: list[Observation] = []
    silicon = {(n, g): rng.uniform(0.985, 1.0) for n in job.nodes for g in range(GPUS)}
    nvlink_total = {(n, g): rng.uniform(1e12, 9e12) for n in job.nodes for g in range(GPUS)}
    for m in range(MINUTES):
        wait = job.pace(m)
        for node in job.nodes:
            offset = rng.uniform(0, 15)
            t = T0 + 60 * m + offset
            for g in range(GPUS):
                s = Gpu()
                for effect in job.effects:
                    effect(node, g, m, s)
                mine = node == job.straggler and job.kind is not None and (
                    s.util > 0 or job.kind[0] == "iteration")
                peer_wait = 0.0 if mine else wait
                if s.idle:
                    clock, power, util, dram, rate = 345.0, 70.0, 0.0, 0.0, 0.0
                    gen, reasons = 1, dcgm.GPU_IDLE
                else:
                    clock = 1980 * silicon[(node, g)] * s.clock * rng.uniform(0.985, 1.0)
                    power = 690 * s.power * rng.uniform(0.95, 1.04) * (1 - 0.5 * peer_wait)
                    util = min(100.0, rng.uniform(92, 99) + s.util - 40 * peer_wait)
                    dram = 0.58 * s.dram * rng.uniform(0.95, 1.05) * (1 - peer_wait)
                    rate = 180e9 * s.nvlink * rng.uniform(0.95, 1.05) * (1 - peer_wait)
                    gen, reasons = s.gen, s.reasons
                nvlink_total[(node, g)] += rate * SCRAPE_S
                at = _at(t + 0.01 * g)
                for metric, value in (
                        (dcgm.SM_CLOCK, round(clock / 15) * 15.0), (dcgm.POWER_USAGE, power),
                        (dcgm.GPU_UTIL, round(max(0.0, util))),
                        (dcgm.CLOCKS_EVENT_REASONS, float(reasons)),
                        (dcgm.PROF_DRAM_ACTIVE, dram),
                        (dcgm.NVLINK_BANDWIDTH_TOTAL, nvlink_total[(node, g)]),
                        (dcgm.PCIE_LINK_GEN, float(gen)), (dcgm.PCIE_LINK_WIDTH, float(s.width))):
                    out.append(Observation(at, "dcgm", node, g, metric=metric, value=value))
                if m % 10 == 0:  # the maxima are static: read now and then
                    out.append(Observation(at, "dcgm", node, g, metric=dcgm.PCIE_MAX_LINK_GEN,
                                           value=5.0))
                    out.append(Observation(at, "dcgm", node, g,
                                           metric=dcgm.PCIE_MAX_LINK_WIDTH, value=16.0))
            if job.per_node_steps:
                slower = (1 + job.pace(m)) if node == job.straggler else 1.0
                took = 1.02 * slower * rng.uniform(0.98, 1.02)
                out.append(Observation(_at(t + 1), "job_log", node, job=job.id,
                                       message=f"[rank{job.nodes.index(node) * GPUS}] step "
                                               f"{1000 + m * 50} took {took:.3f} s"))
        ms = 1020 * (1 + wait) * rng.uniform(0.99, 1.01)
        out.append(Observation(_at(T0 + 60 * m + 30), "job_log", job.nodes[0], job=job.id,
                               message=f" iteration {40000 + 40 * m:8d}/  500000 | elapsed "
                                       f"time per iteration (ms): {ms:.1f} | lm loss: 2.1 |"))
    return out


def score(seeds: list[int], jobs: int) -> dict[str, Any]:
    per_kind: dict[str, dict[str, int]] = defaultdict(lambda: {"stragglers": 0, "found": 0})
    flagged_by: dict[str, int] = defaultdict(int)
    nodes_by: dict[str, int] = defaultdict(int)
    tp = fp = fn = healthy_nodes = 0
    timings = []
    confidences: list[float] = []
    examples: dict[str, str] = {}
    wrong: list[dict[str, str]] = []
    for seed in seeds:
        observations, planned = fleet(seed, jobs)
        started = time.perf_counter()
        result = diagnose_window(observations, {}, [JobInfo(j.id, "bench", tuple(j.nodes))
                                                    for j in planned])
        timings.append({"seed": seed, "observations": len(observations),
                        "seconds": round(time.perf_counter() - started, 3)})
        blamed = {n for d in result.diagnoses if d.root_cause == RootCause.FAIL_SLOW
                  for n in d.nodes}
        by_node = {n: d for d in result.diagnoses for n in d.nodes}
        for job in planned:
            for node in job.nodes:
                if node == job.straggler and job.kind is not None:
                    name = " ".join(job.kind)
                    per_kind[name]["stragglers"] += 1
                    if node in blamed:
                        tp += 1
                        per_kind[name]["found"] += 1
                        confidences.append(by_node[node].confidence)
                        examples.setdefault(job.kind[0], by_node[node].explanation)
                    else:
                        fn += 1
                        wrong.append({"missed": node, "straggler": name,
                                      "look_alike": job.look_alike})
                    continue
                healthy_nodes += 1
                nodes_by[job.look_alike] += 1
                if node in blamed:
                    fp += 1
                    flagged_by[job.look_alike] += 1
                    wrong.append({"flagged": node, "look_alike": job.look_alike,
                                  "straggler_in_job": " ".join(job.kind) if job.kind else "",
                                  "explanation": by_node[node].explanation[:300]})
    kinds = {}
    for name, c in sorted(per_kind.items(), key=lambda kv: [k for k, _ in STRAGGLERS].index(
            kv[0].split(" ")[0]) * 10 + [m for _, m in STRAGGLERS].index(kv[0].split(" ")[1])):
        kinds[name] = {**c, "recall": c["found"] / c["stragglers"] if c["stragglers"] else None}
    return {
        "fleets": len(seeds), "jobs_per_fleet": jobs, "seeds": seeds,
        "stragglers": tp + fn, "found": tp, "missed": fn, "healthy_nodes": healthy_nodes,
        "healthy_flagged": fp,
        "precision": tp / (tp + fp) if tp + fp else None,
        "recall": tp / (tp + fn) if tp + fn else None,
        "kinds": kinds,
        "look_alikes": {k: {"healthy_nodes": nodes_by[k], "flagged": flagged_by[k]}
                        for k in LOOK_ALIKES},
        "confidence": {"min": min(confidences, default=None),
                       "median": sorted(confidences)[len(confidences) // 2]
                       if confidences else None,
                       "at_or_above_auto": sum(1 for c in confidences if c >= 0.8)},
        "timings": timings, "examples": examples, "wrong": wrong,
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Fail-slow detection on simulated fleets", "",
        f"{report['when']} UTC, Python {report['python']}. {report['fleets']} fleets of "
        f"{report['jobs_per_fleet']} multi-node jobs (8 GPUs a node, {MINUTES} min, a scrape a "
        f"minute; seeds {report['seeds']}), diagnosed with the replay engine.", "",
        f"Stragglers: **{report['stragglers']}**, found **{report['found']}**. "
        f"Precision **{_ratio(report['precision'])}**, recall **{_ratio(report['recall'])}**. "
        f"Healthy nodes flagged: **{report['healthy_flagged']}** of "
        f"{report['healthy_nodes']}.", "",
        "## Recall per kind and magnitude", "",
        "| straggler | injected | found | recall |", "|---|---:|---:|---:|"]
    for name, c in report["kinds"].items():
        lines.append(f"| {name} | {c['stragglers']} | {c['found']} | {_ratio(c['recall'])} |")
    lines += ["", "## Healthy nodes flagged per look-alike", "",
              "Every job has jitter; each also has one of these (none: jitter only).", "",
              "| look-alike | healthy nodes | flagged |", "|---|---:|---:|"]
    for name, c in report["look_alikes"].items():
        lines.append(f"| {name} | {c['healthy_nodes']} | {c['flagged']} |")
    conf = report["confidence"]
    lines += ["", f"Confidence of the stragglers found: min {_ratio(conf['min'])}, median "
              f"{_ratio(conf['median'])}; {conf['at_or_above_auto']} at or above 0.80 (their "
              "remediation opens by itself; the replacement still waits for a person).", "",
              "## Time", "", "| seed | observations | diagnose_window (s) |", "|---|---:|---:|"]
    lines += [f"| {t['seed']} | {t['observations']:,} | {t['seconds']} |"
              for t in report["timings"]]
    lines += ["", "## What was missed or flagged", ""]
    lines += [f"- {w}" for w in report["wrong"][:40]] or ["None."]
    lines += ["", "## An explanation of each kind", ""]
    lines += [f"- **{k}**: {v}" for k, v in report["examples"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--fleets", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=36, help="jobs per fleet")
    parser.add_argument("--seed", type=int, default=21)
    args = parser.parse_args(argv)
    report = {"when": f"{datetime.now(UTC):%Y-%m-%d %H:%M}", "python": platform.python_version(),
              **score([args.seed + i for i in range(args.fleets)], args.jobs)}
    text = markdown(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-fail-slow.md").write_text(text)
    (args.out / "bench-fail-slow.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
