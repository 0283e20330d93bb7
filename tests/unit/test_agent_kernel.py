"""The agent's kernel log readers against the real ``/dev/kmsg`` of this machine (root may
write a line to it, which puts the line in the kernel log), journald's JSON through a
journalctl that prints what the real one prints, and the record format's corners."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from collectors.agent import kernel
from collectors.agent.kernel import (
    JournalReader,
    KmsgReader,
    boot_id,
    open_kernel_log,
    parse_record,
)
from collectors.agent.runner import KernelLog, StateFile
from collectors.knowledge import agent as proto

KMSG = Path("/dev/kmsg")
needs_kmsg = pytest.mark.skipif(
    not (KMSG.exists() and os.access(KMSG, os.R_OK | os.W_OK)),
    reason="needs /dev/kmsg, readable and writable (root): CI runs as root")
# Under xdist, every test that reads or writes this machine's real /dev/kmsg runs on one worker,
# one at a time: another's reader would take this module's lines (tests/harness/parallel.py).
pytestmark = pytest.mark.xdist_group("kmsg")


def kmsg_write(text: str) -> None:
    """Put a line in the kernel log, as the kernel would (priority 3: an error)."""
    with KMSG.open("w") as fh:
        fh.write(f"<3>{text}\n")


def xid_line(marker: str) -> str:
    # The form current drivers print; the marker keeps this test's lines apart from others'.
    return (f"NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen "
            f"off the bus. [fleetwatch test {marker}]")


def read_until(reader: kernel.KernelReader, marker: str, tries: int = 20) -> list[Any]:
    got: list[Any] = []
    for _ in range(tries):
        got += reader.read(0.2)
        if any(marker in line.message for line in got):
            break
    return got


# --- the record format --------------------------------------------------------------------


def test_a_record_with_its_dictionary_and_escapes_is_read_whole() -> None:
    raw = (b"3,4711,123456789,-,caller=T12;NVRM: The NVIDIA GPU 0000:47:00.0\\x0aNVRM: has "
           b"fallen off the bus \\x5c o/ caf\\xc3\\xa9\n SUBSYSTEM=pci\n DEVICE=+pci:0000:47:00.0\n")
    record = parse_record(raw)
    assert record is not None
    assert (record.priority, record.seq, record.usec, record.flags) == (3, 4711, 123456789, "-")
    # The driver's multi-line message is one record; its newline and a backslash were escaped.
    assert record.message == ("NVRM: The NVIDIA GPU 0000:47:00.0\nNVRM: has fallen off the bus "
                              "\\ o/ café")
    assert record.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:47:00.0"}


@pytest.mark.parametrize("raw", [b"", b"no header at all", b"x,y,z,-;text", b"6,1;short"])
def test_what_is_not_a_record_is_skipped(raw: bytes) -> None:
    assert parse_record(raw) is None


# --- the real /dev/kmsg -------------------------------------------------------------------


@needs_kmsg
def test_kmsg_starts_at_the_end_and_reads_a_new_line_once() -> None:
    marker = uuid.uuid4().hex
    kmsg_write(f"before the agent {marker}")
    reader = KmsgReader(KMSG)
    try:
        kmsg_write(xid_line(marker))
        got = read_until(reader, marker)
        mine = [line for line in got if marker in line.message]
        # The line from before it started is not read; the new one is, whole, with its place.
        assert [line.message for line in mine] == [xid_line(marker)]
        assert mine[0].seq is not None and mine[0].usec is not None
        assert reader.position() == {"kmsg_seq": got[-1].seq, "kmsg_boot": boot_id()}
        assert not [line for line in reader.read(0.1) if marker in line.message]
        assert reader.take_lost() == 0
    finally:
        reader.close()


@needs_kmsg
def test_kmsg_resumes_after_the_last_sequence_number_it_kept() -> None:
    marker = uuid.uuid4().hex
    first = KmsgReader(KMSG)
    try:
        kmsg_write(f"one {marker}")
        kmsg_write(f"two {marker}")
        got = [line for line in read_until(first, f"two {marker}") if marker in line.message]
        assert [line.message for line in got] == [f"one {marker}", f"two {marker}"]
    finally:
        first.close()
    # Restarted after it spooled "one": it reads "two" (and what came after), not "one".
    again = KmsgReader(KMSG, after_seq=got[0].seq)
    try:
        kmsg_write(f"three {marker}")
        seen = [line.message for line in read_until(again, f"three {marker}")
                if marker in line.message]
        assert seen == [f"two {marker}", f"three {marker}"]
    finally:
        again.close()
    # A new boot (the state file names another): everything the kernel still holds is new,
    # the driver's messages at probe among them.
    fresh = KmsgReader(KMSG, after_seq=-1)
    try:
        assert f"one {marker}" in [line.message for line in read_until(fresh, f"three {marker}")]
    finally:
        fresh.close()


@needs_kmsg
def test_open_kernel_log_resumes_in_the_same_boot_and_rereads_after_a_reboot() -> None:
    marker = uuid.uuid4().hex
    kmsg_write(f"kept {marker}")
    reader, how = open_kernel_log(str(KMSG), {})
    assert reader is not None and reader.kind == "kmsg" and how == "reading /dev/kmsg"
    reader.close()
    probe = KmsgReader(KMSG, after_seq=-1)
    seq = next(line.seq for line in read_until(probe, f"kept {marker}", tries=200)
               if f"kept {marker}" in line.message)
    probe.close()
    same, _ = open_kernel_log(str(KMSG), {"kmsg_boot": boot_id(), "kmsg_seq": seq - 1})
    assert same is not None
    assert f"kept {marker}" in [line.message for line in read_until(same, f"kept {marker}")]
    same.close()
    rebooted, _ = open_kernel_log(str(KMSG), {"kmsg_boot": "another-boot", "kmsg_seq": 10**12})
    assert rebooted is not None
    assert f"kept {marker}" in [line.message for line in read_until(rebooted, f"kept {marker}",
                                                                    tries=200)]
    rebooted.close()


@needs_kmsg
def test_the_agent_spools_a_real_xid_line_and_keeps_its_place(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    spooled: list[dict[str, Any]] = []
    state = StateFile(tmp_path / "state.json")
    reader, _ = open_kernel_log(str(KMSG), state.data)
    assert reader is not None
    log = KernelLog("gpu-003", reader, state, spooled.extend)
    try:
        kmsg_write(f"usb 1-1: new high-speed USB device {marker}")  # not worth sending
        kmsg_write(xid_line(marker))
        for _ in range(20):
            log.pass_once(0.2)
            if any(marker in s.get("message", "") for s in spooled):
                break
    finally:
        reader.close()
    mine = [s for s in spooled if marker in s.get("message", "")]
    assert [(s["source"], s["node"], s["message"]) for s in mine] == [
        ("kernel", "gpu-003", xid_line(marker))]
    # Stamped with when the kernel logged it (its timestamp since boot, as wall-clock time).
    assert mine[0]["at"].endswith("Z") and isinstance(mine[0]["seq"], int)
    saved = json.loads((tmp_path / "state.json").read_text())
    assert saved["kmsg_boot"] == boot_id() and saved["kmsg_seq"] >= mine[0]["seq"]


@needs_kmsg
def test_without_cap_syslog_kmsg_is_refused_and_journald_is_followed(tmp_path: Path) -> None:
    # dmesg_restrict=1 (this machine's setting, and many distributions'): reading /dev/kmsg
    # needs CAP_SYSLOG. Run the agent's opening code with that capability dropped.
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "1":
        pytest.skip("kernel.dmesg_restrict is 0 here: anyone may read /dev/kmsg")
    journalctl = fake_journalctl(tmp_path, [])
    code = (
        "import json, sys\n"
        "from collectors.agent.kernel import open_kernel_log\n"
        f"reader, how = open_kernel_log('/dev/kmsg', {{}}, journal_command={str(journalctl)!r})\n"
        "print(json.dumps([getattr(reader, 'kind', None), how]))\n"
        "reader and reader.close()\n")
    done = subprocess.run(["setpriv", "--inh-caps=-syslog", "--bounding-set=-syslog",
                           sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    kind, how = json.loads(done.stdout)
    assert (kind, how) == ("journal", f"following journald ({journalctl})")


# --- overruns and continuation lines (the kernel's answers, scripted) ----------------------


def scripted(monkeypatch: pytest.MonkeyPatch, reader: KmsgReader,
             answers: list[bytes | BaseException]) -> KmsgReader:
    """``reader`` with the kernel's answers to its reads replaced by ``answers``, in order."""

    def scripted_read(fd: int, size: int) -> bytes:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(reader, "poller", SimpleNamespace(poll=lambda timeout: [(reader.fd, 1)]))
    monkeypatch.setattr(kernel.os, "read", scripted_read)
    return reader


