"""FleetWatch on real sources, configured by environment variables alone: a real Celery worker
and beat with ``FLEETWATCH_FLEET=real`` collect from a real Slurm cluster (slurmctld and four
slurmd), the Kubernetes test server and a real Prometheus scraping the simulated
dcgm-exporter. An XID reaches an incident through a real scrape and a real PromQL query;
killing slurmctld or Prometheus turns that source red on its next run and opens no node
incident; bringing it back clears it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from collectors.models import CollectorRun, Gpu, Node, SourceHealth
from collectors.sim import fleet as sim
from collectors.sim.exporter import SimExporter
from collectors.sim.fleet import SimFleet
from incidents import selectors
from incidents.models import Incident
from tests.conftest import ROOT, Worker, stop_process_group, wait_for
from tests.harness.k8s_server import K8sTestServer
from tests.harness.prometheus import PrometheusServer, ScrapeTarget
from tests.harness.slurm_cluster import SlurmCluster, SlurmInstall, missing_binaries

pytestmark = pytest.mark.integration

NODES = ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]
LEAVES = {"leaf-a": NODES[:2], "leaf-b": NODES[2:]}
INTERVAL = 2.0  # FLEETWATCH_COLLECT_INTERVAL for the worker's beat


@dataclass
class Sources:
    slurm: SlurmCluster
    k8s: K8sTestServer
    prometheus: PrometheusServer
    fleet: SimFleet


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory,
            slurm_install: SlurmInstall) -> Iterator[Sources]:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed (missing {', '.join(missing)}): run `make test`")
    root = tmp_path_factory.mktemp("real")
    # The GPUs: the simulated fleet's four nodes, served in dcgm-exporter's format.
    fleet = SimFleet(root / "sim-fleet.json", 1.0)
    fleet.seed(nodes=len(NODES), spares=0)
    exporter = SimExporter(fleet.path, 1.0)
    address = f"127.0.0.1:{exporter.start()}"
    k8s = K8sTestServer({"nodes": [{"name": n, "labels": {"fleetwatch.io/pool": "gpu"}}
                                   for n in NODES]},
                        kubeconfig_path=root / "kubeconfig.yaml", bookmark_interval=0.5)
    k8s.start()
    prometheus = PrometheusServer(root / "prometheus", [ScrapeTarget(address, job="dcgm")], "1s")
    slurm = SlurmCluster(root / "slurm", NODES, LEAVES, kill_wait=2, install=slurm_install)
    try:
        prometheus.start()
        slurm.start()
        yield Sources(slurm, k8s, prometheus, fleet)
    finally:
        slurm.stop()
        prometheus.stop()
        k8s.stop()
        exporter.stop()


@pytest.fixture
def worker(sources: Sources, transactional_db: None, tmp_path: Path) -> Iterator[Worker]:
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if connection.vendor != "postgresql" or not broker.startswith("redis://"):
        pytest.fail("integration tests need PostgreSQL and Redis: run them with `make test`")
    import redis

    redis.Redis.from_url(broker).flushdb()
    db = connection.settings_dict
    # Only what an operator would set: no simulated fleet anywhere in this environment.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FLEETWATCH_SIM")},
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "CELERY_BROKER_URL": broker,
        "FLEETWATCH_DATA_DIR": str(tmp_path / "data"),
        "FLEETWATCH_FLEET": "real",
        "FLEETWATCH_CLUSTER": "lab",
        "FLEETWATCH_SLURM_CONF": sources.slurm.env["SLURM_CONF"],
        "FLEETWATCH_SLURM_BIN_DIR": sources.slurm.bin_dir or "",
        "FLEETWATCH_SLURM_TIMEOUT": "8",
        "FLEETWATCH_KUBECONFIG": str(sources.k8s.kubeconfig_path),
        "FLEETWATCH_PROMETHEUS_URL": sources.prometheus.url,
        "FLEETWATCH_COLLECT_INTERVAL": str(INTERVAL),
        "FLEETWATCH_POLICY_MODE": "observe",  # this test is about collection, not repair
    }
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "fleetwatch", "worker", "-B",
             "-Q", "collect,diagnose,remediate,default", "--concurrency", "3",
             "--loglevel", "INFO", "-s", str(tmp_path / "beat-schedule")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    running = Worker(proc, log)
    try:
        yield running
    finally:
        stop_process_group(proc)


def _health(name: str) -> SourceHealth | None:
    return SourceHealth.objects.filter(cluster__name="lab", name=name).first()


def _healthy(*names: str) -> bool:
    return all((h := _health(n)) is not None and h.healthy for n in names)


def _settled() -> dict[str, tuple[str, str, bool | None]] | None:
    """Each node's health, Slurm state and Kubernetes readiness, once all three sources are
    healthy and every GPU has been read; else None."""
    if not _healthy("slurm", "kubernetes", "telemetry") or Gpu.objects.filter(
            node__cluster__name="lab").count() < 8 * len(NODES):
        return None
    return {n.name: (n.health, n.slurm_state, n.k8s_ready)
            for n in Node.objects.filter(cluster__name="lab")}


def _runs_after(source: str, moment: float) -> list[CollectorRun]:
    return list(CollectorRun.objects.filter(cluster__name="lab", source=source,
                                            started_at__gt=_dt(moment)).order_by("started_at"))


def _dt(moment: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(moment, tz=UTC)


def test_a_dead_source_turns_red_on_its_next_run_and_opens_no_incident(
        sources: Sources, worker: Worker) -> None:
    before = wait_for(lambda: _settled(), 90, f"the fleet collected\n{worker.output()}")

    # slurmctld dies: the first slurm run that starts afterwards fails, and says why.
    killed = time.time()
    sources.slurm.stop_controller()
    try:
        wait_for(lambda: _runs_after("slurm", killed), 60, "a slurm run after the kill")
        first = _runs_after("slurm", killed)[0]
        assert not first.ok and first.error, first.error
        health = _health("slurm")
        assert health is not None and health.healthy is False and health.last_error
        # Kubernetes and Prometheus still answer; nothing about the nodes changed.
        assert _healthy("kubernetes", "telemetry")
    finally:
        sources.slurm.start_controller()
    wait_for(lambda: _healthy("slurm"), 60, f"slurm healthy again\n{worker.output()}")
    # A restarted slurmctld reports its nodes UNKNOWN until each slurmd registers again: that
    # is Slurm's own state, shown as it is, never read as a failure.
    wait_for(lambda: _settled() == before, 60, f"the nodes IDLE again\n{worker.output()}")

    # Prometheus dies: the same for telemetry.
    killed = time.time()
    sources.prometheus.kill()
    try:
        wait_for(lambda: _runs_after("telemetry", killed), 60, "a telemetry run after the kill")
        first = _runs_after("telemetry", killed)[0]
        assert not first.ok and "unreachable" in first.error.lower(), first.error
        assert _health("telemetry").healthy is False  # type: ignore[union-attr]
    finally:
        sources.prometheus.restart()
    wait_for(lambda: _healthy("telemetry"), 60, f"telemetry healthy again\n{worker.output()}")

    # Two outages, and not one node was read as failed or blamed.
    assert _settled() == before
    assert not Incident.objects.filter(cluster__name="lab").exists()


# Last: the XID it injects stays in the exporter's gauge for the rest of the module.
def test_real_sources_fill_the_fleet_and_an_xid_opens_an_incident(
        sources: Sources, worker: Worker, settings: Any) -> None:
    wait_for(lambda: _healthy("slurm", "kubernetes", "telemetry"), 90,
             f"all three sources healthy\n{worker.output()}")
    wait_for(lambda: Gpu.objects.filter(node__cluster__name="lab").count() == 32, 30,
             "32 GPUs from Prometheus")
    nodes = {n.name: n for n in Node.objects.filter(cluster__name="lab")}
    assert sorted(nodes) == NODES
    for name in NODES:
        n = nodes[name]
        assert n.slurm_state == "IDLE" and n.in_service, (name, n.slurm_state)
        assert n.leaf_switch == ("leaf-a" if name in LEAVES["leaf-a"] else "leaf-b")
        assert n.k8s_ready is True and n.pool == "gpu" and n.health == "healthy"

    # XID 79 on gpu-003 GPU 5, the way it reaches FleetWatch in production: the exporter's
    # gauge, a Prometheus scrape, a PromQL query, the collector, diagnosis.
    with sources.fleet.transaction() as state:
        sim.inject_xid(state, "gpu-003", 5, 79, time.time())
    incident = wait_for(lambda: Incident.objects.filter(cluster__name="lab").first(), 60,
                        f"an incident from the XID\n{worker.output()}")
    assert (incident.root_cause, list(incident.nodes)) == ("gpu_hardware", ["gpu-003"])
    gpu = Gpu.objects.get(node__name="gpu-003", index=5)
    assert gpu.last_xid == 79 and gpu.health == "failed"
    assert Node.objects.get(name="gpu-003").health == "failed"
    # Observe mode: FleetWatch recorded what it would do and left Slurm alone.
    assert "IDLE" in sources.slurm.run("sinfo", "-h", "-n", "gpu-003", "-o", "%T").stdout.upper()

    # The incident page's chart reads Prometheus range queries (no samples are stored).
    settings.FLEETWATCH_FLEET, settings.FLEETWATCH_STORE_GPU_SAMPLES = "real", False
    settings.FLEETWATCH_PROMETHEUS_URL = sources.prometheus.url
    settings.FLEETWATCH_SLURM_CONF = sources.slurm.env["SLURM_CONF"]
    settings.FLEETWATCH_SLURM_BIN_DIR = sources.slurm.bin_dir or ""
    settings.FLEETWATCH_KUBECONFIG = str(sources.k8s.kubeconfig_path)
    chart = selectors.incident_chart(incident)
    assert "error" not in chart and "gpu-003" in chart["series"]
    assert len(chart["series"]["gpu-003"]["y"]) >= 2
