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
POWER_MGMT_LIMIT: Final = "DCGM_FI_DEV_POWER_MGMT_LIMIT"  # the power limit in force (W)
CLOCKS_EVENT_REASONS: Final = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
CLOCK_THROTTLE_REASONS: Final = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"  # its name before DCGM 3.2
ECC_DBE_VOL_TOTAL: Final = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
ECC_DBE_AGG_TOTAL: Final = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"
UNCORRECTABLE_REMAPPED_ROWS: Final = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
ROW_REMAP_FAILURE: Final = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
CORRECTABLE_REMAPPED_ROWS: Final = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
PCIE_REPLAY_COUNTER: Final = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"
PCIE_LINK_GEN: Final = "DCGM_FI_DEV_PCIE_LINK_GEN"
PCIE_LINK_WIDTH: Final = "DCGM_FI_DEV_PCIE_LINK_WIDTH"
PCIE_MAX_LINK_GEN: Final = "DCGM_FI_DEV_PCIE_MAX_LINK_GEN"
PCIE_MAX_LINK_WIDTH: Final = "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH"
ROW_REMAP_PENDING: Final = "DCGM_FI_DEV_ROW_REMAP_PENDING"
ECC_SBE_VOL_TOTAL: Final = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
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
NVLINK_BANDWIDTH_TOTAL: Final = "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"
# NVLink traffic in bytes per second (DCGM's profiling module): the bandwidth in use now.
PROF_NVLINK_TX_BYTES: Final = "DCGM_FI_PROF_NVLINK_TX_BYTES"
PROF_NVLINK_RX_BYTES: Final = "DCGM_FI_PROF_NVLINK_RX_BYTES"

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

# What a node's page shows per GPU (``TelemetryClient.gpu_readings``), read when a person
# opens the page and never on the collector's poll, which reads only what diagnosis needs.
# An exporter that does not export one of them leaves it out of the page, nothing more.
NODE_PAGE_FIELDS: Final = (
    POWER_USAGE, POWER_MGMT_LIMIT, SM_CLOCK, MEM_CLOCK, FB_USED, FB_FREE,
    ECC_SBE_VOL_TOTAL, ECC_DBE_VOL_TOTAL,
    CORRECTABLE_REMAPPED_ROWS, UNCORRECTABLE_REMAPPED_ROWS, ROW_REMAP_PENDING, ROW_REMAP_FAILURE,
    *NVLINK_ERROR_COUNTERS, PROF_NVLINK_TX_BYTES, PROF_NVLINK_RX_BYTES, NVLINK_BANDWIDTH_TOTAL,
    PCIE_LINK_GEN, PCIE_MAX_LINK_GEN, PCIE_LINK_WIDTH, PCIE_MAX_LINK_WIDTH, PCIE_REPLAY_COUNTER,
    *CLOCK_REASONS,
)
# Fail-slow: what a GPU that is alive but slower than its job's peers shows, compared with the
# job's other nodes (incidents.diagnosis.slow). Read as history (a range over minutes), never
# by the telemetry poll, which keeps utilisation, temperatures and fault fields only.
FAIL_SLOW_FIELDS: Final = (
    SM_CLOCK, POWER_USAGE, GPU_UTIL, PROF_DRAM_ACTIVE, NVLINK_BANDWIDTH_TOTAL,
    PROF_PCIE_TX_BYTES, PROF_PCIE_RX_BYTES, PCIE_LINK_GEN, PCIE_LINK_WIDTH, PCIE_MAX_LINK_GEN,
    PCIE_MAX_LINK_WIDTH, *CLOCK_REASONS,
)
# Of those, the ones dcgm-exporter exports as counters (running totals): their rate is the
# reading.
COUNTER_FIELDS: Final = frozenset({NVLINK_BANDWIDTH_TOTAL})
# A PCIe link's transfer rate per lane by generation, in GT/s (as the kernel prints it).
PCIE_GT_PER_GEN: Final = MappingProxyType({1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0})


# --- what FleetWatch relies on --------------------------------------------------------------

