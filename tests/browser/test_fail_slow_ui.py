"""Fail-slow in a real browser (headless Chromium) against the live stack: a node of the
simulated fleet's biggest job is held at a power cap, the fail-slow scan finds it (the command
the beat's task runs, against the stack's own database and fleet), and the incident page
explains the slowness with numbers: which figures, by how much against the job's peers, for
how long, and why the clocks are held; its timeline lists the same figures; axe-core finds no
serious or critical violation on the page.

The stack's fleet is seeded when the stack starts, so its jobs have run for about a minute:
the scan runs with a one-minute sustained time and a 5 s step here (the defaults are five
minutes and 30 s), until the jobs' history holds that much."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Any

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, VIEWPORT, Errors, Stack, screenshot
from tests.conftest import ROOT

pytestmark = pytest.mark.browser

LIVE = 60_000  # ms


def _scan(stack: Stack) -> str:
    env = {**stack.env, "FLEETWATCH_FAIL_SLOW_SUSTAIN_MINUTES": "1",
           "FLEETWATCH_FAIL_SLOW_STEP_SECONDS": "5", "FLEETWATCH_FAIL_SLOW_WINDOW_MINUTES": "10"}
    done = subprocess.run([sys.executable, "manage.py", "fleetwatch", "fail-slow"], cwd=ROOT,
                          env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_incident_page_explains_the_slowness_with_numbers(browser: Any,
                                                              stack: Stack) -> None:
    # Every GPU of gpu-003 (job 3001, eight nodes) capped 40 % lower in power.
    stack.manage("fleetwatch", "inject", "slow", "--node", "gpu-003", "--how", "power-cap",
                 "--percent", "40", "--minutes-ago", "10")
    deadline = time.monotonic() + 240
    found = ""
    while time.monotonic() < deadline:
        found = _scan(stack)
        if "gpu-003 is slower than" in found:
            break
        time.sleep(10)
    assert "gpu-003 is slower than the other 7 nodes of job 3001" in found, found
    incident = re.search(r"incident (\d+) ", found)
    assert incident is not None, found

    errors = Errors()
    context = browser.new_context(viewport=VIEWPORT, base_url=stack.base)
    page = errors.watch(context.new_page())
    page.goto("/login/")
    page.fill("#id_username", OPERATOR[0])
    page.fill("#id_password", OPERATOR[1])
    page.click("button[type=submit]")
    expect(page.locator("[data-testid=whoami]")).to_contain_text(OPERATOR[0])

    # The incident list names it; its page explains it.
    page.goto("/incidents/")
    row = page.locator("tr", has_text="gpu-003").filter(has_text=re.compile("fail-slow", re.I))
    expect(row.first).to_be_visible(timeout=LIVE)
    page.goto(f"/incidents/{incident.group(1)}/")
    expect(page.locator("h1, h2").first).to_contain_text("fail-slow", ignore_case=True)
    body = page.locator("main")
    expect(body).to_contain_text("gpu-003 is slower than the other 7 nodes of job 3001 (alice)")
    expect(body).to_contain_text(re.compile(
        r"GPUs 0-7: SM clock [\d,]+ MHz vs its peers' median 1,9\d\d MHz \(-\d+%\) for \d+ "))
    expect(body).to_contain_text(re.compile(r"power [\d,]+ W vs its peers' median [\d,]+ W "
                                            r"\(-\d+%\)"))
    expect(body).to_contain_text("clock-event reasons: sw power cap")
    expect(body).to_contain_text("replace it at the job's next checkpoint")
    # The same figures on its timeline, one signal each.
    expect(page.locator("text=/gpu-003 GPUs 0-7: SM clock/").first).to_be_attached(
        timeout=LIVE)
    for chart in page.locator("[data-chart]").all():
        expect(chart).to_have_attribute("data-state", re.compile("drawn|empty"), timeout=LIVE)
    screenshot(page, "incident-fail-slow", publish=True)
    results = Axe().run(page)
    serious = [f"{v['id']} ({v['impact']}): {v['help']}" for v in results.response["violations"]
               if v["impact"] in ("serious", "critical")]
    assert not serious, serious
    context.close()
    assert not errors.seen, errors.seen
