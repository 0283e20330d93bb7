"""Benchmark: one diagnosis cycle at 1,000, 10,000 and 100,000 GPUs (``make bench``).

A cycle is one call of the engine on a one-minute window: every GPU's dcgm-exporter sample
every 15 s (temperature, utilisation, clock-event reasons and the XID gauge: four fields per
sample, four scrapes), each node's NIC counters, Kubernetes and Slurm records for a few
nodes, and the fault lines of 50 simultaneous faults at 100,000 GPUs (scaled down with the
fleet, at least 5): falling-off-the-bus GPUs whose jobs' peers time out, ECC and NVLink
errors, flapping links, dead leaf switches, overheating GPUs, unreachable nodes and jobs that
run out of memory. Building the window is not timed; the engine's call is, best of a few runs
(the machines are shared), in wall-clock and in CPU time (this process's, which other work on
the machine does not inflate as much). Memory: the most the cycle allocates on top of the
window it reads (tracemalloc, in a pass of its own, since tracing slows every allocation), and
the process's peak RSS once that size has run (sizes run smallest first, so it is the peak of
a process holding that window). It also checks the verdicts: every fault found, no
healthy node blamed. Writes a JSON and a Markdown report under reports/.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import resource
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from incidents.diagnosis import JobInfo, Observation, diagnose_window

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
SCRAPES = 4
SCRAPE_S = 15
NODES_PER_LEAF = 32
XID79 = "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
WATCHDOG = ("[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
            "OpType=ALLREDUCE) ran for 600013 milliseconds before timing out.")
# How the faults split, at 50: 3 + 15 + 8 + 4 + 6 + 5 + 4 + 5 = 50. Switches go first, so
# a whole leaf is still free of other faults.
MIX = [("switch_failure", 3), ("gpu_hardware", 15), ("gpu_memory", 8), ("nvlink", 4),
       ("network_flap", 6), ("thermal", 5), ("node_unreachable", 4), ("application_error", 5)]


@dataclass
class Fleet:
    observations: list[Observation]
    topology: dict[str, list[str]]
    jobs: list[JobInfo]
    expected: set[tuple[str, str]]


def build(gpus: int, faults: int, seed: int = 7) -> Fleet:
    rng = random.Random(seed)
    nodes = [f"gpu{i:05d}" for i in range(gpus // 8)]
    topology = {f"leaf-{i // NODES_PER_LEAF:03d}": nodes[i:i + NODES_PER_LEAF]
                for i in range(0, len(nodes), NODES_PER_LEAF)}
    jobs: list[JobInfo] = []
    job_of: dict[str, JobInfo] = {}
    i = 0
    while i < len(nodes):  # most of the fleet runs jobs of 4 to 32 nodes
        size = rng.choice((4, 8, 16, 32))
        job = JobInfo(str(100000 + len(jobs)), f"user{len(jobs) % 50}", tuple(nodes[i:i + size]))
        jobs.append(job)
        for n in job.nodes:
            job_of[n] = job
        i += size

    events: list[tuple[float, dict[str, Any]]] = []
    expected: set[tuple[str, str]] = set()
    hot: dict[tuple[str, int], tuple[float, float]] = {}   # (node, gpu) -> (temp, clock mask)
    xid_gauge: dict[tuple[str, int], int] = {}
    used: set[str] = set()
    leaves = list(topology)
    scale = faults / 50

    def free_node() -> str:
        while True:
            n = rng.choice(nodes)
            if n not in used and all(n not in topology[leaf] for leaf in failed_leaves):
                used.update(job_of[n].nodes if n in job_of else (n,))
                return n

    failed_leaves: list[str] = []
    for cause, count in MIX:
        for _ in range(max(1, round(count * scale))):
            t = rng.uniform(5, 40)
            if cause == "switch_failure":
                leaf = rng.choice([x for x in leaves if x not in failed_leaves
                                   and not set(topology[x]) & used])
                failed_leaves.append(leaf)
                used.update(topology[leaf])
                for k, n in enumerate(topology[leaf]):
                    events.append((t + k * 0.05, {"source": "nic", "node": n, "device": "mlx5_0",
                                                  "port": 1, "state": "DOWN"}))
                expected.add((cause, leaf))
                continue
            node = free_node()
            job = job_of.get(node)
            if cause == "gpu_hardware":
                events.append((t, {"source": "kernel", "node": node, "message": XID79}))
            elif cause in ("gpu_memory", "nvlink"):
                xid_gauge[(node, rng.randrange(8))] = 48 if cause == "gpu_memory" else 74
            elif cause == "network_flap":
                events.append((t, {"source": "nic", "node": node, "device": "mlx5_0", "port": 1,
                                   "state": "DOWN"}))
                events.append((t + 6, {"source": "nic", "node": node, "device": "mlx5_0",
                                       "port": 1, "state": "ACTIVE"}))
            elif cause == "thermal":
                hot[(node, rng.randrange(8))] = (93.0, 0x40)
            elif cause == "node_unreachable":
                events.append((t, {"source": "kubernetes", "node": node, "condition": "Ready",
                                   "status": "Unknown", "reason": "NodeStatusUnknown"}))
            elif cause == "application_error" and job:
                events.append((t, {"source": "job_log", "job": job.id, "node": node,
                                   "message": "torch.OutOfMemoryError: CUDA out of memory."}))
                events.append((t + 2, {"source": "slurm", "job": job.id, "job_state": ["FAILED"],
                                       "nodes": list(job.nodes), "exit_code": 1}))
                expected.add((cause, job.id))
                continue
            expected.add((cause, node))
            if job and cause in ("gpu_hardware", "gpu_memory", "nvlink", "network_flap",
                                 "node_unreachable"):
                for r, peer in enumerate(job.nodes):  # the symptoms a naive rule would blame
                    if peer != node:
                        events.append((t + 20, {"source": "job_log", "job": job.id,
                                                "node": peer, "message": WATCHDOG.format(r=r)}))

    # Background events: every node's NIC counter each minute, a few Kubernetes heartbeats
    # and Slurm records, ordinary training output.
    for n in nodes:
        events.append((rng.uniform(0, 59), {"source": "nic", "node": n, "device": "mlx5_0",
                                            "port": 1, "counter": "link_downed",
                                            "value": rng.choice((0, 0, 1, 3))}))
    for n in rng.sample(nodes, max(1, len(nodes) // 100)):
        events.append((rng.uniform(0, 59), {"source": "kubernetes", "node": n,
                                            "condition": "Ready", "status": "True",
                                            "reason": "KubeletReady"}))
        events.append((rng.uniform(0, 59), {"source": "slurm", "node": n,
                                            "node_state": ["ALLOCATED"]}))
    for job in rng.sample(jobs, max(1, len(jobs) // 10)):
        events.append((rng.uniform(0, 59), {"source": "job_log", "job": job.id,
                                            "node": job.nodes[0], "message": "step 1200 loss 2.31"}))

    observations: list[Observation] = []
    ident = 0
    events.sort(key=lambda e: e[0])
    ev = 0
    for s in range(SCRAPES):
        at = T0 + timedelta(seconds=s * SCRAPE_S)
        while ev < len(events) and events[ev][0] < s * SCRAPE_S:
            t, fields = events[ev]
            observations.append(Observation.from_record(fields, T0 + timedelta(seconds=t), ident))
            ident, ev = ident + 1, ev + 1
        for n in nodes:
            for g in range(8):
                temp, mask = hot.get((n, g), (55.0 + (g * 3) % 17, 0.0))
                for metric, value in (("DCGM_FI_DEV_GPU_TEMP", temp),
                                      ("DCGM_FI_DEV_GPU_UTIL", 97.0),
                                      ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", mask),
                                      ("DCGM_FI_DEV_XID_ERRORS",
                                       float(xid_gauge.get((n, g), 0)) if s else 0.0)):
                    observations.append(Observation(at, "dcgm", n, g, "", metric, value, id=ident))
                    ident += 1
    for t, fields in events[ev:]:
        observations.append(Observation.from_record(fields, T0 + timedelta(seconds=t), ident))
        ident += 1
    return Fleet(observations, topology, jobs, expected)


def blame_of(result: Any) -> set[tuple[str, str]]:
    out = set()
    for d in result.diagnoses:
        if d.root_cause == "switch_failure":
            out.add((d.root_cause, d.switch))
        elif d.root_cause == "application_error":
            out.add((d.root_cause, d.job))
        else:
            out.update((d.root_cause, n) for n in d.nodes)
    return out


MIB = 1024 * 1024


def measure(gpus: int, repeat: int, memory: bool = True) -> dict[str, Any]:
    faults = max(5, round(50 * gpus / 100_000))
    fleet = build(gpus, faults)
    times, cpu = [], []
    result = None
    for _ in range(repeat):
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        result = diagnose_window(fleet.observations, fleet.topology, fleet.jobs)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    assert result is not None
    got = blame_of(result)
    cycle_mib = None
    if memory:
        # A pass of its own: the peak of what the call allocates while it runs, its result
        # included, above what was allocated before it.
        result = None
        gc.collect()
        tracemalloc.start()
        diagnose_window(fleet.observations, fleet.topology, fleet.jobs)
        cycle_mib = tracemalloc.get_traced_memory()[1] / MIB
        tracemalloc.stop()
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "gpus": gpus, "nodes": gpus // 8, "observations": len(fleet.observations),
        "faults": len(fleet.expected), "best_s": min(times), "median_s": statistics.median(times),
        "cpu_best_s": min(cpu), "cpu_median_s": statistics.median(cpu),
        "per_million_obs_s": min(times) / len(fleet.observations) * 1e6,
        "cycle_peak_mib": cycle_mib, "peak_rss_mib": rss_mib,
        "found": len(got & fleet.expected), "missed": sorted(map(list, fleet.expected - got)),
        "wrongly_blamed": sorted(map(list, got - fleet.expected)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the traced memory pass")
    args = parser.parse_args(argv)

    rows = [measure(g, args.repeat, memory=not args.no_memory) for g in args.gpus]
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def mib(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value:.1f} MiB" if value < 10 else f"{value:.0f} MiB"

    base = rows[0]
    lines = [
        "# Diagnosis benchmark", "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, Python {platform.python_version()}, one core, "
        f"{platform.machine()}. One cycle = one 60 s window ({SCRAPES} scrapes x 4 dcgm fields "
        "per GPU, NIC counters per node, events, faults). Best and median of "
        f"{args.repeat} runs, wall-clock and CPU time. Cycle peak: the most the call allocates "
        "on top of the window (tracemalloc, a separate pass); peak RSS: the process's once "
        f"that size has run (whole run: {peak_mib:.0f} MiB).", "",
        "| GPUs | nodes | observations | faults | cycle (best) | median | CPU (best) | "
        "CPU median | s per 1M obs | vs linear | cycle peak | peak RSS | found | wrongly blamed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        linear = base["best_s"] * r["observations"] / base["observations"]
        lines.append(
            f"| {r['gpus']:,} | {r['nodes']:,} | {r['observations']:,} | {r['faults']} | "
            f"{r['best_s'] * 1000:.0f} ms | {r['median_s'] * 1000:.0f} ms | "
            f"{r['cpu_best_s'] * 1000:.0f} ms | {r['cpu_median_s'] * 1000:.0f} ms | "
            f"{r['per_million_obs_s']:.3f} | {r['best_s'] / linear:.2f}x | "
            f"{mib(r['cycle_peak_mib'])} | {mib(r['peak_rss_mib'])} | "
            f"{r['found']}/{r['faults']} | {len(r['wrongly_blamed'])} |")
    top = rows[-1]
    verdict = "meets" if top["median_s"] < 1.0 else "misses"
    lines += ["", f"Target: the 100,000-GPU cycle under 1 s on one core, at the median: {verdict} "
              f"it ({top['median_s']:.3f} s median, {top['best_s']:.3f} s best, at "
              f"{top['gpus']:,} GPUs)."]
    if len(rows) > 1 and rows[-1]["gpus"] == 10 * rows[-2]["gpus"]:
        low = rows[-2]
        grew = top["observations"] / low["observations"]
        lines.append(f"From {low['gpus']:,} to {top['gpus']:,} GPUs ({grew:.1f}x "
                     f"the observations) the cycle takes {top['best_s'] / low['best_s']:.1f}x "
                     f"as long (best), {top['median_s'] / low['median_s']:.1f}x (median), "
                     f"{top['cpu_best_s'] / low['cpu_best_s']:.1f}x (CPU, best).")
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-diagnosis.md").write_text(report)
    (args.out / "bench-diagnosis.json").write_text(json.dumps(
        {"rows": rows, "peak_rss_mib": peak_mib, "python": platform.python_version()}, indent=1))
    ok = all(not r["missed"] and not r["wrongly_blamed"] for r in rows)
    if not ok:
        print("verdicts wrong:", [(r["gpus"], r["missed"], r["wrongly_blamed"]) for r in rows],
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
