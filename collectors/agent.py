"""The node agent: runs on each GPU node and pushes what only the node can see.

- NVML (``pynvml``, from nvidia-ml-py): utilisation, temperature, double-bit ECC totals,
  remapped rows, clock-event reasons, and, through NVML's event API, critical XID events as
  they happen;
- the kernel log (``/dev/kmsg`` or a file): the NVRM Xid lines and NIC link lines, raw (the
  diagnosis parsers read them, exactly as in a replay file);
- ``/sys/class/infiniband/*/ports/*``: port state and the link counters.

Like the collectors it sends changes, not samples (a GPU in thermal slowdown is reported on
every pass while it lasts, which is what "sustained" needs). Signals go first to an on-disk
spool, then to FleetWatch over HTTP(S) with the node's token; when FleetWatch cannot be
reached they wait in the spool and are sent, oldest first, on a later pass: nothing is lost.
The spool is one JSON object per line; a batch is removed only after FleetWatch stored it.

Everything that touches the machine is injected (``nvml``, ``sysfs_root``, ``kmsg``), so the
agent is tested with a fake NVML and fixture files, and on a GPU machine with real NVML.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

log = logging.getLogger(__name__)

XID_GAUGE = "DCGM_FI_DEV_XID_ERRORS"
THERMAL_BITS = 0x20 | 0x40
# Kernel lines worth sending: the driver's XIDs and NIC link changes. Everything else stays
# on the node.
KERNEL_INTERESTING = re.compile(r"NVRM: Xid|: (?:NIC )?Link (?:is )?(?:up|down)\b", re.I)
IB_COUNTERS = ("link_downed", "link_error_recovery", "symbol_error")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --- NVML ---------------------------------------------------------------------------------


@dataclass
class GpuReading:
    util: float | None = None
    temp: float | None = None
    clocks: int = 0
    dbe: float | None = None
    remap_failure: bool = False


class NvmlSource:
    """GPU readings and XID events through NVML. ``nvml`` is the ``pynvml`` module or a
    fake with the same functions."""

    def __init__(self, node: str, nvml: Any) -> None:
        self.node, self.nvml = node, nvml
        nvml.nvmlInit()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(nvml.nvmlDeviceGetCount())]
        self.last: dict[int, GpuReading] = {}
        self.events = nvml.nvmlEventSetCreate()
        for handle in self.handles:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError,
                                              self.events)
            except nvml.NVMLError as exc:  # some GPUs (or MIG modes) do not support events
                log.warning("NVML events unavailable on a GPU: %s", exc)

    def _read(self, handle: Any) -> GpuReading:
        nvml = self.nvml
        reading = GpuReading()
        for name, call in (
            ("util", lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)),
            ("temp", lambda: float(nvml.nvmlDeviceGetTemperature(handle,
                                                                  nvml.NVML_TEMPERATURE_GPU))),
            ("clocks", lambda: int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))),
            ("dbe", lambda: float(nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))),
            ("remap_failure", lambda: bool(nvml.nvmlDeviceGetRemappedRows(handle)[3])),
        ):
            try:
                setattr(reading, name, call())
            except nvml.NVMLError as exc:  # not supported on this GPU: leave it unknown
                log.debug("NVML %s: %s", name, exc)
        return reading

    def poll(self) -> list[dict[str, Any]]:
        out = []
        for index, handle in enumerate(self.handles):
            now, before = self._read(handle), self.last.get(index)
            self.last[index] = now
            base = {"source": "dcgm", "node": self.node, "gpu": index, "via": "nvml"}
            if (now.clocks | (before.clocks if before else 0)) & THERMAL_BITS:
                out.append({**base, "metric": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
                            "value": now.clocks})
                if now.temp is not None:
                    out.append({**base, "metric": "DCGM_FI_DEV_GPU_TEMP", "value": now.temp})
            if before and now.dbe is not None and before.dbe is not None and now.dbe > before.dbe:
                out.append({**base, "metric": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "value": now.dbe,
                            "previous": before.dbe})
            if now.remap_failure and not (before and before.remap_failure):
                out.append({**base, "metric": "DCGM_FI_DEV_ROW_REMAP_FAILURE", "value": 1})
        return out

    def xid_events(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Critical XIDs NVML reported since the last call, as they happened."""
        nvml = self.nvml
        out = []
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self.events, timeout_ms)
            except nvml.NVMLError_Timeout:
                return out
            index = next((i for i, h in enumerate(self.handles) if h == event.device), None)
            out.append({"source": "dcgm", "node": self.node, "gpu": index, "via": "nvml",
                        "metric": XID_GAUGE, "value": int(event.eventData)})
            timeout_ms = 0

    def utilisation(self) -> dict[int, GpuReading]:
        return dict(self.last)


