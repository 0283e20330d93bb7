"""Redis and PostgreSQL restarting under FleetWatch's running containers (web, one worker per
queue with two for remediate, beat; the simulated fleet, as tests/deploy/test_scale_out.py).

The containers use a PostgreSQL and a Redis of this module's own, started on free loopback
ports (as tests/harness/with-services.sh starts its private ones), so they can be restarted
without disturbing the suite's. Redis runs as a deployment would keep it: append-only file
(``appendonly yes``, ``appendfsync everysec``), stopped with SIGTERM (a Pod's stop: Redis
writes and fsyncs the file before it exits) and started again on the same port and folder
(``redis-aof``). The second variant (``redis-lost``) is a Redis Pod without a persistent
volume: it comes back empty, every queued and unacknowledged message gone. Either way, what
the broker lost is the watchdog's (FLEETWATCH_WATCHDOG_SECONDS): a step whose message was lost
is queued again once its lease has run out. PostgreSQL is restarted with
``pg_ctl restart -m fast`` (every connection dropped).

An XID 79 is injected. Redis goes away for 8 s while the drain step is inside its eviction
call (the simulated API holds it 4 s): the step ends, and the next one is queued, while there
is no broker. PostgreSQL restarts while the replacement step is inside the provider's call. No
container is restarted (same ids and start times, running, no restart counted); every worker
logged the broker lost and reconnected; the playbook finishes, the incident resolves, each
outside action is audited as a change exactly once, no step is left unfinished, and web
answers /healthz with both back. (In the runs so far the next step's message was lost in both
variants and the watchdog re-queued it; the test prints that line rather than asserting how
the message was recovered.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.test_scale_out import query, wait
from tests.deploy.test_server_image import (
    PODMAN,
    Fleet,
    free_port,
    get,
    podman_logs,
    wait_for_health,
    wait_for_log,
)
from tests.integration.test_chaos import ACTIONS, BAD_NODE, SPARE, gate_actions

pytestmark = [pytest.mark.image, pytest.mark.timeout(1200)]


def pg_bin() -> Path:
    """Debian's newest PostgreSQL, else the initdb on PATH (with-services.sh's choice)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                   key=lambda p: [int(x) for x in p.parent.name.split(".") if x.isdigit()])
    if found:
        return found[-1]
    initdb = shutil.which("initdb")
    if initdb is None:
        pytest.skip("PostgreSQL's initdb is not installed (deploy/bootstrap.sh test)")
    return Path(initdb).parent


@dataclass
class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (initdb, pg_ctl), run as the postgres user."""

    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "pg"

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/fleetwatch"

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [str(pg_bin() / tool), *args]
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            argv = ["runuser", "-u", "postgres", "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)

    def pg_ctl(self, *args: str) -> None:
        done = self._run("pg_ctl", "-D", str(self.data), "-w", "-l", str(self.root / "pg.log"),
                         *args)
        assert done.returncode == 0, done.stdout + done.stderr + self.log()

    def log(self) -> str:
        path = self.root / "pg.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def start(self) -> None:
        self.data.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres")
        done = self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                         "-E", "UTF8")
        assert done.returncode == 0, done.stderr
        self.pg_ctl("-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1", "start")
        import psycopg

        with psycopg.connect(f"postgres://postgres@127.0.0.1:{self.port}/postgres",
                             autocommit=True) as conn:
            conn.execute("CREATE DATABASE fleetwatch")

    def restart(self) -> None:
        self.pg_ctl("-m", "fast", "restart")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")


class PrivateRedis:
    """A redis-server of the test's own, persisted as a deployment keeps it (AOF)."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.proc: subprocess.Popen[bytes] | None = None
        # True: a restart comes back empty (a Redis Pod without a persistent volume).
        self.loses_data = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = open(self.root / "redis.log", "ab")  # noqa: SIM115 (the process keeps it)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.root), "--appendonly", "yes", "--appendfsync", "everysec",
             "--save", ""], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, as a Pod is stopped: Redis fsyncs its append-only file and exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, down_for: float) -> None:
        self.stop()
        if self.loses_data:
            shutil.rmtree(self.root / "appendonlydir", ignore_errors=True)
            (self.root / "dump.rdb").unlink(missing_ok=True)
        time.sleep(down_for)
        self.start()

    def log(self) -> str:
        return (self.root / "redis.log").read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module", params=["redis-aof", "redis-lost"])
