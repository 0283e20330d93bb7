"""The suite's own pytest-xdist plumbing (tests/harness/parallel.py, tests/conftest.py): what each
worker is given so that it runs as a test run of its own, and which tests go together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.parallel import (
    ParallelSetupError,
    data_dir_for_worker,
    groups_read,
    groups_write,
    redis_url_for_worker,
    worker_environment,
    worker_index,
)

ROOT = Path(__file__).resolve().parents[2]


def test_each_worker_gets_the_next_redis_database() -> None:
    assert redis_url_for_worker("redis://127.0.0.1:6379/9", 0) == "redis://127.0.0.1:6379/9"
    assert redis_url_for_worker("redis://127.0.0.1:6379/9", 3) == "redis://127.0.0.1:6379/12"
    assert redis_url_for_worker("redis://:pw@cache:6380", 2) == "redis://:pw@cache:6380/2"
    with pytest.raises(ParallelSetupError, match=r"needs Redis database 16 .* databases 0-15"):
        redis_url_for_worker("redis://127.0.0.1:6379/13", 3)
    assert worker_index("gw11") == 11
    with pytest.raises(ParallelSetupError):
        worker_index("master")


def test_a_worker_gets_a_data_folder_of_its_own_with_the_runs_key(tmp_path: Path) -> None:
    (tmp_path / "secret_key").write_text("the-runs-key\n")
    folder = data_dir_for_worker(tmp_path, "gw1")
    assert folder == tmp_path / "xdist-gw1"
    assert (folder / "staticfiles").is_dir()
    assert (folder / "secret_key").read_text() == "the-runs-key\n"

    env = worker_environment("gw2", {"FLEETWATCH_DATA_DIR": str(tmp_path),
                                     "CELERY_BROKER_URL": "redis://127.0.0.1:1/4",
                                     "DATABASE_URL": "postgres://postgres@127.0.0.1/fw"})
    # Nothing answers on port 1: the default 16 databases are assumed.
    assert env == {"CELERY_BROKER_URL": "redis://127.0.0.1:1/6",
                   "FLEETWATCH_DATA_DIR": str(tmp_path / "xdist-gw2")}


def test_groups_written_by_the_workers_are_read_whole(tmp_path: Path) -> None:
    groups_write(tmp_path, "gw0", {"tests/a.py::t1": "tests/a.py", "tests/b.py::t": "kmsg"})
    groups_write(tmp_path, "gw1", {"tests/a.py::t1": "tests/a.py", "tests/b.py::t": "kmsg"})
    assert groups_read(tmp_path) == {"tests/a.py::t1": "tests/a.py", "tests/b.py::t": "kmsg"}
    assert not list(tmp_path.glob(".*partial"))


PRINT_GROUPS = """
import json

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    from tests.conftest import xdist_group

    print("GROUPS " + json.dumps({item.nodeid: xdist_group(item) for item in items}))
"""


def test_a_module_fixture_or_a_group_keeps_its_tests_on_one_worker(tmp_path: Path) -> None:
    """The groups --dist loadgroup hands out whole, on the real suite's collection: a module
    whose tests share a Slurm cluster (one group per Slurm release: each makes its own), the
    /dev/kmsg tests, and tests that share nothing, each on its own."""
    (tmp_path / "print_groups.py").write_text(PRINT_GROUPS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "-p", "print_groups", "tests/integration/test_slurm.py",
         "tests/unit/test_agent_kernel.py", "tests/unit/test_env.py"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
        text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("GROUPS ")]
    groups: dict[str, str | None] = json.loads(line.removeprefix("GROUPS "))

    def of(module: str) -> set[str | None]:
        return {group for nodeid, group in groups.items() if nodeid.startswith(module)}

    assert of("tests/integration/test_slurm.py") == {
        "tests/integration/test_slurm.py[slurm_install=22.05]",
        "tests/integration/test_slurm.py[slurm_install=25.11]"}
    assert of("tests/unit/test_agent_kernel.py") == {"kmsg"}
    assert of("tests/unit/test_env.py") == {None}
