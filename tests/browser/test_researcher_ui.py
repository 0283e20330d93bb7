"""A researcher reads why their job died, in a real browser (headless Chromium) against the
live stack (gunicorn, a real Celery worker and beat, the simulated fleet).

An operator injects an XID 79 under a running job and approves the repair; then the
researcher (a viewer: read-only) opens the job's page and finds the answer in its first line:
what stopped the job, when, on which node and GPU, that FleetWatch requeued it and where it
resumed, that it was not the job's fault, what Slurm itself now says in the job's comment,
and a chart of the job's GPUs with the fault marked. The original start time survives the
requeue. A page that logs a console error or throws fails the test.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, VIEWER, Errors, Stack, screenshot
from tests.browser.test_operator_ui import HEAL, LIVE, _login

pytestmark = pytest.mark.browser


def test_a_researcher_reads_why_their_job_died_on_its_page(browser: Any, stack: Stack) -> None:
    errors = Errors()
    ops = _login(browser, stack, OPERATOR, errors)
    expect(ops.locator("[data-testid=count-healthy] b")).to_have_text("16", timeout=LIVE)
    ops.select_option("#inject-kind", "xid")
    ops.fill("#inject-node", "gpu-003")
    ops.fill("#inject-gpu", "5")
    ops.fill("#inject-code", "79")
    ops.click("#inject-submit")
    expect(ops.locator("[data-testid=messages]")).to_contain_text("Injected")
    row = ops.locator("[data-testid^=open-incident-]")
    expect(row).to_have_count(1, timeout=LIVE)
    row.locator("a").first.click()
    ops.wait_for_url(re.compile(r"/incidents/\d+/$"))
    incident = int(ops.url.rstrip("/").rsplit("/", 1)[1])
    job_link = ops.locator("[data-testid=diagnosis] a[href^='/jobs/']").first
    expect(job_link).to_be_visible(timeout=LIVE)
    job = job_link.inner_text().strip()
    expect(ops.locator("[data-testid=remediation-status]")).to_have_attribute(
        "data-status", "awaiting_approval", timeout=LIVE)
    ops.click("#approve-toggle")
    ops.click("#confirm-approve")
    expect(ops.locator("[data-testid=remediation-status]")).to_have_attribute(
        "data-status", "succeeded", timeout=HEAL)
    ops.context.close()

    # The researcher: read-only, straight to the job's page.
    page = _login(browser, stack, VIEWER, errors)
    page.goto(f"/jobs/{job}/")
    first = page.locator("[data-testid=job-why]")
    expect(first).to_contain_text(
        f"XID 79 (GPU has fallen off the bus) on gpu-003 GPU 5 stopped job {job} at ")
    expect(first).to_contain_text("FleetWatch stopped it and requeued it")
    expect(first).to_contain_text(f"(incident {incident})")
    # The collector has seen it run again (it polls every second): reload until it says so.
    for _ in range(30):
        if "it resumed from step" in first.inner_text():
            break
        page.wait_for_timeout(1000)
        page.reload()
    expect(first).to_contain_text(re.compile(r"it resumed from step \d+ \(\d+ steps? lost\)"))
    expect(page.locator("[data-testid=why-fault]")).to_contain_text("not the job's fault")
    expect(page.locator("[data-testid=why-where]")).to_have_text("gpu-003 GPU 5")
    expect(page.locator("[data-testid=why-resumed]")).to_contain_text("from step")
    expect(page.locator("[data-testid=why-slurm-comment]")).to_have_text(re.compile(
        rf"^fleetwatch: requeued after XID 79 \(GPU has fallen off the bus\) on gpu-003 GPU 5, "
        rf"incident {incident}"))
    expect(page.locator("[data-testid=job-restarts]")).to_have_text("1")
    # The first start survives the requeue: it is earlier than the latest one.
    first_start = page.locator("[data-testid=job-first-started]").inner_text()
    assert first_start not in ("", "-"), first_start

    # The chart of its GPUs over its life, the fault marked.
    chart = "#job-util-chart"
    page.wait_for_function("(sel) => document.querySelector(sel)?.dataset.state === 'drawn'",
                           arg=chart, timeout=LIVE)
    expect(page.locator(f"{chart} .scatterlayer .trace path.js-line").first).to_be_attached()
    expect(page.locator(f"{chart} .annotation-text", has_text="fault")).to_have_count(1)
    screenshot(page, "job-why", publish=True, full_page=True)
    page.context.close()
    assert not errors.seen, errors.seen
