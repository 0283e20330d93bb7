"""The shipped dcgm-exporter counters file exports every field FleetWatch relies on, and the
stock default set does not (which is why the file ships and the client warns)."""

from __future__ import annotations

import pytest

from collectors.knowledge import dcgm
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
    assert dcgm.ROW_REMAP_FAILURE in missing
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
