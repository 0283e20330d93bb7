"""Which kernel log lines matter to FleetWatch: the node agent sends these and keeps the rest
on the node. A superset on purpose: the diagnosis parsers (incidents/diagnosis/parsers.py)
decide what each line means; a line not sent here can never be diagnosed, so when in doubt a
class of line is sent. Standard library only (the agent imports it on GPU nodes)."""

from __future__ import annotations

import re
from typing import Final

# One alternative per class of line, with an example of each as current drivers and kernels
# print it.
KERNEL_LINES_TO_SEND: Final = re.compile(
    "|".join((
        # NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
        # NVRM: Xid (PCI:0000:47:00 GPU-I:05): 94, pid=..., Contained ECC error.   (MIG)
        r"NVRM: Xid\b",
        # nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 45 ...   (NVSwitch)
        r"\bSXid\b",
        # NVRM: The NVIDIA GPU 0000:47:00.0 ... has fallen off the bus and is not responding
        # NVRM: GPU 0000:47:00.0: GPU has fallen off the bus.
        r"fallen off the bus",
        # The same message split over lines in a text log: its first line names the GPU.
        # NVRM: The NVIDIA GPU 0000:18:00.0
        r"NVRM: The NVIDIA GPU [0-9a-fA-F:.]+\s*$",
        # NVRM: GPU 0000:47:00.0: RmInitAdapter failed! (0x26:0x56:1474)
        # NVRM: No NVIDIA GPU found. / NVRM: The NVIDIA probe routine failed for 1 device(s).
        r"NVRM: (?:GPU [0-9a-fA-F:.]+: )?RmInitAdapter failed",
        # NVRM: GPU 0000:98:00.0: rm_init_adapter failed, device minor number 0
        # NVRM: rm_init_adapter(0) failed   (old drivers, which print no address at all)
        r"NVRM: (?:GPU [0-9a-fA-F:.]+: )?rm_init_adapter(?:\(\d+\))? failed",
        # nvidia: probe of 0000:3b:00.0 failed with error -1   (driver core, older kernels)
        # nvidia 0000:3b:00.0: probe with driver nvidia failed with error -1   (newer ones)
        r"nvidia: probe of \S+ failed",
        r"probe with driver nvidia failed",
        r"NVRM: No NVIDIA (?:GPU|devices?) (?:found|detected)",
        r"NVRM: The NVIDIA probe routine (?:was not called|failed)",
        # NVRM: GPU at PCI:0000:47:00: GPU-1c4...: GPU recovery action changed from 0x0 (None)
        # to 0x2 (Node Reboot Required)
        r"recovery action changed",
        # mlx5_core 0000:0c:00.0 enp12s0np0: Link down   /   ice 0000:17:00.0 ens1f0: NIC Link is Up
        r": (?:NIC )?Link (?:is )?(?:up|down)\b",
        # e1000e: eth1 NIC Link is Down
        r"\bNIC Link is (?:up|down)\b",
        # ib_core port state changes (Linux 6.15+, and mlx4 before):
        # mlx5_core 0000:08:00.0 mlx5_0: Port: 1 Link DOWN   /   ... rdmap8s0f0: Port: 2 Link ACTIVE
        r"\bPort:? \d+ (?:Link|link) (?:DOWN|INIT|ARMED|ACTIVE|ACTIVE_DEFER|UP)\b",
        # pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:47:00.0
        # pcieport 0000:00:01.0: AER: Corrected error received: 0000:47:00.0
        # nvidia 0000:47:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer
        r"\bAER: ",
        r"PCIe Bus Error",
    )),
    re.IGNORECASE,
)
