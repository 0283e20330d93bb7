"""Two clusters in one FleetWatch run: a real Celery worker and beat with FLEETWATCH_CLUSTERS
naming "lab", on real sources (a real Slurm cluster through its CLI, the Kubernetes test
server, a real Prometheus scraping the simulated dcgm-exporter), and "demo", a simulated fleet
whose nodes carry the same names. An XID 79 on each cluster's gpu-003: each opens its own
incident, and each repair acts through its own cluster's sources only (lab's gpu-003 drained
in the real Slurm and cordoned in the Kubernetes test server under lab's incident; demo's
replaced from demo's spare pool), while the other cluster's gpu-003 is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from collectors.models import Node, SourceHealth
from collectors.sim import fleet as sim
from collectors.sim.fleet import SimFleet
from incidents.models import Incident
from tests.conftest import ROOT, Worker, stop_process_group, wait_for
from tests.harness.slurm_cluster import scontrol_fields
from tests.integration.test_real_sources import NODES, Sources, sources  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

SOURCES = ("slurm", "kubernetes", "telemetry")


@pytest.fixture
def two_clusters(sources: Sources, transactional_db: None,  # noqa: F811 (the fixture)
                 tmp_path: Path) -> Iterator[tuple[Worker, SimFleet]]:
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if connection.vendor != "postgresql" or not broker.startswith("redis://"):
        pytest.fail("integration tests need PostgreSQL and Redis: run them with `make test`")
    import redis

    redis.Redis.from_url(broker).flushdb()
    demo = SimFleet(tmp_path / "demo-fleet.json", 40.0)
    demo.seed()
    clusters = {
        # Each cluster's own sources; nothing about either in the environment itself.
        "lab": {"FLEETWATCH_FLEET": "real",
                "FLEETWATCH_SLURM_CONF": sources.slurm.env["SLURM_CONF"],
                "FLEETWATCH_SLURM_BIN_DIR": sources.slurm.bin_dir or "",
                "FLEETWATCH_SLURM_TIMEOUT": 8,
                "FLEETWATCH_KUBECONFIG": str(sources.k8s.kubeconfig_path),
                "FLEETWATCH_PROMETHEUS_URL": sources.prometheus.url,
                "FLEETWATCH_PROVIDER": "none"},
        "demo": {"FLEETWATCH_FLEET": "sim", "FLEETWATCH_SIM_STATE": str(demo.path),
                 "FLEETWATCH_SIM_SPEED": 40},
    }
    db = connection.settings_dict
    env = {
        **{k: v for k, v in os.environ.items()
           if not k.startswith(("FLEETWATCH_SIM", "FLEETWATCH_SLURM", "FLEETWATCH_KUBE",
                                "FLEETWATCH_PROMETHEUS"))},
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "CELERY_BROKER_URL": broker,
        "FLEETWATCH_DATA_DIR": str(tmp_path / "data"),
        "FLEETWATCH_FLEET": "real",
        "FLEETWATCH_CLUSTERS": json.dumps(clusters),
        "FLEETWATCH_CLUSTER": "lab",
        "FLEETWATCH_COLLECT_INTERVAL": "2",
        "FLEETWATCH_STEP_POLL_SECONDS": "0.3",
        "FLEETWATCH_POLICY_MODE": "auto",
    }
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "fleetwatch", "worker", "-B",
             "-Q", "collect,diagnose,remediate,default", "--concurrency", "4",
             "--loglevel", "INFO", "-s", str(tmp_path / "beat-schedule")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield Worker(proc, log), demo
    finally:
        stop_process_group(proc)


def _healthy(cluster: str) -> bool:
    rows = dict(SourceHealth.objects.filter(cluster__name=cluster)
                .values_list("name", "healthy"))
    return all(rows.get(source) for source in SOURCES)


def _incident(cluster: str) -> Incident | None:
    return Incident.objects.filter(cluster__name=cluster, nodes__icontains='"gpu-003"').first()


def test_two_clusters_each_collected_diagnosed_and_repaired_through_its_own_sources(
        sources: Sources,  # noqa: F811 (the fixture)
        two_clusters: tuple[Worker, SimFleet]) -> None:
    worker, demo = two_clusters
    wait_for(lambda: _healthy("lab") and _healthy("demo"), 120,
             f"every source of both clusters healthy\n{worker.output()}")
    wait_for(lambda: Node.objects.filter(cluster__name="lab").count() == len(NODES)
             and Node.objects.filter(cluster__name="demo").count() == 16, 30, "both fleets")
    lab_nodes = sorted(Node.objects.filter(cluster__name="lab").values_list("name", flat=True))
    assert lab_nodes == NODES  # the real Slurm's four, not the simulation's sixteen

    # XID 79 on gpu-003 of each: lab's through the exporter, Prometheus and a PromQL query;
    # demo's in the simulated fleet.
    with sources.fleet.transaction() as state:
        sim.inject_xid(state, "gpu-003", 5, 79, time.time())
    with demo.transaction() as state:
        sim.inject_xid(state, "gpu-003", 1, 79, demo.clock.now())

    lab = wait_for(lambda: _incident("lab"), 90, f"lab's incident\n{worker.output()}")
    assert lab.root_cause == "gpu_hardware" and list(lab.nodes) == ["gpu-003"]
    # Demo's repair runs to the end on demo's own spare pool.
    wait_for(lambda: (i := _incident("demo")) is not None and i.status == "resolved", 180,
             f"demo's incident resolved\n{worker.output()}")
    demo_incident = _incident("demo")
    assert demo_incident is not None and demo_incident.pk != lab.pk

    # Lab's repair acted on lab's real Slurm, under lab's incident: gpu-003 drained.
    reason = f"fleetwatch: incident {lab.pk} gpu_hardware"

    def drained() -> dict[str, str] | None:
        node = scontrol_fields(sources.slurm.run("scontrol", "show", "node", "gpu-003",
                                                 check=True).stdout)
        return node if "DRAIN" in node.get("State", "") else None

    node = wait_for(drained, 90, f"gpu-003 drained in lab's Slurm\n{worker.output()}")
    assert node["Reason"].startswith(reason), node
    for other in ("gpu-001", "gpu-002", "gpu-004"):
        shown = scontrol_fields(sources.slurm.run("scontrol", "show", "node", other,
                                                  check=True).stdout)
        assert "DRAIN" not in shown["State"], (other, shown)
    # ... and cordoned it in lab's Kubernetes (the test server's request log).
    wait_for(lambda: ("PATCH", "/api/v1/nodes/gpu-003") in
             [(m, p.split("?")[0]) for m, p, _ in list(sources.k8s.requests)], 60,
             f"gpu-003 cordoned in lab's Kubernetes\n{worker.output()}")
    patched = {p.split("?")[0] for m, p, _ in list(sources.k8s.requests) if m == "PATCH"}
    assert patched == {"/api/v1/nodes/gpu-003"}, patched

    # Demo's gpu-003 went to RMA from demo's fleet, drained under demo's incident; lab's
    # repair never touched demo's fleet.
    nodes = demo.snapshot()["nodes"]
    assert nodes["gpu-003"]["pool"] == "rma"
    assert nodes["gpu-003"]["reason"] == f"fleetwatch: incident {demo_incident.pk} gpu_hardware"
    touched = {name for name, n in nodes.items() if n["drained"] or n["annotations"]}
    assert touched == {"gpu-003"}, touched
