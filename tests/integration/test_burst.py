"""A burst of pushes does not starve detection (issue 23).

One program floods the push API with GPU telemetry from a few nodes, batch after batch, while
a node agent elsewhere reports an XID 79. The XID's incident opens while the flood is still
being absorbed, and the diagnose queue never holds more than one run for the cluster however
many batches arrive (each push used to queue a diagnosis of its own: 2,000 batches, 1,900
waiting, and a new XID had no incident after 650 s).

Real parts: a live HTTP server, a real Celery worker and beat on Redis, PostgreSQL."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import redis
import requests
from django.utils import timezone

from collectors.models import Signal
from collectors.roles import OPERATOR, user_with_role
from incidents.models import DiagnosisState, Incident
from incidents.tokens import agent_token_create
from tests.conftest import Worker, token_for, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

XID79 = "NVRM: Xid (PCI:0000:8a:00): 79, pid=2231, name=python, GPU has fallen off the bus."
FLOOD_NODES = ("gpu-001", "gpu-002", "gpu-003", "gpu-004")
BATCH = 25
MAX_BATCHES = 800  # the flood's bound: 20,000 records at most
XID_AFTER = 40     # batches pushed before the fault


class Flood(threading.Thread):
    """Push telemetry batches until told to stop (or MAX_BATCHES), sampling the queue."""

    def __init__(self, base: str, key: str, queue: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.base, self.key, self.queue = base, key, queue
        self.stop = threading.Event()
        self.batches = self.records = self.depth_max = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        session = requests.Session()
        session.headers["Authorization"] = f"Token {self.key}"
        try:
            while not self.stop.is_set() and self.batches < MAX_BATCHES:
                at = timezone.now().isoformat()
                node = FLOOD_NODES[self.batches % len(FLOOD_NODES)]
                batch = [{"at": at, "source": "dcgm", "node": node, "gpu": i % 8,
                          "metric": "DCGM_FI_DEV_GPU_UTIL", "value": (self.batches + i) % 100}
                         for i in range(BATCH)]
                answer = session.post(f"{self.base}/api/v1/signals/", json={"signals": batch},
                                      timeout=30)
                assert answer.status_code == 201, (answer.status_code, answer.text[:300])
                self.batches += 1
                self.records += BATCH
                # The broker's list for the diagnose queue: runs sent and not yet started.
                self.depth_max = max(self.depth_max, int(self.queue.llen("diagnose")))
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc


def test_an_xid_opens_its_incident_while_a_flood_of_pushes_is_absorbed(
        celery_worker_process: Worker, live_server: Any) -> None:
    base = live_server.url
    queue = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    ingester = token_for(user_with_role("bulk-loader", OPERATOR)[0], ("ingest",), name="loader")
    agent = requests.Session()
    agent.headers["Authorization"] = f"Token {agent_token_create('gpu-012')[1]}"
    flood = Flood(base, ingester, queue)
    try:
        wait_for(lambda: Signal.objects.filter(source="slurm").exists(), 60,
                 "the first collection of the simulated fleet")
        flood.start()
        wait_for(lambda: flood.batches >= XID_AFTER or flood.error, 120, "the flood to start")
        pushed = agent.post(f"{base}/api/v1/signals/", json={"signals": [
            {"at": timezone.now().isoformat(), "source": "kernel", "node": "gpu-012",
             "message": XID79}]}, timeout=30)
        assert pushed.status_code == 201, pushed.text
        at_fault = flood.batches

        def opened() -> Incident | None:
            assert flood.error is None, flood.error
            return Incident.objects.filter(nodes=["gpu-012"]).first()

        incident = wait_for(opened, 240, "the incident for gpu-012 during the flood")
        still_flooding = flood.is_alive() and flood.batches < MAX_BATCHES
        flood.stop.set()
        flood.join(60)
    except AssertionError:
        flood.stop.set()
        print(celery_worker_process.output())
        raise
    assert flood.error is None, flood.error
    assert incident.root_cause == "gpu_hardware"
    # Opened while the flood went on: batches kept arriving after the fault, and the flood
    # had not run out when the incident was there.
    assert still_flooding and flood.batches > at_fault, (at_fault, flood.batches)
    # Every batch was stored, and at no point did the queue hold more than one run.
    assert Signal.objects.filter(node_name__in=FLOOD_NODES, source="dcgm").count() == flood.records
    assert flood.depth_max <= 1, flood.depth_max

    # Everything pushed is diagnosed in the end: nothing left marked, nothing running.
    def drained() -> bool:
        s = DiagnosisState.objects.get()
        return s.pending_since is None and s.running_since is None
    wait_for(drained, 120, "the last diagnosis run")
    print(f"burst: {flood.batches} batches of {BATCH}, XID after {at_fault}, queue depth max "
          f"{flood.depth_max}, {DiagnosisState.objects.get().runs} diagnosis runs")
