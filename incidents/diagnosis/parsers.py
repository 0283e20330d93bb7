"""Parsers for what the sources really print: kernel lines, job output, Slurm and DCGM values.

Pure functions from one raw line or value to a small typed record, or ``None`` when the line
means nothing to diagnosis. They never raise on odd input: a line we do not understand is
noise, not an error (a source's *shape* is checked by its collector, which can say so).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from collectors.knowledge.xid import RECOVERY_ACTIONS

# --- kernel ------------------------------------------------------------------------------

# NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
# NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double bit error ...
# Older drivers print the bus id without "PCI:"; journald prefixes "kernel: ".
_XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.\d)?)\): "
    r"(?P<code>\d+)(?:, pid=(?P<pid>'[^']*'|[^,]*), name=(?P<name>[^,]*))?,?\s*(?P<text>.*)$"
)
# GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)
# The "from" action's name may itself contain "t" ("0x1 (GPU Reset Required)"), so the target
# is found after the last " to "; some tools print only the names ("... from None to Drain and
# Reset"), so a name alone is understood too.
_RECOVERY = re.compile(r"recovery action changed from .*?\bto\s+(?P<to>\S.*?)\s*\.?$",
                       re.IGNORECASE)
_RECOVERY_HEX = re.compile(r"^(0x[0-9a-fA-F]+|\d+)\b")
_RECOVERY_BY_NAME = {name.lower(): code for code, name in RECOVERY_ACTIONS.items()}
# mlx5_core 0000:0c:00.0 enp12s0np0: Link down   /   ice 0000:17:00.0 ens1f0: NIC Link is Down
_NETDEV_LINK = re.compile(
    r"(?P<driver>[\w-]+) (?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d) "
    r"(?P<dev>[\w.-]+): (?:NIC )?Link (?:is )?(?P<state>up|down)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class KernelXid:
    code: int
    pci: str
    pid: str
    process: str
    text: str
    recovery_action: int | None = None  # XID 154: the action the driver now wants


@dataclass(frozen=True, slots=True)
class NetdevLink:
    device: str
    pci: str
    up: bool


def parse_kernel(message: str) -> KernelXid | NetdevLink | None:
    if "Xid" in message:
        m = _XID_LINE.search(message)
        if m:
            code, text = int(m.group("code")), m.group("text").strip()
            action = None
            r = _RECOVERY.search(text)
            if r:
                action = _recovery_action(r.group("to"))
            return KernelXid(code, m.group("pci").lower(), (m.group("pid") or "").strip("'"),
                             (m.group("name") or "").strip(), text, action)
    if "ink" in message:
        m = _NETDEV_LINK.search(message)
        if m:
            return NetdevLink(m.group("dev"), m.group("pci").lower(),
                              m.group("state").lower() == "up")
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
_NCCL_WORDS = ("NCCL", "DistBackendError", "ProcessGroup", "c10d", "Gloo", "Connection reset",
               "Broken pipe", "collective operation timeout")


@dataclass(frozen=True, slots=True)
class JobLine:
    kind: str
    detail: str


def parse_job_line(message: str) -> JobLine | None:
    line = message.strip()
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
    if "NCCL WARN" in line or "ncclRemoteError" in line or "ncclSystemError" in line:
        return JobLine(NCCL_ERROR, line[:200])
    m = _EXIT.search(line)
    if m and int(m.group("code")) != 0:
        return JobLine(APP_EXIT, f"exit code {m.group('code')}")
    return None


# --- Slurm -------------------------------------------------------------------------------

NOT_RESPONDING = "NOT_RESPONDING"


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
            if not part:
                continue
            if part.endswith("*"):
                out.append(NOT_RESPONDING)
                part = part.rstrip("*")
            out.append(part.upper())
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


def k8s_ready(condition: Any, status: Any) -> bool | None:
    """Ready=True -> True, Ready=False/Unknown -> False; any other condition -> None."""
    if condition != "Ready":
        return None
    return str(status) == "True"