@needs_kmsg
def test_an_overrun_is_counted_and_reported_not_fatal(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel overwrote records 11 to 14 before the agent read them: read() fails with
    # EPIPE once, then goes on at the oldest record it still holds.
    answers: list[bytes | BaseException] = [
        b"3,10,100,-;NVRM: Xid (PCI:0000:9b:00): 13, Graphics Exception\n",
        BrokenPipeError(),
        b"3,15,200,-;NVRM: Xid (PCI:0000:9b:00): 79, GPU has fallen off the bus.\n",
        BlockingIOError(),
    ]

    reader = scripted(monkeypatch, KmsgReader(KMSG, after_seq=9), answers)
    spooled: list[dict[str, Any]] = []
    log = KernelLog("gpu-003", reader, StateFile(tmp_path / "state.json"), spooled.extend)
    log.pass_once(0)
    monkeypatch.undo()
    reader.close()
    assert [s.get("event") for s in spooled] == [None, None, proto.KMSG_LOST]
    assert spooled[2]["lost"] == 4 and "4 record(s)" in spooled[2]["message"]
    assert json.loads((tmp_path / "state.json").read_text())["kmsg_seq"] == 15


@needs_kmsg
def test_a_real_overrun_of_the_kernel_buffer_is_counted() -> None:
    # The kernel keeps its log in a ring of a few hundred KiB: lines written faster than the
    # agent reads overwrite the ones it has not read, and its next read() fails with EPIPE.
    marker = uuid.uuid4().hex
    reader = KmsgReader(KMSG)  # at the end, knowing the end's sequence number
    written = 4000  # ~3.6 MB, several times any usual log_buf_len
    read, lost = 0, 0
    try:
        pad = "x" * 900
        for n in range(written):
            fd = os.open(KMSG, os.O_WRONLY)  # the kernel rate-limits writes per open file
            try:
                os.write(fd, f"<7>fleetwatch overrun test {marker} {n} {pad}\n".encode())
            finally:
                os.close(fd)
        kmsg_write(xid_line(marker))
        for _ in range(50):
            lines = reader.read(0.2)
            read += sum(1 for line in lines if marker in line.message)
            lost += reader.take_lost()
            if any(line.message == xid_line(marker) for line in lines):
                break
    finally:
        reader.close()
    assert lost > 0
    # Nothing invented, nothing missed: every line written since the start was read or
    # counted lost (lost may also count other writers' lines).
    assert read + lost >= written + 1 and read < written + 1


@needs_kmsg
def test_continuation_fragments_are_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kernels before 4.9 sent a KERN_CONT message in pieces: flags "c", then "+".
    answers: list[bytes | BaseException] = [
        b"4,20,100,c;NVRM: Xid (PCI:0000:3b:00): 48, \n",
        b"4,21,101,+;An uncorrectable double bit error\n",
        b"6,22,102,-;next line\n",
        BlockingIOError(),
    ]

    reader = scripted(monkeypatch, KmsgReader(KMSG, after_seq=19), answers)
    lines = reader.read(0)
    monkeypatch.undo()
    reader.close()
    assert [line.message for line in lines] == [
        "NVRM: Xid (PCI:0000:3b:00): 48, An uncorrectable double bit error", "next line"]


# --- journald -----------------------------------------------------------------------------


def journal_entry(cursor: str, message: str | list[int], usec: int) -> dict[str, Any]:
    """An entry as `journalctl -k -o json` prints it (fields from systemd 252)."""
    return {"__CURSOR": cursor, "__REALTIME_TIMESTAMP": str(usec),
            "__MONOTONIC_TIMESTAMP": "5512345678", "_BOOT_ID": "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
            "_TRANSPORT": "kernel", "PRIORITY": "3", "SYSLOG_FACILITY": "0",
            "SYSLOG_IDENTIFIER": "kernel", "_HOSTNAME": "gpu-003", "MESSAGE": message,
            "_KERNEL_SUBSYSTEM": "pci", "_KERNEL_DEVICE": "+pci:0000:9b:00.0",
            "_SOURCE_MONOTONIC_TIMESTAMP": "5512340000"}


def fake_journalctl(tmp_path: Path, entries: list[dict[str, Any]], *,
                    fail: str = "") -> Path:
    """A journalctl that prints ``entries`` as the real one does with -o json, then follows
    (sleeps), recording its arguments; or fails as it does without a journal."""
    out = tmp_path / "entries.jsonl"
    out.write_text("".join(json.dumps(e) + "\n" for e in entries))
    script = tmp_path / "journalctl"
    if fail:
        # A shell script: it fails at once, as the real journalctl (a native program) does,
        # within the 0.2 s open_kernel_log() gives it; a Python one may not start that fast on
        # a busy machine (the suite's other workers).
        script.write_text(f"#!/bin/sh\necho \"$*\" >> {shlex.quote(str(tmp_path / 'argv'))}\n"
                          f"echo {shlex.quote(fail)} >&2\nexit 1\n")
        script.chmod(0o755)
        return script
    body = (f"import sys, time\nopen({str(tmp_path / 'argv')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n")
    body += (f"sys.stdout.write(open({str(out)!r}).read()); sys.stdout.flush()\n"
             "time.sleep(60)\n")
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(0o755)
    return script


def test_journald_is_followed_resuming_after_its_cursor(tmp_path: Path) -> None:
    xid = "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    entries = [journal_entry("s=a;i=1", "usb 1-1: new device", 1_764_000_000_000_000),
               # journald sends a message that is not valid UTF-8 as an array of bytes
               journal_entry("s=a;i=2", [*xid.encode(), 0xFF], 1_764_000_001_500_000)]
    command = fake_journalctl(tmp_path, entries)
    reader, how = open_kernel_log("/nonexistent/kmsg", {}, journal_command=str(command))
    assert isinstance(reader, JournalReader) and how == f"following journald ({command})"
    try:
        lines = []
        for _ in range(20):
            lines += reader.read(0.2)
            if len(lines) == 2:
                break
        assert [line.message for line in lines] == ["usb 1-1: new device", xid + "\ufffd"]
        assert lines[1].wall == 1_764_000_001.5
        assert reader.position() == {"journal_cursor": "s=a;i=2"}
    finally:
        reader.close()
    # Started without a cursor at the end; restarted with one, after it.
    again, _ = open_kernel_log("/nonexistent/kmsg", {"journal_cursor": "s=a;i=2"},
                               journal_command=str(command))
    assert again is not None
    again.close()
    calls = (tmp_path / "argv").read_text().splitlines()
    assert calls == ["--dmesg --follow --output=json --no-pager --lines=0",
                     "--dmesg --follow --output=json --no-pager --after-cursor=s=a;i=2"]


