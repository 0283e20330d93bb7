"""Stopping and starting `make run` (deploy/run-local.sh) as a user does, on its embedded
default: SQLite, the filesystem broker, the simulated fleet.

- Ctrl-C in the terminal, a SIGTERM to make, or a stop signal to the script or to any one of
  the three processes it starts (gunicorn, the Celery worker, Celery beat), stops every process
  `make run` started:
  all of them, their own children (gunicorn's workers, Celery's pool) included, are gone.
- A second `make run` that cannot start (its port is taken, or the data folder is in use)
  exits non-zero before changing anything: the first one's demo password still logs in.
- A worker told to stop while a step is inside a 5-minute outside call stops within seconds
  (it cancels what still runs after FLEETWATCH_WORKER_SHUTDOWN_SECONDS), and the others with
  it. The step resumes at the next start, long before its lease (10 minutes here) would have
  let the watchdog take it, and makes each outside call once.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.cookiejar
import json
import os
import pty
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import termios
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, wait_for

pytestmark = pytest.mark.embedded

VENV = Path(sys.executable).parent.parent
PASSWORD = "demo-pass-123"
STOPPED_WITHIN = 60  # generous: the script kills what is left after 10 s; the machine is shared


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _processes() -> dict[int, tuple[int, int, str, str]]:
    """Every live process: pid -> (parent pid, session id, state, command line)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":  # a zombie has ended; only its parent's bookkeeping is left
            found[int(entry)] = (int(fields[1]), int(fields[3]), fields[0], cmd.strip())
    return found


@dataclass
class Stack:
    """One `make run` in a data folder of its own; knows every process it started."""

    tmp: Path
    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen[bytes] | None = None
    terminal: int = -1
    runs: int = 0
    pids: set[int] = field(default_factory=set)
    sessions: set[int] = field(default_factory=set)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def db(self) -> Path:
        return self.tmp / "data" / "fleetwatch.sqlite3"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in {
            "DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE",
            "FLEETWATCH_DEMO_PASSWORD", "FLEETWATCH_DEMO_ROTATE", "FLEETWATCH_LOG_FORMAT",
            "MAKEFLAGS", "MFLAGS"}}
        env.update(FLEETWATCH_DATA_DIR=str(self.tmp / "data"), FLEETWATCH_COLLECT_INTERVAL="1",
                   FLEETWATCH_SIM_SPEED="40", **extra)
        return env

    def make_run(self, port: int | None = None, terminal: bool = False,
                 **extra: str) -> subprocess.Popen[bytes]:
        """`make run` in a session of its own; with ``terminal``, in the foreground of a
        pseudo-terminal (self.terminal: the side a person types into) as from a shell."""
        # -o: the venv the suite runs in is installed; make must not reinstall it.
        command = ["make", "--no-print-directory", "-o", f"{VENV}/bin/.installed", "run",
                   f"PORT={port or self.port}", f"VENV={VENV}"]
        self.runs += 1
        log = self.tmp / f"run-{self.runs}.log"
        if not terminal:
            with open(log, "wb") as out:
                return subprocess.Popen(command, cwd=ROOT, env=self.env(**extra), stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.terminal, tty = pty.openpty()

        def controlling_terminal() -> None:  # in the child, after setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        proc = subprocess.Popen(command, cwd=ROOT, env=self.env(**extra), stdin=tty, stdout=tty,
                                stderr=tty, start_new_session=True,
                                preexec_fn=controlling_terminal)
        os.close(tty)
        threading.Thread(target=_copy, args=(self.terminal, log), daemon=True).start()
        return proc

    def log(self) -> str:
        return (self.tmp / f"run-{self.runs}.log").read_text(errors="replace")

    def start(self, terminal: bool = False, **extra: str) -> None:
        self.proc = self.make_run(terminal=terminal, FLEETWATCH_DEMO_PASSWORD=PASSWORD, **extra)
        try:
            wait_for(lambda: _get(f"{self.base}/healthz") == 200, 120, "the web server")
            # The worker and beat are up too (they start before gunicorn, but slower).
            wait_for(lambda: self.find("worker") and self.find("beat"), 60, "worker and beat")
        except AssertionError:
            print(self.log()[-5000:])
            raise
        self.remember()

    def remember(self) -> None:
        """Every process make started, down to grandchildren, and the sessions they run in
        (the script starts each of its three in a session of its own)."""
        assert self.proc is not None
        ps = _processes()
        mine = {self.proc.pid}
        while grown := {pid for pid, (ppid, *_) in ps.items() if ppid in mine} - mine:
            mine |= grown
        self.pids |= mine
        self.sessions |= {ps[pid][1] for pid in mine if pid in ps}

    def find(self, what: str) -> int | None:
        """The pid of the script, or of the worker, beat or gunicorn it started."""
        assert self.proc is not None
        ps = _processes()
        script = next((pid for pid, (ppid, _, _, cmd) in ps.items()
                       if ppid == self.proc.pid and "run-local.sh" in cmd), None)
        if what == "script" or script is None:
            return script
        pattern = {"worker": r"celery .*\bworker\b", "beat": r"celery .*\bbeat\b",
                   "gunicorn": r"gunicorn "}[what]
        return next((pid for pid, (ppid, _, _, cmd) in ps.items()
                     if ppid == script and re.search(pattern, cmd)), None)

    def left(self) -> list[str]:
        """What is still running of everything this stack started."""
        return [f"{pid} {cmd[:100]}" for pid, (_, sid, _, cmd) in _processes().items()
                if pid in self.pids or sid in self.sessions]

    def wait_stopped(self) -> None:
        try:
            wait_for(lambda: not self.left(), STOPPED_WITHIN, "every process to stop")
        except AssertionError:
            print(self.left(), self.log()[-5000:])
            raise
        assert self.proc is not None
        self.proc.wait(timeout=5)

    def kill_all(self) -> None:
        """After a failure: whatever is left, by pid (never a whole group by number: a pid
        freed by a stopped process may be someone else's by now)."""
        for entry in self.left():
            with contextlib.suppress(OSError):
                os.kill(int(entry.split()[0]), signal.SIGKILL)

    def manage(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env(),
                              capture_output=True, text=True, check=True)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with contextlib.closing(sqlite3.connect(self.db, timeout=30)) as db:
            return db.execute(sql, params).fetchall()


