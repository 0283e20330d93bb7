"""Parsers for what the sources really print: kernel lines, job output, Slurm and DCGM values.

Pure functions from one raw line or value to a small typed record, or ``None`` when the line
means nothing to diagnosis. They never raise on odd input: a line we do not understand is
noise, not an error (a source's *shape* is checked by its collector, which can say so).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from collectors.knowledge import health_tools as ht
from collectors.knowledge.xid import RECOVERY_ACTIONS

# --- kernel ------------------------------------------------------------------------------

# A PCI address as the kernel and the driver print it: "0000:3b:00.0", "PCI:0000:3b:00" (XID
# lines leave out the function), NVML's "00000000:3B:00.0"; a few lines leave out the domain.
_ADDR = r"(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
# NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
# NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double bit error ...
# On a MIG GPU the driver names the GPU instance, and the compute instance where it knows it
# (kernel_rc.c): NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User ...
# and NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 13, ... The fault is the physical GPU's
# either way: the PCI address is what is blamed, the instance is kept for the explanation.
# Older drivers print the bus id without "PCI:"; journald prefixes "kernel: "; the process is
# sometimes named without a pid, sometimes the pid without a name.
_XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>" + _ADDR + r")"
    r"(?:\s+GPU-I:\s*(?P<gi>\d+))?(?:\s+GPU-CI:\s*(?P<ci>\d+))?\): "
    r"(?P<code>\d+)(?:, pid=(?P<pid>'[^']*'|[^,]*))?(?:, name=(?P<name>[^,]*))?,?\s*(?P<text>.*)$"
)
# GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)
# The "from" action's name may itself contain "t" ("0x1 (GPU Reset Required)"), so the target
# is found after the last " to "; some tools print only the names ("... from None to Drain and
# Reset"), so a name alone is understood too.
_RECOVERY = re.compile(r"recovery action changed from .*?\bto\s+(?P<to>\S.*?)\s*\.?$",
                       re.IGNORECASE)
_RECOVERY_HEX = re.compile(r"^(0x[0-9a-fA-F]+|\d+)\b")
_RECOVERY_BY_NAME = {name.lower(): code for code, name in RECOVERY_ACTIONS.items()}
# NVSwitch errors, from the nvswitch driver (not NVRM): the severity is the word after the code.
#   nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted ...
#   nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up
# Each error is followed by detail lines with the same code ("Severity 1 Engine instance 60
# ...", "Data {0x...}"): those say nothing new and are read as detail, not as more errors.
_SXID_LINE = re.compile(
    r"(?:(?P<switch>[\w-]*nvswitch\d*):\s*)?SXid \((?:PCI:)?(?P<pci>" + _ADDR + r")\): "
    r"(?P<code>\d+),\s*(?P<rest>.*)$"
)
_SXID_LINK = re.compile(r"\bLink (?P<link>-?\d+)\b")
# The driver's own "fallen off the bus" messages, with no XID:
#   NVRM: The NVIDIA GPU 0000:18:00.0 (PCI ID: 10de:2901) installed in this system has fallen
#   off the bus and is not responding to commands.      (probe or resume, osapi.c)
#   NVRM: GPU 0000:29:00.0: GPU has fallen off the bus.  (runtime, osinit.c)
# The first is printed over three lines ("NVRM: The NVIDIA GPU 0000:18:00.0" / "NVRM: (PCI ID:
# ...) installed in this system has" / "NVRM: fallen off the bus ..."): one kmsg record that the
# agent hands over with its newlines, or three lines in a text log. Joined, it is read whole;
# split, the last line alone still says a GPU of the node is lost (``pci`` empty), and the
# first line alone names it (``NvrmGpuHeader``) for the facts to join them.
_NVRM_CONT = re.compile(r"\s*(?:\n|\\x0a)\s*(?:\[[^\]]*\]\s*)?NVRM:\s*")
_FALLEN = re.compile(
    r"NVRM: (?:The NVIDIA GPU |GPU (?:at (?:PCI:)?)?)?(?P<pci>" + _ADDR + r")?\b.*?"
    r"fallen off the bus", re.IGNORECASE | re.DOTALL)
_NVRM_HEADER = re.compile(r"NVRM: The NVIDIA GPU (?P<pci>" + _ADDR + r")\s*$")
# A GPU the driver could not bring up at load (the node runs short of a GPU):
#   NVRM: GPU 0000:98:00.0: RmInitAdapter failed! (0x62:0x65:1792)
#   NVRM: GPU 0000:0a:00.0: rm_init_adapter failed, device minor number 5
#   NVRM: RmInitAdapter failed! (0x26:0xffff:1375)          (older drivers: no address)
#   NVRM: rm_init_adapter(0) failed                           (older still: the minor number)
#   nvidia: probe of 0000:3b:00.0 failed with error -1      (the kernel's driver core, < 5.x)
#   nvidia 0000:3b:00.0: probe with driver nvidia failed with error -1   (newer kernels)
#   NVRM: The NVIDIA probe routine failed for 1 device(s).
_INIT_FAILED = re.compile(
    r"NVRM: (?:GPU (?P<pci>" + _ADDR + r"): )?(?:RmInitAdapter|rm_init_adapter(?:\(\d+\))?) failed"
    r"|nvidia: probe of (?P<pci2>" + _ADDR + r") failed with error"
    r"|nvidia (?P<pci3>" + _ADDR + r"): probe with driver nvidia failed with error"
    r"|NVRM: The NVIDIA probe routine failed for \d+ device")
# mlx5_core 0000:0c:00.0 enp12s0np0: Link down   /   ice 0000:17:00.0 ens1f0: NIC Link is Down
# mlx4_en: eth2: Link Down   /   r8169 0000:06:00.0 eth0: link down
# igb 0000:01:00.0 eno1: igb: eno1 NIC Link is Up 1000 Mbps Full Duplex, Flow Control: RX/TX
# Only "Link up/down" or "NIC Link is Up/Down" right after the device name and its colon (a
# second driver tag in between is allowed): "ata3: SATA link down" (a disk) and "eth0: link
# becomes ready" (an address being configured) are not a NIC's link state.
_NETDEV_LINK = re.compile(
    r"(?:(?P<driver>[\w-]+) (?P<pci>" + _ADDR + r") )?(?P<dev>[\w.-]+): "
    r"(?:[\w-]+: [\w.-]+ )?(?:NIC )?Link (?:is )?(?P<state>up|down)\b",
    re.IGNORECASE,
)
# e1000e: eth1 NIC Link is Down   (Intel's e1000/e1000e print the driver, then the device)
_NIC_LINK_BARE = re.compile(r"(?P<dev>[\w.-]+) NIC Link is (?P<state>Up|Down)\b",
                            re.IGNORECASE)
# IB/RoCE port state, printed by ib_core for every device since Linux 6.15 (cache.c,
# ib_port_state_to_str) and by mlx4 before it:
#   mlx5_core 0000:08:00.0 mlx5_0: Port: 1 Link DOWN
#   mlx5_core 0000:08:00.0 rdmap8s0f0: Port: 2 Link ACTIVE
_IB_PORT = re.compile(
    r"(?:(?P<driver>[\w-]+) (?P<pci>" + _ADDR + r") )?(?P<dev>[\w.-]+): Port: (?P<port>\d+) "
    r"Link (?P<state>NOP|DOWN|INIT|ARMED|ACTIVE_DEFER|ACTIVE)\b")
# Port states that carry no traffic, and those that do; INIT and ARMED are a link coming up
# (trained, waiting for the subnet manager): neither a loss nor yet a recovery.
IB_DOWN_STATES = frozenset({"DOWN"})
IB_UP_STATES = frozenset({"ACTIVE", "ACTIVE_DEFER"})
# PCIe Advanced Error Reporting (drivers/pci/pcie/aer.c). The root port announces what it
# received and from whom, then each device involved prints its own detail:
#   pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0     (< 6.x)
#   pcieport 0000:00:02.0: AER: Corrected error received: id=0010                   (older)
#   pcieport 0000:00:03.1: AER: Correctable error message received from 0000:00:00.0 (6.x)
#   pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: 0000:00:03.0
#   nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer
#   snd_hda_intel 0000:63:00.1: PCIe Bus Error: Uncorrectable (Non-Fatal), type=Transaction Layer
# Severity words changed over releases (Corrected/Correctable, Uncorrected/Uncorrectable), and
# recent kernels dropped "severity=".
_SEVERITY = r"(?P<sev>Corrected|Correctable|Uncorrect(?:ed|able) \((?:Non-)?Fatal\))"
_AER_RECEIVED = re.compile(
    r"(?P<driver>[\w-]+) (?P<port>" + _ADDR + r"): AER: (?:Multiple )?" + _SEVERITY
    + r" error (?:message )?received(?::| from) (?:(?P<src>" + _ADDR + r")|id=(?P<id>[0-9a-fA-F]+))",
    re.IGNORECASE)
_AER_BUS_ERROR = re.compile(
    r"(?P<driver>[\w-]+) (?P<dev>" + _ADDR + r"): (?:AER: )?PCIe Bus Error: (?:severity=)?"
    + _SEVERITY, re.IGNORECASE)
AER_CORRECTED, AER_NONFATAL, AER_FATAL = "corrected", "nonfatal", "fatal"


def pci_address(text: str) -> str:
    """"0000:3b:00" for any spelling of a GPU's address ("PCI:0000:3B:00", "0000:3b:00.0",
    "00000000:3B:00.0", "3b:00.0"): the key a kernel line, an AER line and NVML agree on. The
    function is left out (XID lines never print it; a GPU is function 0)."""
    text = text.strip().lower().removeprefix("pci:")
    parts = text.split(".")[0].split(":")
    if len(parts) == 2:
        parts.insert(0, "0000")
    if len(parts) != 3:
        return text
    domain, bus, device = parts
    return f"{int(domain, 16):04x}:{bus.zfill(2)}:{device.zfill(2)}"


@dataclass(frozen=True, slots=True)
class KernelXid:
    code: int
    pci: str  # "0000:9b:00"; empty where the line names no GPU (the node lost one, which?)
    pid: str
    process: str
    text: str
    recovery_action: int | None = None  # XID 154: the action the driver now wants
    gpu_instance: int | None = None  # MIG: the GPU instance the driver attributes it to
    compute_instance: int | None = None
    # Empty for a real XID line; else the driver message read as this XID, in words.
    via: str = ""


@dataclass(frozen=True, slots=True)
class NvswitchSxid:
    code: int
    pci: str  # the NVSwitch's address, not a GPU's
    switch: str  # "nvidia-nvswitch3"
    fatal: bool | None  # None: a detail line of the error before it
    link: int | None
    text: str


@dataclass(frozen=True, slots=True)
class NvrmGpuHeader:
    """``NVRM: The NVIDIA GPU 0000:18:00.0`` alone: the first line of a message split over
    lines; it names the GPU the next line is about."""

    pci: str


@dataclass(frozen=True, slots=True)
class NetdevLink:
    device: str
    pci: str
    up: bool


@dataclass(frozen=True, slots=True)
class IbPortState:
    device: str  # the IB device ("mlx5_0"), or the netdev where a driver prints that
    pci: str
    port: int
    state: str  # DOWN, INIT, ARMED, ACTIVE, ACTIVE_DEFER

    @property
    def up(self) -> bool | None:
        """True for a port passing traffic, False for one down, None for one coming up."""
        if self.state in IB_UP_STATES:
            return True
        if self.state in IB_DOWN_STATES:
            return False
        return None


@dataclass(frozen=True, slots=True)
class PcieAer:
    severity: str  # AER_CORRECTED, AER_NONFATAL or AER_FATAL
    pci: str  # the device in error, as pci_address() writes it
    driver: str  # the driver of the line's device ("nvidia", "pcieport", ...)
    port: str  # the reporting root port, where the line names it

    @property
    def from_gpu_driver(self) -> bool:
        """The line is the NVIDIA driver's own device speaking: the address is a GPU's."""
        return self.driver == "nvidia" and not self.port


KernelLine = KernelXid | NvswitchSxid | NvrmGpuHeader | NetdevLink | IbPortState | PcieAer

# Words one of which every line parse_kernel reads holds, case and all; the database leaves
# kernel lines holding none of them out of a diagnosis window (incidents/selectors.py), so a
# line class added above needs its word here.
# ("nvidia: probe of", "probe with driver nvidia", "NVIDIA probe routine": the driver's own
# probe failures, not every device's probe a chatty kernel logs.)
KERNEL_WORDS = ("Xid", "ink", "fallen off the bus", "NVRM: The NVIDIA GPU", "RmInitAdapter",
                "rm_init_adapter", "nvidia: probe of", "probe with driver nvidia",
                "NVIDIA probe routine", "AER", "PCIe Bus Error")


# A diagnosis run reads every kernel line of its window, and in a storm every run reads again
# the lines the runs before it read: each line's reading (immutable) is kept for the next.
# Kernel lines are short; a longer message (a pushed one may hold 4,000 characters) is read
# each time, so the cache stays within a few MB whatever is pushed.
KEPT_LINES, KEPT_LINE_CHARS = 16384, 512


def parse_kernel(message: str) -> KernelLine | None:
    if len(message) <= KEPT_LINE_CHARS:
        return _parse_kernel_kept(message)
    return _parse_kernel(message)


def _parse_kernel(message: str) -> KernelLine | None:
    if "NVRM" in message and ("\n" in message or "\\x0a" in message):
        # A message printed over several lines, as one record: read it as one line.
        message = _NVRM_CONT.sub(" ", message)
    if "Xid" in message:
        if "SXid" in message:
            s = _SXID_LINE.search(message)
            if s:
                return _sxid(s)
        m = _XID_LINE.search(message)
        if m:
            code, text = int(m.group("code")), m.group("text").strip()
            action = None
            r = _RECOVERY.search(text)
            if r:
                action = _recovery_action(r.group("to"))
            gi, ci = m.group("gi"), m.group("ci")
            return KernelXid(code, pci_address(m.group("pci")),
                             (m.group("pid") or "").strip().strip("'"),
                             (m.group("name") or "").strip(), text, action,
                             int(gi) if gi else None, int(ci) if ci else None)
    if "NVRM" in message:
        if "fallen off the bus" in message:
            f = _FALLEN.search(message)
            if f:
                pci = f.group("pci")
                return KernelXid(79, pci_address(pci) if pci else "", "", "", message.strip(),
                                 via="the driver's 'fallen off the bus' message")
        h = _NVRM_HEADER.search(message)
        if h:
            return NvrmGpuHeader(pci_address(h.group("pci")))
    if "ailed" in message and ("nit" in message or "probe" in message):
        i = _INIT_FAILED.search(message)
        if i:
            pci = i.group("pci") or i.group("pci2") or i.group("pci3")
            return KernelXid(143, pci_address(pci) if pci else "", "", "", message.strip(),
                             via="the driver failing to initialize the GPU at load")
    if "ink" in message:
        if "Port: " in message:
            b = _IB_PORT.search(message)
            if b:
                return IbPortState(b.group("dev"), (b.group("pci") or "").lower(),
                                   int(b.group("port")), b.group("state"))
        m = _NETDEV_LINK.search(message)
        if m:
            return NetdevLink(m.group("dev"), (m.group("pci") or "").lower(),
                              m.group("state").lower() == "up")
        n = _NIC_LINK_BARE.search(message)
        if n:
            return NetdevLink(n.group("dev"), "", n.group("state").lower() == "up")
    if "AER" in message or "PCIe Bus Error" in message:
        return _aer(message)
    return None


_parse_kernel_kept = functools.lru_cache(maxsize=KEPT_LINES)(_parse_kernel)


def _sxid(m: re.Match[str]) -> NvswitchSxid:
    rest = m.group("rest").strip()
    word = rest.split(",", 1)[0].strip().lower()
    fatal: bool | None
    if word.startswith("fatal"):
        fatal = True
    elif word.startswith(("non-fatal", "nonfatal", "non fatal")):
        fatal = False
    else:
        fatal = None  # "Severity 1 Engine instance ...", "Data {...}": detail lines
    link = _SXID_LINK.search(rest)
    return NvswitchSxid(int(m.group("code")), pci_address(m.group("pci")),
                        m.group("switch") or "", fatal, int(link.group("link")) if link else None,
                        rest)


def _severity(word: str) -> str:
    word = word.lower()
    if word.startswith("correct"):
        return AER_CORRECTED
    return AER_NONFATAL if "non-fatal" in word else AER_FATAL


def _aer(message: str) -> PcieAer | None:
    r = _AER_RECEIVED.search(message)
    if r:
        port = pci_address(r.group("port"))
        if r.group("src"):
            source = pci_address(r.group("src"))
        else:
            # "id=0010": the requester id, bus << 8 | device << 3 | function, in the port's
            # domain.
            rid = int(r.group("id"), 16)
            source = f"{port[:4]}:{rid >> 8:02x}:{(rid >> 3) & 0x1f:02x}"
        return PcieAer(_severity(r.group("sev")), source, r.group("driver"), port)
    b = _AER_BUS_ERROR.search(message)
    if b:
        return PcieAer(_severity(b.group("sev")), pci_address(b.group("dev")), b.group("driver"),
                       "")
    return None


def _recovery_action(target: str) -> int | None:
    """``0x2 (Node Reboot Required)``, ``0x2``, ``2`` or ``Node Reboot Required`` -> 2."""
    m = _RECOVERY_HEX.match(target)
    if m:
        return int(m.group(1), 0)
    name = target.strip().strip("()").strip().lower()
    return _RECOVERY_BY_NAME.get(name)


def recovery_action_name(action: int | None) -> str:
    if action is None:
        return "unknown"
    return RECOVERY_ACTIONS.get(action, f"0x{action:x}")


# --- job output: NCCL, PyTorch, the application ---------------------------------------------

# Symptoms of a fault somewhere else in the job: they never blame the node that prints them.
NCCL_TIMEOUT = "nccl_timeout"
NCCL_IB_ERROR = "nccl_ib_error"
NCCL_REMOTE = "nccl_remote_error"
NCCL_ERROR = "nccl_error"
JOB_NODE_FAIL = "node_fail"  # Slurm ended the job because a node failed: which one, it does not say
# Failures of the application itself.
APP_OOM = "cuda_oom"
APP_EXCEPTION = "exception"
APP_TRACEBACK = "traceback"
APP_EXIT = "exit_code"
APP_CRASH = "crash"

SYMPTOMS = frozenset({NCCL_TIMEOUT, NCCL_IB_ERROR, NCCL_REMOTE, NCCL_ERROR, JOB_NODE_FAIL})
APP_STRONG = frozenset({APP_OOM, APP_EXCEPTION, APP_CRASH})

# NET/IB : Got completion from peer 10.0.0.7<45612> with error 12, opcode 0, len 0, vendor err 129
# NET/IB : Got completion from peer 10.0.0.7<45612> with status=12 opcode=...
# NET/IB : Got completion from peer 10.0.0.7<45612> with status=IBV_WC_RETRY_EXC_ERR(12) ...
# NCCL 2.23+ prints ibv_wc_status_str(), words and all, and the GIN transport its own prefix:
# NET/IB: Got completion from peer 10.0.0.7<45612> with status=transport retry counter exceeded(12)
# NET/IB/GIN: Got completion from peer ... with status=12 opcode=0 len=0 vendor err 129 (Recv)
_IB_COMPLETION = re.compile(
    r"NET/IB(?:/\w+)?\s*:\s*Got completion from peer (?P<peer>\S+) with "
    r"(?:error (?P<e1>\d+)|status=(?:(?P<e2>\d+)\b|[^()]*?\((?P<e3>\d+)\)))"
)
_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: (?P<work>WorkNCCL\([^)]*\))")
_EXCEPTION = re.compile(
    r"^(?:\[[^\]]*\]\s*)?(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::\s*(?P<msg>.*))?$"
)
_EXIT = re.compile(r"(?:exited|exit(?:ed)?) with (?:exit )?(?:code|status) (?P<code>-?\d+)",
                   re.IGNORECASE)
# PyTorch's and NCCL's own words for a communicator that failed (its watchdog's lines carry
# no exception name of their own).
_NCCL_FAILED = ("NCCL WARN", "ncclRemoteError", "ncclSystemError", "ncclInternalError",
                "NCCL error", "NCCL communicator", "ProcessGroupNCCL")
# Exit codes of a task that was told to stop (128 + SIGTERM, 128 + SIGINT: scancel, a time
# limit, torchrun stopping the other workers), or succeeded.
_NOT_FAILED = frozenset({0, 130, 143})
_NCCL_WORDS = ("NCCL", "DistBackendError", "DistNetworkError", "DistStoreError", "ProcessGroup",
               "c10d", "Gloo", "gloo", "Connection reset", "Connection closed by peer",
               "Broken pipe", "collective operation timeout")


@dataclass(frozen=True, slots=True)
class JobLine:
    kind: str
    detail: str


# What launchers put before each line of a rank's output: srun --label ("3: "), torchrun
# --tee ("[default3]:"), PyTorch 2.x's own ("[rank3]:"), a timestamp in brackets; one or more.
_RANK_PREFIX = re.compile(r"^(?:\s*(?:\[[^\]\n]{1,64}\]:?|\d{1,6}:)\s*)+")
# torchrun's summaries of a worker that failed (the worker printed why before it) and of the
# launcher being told to stop (scancel, a time limit): neither is a bug of its own.
_LAUNCHER_SUMMARY = re.compile(r"ChildFailedError|multiprocessing\.api:\s*\[ERROR\] failed")
_STOPPED = re.compile(r"SignalException: Process \d+ got signal: (?:15|2|9|SIGTERM|SIGINT|SIGKILL)"
                      r"|got signal: (?:SIGTERM|SIGINT)")


def parse_job_line(message: str) -> JobLine | None:
    line = _RANK_PREFIX.sub("", message.strip(), count=1)
    if _STOPPED.search(line):
        return None
    if _LAUNCHER_SUMMARY.search(line):
        return JobLine(APP_EXIT, line[:200])
    if "NET/IB" in line:
        m = _IB_COMPLETION.search(line)
        if m:
            code = m.group("e1") or m.group("e2") or m.group("e3")
            return JobLine(NCCL_IB_ERROR, f"IB completion error {code} from peer {m.group('peer')}")
    if "Watchdog caught collective operation timeout" in line:
        m = _WATCHDOG.search(line)
        return JobLine(NCCL_TIMEOUT, m.group("work") if m else "collective operation timeout")
    if "remote process exited or there was a network error" in line:
        return JobLine(NCCL_REMOTE, "remote process exited or there was a network error")
    if "out of memory" in line and ("CUDA" in line or "OutOfMemoryError" in line):
        return JobLine(APP_OOM, line[:200])
    if line.startswith("Traceback (most recent call last)"):
        return JobLine(APP_TRACEBACK, "Python traceback")
    if "Segmentation fault" in line or "core dumped" in line:
        return JobLine(APP_CRASH, line[:200])
    m = _EXCEPTION.match(line)
    if m:
        # An exception that is about NCCL or the process group is the job noticing a peer
        # went away, not a bug in the job.
        if any(word in line for word in _NCCL_WORDS):
            return JobLine(NCCL_ERROR, line[:200])
        return JobLine(APP_EXCEPTION, line[:200])
    if any(word in line for word in _NCCL_FAILED):
        return JobLine(NCCL_ERROR, line[:200])
    m = _EXIT.search(line)
    if m and int(m.group("code")) not in _NOT_FAILED:
        return JobLine(APP_EXIT, f"exit code {m.group('code')}")
    return None


# --- Slurm -------------------------------------------------------------------------------

NOT_RESPONDING = "NOT_RESPONDING"
# Node state flags of work someone planned: `scontrol reboot` (REBOOT_REQUESTED, then
# REBOOT_ISSUED while it boots), a maintenance reservation, power saving (slurm.conf's
# SuspendProgram); sinfo's short forms included.
SLURM_PLANNED = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED", "REBOOT", "MAINTENANCE", "MAINT",
                           "POWER_DOWN", "POWERING_DOWN", "POWERED_DOWN", "POWERING_UP", "BOOT"})

# slurmctld's reason when a slurmd registers fewer GPUs than slurm.conf gives its node
# (gres.c): "gres/gpu count reported lower than configured (7 < 8)"; older releases said
# "gres/gpu count too low (7 < 8)"; a typed GRES names its type ("gres/gpu:a100 ..."). Both
# Slurm and scontrol may append who set it and when: "[slurm@2024-12-19T11:03:34]".
_GRES_GPU_LOW = re.compile(
    r"\bgres/gpu(?::[\w.-]+)? count (?:reported lower than configured|too low) "
    r"\((?P<reported>\d+) < (?P<configured>\d+)\)")


def slurm_gpus_lost(reason: str) -> tuple[int, int] | None:
    """(reported, configured) when a Slurm reason says the node registered too few GPUs."""
    m = _GRES_GPU_LOW.search(reason)
    if m is None:
        return None
    return int(m.group("reported")), int(m.group("configured"))


# sinfo's state suffixes (man sinfo, NODE STATE CODES) and short names, as the flags and
# states `scontrol show node --json` spells out.
_SINFO_SUFFIX = {"*": NOT_RESPONDING, "~": "POWERED_DOWN", "#": "POWERING_UP",
                 "%": "POWERING_DOWN", "!": "POWER_DOWN", "@": "REBOOT_REQUESTED",
                 "^": "REBOOT_ISSUED", "$": "MAINTENANCE"}
_SINFO_SHORT = {"ALLOC": "ALLOCATED", "MIX": "MIXED", "COMP": "COMPLETING", "DRNG": "DRAINING",
                "DRAIN": "DRAIN", "DRAINED": "DRAINED", "MAINT": "MAINTENANCE", "RESV": "RESERVED",
                "NPC": "PERFCTRS", "INVAL": "INVALID_REG", "PLND": "PLANNED"}


def slurm_node_state(value: Any) -> frozenset[str]:
    """Node state tokens, upper case, from any shape Slurm gives.

    23.02 and later: a list (``["IDLE", "DRAIN"]``). 22.05: a string plus ``state_flags``
    (``{"state": "down", "state_flags": ["NOT_RESPONDING"]}``). ``sinfo`` text: ``down*``
    (the ``*`` means not responding) or ``idle+drain``.
    """
    tokens: list[str] = []
    if isinstance(value, Mapping):
        tokens += _state_tokens(value.get("state"))
        tokens += _state_tokens(value.get("state_flags"))
    else:
        tokens += _state_tokens(value)
    return frozenset(tokens)


def _state_tokens(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        out = []
        for part in re.split(r"[+,\s]+", value.strip()):
            while part and part[-1] in _SINFO_SUFFIX:
                out.append(_SINFO_SUFFIX[part[-1]])
                part = part[:-1]
            if not part:
                continue
            upper = part.upper()
            out.append(_SINFO_SHORT.get(upper, upper))
        return out
    if isinstance(value, Iterable):
        return [t for item in value for t in _state_tokens(item)]
    return []


def slurm_job_state(value: Any) -> str:
    """``"FAILED"`` (22.05) or ``["FAILED"]`` (23.02+): the base state, upper case."""
    if isinstance(value, str):
        return value.strip().upper()
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        states = [str(v).upper() for v in value]
        return states[0] if states else ""
    return ""


@dataclass(frozen=True, slots=True)
class ExitCode:
    return_code: int | None
    signal: int | None

    @property
    def failed(self) -> bool:
        return bool(self.return_code) or bool(self.signal)


def _number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, Mapping):  # 23.02+: {"set": true, "infinite": false, "number": 1}
        if value.get("set", True) and not value.get("infinite", False):
            return _number(value.get("number"))
        return None
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


def slurm_exit_code(value: Any) -> ExitCode | None:
    """A job's exit code from any shape: 22.05's integer wait status, ``"1:0"``, or the
    23.02+ object ``{"status": ..., "return_code": ..., "signal": {"id": ...}}``."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        # 22.05's squeue prints the raw wait status: return code in the high byte.
        if value > 255:
            return ExitCode(value >> 8, value & 0x7F or None)
        return ExitCode(value, None)
    if isinstance(value, str):
        rc, _, sig = value.partition(":")
        return ExitCode(_number(rc), _number(sig) or None)
    if isinstance(value, Mapping):
        signal = value.get("signal")
        sig = _number(signal.get("id")) if isinstance(signal, Mapping) else _number(signal)
        return ExitCode(_number(value.get("return_code")), sig or None)
    return None