# --- the kernel log -----------------------------------------------------------------------


class KernelLogSource:
    """New lines of the kernel log since the last pass. ``/dev/kmsg`` records look like
    ``6,1234,5678,-;message``; a plain file (journald export, a test fixture) is read as
    lines. Starts at the end: old lines were the last agent's business."""

    def __init__(self, node: str, path: str | Path) -> None:
        self.node, self.path = node, Path(path)
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        size = self.path.stat().st_size
        if size < self.offset:
            self.offset = 0  # rotated or truncated
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete = chunk.rfind(b"\n") + 1  # leave a half-written last line for next time
        self.offset += complete
        out = []
        for raw in chunk[:complete].decode("utf-8", "replace").splitlines():
            line = raw.split(";", 1)[1] if re.match(r"^\d+,\d+,\d+,[^;]*;", raw) else raw
            if KERNEL_INTERESTING.search(line):
                out.append({"source": "kernel", "node": self.node, "message": line.strip()})
        return out


# --- InfiniBand sysfs ---------------------------------------------------------------------


class InfinibandSource:
    """Port state and counters under ``/sys/class/infiniband/<dev>/ports/<n>/``."""

    def __init__(self, node: str, root: str | Path = "/sys/class/infiniband") -> None:
        self.node, self.root = node, Path(root)
        self.last: dict[tuple[str, int], dict[str, Any]] = {}

    def read(self) -> dict[tuple[str, int], dict[str, Any]]:
        ports: dict[tuple[str, int], dict[str, Any]] = {}
        for port_dir in sorted(self.root.glob("*/ports/*")):
            try:
                device, port = port_dir.parent.parent.name, int(port_dir.name)
                # "4: ACTIVE" -> "ACTIVE"
                state = (port_dir / "state").read_text().strip().rpartition(":")[2].strip()
                reading: dict[str, Any] = {"state": state}
                for counter in IB_COUNTERS:
                    f = port_dir / "counters" / counter
                    if f.exists():
                        reading[counter] = int(f.read_text().strip())
            except (OSError, ValueError) as exc:
                log.warning("unreadable port %s: %s", port_dir, exc)
                continue
            ports[(device, port)] = reading
        return ports

    def poll(self) -> list[dict[str, Any]]:
        out = []
        for (device, port), now in self.read().items():
            before = self.last.get((device, port))
            self.last[(device, port)] = now
            if before is None:
                continue  # the first reading is the baseline
            base = {"source": "nic", "node": self.node, "device": device, "port": port}
            for counter in IB_COUNTERS:
                if counter in now and now[counter] > before.get(counter, now[counter]):
                    out.append({**base, "counter": counter, "value": now[counter],
                                "previous": before[counter]})
            if now["state"] != before["state"]:
                out.append({**base, "state": now["state"]})
        return out


# --- spool and push -----------------------------------------------------------------------


