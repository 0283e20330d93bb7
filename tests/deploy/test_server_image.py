"""FleetWatch's server image as a platform team runs it (deploy/image/README.md): built with
deploy/image/build.sh, run with podman as Kubernetes would run it (read-only root, /data and
/tmp the only writable mounts, uid 10001, every capability dropped), against the suite's
PostgreSQL (a database of this test's own, made and dropped here) and Redis: migrations from
the image (`manage migrate`, as the Job runs them), web answering /healthz and serving a static
file, a worker from the same image ready, beat started, web stopping cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.deploy.test_agent_deploy import PODMAN, limits, podman_logs, running
from tests.harness.parallel import machine_lock

ROOT = Path(__file__).resolve().parent.parent.parent
BUILD = ROOT / "deploy" / "image" / "build.sh"
IMAGE = "localhost/fleetwatch:latest"
STATIC = "static/fleetwatch/fleetwatch.css"  # a file of the checkout's static/, collected

pytestmark = [pytest.mark.image, pytest.mark.timeout(1200)]


def podman_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("building and running the image needs root (mmdebstrap, rootful podman)")
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        pytest.skip("podman is not installed and apt-get cannot install it here")


def build_image() -> str:
    """deploy/image/build.sh from this checkout: the ``image`` fixture (tests/deploy/conftest.py,
    once per test run). One build at a time on this machine: two would race on the shared base
    image and the tags."""
    podman_or_skip()
    started = time.monotonic()
    with machine_lock("image-build"):
        done = subprocess.run([str(BUILD)], cwd=ROOT, capture_output=True, text=True,
                              timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(f"build.sh: {time.monotonic() - started:.1f} s; {done.stdout.splitlines()[-1]}")
    return IMAGE


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    """A database of this module's own on the suite's PostgreSQL, dropped afterwards."""
    import psycopg

    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        pytest.skip("needs the suite's PostgreSQL (tests/harness/with-services.sh)")
    name = f"fw_image_{os.getpid()}"
    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """/data for every container: writable by uid 10001 only (group 0, as OpenShift runs it)."""
    path = tmp_path_factory.mktemp("image-data")
    os.chown(path, 10001, 0)
    path.chmod(0o770)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Fleet:
    """Containers of the image, as the manifests run them; removed at the end."""

    def __init__(self, image: str, database_url: str, data: Path) -> None:
        broker = os.environ.get("CELERY_BROKER_URL") or os.environ.get("REDIS_URL", "")
        if not broker.startswith("redis"):
            pytest.skip("needs the suite's Redis (tests/harness/with-services.sh)")
        self.image, self.data, self.names = image, data, []
        self.env = {"DATABASE_URL": database_url, "CELERY_BROKER_URL": broker,
                    "SECRET_KEY": secrets.token_urlsafe(50), "FLEETWATCH_FLEET": "sim",
                    "FLEETWATCH_LOG_FORMAT": "plain", "HOST": "127.0.0.1"}

    def options(self, name: str | None = None, **env: str) -> list[str]:
        opts = [*limits(), "--network", "host",  # no host network change (RECIPE.md)
                "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777",
                "-v", f"{self.data}:/data", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges"]
        if name:
            opts += ["--name", name]
        for key, value in {**self.env, **env}.items():
            opts += ["-e", f"{key}={value}"]
        return opts

    def run(self, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*PODMAN, "run", "--rm", *self.options(**env), self.image, *args],
                              capture_output=True, text=True, timeout=timeout, check=False)

    def start(self, role: str, *args: str, **env: str) -> str:
        name = f"fleetwatch-image-test-{role}-{os.getpid()}-{len(self.names)}"
        self.names.append(name)
        done = subprocess.run([*PODMAN, "run", "-d", *self.options(name, **env), self.image, role,
                               *args], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return name

    def remove(self) -> None:
        for name in self.names:
            subprocess.run([*PODMAN, "rm", "-f", "-t", "0", name], capture_output=True,
                           timeout=60, check=False)


@pytest.fixture(scope="module")
def fleet(image: str, database_url: str, data_dir: Path) -> Iterator[Fleet]:
    fleet = Fleet(image, database_url, data_dir)
    # Earlier tests leave tasks queued for their own databases in the suite's Redis: a worker
    # container must not take them (as tests/conftest.py's worker fixture does).
    import redis

    redis.Redis.from_url(fleet.env["CELERY_BROKER_URL"]).flushdb()
    try:
        yield fleet
    finally:
        fleet.remove()


@pytest.fixture(scope="module")
def migrated(fleet: Fleet) -> Fleet:
    """Migrations as the Job runs them: `manage migrate`, the same image, then nothing left."""
    done = fleet.run("manage", "migrate", "--noinput")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plan = fleet.run("manage", "showmigrations", "--plan")
    assert plan.returncode == 0, plan.stderr
    assert "[X]" in plan.stdout and "[ ]" not in plan.stdout, plan.stdout
    return fleet


def get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for_health(name: str, port: int, timeout: float = 90) -> float:
    """Seconds until /healthz answers 200."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            status, _ = get(f"http://127.0.0.1:{port}/healthz", timeout=3)
            if status == 200:
                return time.monotonic() - started
        except OSError:
            pass
        assert running(name), podman_logs(name)
        time.sleep(0.2)
    raise AssertionError(f"no /healthz 200 after {timeout} s: {podman_logs(name)[-3000:]}")


