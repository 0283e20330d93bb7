from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from collectors.roles import OPERATOR, VIEWER, user_with_role
from collectors.sim.fleet import SimFleet
from tests.harness import parallel
from tests.harness.parallel import ParallelSetupError, worker_environment
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


def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker hands what its daemons said to the controller, which prints the summary.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["slurm_versions"] = sorted(_SLURM_VERSIONS_RAN)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _SLURM_VERSIONS_RAN.update(getattr(node, "workeroutput", {}).get("slurm_versions", ()))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _SLURM_VERSIONS_RAN:
        terminalreporter.write_sep("-", "Slurm versions these tests ran against: "
                                   + ", ".join(sorted(_SLURM_VERSIONS_RAN)))


# --- pytest-xdist (`make test` runs the suite on several workers: tests/harness/parallel.py) ----

_GROUPS_DIR: list[Path] = []  # the controller's folder for the workers' group files


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: list[Any]) -> None:
    """Each worker its own Redis database and data folder, in its environment from the start,
    before it imports the settings."""
    lines = []
    for spec in specs:
        try:
            env = worker_environment(spec.id, os.environ)
        except ParallelSetupError as exc:
            raise pytest.UsageError(str(exc)) from exc
        spec.env.update(env)
        lines.append(f"{spec.id}: " + ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and config.option.verbose >= 0:
        for line in lines:
            reporter.write_line(f"xdist {line}")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    if not _GROUPS_DIR:
        _GROUPS_DIR.append(Path(tempfile.mkdtemp(prefix="fleetwatch-xdist-groups-")))
    node.workerinput[parallel.GROUPS_KEY] = str(_GROUPS_DIR[0])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadgroup" or not _GROUPS_DIR:
        return None
    return parallel.group_scheduling(config, log, _GROUPS_DIR[0])


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _GROUPS_DIR:
        shutil.rmtree(folder, ignore_errors=True)


# Fixture scopes above the test: what a module's (or class's) tests share and pay for once.
_SHARED_SCOPES = frozenset({"class", "module", "package"})
# What the workers are handed first: the slow, waiting tests before the quick ones, so no worker
# starts a minutes-long module while the others have run out of work.
_FIRST = ("tests/deploy/", "tests/integration/", "tests/browser/", "tests/api/")


def _scope(item: pytest.Item, name: str) -> str | None:
    """The scope of a fixture of this suite's the test uses (None for the plugins' own, such
    as pytest-django's class-scoped no-op for unittest classes, which every test uses)."""
    defs = item._fixtureinfo.name2fixturedefs.get(name)  # type: ignore[attr-defined]
    return defs[-1].scope if defs and defs[-1].baseid else None


def xdist_group(item: pytest.Item) -> str | None:
    """The group a test runs in under ``--dist loadgroup`` (one worker runs a group's tests one
    after another): its ``xdist_group`` mark's name; else, if it uses a fixture set up once per
    module (a Slurm cluster, the live stack, a built image), its module's, per value of any
    parameter above the test's own scope (each value makes its own instance of the fixture
    anyway); else None, a group of its own."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    if not any(_scope(item, name) in _SHARED_SCOPES for name in item.fixturenames):
        return None
    group = item.nodeid.split("::", 1)[0]
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        above = [f"{name}={callspec.params[name]}" for name in sorted(callspec.params)
                 if _scope(item, name) in _SHARED_SCOPES | {"session"}]
        if above:
            group += "[" + ",".join(above) + "]"
    return group


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: the slow directories first (xdist hands work out in the order
    collected), and each test's group written for the controller's scheduler."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return

    def rank(item: pytest.Item) -> int:
        return next((i for i, first in enumerate(_FIRST) if item.nodeid.startswith(first)),
                    len(_FIRST))

    items.sort(key=rank)
    if parallel.GROUPS_KEY in workerinput:
        groups = {item.nodeid: group for item in items if (group := xdist_group(item))}
        parallel.groups_write(Path(workerinput[parallel.GROUPS_KEY]), workerinput["workerid"],
                              groups)
