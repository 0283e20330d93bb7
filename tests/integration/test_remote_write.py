"""The telemetry doorbell end to end: a real Prometheus scrapes the simulated dcgm-exporter and
remote-writes the fault fields (deploy/prometheus/remote-write-fleetwatch.yaml's relabelling)
to a live FleetWatch; a real Celery worker runs with no beat at all, so nothing polls. An XID
reaches an incident only through the doorbell: the write rings, the worker collects through
PromQL and diagnoses. The gauge staying at 79 rings no more; a second fault rings again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.cache import cache
from django.db import connection

from collectors.models import CollectorRun
from collectors.sim import fleet as sim
from collectors.sim.exporter import SimExporter
from collectors.sim.fleet import SimFleet
from incidents.models import Incident
from tests.conftest import ROOT, Worker, stop_process_group, token_for, wait_for
from tests.harness.prometheus import PrometheusServer, ScrapeTarget

pytestmark = pytest.mark.integration


def _runs() -> int:
    return CollectorRun.objects.filter(cluster__name="lab", source="telemetry").count()


@pytest.fixture
def stack(live_server: Any, transactional_db: None, settings: Any, operator: Any,
          tmp_path: Path) -> Iterator[tuple[SimFleet, Worker, PrometheusServer]]:
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if connection.vendor != "postgresql" or not broker.startswith("redis://"):
        pytest.fail("integration tests need PostgreSQL and Redis: run them with `make test`")
    import redis

    redis.Redis.from_url(broker).flushdb()
    cache.clear()  # fault values other tests' clusters (the same ids) left remembered
    fleet = SimFleet(tmp_path / "sim-fleet.json", 1.0)
    fleet.seed(nodes=4, spares=0)
    exporter = SimExporter(fleet.path, 1.0)
    address = f"127.0.0.1:{exporter.start()}"
    # The example's remote_write, pointed at this FleetWatch with an ingest token.
    example = yaml.safe_load((ROOT / "deploy/prometheus/remote-write-fleetwatch.yaml")
                             .read_text())["remote_write"][0]
    token = token_for(operator, ("ingest",), name="prometheus")
    (tmp_path / "token").write_text(token)
    example["url"] = f"{live_server.url}/api/v1/prometheus/write/?cluster=lab"
    example["authorization"]["credentials_file"] = str(tmp_path / "token")
    prometheus = PrometheusServer(tmp_path / "prometheus", [ScrapeTarget(address, job="dcgm")],
                                  "1s", extra={"remote_write": [example]})
    # This process serves the writes (live_server): it must see the cluster as the worker does.
    settings.FLEETWATCH_FLEET, settings.FLEETWATCH_CLUSTER = "real", "lab"
    settings.FLEETWATCH_SOURCES = ["telemetry"]
    settings.FLEETWATCH_PROMETHEUS_URL = prometheus.url
    settings.FLEETWATCH_STORE_GPU_SAMPLES, settings.FLEETWATCH_PROVIDER = False, "none"
    db = connection.settings_dict
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FLEETWATCH_SIM")},
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "CELERY_BROKER_URL": broker,
        "FLEETWATCH_DATA_DIR": str(tmp_path / "data"),
        "FLEETWATCH_FLEET": "real", "FLEETWATCH_CLUSTER": "lab",
        "FLEETWATCH_SOURCES": "telemetry", "FLEETWATCH_PROMETHEUS_URL": prometheus.url,
        "FLEETWATCH_POLICY_MODE": "observe",
    }
    log = tmp_path / "worker.log"
    try:
        prometheus.start()
        with open(log, "wb") as out:
            # No -B: no beat, so no poll; only the doorbell queues collections.
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "fleetwatch", "worker",
                 "-Q", "collect,diagnose,remediate,default", "--concurrency", "2",
                 "--loglevel", "INFO"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        worker = Worker(proc, log)
        try:
            yield fleet, worker, prometheus
        finally:
            stop_process_group(proc)
    finally:
        prometheus.stop()
        exporter.stop()


def test_a_scraped_fault_is_collected_at_once_with_no_poll(
        stack: tuple[SimFleet, Worker, PrometheusServer]) -> None:
    fleet, worker, prometheus = stack
    time.sleep(3)  # a few scrapes and writes of a quiet fleet
    assert _runs() == 0  # nothing rang, nothing polled

    with fleet.transaction() as state:
        sim.inject_xid(state, "gpu-003", 5, 79, time.time())
    incident = wait_for(lambda: Incident.objects.filter(cluster__name="lab").first(), 30,
                        f"an incident through the doorbell\n{worker.output()}\n"
                        f"{prometheus.log_tail()}")
    assert (incident.root_cause, list(incident.nodes)) == ("gpu_hardware", ["gpu-003"])
    assert _runs() == 1

    # The exporter keeps printing 79, and Prometheus keeps writing it: no more rings.
    time.sleep(4)
    assert _runs() == 1, worker.output()

    # Another GPU's fault rings again.
    with fleet.transaction() as state:
        sim.inject_xid(state, "gpu-001", 2, 48, time.time())
    second = wait_for(lambda: Incident.objects.filter(cluster__name="lab",
                                                      nodes__icontains='"gpu-001"').first(),
                      30, f"the second fault's incident\n{worker.output()}")
    assert second.root_cause in ("gpu_hardware", "gpu_memory")
    assert _runs() == 2