def wait_for_log(name: str, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = podman_logs(name)
        if text in logs:
            return logs
        assert running(name), logs[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no '{text}' in {name}'s log after {timeout} s: {podman_logs(name)[-3000:]}")


def test_the_image_holds_no_build_or_test_tools(image: str) -> None:
    inspect = subprocess.run([*PODMAN, "image", "inspect", image], capture_output=True, text=True,
                             timeout=60, check=True)
    (meta,) = json.loads(inspect.stdout)
    config = meta["Config"]
    assert config["User"] == "10001:0"
    assert config["Entrypoint"] == ["/usr/bin/tini", "--", "/app/deploy/image/entrypoint.sh"]
    assert config["Cmd"] == ["web"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, timeout=60, check=False).stdout.strip()
    labels = meta["Labels"]
    assert labels["org.opencontainers.image.version"].startswith("0.1.0+g")
    assert labels["org.opencontainers.image.revision"].startswith(head or "unknown")
    assert meta["Healthcheck"]["Test"] == ["CMD", "/app/deploy/image/entrypoint.sh",
                                             "healthcheck"]
    probe = ("import importlib.util as u, os, shutil\n"
             "print(sorted(m for m in ('pytest', 'mypy', 'ruff', 'playwright', 'schemathesis',"
             " 'pip', 'setuptools') if u.find_spec(m)))\n"
             "print(sorted(t for t in ('gcc', 'cc', 'make', 'apt-get', 'pip') if "
             "shutil.which(t) and t != 'apt-get'))\n"
             "print(os.getuid(), len(os.listdir('/app/staticfiles')) > 0)\n")
    done = subprocess.run([*PODMAN, "run", "--rm", "--network", "none", *limits(), "--read-only",
                           image, "python", "-c", probe], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["[]", "[]", "10001 True"], done.stdout


def test_the_acceptance_check_runs_in_the_image_as_a_check_job_runs_it(image: str) -> None:
    """On a pool Kubernetes schedules the gate's check Job runs this image with the default
    FLEETWATCH_GATE_CHECK_DIR: the Job's command (collectors.clients.kubernetes's manifest,
    the gate's script) finds the check there and it gives its verdict line (no GPU here: the
    CPU and memory burn-in)."""
    from collectors.clients.base import PodCheckSpec
    from collectors.clients.kubernetes import check_job_manifest
    from collectors.knowledge.acceptance import CHECKS
    from incidents.remediation import gate

    check = CHECKS["fleetwatch-check"]
    planned = gate.PlannedCheck(check.name, check.command.replace(
        "{check_dir}", "/opt/fleetwatch/checks"), check.minutes)
    plan = gate.GatePlan(key="img", node="gpu-a", repair="replace", checks=(planned,),
                         environment={"FLEETWATCH_CHECK_SECONDS": "1"})
    job = check_job_manifest(PodCheckSpec("fleetwatch-check-img", "fleetwatch", "gpu-a", image,
                                          gate.check_script(planned, plan, None), 15))
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    done = subprocess.run([*PODMAN, "run", "--rm", "--network", "none", *limits(), "--read-only",
                           "--entrypoint", command[0], image, *command[1:]],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, (done.stdout, done.stderr)
    verdict = gate.result_line(done.stdout)
    assert verdict["check"] == "fleetwatch-check" and verdict["ok"] is True, done.stdout


def test_a_deployment_without_secret_key_stops_naming_it(fleet: Fleet) -> None:
    """Every subcommand: at once, with the message, and web before any worker boots."""
    for role in (["manage", "check"], ["web"], ["worker"], ["beat"]):
        done = fleet.run(*role, SECRET_KEY="", PORT=str(free_port()), timeout=120)
        assert done.returncode != 0, role
        output = done.stdout + done.stderr
        assert "SECRET_KEY is not set" in output, (role, output[-2000:])
        if role == ["web"]:
            assert "FleetWatch cannot start: SECRET_KEY is not set" in output, output[-2000:]
            assert "Booting worker" not in output, output[-2000:]


def test_web_worker_and_beat_from_one_image(migrated: Fleet) -> None:
    fleet = migrated
    port = free_port()
    started = time.monotonic()
    web = fleet.start("web", PORT=str(port), WEB_CONCURRENCY="2")
    took = wait_for_health(web, port)
    print(f"podman run -> /healthz 200: {time.monotonic() - started:.2f} s "
          f"({took:.2f} s after podman run -d returned)")
    status, body = get(f"http://127.0.0.1:{port}/healthz")
    assert json.loads(body) == {"status": "ok", "database": "ok", "broker": "ok"}
    # The image's own HEALTHCHECK, run as the runtime would.
    check = subprocess.run([*PODMAN, "healthcheck", "run", web], capture_output=True, text=True,
                           timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    # A static file, collected at build time, served by WhiteNoise (compressed on request).
    status, css = get(f"http://127.0.0.1:{port}/{STATIC}")
    assert status == 200 and css == (ROOT / STATIC).read_bytes()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/{STATIC}",
                                     headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.headers.get("Content-Encoding") == "gzip"
    status, _ = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200

    worker = fleet.start("worker", "--concurrency", "1")
    wait_for_log(worker, "ready.")
    beat = fleet.start("beat")
    logs = wait_for_log(beat, "beat: Starting")
    time.sleep(3)  # it keeps running (its schedule file on /data), sending its first tasks
    assert running(beat), podman_logs(beat)
    assert any(p.name.startswith("celerybeat-schedule") for p in fleet.data.iterdir()), logs

    for name in (web, worker, beat):
        logs = podman_logs(name)
        assert "Traceback" not in logs and "Read-only file system" not in logs, logs[-3000:]

    # SIGTERM (podman stop): gunicorn stops its workers gracefully and exits 0.
    stopping = time.monotonic()
    subprocess.run([*PODMAN, "stop", "-t", "25", web], capture_output=True, timeout=60, check=True)
    print(f"podman stop (web): {time.monotonic() - stopping:.1f} s")
    # 0, not 137: gunicorn stopped on SIGTERM before podman's 25 s ran out and it sent SIGKILL.
    assert exit_code(web) == "0", podman_logs(web)[-3000:]
    # The worker's warm shutdown and beat stop on SIGTERM too, through tini, exit 0.
    for name in (worker, beat):
        subprocess.run([*PODMAN, "stop", "-t", "25", name], capture_output=True, timeout=60,
                       check=True)
        assert exit_code(name) == "0", podman_logs(name)[-3000:]
    # web does not migrate unless told: the default logs no migration, FLEETWATCH_MIGRATE=1
    # migrates first (nothing left to do here, the Job did it) and then serves.
    assert "migrations" not in podman_logs(web).lower()
    port = free_port()
    web = fleet.start("web", PORT=str(port), FLEETWATCH_MIGRATE="1")
    wait_for_health(web, port)
    assert "No migrations to apply." in podman_logs(web), podman_logs(web)[-3000:]


def exit_code(name: str) -> str:
    return subprocess.run([*PODMAN, "inspect", "--format", "{{.State.ExitCode}}", name],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
