"""The shipped dcgm-exporter counters file exports every field FleetWatch relies on, and the
stock default set does not (which is why the file ships and the client warns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.knowledge import dcgm
from collectors.sim.exporter import SimExporter, counters_set
from collectors.sim.exporter import main as exporter_main
from collectors.sim.fleet import SimFleet
from tests.conftest import ROOT

COUNTERS = ROOT / "deploy" / "dcgm-exporter" / "counters.csv"


def test_the_shipped_counters_file_exports_every_relied_on_field() -> None:
    exported = dcgm.counters_csv_fields(COUNTERS.read_text())
    assert dcgm.missing_fields(set(exported)) == []
    assert len(exported) == len(set(exported)), "a field listed twice"
    # ...and the stock defaults, so installing it loses no dashboard.
    assert set(dcgm.EXPORTER_DEFAULT_FIELDS) <= set(exported)


def test_the_stock_default_set_misses_the_fault_fields() -> None:
    missing = dcgm.missing_fields(set(dcgm.EXPORTER_DEFAULT_FIELDS))
    assert dcgm.ECC_DBE_VOL_TOTAL in missing
    assert dcgm.CLOCKS_EVENT_REASONS in missing
    assert dcgm.ROW_REMAP_FAILURE not in missing  # exported by default (4.5.3-4.8.2)
    assert set(dcgm.NVLINK_ERROR_COUNTERS) <= set(missing)
    assert dcgm.XID_ERRORS not in missing
    assert dcgm.missing_field_warning(dcgm.ECC_DBE_VOL_TOTAL) == (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL not exported: double-bit ECC faults will not be seen")


def test_a_commented_out_field_is_not_exported_and_the_old_clock_name_serves() -> None:
    text = ("# DCGM_FI_DEV_ECC_DBE_VOL_TOTAL, counter, commented out\n\n"
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS, gauge, Current clock throttle reasons.\n")
    exported = set(dcgm.counters_csv_fields(text))
    assert exported == {dcgm.CLOCK_THROTTLE_REASONS}
    missing = dcgm.missing_fields(exported)
    assert dcgm.ECC_DBE_VOL_TOTAL in missing and dcgm.CLOCKS_EVENT_REASONS not in missing


def test_a_malformed_counters_line_is_named() -> None:
    with pytest.raises(ValueError, match="line 2"):
        dcgm.counters_csv_fields("# ok\nDCGM_FI_DEV_GPU_UTIL gauge no commas\n")


def _families(page: str) -> set[str]:
    return {line.split(" ")[2] for line in page.splitlines() if line.startswith("# TYPE ")}


def test_the_simulated_exporter_exports_only_its_counters(tmp_path: Path) -> None:
    fleet = SimFleet(tmp_path / "fleet.json", 20)
    fleet.seed()
    everything = _families(SimExporter(fleet.path).render())
    stock = _families(SimExporter(fleet.path, counters=counters_set("default")).render())
    ours = _families(SimExporter(fleet.path, counters=counters_set(str(COUNTERS))).render())
    dcgm_ours = {n for n in ours if n.startswith("DCGM_")}
    assert dcgm.ECC_DBE_VOL_TOTAL in everything and dcgm.ECC_DBE_VOL_TOTAL not in stock
    assert {n for n in stock if n.startswith("DCGM_")} <= set(dcgm.EXPORTER_DEFAULT_FIELDS)
    assert dcgm.missing_fields(dcgm_ours) == [] and dcgm_ours == {
        n for n in everything if n.startswith("DCGM_")}
    assert "node_infiniband_state_id" in stock  # node_exporter's page is not dcgm-exporter's


def test_a_bad_counters_file_is_refused_by_name(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "counters.csv"
    bad.write_text("DCGM_FI_DEV_GPU_UTIL, gauge, ok\nnonsense\n")
    with pytest.raises(SystemExit) as exc:
        exporter_main(["--state", str(tmp_path / "fleet.json"), "--counters", str(bad)])
    assert exc.value.code == 2
    assert f"counters file {bad}: line 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"missing\.csv"):
        counters_set(str(tmp_path / "missing.csv"))