def _copy(terminal: int, log: Path) -> None:
    """What the terminal shows, into the log (read all along: a full terminal blocks)."""
    with open(log, "ab") as out:
        while True:
            try:
                data = os.read(terminal, 65536)
            except OSError:  # every process holding the terminal has ended
                return
            if not data:
                return
            out.write(data)
            out.flush()


def _listening(port: int) -> bool:
    """Whether anything on this machine listens on the TCP port (IPv4 or IPv6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if int(local.rsplit(":", 1)[1], 16) == port and state == "0A":  # TCP_LISTEN
                    return True
    return False


# The banner `make run` prints once everything has started (deploy/run-local.sh).
BANNER = re.compile(r"^FleetWatch is running on (\S+)\nLog in as demo / (\S+)(.*)\n", re.M)
# A plain log line: time, level, logger, message (and the request id when there is one).
PLAIN_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.]+: \S")


def _banner(stack: Stack) -> re.Match[str]:
    try:
        wait_for(lambda: BANNER.search(stack.log()), 120, "the banner")
    except AssertionError:
        print(stack.log()[-5000:])
        raise
    found = BANNER.search(stack.log())
    assert found is not None
    return found


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _logs_in(base: str, username: str, password: str) -> bool:
    """Log in through the login page as a person does; True if a session was opened."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(f"{base}/login/", timeout=10).read().decode()
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert csrf, page[:500]
    form = urllib.parse.urlencode({"username": username, "password": password,
                                   "csrfmiddlewaretoken": csrf.group(1)}).encode()
    request = urllib.request.Request(f"{base}/login/", data=form,
                                     headers={"Referer": f"{base}/login/"})
    opener.open(request, timeout=10).read()
    return any(cookie.name == "sessionid" for cookie in jar)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.kill_all()


