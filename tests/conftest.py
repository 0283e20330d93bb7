from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from collectors.roles import OPERATOR, VIEWER, user_with_role
from collectors.sim.fleet import SimFleet
from tests.harness.processes import stop_process_group
from tests.harness.slurm_cluster import RELEASES as SLURM_RELEASES
from tests.harness.slurm_cluster import SlurmInstall, install_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sim_fleet(settings: Any, tmp_path: Path) -> SimFleet:
    """A freshly seeded simulated fleet in a temporary file, used by the code under test."""
    settings.FLEETWATCH_SIM_STATE = tmp_path / "sim-fleet.json"
    fleet = SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED)
    fleet.seed()
    return fleet


@pytest.fixture
def operator(db: None) -> Any:
    return user_with_role("olivia", OPERATOR, "operator-pass-1")[0]


@pytest.fixture
def viewer(db: None) -> Any:
    return user_with_role("victor", VIEWER, "viewer-pass-1")[0]


def token_for(user: Any, scopes: tuple[str, ...] = ("read", "operate", "ingest"),
              name: str | None = None, days: float | None = None) -> str:
    """An API token's key for ``user`` (all scopes unless told)."""
    from incidents.models import ApiToken
    from incidents.tokens import token_create

    name = name or f"{user.get_username()}-{ApiToken.objects.count() + 1}"
    return token_create(user, name, scopes, ttl_days=days)[1]


def rerun_on_sqlite(test_file: str, tmp_path: Path, select: str) -> None:
    """Run ``test_file``'s tests selected by ``select`` (a ``-k`` expression) again in a
    subprocess on an SQLite database, the embedded demo's: where the two databases differ
    (what they store, how they compare, how writers take turns), both are tested."""
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'rerun.sqlite3'}"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-k", select],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-3000:]


def steps_queued(callbacks: list[Callable[[], Any]]) -> int:
    """How many on-commit callbacks queue a remediation step (others tell webhooks)."""
    from collectors import queueing

    return sum(1 for c in callbacks if getattr(c, "task", None) == queueing.RUN_STEP)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Worker:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc, self.log = proc, log

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@pytest.fixture
def policy_mode() -> str:
    """The worker's FLEETWATCH_POLICY_MODE; parametrize this name to change it."""
    return "auto"


@pytest.fixture
def worker_env() -> dict[str, str]:
    """More environment for the worker of ``celery_worker_process``; override this name in a
    test module to give its worker settings of its own."""
    return {}


@pytest.fixture
def sim_state(settings: Any) -> Callable[[], dict[str, Any]]:
    """Read the simulated fleet as its Slurm/Kubernetes/provider would report it now."""
    return lambda: SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED).snapshot()


@pytest.fixture
def celery_worker_process(
    transactional_db: None, settings: Any, tmp_path: Path, policy_mode: str,
    worker_env: dict[str, str],
) -> Iterator[Worker]:
    """A real ``celery worker`` (with beat) on real Redis, writing to the test database."""
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if connection.vendor != "postgresql" or not broker.startswith("redis://"):
        pytest.fail("integration tests need PostgreSQL and Redis: run them with `make test`")
    import redis

    settings.FLEETWATCH_POLICY_MODE = policy_mode
    redis.Redis.from_url(broker).flushdb()  # no stale tasks from an earlier run
    settings.FLEETWATCH_SIM_SPEED = 40.0  # 120 s of SIGTERM grace pass in 3 s
    settings.FLEETWATCH_SIM_STATE = tmp_path / "sim-fleet.json"
    SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED).seed()
    db = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "CELERY_BROKER_URL": broker,
        "FLEETWATCH_DATA_DIR": str(tmp_path / "data"),
        "FLEETWATCH_SIM_STATE": str(settings.FLEETWATCH_SIM_STATE),
        "FLEETWATCH_SIM_SPEED": str(settings.FLEETWATCH_SIM_SPEED),
        "FLEETWATCH_COLLECT_INTERVAL": "1",
        "FLEETWATCH_STEP_POLL_SECONDS": "0.3",
        "FLEETWATCH_POLICY_MODE": settings.FLEETWATCH_POLICY_MODE,
        **worker_env,
    }
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "fleetwatch", "worker", "-B",
             "-Q", "collect,diagnose,remediate,default", "--concurrency", "3",
             "--loglevel", "INFO", "-s", str(tmp_path / "beat-schedule")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    worker = Worker(proc, log)
    try:
        yield worker
    finally:
        stop_process_group(proc)


# --- Slurm: every Slurm test runs on each release this suite knows --------------------------------

# What each run's daemons said of themselves, for the summary below.
_SLURM_VERSIONS_RAN: set[str] = set()


@pytest.fixture(scope="session", params=SLURM_RELEASES, ids=[f"slurm{r}" for r in SLURM_RELEASES])
def slurm_install(request: pytest.FixtureRequest) -> SlurmInstall:
    """Debian's Slurm 22.05, then 25.11 built from the shared source (once, into a cache:
    tests/harness/slurm_build.py). Never skipped: a Slurm that cannot be had is an error.
    ``-k slurm25.11`` (or ``slurm22.05``) selects one."""
    install = install_for(str(request.param))
    _SLURM_VERSIONS_RAN.add(install.version())
    return install


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _SLURM_VERSIONS_RAN:
        terminalreporter.write_sep("-", "Slurm versions these tests ran against: "
                                   + ", ".join(sorted(_SLURM_VERSIONS_RAN)))
