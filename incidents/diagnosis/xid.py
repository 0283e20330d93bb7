"""NVIDIA XID catalogue, as data.

Each entry says what the XID means, which root cause it points to (its class) and NVIDIA's
recommended action, after NVIDIA's XID catalogue ("Analyzing Xid Errors with the Xid Catalog",
docs.nvidia.com/deploy/xid-errors) and its resolution buckets (RESTART_APP, RESET_GPU,
RESTART_BM, WORKFLOW_XID_48, WORKFLOW_NVLINK_ERR, XID_154_EVAL, ...).

Classes:
- ``gpu_hardware``, ``gpu_memory``, ``nvlink``: the GPU is at fault; the node is blamed.
- ``application``: usually the user's code (bad address, illegal instruction). Blames the job,
  unless the same XID follows one GPU across different jobs, which points at the GPU.
- ``driver``: a driver or firmware fault on the node; blamed with low confidence, so a person
  looks before anything is done automatically.
- ``consequence``: reported because of an earlier error (XID 45); never a cause by itself.
- ``recovery``: XID 154, the driver saying which recovery it now needs; see ``RECOVERY_ACTIONS``.

``repeat`` is how many times the XID must be seen on the same GPU in the window before it
counts (GSP timeouts, 119/120, are recoverable once; repeated, the GPU is failing).
``opens`` says whether the XID alone opens an incident or only supports one.
"""

from __future__ import annotations

from dataclasses import dataclass

HARDWARE = "gpu_hardware"
MEMORY = "gpu_memory"
NVLINK = "nvlink"
APPLICATION = "application"
DRIVER = "driver"
CONSEQUENCE = "consequence"
RECOVERY = "recovery"


@dataclass(frozen=True)
class Xid:
    code: int
    meaning: str
    klass: str
    action: str
    repeat: int = 1
    opens: bool = True


