"""The capacity page in a real browser (headless Chromium) against the live stack (`make run`'s
gunicorn, Celery worker and beat, the simulated fleet): an operator sees GPUs by pool and use,
the charts, Slurm's pending demand and the idle nodes that could be lent; lends one with one
click after a confirmation that says what runs; watches the worker lend it; opens the loan's
page with its audit trail; and returns it. A viewer sees no buttons. axe-core finds no serious
violation on either page, and no page logs a console error."""

from __future__ import annotations

import re
from typing import Any

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, VIEWER, VIEWPORT, Errors, Stack, screenshot

pytestmark = pytest.mark.browser

LIVE = 60_000  # ms: a collection or a worker's run, on a busy shared machine
NODE = "gpu-013"

# The sim's job 3003 ends (its four nodes go idle in Slurm), and a capacity snapshot is
# taken at once rather than at the beat's next one (every 5 min).
FREE_NODES = (
    "from django.conf import settings; from collectors.sim.fleet import SimFleet; "
    "f = SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED)\n"
    "with f.transaction() as s: s['jobs']['3003'].update(state='COMPLETED', nodes=[], gpus={})")
SNAPSHOT = ("from collectors.services import collect_source; "
            "from incidents.lending.services import capacity_snapshot\n"
            "for source in ('slurm', 'kubernetes', 'telemetry'): collect_source(source)\n"
            "capacity_snapshot()")


def _login(browser: Any, stack: Stack, who: tuple[str, str], errors: Errors) -> Any:
    context = browser.new_context(viewport=VIEWPORT, base_url=stack.base)
    page = errors.watch(context.new_page())
    page.goto("/login/")
    page.fill("#id_username", who[0])
    page.fill("#id_password", who[1])
    page.click("button[type=submit]")
    expect(page.locator("[data-testid=whoami]")).to_contain_text(who[0])
    return page


def _serious(page: Any) -> list[str]:
    results = Axe().run(page)
    return [f"{page.url}: {v['id']} ({v['impact']}): {v['help']} at "
            f"{[n['target'] for n in v['nodes']][:5]}"
            for v in results.response["violations"] if v["impact"] in ("serious", "critical")]


def _reload_until(page: Any, locator: str, text: str) -> None:
    """The capacity page is not live: reload it until ``locator`` says ``text``."""
    for _ in range(LIVE // 1000):
        found = page.locator(locator)
        if found.count() and text in found.first.inner_text():
            return
        page.wait_for_timeout(1000)
        page.reload()
    expect(page.locator(locator)).to_contain_text(text)


def test_capacity_page_and_a_one_click_lend(browser: Any, stack: Stack) -> None:
    stack.manage("shell", "-c", FREE_NODES)
    stack.manage("shell", "-c", SNAPSHOT)
    errors = Errors()
    page = _login(browser, stack, OPERATOR, errors)
    page.click("[data-testid=nav-capacity]")
    page.wait_for_url(re.compile(r"/capacity/"))
    expect(page.locator("[data-testid=nav-capacity]")).to_have_attribute("aria-current", "page")
    now = page.locator("[data-testid=capacity-now]")
    expect(now.locator("[data-testid=pool-gpu] [data-testid=gpus-training_allocated]"))\
        .to_have_text("96")  # 12 of 16 nodes run jobs, 8 GPUs each
    expect(now.locator("[data-testid=pool-gpu] [data-testid=gpus-training_idle]")).to_have_text(
        "32")
    expect(page.locator("[data-testid=pending-jobs]")).to_have_text("0")
    for chart in page.locator("[data-chart]").all():
        expect(chart).to_have_attribute("data-state", "drawn", timeout=LIVE)
    expect(page.locator("#capacity-gpus-chart .legendtext",
                        has_text="Slurm training: idle")).to_have_count(1)
    lendable = page.locator(f"[data-testid=lendable-{NODE}]")
    expect(lendable).to_be_visible()

    # One click, after a confirmation that says what runs.
    page.click(f"#lend-toggle-{NODE}")
    confirmation = page.locator(f"[data-testid=control-lend-{NODE}] form")
    expect(confirmation).to_contain_text(f"This lends {NODE}")
    expect(confirmation).to_contain_text("drain it in Slurm with FleetWatch's reason")
    expect(confirmation).to_contain_text("label and taint it for inference in Kubernetes")
    expect(confirmation).to_contain_text("fleetwatch: lent to inference (loan N)")
    expect(confirmation).to_contain_text("evict its inference pods through the Eviction API")
    found = _serious(page)
    screenshot(page, "capacity-confirm-lend", full_page=True)
    page.click(f"#confirm-lend-{NODE}")
    expect(page.locator("[data-testid=messages]")).to_contain_text(
        f"Lending {NODE} to inference")
    row = page.locator(f"[data-testid=loan-{NODE}]")
    expect(row).to_have_count(1)
    _reload_until(page, f"[data-testid=loan-{NODE}] [data-testid=loan-status]",
                  "lent to inference")
    expect(page.locator(f"[data-testid=lendable-{NODE}]")).to_have_count(0)
    stack.manage("shell", "-c", SNAPSHOT)  # the chart shows the loan too
    page.reload()
    for chart in page.locator("[data-chart]").all():
        expect(chart).to_have_attribute("data-state", "drawn", timeout=LIVE)
    page.click("#lend-toggle-gpu-014")  # what the README shows: a lend's confirmation
    screenshot(page, "capacity-lend", publish=True, full_page=True)

    # The loan's page: its steps and its audit trail, each outside call once.
    row.locator("a").first.click()
    page.wait_for_url(re.compile(r"/capacity/loans/\d+/$"))
    expect(page.locator("[data-testid=loan-status]")).to_have_text("lent to inference")
    audit = page.locator("[data-testid=loan-audit]")
    expect(audit.locator("li", has_text="slurm.drain")).to_have_count(1)
    expect(audit.locator("li", has_text="slurm.drain")).to_contain_text(
        f"scontrol update nodename={NODE} state=DRAIN reason='fleetwatch: lent to inference")
    expect(audit.locator("li", has_text="k8s.relabel")).to_have_count(1)
    expect(audit.locator("li", has_text="loan.started")).to_contain_text(OPERATOR[0])
    found += _serious(page)

    # Return it.
    page.go_back()
    page.reload()
    page.click(f"[data-testid=loan-{NODE}] summary:has-text('Return to training')")
    page.click(f"[data-testid=loan-{NODE}] button:has-text('Confirm: return')")
    expect(page.locator("[data-testid=messages]")).to_contain_text("Returning to training")
    for _ in range(LIVE // 1000):
        if not page.locator(f"[data-testid=loan-{NODE}]").count():
            break
        page.wait_for_timeout(1000)
        page.reload()
    expect(page.locator(f"[data-testid=loan-{NODE}]")).to_have_count(0)
    expect(page.locator("[data-testid=loans] details")).to_contain_text(
        f"{NODE} returned to training")
    page.context.close()

    # A viewer reads the page and has no buttons.
    viewer = _login(browser, stack, VIEWER, errors)
    viewer.goto("/capacity/")
    expect(viewer.locator("[data-testid=capacity-now]")).to_be_visible()
    expect(viewer.locator("summary:has-text('Lend to inference')")).to_have_count(0)
    viewer.context.close()
    assert not found, "\n".join(found)
    assert not errors.seen, errors.seen
