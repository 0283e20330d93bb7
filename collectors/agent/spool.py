"""The on-disk spool: every signal is written here first and leaves only once FleetWatch
stored it (or refused it: set aside beside the spool for a person). A crash or a full disk
loses nothing already written.

``spool.jsonl`` holds the records, one JSON object per line, oldest first, and is only ever
appended to. ``spool.head`` (replaced atomically) says where the unsent records start (a byte
offset) and which batch at that point is sealed: its idempotency key, how many records, its
failed tries. Sending a batch and forgetting it therefore costs what the batch costs, not what
the spool holds: after an outage of days the backlog drains in batches at the speed of the
network. The sent part of the file is cut off now and then (``COMPACT_BYTES``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from collectors.knowledge import agent as proto

log = logging.getLogger(__name__)
T = TypeVar("T")

# The spool's cap on disk (FLEETWATCH_AGENT_SPOOL_MAX_MB): days of an ordinary node's changes.
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
# Cut the sent records off the file once they take this much and half of it.
COMPACT_BYTES = 8 * 1024 * 1024
# The header line on top of a spool written by agents before 0.2 (read, then converted).
BATCH_HEADER = "_batch"


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    """Run a Spool method under its lock: the reader threads append while the sender reads
    and moves the head."""

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


def _fsync_write(path: Path, data: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


class Spool:
    """Signals waiting to be sent, oldest first. The batch being sent is sealed (in the head
    file), so a retry, after a crash too, sends the same signals under the same key and
    FleetWatch stores them once."""

    def __init__(self, path: str | Path, *, node: str = "", max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], str] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.head_path = self.path.with_name(self.path.name + ".head")
        self.node = node
        self.max_bytes = max_bytes
        self.clock = clock
        # Records not written since the spool reached its cap (reported when it has room).
        self.dropped = 0
        self.dropped_since: str | None = None
        self.lock = threading.RLock()
        self.head: dict[str, Any] = self._load_head()
        self._count = sum(1 for _ in self._records(self.head["offset"]))

    # --- the head -------------------------------------------------------------------------

    def _load_head(self) -> dict[str, Any]:
        head: dict[str, Any] = {"offset": 0}
        try:
            loaded = json.loads(self.head_path.read_text())
            if isinstance(loaded, dict) and isinstance(loaded.get("offset"), int):
                head = loaded
        except FileNotFoundError:
            head = self._convert_old_header()
        except (OSError, ValueError) as exc:
            log.warning("spool head %s unreadable (%s): sending the spool from its start",
                        self.head_path, exc)
        head["offset"] = min(max(0, int(head["offset"])), self.size())
        return head

    def _convert_old_header(self) -> dict[str, Any]:
        """An older agent's spool keeps its sealed batch as a header line on top."""
        with contextlib.suppress(OSError, ValueError), self.path.open("rb") as fh:
            first = fh.readline()
            record = json.loads(first)
            if isinstance(record, dict) and isinstance(record.get(BATCH_HEADER), dict):
                old = record[BATCH_HEADER]
                head = {"offset": len(first), "key": old.get("key"),
                        "count": int(old.get("count", 0)), "tries": int(old.get("tries", 0)),
                        "next_at": float(old.get("next_at", 0.0))}
                _fsync_write(self.head_path, json.dumps(head))
                return head
        return {"offset": 0}

    def _save_head(self) -> None:
        _fsync_write(self.head_path, json.dumps(self.head))

    # --- reading --------------------------------------------------------------------------

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _records(self, offset: int, limit: int | None = None
                 ) -> Iterator[tuple[int, dict[str, Any]]]:
        """(the byte offset after it, record) for up to ``limit`` records from ``offset``."""
        if limit == 0 or not self.path.exists():
            return
        found = 0
        with self.path.open("rb") as fh:
            fh.seek(offset)
            while True:
                line = fh.readline()
                if not line.endswith(b"\n"):
                    return  # the end, or a line still being written
                offset += len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    # A line torn by a crash or a full disk while it was written (likely on
                    # the very node that is failing): skipped rather than stopping the agent.
                    log.warning("spool %s: unreadable line skipped: %.120r", self.path, line)
                    continue
                if not isinstance(record, dict) or BATCH_HEADER in record:
                    continue
                yield offset, record
                found += 1
                if limit is not None and found >= limit:
                    return

    @_locked
    def pending(self, limit: int) -> list[dict[str, Any]]:
        return [record for _, record in self._records(self.head["offset"], limit)]

    def __len__(self) -> int:
        return self._count

    # --- writing --------------------------------------------------------------------------

    def add(self, signals: Iterable[dict[str, Any]]) -> int:
        """Append signals, durably. At the cap, newer ones are not written (the older ones
        keep their order and are sent first when FleetWatch is back): they are counted, an
        error is logged once, and a ``spool_full`` report goes out once there is room. A
        write the disk refuses counts them the same way. Returns how many were written."""
        lines = [json.dumps(s, separators=(",", ":")) + "\n" for s in signals]
        if not lines:
            return 0
        with self.lock:
            waiting = self.size() - self.head["offset"]
            if self.dropped and waiting < self.max_bytes * 0.9:
                lines.insert(0, json.dumps(self._full_report(), separators=(",", ":")) + "\n")
                log.warning("spool has room again: %d record(s) were dropped while it was full",
                            self.dropped)
                self.dropped, self.dropped_since = 0, None
            kept: list[str] = []
            for line in lines:
                if waiting + len(line) > self.max_bytes:
                    self._drop(1, f"is full ({waiting} bytes waiting, cap {self.max_bytes})")
                    continue
                waiting += len(line)
                kept.append(line)
            if not kept:
                return 0
            try:
                with self.path.open("ab") as fh:
                    start = fh.tell()
                    try:
                        if start and not self._ends_with_newline():
                            fh.write(b"\n")  # a torn last line stays alone, not glued to ours
                        fh.write("".join(kept).encode("utf-8", "surrogatepass"))
                        fh.flush()
                        os.fsync(fh.fileno())
                    except OSError:
                        with contextlib.suppress(OSError):
                            fh.truncate(start)  # not half there: counted as dropped
                        raise
            except OSError as exc:  # a full disk, a read-only remount: counted, not fatal
                self._drop(len(kept), f"cannot be written ({exc.strerror or exc})")
                return 0
            self._count += len(kept)
        return len(kept)

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"

    def _drop(self, count: int, why: str) -> None:
        if not self.dropped:
            self.dropped_since = self.clock() if self.clock else None
            log.error("spool %s %s: newer records are dropped until FleetWatch takes the older "
                      "ones", self.path, why)
        self.dropped += count

    def _full_report(self) -> dict[str, Any]:
        report = {"source": "kernel", "node": self.node, "event": proto.SPOOL_FULL,
                  "dropped": self.dropped, "since": self.dropped_since,
                  "message": f"fleetwatch-agent: spool full (cap {self.max_bytes} bytes): "
                             f"{self.dropped} record(s) dropped since {self.dropped_since}"}
        if self.clock:
            report["at"] = self.clock()
        return report

    # --- batches --------------------------------------------------------------------------

    @_locked
    def batch(self, limit: int) -> SpooledBatch | None:
        """The sealed batch at the head of the spool, sealing up to ``limit`` signals with a
        fresh key when none is."""
        head = self.head
        if head.get("key") and int(head.get("count", 0)) > 0:
            signals = [r for _, r in self._records(head["offset"], int(head["count"]))]
            if signals:
                return SpooledBatch(str(head["key"]), signals, int(head.get("tries", 0)),
                                    float(head.get("next_at", 0.0)))
        signals = [r for _, r in self._records(head["offset"], limit)]
        if not signals:
            return None
        self.head = {"offset": head["offset"], "key": uuid.uuid4().hex, "count": len(signals),
                     "tries": 0}
        self._save_head()
        return SpooledBatch(self.head["key"], signals)

    @_locked
    def reseal(self, batch: SpooledBatch, count: int) -> None:
        """Seal the first ``count`` of the batch's signals as a batch of their own, under a
        new key (FleetWatch said the batch is too large)."""
        self.head = {"offset": self.head["offset"], "key": uuid.uuid4().hex,
                     "count": max(1, count), "tries": 0}
        self._save_head()

    @_locked
    def tried(self, batch: SpooledBatch, error: str) -> None:
        """Record a failed try of the sealed batch (``batch.tries``, ``batch.next_at``)."""
        self.head.update(tries=batch.tries, next_at=batch.next_at, error=error[:300])
        self._save_head()

    @_locked
    def drop(self, count: int) -> None:
        """Forget the first ``count`` signals (sent, or set aside) and their seal; a crash
        before the head is written sends them again, under their key (stored once)."""
        offset = self.head["offset"]
        gone = 0
        for offset, _ in self._records(self.head["offset"], count):  # noqa: B007
            gone += 1
        self.head = {"offset": offset}
        self._save_head()
        self._count = max(0, self._count - gone)
        if offset >= COMPACT_BYTES and offset * 2 >= self.size():
            self._compact()

    def _compact(self) -> None:
        """Cut the sent records off the file (the rest is copied once)."""
        offset = self.head["offset"]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with self.path.open("rb") as src, tmp.open("wb") as dst:
            src.seek(offset)
            while chunk := src.read(1 << 20):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        # The head first: a crash between the two leaves offset 0 on the old file, which
        # sends its sent records again (under new keys: stored twice) rather than losing any.
        self.head = {"offset": 0}
        self._save_head()
        tmp.replace(self.path)
