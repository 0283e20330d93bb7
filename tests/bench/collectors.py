"""Benchmark: a full poll of 12,500 nodes and 100,000 GPUs, normalized and stored in PostgreSQL.

Run by ``make bench`` under deploy/testing/with-services.sh, in a database of its own
(``<DATABASE_URL's name>_bench``, created and dropped here). Slurm and Prometheus are the real
clients (``SlurmCli``, ``PrometheusTelemetry``) with their transport replaced by the text a
real fleet's answers hold: ``sinfo --json`` and ``squeue --json`` output in Slurm 22.05's shape
(records copied from the captured fixtures) and Prometheus query responses for the fourteen
instant queries, rendered before the clock starts. So the figures are FleetWatch's own cost
(JSON decoding, parsing, merging the series, change detection, signal drafting and the bulk
writes), without the network and the sources' own time. Kubernetes nodes come as parsed
objects. Three polls per source:

- first: an empty database (every node, GPU and job is new);
- steady: the next scrape, in which every GPU's utilisation and temperature moved (the worst
  case: every GPU row is rewritten) and nothing else did;
- between scrapes: the same answers again, as most polls read (Prometheus scrapes the
  exporters every 15 s, FleetWatch polls every 5 s): nothing is written;
- eventful: 100 GPUs report an XID, 50 nodes drain, 200 links flap, jobs change state.

Target: a whole poll (the three sources) under 2 s on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import hostlist

NODES = 12_500
GPUS_PER_NODE = 8


def _setup_database() -> tuple[str, str]:
    import dj_database_url
    import psycopg

    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        sys.exit("collectors bench: needs DATABASE_URL pointing at PostgreSQL "
                 "(run it with deploy/testing/with-services.sh)")
    config = dj_database_url.parse(url)
    name = f"{config['NAME']}_bench"
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    os.environ["DATABASE_URL"] = url.rsplit("/", 1)[0] + "/" + name
    return admin, name


def _drop_database(admin: str, name: str) -> None:
    import psycopg
    from django.db import connections

    connections.close_all()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Fleet:
    """In-memory sources for a large fleet; ``tick()`` moves it one scrape forward."""

    def __init__(self, nodes: int, seed: int = 3) -> None:
        from collectors.clients.base import GpuMetric, K8sNode, NicPort, SlurmJob, SlurmNode

        self.rng = random.Random(seed)
        names = [f"gpu{i:05d}" for i in range(nodes)]
        self.names = names
        self.slurm_nodes = [SlurmNode(n, "ALLOCATED", (), "", "gpu") for n in names]
        self.k8s_nodes = [K8sNode(n, True, False, {}, {"fleetwatch.io/pool": "gpu"})
                          for n in names]
        self.gpus = [GpuMetric(n, g, f"GPU-{i:05d}-{g}", 95.0, 60.0, 0, power_w=650.0)
                     for i, n in enumerate(names) for g in range(GPUS_PER_NODE)]
        self.ports = [NicPort(n, "mlx5_0", 1, "ACTIVE", 0) for n in names]
        self.jobs = [SlurmJob(str(500000 + i), f"train-{i}", f"user{i % 50}", "RUNNING",
                              tuple(names[i * 16:(i + 1) * 16]))
                     for i in range(nodes // 16)]
        self.leaves = {f"leaf-{i // 32:03d}": names[i:i + 32] for i in range(0, nodes, 32)}

    def tick(self) -> None:
        rng = self.rng
        self.gpus = [replace(m, utilization=float(rng.randrange(80, 101)),
                             temperature=float(rng.randrange(50, 78))) for m in self.gpus]

    def events(self) -> None:
        rng = self.rng
        for i in rng.sample(range(len(self.gpus)), 100):
            self.gpus[i] = replace(self.gpus[i], last_xid=rng.choice((79, 48, 13)))
        for i in rng.sample(range(len(self.slurm_nodes)), 50):
            self.slurm_nodes[i] = replace(self.slurm_nodes[i], flags=("DRAIN",),
                                          reason="maint: bench")
        for i in rng.sample(range(len(self.ports)), 200):
            p = self.ports[i]
            self.ports[i] = replace(p, state="DOWN", link_downed=p.link_downed + 1)
        for i in rng.sample(range(len(self.jobs)), 40):
            self.jobs[i] = replace(self.jobs[i], state="COMPLETED")


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"


def _slurm_payloads(fleet: Fleet) -> dict[str, str]:
    """``sinfo --json``, ``squeue --all --json`` and ``scontrol show topology`` as 22.05
    prints them for the fleet's current state."""
    sinfo = json.loads((FIXTURES / "22.05-sinfo.json").read_text())
    squeue = json.loads((FIXTURES / "22.05-squeue.json").read_text())
    node_t, job_t = sinfo["nodes"][0], squeue["jobs"][0]
    nodes = [{**node_t, "name": n.name, "hostname": n.name, "state": n.state.lower(),
              "state_flags": list(n.flags), "reason": n.reason} for n in fleet.slurm_nodes]
    jobs = [{**job_t, "job_id": int(j.job_id), "name": j.name, "user_name": j.user,
             "job_state": j.state, "nodes": hostlist.collect_hostlist(list(j.nodes)),
             "node_count": len(j.nodes)} for j in fleet.jobs]
    topology = "".join(f"SwitchName={leaf} Level=0 LinkSpeed=1 "
                       f"Nodes={hostlist.collect_hostlist(members)}\n"
                       for leaf, members in fleet.leaves.items())
    return {"sinfo --json": json.dumps({**sinfo, "nodes": nodes}),
            "squeue --all --json": json.dumps({**squeue, "jobs": jobs}),
            "scontrol show topology": topology}


def _vector(series: list[tuple[dict[str, str], float]]) -> str:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": labels, "value": [1796284426.5, f"{value:g}"]} for labels, value in series]}})


