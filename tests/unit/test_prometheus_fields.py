"""The Prometheus client's checks of what the exporters export: the relied-on DCGM fields an
exporter leaves out (named in the run's warnings, the source stays usable) and series whose
only node is an ``IP:port`` instance (counted and warned about, never a phantom node).

Prometheus's answers are given here as it returns them (the query API's JSON); the real
Prometheus is in tests/integration/test_prometheus.py."""

from __future__ import annotations

from typing import Any

import pytest

from collectors.clients import prometheus
from collectors.clients.prometheus import PrometheusTelemetry, _Warnings
from collectors.knowledge import dcgm


class Answers(PrometheusTelemetry):
    """A client whose instant queries are answered from a table, counting the questions."""

    def __init__(self, names: list[str], url: str = "http://prom.test:9090") -> None:
        super().__init__(url)
        self.names = names
        self.asked: list[str] = []

    def _query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        self.asked.append(expr)
        if expr.startswith("count by (__name__)"):
            return [{"metric": {"__name__": n}, "value": [1.0, "8"]} for n in self.names]
        return []


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    prometheus._FIELD_CHECKS.clear()


def test_each_missing_relied_on_field_is_a_warning_and_the_read_goes_on() -> None:
    client = Answers(list(dcgm.EXPORTER_DEFAULT_FIELDS))
    assert client.gpu_metrics() == []  # read as usual (this table has no samples)
    warnings = client.last_warnings
    assert ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL not exported: double-bit ECC faults will not be "
            "seen") in warnings
    assert any(w.startswith("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL not exported")
               for w in warnings)
    assert any(w.startswith("DCGM_FI_DEV_CLOCKS_EVENT_REASONS not exported") for w in warnings)
    assert not any(w.startswith("DCGM_FI_DEV_XID_ERRORS") for w in warnings)
    assert not any(w.startswith("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS") for w in warnings)


def test_every_field_exported_no_warning() -> None:
    client = Answers([*dcgm.RELIED_ON, dcgm.SM_CLOCK])
    client.gpu_metrics()
    assert client.last_warnings == []


def test_the_old_clock_field_name_serves() -> None:
    names = [n for n in dcgm.RELIED_ON if n != dcgm.CLOCKS_EVENT_REASONS]
    client = Answers([*names, dcgm.CLOCK_THROTTLE_REASONS])
    client.gpu_metrics()
    assert client.last_warnings == []


def test_no_dcgm_series_at_all_is_not_a_missing_field() -> None:
    client = Answers([])
    client.gpu_metrics()
    assert client.last_warnings == []


def test_the_check_is_one_query_and_asked_at_most_every_few_minutes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(prometheus.time, "monotonic", lambda: clock[0])
    first = Answers(list(dcgm.EXPORTER_DEFAULT_FIELDS))
    first.changes(None)
    checks = [e for e in first.asked if e.startswith("count by (__name__)")]
    assert checks == ['count by (__name__) ({__name__=~"DCGM_FI_.+"})']
    # The next run's client (one per run) reuses the answer, warnings included.
    clock[0] += prometheus.FIELD_CHECK_INTERVAL - 1
    second = Answers(list(dcgm.RELIED_ON))
    second.changes(None)
    assert not [e for e in second.asked if e.startswith("count by")]
    assert second.last_warnings == first.last_warnings != []
    clock[0] += 2
    third = Answers(list(dcgm.RELIED_ON))
    third.changes(None)
    assert [e for e in third.asked if e.startswith("count by")] and third.last_warnings == []


def test_the_check_honours_the_matchers() -> None:
    client = PrometheusTelemetry("http://prom.test", matchers='cluster="a"')
    assert client._exported_fields_expr() == (
        'count by (__name__) ({__name__=~"DCGM_FI_.+", cluster="a"})')


def test_an_ip_instance_is_counted_and_warned_about_not_made_a_node() -> None:
    client = PrometheusTelemetry("http://127.0.0.1:1")
    series = [
        {"metric": {"instance": "10.0.0.7:9100", "device": "mlx5_0", "port": "1"},
         "value": [1.0, "4"]},
        {"metric": {"instance": "[fd00::7]:9100", "device": "mlx5_0", "port": "1"},
         "value": [1.0, "4"]},
        # A relabelled series: its Hostname names the node whatever the instance.
        {"metric": {"Hostname": "gpu-007", "instance": "10.0.0.7:9100", "device": "mlx5_0",
                    "port": "1"}, "value": [1.0, "4"]},
        {"metric": {"instance": "gpu-008:9100", "device": "mlx5_0", "port": "1"},
         "value": [1.0, "4"]},
    ]
    warnings = _Warnings()
    read = list(client._samples("Q", series, warnings, ("device", "port")))
    assert [node for node, _, _ in read] == ["gpu-007", "gpu-008"]
    text = warnings.finish()
    assert len(text) == 1 and text[0].startswith("2 series skipped: their instance label is "
                                                  "an IP address")
    assert "relabel-node-name.yaml" in text[0]