# --- Kubernetes --------------------------------------------------------------------------

UNREACHABLE_EVENTS = frozenset({"NodeNotReady", "NodeStatusUnknown", "NodeUnreachable"})
REACHABLE_EVENTS = frozenset({"NodeReady"})
# The node controller's event for `kubectl cordon` (spec.unschedulable set).
CORDONED_EVENTS = frozenset({"NodeNotSchedulable"})


def k8s_ready(condition: Any, status: Any) -> bool | None:
    """Ready=True -> True, Ready=False/Unknown -> False; any other condition -> None."""
    if condition != "Ready":
        return None
    return str(status) == "True"



# --- other health tools' verdicts (NVSentinel, gpud, Node Problem Detector) -----------------

@dataclass(frozen=True, slots=True)
class ToolXid:
    code: int
    pci: str  # "0000:ef:00", or "" where the verdict names no address
    gpu: int | None = None  # the GPU index (NVSentinel's "GPU:2" entity), where no address


@dataclass(frozen=True, slots=True)
class ToolVerdict:
    """A health tool's word on a node. ``active``: it says something is wrong now (a condition
    True, an unhealthy event); False: a condition that cleared, or a healthy event."""

    tool: str       # "NVSentinel", "gpud", "node-problem-detector"
    check: str      # the condition type, check name or gpud component
    claim: str      # a collectors.knowledge.health_tools claim
    active: bool
    fatal: bool     # a condition (durable: the tool acts on it) or a fatal/critical event
    xids: tuple[ToolXid, ...]
    text: str