def _prometheus_payloads(fleet: Fleet, client: Any) -> dict[str, str]:
    """The answer to each of the client's instant queries, as Prometheus sends it."""
    import operator

    from collectors.clients import prometheus as p

    ops = {"!=": operator.ne, ">": operator.gt, ">=": operator.ge}
    out = {}
    for query in p.GPU_QUERIES:
        series = []
        op, _, bound = query.keep.partition(" ")
        for m in fleet.gpus:
            value = getattr(m, query.attr)
            # What Prometheus leaves out: no series, or one the query's comparison drops.
            if value is None or (op and not ops[op](value, float(bound))):
                continue
            labels = {"Hostname": m.node, "gpu": str(m.gpu), "instance": f"{m.node}:9400"}
            if not query.lean:
                labels.update(UUID=m.uuid, modelName="NVIDIA H100 80GB HBM3")
            series.append((labels, float(value)))
        group = p.GPU_LEAN_GROUP if query.lean else p.GPU_GROUP
        out[client._instant_expr(query, group)] = _vector(series)
    states = {v: k for k, v in p.IB_STATES.items()}
    for query in p.NIC_QUERIES:
        series = []
        for port in fleet.ports:
            value = states[port.state] if query.attr == "state" else getattr(port, query.attr)
            series.append(({"Hostname": port.node, "device": port.device, "port": str(port.port),
                            "instance": f"{port.node}:9100"}, float(value)))
        out[client._instant_expr(query, p.NIC_GROUP)] = _vector(series)
    return out


def _clients(fleet: Fleet) -> tuple[Any, Any, Any]:
    from collectors.clients.prometheus import PrometheusTelemetry
    from collectors.clients.slurm import SlurmCli

    class Slurm(SlurmCli):
        payloads: dict[str, str] = {}

        def _run(self, *args: str, retry: bool = True) -> str:
            return self.payloads[" ".join(args)]

    class Telemetry(PrometheusTelemetry):
        payloads: dict[str, str] = {}

        def _query(self, expr: str) -> list[dict[str, Any]]:
            # What the HTTP client does with the body: decode it, take the result.
            return json.loads(self.payloads[expr])["data"]["result"]

    class Kubernetes:
        def nodes(self) -> list[Any]:
            return fleet.k8s_nodes

    slurm = Slurm()
    slurm._release = (22, 5)
    telemetry = Telemetry("http://prometheus.invalid:9090")
    return slurm, Kubernetes(), telemetry


def _render(fleet: Fleet, slurm: Any, telemetry: Any) -> None:
    slurm.payloads = _slurm_payloads(fleet)
    telemetry.payloads = _prometheus_payloads(fleet, telemetry)


def run(nodes: int) -> list[dict[str, Any]]:
    from collectors import services
    from collectors.clients import Clients
    from collectors.models import CollectorRun

    fleet = Fleet(nodes)
    slurm, kubernetes, telemetry = _clients(fleet)
    clients = Clients(slurm, kubernetes, telemetry, None, None)  # type: ignore[arg-type]
    rows = []
    for phase in ("first", "steady", "between scrapes", "eventful"):
        if phase in ("steady", "eventful"):
            fleet.tick()
        if phase == "eventful":
            fleet.events()
        _render(fleet, slurm, telemetry)  # the sources' answers, before the clock starts
        row: dict[str, Any] = {"phase": phase}
        for source in ("slurm", "kubernetes", "telemetry"):
            start = time.perf_counter()
            result = services.collect_source(source, clients=clients)
            row[source] = time.perf_counter() - start
            row[f"{source}_signals"] = len(result.signal_ids)
            assert result.healthy, result.error
            warnings = CollectorRun.objects.filter(source=source).first()
            assert warnings is not None and not warnings.warnings, warnings.warnings[:3]
        row["total"] = row["slurm"] + row["kubernetes"] + row["telemetry"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=NODES)
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    admin, name = _setup_database()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
    os.environ["FLEETWATCH_STORE_GPU_SAMPLES"] = "0"  # as with Prometheus behind the charts
    import django

    django.setup()
    from django.core.management import call_command

    try:
        call_command("migrate", verbosity=0)
        # Announcing signals to diagnosis is a broker message after commit; not timed here.
        from collectors import services

        services.signals_announce = lambda ids: None  # type: ignore[assignment]
        rows = run(args.nodes)
    finally:
        _drop_database(admin, name)
    gpus = args.nodes * GPUS_PER_NODE
    lines = ["# Collector benchmark", "",
             f"A full poll of {args.nodes:,} nodes and {gpus:,} GPUs (Slurm nodes and "
             f"{args.nodes // 16:,} jobs from `sinfo`/`squeue --json` text, Kubernetes nodes, "
             "the dcgm fields a poll reads (utilisation and temperature of every GPU, the "
             "fault fields of the GPUs that have one) and every node's NIC port from Prometheus "
             "query responses), decoded, parsed, normalized and stored in PostgreSQL.", "",
             "| poll | slurm | kubernetes | telemetry | total | signals |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        signals = r["slurm_signals"] + r["kubernetes_signals"] + r["telemetry_signals"]
        lines.append(f"| {r['phase']} | {r['slurm']:.2f} s | {r['kubernetes']:.2f} s | "
                     f"{r['telemetry']:.2f} s | {r['total']:.2f} s | {signals:,} |")
    worst = max(r["total"] for r in rows if r["phase"] != "first")
    lines += ["", f"Target: a poll under 2 s. Steady and eventful polls: worst {worst:.2f} s "
              f"({'meets' if worst < 2 else 'misses'} it); the first poll creates every row."]
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-collectors.md").write_text(report)
    (args.out / "bench-collectors.json").write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