def test_no_kernel_log_at_all_is_said_plainly(tmp_path: Path) -> None:
    command = fake_journalctl(tmp_path, [], fail="No journal files were found.")
    reader, how = open_kernel_log("/nonexistent/kmsg", {}, journal_command=str(command))
    assert reader is None
    assert "/nonexistent/kmsg: No such file or directory" in how
    assert "No journal files were found." in how


def test_a_journalctl_that_stops_is_reported_and_started_again_after_its_cursor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(JournalReader, "RESTART_AFTER", 0.3)
    xid = "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    out = tmp_path / "entries.jsonl"
    out.write_text(json.dumps(journal_entry("s=a;i=7", xid, 1_764_000_000_000_000)) + "\n")
    script = tmp_path / "journalctl"
    # Complains (200 KB: more than a pipe holds), prints its entry, and a moment later exits
    # as journalctl does when journald goes away; the second time it just follows.
    script.write_text(
        f"#!{sys.executable}\nimport sys, time\n"
        f"open({str(tmp_path / 'argv')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if '--after-cursor=s=a;i=7' in sys.argv:\n    time.sleep(60)\n"
        "sys.stderr.write('Journal file corrupted, ignoring file.\\n' * 5000)\n"
        f"sys.stdout.write(open({str(out)!r}).read()); sys.stdout.flush()\n"
        "time.sleep(0.5)\n"
        "sys.stderr.write('Failed to get journal fields: Bad message\\n'); sys.exit(1)\n")
    script.chmod(0o755)
    reader, _ = open_kernel_log("/nonexistent/kmsg", {}, journal_command=str(script),
                                mode="journal")
    assert reader is not None
    spooled: list[dict[str, Any]] = []
    log = KernelLog("gpu-003", reader, StateFile(tmp_path / "state.json"), spooled.extend)
    reads = 0
    try:
        for _ in range(40):
            reads += 1
            log.pass_once(0.2)
            if len((tmp_path / "argv").read_text().splitlines()) == 2:
                break
    finally:
        reader.close()
    assert [s["message"] for s in spooled if "Xid" in s["message"]] == [xid]
    [trouble] = [s for s in spooled if s.get("event") == proto.KERNEL_LOG_UNREADABLE]
    assert "exited with 1" in trouble["message"]
    assert "Failed to get journal fields: Bad message" in trouble["message"]
    assert (tmp_path / "argv").read_text().splitlines()[1].endswith("--after-cursor=s=a;i=7")
    assert reads < 40  # it came back, without spinning through the passes