# NVSentinel: "ErrorCode:79 PCI:0000:ef:00 GPU_UUID:GPU-... message Recommended Action=...;",
# one such part for each fault, joined with ";". gpud: "XID 79 ... detected on GPU
# PCI:0000:9b:00". NPD (AKS XIDErrors) carries the driver's own "Xid (PCI:...): 79" line.
_TOOL_PART = re.compile(r"[^;]+")
# (NVSentinel's event exporter documents an errorCode of "XID_79": read like "79".)
_TOOL_CODE = re.compile(r"\bErrorCode:(?:XID_)?(?P<code>\d+)\b|\bXID (?P<gpud>\d+)\b|"
                        r"\bXid \((?:PCI:)?[0-9a-fA-F:.]+\): (?P<nvrm>\d+)\b")
_TOOL_PCI = re.compile(r"\bPCI:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})")
_TOOL_GPU = re.compile(r"\bGPU:(?P<gpu>\d+)\b")


def _tool_xids(message: str) -> tuple[ToolXid, ...]:
    found: dict[tuple[int, str, int | None], None] = {}
    for part in _TOOL_PART.findall(message):
        m = _TOOL_CODE.search(part)
        if m is None:
            continue
        code = int(m["code"] or m["gpud"] or m["nvrm"])
        pci = _TOOL_PCI.search(part)
        index = _TOOL_GPU.search(part) if pci is None else None
        found[(code, pci_address(pci["pci"]) if pci else "",
               int(index["gpu"]) if index else None)] = None
    return tuple(ToolXid(code, pci, gpu) for code, pci, gpu in found)


