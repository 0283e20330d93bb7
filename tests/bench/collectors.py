"""Benchmark: a full poll of 12,500 nodes and 100,000 GPUs, normalized and stored in PostgreSQL.

Run by ``make bench`` under deploy/testing/with-services.sh, in a database of its own
(``<DATABASE_URL's name>_bench``, created and dropped here). The sources are in-memory
clients that return what a real fleet returns (Slurm nodes and jobs, Kubernetes nodes, every
GPU's dcgm sample and every node's NIC port), so the figures are FleetWatch's own cost:
change detection, signal drafting and the bulk writes. Three polls per source:

- first: an empty database (every node, GPU and job is new);
- steady: the next scrape, in which every GPU's utilisation and temperature moved (they always
  do) and nothing else did;
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


class _Slurm:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def nodes(self) -> list[Any]:
        return self.fleet.slurm_nodes

    def jobs(self) -> list[Any]:
        return self.fleet.jobs

    def topology(self) -> dict[str, list[str]]:
        return self.fleet.leaves


class _Kubernetes:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def nodes(self) -> list[Any]:
        return self.fleet.k8s_nodes


class _Telemetry:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def gpu_metrics(self) -> list[Any]:
        return self.fleet.gpus

    def nic_ports(self) -> list[Any]:
        return self.fleet.ports


def run(nodes: int) -> list[dict[str, Any]]:
    from collectors import services
    from collectors.clients import Clients

    fleet = Fleet(nodes)
    clients = Clients(_Slurm(fleet), _Kubernetes(fleet), _Telemetry(fleet), None, None)  # type: ignore[arg-type]
    rows = []
    for phase in ("first", "steady", "eventful"):
        if phase != "first":
            fleet.tick()
        if phase == "eventful":
            fleet.events()
        row: dict[str, Any] = {"phase": phase}
        for source in ("slurm", "kubernetes", "telemetry"):
            start = time.perf_counter()
            result = services.collect_source(source, clients=clients)
            row[source] = time.perf_counter() - start
            row[f"{source}_signals"] = len(result.signal_ids)
            assert result.healthy, result.error
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
             f"{args.nodes // 16:,} jobs, Kubernetes nodes, every GPU's dcgm sample and every "
             "node's NIC port), normalized and stored in PostgreSQL.", "",
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
