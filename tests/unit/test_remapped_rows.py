"""DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS (in dcgm-exporter's stock counters, unlike the
row-remap failure flag): a rise is an uncorrectable GPU memory fault, diagnosed as one; the
first reading is a baseline; a collector poll turns a rise into one signal."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from collectors import services as collectors
from collectors.clients import Clients, get_clients
from collectors.clients.base import GpuMetric, TelemetryChanges
from collectors.knowledge import dcgm
from collectors.models import CollectorRun, Signal
from collectors.normalize import SignalDraft, remapped_rows_change
from collectors.sim.fleet import SimFleet, SimTelemetry
from incidents.diagnosis import Observation, diagnose

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


def _gpu(rows: float | None) -> GpuMetric:
    return GpuMetric("gpu-004", 2, "GPU-x", 97.0, 60.0, 0, uncorrectable_remapped_rows=rows)


def _observation(draft: SignalDraft, seconds: float, ident: int) -> Observation:
    return Observation.from_record({"source": draft.source, "node": draft.node,
                                    "gpu": draft.gpu, **draft.data},
                                   T0 + timedelta(seconds=seconds), id=ident)


def test_a_rise_is_a_memory_fault_and_the_first_reading_a_baseline() -> None:
    baseline = remapped_rows_change(None, _gpu(2))
    assert baseline is not None and "previous" not in baseline.data
    assert remapped_rows_change(2, _gpu(2)) is None
    assert remapped_rows_change(0, _gpu(None)) is None
    rise = remapped_rows_change(2, _gpu(3))
    assert rise is not None and rise.kind == "dcgm_field"
    assert rise.data == {"metric": dcgm.UNCORRECTABLE_REMAPPED_ROWS, "value": 3, "previous": 2}
    # Diagnosis: the baseline alone is nothing; the rise is the GPU's memory.
    assert diagnose([_observation(baseline, 0, 1)]) == []
    [d] = diagnose([_observation(baseline, 0, 1), _observation(rise, 30, 2)])
    assert (d.root_cause, d.nodes) == ("gpu_memory", ("gpu-004",))
    assert 2 in d.evidence


class Rows(SimTelemetry):
    """The simulated telemetry with a count of remapped rows on some GPUs (what the
    Prometheus client's ``> 0`` query brings: only the GPUs above 0)."""

    rows: dict[tuple[str, int], float] = {}

    def gpu_metrics(self, nodes: Sequence[str] | None = None) -> list[GpuMetric]:
        return [replace(m, uncorrectable_remapped_rows=self.rows.get((m.node, m.gpu)))
                for m in super().gpu_metrics(nodes)]

    def changes(self, cursor: Mapping[str, Any] | None,
                watch: Iterable[str] = ()) -> TelemetryChanges | None:
        return None


@pytest.mark.django_db
def test_a_poll_signals_a_rise_once_and_a_count_found_at_first_sight_is_a_baseline(
        sim_fleet: SimFleet) -> None:
    base = get_clients()
    telemetry = Rows(sim_fleet)
    clients = Clients(base.slurm, base.kubernetes, telemetry, base.provider, base.notifier)
    # Rows remapped long before FleetWatch first saw the GPU: a baseline, no fault.
    telemetry.rows = {("gpu-001", 0): 4.0}
    assert collectors.collect_source("telemetry", clients=clients).healthy

    def recorded() -> list[tuple[str, int | None, Any]]:
        return list(Signal.objects.filter(kind="dcgm_field").order_by("id").values_list(
            "node_name", "gpu_index", "data"))

    assert recorded() == [("gpu-001", 0, {"metric": dcgm.UNCORRECTABLE_REMAPPED_ROWS,
                                          "value": 4.0})]
    collectors.collect_source("telemetry", clients=clients)
    assert len(recorded()) == 1  # unchanged: nothing new
    # A known GPU at 0 (left out of the answer) gets its first remapped row; another rises.
    telemetry.rows = {("gpu-001", 0): 5.0, ("gpu-006", 3): 1.0}
    collectors.collect_source("telemetry", clients=clients)
    new = recorded()[1:]
    assert sorted((n, g, d["value"], d["previous"]) for n, g, d in new) == [
        ("gpu-001", 0, 5.0, 4.0), ("gpu-006", 3, 1.0, 0.0)]
    collectors.collect_source("telemetry", clients=clients)
    assert len(recorded()) == 3


@pytest.mark.django_db
def test_counts_found_on_the_first_poll_after_an_upgrade_are_baselines(
        sim_fleet: SimFleet) -> None:
    base = get_clients()
    telemetry = Rows(sim_fleet)
    clients = Clients(base.slurm, base.kubernetes, telemetry, base.provider, base.notifier)
    telemetry.rows = {}
    collectors.collect_source("telemetry", clients=clients)
    # Those runs were a FleetWatch that did not read the field: its GPUs are known, and one
    # had rows remapped long ago.
    CollectorRun.objects.all().delete()
    telemetry.rows = {("gpu-002", 1): 3.0}
    collectors.collect_source("telemetry", clients=clients)
    [(node, gpu, data)] = Signal.objects.filter(kind="dcgm_field").values_list(
        "node_name", "gpu_index", "data")
    assert (node, gpu, data) == ("gpu-002", 1, {"metric": dcgm.UNCORRECTABLE_REMAPPED_ROWS,
                                                "value": 3.0})
    assert not collectors.collect_source("telemetry", clients=clients).signal_ids
