"""The on-disk spool: every signal is written here first and leaves only once FleetWatch
stored it (or refused it: set aside beside the spool for a person). One JSON object per line,
oldest first; a crash or a full disk loses nothing already written."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from collectors.knowledge import agent as proto

log = logging.getLogger(__name__)
T = TypeVar("T")

# The spool's cap on disk (FLEETWATCH_AGENT_SPOOL_MAX_MB): days of an ordinary node's changes.
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

# A sealed batch's header line at the top of the spool (see Spool.batch).
BATCH_HEADER = "_batch"


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    """Run a Spool method under its lock: a rewrite of the file must not race an append."""

    @functools.wraps(method)
    def run(self: Spool, *args: Any, **kwargs: Any) -> T:
        with self.lock:
            return method(self, *args, **kwargs)

    return run


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

    def __init__(self, path: str | Path, *, node: str = "", max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], str] | None = None) -> None:
        self.path = Path(path)
        self.node = node
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.clock = clock
        # Records not written since the spool reached its cap (reported when it has room).
        self.dropped = 0
        self.dropped_since: str | None = None
        # add() runs in the reader threads, batch()/drop() in the pusher: one at a time.
        self.lock = threading.RLock()

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def add(self, signals: Iterable[dict[str, Any]]) -> int:
        """Append signals, durably. At the cap, newer ones are not written (the older ones
        keep their order and are sent first when FleetWatch is back): they are counted, an
        error is logged once, and a ``spool_full`` report goes out once there is room.
        Returns how many were written."""
        lines = [json.dumps(s, separators=(",", ":")) + "\n" for s in signals]
        if not lines:
            return 0
        with self.lock:
            size = self.size()
            if self.dropped and size < self.max_bytes * 0.9:
                lines.insert(0, json.dumps(self._full_report(), separators=(",", ":")) + "\n")
                log.warning("spool has room again: %d record(s) were dropped while it was full",
                            self.dropped)
                self.dropped, self.dropped_since = 0, None
            kept = []
            for line in lines:
                if size + len(line) > self.max_bytes:
                    if not self.dropped:
                        self.dropped_since = self.clock() if self.clock else None
                        log.error("spool %s is full (%d bytes, cap %d): newer records are "
                                  "dropped until FleetWatch takes the older ones",
                                  self.path, size, self.max_bytes)
                    self.dropped += 1
                    continue
                size += len(line)
                kept.append(line)
            if kept:
                with self.path.open("a") as fh:
                    fh.write("".join(kept))
                    fh.flush()
                    os.fsync(fh.fileno())
        return len(kept)

    def _full_report(self) -> dict[str, Any]:
        report = {"source": "kernel", "node": self.node, "event": proto.SPOOL_FULL,
                  "dropped": self.dropped, "since": self.dropped_since,
                  "message": f"fleetwatch-agent: spool full (cap {self.max_bytes} bytes): "
                             f"{self.dropped} record(s) dropped since {self.dropped_since}"}
        if self.clock:
            report["at"] = self.clock()
        return report

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

    @_locked
    def pending(self, limit: int) -> list[dict[str, Any]]:
        return self._read(limit)[1]

    @_locked
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

    @_locked
    def tried(self, batch: SpooledBatch, error: str) -> None:
        """Record a failed try of the sealed batch (``batch.tries``, ``batch.next_at``)."""
        _, signals = self._read()
        self._write({"key": batch.key, "count": len(batch.signals), "tries": batch.tries,
                     "next_at": batch.next_at, "error": error[:300]}, signals)

    @_locked
    def drop(self, count: int) -> None:
        """Remove the first ``count`` signals (sent) and the batch header, atomically: a crash
        keeps them all."""
        self._write(None, self._read()[1][count:])

    @_locked
    def __len__(self) -> int:
        return len(self._read()[1])
