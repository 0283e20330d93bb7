"""NVIDIA XID catalogue, as data: the one place FleetWatch knows what an XID means.

Each entry says what the XID means, its class (which root cause it points to), whether it takes
the GPU out of service (the GPU cannot make progress until it is reset or the node rebooted),
and NVIDIA's recommended action, after NVIDIA's XID catalogue ("Analyzing Xid Errors with the
Xid Catalog", docs.nvidia.com/deploy/xid-errors) and its resolution buckets (``Action``).

Classes:
- ``gpu_hardware``, ``gpu_memory``, ``nvlink``: the GPU is at fault; the node is blamed. Their
  values are the root-cause labels they lead to.
- ``application``: usually the user's code (bad address, illegal instruction). Blames the job,
  unless the same XID follows one GPU across different jobs, which points at the GPU.
- ``driver``: a driver or firmware fault on the node; blamed with low confidence, so a person
  looks before anything is done automatically.
- ``consequence``: reported because of an earlier error (XID 45); never a cause by itself.
- ``recovery``: XID 154, the driver saying which recovery it now needs; see ``RECOVERY_ACTIONS``.

``takes_gpu_out``: the simulated fleet hangs the job on such a GPU, the GPU's health reads
"failed", and a repair is not done while telemetry still shows it. It is the union of the three
lists FleetWatch kept before (collector health, simulator, repair check), which disagreed, plus
the newer codes NVIDIA lists as needing a reset or reboot (155, 157, 158, 167, 169, 173).
``repeat`` is how many times the XID must be seen on the same GPU in the window before it
counts (GSP timeouts, 119/120, are recoverable once; repeated, the GPU is failing).
``opens`` says whether the XID alone opens an incident or only supports one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from collectors.knowledge.causes import RootCause


class XidClass(StrEnum):
    GPU_HARDWARE = RootCause.GPU_HARDWARE.value
    GPU_MEMORY = RootCause.GPU_MEMORY.value
    NVLINK = RootCause.NVLINK.value
    APPLICATION = "application"
    DRIVER = "driver"
    CONSEQUENCE = "consequence"
    RECOVERY = "recovery"


class Action(StrEnum):
    """NVIDIA's resolution buckets (the catalogue's "immediate action")."""

    IGNORE = "IGNORE"  # nothing to do by itself
    RESTART_APP = "RESTART_APP"  # the application restarts; the GPU is healthy
    RESET_GPU = "RESET_GPU"
    RESTART_BM = "RESTART_BM"  # reboot the node (bare metal)
    CHECK_MECHANICALS = "CHECK_MECHANICALS"  # reseat cables, cartridges, the GPU
    UPDATE_SW = "UPDATE_SW"  # driver or firmware
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"  # double-bit ECC: drain, reset, remap
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"  # NVLink 5 (Blackwell) errors
    XID_154_EVAL = "XID_154_EVAL"  # read the recovery action XID 154 names


# Short names for the table below.
HARDWARE, MEMORY, NVLINK = XidClass.GPU_HARDWARE, XidClass.GPU_MEMORY, XidClass.NVLINK
APPLICATION, DRIVER = XidClass.APPLICATION, XidClass.DRIVER
CONSEQUENCE, RECOVERY = XidClass.CONSEQUENCE, XidClass.RECOVERY
A = Action
OUT, IN = True, False  # takes the GPU out, or not


@dataclass(frozen=True)
class Xid:
    code: int
    meaning: str
    klass: XidClass
    action: Action
    takes_gpu_out: bool
    advice: str  # what to do, in words, after NVIDIA
    repeat: int = 1
    opens: bool = True


_TABLE = [
    Xid(13, "Graphics engine exception", APPLICATION, A.RESTART_APP, IN,
        "RESTART_APP: check the application for an illegal instruction or address; "
        "run diagnostics if it follows one GPU"),
    Xid(31, "GPU memory page fault (MMU fault)", APPLICATION, A.RESTART_APP, IN,
        "RESTART_APP: check the application for an illegal memory access"),
    Xid(32, "Invalid or corrupted push buffer stream", DRIVER, A.RESTART_APP, IN,
        "RESTART_APP; if it recurs, check the PCIe link and system memory, reset the GPU"),
    Xid(38, "Driver firmware error", DRIVER, A.RESET_GPU, IN,
        "RESET_GPU; update the driver and firmware if it recurs"),
    Xid(43, "GPU stopped processing (channel reset by the driver)", APPLICATION, A.RESTART_APP, IN,
        "RESTART_APP: a user-level fault; the GPU remains healthy"),
    Xid(45, "Preemptive cleanup, due to previous errors", CONSEQUENCE, A.IGNORE, IN,
        "none by itself: follow the XID that came before it", opens=False),
    Xid(46, "GPU stopped processing (driver error)", DRIVER, A.RESET_GPU, IN,
        "RESET_GPU; reboot the node if it recurs"),
    Xid(48, "Double-bit ECC error (uncorrectable)", MEMORY, A.WORKFLOW_XID_48, OUT,
        "WORKFLOW_XID_48: drain, reset the GPU so the row is remapped; replace if it recurs"),
    Xid(61, "Internal micro-controller breakpoint/warning", HARDWARE, A.RESET_GPU, IN,
        "RESET_GPU; replace if it recurs"),
    Xid(62, "Internal micro-controller halt", HARDWARE, A.RESET_GPU, OUT,
        "RESET_GPU or reboot the node; replace if it recurs"),
    Xid(63, "ECC page retirement or row remapping recorded", MEMORY, A.RESET_GPU, OUT,
        "reset the GPU when it is idle so the remap takes effect"),
    Xid(64, "ECC page retirement or row remapper recording failure", MEMORY, A.RESET_GPU, OUT,
        "drain, reset the GPU; replace (RMA) if it recurs"),
    Xid(68, "NVDEC0 exception (video decoder)", APPLICATION, A.RESTART_APP, IN,
        "RESTART_APP: check the application"),
    Xid(69, "Graphics engine class error", APPLICATION, A.RESTART_APP, IN,
        "RESTART_APP: check the application"),
    Xid(74, "NVLink error", NVLINK, A.WORKFLOW_NVLINK_ERR, OUT,
        "WORKFLOW_NVLINK_ERR: drain, reset the GPU or reboot; replace if the link stays bad"),
    Xid(79, "GPU has fallen off the bus", HARDWARE, A.RESTART_BM, OUT,
        "RESTART_BM: drain and reboot the node; replace it if the GPU does not come back"),
    Xid(92, "High single-bit ECC error rate", MEMORY, A.IGNORE, IN,
        "watch; reset the GPU when idle; replace if the rate stays high", opens=False),
    Xid(94, "Contained ECC error", MEMORY, A.RESTART_APP, OUT,
        "RESTART_APP; reset the GPU when idle so the row is remapped"),
    Xid(95, "Uncontained ECC error", MEMORY, A.RESET_GPU, OUT,
        "RESET_GPU: drain and reset; every process on the GPU is affected"),
    Xid(109, "Context switch timeout", APPLICATION, A.RESTART_APP, IN,
        "RESTART_APP; reset the GPU if it recurs"),
    Xid(119, "GSP RPC timeout", HARDWARE, A.RESET_GPU, OUT,
        "RESET_GPU; replace if it recurs", repeat=2),
    Xid(120, "GSP error", HARDWARE, A.RESET_GPU, OUT,
        "RESET_GPU; replace if it recurs", repeat=2),
    Xid(121, "C2C link corrected error", NVLINK, A.IGNORE, IN,
        "watch; reset the GPU at the next maintenance if it recurs", opens=False),
    Xid(136, "NVLink link error", NVLINK, A.WORKFLOW_NVLINK_ERR, OUT,
        "WORKFLOW_NVLINK_ERR: drain, reset the GPU or reboot; replace if it recurs"),
    Xid(140, "Unrecovered ECC error", MEMORY, A.RESET_GPU, OUT,
        "drain and reset the GPU; replace if it recurs"),
    Xid(143, "GPU initialization failure", HARDWARE, A.RESTART_BM, OUT,
        "RESTART_BM: reboot; replace the node if the GPU still fails to initialize"),
    Xid(144, "NVLink SAW error", NVLINK, A.WORKFLOW_NVLINK5_ERR, OUT,
        "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(145, "NVLink RLW error", NVLINK, A.WORKFLOW_NVLINK5_ERR, OUT,
        "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(146, "NVLink TLW error", NVLINK, A.WORKFLOW_NVLINK5_ERR, OUT,
        "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(147, "NVLink TREX error", NVLINK, A.WORKFLOW_NVLINK5_ERR, OUT,
        "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(148, "NVLink NVLPW_CTRL error", NVLINK, A.WORKFLOW_NVLINK5_ERR, OUT,
        "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(149, "NVLink NETIR error", NVLINK, A.WORKFLOW_NVLINK5_ERR, OUT,
        "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot; check the NVLink cartridge"),
    Xid(150, "NVLink MSE error", NVLINK, A.WORKFLOW_NVLINK5_ERR, OUT,
        "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(154, "GPU recovery action changed", RECOVERY, A.XID_154_EVAL, IN,
        "XID_154: do what the recovery action says (reset the GPU, reboot the node, ...)",
        opens=False),
    Xid(155, "NVLink software-defined error", NVLINK, A.RESET_GPU, OUT,
        "reset the GPU or reboot"),
    Xid(156, "Resource retirement event", MEMORY, A.RESET_GPU, IN,
        "reset the GPU when idle so the retirement takes effect", opens=False),
    Xid(157, "Resource retirement failure", MEMORY, A.RESET_GPU, OUT,
        "drain, reset the GPU; replace if it recurs"),
    Xid(158, "GPU fatal timeout", HARDWARE, A.RESET_GPU, OUT,
        "RESET_GPU or reboot; replace if it recurs"),
    Xid(167, "PCIe fatal timeout", HARDWARE, A.RESTART_BM, OUT,
        "RESTART_BM; check the PCIe path; replace"),
    Xid(169, "Internal micro-controller halt", HARDWARE, A.RESET_GPU, OUT,
        "RESET_GPU or reboot; replace if it recurs"),
    Xid(173, "C2C fatal link failure", NVLINK, A.RESTART_BM, OUT,
        "RESTART_BM; replace if it recurs"),
]

XID_TABLE: Final[dict[int, Xid]] = {x.code: x for x in _TABLE}

# XIDs after which the GPU cannot make progress until it is reset or the node rebooted.
GPU_OUT_XIDS: Final = frozenset(x.code for x in _TABLE if x.takes_gpu_out)

# XID 154's recovery actions (NVML nvmlDeviceGpuRecoveryAction_t).
RECOVERY_ACTIONS: Final = MappingProxyType({
    0: "None",
    1: "GPU Reset Required",
    2: "Node Reboot Required",
    3: "Drain P2P",
    4: "Drain and Reset",
})
# The actions that mean the GPU itself is unhealthy (as opposed to "None" after a recovery).
# "Drain P2P" is the first half of a reset (stop peer-to-peer traffic, then reset the GPU), so
# it asks for a reset as much as 0x1 and 0x4 do; every action but None is a fault.
RECOVERY_FAULTS: Final = MappingProxyType({1: HARDWARE, 2: HARDWARE, 3: HARDWARE, 4: HARDWARE})


def xid_info(code: int) -> Xid | None:
    return XID_TABLE.get(code)


def takes_gpu_out(code: int) -> bool:
    """Whether the GPU that reported this XID is out of service until a reset or reboot."""
    return code in GPU_OUT_XIDS
