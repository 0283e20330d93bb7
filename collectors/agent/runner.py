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


def pci_key(text: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of the first PCI address in ``text``: NVML writes
    ``00000000:9B:00.0``, the kernel ``0000:9b:00.0`` and the driver's XID lines
    ``PCI:0000:9b:00``."""
    match = _PCI.search(text)
    return (int(match[1], 16), int(match[2], 16), int(match[3], 16)) if match else None


def env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw.strip() else default
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, raw, default)
        return default


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

    def save(self, **values: Any) -> None:
        self.data.update(values, boot_id=boot_id(), saved_at=iso())
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
            key = pci_key(line.message)
            if key and self.gpu_for_pci:
                gpu = self.gpu_for_pci(key)
                if gpu is not None:
                    record["gpu"] = gpu
            out.append(record)
        return out

    def pass_once(self, timeout: float) -> int:
        lines = self.reader.read(timeout)
        records = self.records(lines)
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
            except VersionMismatch as exc:
                log.error("FleetWatch refuses this agent, %d signal(s) kept in the spool: %s",
                          len(self.spool), exc)
                return sent
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
        """Read every ``interval`` seconds and send; send at once whenever a reader thread
        spooled something urgent. ``passes``: stop after that many periodic passes (tests);
        ``stopping`` (SIGTERM) ends it after a last send."""
        for reader in (self.kernel, self.events):
            if reader is not None:
                reader.start()
        try:
            done = 0
            while not self.stopping.is_set() and (passes is None or done < passes):
                due = time.monotonic() + interval
                self.collect()
                self._send()
                done += 1
                # Until the next pass: send whatever the readers spool, as it comes.
                while not self.stopping.is_set():
                    left = due - time.monotonic()
                    if left <= 0 or not self.wake.wait(left):
                        break
                    self.wake.clear()
                    self._send()
            self._send()
        finally:
            for reader in (self.kernel, self.events):
                if reader is not None:
                    with contextlib.suppress(Exception):
                        reader.stop()

    def _send(self) -> None:
        if not self.version_ok:
            self.check_version()
            if not self.version_ok:
                return
        self.flush()
