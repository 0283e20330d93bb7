"""A node's GPU readings (power, clocks, memory, ECC, remapped rows, NVLink, PCIe link, clock
events), as the simulated fleet reports them, as its exporter prints them, and as the node
page's rows read them. The Prometheus client's read is tested against a real Prometheus in
tests/integration/test_prometheus.py."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from collectors.clients.base import ClientError
from collectors.clock import ManualClock
from collectors.knowledge import dcgm
from collectors.selectors import GpuReadings, _not_exported
from collectors.sim import fleet as sim
from collectors.sim.exporter import SimExporter, counters_set
from collectors.sim.fleet import SimFleet, SimSlurm, SimTelemetry
from tests.unit.test_exposition import parse

FIELDS = dcgm.NODE_PAGE_FIELDS


@pytest.fixture
def fleet(tmp_path: Path) -> SimFleet:
    f = SimFleet(tmp_path / "fleet.json", 20, clock=ManualClock())
    f.seed()
    return f


def _busy_node(fleet: SimFleet) -> str:
    """A node whose job is making progress (every node runs one after seeding)."""
    running = [j for j in SimSlurm(fleet).jobs() if j.state == "RUNNING"]
    assert running, "the seeded fleet runs its jobs"
    return running[0].nodes[0]


def test_a_busy_h100_reports_boost_clocks_power_under_its_limit_and_a_gen5_x16_link(
        fleet: SimFleet) -> None:
    node = _busy_node(fleet)
    readings = SimTelemetry(fleet).gpu_readings([node], FIELDS)
    assert sorted(readings) == [(node, g) for g in range(8)]
    gpu = readings[(node, 0)]
    # Boost clocks, a little below the 1,980 MHz top from one scrape to the next.
    assert 1900 <= gpu[dcgm.SM_CLOCK] <= 1980 and gpu[dcgm.MEM_CLOCK] == 2619
    assert 500 < gpu[dcgm.POWER_USAGE] < gpu[dcgm.POWER_MGMT_LIMIT] == 700
    assert (gpu[dcgm.PCIE_LINK_GEN], gpu[dcgm.PCIE_LINK_WIDTH]) == (5, 16)
    assert (gpu[dcgm.PCIE_MAX_LINK_GEN], gpu[dcgm.PCIE_MAX_LINK_WIDTH]) == (5, 16)
    assert gpu[dcgm.FB_USED] > 60_000 and gpu[dcgm.FB_USED] + gpu[dcgm.FB_FREE] == 81_030
    assert gpu[dcgm.PROF_NVLINK_TX_BYTES] > 1e11 and gpu[dcgm.CLOCKS_EVENT_REASONS] == 0
    assert gpu[dcgm.ECC_DBE_VOL_TOTAL] == gpu[dcgm.PCIE_REPLAY_COUNTER] == 0
    # Only the fields asked for, and no field the simulated exporter does not print.
    assert dcgm.CLOCK_THROTTLE_REASONS not in gpu
    # The NVLink traffic's running total (what the fail-slow analysis reads as a rate).
    assert gpu[dcgm.NVLINK_BANDWIDTH_TOTAL] > 0
    assert SimTelemetry(fleet).gpu_readings([node], [dcgm.SM_CLOCK])[(node, 3)] == {
        dcgm.SM_CLOCK: readings[(node, 3)][dcgm.SM_CLOCK]}
    # A quiet fleet reads the same twice: the page does not flicker between reloads.
    assert SimTelemetry(fleet).gpu_readings([node], FIELDS) == readings


def test_an_idle_gpu_clocks_down_and_says_why(fleet: SimFleet) -> None:
    node = _busy_node(fleet)
    job = next(j for j in SimSlurm(fleet).jobs() if node in j.nodes)
    SimSlurm(fleet).cancel(job.job_id, "KILL", 0)
    cast(ManualClock, fleet.clock).advance(1)
    gpu = SimTelemetry(fleet).gpu_readings([node], FIELDS)[(node, 0)]
    assert gpu[dcgm.SM_CLOCK] == 345 and gpu[dcgm.POWER_USAGE] < 100
    assert gpu[dcgm.FB_USED] == 0 and gpu[dcgm.PROF_NVLINK_TX_BYTES] == 0
    assert dcgm.clock_event_reasons(int(gpu[dcgm.CLOCKS_EVENT_REASONS])) == ["gpu idle"]


def test_a_gpu_off_the_bus_spares_and_unknown_nodes_report_nothing(fleet: SimFleet) -> None:
    with fleet.transaction() as state:
        sim.inject_xid(state, "gpu-003", 5, 79, fleet.clock.now())
    readings = SimTelemetry(fleet).gpu_readings(["gpu-003", "gpu-019", "nope"], FIELDS)
    assert ("gpu-003", 5) not in readings  # not zeros: nothing at all
    assert sorted(g for n, g in readings) == [0, 1, 2, 3, 4, 6, 7]
    assert {n for n, _ in readings} == {"gpu-003"}  # gpu-019 is a spare, "nope" no node
    assert SimTelemetry(fleet).gpu_readings([], FIELDS) == {}


def test_a_telemetry_outage_is_an_error_not_an_empty_answer(fleet: SimFleet) -> None:
    with fleet.transaction() as state:
        sim.set_source_down(state, "telemetry", True)
    with pytest.raises(ClientError, match="telemetry unreachable"):
        SimTelemetry(fleet).gpu_readings(["gpu-001"], FIELDS)


def test_the_simulated_exporter_prints_the_readings_its_counters_export(
        fleet: SimFleet) -> None:
    node = _busy_node(fleet)
    truth = SimTelemetry(fleet).gpu_readings([node], FIELDS)[(node, 2)]
    families = parse(SimExporter(fleet.path, node=node).render())
    for name in (dcgm.SM_CLOCK, dcgm.PCIE_LINK_GEN, dcgm.PCIE_MAX_LINK_WIDTH, dcgm.FB_USED,
                 dcgm.POWER_MGMT_LIMIT, dcgm.PROF_NVLINK_RX_BYTES):
        [value] = [v for labels, v in families[name] if labels["gpu"] == "2"]
        assert float(value) == truth[name], name
    # The power it prints is the readings' own, so the page and Prometheus agree.
    [power] = [v for labels, v in families[dcgm.POWER_USAGE] if labels["gpu"] == "2"]
    assert float(power) == truth[dcgm.POWER_USAGE]
    # dcgm-exporter's stock counters have the clocks and framebuffer but not the PCIe link.
    stock = parse(SimExporter(fleet.path, node=node, counters=counters_set("default")).render())
    assert dcgm.SM_CLOCK in stock and dcgm.FB_FREE in stock
    assert dcgm.PCIE_LINK_GEN not in stock and dcgm.POWER_MGMT_LIMIT not in stock


def test_a_gpu_row_says_what_was_not_reported_instead_of_zero() -> None:
    row = GpuReadings(0, {dcgm.POWER_USAGE: 612.5, dcgm.PCIE_LINK_GEN: 3,
                          dcgm.PCIE_MAX_LINK_GEN: 5, dcgm.PCIE_LINK_WIDTH: 16,
                          dcgm.PCIE_MAX_LINK_WIDTH: 16, dcgm.CLOCK_THROTTLE_REASONS: 0x41,
                          dcgm.NVLINK_BANDWIDTH_TOTAL: 123456, dcgm.NVLINK_REPLAY_ERRORS: 2,
                          dcgm.ROW_REMAP_PENDING: 1, dcgm.ROW_REMAP_FAILURE: 0})
    assert row.reported and row.power == 612.5
    assert row.power_limit is None and row.sm_clock is None and row.ecc_dbe is None
    # Gen3 on a Gen5 link while the GPU says it idles: power saving, not a slow link.
    assert row.pcie_idle_gen and not row.pcie_below_max
    # The clock-event reasons under their pre-3.2 name, in words.
    assert row.clock_events == ["gpu idle", "hw thermal slowdown"]
    assert row.nvlink_counter == 123456 and row.nvlink_gbs == (None, None)
    assert row.nvlink_errors == row.nvlink_errors_seen == [("replay", 2)]
    quiet = GpuReadings(4, dict.fromkeys(dcgm.NVLINK_ERROR_COUNTERS, 0.0))
    assert len(quiet.nvlink_errors) == 4 and quiet.nvlink_errors_seen == []
    assert (row.remap_pending, row.remap_failure) == (True, False)
    assert not GpuReadings(1, {dcgm.PCIE_LINK_GEN: 5}).pcie_below_max  # no maximum: no verdict
    assert not GpuReadings(2, {}).reported and GpuReadings(2, {}).clock_events is None
    rates = GpuReadings(3, {dcgm.PROF_NVLINK_TX_BYTES: 1.2e11, dcgm.NVLINK_BANDWIDTH_TOTAL: 9})
    assert rates.nvlink_gbs == (120.0, None) and rates.nvlink_counter is None


def test_fields_no_gpu_reported_are_named_once_an_exporter_answers() -> None:
    stock = {name: 1.0 for name in dcgm.NODE_PAGE_FIELDS
             if name in dcgm.EXPORTER_DEFAULT_FIELDS}
    missing = _not_exported([GpuReadings(0, stock), GpuReadings(1, {})])
    assert dcgm.PCIE_LINK_GEN in missing and dcgm.CLOCKS_EVENT_REASONS in missing
    assert dcgm.SM_CLOCK not in missing and dcgm.CLOCK_THROTTLE_REASONS not in missing
    everything = {name: 1.0 for name in dcgm.NODE_PAGE_FIELDS
                  if name not in (dcgm.CLOCKS_EVENT_REASONS, dcgm.NVLINK_BANDWIDTH_TOTAL)}
    assert _not_exported([GpuReadings(0, everything)]) == []  # the old name and the rates do
    assert _not_exported([GpuReadings(0, {})]) == []  # a silent exporter, not a short one


def test_a_pcie_link_below_its_maximum_is_marked_unless_an_idle_gpu_saves_power() -> None:
    """An idle GPU steps its link down a generation (and back under load): not a fault. Fewer
    lanes, or a lower generation while it works, is a slow link nothing else reports."""
    link = {dcgm.PCIE_MAX_LINK_GEN: 5.0, dcgm.PCIE_MAX_LINK_WIDTH: 16.0}
    idle = {dcgm.CLOCKS_EVENT_REASONS: float(dcgm.GPU_IDLE)}
    busy = {dcgm.CLOCKS_EVENT_REASONS: 0.0}

    def gpu(gen: float, width: float, clocks: dict[str, float]) -> GpuReadings:
        return GpuReadings(0, {**link, dcgm.PCIE_LINK_GEN: gen, dcgm.PCIE_LINK_WIDTH: width,
                               **clocks})

    assert not gpu(5, 16, busy).pcie_below_max and not gpu(5, 16, busy).pcie_idle_gen
    assert gpu(3, 16, busy).pcie_below_max
    assert not gpu(1, 16, idle).pcie_below_max and gpu(1, 16, idle).pcie_idle_gen
    assert gpu(1, 8, idle).pcie_below_max  # lanes missing: idle or not
    assert gpu(5, 8, busy).pcie_below_max
    # No clock-event field exported: a lower generation cannot be put down to idling.
    assert GpuReadings(0, {**link, dcgm.PCIE_LINK_GEN: 1.0,
                           dcgm.PCIE_LINK_WIDTH: 16.0}).pcie_below_max