def services(request: pytest.FixtureRequest) -> Iterator[tuple[PrivatePostgres, PrivateRedis]]:
    """Each variant gets its own services, database and containers (the fixtures below
    depend on this one, so pytest makes them again for each)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (deploy/bootstrap.sh test)")
    # Not under pytest's 0700 temporary folder: the postgres user must reach the data folder.
    root = Path(tempfile.mkdtemp(prefix="fw-restarts-"))
    root.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    pg, rd = PrivatePostgres(root, free_port()), PrivateRedis(root, free_port())
    rd.loses_data = request.param == "redis-lost"
    try:
        pg.start()
        rd.start()
        yield pg, rd
    finally:
        rd.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


# The image's fixtures (conftest.py) on these private services instead of the suite's.
@pytest.fixture(scope="module")
def database_url(services: tuple[PrivatePostgres, PrivateRedis]) -> str:
    return services[0].url


@pytest.fixture(scope="module")
def fleet(image: str, database_url: str, data_dir: Path,
          services: tuple[PrivatePostgres, PrivateRedis]) -> Iterator[Fleet]:
    with pytest.MonkeyPatch.context() as patch:  # Fleet() takes the suite's broker
        patch.setenv("CELERY_BROKER_URL", services[1].url)
        fleet = Fleet(image, database_url, data_dir)
    fleet.env["CELERY_BROKER_URL"] = services[1].url
    try:
        yield fleet
    finally:
        fleet.remove()


def identity(name: str) -> tuple[str, str, str, str]:
    """What would change if the container had been restarted or replaced."""
    done = subprocess.run([*PODMAN, "inspect", "--format",
                           "{{.Id}}|{{.State.StartedAt}}|{{.RestartCount}}|{{.State.Running}}",
                           name], capture_output=True, text=True, timeout=60, check=True)
    ident, started, restarts, running = done.stdout.strip().split("|")
    return ident, started, restarts, running


def test_redis_and_postgres_restarting_under_the_containers_lose_and_repeat_no_step(
        migrated: Fleet, services: tuple[PrivatePostgres, PrivateRedis],
        database_url: str) -> None:
    f = migrated
    pg, rd = services
    f.env.update({
        "FLEETWATCH_SIM_STATE": "/data/sim-fleet.json", "FLEETWATCH_SIM_SPEED": "40",
        "FLEETWATCH_SIM_ACTION_DELAY": "k8s.evict=4,provider.replace=4",
        "FLEETWATCH_COLLECT_INTERVAL": "1", "FLEETWATCH_STEP_POLL_SECONDS": "0.3",
        "FLEETWATCH_WATCHDOG_SECONDS": "2", "FLEETWATCH_STEP_LEASE_SECONDS": "8",
        "FLEETWATCH_POLICY_MODE": "auto", "FLEETWATCH_LOG_LEVEL": "INFO"})
    done = f.run("manage", "fleetwatch", "seed", "--reset")
    assert done.returncode == 0, done.stdout + done.stderr

    port = free_port()
    web = f.start("web", PORT=str(port))
    for queue in ("collect", "diagnose", "default", "remediate", "remediate"):
        wait_for_log(f.start("worker", queue, "--concurrency", "1"), "ready.")
    f.start("beat")
    wait_for_health(web, port)
    before = {name: identity(name) for name in f.names}

    def logs() -> str:
        return "\n".join(f"--- {name}\n{podman_logs(name)[-2500:]}" for name in f.names)

    def steps() -> list[tuple[str, str, str]]:
        return [(k, s, c) for k, s, c in query(
            database_url, "SELECT kind, status, done_calls::text FROM incidents_step "
                          "ORDER BY \"order\"")]

    def explain() -> str:
        return logs() + "\n" + json.dumps(steps(), default=str)

    wait(lambda: query(database_url, "SELECT count(*) FROM collectors_node WHERE in_service")[0][0]
         >= 16, 90, "the first collection of the simulated fleet", explain)
    wait(lambda: query(database_url, "SELECT count(*) FROM collectors_job WHERE state = 'RUNNING'")
         [0][0] == 3, 60, "the fleet's three jobs", explain)
    done = f.run("manage", "fleetwatch", "inject", "xid", "--node", BAD_NODE, "--gpu", "5",
                 "--code", "79")
    assert done.returncode == 0, done.stdout + done.stderr

    # Redis goes away while the drain step is inside its eviction call (4 s), for 3 s.
    wait(lambda: ("cordon_and_drain", "running") in [(k, s) for k, s, c in steps()
                                                     if "k8s.cordon" in c], 120,
         "the drain step in its eviction call", explain)
    import redis

    run_id = redis.Redis.from_url(rd.url).info("server")["run_id"]
    # Down for longer than the call has left: the step ends, and its successor is queued,
    # while there is no broker.
    rd.restart(down_for=8)
    assert redis.Redis.from_url(rd.url).info("server")["run_id"] != run_id  # a new server
    # The append-only file was read back, or (the lost volume) there was none to read.
    assert rd.log().count("DB loaded from append only file") == (0 if rd.loses_data else 1)

    # PostgreSQL restarts while the replacement is inside the provider's call (4 s).
    wait(lambda: ("replace_node", "running") in [(k, s) for k, s, c in steps()], 120,
         "the replacement step running", explain)
    pg.restart()

    def resolved() -> bool:
        rows = query(database_url, "SELECT status FROM incidents_incident")
        return bool(rows) and rows[0][0] == "resolved"

    wait(resolved, 180, "the incident resolved", explain)
    assert all(status == "succeeded" for _, status, _ in steps()), steps()
    entries = query(database_url, "SELECT verb, target, ok, data::text FROM incidents_auditentry "
                                  "WHERE call <> ''")
    changed = Counter((verb, target) for verb, target, ok, data in entries
                      if ok and json.loads(data).get("changed"))
    # The spare's return-to-service gate (one remediation: id 1) is among them.
    [(remediation_id,)] = query(database_url, "SELECT id FROM incidents_remediation")
    assert set(changed) == ACTIONS | gate_actions(remediation_id), changed
    assert all(count == 1 for count in changed.values()), changed
    state = json.loads((f.data / "sim-fleet.json").read_text())
    assert state["jobs"]["3001"]["state"] == "RUNNING"
    assert SPARE in state["jobs"]["3001"]["nodes"] and BAD_NODE not in state["jobs"]["3001"]["nodes"]

    print(json.dumps(steps(), default=str))
    # The workers saw the broker go and came back to it on their own.
    lost = [name for name in f.names if "Connection to broker lost" in podman_logs(name)]
    assert lost, logs()
    print(f"workers that lost the broker and reconnected: {len(lost)}")
    print("database errors seen:", {name: [line[:200] for line in podman_logs(name).splitlines()
                                             if "OperationalError" in line
                                             or "terminating connection" in line][:3]
                                     for name in f.names})
    print("watchdog:", [line for name in f.names for line in podman_logs(name).splitlines()
                        if "watchdog: re-queued" in line])

    # Nothing was restarted to get there: the same containers, still running.
    assert {name: identity(name) for name in f.names} == before
    status, body = get(f"http://127.0.0.1:{port}/healthz")
    assert (status, json.loads(body)) == (200, {"status": "ok", "database": "ok", "broker": "ok"})
