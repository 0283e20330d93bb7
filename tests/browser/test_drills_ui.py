"""Fire drills in a real browser (headless Chromium) against the live `make run` stack: an
operator opens the Drills page from the navigation, presses "Run a drill now", and watches the
drill's report fill in until it passes (phases, the timeline with each "would call", the link
to its incident, which says it is a drill); a second press while one runs starts none and says
so; a viewer sees the reports but no button; axe-core finds no serious violation on the drills
pages. A page that logs a console error or throws fails the test."""

from __future__ import annotations

import re
from typing import Any

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, VIEWER, VIEWPORT, Errors, Stack, screenshot

pytestmark = pytest.mark.browser

LIVE = 60_000  # ms: a collection, a diagnosis and six steps, on a busy shared machine
CANARY = "gpu-016"


@pytest.fixture(scope="module")
def stack_env() -> dict[str, str]:
    return {"FLEETWATCH_DRILL_NODES": CANARY, "FLEETWATCH_DRILL_BUDGET_SECONDS": "120"}


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


def test_an_operator_runs_a_drill_and_reads_its_report(browser: Any, stack: Stack) -> None:
    # The demo's jobs fill every node; one ends, and its nodes are free canaries.
    stack.manage("fleetwatch", "sim", "--finish-job", "3003")
    errors = Errors()
    page = _login(browser, stack, OPERATOR, errors)
    expect(page.locator("[data-testid=count-healthy] b")).to_have_text("16", timeout=LIVE)
    page.click("[data-testid=nav-drills]")
    page.wait_for_url(re.compile(r"/drills/$"))
    expect(page.locator("[data-testid=nav-drills]")).to_have_attribute("aria-current", "page")
    expect(page.locator("[data-testid=empty]")).to_contain_text("No drill has run yet")
    expect(page.locator("[data-testid=drill-settings]")).to_contain_text(CANARY)
    found = _serious(page)

    page.click("#drill-run")
    page.wait_for_url(re.compile(r"/drills/\d+/$"))
    drill_url = page.url
    expect(page.locator("[data-testid=messages]")).to_contain_text("started (observe mode")
    status = page.locator("[data-testid=drill-status]")
    expect(status).to_have_attribute("data-status", "passed", timeout=LIVE)
    expect(page.locator("[data-testid=drill-title]")).to_contain_text(f"on {CANARY}")
    expect(page.locator("[data-testid=drill-passed]")).to_contain_text(
        f"nothing was changed on {CANARY}")
    phases = page.locator("[data-testid=drill-phases]")
    for phase in ("inject", "detect", "decide", "first_action", "drain", "replace", "total"):
        expect(phases.locator(f"td[data-phase={phase}]")).to_have_count(1)
    timeline = page.locator("[data-testid=drill-timeline]")
    expect(timeline.locator("li[data-type=would]")).to_have_count(5)
    expect(timeline).to_contain_text(f"would call provider.replace {CANARY}")
    expect(timeline.locator("li[data-type=drill]", has_text="canary chosen")).to_contain_text(
        "no user job")
    screenshot(page, "drill-report", publish=True, full_page=True)
    found += _serious(page)

    # Its incident says it is a drill, and links back.
    page.click("[data-testid=drill-incident]")
    page.wait_for_url(re.compile(r"/incidents/\d+/$"))
    banner = page.locator("[data-testid=drill-banner]")
    expect(banner).to_contain_text("A fire drill, not a real fault.")
    banner.locator("a").click()
    page.wait_for_url(drill_url)

    # The history lists it with its result and phases; the incidents list marks its incident.
    page.goto("/drills/")
    row = page.locator("[data-testid^=drill-row-]").first
    expect(row).to_contain_text("passed")
    expect(row).to_contain_text(CANARY)
    expect(row.locator(".phase", has_text="detect")).to_have_count(1)
    page.goto("/incidents/")
    expect(page.locator("[data-testid=incident-table] .badge.drill")).to_have_count(1)

    # Two presses at once: one drill, and the second is told which one runs.
    page.goto("/drills/")
    token = page.locator("[data-testid=drill-run-form] input[name=csrfmiddlewaretoken]") \
        .get_attribute("value")
    first = page.request.post("/drills/run", form={"csrfmiddlewaretoken": token})
    second = page.request.post("/drills/run", form={"csrfmiddlewaretoken": token})
    assert first.ok and second.ok
    assert "started (observe mode" in first.text()
    running = re.search(r"Fire drill #(\d+) started", first.text())
    assert running is not None
    assert (f"Fire drill #{running.group(1)} is already running" in second.text()
            and "no second drill was started" in second.text()), second.text()[-2000:]
    page.goto("/drills/")
    expect(page.locator("[data-testid^=drill-row-]")).to_have_count(2)
    screenshot(page, "drills", full_page=True)
    page.context.close()

    # A viewer reads the reports, and has no button.
    viewer = _login(browser, stack, VIEWER, errors)
    viewer.goto("/drills/")
    expect(viewer.locator("[data-testid^=drill-row-]")).to_have_count(2)
    expect(viewer.locator("#drill-run")).to_have_count(0)
    viewer.goto(drill_url)
    expect(viewer.locator("[data-testid=drill-status]")).to_have_attribute("data-status",
                                                                            "passed")
    viewer.context.close()
    assert not found, "\n".join(found)
    assert not errors.seen, errors.seen
