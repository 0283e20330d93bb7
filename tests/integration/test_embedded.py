"""`make run`'s embedded default, as a new user gets it: SQLite, the filesystem broker and the
simulated fleet, web (gunicorn), worker and beat started by deploy/run-local.sh. An XID 79
injected with the documented command ends in a resolved incident with all seven steps."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, stop_process_group, wait_for

pytestmark = pytest.mark.embedded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Token {token}"}
                                     if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def test_make_run_stack_heals_an_xid79(tmp_path: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env.update(FLEETWATCH_DATA_DIR=str(tmp_path / "data"), PORT=str(port),
               VENV=str(Path(sys.executable).parent.parent), FLEETWATCH_COLLECT_INTERVAL="1",
               FLEETWATCH_SIM_SPEED="40", FLEETWATCH_DEMO_PASSWORD="demo-pass-123")
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["deploy/run-local.sh"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    manage = [sys.executable, "manage.py"]
    try:
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _get(f"{base}/healthz")[0] == 200, 90, "the web server")
        except AssertionError:
            print(log.read_text()[-5000:])
            raise
        health = json.loads(_get(f"{base}/healthz")[1])
        assert health == {"status": "ok", "database": "ok", "broker": "ok"}
        assert b"demo / demo-pass-123" in log.read_bytes()
        status, login = _get(f"{base}/login/")
        assert status == 200 and b"Log in" in login

        token = subprocess.run(
            [*manage, "fleetwatch", "api-token", "create", "--user", "demo", "--name", "embedded",
             "--scopes", "read"], cwd=ROOT, env=env, capture_output=True,
            text=True, check=True).stdout.strip()
        wait_for(lambda: json.loads(_get(f"{base}/api/v1/nodes/?health=healthy", token)[1])
                 .get("count") == 16, 30, "the first collection")
        subprocess.run([*manage, "fleetwatch", "inject", "xid", "--node", "gpu-003", "--gpu",
                        "5", "--code", "79"], cwd=ROOT, env=env, check=True)

        def resolved() -> dict | None:
            body = json.loads(_get(f"{base}/api/v1/incidents/?status=resolved", token)[1])
            return body["results"][0] if body.get("count") else None

        try:
            incident = wait_for(resolved, 90, "the incident to resolve", interval=1)
        except AssertionError:
            print(log.read_text()[-8000:])
            raise
        steps = incident["remediations"][0]["steps"]
        assert [s["status"] for s in steps] == ["succeeded"] * 8  # the gate among them
        assert incident["nodes"] == ["gpu-003"] and incident["root_cause"] == "gpu_hardware"
    finally:
        stop_process_group(proc)
