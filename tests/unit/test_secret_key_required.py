"""A deployment (the real fleet, or a database server) refuses to start without SECRET_KEY, with
a message naming it and why; the embedded default (``make run``: nothing set) still makes up
and keeps its own key.

Each case imports the settings in a fresh interpreter with only the environment it names, as a
deployment's process would (the refusal happens at import, before any command runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
POSTGRES = "postgres://fleetwatch@db.example.org:5432/fleetwatch"
SHOW = ("import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps([s.FLEETWATCH_FLEET, s.SECRET_KEY]))")
REFUSAL = "django.core.exceptions.ImproperlyConfigured: SECRET_KEY is not set, and "


def _python(home: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
             "FLEETWATCH_DATA_DIR": str(home / "data"), "PYTHONDONTWRITEBYTECODE": "1",
             "DJANGO_SETTINGS_MODULE": "fleetwatch.settings", **env}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=clean, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize(("env", "why"), [
    ({"DATABASE_URL": POSTGRES, "FLEETWATCH_FLEET": "sim"},
     "DATABASE_URL naming a database server (postgresql) means a deployment"),
    ({"FLEETWATCH_FLEET": "real", "FLEETWATCH_PROMETHEUS_URL": "http://prometheus:9090"},
     "FLEETWATCH_FLEET=real means a deployment"),
    ({"DATABASE_URL": POSTGRES, "FLEETWATCH_FLEET": "real",
      "FLEETWATCH_PROMETHEUS_URL": "http://prometheus:9090", "SECRET_KEY": "  "},
     "FLEETWATCH_FLEET=real means a deployment"),  # blank is not set
], ids=["postgres", "real-fleet", "blank"])
def test_a_deployment_without_secret_key_is_refused(tmp_path: Path, env: dict[str, str],
                                                    why: str) -> None:
    for command in (["-c", SHOW], ["manage.py", "check"]):
        done = _python(tmp_path, env, *command)
        assert done.returncode != 0, done.stdout
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(REFUSAL + why), done.stderr
        assert "set SECRET_KEY" in last
        assert "System check" not in done.stdout


def test_a_saved_key_does_not_stand_in_for_a_deployment(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "secret_key").write_text("s" * 60)
    done = _python(tmp_path, {"DATABASE_URL": POSTGRES, "FLEETWATCH_FLEET": "sim"}, "-c", SHOW)
    assert done.returncode != 0
    assert REFUSAL in done.stderr


def test_a_deployment_with_secret_key_starts(tmp_path: Path) -> None:
    done = _python(tmp_path, {"DATABASE_URL": POSTGRES, "FLEETWATCH_FLEET": "sim",
                              "SECRET_KEY": "k" * 60}, "-c", SHOW)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["sim", "k" * 60]


def test_the_embedded_default_needs_no_key(tmp_path: Path) -> None:
    """``make run`` with nothing set: manage.py makes and keeps a key in the data folder."""
    done = _python(tmp_path, {}, "manage.py", "check")
    assert done.returncode == 0, done.stderr
    saved = (tmp_path / "data" / "secret_key").read_text()
    shown = _python(tmp_path, {}, "-c", SHOW)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == ["sim", saved]
