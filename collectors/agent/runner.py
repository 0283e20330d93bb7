"""The agent's loop: readers in threads push urgent lines the moment they arrive, the other
sources are read every ``interval`` seconds, and the spool is sent whenever something is in
it (at once after an urgent line, else after each pass)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from collectors.agent.kernel import KernelLine, KernelReader, boot_id
from collectors.agent.push import Pusher, PushFailed, VersionMismatch
from collectors.agent.spool import Spool, SpooledBatch
from collectors.knowledge import agent as proto
from collectors.knowledge.kernel import KERNEL_LINES_TO_SEND

log = logging.getLogger(__name__)

# "PCI:0000:9b:00" (an XID line) or "0000:9b:00.0" (most other driver lines)
_PCI = re.compile(r"\b(?:PCI:)?([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.\d)?\b")


def iso(seconds: float | None = None) -> str:
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def pci_keys(text: str) -> list[tuple[int, int, int]]:
    """(domain, bus, device) of each PCI address in ``text``, in order: NVML writes
    ``00000000:9B:00.0``, the kernel ``0000:9b:00.0`` and the driver's XID lines
    ``PCI:0000:9b:00``. An AER line names the root port first and the device after it."""
    return [(int(m[1], 16), int(m[2], 16), int(m[3], 16)) for m in _PCI.finditer(text)]


def pci_key(text: str) -> tuple[int, int, int] | None:
    keys = pci_keys(text)
    return keys[0] if keys else None


def env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw.strip() else default
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, raw, default)
        return default


# What a kernel log reader's position() may hold (kernel.py).
POSITION_KEYS = ("kmsg_seq", "kmsg_boot", "journal_cursor", "file", "file_offset")
# The shortest interval between readings: a loop that never sleeps would starve the node.
MIN_INTERVAL = 0.1


class StateFile:
    """What the agent must remember across restarts: where it stopped reading the kernel log
    (and in which boot). Written atomically, after the lines it covers are in the spool."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {}
        try:
            loaded = json.loads(self.path.read_text())
            self.data = loaded if isinstance(loaded, dict) else {}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("state file %s unreadable (%s): starting at the kernel log's end",
                        self.path, exc)

    def save(self, **position: Any) -> None:
        """Record where the kernel log reader stands (its ``position()``), replacing where
        any reader stood before: a node that went from journald back to /dev/kmsg must not
        resume at an old sequence number."""
        self.data = {k: v for k, v in self.data.items() if k not in POSITION_KEYS}
        self.data.update(position, boot_id=boot_id(), saved_at=iso())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w") as fh:
            json.dump(self.data, fh)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(self.path)


class Poller(Protocol):
    def poll(self) -> list[dict[str, Any]]: ...


class KernelLog:
    """Reads the kernel log in a thread and hands the lines worth sending to ``deliver``
    (which spools them durably) before it records how far it read."""

    SAVE_EVERY = 5.0  # seconds: the position is saved this often when nothing is sent

    def __init__(self, node: str, reader: KernelReader, state: StateFile,
                 deliver: Callable[[list[dict[str, Any]]], None],
                 gpu_for_pci: Callable[[tuple[int, int, int]], int | None] | None = None) -> None:
        self.node, self.reader, self.state, self.deliver = node, reader, state, deliver
        self.gpu_for_pci = gpu_for_pci
        # kmsg's timestamps count from boot on CLOCK_MONOTONIC's clock.
        self.boot_wall = time.time() - time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernel-log", daemon=True)
        self._saved = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
        self.reader.close()

    def records(self, lines: list[KernelLine]) -> list[dict[str, Any]]:
        out = []
        for line in lines:
            if not KERNEL_LINES_TO_SEND.search(line.message):
                continue
            record: dict[str, Any] = {"at": iso(line.at(self.boot_wall)), "source": "kernel",
                                      "node": self.node, "message": line.message.strip()}
            if line.seq is not None:
                record["seq"] = line.seq
            if self.gpu_for_pci:
                gpu = next((g for g in map(self.gpu_for_pci, pci_keys(line.message))
                            if g is not None), None)
                if gpu is not None:
                    record["gpu"] = gpu
            out.append(record)
        return out

    def pass_once(self, timeout: float) -> int:
        lines = self.reader.read(timeout)
        records = self.records(lines)
        for trouble in self.reader.take_trouble():
            records.append({"at": iso(), "source": "kernel", "node": self.node,
                            "event": proto.KERNEL_LOG_UNREADABLE,
                            "message": f"fleetwatch-agent: kernel log: {trouble}"})
        lost = self.reader.take_lost()
        if lost:
            records.append({"at": iso(), "source": "kernel", "node": self.node,
                            "event": proto.KMSG_LOST, "lost": lost,
                            "message": f"fleetwatch-agent: kernel log overrun: {lost} record(s) "
                                       "were overwritten before the agent read them"})
        if records:
            self.deliver(records)
        # Saved only now that they are in the spool: a crash before this re-reads them.
        if (lines or lost) and (records or time.monotonic() - self._saved > self.SAVE_EVERY):
            self.state.save(**self.reader.position())
            self._saved = time.monotonic()
        return len(records)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.pass_once(0.5)
            except Exception:  # a reader's surprise must not end the thread
                log.exception("kernel log read failed")
                self._stop.wait(1.0)
        with contextlib.suppress(Exception):
            self.state.save(**self.reader.position())


