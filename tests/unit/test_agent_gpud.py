"""The node agent's gpud reader: each new event of gpud's /v1/events once, as a ``gpud`` record
the diagnosis reads; gpud down is an outage of that source, never a fault of the node."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from collectors.agent.gpud import GpudSource
from incidents.diagnosis import Observation, diagnose

XID79 = ("XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS GPU has fallen off the bus detected "
         "on GPU PCI:0000:9b:00")
NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def _answer(*events: dict[str, Any]) -> list[dict[str, Any]]:
    """api/v1 GPUdComponentEvents, as gpud serves it."""
    return [{"component": "accelerator-nvidia-error-xid", "startTime": "2026-12-04T11:50:00Z",
             "endTime": "2026-12-04T12:00:00Z", "events": list(events)},
            {"component": "accelerator-nvidia-infiniband", "startTime": "2026-12-04T11:50:00Z",
             "endTime": "2026-12-04T12:00:00Z", "events": None}]


def test_each_event_is_sent_once_and_reaches_diagnosis() -> None:
    event = {"component": "accelerator-nvidia-error-xid", "time": "2026-12-04T11:58:00Z",
             "name": "error_xid", "type": "Fatal", "message": XID79}
    answers = [_answer(event), _answer(event), _answer(event, {**event, "time":
                                                                "2026-12-04T11:59:00Z"})]
    urls: list[str] = []

    def fetch(url: str) -> Any:
        urls.append(url)
        return answers.pop(0)

    source = GpudSource("gpu-001", "https://localhost:15132/", fetch=fetch, now=lambda: NOW)
    first = source.poll()
    assert first == [{"at": "2026-12-04T11:58:00.000Z", "source": "gpud", "node": "gpu-001",
                      "component": "accelerator-nvidia-error-xid", "name": "error_xid",
                      "type": "Fatal", "message": XID79}]
    assert source.poll() == []  # the same event again: not sent twice
    assert [r["at"] for r in source.poll()] == ["2026-12-04T11:59:00.000Z"]
    assert urls[0] == "https://localhost:15132/v1/events?startTime=2026-12-04T11:50:00Z"
    assert urls[1].endswith("startTime=2026-12-04T11:58:00Z")

    found = diagnose([Observation.from_record(first[0], NOW)])
    assert [(d.root_cause, d.nodes) for d in found] == [("gpu_hardware", ("gpu-001",))]


def test_gpud_down_or_answering_nonsense_is_no_record() -> None:
    def refused(url: str) -> Any:
        raise ConnectionRefusedError(111, "Connection refused")

    source = GpudSource("gpu-001", "https://localhost:15132", fetch=refused, now=lambda: NOW)
    assert source.poll() == [] and source.down
    source.fetch = lambda url: {"code": 404, "message": "component not found"}
    assert source.poll() == [] and source.down
    source.fetch = lambda url: _answer()
    assert source.poll() == [] and not source.down