def parse_tool_verdict(fields: Mapping[str, Any], message: str) -> ToolVerdict | None:
    """A ``kubernetes`` signal's condition or event as a health tool's verdict, or None when it
    is not one (Ready, a kubelet condition, an event of Kubernetes' own)."""
    condition = str(fields.get("condition") or "")
    reason = str(fields.get("reason") or "")
    message = message or str(fields.get("message") or "")
    if condition:
        claim = ht.condition_claim(condition)
        if claim is None or condition in ht.KUBELET_CONDITIONS:
            return None
        active = str(fields.get("status")) == "True"
        tool = ht.NVSENTINEL if ht.nvsentinel_check(reason) else ht.NPD
        return ToolVerdict(tool, condition, claim, active, True,
                           _tool_xids(message) if active else (), message)
    event = str(fields.get("event_reason") or "")
    check = ht.nvsentinel_check(event)
    if check is None:
        # NPD writes events with the condition's reason; only NVSentinel's name a check.
        return None
    name, healthy = check
    claim = ht.condition_claim(name)
    if claim is None:
        return None
    # NVSentinel writes node events only for non-fatal faults (fatal ones set a condition).
    return ToolVerdict(ht.NVSENTINEL, name, claim, not healthy, False,
                       () if healthy else _tool_xids(message), message)


def parse_gpud_event(fields: Mapping[str, Any], message: str) -> ToolVerdict | None:
    """One gpud /v1/events event (``component``, ``name``, ``type``, ``message``), as the node
    agent forwards it, or None for a component whose events claim nothing."""
    component = str(fields.get("component") or "")
    claim = ht.GPUD_COMPONENT_CLAIMS.get(component)
    if claim is None:
        return None
    kind = str(fields.get("type") or "")
    fatal = kind in ht.GPUD_FAULT_TYPES
    return ToolVerdict(ht.GPUD, component, claim, fatal, fatal,
                       _tool_xids(message) if fatal else (), message)
