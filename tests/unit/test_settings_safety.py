"""Settings are safe for production: a deployment on a database server that forgets
FLEETWATCH_FLEET stops with a message naming it and its values (it never comes up quietly on the
simulated fleet, fault-injection buttons and all), and importing the settings writes no file.
The embedded default (no DATABASE_URL) still runs the simulated fleet, and the programs that
use its data folder (manage.py, the Celery app, make run) make it and its key on first use.

Each case imports the settings in a fresh interpreter with only the environment it names, as a
deployment's process would."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fleetwatch.datadir import data_dir_prepare

ROOT = Path(__file__).resolve().parent.parent.parent
POSTGRES = "postgres://fleetwatch@db.example.org:5432/fleetwatch"
KEY = "k" * 60  # a deployment's SECRET_KEY (tests/unit/test_secret_key_required.py)
SHOW = ("import django, json; django.setup(); from django.conf import settings as s; "
        "import fleetwatch.urls; "
        "print(json.dumps([s.FLEETWATCH_FLEET, s.FLEETWATCH_DEMO_CONTROLS, s.SECRET_KEY, "
        "s.DATABASES['default']['ENGINE']]))")


def _python(home: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in the checkout with nothing of this process's environment but PATH:
    HOME and the data folder in ``home``."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
             "FLEETWATCH_DATA_DIR": str(home / "data"), "PYTHONDONTWRITEBYTECODE": "1",
             "DJANGO_SETTINGS_MODULE": "fleetwatch.settings", **env}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=clean, capture_output=True,
                          text=True, timeout=120, check=False)


def _files(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*"))


def test_a_database_server_without_a_fleet_is_refused(tmp_path: Path) -> None:
    done = _python(tmp_path, {"DATABASE_URL": POSTGRES}, "-c", SHOW)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: FLEETWATCH_FLEET is "
                           "not set"), done.stderr
    assert "DATABASE_URL" in last and "Allowed values: sim, real." in last
    assert _files(tmp_path) == []


@pytest.mark.parametrize("command", [["-c", SHOW], ["manage.py", "check"]])
def test_the_refusal_comes_before_anything_runs(tmp_path: Path, command: list[str]) -> None:
    done = _python(tmp_path, {"DATABASE_URL": POSTGRES}, *command)
    assert done.returncode != 0 and "FLEETWATCH_FLEET is not set" in done.stderr
    assert "System check" not in done.stdout


def test_a_database_server_with_a_named_fleet(tmp_path: Path) -> None:
    sim = _python(tmp_path, {"DATABASE_URL": POSTGRES, "FLEETWATCH_FLEET": "sim",
                             "SECRET_KEY": KEY}, "-c", SHOW)
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)[:2] == ["sim", True]
    real = _python(tmp_path, {"DATABASE_URL": POSTGRES, "FLEETWATCH_FLEET": "real",
                              "SECRET_KEY": KEY,
                              "FLEETWATCH_PROMETHEUS_URL": "http://prometheus:9090"}, "-c", SHOW)
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout)[:2] == ["real", False]  # no fault-injection buttons
    typo = _python(tmp_path, {"DATABASE_URL": POSTGRES, "FLEETWATCH_FLEET": "prod"}, "-c", SHOW)
    assert typo.returncode != 0
    assert "FLEETWATCH_FLEET='prod' is not one of sim, real" in typo.stderr


def test_the_embedded_default_runs_the_simulated_fleet_and_writes_nothing(
        tmp_path: Path) -> None:
    done = _python(tmp_path, {}, "-c", SHOW)
    assert done.returncode == 0, done.stderr
    fleet, controls, key, engine = json.loads(done.stdout)
    assert (fleet, controls, engine) == ("sim", True, "django.db.backends.sqlite3")
    assert len(key) >= 50
    # Neither the data folder, nor its key, broker, static or cache folders: nothing at all.
    assert _files(tmp_path) == []
    # A SQLite file named by DATABASE_URL is the embedded kind too (no fleet needed).
    sqlite = _python(tmp_path, {"DATABASE_URL": f"sqlite:///{tmp_path / 'x.sqlite3'}"},
                     "-c", SHOW)
    assert sqlite.returncode == 0, sqlite.stderr
    assert _files(tmp_path) == []


def test_importing_the_celery_app_writes_nothing_until_it_loads_its_configuration(
        tmp_path: Path) -> None:
    code = ("import os; from fleetwatch.celery import app; "
            "print(os.path.exists(os.environ['FLEETWATCH_DATA_DIR'])); app.conf.broker_url; "
            "from django.conf import settings; print(settings.SECRET_KEY == open("
            "os.path.join(os.environ['FLEETWATCH_DATA_DIR'], 'secret_key')).read())")
    done = _python(tmp_path, {}, "-c", code)
    assert done.returncode == 0, done.stderr
    # First use (a worker or beat starting, a task sent): the folder and the key, which the
    # settings then read.
    assert done.stdout.split() == ["False", "True"]


def test_first_use_makes_the_data_folder_and_keeps_its_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SECRET_KEY", "CELERY_BROKER_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLEETWATCH_DATA_DIR", str(tmp_path / "data"))
    base = data_dir_prepare()
    assert base == tmp_path / "data"
    assert _files(tmp_path) == ["data", "data/broker", "data/broker/processed",
                                "data/secret_key", "data/staticfiles"]
    key = (base / "secret_key").read_text()
    assert len(key) >= 50 and stat.S_IMODE((base / "secret_key").stat().st_mode) == 0o600
    data_dir_prepare()  # every start: the same key (sessions and signed checkpoints survive)
    assert (base / "secret_key").read_text() == key
    # The settings of every later process read it.
    done = _python(tmp_path, {}, "-c", SHOW)
    assert json.loads(done.stdout)[2] == key


def test_first_use_with_a_key_and_a_broker_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETWATCH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SECRET_KEY", "k" * 60)
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
    data_dir_prepare()
    assert _files(tmp_path) == ["data", "data/staticfiles"]


def test_manage_py_makes_the_data_folder_as_make_run_did(tmp_path: Path) -> None:
    done = _python(tmp_path, {}, "manage.py", "check")
    assert done.returncode == 0, done.stderr
    assert {"data", "data/secret_key", "data/broker", "data/staticfiles"} <= set(_files(tmp_path))
