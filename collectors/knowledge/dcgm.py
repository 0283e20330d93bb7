"""DCGM field names (as dcgm-exporter exposes them) and the clock-event reason bits.

Every collector, the node agent, the simulated exporter and the diagnosis engine name DCGM
fields through these constants, so a renamed field (DCGM 3.2 renamed the throttle reasons to
clock-event reasons) is one edit.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

# --- fields FleetWatch reads ----------------------------------------------------------------

# The value of the *last* XID (a gauge): only a change is a new XID.
XID_ERRORS: Final = "DCGM_FI_DEV_XID_ERRORS"
GPU_UTIL: Final = "DCGM_FI_DEV_GPU_UTIL"
GPU_TEMP: Final = "DCGM_FI_DEV_GPU_TEMP"
MEMORY_TEMP: Final = "DCGM_FI_DEV_MEMORY_TEMP"
POWER_USAGE: Final = "DCGM_FI_DEV_POWER_USAGE"
CLOCKS_EVENT_REASONS: Final = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
CLOCK_THROTTLE_REASONS: Final = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"  # its name before DCGM 3.2
ECC_DBE_VOL_TOTAL: Final = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
ECC_DBE_AGG_TOTAL: Final = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"
UNCORRECTABLE_REMAPPED_ROWS: Final = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
ROW_REMAP_FAILURE: Final = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
PCIE_REPLAY_COUNTER: Final = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"
NVLINK_CRC_FLIT_ERRORS: Final = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
NVLINK_CRC_DATA_ERRORS: Final = "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"
NVLINK_REPLAY_ERRORS: Final = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"
NVLINK_RECOVERY_ERRORS: Final = "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"
DRIVER_VERSION: Final = "DCGM_FI_DRIVER_VERSION"  # a label on every series, not a series

# Fields that are routine telemetry, never evidence of a fault by themselves.
MEM_COPY_UTIL: Final = "DCGM_FI_DEV_MEM_COPY_UTIL"
ENC_UTIL: Final = "DCGM_FI_DEV_ENC_UTIL"
DEC_UTIL: Final = "DCGM_FI_DEV_DEC_UTIL"
SM_CLOCK: Final = "DCGM_FI_DEV_SM_CLOCK"
MEM_CLOCK: Final = "DCGM_FI_DEV_MEM_CLOCK"
TOTAL_ENERGY_CONSUMPTION: Final = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
FB_FREE: Final = "DCGM_FI_DEV_FB_FREE"
FB_USED: Final = "DCGM_FI_DEV_FB_USED"
PROF_GR_ENGINE_ACTIVE: Final = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
PROF_SM_ACTIVE: Final = "DCGM_FI_PROF_SM_ACTIVE"
PROF_SM_OCCUPANCY: Final = "DCGM_FI_PROF_SM_OCCUPANCY"
PROF_PIPE_TENSOR_ACTIVE: Final = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
PROF_DRAM_ACTIVE: Final = "DCGM_FI_PROF_DRAM_ACTIVE"
PROF_PCIE_TX_BYTES: Final = "DCGM_FI_PROF_PCIE_TX_BYTES"
PROF_PCIE_RX_BYTES: Final = "DCGM_FI_PROF_PCIE_RX_BYTES"

# --- groups ---------------------------------------------------------------------------------

# The clock-event reasons under either name.
CLOCK_REASONS: Final = (CLOCKS_EVENT_REASONS, CLOCK_THROTTLE_REASONS)
TEMPERATURES: Final = (GPU_TEMP, MEMORY_TEMP)
# Running totals whose rise means an uncorrectable memory error happened.
MEMORY_COUNTERS: Final = (ECC_DBE_VOL_TOTAL, ECC_DBE_AGG_TOTAL, UNCORRECTABLE_REMAPPED_ROWS)
# NVLink error counters (per link; FleetWatch sums them per GPU).
NVLINK_ERROR_COUNTERS: Final = (NVLINK_CRC_FLIT_ERRORS, NVLINK_CRC_DATA_ERRORS,
                                NVLINK_REPLAY_ERRORS, NVLINK_RECOVERY_ERRORS)
# Utilisation, clocks, power and memory use: what a busy exporter mostly sends, and what the
# diagnosis engine reads as "the node is alive" and nothing more.
IDLE_FIELDS: Final = (
    GPU_UTIL, MEM_COPY_UTIL, ENC_UTIL, DEC_UTIL, SM_CLOCK, MEM_CLOCK, POWER_USAGE,
    TOTAL_ENERGY_CONSUMPTION, FB_FREE, FB_USED, PCIE_REPLAY_COUNTER, PROF_GR_ENGINE_ACTIVE,
    PROF_SM_ACTIVE, PROF_SM_OCCUPANCY, PROF_PIPE_TENSOR_ACTIVE, PROF_DRAM_ACTIVE,
    PROF_PCIE_TX_BYTES, PROF_PCIE_RX_BYTES,
)
# Fields that are evidence of a fault: never idle.
FAULT_FIELDS: Final = (XID_ERRORS, ROW_REMAP_FAILURE, *CLOCK_REASONS, *TEMPERATURES,
                       *MEMORY_COUNTERS)
assert not set(IDLE_FIELDS) & set(FAULT_FIELDS)

# --- clock-event reason bits (DCGM_FI_DEV_CLOCKS_EVENT_REASONS, nvmlClocksEventReasons) -------

GPU_IDLE: Final = 0x1
APPLICATIONS_CLOCKS_SETTING: Final = 0x2
SW_POWER_CAP: Final = 0x4
HW_SLOWDOWN: Final = 0x8  # the GPU's own thermal sensor, or the power brake
SYNC_BOOST: Final = 0x10
SW_THERMAL: Final = 0x20
HW_THERMAL: Final = 0x40
POWER_BRAKE: Final = 0x80
DISPLAY_CLOCK_SETTING: Final = 0x100

CLOCK_EVENT_BITS: Final = MappingProxyType({
    GPU_IDLE: "gpu idle",
    APPLICATIONS_CLOCKS_SETTING: "applications clocks setting",
    SW_POWER_CAP: "sw power cap",
    HW_SLOWDOWN: "hw slowdown",
    SYNC_BOOST: "sync boost",
    SW_THERMAL: "sw thermal slowdown",
    HW_THERMAL: "hw thermal slowdown",
    POWER_BRAKE: "hw power brake slowdown",
    DISPLAY_CLOCK_SETTING: "display clock setting",
})
# Software and hardware thermal slowdown: the GPU holds its clocks back for heat.
THERMAL_BITS: Final = SW_THERMAL | HW_THERMAL
# Any bit that may mean heat (HW slowdown needs a closer look: see ``thermal_mask``).
SLOW_BITS: Final = THERMAL_BITS | HW_SLOWDOWN
# Below this a mask holds only idle, application-clock and power-cap reasons: nothing to see.
FIRST_SLOWDOWN_BIT: Final = HW_SLOWDOWN


def thermal_mask(mask: int, in_run: bool = False) -> bool:
    """Whether a clock-event mask holds the GPU back for heat.

    The thermal bits always do. HW slowdown (0x8) is raised by the GPU's own thermal sensor or
    by the power brake; with the power brake bit beside it, it is power, unless the GPU was
    already slowing down for heat (``in_run``). Whether the GPU is actually hot is checked
    against its temperature later.
    """
    if mask & THERMAL_BITS:
        return True
    return bool(mask & HW_SLOWDOWN) and (in_run or not mask & POWER_BRAKE)


def clock_event_reasons(mask: int) -> list[str]:
    return [name for bit, name in CLOCK_EVENT_BITS.items() if mask & bit]
