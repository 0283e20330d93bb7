"""Running the suite on several pytest-xdist workers (``make test`` does, ``-n`` workers).

Every worker is a test run of its own as far as the shared services go:

- PostgreSQL: pytest-django names each worker's test database with its id (``test_fw_gw0``...).
- Redis: each worker gets a database of its own (the broker URL's number plus the worker's
  index: db 9 for gw0, 10 for gw1...). The Celery workers the tests start flush their broker
  and take any task queued there; on one shared database a test on gw1 would lose its queued
  tasks to gw0's flush, or gw0's worker would run them against the wrong PostgreSQL database.
- The data folder (FLEETWATCH_DATA_DIR: the throttle cache, the beat schedule, the default
  simulated fleet): ``<data dir>/xdist-gw0``..., made before the worker starts.

These reach each worker's environment before it imports anything (the ``env:`` of its xdist
gateway spec), so the settings, the suite and every process a test starts see the same values
as a run of its own would.

Which tests go to which worker (``--dist loadgroup``): tests of one group run on one worker, one
after another. A test's group is its ``xdist_group`` mark's name, else, when it uses a fixture
set up once per module (a Slurm cluster, the live stack, a built image), its module's, so that
fixture is set up once and not once per worker; any other test is a group of its own.
(pytest-xdist's own loadgroup marks a test's group by appending it to the test's node id, which
pytest 9 no longer lets a plugin change: the workers write the groups to a file the controller's
``GroupScheduling`` reads instead.)

What the workers still share is this machine: ``machine_lock`` keeps two of them (or two test
runs) from doing the same one-at-a-time thing at once, such as building an image with podman.
Tests that must not overlap with each other (the real /dev/kmsg) share an ``xdist_group``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit, urlunsplit

REDIS_DATABASES = 16  # redis.conf's default `databases`


class ParallelSetupError(RuntimeError):
    pass


def worker_index(worker_id: str) -> int:
    """``gw3`` -> 3."""
    if not worker_id.startswith("gw") or not worker_id[2:].isdigit():
        raise ParallelSetupError(f"not an xdist worker id: {worker_id!r}")
    return int(worker_id[2:])


def redis_databases(url: str) -> int:
    """How many databases the Redis at ``url`` has (CONFIG GET databases); the default where it
    will not say."""
    try:
        import redis

        answer = redis.Redis.from_url(url, socket_timeout=5).config_get("databases")
        return int(answer.get("databases", REDIS_DATABASES))
    except Exception:  # no answer is no reason to refuse: the worker's own check will fail loudly
        return REDIS_DATABASES


def redis_url_for_worker(url: str, index: int, databases: int = REDIS_DATABASES) -> str:
    """The broker URL's database number plus ``index`` (redis://h:p/9 -> /10 for gw1)."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    base = int(path) if path.isdigit() else 0
    db = base + index
    if db >= databases:
        raise ParallelSetupError(
            f"xdist worker gw{index} needs Redis database {db} ({url} plus its index), but that "
            f"Redis has databases 0-{databases - 1}: run fewer workers (-n) or give a lower "
            "database number in CELERY_BROKER_URL")
    return urlunsplit(parts._replace(path=f"/{db}"))


def data_dir_for_worker(base: Path, worker_id: str) -> Path:
    """``base/xdist-gw0``, prepared as with-services.sh prepares ``base``: made, with its
    static and broker folders, and the base's saved secret key (if it has one) so every worker
    signs with the same key."""
    from fleetwatch.datadir import KEY_FILE, data_dir_prepare

    path = base / f"xdist-{worker_id}"
    path.mkdir(parents=True, exist_ok=True)
    key = base / KEY_FILE
    if key.is_file() and not (path / KEY_FILE).exists():
        shutil.copy2(key, path / KEY_FILE)
    with mock.patch.dict(os.environ, {"FLEETWATCH_DATA_DIR": str(path)}):
        data_dir_prepare()
    return path


def worker_environment(worker_id: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What changes in the environment of xdist worker ``worker_id``."""
    from fleetwatch.datadir import data_dir

    index = worker_index(worker_id)
    env: dict[str, str] = {}
    for name in ("CELERY_BROKER_URL", "REDIS_URL", "FLEETWATCH_CACHE_URL"):
        url = environ.get(name, "")
        if url.startswith(("redis://", "rediss://")):
            env[name] = redis_url_for_worker(url, index, redis_databases(url))
    with mock.patch.dict(os.environ, {"FLEETWATCH_DATA_DIR": environ.get("FLEETWATCH_DATA_DIR", "")}):
        base = data_dir()  # the settings' own default where none is set
    env["FLEETWATCH_DATA_DIR"] = str(data_dir_for_worker(base, worker_id))
    return env


@contextlib.contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Hold a lock on this machine named ``name`` (a file in the temporary folder, flock'ed):
    another process asking for it, in this run or another, waits until it is released. The
    kernel drops it with the process, so a killed run leaves nothing locked."""
    path = Path(tempfile.gettempdir()) / f"fleetwatch-{name}.lock"
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- which worker runs what ----------------------------------------------------------------

GROUPS_KEY = "fleetwatch_xdist_groups"  # in each worker's workerinput: the folder of the files


def groups_write(folder: Path, worker_id: str, groups: Mapping[str, str]) -> None:
    """A worker's {node id: group} for the tests it collected (every worker collects them all
    and writes the same), whole or not at all."""
    path = folder / f"{worker_id}.json"
    partial = folder / f".{worker_id}.json.partial"
    partial.write_text(json.dumps(dict(groups)))
    partial.replace(path)


def groups_read(folder: Path) -> dict[str, str]:
    groups: dict[str, str] = {}
    for path in sorted(folder.glob("gw*.json")):
        groups.update(json.loads(path.read_text()))
    return groups


def group_scheduling(config: Any, log: Any, folder: Path) -> Any:
    """xdist's LoadScopeScheduling (a unit of work is handed to one worker whole, in the order
    collected) with the groups the workers wrote as its units."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            # First called once every worker has finished collecting (and written its file).
            if self._groups is None:
                self._groups = groups_read(folder)
            return self._groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)
