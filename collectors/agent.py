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
The spool is one JSON object per line; a batch is removed only after FleetWatch stored it, or
set aside (``spool.rejected``) when FleetWatch refused it or failed on it every time, so one
batch the server cannot take never holds up the rest. Each batch carries an idempotency key,
kept with it in the spool: FleetWatch stores a retried batch once.

Everything that touches the machine is injected (``nvml``, ``sysfs_root``, ``kmsg``), so the
agent is tested with a fake NVML and fixture files, and on a GPU machine with real NVML.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from collectors.knowledge import dcgm

log = logging.getLogger(__name__)

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
            if (now.clocks | (before.clocks if before else 0)) & dcgm.THERMAL_BITS:
                out.append({**base, "metric": dcgm.CLOCKS_EVENT_REASONS,
                            "value": now.clocks})
                if now.temp is not None:
                    out.append({**base, "metric": dcgm.GPU_TEMP, "value": now.temp})
            if before and now.dbe is not None and before.dbe is not None and now.dbe > before.dbe:
                out.append({**base, "metric": dcgm.ECC_DBE_VOL_TOTAL, "value": now.dbe,
                            "previous": before.dbe})
            if now.remap_failure and not (before and before.remap_failure):
                out.append({**base, "metric": dcgm.ROW_REMAP_FAILURE, "value": 1})
        return out

    def xid_events(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Critical XIDs NVML reported since the last call, as they happened."""
        nvml = self.nvml
        out: list[dict[str, Any]] = []
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self.events, timeout_ms)
            except nvml.NVMLError_Timeout:
                return out
            index = next((i for i, h in enumerate(self.handles) if h == event.device), None)
            out.append({"source": "dcgm", "node": self.node, "gpu": index, "via": "nvml",
                        "metric": dcgm.XID_ERRORS, "value": int(event.eventData)})
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


# A sealed batch's header line at the top of the spool (see Spool.batch).
BATCH_HEADER = "_batch"


@dataclass
class SpooledBatch:
    """The batch at the head of the spool: its signals, its idempotency key (the same on
    every try, across restarts) and how many times FleetWatch answered it with an error."""

    key: str
    signals: list[dict[str, Any]]
    tries: int = 0
    next_at: float = 0.0  # no try before this (time.time()), after a failed one


class Spool:
    """Signals waiting to be sent, one JSON object per line, oldest first. The batch being
    sent is sealed: a header line on top names its key, size and failed tries, so a retry
    (after a crash too) sends the same signals under the same key and FleetWatch stores
    them once."""

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

    def _read(self, limit: int = 10**9) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The header (if a batch is sealed) and up to ``limit`` signals."""
        if not self.path.exists():
            return None, []
        header: dict[str, Any] | None = None
        out: list[dict[str, Any]] = []
        with self.path.open() as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    # A line torn by a crash or a full disk while it was written (likely on
                    # the very node that is failing): skipped, and gone at the next drop,
                    # rather than stopping the agent on every start.
                    log.warning("spool %s: unreadable line skipped: %.120s", self.path, line)
                    continue
                if isinstance(record, dict) and BATCH_HEADER in record:
                    if header is None and not out:
                        header = record[BATCH_HEADER]
                    continue
                out.append(record)
                if len(out) >= limit:
                    break
        return header, out

    def _write(self, header: dict[str, Any] | None, signals: list[dict[str, Any]]) -> None:
        """Replace the spool, atomically: a crash leaves the old one or the new one."""
        lines = [{BATCH_HEADER: header}] if header is not None else []
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w") as fh:
            fh.write("".join(json.dumps(s, separators=(",", ":")) + "\n"
                             for s in lines + signals))
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(self.path)

    def pending(self, limit: int) -> list[dict[str, Any]]:
        return self._read(limit)[1]

    def batch(self, limit: int) -> SpooledBatch | None:
        """The sealed batch at the head of the spool, sealing up to ``limit`` signals with a
        fresh key when none is."""
        header, signals = self._read(limit)  # a sealed batch needs no more (a long spool)
        if header is not None and int(header.get("count", 0)) > 0:
            count = int(header["count"])
            if count > len(signals):  # sealed by an agent with a larger batch size
                signals = self._read(count)[1]
            return SpooledBatch(str(header["key"]), signals[:count], int(header.get("tries", 0)),
                                float(header.get("next_at", 0.0)))
        if not signals:
            return None
        signals = self._read()[1]  # all of them: the spool is rewritten with the header on top
        sealed = SpooledBatch(uuid.uuid4().hex, signals[:limit])
        self._write({"key": sealed.key, "count": len(sealed.signals), "tries": 0}, signals)
        return sealed

    def tried(self, batch: SpooledBatch, error: str) -> None:
        """Record a failed try of the sealed batch (``batch.tries``, ``batch.next_at``)."""
        _, signals = self._read()
        self._write({"key": batch.key, "count": len(batch.signals), "tries": batch.tries,
                     "next_at": batch.next_at, "error": error[:300]}, signals)

    def drop(self, count: int) -> None:
        """Remove the first ``count`` signals (sent) and the batch header, atomically: a crash
        keeps them all."""
        self._write(None, self._read()[1][count:])

    def __len__(self) -> int:
        return len(self._read()[1])


class Pusher:
    def __init__(self, url: str, token: str, *, timeout: float = 5.0,
                 session: requests.Session | None = None) -> None:
        self.url = url.rstrip("/") + "/api/v1/signals/"
        self.timeout = timeout
        self.session = session or requests.Session()
        # Retries for the blips (a restart behind a load balancer); a longer outage is the
        # spool's job, so keep them short. Safe to repeat: every push carries its batch's key.
        # The last answer comes back (not an exception), so push() can tell a gateway's 502
        # or 504, which may be this batch's doing, from an unreachable server.
        retry = Retry(total=2, backoff_factor=0.5, status_forcelist=(502, 503, 504),
                      allowed_methods=frozenset({"POST"}), raise_on_status=False)
        self.session.mount("http://", HTTPAdapter(max_retries=retry))
        self.session.mount("https://", HTTPAdapter(max_retries=retry))
        self.session.headers["Authorization"] = f"Token {token}"

    def push(self, signals: list[dict[str, Any]], key: str | None = None) -> None:
        """Raises ``PushFailed`` unless FleetWatch stored the whole batch (now, or earlier
        under the same ``key``: a retry whose first answer was lost)."""
        headers = {"Idempotency-Key": key} if key else {}
        try:
            response = self.session.post(self.url, json={"signals": signals}, headers=headers,
                                         timeout=self.timeout)
        except requests.RequestException as exc:
            raise PushFailed(f"FleetWatch unreachable: {exc}", retry=True) from exc
        code = response.status_code
        if code == 201:
            return
        message = f"FleetWatch answered {code}: {response.text[:300]}"
        if code in (401, 404, 408, 429, 503):
            # A token being rotated, a proxy mid-deploy, "later, please": not this batch's
            # fault, so no try is counted and the spool waits as long as it takes.
            raise PushFailed(message, retry=True)
        # Any other server error may be this very batch (a record the server trips on): tried
        # again a few times, then set aside. 400/403/413/422: refused, set aside at once.
        raise PushFailed(message, retry=code >= 500, bounded=True)


class PushFailed(Exception):
    """``retry``: worth sending again; ``bounded``: only a few times (the answer may be about
    this batch), else for as long as it takes (FleetWatch is away)."""

    def __init__(self, message: str, *, retry: bool, bounded: bool = False) -> None:
        super().__init__(message)
        self.retry = retry
        self.bounded = bounded


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw.strip() else default
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, raw, default)
        return default