def test_term_to_make_stops_all_and_a_second_make_run_changes_nothing(stack: Stack) -> None:
    stack.start()
    first = stack.proc
    assert first is not None
    assert _logs_in(stack.base, "demo", PASSWORD)
    assert not _logs_in(stack.base, "demo", "not-the-password")

    # The same port: refused before migrating or seeding, naming the port. No
    # FLEETWATCH_DEMO_PASSWORD this time, so a seed would have set a new password.
    second = stack.make_run()
    assert second.wait(timeout=60) != 0
    assert f"cannot listen on 127.0.0.1:{stack.port}" in stack.log()
    assert "login:" not in stack.log()
    # Another port but the same data folder (database, broker): refused as well.
    third = stack.make_run(port=_free_port())
    assert third.wait(timeout=60) != 0
    assert "FleetWatch is already running on" in stack.log()
    assert "login:" not in stack.log()
    assert _logs_in(stack.base, "demo", PASSWORD)
    assert first.poll() is None and _get(f"{stack.base}/healthz") == 200

    os.kill(first.pid, signal.SIGTERM)  # make passes a TERM on to its recipe: the script
    stack.wait_stopped()
    assert first.returncode != 0


def test_ctrl_c_in_a_terminal_stops_everything(stack: Stack) -> None:
    stack.start(terminal=True)
    _banner(stack)
    # On a terminal the logs are text a person reads, not JSON (nothing set).
    lines = stack.log().splitlines()
    assert any(PLAIN_LINE.match(line) for line in lines), lines[:40]
    assert not any(line.startswith('{"') for line in lines)
    # The terminal sends SIGINT to its foreground process group: make and the script. The
    # three the script started run in sessions of their own and are stopped by the script.
    os.write(stack.terminal, b"\x03")
    stack.wait_stopped()
    assert "FleetWatch: stopping web, worker and beat" in stack.log()
    assert not _listening(stack.port)


def test_plain_logs_the_banner_and_one_password_across_restarts(stack: Stack) -> None:
    """No terminal, FLEETWATCH_LOG_FORMAT=plain: readable lines; the banner comes last, with the
    URL and the whole login; SIGINT stops everything within seconds, nothing left listening;
    the next start prints the same password, which still logs in."""
    stack.proc = stack.make_run(FLEETWATCH_LOG_FORMAT="plain")  # no password: one is made
    banner = _banner(stack)
    stack.remember()
    assert banner.group(1) == f"{stack.base}/"
    password = banner.group(2)
    assert _logs_in(stack.base, "demo", password)
    log = stack.log()
    # After everything has started: gunicorn listening, the worker ready, a collection run.
    assert log.index("celery.apps.worker: celery@") < banner.start()
    assert log.index("gunicorn.error: Listening at: ") < banner.start()
    assert re.search(r"^\d\d:\d\d:\d\d INFO    fleetwatch\.access: POST /login/ 302 [\d.]+ms "
                     r"\[[0-9a-f]{32}\]$", log, re.M), log[-3000:]
    lines = log.splitlines()
    assert not any(line.startswith('{"') for line in lines)
    # Routine task lines stay out of a terminal's way at INFO.
    assert "Sending due task" not in log and " succeeded in " not in log

    # Ctrl-C as a terminal delivers it to the script (make's recipe): seconds, not minutes.
    script = stack.find("script")
    assert script is not None
    began = time.monotonic()
    os.kill(script, signal.SIGINT)
    stack.wait_stopped()
    assert time.monotonic() - began < 30  # ~5 s; generous, the machine is shared
    assert not _listening(stack.port) and _get(f"{stack.base}/healthz") == 0

    # Started again (JSON this time: no terminal, nothing set): the same login, printed whole.
    stack.pids.clear()
    stack.sessions.clear()
    stack.proc = stack.make_run()
    again = _banner(stack)
    stack.remember()
    assert again.group(2) == password and "kept from the last start" in again.group(3)
    assert _logs_in(stack.base, "demo", password)
    assert any(line.startswith('{"time"') for line in stack.log().splitlines())
    assert stack.proc is not None
    os.kill(stack.proc.pid, signal.SIGTERM)
    stack.wait_stopped()
    assert not _listening(stack.port)


@pytest.mark.parametrize(("target", "signum"), [
    ("worker", signal.SIGTERM), ("beat", signal.SIGTERM), ("gunicorn", signal.SIGTERM),
    ("script", signal.SIGINT),
], ids=["TERM-to-worker", "TERM-to-beat", "TERM-to-gunicorn", "INT-to-script"])
def test_a_stop_signal_to_any_one_process_stops_them_all(stack: Stack, target: str,
                                                          signum: int) -> None:
    stack.start()
    pid = stack.find(target)
    assert pid is not None, stack.left()
    os.kill(pid, signum)
    stack.wait_stopped()


