"""The kernel log, as the kernel serves it.

``/dev/kmsg`` is not a file: each ``read()`` returns one whole record
(``prio,seq,usec,flags[,...];message`` then optional `` KEY=value`` lines), there is no size
and no byte offset, records carry a 64-bit sequence number, and a reader whose next record the
kernel has already overwritten gets ``EPIPE`` once and then continues at the oldest record
still held. Non-printable bytes (and the backslash) of a message are escaped as ``\\xNN``, so
a message the driver printed over several lines arrives as one record with ``\\x0a`` in it.
Opening it needs CAP_SYSLOG where ``kernel.dmesg_restrict=1``.

Where it cannot be read (no CAP_SYSLOG, a container without the device), ``journalctl -k -f
-o json`` follows the kernel messages journald keeps, resuming after its cursor. A regular
file (a log a site forwards, a test's fixture) is followed by byte offset.

Each reader yields ``KernelLine``s and a position (sequence number, cursor or offset) that the
agent keeps in its state file once the lines are in its spool, so a restart resumes after the
last line sent and never sends one twice.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import select
import shlex
import signal
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

log = logging.getLogger(__name__)

# The kernel refuses a read into a buffer smaller than the record (EINVAL); a record is at
# most CONSOLE_EXT_LOG_MAX (8 KiB) with its dictionary.
READ_SIZE = 16384
# A file is followed at most this much per read (a large backlog, a few reads).
READ_FILE_MAX = 4 * 1024 * 1024
_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")
# A record's header: "6,1234,5678,-;" (more comma fields may follow the flags on newer kernels)
_HEADER = re.compile(r"^(\d+),(\d+),(\d+),([^,;]*)[^;]*;")


@dataclass(frozen=True)
class KernelLine:
    message: str
    seq: int | None = None  # /dev/kmsg's sequence number
    usec: int | None = None  # microseconds since boot (CLOCK_MONOTONIC), /dev/kmsg only
    wall: float | None = None  # seconds since the epoch, when the source says
    fields: dict[str, str] = field(default_factory=dict)  # SUBSYSTEM=pci, DEVICE=+pci:0000:...

    def at(self, boot_wall: float) -> float:
        """When the kernel logged it, as wall-clock seconds."""
        if self.wall is not None:
            return self.wall
        if self.usec is not None:
            return boot_wall + self.usec / 1e6
        return time.time()


def unescape(raw: bytes) -> str:
    return _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), raw).decode("utf-8", "replace")


@dataclass(frozen=True)
class KmsgRecord:
    priority: int
    seq: int
    usec: int
    flags: str
    message: str
    fields: dict[str, str]


def parse_record(raw: bytes) -> KmsgRecord | None:
    """One ``/dev/kmsg`` record, or None when it is not one (never raises)."""
    head, sep, rest = raw.partition(b";")
    if not sep:
        return None
    match = _HEADER.match(head.decode("ascii", "replace") + ";")
    if match is None:
        return None
    body, *dictionary = rest.rstrip(b"\n").split(b"\n")
    fields = {}
    for line in dictionary:
        if line.startswith(b" ") and b"=" in line:
            key, _, value = line[1:].partition(b"=")
            fields[key.decode("ascii", "replace")] = unescape(value)
    return KmsgRecord(int(match[1]), int(match[2]), int(match[3]), match[4], unescape(body),
                      fields)


class KernelReader(Protocol):
    """A source of kernel lines. ``read`` returns what is there now (waiting at most
    ``timeout`` seconds for the first), never raising for what the kernel or journald do."""

    kind: str

    def read(self, timeout: float) -> list[KernelLine]: ...

    def position(self) -> dict[str, Any]:
        """Where to resume after the lines read so far (kept in the state file)."""
        ...

    def take_lost(self) -> int:
        """Records lost since the last call (overwritten before they were read)."""
        ...

    def take_trouble(self) -> list[str]:
        """What went wrong with the reader since the last call (it goes on, or will)."""
        ...

    def close(self) -> None: ...


class KmsgReader:
    """``/dev/kmsg``. ``after_seq``: resume after this sequence number (same boot); None:
    start at the end (first start: old records were no one's business); -1: from the oldest
    record held (a new boot: its records, the driver's probe among them, are all new)."""

    kind = "kmsg"

    def __init__(self, path: str | Path = "/dev/kmsg", after_seq: int | None = None) -> None:
        self.path = str(path)
        # Non-blocking: read returns EAGAIN when no record is waiting; poll() says when one is.
        self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self.last_seq: int | None = after_seq if after_seq is not None and after_seq >= 0 else None
        self.lost = 0
        os.lseek(self.fd, 0, os.SEEK_SET)
        if after_seq is None:
            # "From the end", but knowing where the end is: the records held now are read and
            # dropped (SEEK_END would leave the next sequence number unknown, and a first
            # overrun could not be counted).
            for record in self._records():
                self.last_seq = record.seq
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLIN)
        # KERN_CONT fragments (flags "c" then "+", kernels before 4.9): joined into one line.
        self._pending: KmsgRecord | None = None

    def _records(self) -> Iterator[KmsgRecord]:
        while True:
            try:
                raw = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                return
            except BrokenPipeError:
                # Our next record was overwritten; the next read gives the oldest one held,
                # and the gap in sequence numbers says how many were lost.
                log.warning("kernel log overrun: records were overwritten before they were read")
                continue
            except InterruptedError:
                continue
            if not raw:
                return
            record = parse_record(raw)
            if record is None:
                log.warning("unreadable /dev/kmsg record skipped: %.120r", raw)
                continue
            yield record

    def read(self, timeout: float) -> list[KernelLine]:
        if not self.poller.poll(max(0, int(timeout * 1000))):
            return self._flush_pending([])
        out: list[KernelLine] = []
        for record in self._records():
            if self.last_seq is not None:
                if record.seq <= self.last_seq:
                    continue  # sent before a restart
                if record.seq > self.last_seq + 1:
                    self.lost += record.seq - self.last_seq - 1
            self.last_seq = record.seq
            if "+" in record.flags and self._pending is not None:
                pending = self._pending
                self._pending = KmsgRecord(pending.priority, record.seq, pending.usec,
                                           pending.flags, pending.message + record.message,
                                           {**pending.fields, **record.fields})
                continue
            self._flush_pending(out)
            if "c" in record.flags:
                self._pending = record
                continue
            out.append(KernelLine(record.message, record.seq, record.usec,
                                  fields=record.fields))
        return self._flush_pending(out)

    def _flush_pending(self, out: list[KernelLine]) -> list[KernelLine]:
        if self._pending is not None:
            p, self._pending = self._pending, None
            out.append(KernelLine(p.message, p.seq, p.usec, fields=p.fields))
        return out

    def position(self) -> dict[str, Any]:
        # The boot with it: sequence numbers start again at every boot.
        return ({"kmsg_seq": self.last_seq, "kmsg_boot": boot_id()}
                if self.last_seq is not None else {})

    def take_lost(self) -> int:
        lost, self.lost = self.lost, 0
        return lost

    def take_trouble(self) -> list[str]:
        return []

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class JournalReader:
    """``journalctl -k -f -o json``: the kernel messages journald keeps, for a node where
    /dev/kmsg cannot be read. Resumes after ``cursor``; without one, starts at the end. A
    journalctl that stops (journald restarted, the journal rotated away) is reported and
    started again after its last cursor, ``RESTART_AFTER`` seconds later."""

    kind = "journal"
    RESTART_AFTER = 5.0

    def __init__(self, command: str = "journalctl", cursor: str | None = None) -> None:
        self.command, self.cursor = command, cursor
        self.trouble: list[str] = []
        self._restart_at: float | None = None
        self._start()

    def _start(self) -> None:
        argv = [*shlex.split(self.command), "--dmesg", "--follow", "--output=json", "--no-pager"]
        argv += [f"--after-cursor={self.cursor}"] if self.cursor else ["--lines=0"]
        self.argv = argv
        # Its own process group, so a wrapper (nsenter, chroot) goes with it on close.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._buffer = b""
        self._out = self.proc.stdout
        os.set_blocking(self._out.fileno(), False)
        self.poller = select.poll()
        self.poller.register(self._out.fileno(), select.POLLIN)
        # Its complaints are read as they come (a full pipe would stop it) and the last
        # few kept for the report when it stops.
        self._errors: deque[str] = deque(maxlen=20)
        threading.Thread(target=self._drain_errors, args=(self.proc.stderr,),
                         name="journalctl-stderr", daemon=True).start()

    def _drain_errors(self, stream: IO[bytes]) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in stream:
                self._errors.append(line.decode("utf-8", "replace").rstrip())

    def failed(self) -> str | None:
        """Why journalctl stopped, if it did."""
        code = self.proc.poll()
        if code is None:
            return None
        time.sleep(0.05)  # its last words, read by the stderr thread
        return (f"{shlex.join(self.argv)} exited with {code}: "
                f"{' / '.join(self._errors)[-300:]}")

    def read(self, timeout: float) -> list[KernelLine]:
        if self._restart_at is not None:
            wait = self._restart_at - time.monotonic()
            if wait > 0:
                time.sleep(min(timeout, wait))
                return []
            self._restart_at = None
            self._start()
        ended = False
        if self.poller.poll(max(0, int(timeout * 1000))):
            try:
                while chunk := os.read(self._out.fileno(), 65536):
                    self._buffer += chunk
                ended = True  # end of file: journalctl is gone
            except BlockingIOError:
                pass
        *complete, self._buffer = self._buffer.split(b"\n")
        out = [line for line in map(self._line, complete) if line is not None]
        if ended:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)  # its exit status, which comes just after its output ends
            why = self.failed() or f"{shlex.join(self.argv)} closed its output"
            log.error("kernel log: %s; starting it again in %.0f s", why, self.RESTART_AFTER)
            self.trouble.append(why)
            self._stop_process()
            self._restart_at = time.monotonic() + self.RESTART_AFTER
        return out

    def _line(self, raw: bytes) -> KernelLine | None:
        if not raw.strip():
            return None
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError:
            log.warning("unreadable journal entry skipped: %.120r", raw)
            return None
        if not isinstance(entry, dict):
            return None
        self.cursor = entry.get("__CURSOR") or self.cursor
        message = entry.get("MESSAGE")
        if isinstance(message, list):  # journald sends non-UTF-8 messages as a byte array
            message = bytes(b & 0xFF for b in message if isinstance(b, int)).decode("utf-8",
                                                                                    "replace")
        if not isinstance(message, str):
            return None
        wall = None
        with contextlib.suppress(TypeError, ValueError):
            wall = int(entry.get("__REALTIME_TIMESTAMP")) / 1e6  # type: ignore[arg-type]
        fields = {k.lstrip("_"): str(v) for k, v in entry.items()
                  if k in ("_KERNEL_SUBSYSTEM", "_KERNEL_DEVICE", "_BOOT_ID")}
        return KernelLine(message, wall=wall, fields=fields)

    def position(self) -> dict[str, Any]:
        return {"journal_cursor": self.cursor} if self.cursor else {}

    def take_lost(self) -> int:
        return 0

    def take_trouble(self) -> list[str]:
        trouble, self.trouble = self.trouble, []
        return trouble

    def _stop_process(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(OSError):
            self._out.close()

    def close(self) -> None:
        self._stop_process()


class FileReader:
    """A plain file of kernel lines (plain, or ``/dev/kmsg``'s record form one per line),
    followed by byte offset; a shorter file was rotated and is read again from its start."""

    kind = "file"

    def __init__(self, path: str | Path, offset: int | None = None) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size if self.path.exists() else 0
        self.offset = size if offset is None or offset > size else offset

    def read(self, timeout: float) -> list[KernelLine]:
        deadline = time.monotonic() + timeout
        while True:
            lines = self._read_now()
            if lines or time.monotonic() >= deadline:
                return lines
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _read_now(self) -> list[KernelLine]:
        if not self.path.exists():
            return []
        if self.path.stat().st_size < self.offset:
            self.offset = 0
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read(READ_FILE_MAX)  # the rest on the next read
        complete = chunk.rfind(b"\n") + 1  # a half-written last line waits for its end
        self.offset += complete
        out = []
        for raw in chunk[:complete].splitlines():
            record = parse_record(raw)
            out.append(KernelLine(record.message, usec=record.usec) if record
                       else KernelLine(raw.decode("utf-8", "replace")))
        return out

    def position(self) -> dict[str, Any]:
        return {"file": str(self.path), "file_offset": self.offset}

    def take_lost(self) -> int:
        return 0

    def take_trouble(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def open_kernel_log(path: str, state: dict[str, Any], *, journal_command: str = "journalctl",
                    mode: str = "auto") -> tuple[KernelReader | None, str]:
    """The best reader this node allows, resuming from ``state`` (the agent's state file):
    ``/dev/kmsg`` (or the character device at ``path``), else journald, else nothing; a
    regular file at ``path`` is followed as a file. Returns the reader (None: no kernel log)
    and what was tried, for the log and the agent's report."""
    kmsg_boot = state.get("kmsg_boot")
    same_boot = kmsg_boot is not None and kmsg_boot == boot_id() != ""
    tried = []
    if mode in ("auto", "kmsg", "file"):
        try:
            st = os.stat(path)
        except OSError as exc:
            st = None
            tried.append(f"{path}: {exc.strerror or exc}")
        if st is not None and stat.S_ISCHR(st.st_mode) and mode != "file":
            # Same boot: after the last record spooled. Another boot: all of this one (the
            # driver's probe messages among them). Never read before: from the end.
            after = state.get("kmsg_seq") if same_boot else (-1 if kmsg_boot else None)
            try:
                return KmsgReader(path, after), f"reading {path}"
            except OSError as exc:
                why = ("not permitted: no CAP_SYSLOG where kernel.dmesg_restrict=1, or a "
                       "container not granted the device (its device cgroup)"
                       if exc.errno == errno.EPERM else exc.strerror or str(exc))
                tried.append(f"{path}: {why}")
        elif st is not None and stat.S_ISREG(st.st_mode):
            offset = state.get("file_offset") if state.get("file") == str(path) else None
            return FileReader(path, offset), f"following the file {path}"
    if mode in ("auto", "journal"):
        cursor = state.get("journal_cursor")
        try:
            reader = JournalReader(journal_command, cursor)
        except OSError as exc:
            tried.append(f"{journal_command}: {exc.strerror or exc}")
        else:
            time.sleep(0.2)  # journalctl fails at once when it cannot read the journal
            why = reader.failed()
            if why is None:
                return reader, f"following journald ({journal_command})"
            tried.append(why)
    return None, "; ".join(tried) or f"kernel log off (--kernel-log {mode})"
