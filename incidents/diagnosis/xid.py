"""NVIDIA XID error catalogue (a subset; the full table is grown by the diagnosis issue).

Each entry: what the XID means, its class (which root cause it points to, or ``application``
when the user's code is the usual culprit) and NVIDIA's recommended action, after the XID
catalogue in NVIDIA's GPU deployment and management documentation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Xid:
    code: int
    meaning: str
    klass: str  # gpu_hardware, gpu_memory, nvlink, thermal, application, driver
    action: str


_TABLE = [
    Xid(13, "Graphics engine exception", "application", "check the application; rerun"),
    Xid(31, "GPU memory page fault", "application", "check the application for illegal access"),
    Xid(43, "GPU stopped processing (reset channel)", "application", "none; user-level fault"),
    Xid(45, "Preemptive cleanup, due to previous errors", "application", "none"),
    Xid(48, "Double-bit ECC error", "gpu_memory", "drain; reset the GPU or reboot"),
    Xid(62, "Internal micro-controller halt", "gpu_hardware", "drain; reset or reboot"),
    Xid(63, "ECC page retirement or row remapping recorded", "gpu_memory",
        "reset the GPU when idle so the remap takes effect"),
    Xid(64, "ECC page retirement or row remapper recording failure", "gpu_memory",
        "drain; reset the GPU; replace if it recurs"),
    Xid(74, "NVLink error", "nvlink", "drain; reset the GPU; check the NVLink"),
    Xid(79, "GPU has fallen off the bus", "gpu_hardware", "drain; reboot or replace the node"),
    Xid(94, "Contained ECC error", "gpu_memory", "restart the affected application; reset"),
    Xid(95, "Uncontained ECC error", "gpu_memory", "drain; reset the GPU"),
    Xid(119, "GSP RPC timeout", "gpu_hardware", "reset the GPU; replace if it recurs"),
    Xid(120, "GSP error", "gpu_hardware", "reset the GPU; replace if it recurs"),
    Xid(140, "Unrecovered ECC error", "gpu_memory", "drain; reset the GPU"),
    Xid(143, "GPU initialization failure", "gpu_hardware", "drain; replace the node"),
]

XID_TABLE: dict[int, Xid] = {x.code: x for x in _TABLE}


def xid_info(code: int) -> Xid | None:
    return XID_TABLE.get(code)