def _step(stack: Stack, kind: str) -> dict[str, Any]:
    rows = stack.query("SELECT id, status, lease_until, done_calls FROM incidents_step "
                       "WHERE kind = ?", kind)
    if not rows:
        return {}
    pk, status, lease, done = rows[0]
    return {"id": pk, "status": status, "lease_until": lease, "done_calls": json.loads(done)}


def _changes(stack: Stack, verb: str) -> int:
    """Outside calls of this verb audited as having changed something."""
    rows = stack.query("SELECT data FROM incidents_auditentry WHERE verb = ? AND call != '' "
                       "AND ok", verb)
    return sum(1 for (data,) in rows if json.loads(data).get("changed"))


def test_a_step_cut_off_by_a_stop_resumes_at_the_next_start(stack: Stack) -> None:
    # In the first run the eviction takes 5 minutes in the sim. A worker that waited for its
    # running tasks (Celery's warm shutdown) would outlive this test; it gives them 3 s and
    # cancels them. The lease (10 minutes) is far longer than this test waits, so only the
    # next start can bring the step back.
    lease = {"FLEETWATCH_STEP_LEASE_SECONDS": "600", "FLEETWATCH_STEP_POLL_SECONDS": "0.5"}
    stack.start(FLEETWATCH_SIM_ACTION_DELAY="k8s.evict=300", **lease)
    wait_for(lambda: stack.query("SELECT count(*) FROM collectors_node WHERE health = 'healthy'")
             [0][0] == 16, 60, "the first collection")
    stack.manage("fleetwatch", "inject", "xid", "--node", "gpu-003", "--gpu", "5", "--code", "79")
    try:
        wait_for(lambda: _step(stack, "cordon_and_drain").get("status") == "running" and "k8s.cordon gpu-003"
                 in _step(stack, "cordon_and_drain")["done_calls"], 120, "the cordon", interval=0.1)
    except AssertionError:
        print(stack.log()[-5000:])
        raise
    stack.remember()
    worker = stack.find("worker")
    assert worker is not None
    os.kill(worker, signal.SIGTERM)  # the worker alone: the script stops the rest once it ends
    stack.wait_stopped()

    # Cut off inside the eviction: still leased, the pod not evicted, nothing audited for it.
    cut = _step(stack, "cordon_and_drain")
    assert cut["status"] == "running" and cut["lease_until"] is not None
    pods = json.loads(stack.manage("fleetwatch", "sim", "--show", "--json").stdout)["pods"]
    assert "slurmd-gpu-003" in [p["name"] for p in pods if p["node"] == "gpu-003"]
    assert _changes(stack, "k8s.evict") == 0

    stack.start(**lease)
    try:
        wait_for(lambda: stack.query("SELECT status FROM incidents_incident") == [("resolved",)],
                 120, "the incident to resolve", interval=0.5)
    except AssertionError:
        print(stack.query("SELECT kind, status, lease_until, done_calls FROM incidents_step"))
        print(stack.log()[-5000:])
        raise
    statuses = stack.query("SELECT status FROM incidents_step ORDER BY \"order\"")
    assert statuses == [("succeeded",)] * 8  # replace_node's, the gate among them
    # Resumed by the start-up, which said so in the audit trail, not by the watchdog.
    assert stack.query("SELECT count(*) FROM incidents_auditentry WHERE verb = "
                       "'step.lease_released' AND step_id = ?", cut["id"]) == [(1,)]
    # The cordon recorded before the stop was not made again; the eviction was made once.
    assert stack.query("SELECT count(*) FROM incidents_auditentry WHERE verb = 'k8s.cordon' "
                       "AND call != ''") == [(1,)]
    assert _changes(stack, "k8s.evict") == 1
    pods = json.loads(stack.manage("fleetwatch", "sim", "--show", "--json").stdout)["pods"]
    assert [p["name"] for p in pods if p["node"] == "gpu-003"] == ["dcgm-exporter-gpu-003"]
    assert stack.manage("fleetwatch", "audit", "verify").returncode == 0
    assert stack.proc is not None
    os.kill(stack.proc.pid, signal.SIGTERM)
    stack.wait_stopped()
