"""The telemetry doorbell (Prometheus remote write): the body decoded, fault samples told
from readings, a new fault value queues one telemetry collection, a value already seen or a
collection already waiting queues nothing, and bad input gets a clear answer. (A real
Prometheus sending to a live FleetWatch: tests/integration/test_remote_write.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.cache import cache
from rest_framework.test import APIClient

from collectors import queueing
from collectors import services as collectors
from collectors.clients import remote_write
from collectors.clients.prometheus import FAULT_QUERIES, fault_sample
from collectors.clients.remote_write import Series
from tests.conftest import token_for

ROOT = Path(__file__).resolve().parents[2]
XID = "DCGM_FI_DEV_XID_ERRORS"


def series(name: str, value: float, node: str = "gpu-003", gpu: str = "5",
           at: int = 1_700_000_000_000) -> Series:
    return Series({"__name__": name, "Hostname": node, "gpu": gpu, "job": "dcgm"},
                  [(at - 5000, 0.0), (at, value)])


def test_a_body_decodes_as_prometheus_sent_it() -> None:
    sent = [series(XID, 79.0), series("DCGM_FI_DEV_GPU_TEMP", 61.5, gpu="0")]
    got = remote_write.decode(remote_write.encode(sent))
    assert got == sent and got[0].name == XID


@pytest.mark.parametrize("body", [b"", b"not snappy at all", b"\xff" * 64,
                                  # snappy of bytes that are no WriteRequest
                                  b"\x05\x10\xff\xff\xff\xff"])
def test_what_is_not_a_remote_write_is_refused(body: bytes) -> None:
    with pytest.raises(remote_write.RemoteWriteError):
        remote_write.decode(body)


def test_only_fault_values_a_poll_would_read_ring() -> None:
    labels = {"__name__": XID, "Hostname": "gpu-003", "gpu": "5"}
    assert fault_sample(labels, 79.0) == ("gpu-003", "5", XID)
    assert fault_sample(labels, 0.0) is None  # no XID
    assert fault_sample({**labels, "__name__": "DCGM_FI_DEV_GPU_TEMP"}, 99.0) is None
    # The clock-event bits below the first slowdown bit are idle clocks and power caps.
    clocks = {**labels, "__name__": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"}
    assert fault_sample(clocks, 1.0) is None and fault_sample(clocks, 8.0) is not None
    # No Hostname label: the node from the instance, as the collector reads it.
    assert fault_sample({"__name__": XID, "instance": "gpu-007:9400", "gpu": "1"}, 48.0) == (
        "gpu-007", "1", XID)
    assert fault_sample({"__name__": XID, "gpu": "1"}, 48.0) is None  # no node at all


def test_the_example_config_sends_exactly_the_fault_fields() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/remote-write-fleetwatch.yaml").read_text())
    [rule] = config["remote_write"][0]["write_relabel_configs"]
    assert set(rule["regex"].split("|")) == set(FAULT_QUERIES)
    assert re.fullmatch(rule["regex"], XID)


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    cache.clear()
    sent: list[tuple[Any, ...]] = []
    monkeypatch.setattr(queueing, "enqueue",
                        lambda task, *args, **kw: sent.append((task, *args)))
    return sent


def rings(queued: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [q for q in queued if q[0] == queueing.COLLECT_SOURCE]


def test_a_new_fault_rings_once(db: None, sim_fleet: Any, queued: list[tuple[Any, ...]]) -> None:
    cluster = collectors.cluster_default()
    ring = [series(XID, 79.0)]
    assert collectors.telemetry_doorbell(cluster, ring) is True
    assert queued == [(queueing.COLLECT_SOURCE, "telemetry", cluster.name, True)]
    # The next scrapes carry the same gauge: nothing more.
    assert collectors.telemetry_doorbell(cluster, ring) is False
    # Another fault while the first ring's collection still waits: it will read both.
    assert collectors.telemetry_doorbell(cluster, [series(XID, 48.0, node="gpu-009")]) is False
    assert len(rings(queued)) == 1
    # Once that collection has started, a new fault rings again.
    collectors.collect_source("telemetry")
    assert collectors.telemetry_doorbell(cluster, [series(XID, 31.0, node="gpu-010")]) is True
    # Readings and quiet fault fields never ring.
    collectors.collect_source("telemetry")
    assert collectors.telemetry_doorbell(cluster, [
        series("DCGM_FI_DEV_GPU_UTIL", 100.0), series(XID, 0.0, node="gpu-011")]) is False
    assert len(rings(queued)) == 2


def test_a_ring_whose_message_was_lost_is_asked_again(db: None, sim_fleet: Any,
                                                       queued: list[tuple[Any, ...]]) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from collectors.models import CollectionWanted

    cluster = collectors.cluster_default()
    assert collectors.telemetry_doorbell(cluster, [series(XID, 79.0)]) is True
    # The message never reached a worker: the ask stays, and holds new rings back ...
    assert collectors.telemetry_doorbell(cluster, [series(XID, 48.0, node="gpu-009")]) is False
    # ... until it is older than the doorbell's patience.
    CollectionWanted.objects.update(
        asked_at=timezone.now() - timedelta(seconds=collectors.DOORBELL_PENDING_SECONDS + 1))
    assert collectors.telemetry_doorbell(cluster, [series(XID, 31.0, node="gpu-010")]) is True
    assert len(rings(queued)) == 2


def test_a_cluster_without_telemetry_never_rings(db: None, settings: Any,
                                                 queued: list[tuple[Any, ...]]) -> None:
    settings.FLEETWATCH_SOURCES = ["slurm", "kubernetes"]
    assert collectors.telemetry_doorbell(collectors.cluster_default(),
                                         [series(XID, 79.0)]) is False
    assert queued == []


def test_the_endpoint(db: None, operator: Any, viewer: Any,
                      queued: list[tuple[Any, ...]]) -> None:
    api = APIClient()
    url = "/api/v1/prometheus/write/"
    body = remote_write.encode([series(XID, 79.0)])
    post = {"content_type": "application/x-protobuf", "HTTP_CONTENT_ENCODING": "snappy"}
    assert api.post(url, body, **post).status_code == 401  # no token
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(viewer, ('read',))}")
    assert api.post(url, body, **post).status_code == 403
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator, ('ingest',))}")
    answer = api.post(url, b"garbage", **post)
    assert answer.status_code == 400 and "snappy" in answer.json()["detail"]
    unknown = api.post(url + "?cluster=north", body, **post)
    assert unknown.status_code == 400 and "unknown cluster 'north'" in unknown.json()["detail"]
    assert queued == []
    assert api.post(url, body, **post).status_code == 204
    assert api.post(url, body, **post).status_code == 204  # the same write again
    assert len(queued) == 1
    # Accepted writes are intake, not actions: unaudited (they took the audit trail's lock
    # once per scrape); the refused ones are in the trail.
    from incidents.models import AuditEntry

    audited = AuditEntry.objects.filter(verb="api.call", target__contains="prometheus/write")
    assert sorted(audited.values_list("result", flat=True)) == ["400", "400", "403"]


def test_a_broker_away_is_a_503_and_the_retry_rings(db: None, operator: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from kombu.exceptions import OperationalError

    cache.clear()
    sent: list[str] = []

    def enqueue(task: str, *args: Any, **kw: Any) -> None:
        if not sent:
            sent.append("refused")
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379")
        sent.append(task)

    monkeypatch.setattr(queueing, "enqueue", enqueue)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator, ('ingest',))}")
    body = remote_write.encode([series(XID, 79.0)])
    post = {"content_type": "application/x-protobuf"}
    away = api.post("/api/v1/prometheus/write/", body, **post)
    assert away.status_code == 503 and "broker unreachable" in away.json()["detail"]
    # Prometheus retries a 5xx: that retry rings, it was not remembered as seen.
    assert api.post("/api/v1/prometheus/write/", body, **post).status_code == 204
    assert sent == ["refused", queueing.COLLECT_SOURCE]