class Spool:
    """Signals waiting to be sent, one JSON object per line, oldest first."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, signals: Iterable[dict[str, Any]]) -> None:
        lines = "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in signals)
        if lines:
            with self.path.open("a") as fh:
                fh.write(lines)
                fh.flush()
                os.fsync(fh.fileno())

    def pending(self, limit: int) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        with self.path.open() as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    # A line torn by a crash or a full disk while it was written (likely on
                    # the very node that is failing): skipped, and gone at the next drop,
                    # rather than stopping the agent on every start.
                    log.warning("spool %s: unreadable line skipped: %.120s", self.path, line)
                    continue
                if len(out) >= limit:
                    break
        return out

    def drop(self, count: int) -> None:
        """Remove the first ``count`` signals (sent), atomically: a crash keeps them all."""
        rest = self.pending(10**9)[count:]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(s, separators=(",", ":")) + "\n" for s in rest))
        tmp.replace(self.path)

    def __len__(self) -> int:
        return len(self.pending(10**9))


class Pusher:
    def __init__(self, url: str, token: str, *, timeout: float = 5.0,
                 session: requests.Session | None = None) -> None:
        self.url = url.rstrip("/") + "/api/v1/signals/"
        self.timeout = timeout
        self.session = session or requests.Session()
        # Retries for the blips (a restart behind a load balancer); a longer outage is the
        # spool's job, so keep them short.
        retry = Retry(total=2, backoff_factor=0.5, status_forcelist=(502, 503, 504),
                      allowed_methods=frozenset({"POST"}))
        self.session.mount("http://", HTTPAdapter(max_retries=retry))
        self.session.mount("https://", HTTPAdapter(max_retries=retry))
        self.session.headers["Authorization"] = f"Token {token}"

    def push(self, signals: list[dict[str, Any]]) -> None:
        """Raises ``PushFailed`` unless FleetWatch stored the whole batch."""
        try:
            response = self.session.post(self.url, json={"signals": signals},
                                         timeout=self.timeout)
        except requests.RequestException as exc:
            raise PushFailed(f"FleetWatch unreachable: {exc}", retry=True) from exc
        if response.status_code == 201:
            return
        raise PushFailed(f"FleetWatch answered {response.status_code}: {response.text[:300]}",
                         # 401/404: a token being rotated, a proxy mid-deploy: keep the spool.
                         retry=response.status_code >= 500
                         or response.status_code in (401, 404, 408, 429))


class PushFailed(Exception):
    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


@dataclass
class Agent:
    node: str
    spool: Spool
    pusher: Pusher
    sources: list[Any] = field(default_factory=list)
    batch: int = 500
    clock: Callable[[], str] = _now

    def collect(self) -> int:
        signals = []
        for source in self.sources:
            try:
                found = source.poll()
                if isinstance(source, NvmlSource):
                    found += source.xid_events()
            except Exception as exc:  # one broken source must not stop the others
                log.exception("agent source %s failed: %s", type(source).__name__, exc)
                continue
            signals += found
        stamped = [{"at": self.clock(), **s} for s in signals]
        self.spool.add(stamped)
        return len(stamped)

    def flush(self) -> int:
        """Send the spool, oldest first. Returns how many were stored."""
        sent = 0
        while True:
            batch = self.spool.pending(self.batch)
            if not batch:
                return sent
            try:
                self.pusher.push(batch)
            except PushFailed as exc:
                if exc.retry:
                    log.warning("push failed, %d signal(s) kept in the spool: %s",
                                len(self.spool), exc)
                    return sent
                # FleetWatch refused the batch itself (400/403/413/422): sending it again
                # cannot help. Keep it beside the spool for a person, and go on.
                rejected = self.spool.path.with_suffix(".rejected")
                with rejected.open("a") as fh:
                    fh.write(json.dumps({"error": str(exc), "signals": batch}) + "\n")
                log.error("push rejected, batch moved to %s: %s", rejected, exc)
            self.spool.drop(len(batch))
            sent += len(batch)

    def run(self, interval: float, passes: int | None = None) -> None:
        done = 0
        while passes is None or done < passes:
            started = time.monotonic()
            self.collect()
            self.flush()
            done += 1
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
