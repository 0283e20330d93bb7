"""An incremental telemetry poll sends its independent queries together (a few requests in
flight at once) and reads their answers in its own order; a query that fails fails the poll.

Prometheus's answers are given here as it returns them (the query API's JSON), each after a
delay as over a network; the real Prometheus is in tests/integration/test_prometheus.py."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import requests

from collectors.clients import prometheus
from collectors.clients.base import ClientError
from collectors.clients.prometheus import PrometheusTelemetry

NOW = 1_000_000.0
URL = "http://prom.test:9090"


class Network(PrometheusTelemetry):
    """Instant answers after a delay, recording who asked what; ``fail``: an expression
    whose request fails as an unreachable Prometheus's does."""

    def __init__(self, fail: str = "") -> None:
        super().__init__(URL)
        self.fail = fail
        self.asked: list[tuple[str, str]] = []  # (expression, asking thread's name)
        self._lock = threading.Lock()

    def _instant_answer(self, expr: str, at: float | None) -> bytes:
        with self._lock:
            self.asked.append((expr, threading.current_thread().name))
        time.sleep(0.02)
        if expr == self.fail:
            raise requests.exceptions.ConnectionError("connection refused")
        if expr == "vector(time())":
            result = [{"metric": {}, "value": [NOW, str(NOW)]}]
        elif "(DCGM_FI_DEV_XID_ERRORS) != 0" in expr:
            result = [{"metric": {"Hostname": "gpu-003", "gpu": "5"}, "value": [NOW, "79"]}]
        else:
            result = []
        return json.dumps({"status": "success",
                           "data": {"resultType": "vector", "result": result}}).encode()


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    prometheus._FIELD_CHECKS.clear()


def cursor() -> dict[str, object]:
    return {"at": NOW - 60, "source": URL}


def test_an_incremental_poll_sends_its_queries_together_and_reads_each_once() -> None:
    client = Network()
    read = client.changes(cursor())
    assert not read.complete_gpus  # the incremental read, not a full one
    assert [(m.node, m.gpu, m.last_xid) for m in read.gpus] == [("gpu-003", 5, 79)]
    ahead = [expr for expr, thread in client.asked if thread.startswith("prometheus-query")]
    # Every GPU field, the new identities, the dropped nodes and the ports: fetched ahead.
    assert len(ahead) == len(prometheus.GPU_QUERIES) + 3
    # Each answer fetched ahead was the one read: nothing asked twice.
    assert [e for e, n in Counter(e for e, _ in client.asked).items() if n > 1] == []
    assert client._ahead == {}


def test_a_poll_long_after_the_last_reads_every_port_its_queries_sent_together_too() -> None:
    client = Network()
    read = client.changes({"at": NOW - 400, "source": URL})  # past the ports' change window
    assert read.complete_ports and not read.complete_gpus
    ahead = [expr for expr, thread in client.asked if thread.startswith("prometheus-query")]
    assert len(ahead) == len(prometheus.GPU_QUERIES) + 2 + len(prometheus.NIC_QUERIES)
    assert [e for e, n in Counter(e for e, _ in client.asked).items() if n > 1] == []


def test_a_query_that_fails_fails_the_poll_and_the_next_poll_reads_afresh() -> None:
    plan = Network()._gpu_plan(NOW - 60, NOW - prometheus.SCRAPE_LAG)
    client = Network(fail=plan[2][1])
    with pytest.raises(ClientError, match="unreachable"):
        client.changes(cursor())
    # The same client, the query answering again: nothing of the failed poll is read back.
    client.fail = ""
    before = len(client.asked)
    read = client.changes(cursor())
    assert [(m.node, m.gpu, m.last_xid) for m in read.gpus] == [("gpu-003", 5, 79)]
    again = Counter(e for e, _ in client.asked[before:])
    assert again[plan[2][1]] == 1 and max(again.values()) == 1
