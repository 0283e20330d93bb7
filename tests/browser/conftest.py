"""The live stack and the browser the browser tests drive.

The stack is `make run`'s own (deploy/run-local.sh: gunicorn, a Celery worker and beat on
SQLite and the filesystem broker, the simulated fleet), started once per module in a private
data dir on a free port, with the policy in "approve" mode so a person's click is what starts
the repair. The browser is Debian's headless Chromium, driven by Python Playwright; Playwright's
own browser downloads are never used (the machines running this are often offline).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, stop_process_group, wait_for

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 800}
OPERATOR = ("demo", "demo-pass-123")
VIEWER = ("vera", "viewer-pass-123")
# Every run's screenshots (test artifacts); FLEETWATCH_UPDATE_SCREENSHOTS=1 also refreshes the
# ones committed under tests/browser/screenshots/ that the README shows.
SHOTS = ROOT / "reports" / "screenshots"
DOC_SHOTS = ROOT / "tests" / "browser" / "screenshots"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@dataclass
class Stack:
    base: str
    env: dict[str, str]
    log: Path

    def manage(self, *args: str) -> str:
        """Run manage.py against the stack's database (its data dir)."""
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@pytest.fixture(scope="module")
def stack_env() -> dict[str, str]:
    """More settings for a module's stack; override this name in a test module."""
    return {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stack_env: dict[str, str]) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    port = _free_port()
    # The embedded stack, whatever the suite's own services are: no DATABASE_URL or broker
    # from the environment, and none of the caller's FLEETWATCH_* settings.
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}
           and not k.startswith("FLEETWATCH_")}
    env.update(FLEETWATCH_DATA_DIR=str(tmp / "data"), PORT=str(port),
               VENV=str(Path(sys.executable).parent.parent),
               FLEETWATCH_POLICY_MODE="approve", FLEETWATCH_COLLECT_INTERVAL="1",
               FLEETWATCH_STEP_POLL_SECONDS="0.3", FLEETWATCH_SIM_SPEED="40",
               FLEETWATCH_DEMO_USER=OPERATOR[0], FLEETWATCH_DEMO_PASSWORD=OPERATOR[1],
               DJANGO_SETTINGS_MODULE="fleetwatch.settings")
    env.update(stack_env)
    log = tmp / "stack.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["deploy/run-local.sh"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    stack = Stack(f"http://127.0.0.1:{port}", env, log)
    try:
        try:
            wait_for(lambda: _status(f"{stack.base}/healthz") == 200, 90, "the web server")
        except AssertionError:
            print(stack.tail())
            raise
        # The viewer, in the same data dir (run-local.sh has migrated it by now).
        stack.manage("shell", "-c", "from collectors.roles import user_with_role; "
                     f"user_with_role({VIEWER[0]!r}, 'viewer', {VIEWER[1]!r})")
        yield stack
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium "
                    "(deploy/bootstrap.sh test does; never `playwright install`)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Errors:
    """What went wrong inside the pages: console errors and uncaught exceptions."""
    seen: list[str] = field(default_factory=list)

    def watch(self, page: Any) -> Any:
        page.on("console", lambda m: m.type == "error" and self.seen.append(
            f"{page.url}: console: {m.text}"))
        page.on("pageerror", lambda e: self.seen.append(f"{page.url}: pageerror: {e}"))
        # The console says only "Failed to load resource"; this says which one.
        page.on("response", lambda r: r.status >= 400 and r.request.method == "GET"
                and self.seen.append(f"{page.url}: GET {r.url} -> {r.status}"))
        return page


def screenshot(page: Any, name: str, publish: bool = False, full_page: bool = False) -> Path:
    """Save a screenshot as a test artifact; ``publish`` ones also go to tests/browser/screenshots/
    when FLEETWATCH_UPDATE_SCREENSHOTS=1. Kept small: the 1280x800 view, or the whole page
    where the point is below the fold (the dashboard's incidents under its grid)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    if publish and os.environ.get("FLEETWATCH_UPDATE_SCREENSHOTS") == "1":
        DOC_SHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOC_SHOTS / path.name)
    return path