@dataclass
class Agent:
    node: str
    spool: Spool
    pusher: Pusher
    sources: list[Any] = field(default_factory=list)
    batch: int = 500
    clock: Callable[[], str] = _now
    # A batch answered with a server error is tried this many times in all, waiting
    # retry_backoff seconds after the first failure, twice as long after each next one (at
    # most retry_backoff_max), and then set aside beside the spool so the rest flows.
    max_tries: int = field(default_factory=lambda: max(
        1, int(_env_number("FLEETWATCH_AGENT_MAX_TRIES", 5))))
    retry_backoff: float = field(default_factory=lambda: max(
        0.0, _env_number("FLEETWATCH_AGENT_RETRY_BACKOFF", 10.0)))
    retry_backoff_max: float = 300.0
    now: Callable[[], float] = time.time

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
        """Send the spool, oldest first. Returns how many signals left it (stored, or set
        aside)."""
        sent = 0
        while True:
            batch = self.spool.batch(self.batch)
            if batch is None or batch.next_at > self.now():
                return sent  # empty, or this batch's next try is not due yet
            try:
                self.pusher.push(batch.signals, key=batch.key)
            except PushFailed as exc:
                if exc.retry and not exc.bounded:
                    log.warning("push failed, %d signal(s) kept in the spool: %s",
                                len(self.spool), exc)
                    return sent
                batch.tries += 1
                if exc.retry and batch.tries < self.max_tries:
                    batch.next_at = self.now() + min(
                        self.retry_backoff * 2 ** (batch.tries - 1), self.retry_backoff_max)
                    self.spool.tried(batch, str(exc))
                    log.warning("push of a batch of %d failed (try %d of %d), next try in "
                                "%.0f s: %s", len(batch.signals), batch.tries, self.max_tries,
                                batch.next_at - self.now(), exc)
                    return sent
                self._set_aside(batch, exc)
            self.spool.drop(len(batch.signals))
            sent += len(batch.signals)

    def _set_aside(self, batch: SpooledBatch, exc: PushFailed) -> None:
        """FleetWatch refused the batch (400/403/413/422), or failed on it every time: sending
        it again cannot help, and the signals behind it must not wait. Kept beside the spool
        for a person."""
        rejected = self.spool.path.with_suffix(".rejected")
        with rejected.open("a") as fh:
            fh.write(json.dumps({"error": str(exc), "key": batch.key, "tries": batch.tries,
                                 "signals": batch.signals}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        log.error("push %s, batch of %d moved to %s: %s",
                  f"failed {batch.tries} times" if exc.retry else "rejected",
                  len(batch.signals), rejected, exc)

    def run(self, interval: float, passes: int | None = None) -> None:
        done = 0
        while passes is None or done < passes:
            started = time.monotonic()
            self.collect()
            self.flush()
            done += 1
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
