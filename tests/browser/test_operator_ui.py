"""The operator UI in a real browser (headless Chromium) against the live stack with a real
Celery worker: an operator injects an XID 79, watches the incident appear and the repair run
without reloading, approves it from the incident page; a viewer sees no remediation control,
and a forged POST with the viewer's session and a valid CSRF token gets 403.

The tests run in order and share the stack: the viewer's test reads the incident the
operator's test healed. Waits are Playwright's own (``expect``, ``wait_for_selector``) with
generous timeouts; nothing is timed. A page that logs a console error or throws fails the test.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, VIEWER, VIEWPORT, Errors, Stack, screenshot

pytestmark = pytest.mark.browser

LIVE = 60_000  # ms: a collection, a diagnosis or a step, on a busy shared machine
HEAL = 120_000  # ms: the whole repair (drain, SIGTERM grace, requeue, replace, ...)
CONTROLS = ("#approve-toggle", "#cancel-toggle", "#continue-toggle", "#retry-toggle",
            "#start-toggle", "#confirm-approve", "#confirm-cancel", "#confirm-continue",
            "#confirm-retry", "#confirm-start")

# Remember, inside the page, that it has not been reloaded since (a reload drops it), and
# record every state the live region shows: the steps' statuses after each htmx swap.
MARK = "window.__fwNoReload = true"
RECORD_STEPS = """() => {
  window.__fwSteps = [];
  const snap = () => window.__fwSteps.push(Array.from(
      document.querySelectorAll('#incident-live [data-testid^="step-"]'),
      (li) => li.dataset.status).join(','));
  snap();
  new MutationObserver(snap).observe(document.getElementById('incident-live'),
                                     { childList: true });
}"""


def _login(browser: Any, stack: Stack, who: tuple[str, str], errors: Errors) -> Any:
    context = browser.new_context(viewport=VIEWPORT, base_url=stack.base)
    page = errors.watch(context.new_page())
    page.goto("/login/")
    page.fill("#id_username", who[0])
    page.fill("#id_password", who[1])
    page.click("button[type=submit]")
    expect(page.locator("[data-testid=whoami]")).to_contain_text(who[0])
    return page


def _not_reloaded(page: Any) -> bool:
    return bool(page.evaluate("window.__fwNoReload === true"))


def _expect_plot(page: Any, chart: str, drawing: str) -> None:
    """The chart is drawn, and still there after it has refreshed itself (and, on the
    dashboard, after the live region around it has been swapped)."""
    page.wait_for_function(
        "([sel, n]) => Number(document.querySelector(sel)?.dataset.draws || 0) >= n",
        arg=[chart, 2], timeout=LIVE)
    expect(page.locator(chart)).to_have_attribute("data-state", "drawn")
    expect(page.locator(f"{chart} {drawing}").first).to_be_attached()


@pytest.fixture(scope="module")
def shared() -> dict[str, Any]:
    """What the operator's test leaves for the viewer's: the incident and remediation."""
    return {}


def test_operator_injects_xid79_approves_and_watches_it_heal(
        browser: Any, stack: Stack, shared: dict[str, Any]) -> None:
    errors = Errors()
    page = _login(browser, stack, OPERATOR, errors)
    expect(page.locator("[data-testid=role]")).to_have_text("operator")
    expect(page.locator("[data-testid=whoami]")).to_contain_text("policy approve")

    # The dashboard fills in by itself once the first collection has run.
    expect(page.locator("[data-testid=count-healthy] b")).to_have_text("16", timeout=LIVE)
    expect(page.locator("#gpu-grid")).to_have_attribute("data-state", "drawn", timeout=LIVE)
    expect(page.locator("[data-testid^=open-incident-]")).to_have_count(0)
    page.evaluate(MARK)

    # Inject from the dashboard's form in a second tab, so the first one stays unreloaded.
    inject = errors.watch(page.context.new_page())
    inject.goto("/")
    inject.select_option("#inject-kind", "xid")
    inject.fill("#inject-node", "gpu-003")
    inject.fill("#inject-gpu", "5")
    inject.fill("#inject-code", "79")
    inject.click("#inject-submit")
    expect(inject.locator("[data-testid=messages]")).to_contain_text("Injected")

    # The incident appears on the untouched dashboard: the live region polls every 3 s.
    row = page.locator("[data-testid^=open-incident-]")
    expect(row).to_have_count(1, timeout=LIVE)
    expect(row).to_contain_text("gpu-003")
    incident_pk = int((row.get_attribute("data-testid") or "").rsplit("-", 1)[1])
    assert _not_reloaded(page), "the dashboard reloaded instead of updating in place"
    # The repair waits for a person (approve mode) and is listed as in flight.
    repair = page.locator("[data-testid^=repair-]")
    expect(repair).to_contain_text("awaiting approval", timeout=LIVE)
    _expect_plot(page, "#gpu-grid", ".heatmaplayer .hm image")
    # The grid redraws itself (every 5 s) with the failed GPU: the cell gpu-003 x GPU 5 is
    # "failed" (2) in the data Plotly drew.
    page.wait_for_function("""() => {
      const d = document.getElementById('gpu-grid').data;
      if (!d || !d.length) return false;
      const row = d[0].y.findIndex((y) => String(y).startsWith('gpu-003'));
      return row >= 0 && d[0].z[row][5] === 2;
    }""", timeout=LIVE)
    screenshot(page, "dashboard", publish=True, full_page=True)
    inject.close()

    # Open it from the dashboard.
    row.locator("a").first.click()
    page.wait_for_url(re.compile(rf"/incidents/{incident_pk}/$"))
    expect(page.locator("[data-testid=diagnosis] h1")).to_contain_text("gpu-003")
    expect(page.locator("[data-testid=confidence]")).to_contain_text("%")
    expect(page.locator("[data-testid=remediation-status]")).to_have_attribute(
        "data-status", "awaiting_approval", timeout=LIVE)

    # Approve from the keyboard: the toggle is reachable, and the confirmation says what
    # will happen (node, job, actions) before anything does.
    page.locator("body").focus()
    for _ in range(80):  # Tab from the top of the page to the control
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement && document.activeElement.id") == "approve-toggle":
            break
    else:
        pytest.fail("Tab never reaches the approve control")
    page.keyboard.press("Enter")
    confirm = page.locator("[data-testid=control-approve] form")
    expect(confirm).to_be_visible()
    expect(confirm).to_contain_text("gpu-003")
    expect(confirm).to_contain_text(re.compile(r"job\(s\) \d+"))
    expect(confirm).to_contain_text("drain the Slurm node")
    shared["remediation"] = int(confirm.locator("input[name=remediation]").input_value())
    shared["incident"] = incident_pk
    # An open confirmation is not polled away (the page polls every 2 s).
    page.wait_for_timeout(4500)
    expect(confirm).to_be_visible()
    page.click("#confirm-approve")

    page.wait_for_url(re.compile(rf"/incidents/{incident_pk}/$"))
    expect(page.locator("[data-testid=messages]")).to_contain_text("Approved: the remediation runs now")
    page.evaluate(MARK)
    page.evaluate(RECORD_STEPS)

    # The steps complete live; a screenshot while the repair is under way.
    expect(page.locator("[data-testid=step-1]")).to_have_attribute(
        "data-status", "succeeded", timeout=LIVE)
    screenshot(page, "incident-remediating", publish=True)
    expect(page.locator("[data-testid=remediation-status]")).to_have_attribute(
        "data-status", "succeeded", timeout=HEAL)
    expect(page.locator("[data-testid=incident-status]")).to_have_attribute(
        "data-status", "resolved", timeout=LIVE)
    steps = page.locator("[data-testid=steps] > li")
    assert steps.count() == 8  # replace_node's, the acceptance checks (the gate) among them
    for i in range(1, 9):
        expect(page.locator(f"[data-testid=step-{i}]")).to_have_attribute("data-status", "succeeded")
    assert _not_reloaded(page), "the incident page reloaded instead of updating in place"
    seen = page.evaluate("window.__fwSteps")
    assert len(set(seen)) > 2, f"the steps were not seen changing live: {seen}"
    assert seen[0] != seen[-1]

    # No control is left to click on a finished repair except starting a new one.
    for selector in ("#approve-toggle", "#cancel-toggle", "#continue-toggle", "#retry-toggle"):
        expect(page.locator(selector)).to_have_count(0)

    # The timeline has everything, and the approval under the operator's name.
    timeline = page.locator("[data-testid=timeline]")
    for kind in ("signal", "diagnosis", "step", "audit"):
        expect(timeline.locator(f"li[data-type={kind}]").first).to_be_visible()
    expect(timeline.locator("li[data-type=audit]", has_text="approved")).not_to_have_count(0)
    expect(timeline).to_contain_text(OPERATOR[0])
    expect(page.locator("[data-testid=phases]")).to_be_visible()

    # Both charts draw from the stored samples, with the fault and resolution marked.
    for chart in ("#util-chart", "#temp-chart"):
        _expect_plot(page, chart, ".scatterlayer .trace path.js-line")
    assert int(page.locator("#util-chart").get_attribute("data-series") or 0) >= 1
    for mark in ("fault", "resolved"):
        expect(page.locator("#util-chart .annotation-text", has_text=mark)).to_have_count(1)
    screenshot(page, "incident-resolved", publish=True)
    page.locator("#util-chart").scroll_into_view_if_needed()
    screenshot(page, "incident-charts", publish=True)

    # The nodes list shows the failed node; the audit chain verifies.
    page.click("[data-testid=nav-nodes]")
    expect(page.locator("[data-testid=node-row-gpu-003]")).to_be_visible()
    screenshot(page, "nodes", publish=True)
    page.click("[data-testid=node-row-gpu-003] a")
    expect(page.locator("[data-testid=node-health]")).to_have_text("failed")
    expect(page.locator("[data-testid=node-incidents]")).to_contain_text(f"#{incident_pk}")
    for chart in ("#node-util-chart", "#node-temp-chart"):
        _expect_plot(page, chart, ".scatterlayer .trace path.js-line")
    page.click("[data-testid=nav-audit]")
    page.click("#verify-chain")
    expect(page.locator("[data-testid=verify-result]")).to_have_attribute("data-ok", "true",
                                                                          timeout=LIVE)
    expect(page.locator("[data-testid=audit-table]")).to_contain_text("remediation.approved")
    screenshot(page, "audit")

    page.click("[data-testid=nav-incidents]")
    expect(page.locator(f"[data-testid=incident-row-{incident_pk}]")).to_contain_text("resolved")
    page.context.close()
    assert not errors.seen, errors.seen


def test_viewer_sees_no_control_and_a_forged_post_gets_403(
        browser: Any, stack: Stack, shared: dict[str, Any]) -> None:
    if not shared:
        pytest.fail("needs the incident of test_operator_injects_xid79_approves_and_watches_it_heal "
                    "(run the whole module)")
    incident, remediation = shared["incident"], shared["remediation"]
    errors = Errors()
    page = _login(browser, stack, VIEWER, errors)
    expect(page.locator("[data-testid=role]")).to_have_text("viewer")
    # No inject form on the dashboard.
    expect(page.locator("[data-testid=fleet-counts]")).to_be_visible()
    expect(page.locator("#inject-submit")).to_have_count(0)

    page.goto(f"/incidents/{incident}/")
    expect(page.locator("[data-testid=remediation-status]")).to_be_visible()
    expect(page.locator("[data-testid=controls]")).to_have_count(0)
    for selector in CONTROLS:
        expect(page.locator(selector)).to_have_count(0)
    # Nothing enabled inside the live region could change anything (the only forms a viewer
    # has are log out and reading ones).
    live_buttons = page.locator("#incident-live button:enabled, #incident-live form[method=post]")
    expect(live_buttons).to_have_count(0)
    screenshot(page, "incident-viewer")

    # A forged POST with the viewer's own session and a valid CSRF token: refused on the role.
    token = page.locator("input[name=csrfmiddlewaretoken]").first.input_value()
    headers = {"X-CSRFToken": token, "Referer": f"{stack.base}/incidents/{incident}/"}
    for action, form in (("approve", {"remediation": str(remediation)}),
                         ("cancel", {"remediation": str(remediation)}),
                         ("retry", {"remediation": str(remediation)}),
                         ("start", {})):
        response = page.request.post(f"/incidents/{incident}/{action}", form=form,
                                     headers=headers, max_redirects=0)
        assert response.status == 403, (action, response.status)
        assert "CSRF" not in response.text(), "refused for CSRF, not for the role"
    response = page.request.post("/demo/inject", headers=headers, max_redirects=0,
                                 form={"kind": "xid", "node": "gpu-004", "gpu": "1",
                                       "code": "79"})
    assert response.status == 403
    # And without the token, CSRF refuses it first.
    response = page.request.post(f"/incidents/{incident}/start", form={}, max_redirects=0)
    assert response.status == 403 and "CSRF" in response.text()

    # Nothing the viewer tried is in the audit trail as done by them.
    page.goto(f"/audit/?actor={VIEWER[0]}")
    expect(page.locator("[data-testid=audit-table]")).to_have_count(0)
    page.context.close()
    assert not errors.seen, errors.seen