_TABLE = [
    Xid(13, "Graphics engine exception", APPLICATION,
        "RESTART_APP: check the application for an illegal instruction or address; "
        "run diagnostics if it follows one GPU"),
    Xid(31, "GPU memory page fault (MMU fault)", APPLICATION,
        "RESTART_APP: check the application for an illegal memory access"),
    Xid(32, "Invalid or corrupted push buffer stream", DRIVER,
        "RESTART_APP; if it recurs, check the PCIe link and system memory, reset the GPU"),
    Xid(38, "Driver firmware error", DRIVER,
        "RESET_GPU; update the driver and firmware if it recurs"),
    Xid(43, "GPU stopped processing (channel reset by the driver)", APPLICATION,
        "RESTART_APP: a user-level fault; the GPU remains healthy"),
    Xid(45, "Preemptive cleanup, due to previous errors", CONSEQUENCE,
        "none by itself: follow the XID that came before it", opens=False),
    Xid(46, "GPU stopped processing (driver error)", DRIVER,
        "RESET_GPU; reboot the node if it recurs"),
    Xid(48, "Double-bit ECC error (uncorrectable)", MEMORY,
        "WORKFLOW_XID_48: drain, reset the GPU so the row is remapped; replace if it recurs"),
    Xid(61, "Internal micro-controller breakpoint/warning", HARDWARE,
        "RESET_GPU; replace if it recurs"),
    Xid(62, "Internal micro-controller halt", HARDWARE,
        "RESET_GPU or reboot the node; replace if it recurs"),
    Xid(63, "ECC page retirement or row remapping recorded", MEMORY,
        "reset the GPU when it is idle so the remap takes effect"),
    Xid(64, "ECC page retirement or row remapper recording failure", MEMORY,
        "drain, reset the GPU; replace (RMA) if it recurs"),
    Xid(68, "NVDEC0 exception (video decoder)", APPLICATION,
        "RESTART_APP: check the application"),
    Xid(69, "Graphics engine class error", APPLICATION,
        "RESTART_APP: check the application"),
    Xid(74, "NVLink error", NVLINK,
        "WORKFLOW_NVLINK_ERR: drain, reset the GPU or reboot; replace if the link stays bad"),
    Xid(79, "GPU has fallen off the bus", HARDWARE,
        "RESTART_BM: drain and reboot the node; replace it if the GPU does not come back"),
    Xid(92, "High single-bit ECC error rate", MEMORY,
        "watch; reset the GPU when idle; replace if the rate stays high", opens=False),
    Xid(94, "Contained ECC error", MEMORY,
        "RESTART_APP; reset the GPU when idle so the row is remapped"),
    Xid(95, "Uncontained ECC error", MEMORY,
        "RESET_GPU: drain and reset; every process on the GPU is affected"),
    Xid(109, "Context switch timeout", APPLICATION,
        "RESTART_APP; reset the GPU if it recurs"),
    Xid(119, "GSP RPC timeout", HARDWARE,
        "RESET_GPU; replace if it recurs", repeat=2),
    Xid(120, "GSP error", HARDWARE,
        "RESET_GPU; replace if it recurs", repeat=2),
    Xid(121, "C2C link corrected error", NVLINK,
        "watch; reset the GPU at the next maintenance if it recurs", opens=False),
    Xid(136, "NVLink link error", NVLINK,
        "WORKFLOW_NVLINK_ERR: drain, reset the GPU or reboot; replace if it recurs"),
    Xid(140, "Unrecovered ECC error", MEMORY,
        "drain and reset the GPU; replace if it recurs"),
    Xid(143, "GPU initialization failure", HARDWARE,
        "RESTART_BM: reboot; replace the node if the GPU still fails to initialize"),
    Xid(144, "NVLink SAW error", NVLINK, "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(145, "NVLink RLW error", NVLINK, "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(146, "NVLink TLW error", NVLINK, "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(147, "NVLink TREX error", NVLINK, "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(148, "NVLink NVLPW_CTRL error", NVLINK, "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(149, "NVLink NETIR error", NVLINK,
        "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot; check the NVLink cartridge"),
    Xid(150, "NVLink MSE error", NVLINK, "WORKFLOW_NVLINK5_ERR: reset the GPU or reboot"),
    Xid(154, "GPU recovery action changed", RECOVERY,
        "XID_154: do what the recovery action says (reset the GPU, reboot the node, ...)",
        opens=False),
    Xid(155, "NVLink software-defined error", NVLINK, "reset the GPU or reboot"),
    Xid(156, "Resource retirement event", MEMORY,
        "reset the GPU when idle so the retirement takes effect", opens=False),
    Xid(157, "Resource retirement failure", MEMORY, "drain, reset the GPU; replace if it recurs"),
    Xid(158, "GPU fatal timeout", HARDWARE, "RESET_GPU or reboot; replace if it recurs"),
    Xid(167, "PCIe fatal timeout", HARDWARE, "RESTART_BM; check the PCIe path; replace"),
    Xid(169, "Internal micro-controller halt", HARDWARE, "RESET_GPU or reboot; replace if it recurs"),
    Xid(173, "C2C fatal link failure", NVLINK, "RESTART_BM; replace if it recurs"),
]

XID_TABLE: dict[int, Xid] = {x.code: x for x in _TABLE}

# XID 154's recovery actions (NVML nvmlDeviceGpuRecoveryAction_t).
RECOVERY_ACTIONS = {
    0: "None",
    1: "GPU Reset Required",
    2: "Node Reboot Required",
    3: "Drain P2P",
    4: "Drain and Reset",
}
# The actions that mean the GPU itself is unhealthy (as opposed to "None" after a recovery).
# "Drain P2P" is the first half of a reset (stop peer-to-peer traffic, then reset the GPU), so
# it asks for a reset as much as 0x1 and 0x4 do; every action but None is a fault.
RECOVERY_FAULTS = {1: HARDWARE, 2: HARDWARE, 3: HARDWARE, 4: HARDWARE}


def xid_info(code: int) -> Xid | None:
    return XID_TABLE.get(code)
