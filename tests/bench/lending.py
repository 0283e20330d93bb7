"""Benchmark: automatic lending driven by a simulated demand curve, and what the capacity
reads cost at 12,500 nodes.

Curve (the default): a simulated GPU cluster (collectors/sim/fleet.py, on a manual clock, no
database) whose training demand follows a working week: busy by day, quiet at night, a
burst beyond the fleet one afternoon, noise every half hour. Jobs of one or two whole nodes
arrive to keep the queue at the curve and end after their run time; Slurm's own scheduling
(the sim's) places them. Every simulated minute the decision (incidents/lending/decide.py)
sees the nodes' use and the pending GPU demand, and its lends and returns run through the
loan's real steps (incidents/lending/steps.py) against the sim's Slurm and Kubernetes: drain,
label, taint; cordon, evict the inference pod placed on the lent node, restore, resume.

Reported (``reports/bench-lending.md`` and ``.json``, the chart ``reports/bench-lending.svg``;
``--publish`` also copies the chart to ``tests/bench/charts/lending.svg``, which the README
shows): loans made, how long they lasted, nodes lent again within the cooldown of coming back
(0 is no bouncing), loans back within 30 minutes of going out, ticks with training below its
floor (0), the most lent at once against the ceiling, each loan's outside calls (one per
action), and the GPU-hours lent to inference against the GPU-hours training waited.

Scale (``--scale``; needs PostgreSQL, as ``make bench`` runs it under
tests/harness/with-services.sh): 12,500 nodes of 8 GPUs in one database of its own, a tenth
busy, 200 loans live, 500 jobs pending; times ``node_uses`` (what the tick and the page read),
the capacity page's ``capacity``, one ``capacity_snapshot`` and one ``lending_tick``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PUBLISHED = ROOT / "tests" / "bench" / "charts" / "lending.svg"

MIN = 60.0
HOUR = 3600.0
GPUS = 8


def wanted_nodes(t: float, rng: random.Random, noise: dict[int, int]) -> int:
    """Training demand, in nodes' worth of GPUs, at simulated second ``t`` of the week."""
    day, hour = divmod(t / HOUR, 24)
    weekend = int(day) % 7 >= 5
    if 8 <= hour < 19 and not weekend:
        base = 26
    elif 7 <= hour < 8 or 19 <= hour < 21:
        base = 18 if not weekend else 10
    else:
        base = 8
    if int(day) == 2 and 14 <= hour < 17:
        base = 40  # a sweep bigger than the fleet: training waits, nothing is out
    slot = int(t // (30 * MIN))
    if slot not in noise:
        noise[slot] = rng.randint(-2, 2)
    return max(0, base + noise[slot])


@dataclass
class LoanRun:
    """One loan, in memory: what the services keep in a Loan row, for the bench."""

    loan_id: int
    node: str
    status: str  # lending, lent, returning, returned, failed
    step: str
    started: float
    state: dict[str, Any] = field(default_factory=dict)
    done_calls: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    lent_at: float | None = None
    returned_at: float | None = None


def simulate(hours: float, nodes: int, seed: int, *, lend: bool = True) -> dict[str, Any]:
    """The week, minute by minute; ``lend=False``: the same demand with nothing lent (the
    baseline the cost of lending to training is measured against)."""
    from collectors.clients import Clients
    from collectors.clients.base import NoProvider
    from collectors.clock import ManualClock
    from collectors.sim import fleet as sim
    from incidents.lending import decide, steps
    from incidents.remediation.steps import Done, Wait

    rng = random.Random(seed)
    noise: dict[int, int] = {}
    clock = ManualClock(1_800_000_000.0)
    start = clock.now()
    tmp = Path(tempfile.mkdtemp(prefix="fleetwatch-lending-"))
    fleet = sim.SimFleet(tmp / "fleet.json", speed=1.0, clock=clock)
    fleet.seed(nodes=nodes, spares=0)
    with fleet.transaction() as state:
        state["jobs"].clear()  # the curve's jobs only
    clients = Clients(sim.SimSlurm(fleet), sim.SimKubernetes(fleet), sim.SimTelemetry(fleet),
                      NoProvider(), None)  # type: ignore[arg-type]  # nothing notifies here
    rules = decide.Policy(
        floor={"*": decide.Share(percent=50)},
        ceiling={"*": decide.Share(percent=40) if lend else decide.Share(count=0)},
        lend_below_gpus=0, return_above_gpus=0, idle_seconds=45 * MIN, quiet_seconds=45 * MIN,
        demand_seconds=10 * MIN, cooldown_seconds=HOUR, max_moves=2)
    marks = steps.Marks({"fleetwatch.io/lent-to": "inference"}, (),
                        [("fleetwatch.io/inference", "true", "NoSchedule")], ())
    ends: dict[str, float] = {}
    loans: dict[str, LoanRun] = {}
    history: list[LoanRun] = []
    memory = decide.Memory()
    series: list[dict[str, float]] = []
    decide_ms: list[float] = []

    def run(loan: LoanRun) -> None:
        """The loan's steps until one waits: the services' runner, without the database."""
        for _ in range(20):
            def audit(verb: str, target: str, result: Any, error: str | None,
                      duration_ms: float | None = None) -> None:
                loan.calls.append(f"{verb} {target}" + (" (failed)" if error else ""))

            ctx = steps.LoanContext(
                loan_id=loan.loan_id, node=loan.node, clients=clients, state=loan.state,
                audit=audit, marks=marks, deadline=loan.started + HOUR,
                done_calls=loan.done_calls, clock=clock)
            outcome = steps.EXECUTORS[loan.step](ctx)
            if isinstance(outcome, Wait):
                return
            if isinstance(outcome, steps.GiveBack):
                loan.status, loan.step = "returning", steps.FIRST_RETURN_STEP
                continue
            if not isinstance(outcome, Done):
                loan.status = "failed"
                return
            following = steps.next_step(loan.step)
            if following is not None:
                loan.step = following
                continue
            if loan.status == "lending":
                loan.status, loan.lent_at = "lent", clock.now()
                with fleet.transaction() as state:  # inference schedules there
                    state["pods"].append({"namespace": "inference", "name": f"llm-{loan.node}",
                                          "node": loan.node, "labels": {"app": "llm"},
                                          "owner_kind": "ReplicaSet"})
            else:
                loan.status, loan.returned_at = "returned", clock.now()
            return

    job_seq = made = 0
    while clock.now() - start < hours * HOUR:
        now = clock.now()
        t = now - start
        with fleet.transaction() as state:
            for job_id, end in list(ends.items()):
                if end <= now:
                    # Done: gone from Slurm's list (as past MinJobAge), and from the state
                    # file, which every simulated call reads whole.
                    del state["jobs"][job_id]
                    del ends[job_id]
            queued = sum(j["num_nodes"] for j in state["jobs"].values()
                         if j["state"] in ("RUNNING", "PENDING"))
            target = wanted_nodes(t, rng, noise)
            while queued < target:
                size = rng.choice((1, 1, 2))
                job_id = sim.submit_job(state, f"train-{job_seq}", "curve", num_nodes=size)
                job_seq += 1
                state["jobs"][job_id]["run_seconds"] = rng.uniform(45 * MIN, 180 * MIN)
                queued += size
        with fleet.transaction() as state:  # started jobs get their end time
            for job_id, job in state["jobs"].items():
                if job["state"] == "RUNNING" and job_id not in ends:
                    ends[job_id] = now + float(job.get("run_seconds", HOUR))
        slurm = {n.name: n for n in clients.slurm.nodes()}
        jobs = clients.slurm.jobs()
        pending = sum(j.gpus_requested or 0 for j in jobs if j.state == "PENDING")
        busy = {n for j in jobs if j.state == "RUNNING" for n in j.nodes}
        views = []
        for name, node in sorted(slurm.items()):
            loan = loans.get(name)
            if loan is not None:
                use = {"lending": decide.LENDING, "lent": decide.LENT,
                       "returning": decide.RETURNING}.get(loan.status, decide.OUT)
            elif "DRAIN" in node.flags:
                use = decide.OUT
            else:
                use = decide.TRAINING_BUSY if name in busy else decide.TRAINING_IDLE
            back = [h.returned_at for h in history if h.node == name and h.returned_at]
            views.append(decide.NodeView(name, "gpu", use, GPUS, returned_at=max(back, default=None),
                                         lent_at=loan.lent_at if loan else None))
        tick = time.perf_counter()
        decision = decide.decide(views, pending, memory, rules, now)
        decide_ms.append((time.perf_counter() - tick) * 1000)
        memory = decision.memory
        for move in decision.lend:
            made += 1
            loans[move.node] = LoanRun(made, move.node, "lending", steps.FIRST_LEND_STEP, now)
        for move in decision.bring_back:
            loan = loans[move.node]
            loan.status, loan.step = "returning", steps.FIRST_RETURN_STEP
        for name, loan in list(loans.items()):
            if loan.status in ("lending", "returning"):
                run(loan)
            if loan.status in ("returned", "failed"):
                history.append(loans.pop(name))
        fig = decision.pools[0]
        # Slurm's schedulable nodes after this tick's moves (a lend drains, a return resumes).
        training = sum(1 for n in clients.slurm.nodes() if "DRAIN" not in n.flags)
        series.append({"t": t / HOUR, "lent": sum(1 for loan in loans.values()
                                                  if loan.status == "lent"),
                       "moving": sum(1 for loan in loans.values() if loan.status != "lent"),
                       "training": training, "floor": fig.floor, "ceiling": fig.ceiling,
                       "pending_nodes": pending / GPUS, "wanted": wanted_nodes(t, rng, noise),
                       "running_nodes": len(busy)})
        clock.advance(MIN)
    history.extend(loans.values())
    shutil.rmtree(tmp, ignore_errors=True)
    return {"series": series, "loans": history, "decide_ms": decide_ms, "rules": rules}


def figures(result: dict[str, Any]) -> dict[str, Any]:
    series, loans, rules = result["series"], result["loans"], result["rules"]
    done = [loan for loan in loans if loan.lent_at and loan.returned_at]
    durations = [(loan.returned_at - loan.lent_at) / MIN for loan in done]
    by_node: dict[str, list[Any]] = {}
    for loan in sorted(loans, key=lambda x: x.started):
        by_node.setdefault(loan.node, []).append(loan)
    relent = sum(1 for runs in by_node.values() for a, b in itertools.pairwise(runs)
                 if a.returned_at is not None and b.started - a.returned_at < rules.cooldown_seconds)
    quick = sum(1 for d in durations if d < 30)
    per_call = [c for loan in loans for c in loan.calls]
    repeated = sum(1 for loan in loans for c in set(loan.calls) if loan.calls.count(c) > 1)
    ms = sorted(result["decide_ms"])
    return {
        "simulated_hours": round(series[-1]["t"], 1) if series else 0,
        "nodes": int(series[0]["training"]) if series else 0,
        "loans": len(loans),
        "loans_completed": len(done),
        "loan_minutes_median": round(statistics.median(durations), 1) if durations else None,
        "loan_minutes_min": round(min(durations), 1) if durations else None,
        "lent_again_within_cooldown": relent,
        "back_within_30_min": quick,
        "ticks_training_below_floor": sum(1 for s in series if s["training"] < s["floor"]),
        "max_lent": max((s["lent"] for s in series), default=0),
        "ceiling": series[0]["ceiling"] if series else 0,
        "floor": series[0]["floor"] if series else 0,
        "outside_calls": len(per_call),
        "calls_made_twice_in_a_loan": repeated,
        "failed_loans": sum(1 for loan in loans if loan.status == "failed"),
        "gpu_hours_lent": round(sum(s["lent"] for s in series) * GPUS / 60, 1),
        "gpu_hours_training_waited": round(sum(s["pending_nodes"] for s in series) * GPUS / 60, 1),
        "decide_ms_median": round(statistics.median(ms), 3) if ms else None,
        "decide_ms_max": round(ms[-1], 3) if ms else None,
    }


def svg_chart(series: list[dict[str, float]], out: Path) -> None:
    """Lent nodes, Slurm's pending demand (in nodes) and training nodes against the floor
    and the ceiling, over the simulated week: a plain SVG, no plotting library."""
    width, height, left, right, top, bottom = 960, 380, 56, 20, 40, 46
    hours = max(s["t"] for s in series)
    top_value = max(max(s["training"] for s in series), max(s["pending_nodes"] for s in series),
                    1.0) * 1.1

    def x(t: float) -> float:
        return left + (width - left - right) * t / hours

    def y(v: float) -> float:
        return top + (height - top - bottom) * (1 - v / top_value)

    def line(key: str | Callable[[dict[str, float]], float], colour: str, dash: str = "",
             w: float = 2.0) -> str:
        value = (lambda s: s[key]) if isinstance(key, str) else key
        values = [value(s) for s in series]
        # Only where the line turns: a flat stretch is its two ends (a week of minutes is
        # 10,080 points; the chart stays a few kilobytes).
        kept = [i for i, v in enumerate(values) if i in (0, len(values) - 1)
                or v != values[i - 1] or v != values[i + 1]]
        points = " ".join(f"{x(series[i]['t']):.1f},{y(values[i]):.1f}" for i in kept)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return (f'<polyline fill="none" stroke="{colour}" stroke-width="{w}"{extra} '
                f'points="{points}"/>')

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             '<title>Automatic lending over a simulated week: nodes lent to inference, '
             "Slurm's pending demand, training nodes, the floor and the ceiling</title>",
             f'<rect width="{width}" height="{height}" fill="#ffffff"/>']
    step = 5 if top_value <= 40 else 10
    for v in range(0, int(top_value) + 1, step):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     'stroke="#e4e7eb"/>')
        parts.append(f'<text x="{left - 8}" y="{y(v) + 4:.1f}" text-anchor="end" '
                     f'fill="#555">{v}</text>')
    for day in range(int(hours // 24) + 1):
        xd = x(day * 24)
        parts.append(f'<line x1="{xd:.1f}" x2="{xd:.1f}" y1="{top}" y2="{height - bottom}" '
                     'stroke="#e4e7eb"/>')
        label = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")[day % 7]
        if day * 24 < hours:
            parts.append(f'<text x="{x(day * 24 + 12):.1f}" y="{height - bottom + 18}" '
                         f'text-anchor="middle" fill="#555">{label}</text>')
    parts.append(f'<text x="14" y="{(top + height - bottom) / 2:.0f}" fill="#555" '
                 f'transform="rotate(-90 14 {(top + height - bottom) / 2:.0f})" '
                 'text-anchor="middle">nodes</text>')
    parts += [
        line("floor", "#d93025", "6 4", 1.5),
        line("ceiling", "#7a7a7a", "2 3", 1.5),
        line("training", "#2e9d5b", "", 1.5),
        line("pending_nodes", "#e8710a", "", 1.5),
        line("lent", "#1a56c4", "", 2.5),
    ]
    legend = [("#1a56c4", "nodes lent to inference"), ("#e8710a", "Slurm's pending demand "
              "(nodes' worth of GPUs)"), ("#2e9d5b", "nodes in Slurm training"),
              ("#d93025", "training floor"), ("#7a7a7a", "lending ceiling")]
    lx = left
    for colour, text in legend:
        parts.append(f'<line x1="{lx}" x2="{lx + 18}" y1="18" y2="18" stroke="{colour}" '
                     'stroke-width="3"/>')
        parts.append(f'<text x="{lx + 22}" y="22" fill="#222">{text}</text>')
        lx += 26 + 6.2 * len(text)
    parts.append("</svg>")
    out.write_text("\n".join(parts) + "\n")


def scale(nodes: int) -> dict[str, Any]:
    """What the tick, the page and the snapshot cost with ``nodes`` nodes in the database."""
    from tests.bench.burst import on_own_database

    def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
        from django.core.management import call_command
        from django.db import connection
        from django.utils import timezone

        from collectors import services as collectors
        from collectors.models import CollectorRun, Gpu, Job, Node, SourceHealth
        from incidents.lending import selectors, services
        from incidents.models import Loan

        call_command("migrate", verbosity=0)
        cluster = collectors.cluster_default()
        now = timezone.now()
        names = [f"gpu-{i:05d}" for i in range(1, nodes + 1)]
        Node.objects.bulk_create([Node(
            cluster=cluster, name=n, pool="gpu", slurm_state="ALLOCATED" if i % 10 == 0
            else "IDLE", k8s_ready=True, k8s_ready_status="True", health="healthy")
            for i, n in enumerate(names)], batch_size=2000)
        ids = dict(Node.objects.values_list("name", "id"))
        Gpu.objects.bulk_create([Gpu(node_id=ids[n], index=g, utilization=50.0 if i % 10 == 0
                                     else 0.0) for i, n in enumerate(names) for g in range(GPUS)],
                                batch_size=5000)
        Job.objects.bulk_create([Job(cluster=cluster, slurm_id=str(i), state="RUNNING",
                                     nodes=[n], gpus={n: list(range(GPUS))}, updated_at=now)
                                 for i, n in enumerate(names) if i % 10 == 0], batch_size=2000)
        Job.objects.bulk_create([Job(cluster=cluster, slurm_id=f"p{i}", state="PENDING",
                                     gpus_requested=GPUS, state_reason="Resources",
                                     submitted_at=now, updated_at=now) for i in range(500)],
                                batch_size=2000)
        Loan.objects.bulk_create([Loan(cluster=cluster, node=n, pool="gpu", status="lent",
                                       requested_by="system", lent_at=now)
                                  for n in names[1:2001:10]], batch_size=2000)
        SourceHealth.objects.create(cluster=cluster, name="slurm", healthy=True,
                                    last_success_at=now, last_run_at=now)
        CollectorRun.objects.create(cluster=cluster, source="slurm", started_at=now,
                                    finished_at=now, duration_ms=1.0, ok=True)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        timings: dict[str, list[float]] = {}
        for name, fn in (("node_uses", lambda: selectors.node_uses(cluster)),
                         ("capacity_page", lambda: selectors.capacity(cluster)),
                         ("capacity_snapshot", lambda: services.capacity_snapshot(cluster)),
                         ("lending_tick", lambda: services.lending_tick(cluster))):
            for _ in range(3):
                started = time.perf_counter()
                fn()
                timings.setdefault(name, []).append((time.perf_counter() - started) * 1000)
        return {"nodes": nodes, "gpus": nodes * GPUS, "loans_live": 200, "jobs_pending": 500,
                **{f"{k}_ms_median": round(statistics.median(v), 1) for k, v in timings.items()}}

    os.environ.setdefault("FLEETWATCH_FLEET", "sim")
    return on_own_database("lending", run, argparse.Namespace())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=7 * 24)
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "reports")
    parser.add_argument("--publish", action="store_true",
                        help=f"copy the chart to {PUBLISHED.relative_to(ROOT)} (the README's)")
    parser.add_argument("--scale", type=int, default=0,
                        help="also time the capacity reads with this many nodes (PostgreSQL)")
    args = parser.parse_args(argv)
    os.environ.setdefault("FLEETWATCH_FLEET", "sim")
    # At scale first: it sets Django up on a PostgreSQL database of its own (and drops it);
    # the simulation needs Django's settings, never a database.
    scaled = scale(args.scale) if args.scale else None
    if not scaled:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
        os.environ.setdefault("FLEETWATCH_DATA_DIR", tempfile.mkdtemp(prefix="fleetwatch-bench-"))
        import django

        django.setup()
    started = time.perf_counter()
    result = simulate(args.hours, args.nodes, args.seed)
    report: dict[str, Any] = {"curve": figures(result)}
    baseline = figures(simulate(args.hours, args.nodes, args.seed, lend=False))
    report["curve"]["gpu_hours_training_waited_without_lending"] = \
        baseline["gpu_hours_training_waited"]
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    if scaled:
        report["scale"] = scaled
    args.out.mkdir(parents=True, exist_ok=True)
    chart = args.out / "bench-lending.svg"
    svg_chart(result["series"], chart)
    if args.publish:
        PUBLISHED.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(chart, PUBLISHED)
    (args.out / "bench-lending.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Lending: a simulated week of demand", "",
             f"`python -m tests.bench.lending --hours {args.hours:g} --nodes {args.nodes}"
             f" --seed {args.seed}`{' --scale ' + str(args.scale) if args.scale else ''}", "",
             "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["curve"].items()]
    if "scale" in report:
        lines += ["", "## At scale", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in report["scale"].items()]
    lines += ["", f"Chart: `{chart.relative_to(ROOT) if chart.is_relative_to(ROOT) else chart}`"]
    (args.out / "bench-lending.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    curve = report["curve"]
    bad = curve["lent_again_within_cooldown"] or curve["ticks_training_below_floor"] or \
        curve["calls_made_twice_in_a_loan"] or curve["failed_loans"] or not curve["loans"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