# Each field FleetWatch reads, and what is lost when the exporter does not export it.
# dcgm-exporter's stock etc/default-counters.csv leaves several of them out (the ECC, NVLink
# error and clock-event fields), so an exporter installed with its defaults
# is blind to those faults; deploy/dcgm-exporter/counters.csv exports them all, and the
# Prometheus client names each missing one on the Sources page.
RELIED_ON: Final = MappingProxyType({
    XID_ERRORS: "XID errors (GPU faults, GPUs off the bus) will not be seen",
    GPU_UTIL: "GPU utilisation will not be shown and a GPU off the bus may be missed",
    GPU_TEMP: "GPU temperatures will not be shown and thermal slowdowns cannot be confirmed",
    CLOCKS_EVENT_REASONS: "thermal and power slowdowns will not be seen",
    ECC_DBE_VOL_TOTAL: "double-bit ECC faults will not be seen",
    ROW_REMAP_FAILURE: ("a failed row remap (no spare rows left) will not be seen; a rise in "
                        f"{UNCORRECTABLE_REMAPPED_ROWS} is read as the memory fault instead"),
    UNCORRECTABLE_REMAPPED_ROWS: "rows remapped after uncorrectable memory errors will not be seen",
    PCIE_REPLAY_COUNTER: "PCIe replays (a degrading PCIe link) will not be seen",
    NVLINK_CRC_FLIT_ERRORS: "NVLink flow-control CRC errors will not be seen",
    NVLINK_CRC_DATA_ERRORS: "NVLink data CRC errors will not be seen",
    NVLINK_REPLAY_ERRORS: "NVLink replays will not be seen",
    NVLINK_RECOVERY_ERRORS: "NVLink recovery errors will not be seen",
    SM_CLOCK: "a GPU whose clocks are held below its job's peers' (fail-slow) will not be seen",
    PCIE_LINK_GEN: "a PCIe link trained at a lower generation (fail-slow) will not be seen",
    PCIE_LINK_WIDTH: "a PCIe link trained at a lower width (fail-slow) will not be seen",
})
# Another name that serves as a relied-on field: an exporter older than DCGM 3.2 prints the
# clock-event reasons under their throttle name.
ALSO_SERVED_BY: Final = MappingProxyType({CLOCKS_EVENT_REASONS: (CLOCK_THROTTLE_REASONS,)})


def missing_fields(exported: set[str] | frozenset[str]) -> list[str]:
    """The relied-on fields (in ``RELIED_ON`` order) that none of ``exported`` serves."""
    return [name for name in RELIED_ON
            if name not in exported
            and not any(alt in exported for alt in ALSO_SERVED_BY.get(name, ()))]


def missing_field_warning(name: str) -> str:
    return f"{name} not exported: {RELIED_ON[name]}"


# The fields dcgm-exporter exports when installed with its stock etc/default-counters.csv
# (as released in 4.5.3 to 4.8.2, read from NVIDIA/dcgm-exporter; the simulated exporter's
# ``--counters default``). It leaves out (comments out) the ECC and NVLink error counters and
# has no clock-event reasons at all.
EXPORTER_DEFAULT_FIELDS: Final = (
    SM_CLOCK, MEM_CLOCK, MEMORY_TEMP, GPU_TEMP, POWER_USAGE, TOTAL_ENERGY_CONSUMPTION,
    PCIE_REPLAY_COUNTER, GPU_UTIL, MEM_COPY_UTIL, ENC_UTIL, DEC_UTIL, XID_ERRORS, FB_FREE,
    FB_USED, NVLINK_BANDWIDTH_TOTAL, UNCORRECTABLE_REMAPPED_ROWS, CORRECTABLE_REMAPPED_ROWS,
    ROW_REMAP_FAILURE,
    PROF_GR_ENGINE_ACTIVE, PROF_PIPE_TENSOR_ACTIVE, PROF_DRAM_ACTIVE, PROF_PCIE_TX_BYTES,
    PROF_PCIE_RX_BYTES,
)


def counters_csv_fields(text: str) -> list[str]:
    """The field names a dcgm-exporter counters file exports: one ``NAME, type, help`` per
    line; blank lines and ``#`` comments (commented-out fields) export nothing. A line that
    is not of that form raises ValueError naming it (dcgm-exporter refuses such a file too)."""
    names = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) < 3 or not parts[0].startswith("DCGM_") or parts[1] not in (
                "gauge", "counter", "label"):
            raise ValueError(f"line {number} is not 'DCGM_FI_NAME, gauge|counter, help': "
                             f"{line[:200]!r}")
        names.append(parts[0])
    return names


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