@dataclass
class Agent:
    node: str
    spool: Spool
    pusher: Pusher
    sources: list[Poller] = field(default_factory=list)  # read every interval
    kernel: KernelLog | None = None
    events: Any = None  # NvmlEvents: started and stopped with the loop
    batch: int = 500
    clock: Callable[[], str] = iso
    # A batch answered with a server error is tried this many times in all, waiting
    # retry_backoff seconds after the first failure, twice as long after each next one (at
    # most retry_backoff_max), and then set aside beside the spool so the rest flows.
    max_tries: int = field(default_factory=lambda: max(
        1, int(env_number("FLEETWATCH_AGENT_MAX_TRIES", 5))))
    retry_backoff: float = field(default_factory=lambda: max(
        0.0, env_number("FLEETWATCH_AGENT_RETRY_BACKOFF", 10.0)))
    retry_backoff_max: float = 300.0
    now: Callable[[], float] = time.time
    # Set by a reader thread when it spooled something urgent: the loop sends at once.
    wake: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)
    version_ok: bool = False
    restart_needed: bool = False  # stopped so that the service manager starts it afresh

    def urgent(self, signals: list[dict[str, Any]]) -> None:
        """From a reader thread: spool (durably) and have the loop send now."""
        self.spool.add([{"at": self.clock(), **s} for s in signals])
        self.wake.set()

    def collect(self) -> int:
        signals = []
        for source in self.sources:
            try:
                signals += source.poll()
            except Exception as exc:  # one broken source must not stop the others
                log.exception("agent source %s failed: %s", type(source).__name__, exc)
        return self.spool.add([{"at": self.clock(), **s} for s in signals])

    def check_version(self) -> None:
        """Raises VersionMismatch when FleetWatch does not take this agent; an unreachable
        FleetWatch is asked again before the next send."""
        try:
            log.info("%s", self.pusher.check_version())
            self.version_ok = True
        except VersionMismatch:
            raise
        except PushFailed as exc:
            log.warning("version check postponed (signals are spooled meanwhile): %s", exc)

    def flush(self, deadline: float | None = None) -> int:
        """Send the spool, oldest first, until it is empty or a send fails; a stop
        (``stopping``) ends it after the batch under way, unless a ``deadline``
        (time.monotonic()) is given for a last send. Returns how many signals left the spool
        (stored, or set aside)."""
        sent = 0
        while True:
            if deadline is None and self.stopping.is_set():
                return sent
            if deadline is not None and time.monotonic() > deadline:
                log.warning("stopping with %d signal(s) in the spool", len(self.spool))
                return sent
            batch = self.spool.batch(self.batch)
            if batch is None or batch.next_at > self.now():
                return sent  # empty, or this batch's next try is not due yet
            try:
                self.pusher.push(batch.signals, key=batch.key)
            except VersionMismatch as exc:
                log.error("FleetWatch refuses this agent, %d signal(s) kept in the spool: %s",
                          len(self.spool), exc)
                return sent
            except PushFailed as exc:
                if exc.status == 413 and len(batch.signals) > 1:
                    # Over FleetWatch's (or a proxy's) limit: smaller batches from now on.
                    self.batch = max(1, len(batch.signals) // 2)
                    self.spool.reseal(batch, self.batch)
                    log.warning("FleetWatch took no batch of %d (413): sending %d at a time",
                                len(batch.signals), self.batch)
                    continue
                if exc.retry and not exc.bounded:
                    if exc.status == 401:
                        log.error("FleetWatch does not know this node's token (401); %d "
                                  "signal(s) kept in the spool: %s", len(self.spool), exc)
                    else:
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
        """Read the sources every ``interval`` seconds (in a thread of its own: an NVML call
        that hangs on a bad GPU must not hold back what the readers spooled) and send
        whenever something was spooled. ``passes``: stop after that many readings (tests);
        ``stopping`` (SIGTERM) ends it after a last send of at most ``STOP_SEND`` seconds."""
        interval = max(interval, MIN_INTERVAL)
        poller = threading.Thread(target=self._poll_loop, args=(interval, passes),
                                  name="readings", daemon=True)
        started: list[Any] = []
        try:
            for reader in (self.kernel, self.events):
                if reader is not None:
                    reader.start()
                    started.append(reader)
            poller.start()
            while not self.stopping.is_set():
                self.wake.wait(interval)  # woken by a reader, or a retry that came due
                self.wake.clear()
                self._send()
            self._send(deadline=time.monotonic() + self.STOP_SEND)
        finally:
            self.stopping.set()
            for reader in started:
                with contextlib.suppress(Exception):
                    reader.stop()
            poller.join(timeout=5)

    STOP_SEND = 5.0

    def _poll_loop(self, interval: float, passes: int | None) -> None:
        done = 0
        while not self.stopping.is_set():
            try:
                self.collect()
            except Exception:  # a spool that cannot be written is counted there; the rest
                log.exception("reading the sources failed")
            done += 1
            self.wake.set()
            if any(getattr(source, "restart_needed", False) for source in self.sources):
                log.error("NVML needs this process to start again (a new driver under the old "
                          "library): stopping")
                self.restart_needed = True
                self.stopping.set()
                return
            if passes is not None and done >= passes:
                self.stopping.set()
                self.wake.set()
                return
            self.stopping.wait(interval)

    def _send(self, deadline: float | None = None) -> None:
        if not self.version_ok:
            self.check_version()
            if not self.version_ok:
                return
        self.flush(deadline)
