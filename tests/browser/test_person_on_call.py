"""The person on call, in a real browser (headless Chromium) against the live stack: the
dashboard puts what needs a person first and counts it in the tab title, live; a source that
is down marks the figures it feeds stale; a grid cell opens its node; the lists sort by a
column and export what they show as CSV; times switch to the browser's zone; and axe-core
finds no serious or critical violation on any of FleetWatch's pages.

The tests run in order and share the stack: the lists and the accessibility checks read the
incident the first test opened (its remediation waits for approval: policy "approve")."""

from __future__ import annotations

import csv
import re
from typing import Any

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, VIEWPORT, Errors, Stack, screenshot

pytestmark = pytest.mark.browser

LIVE = 60_000  # ms: a collection, a diagnosis or a step, on a busy shared machine
MARK = "window.__fwNoReload = true"


def _login(browser: Any, stack: Stack, errors: Errors, **context: Any) -> Any:
    ctx = browser.new_context(viewport=VIEWPORT, base_url=stack.base, accept_downloads=True,
                              **context)
    page = errors.watch(ctx.new_page())
    page.goto("/login/")
    page.fill("#id_username", OPERATOR[0])
    page.fill("#id_password", OPERATOR[1])
    page.click("button[type=submit]")
    expect(page.locator("[data-testid=whoami]")).to_contain_text(OPERATOR[0])
    return page


@pytest.fixture(scope="module")
def shared() -> dict[str, Any]:
    return {}


def test_dashboard_puts_what_needs_a_person_first(browser: Any, stack: Stack,
                                                  shared: dict[str, Any]) -> None:
    errors = Errors()
    page = _login(browser, stack, errors)
    expect(page.locator("[data-testid=count-healthy] b")).to_have_text("16", timeout=LIVE)
    attention = page.locator("[data-testid=attention]")
    expect(attention.locator("[data-testid=attention-none]")).to_be_visible()
    expect(page).to_have_title("Dashboard · FleetWatch")
    expect(page.locator("[data-testid=count-cordoned]")).not_to_have_attribute("data-stale",
                                                                             re.compile("."))
    page.evaluate(MARK)

    # Kubernetes goes down: it is listed first, the figures it feeds say they are stale, and
    # the tab title counts it, all without a reload.
    stack.manage("fleetwatch", "sim", "--source-down", "kubernetes")
    expect(attention.locator("[data-testid=attention-source-kubernetes]")).to_contain_text(
        "down", timeout=LIVE)
    expect(page).to_have_title("(1) Dashboard · FleetWatch", timeout=LIVE)
    cordoned = page.locator("[data-testid=count-cordoned]")
    expect(cordoned).to_have_attribute("data-stale", "kubernetes")
    expect(cordoned).to_contain_text("stale: kubernetes down")
    # Slurm and the telemetry still report: their figures are not marked.
    expect(page.locator("[data-testid=count-gpus-failed]")).not_to_have_attribute(
        "data-stale", re.compile("."))

    # An XID 79: the incident opens and its remediation waits for approval (policy
    # "approve"); both are in the attention area, counted once.
    stack.manage("fleetwatch", "inject", "xid", "--node", "gpu-003", "--gpu", "5",
                 "--code", "79")
    waiting = attention.locator("[data-testid^=attention-remediation-]")
    expect(waiting).to_have_count(1, timeout=LIVE)
    expect(waiting).to_have_attribute("data-status", "awaiting_approval")
    expect(waiting).to_contain_text("awaiting approval")
    expect(waiting).to_contain_text("gpu-003")
    expect(attention.locator("[data-testid^=open-incident-]")).to_have_count(1)
    expect(page.locator("[data-testid=attention-count]")).to_have_text("2", timeout=LIVE)
    expect(page).to_have_title("(2) Dashboard · FleetWatch", timeout=LIVE)
    assert page.evaluate("window.__fwNoReload === true"), "the dashboard reloaded"
    row = attention.locator("[data-testid^=open-incident-]")
    shared["incident"] = int((row.get_attribute("data-testid") or "").rsplit("-", 1)[1])

    # What needs a person is above the fleet's figures and the GPU grid.
    top = attention.bounding_box()
    grid = page.locator("#gpu-health").bounding_box()
    counts = page.locator("[data-testid=fleet-counts]").bounding_box()
    assert top and grid and counts and top["y"] < counts["y"] < grid["y"]
    screenshot(page, "dashboard-attention", publish=True, full_page=True)

    # The grid shows the failed GPU; a click on its cell opens the node.
    page.wait_for_function("""() => {
      const d = document.getElementById('gpu-grid').data;
      if (!d || !d.length) return false;
      const row = d[0].y.findIndex((y) => String(y).startsWith('gpu-003'));
      return row >= 0 && d[0].z[row][5] === 2;
    }""", timeout=LIVE)
    expect(page.locator("[data-testid=failed-nodes]")).to_contain_text("gpu-003", timeout=LIVE)
    page.locator("#gpu-grid").scroll_into_view_if_needed()
    cell = page.evaluate("""() => {
      const el = document.getElementById('gpu-grid');
      const fl = el._fullLayout;
      const row = el.data[0].y.findIndex((y) => String(y).startsWith('gpu-003'));
      const box = el.getBoundingClientRect();
      return { x: box.left + fl.xaxis._offset + fl.xaxis.l2p(5),
               y: box.top + fl.yaxis._offset + fl.yaxis.l2p(row) };
    }""")
    # Hovering the cell shows its GPU (the click lands on the right one), then the click.
    page.mouse.move(cell["x"], cell["y"])
    expect(page.locator("#gpu-grid .hoverlayer")).to_contain_text("gpu-003 GPU 5")
    page.mouse.click(cell["x"], cell["y"])
    page.wait_for_url(re.compile(r"/nodes/gpu-003/\?cluster="))
    expect(page.locator("[data-testid=node-health]")).to_have_text("failed")
    expect(page.locator("[data-testid=gpu-row-5]")).to_contain_text("XID 79")
    expect(page.locator("[data-testid=gpu-not-stored]")).to_contain_text("not kept")
    # What dcgm-exporter says of its GPUs now: GPU 5 nothing at all (not zeros); the others
    # their power against the limit, clocks and a Gen5 x16 link. Kubernetes is still down:
    # the pods cannot be listed, and the page says so instead of failing.
    expect(page.locator("[data-testid=readings-none-5]")).to_contain_text("no readings")
    expect(page.locator("[data-testid=readings-power-0]")).to_contain_text("of 700 W")
    expect(page.locator("[data-testid=readings-clocks-0]")).to_contain_text("2,619 MHz")
    # gpu-003's job hangs, so its GPUs idle: the link steps down a generation to save power,
    # which the page says without calling it a fault.
    expect(page.locator("[data-testid=readings-pcie-0]")).to_have_text(
        re.compile(r"^Gen\d x16 of Gen5 x16( \(idle: a lower generation saves power\))?$"))
    expect(page.locator("[data-testid=readings-pcie-0]")).not_to_contain_text("below")
    expect(page.locator("[data-testid=pods-unavailable]")).to_contain_text(
        "kubernetes unreachable")

    stack.manage("fleetwatch", "sim", "--source-up", "kubernetes")
    # Kubernetes back: the node's pods, the one that forbids automatic replacement marked.
    stack.manage("fleetwatch", "sim", "--node", "gpu-003", "--no-auto-replace", "on")
    page.reload()
    slurmd = page.locator("[data-testid=pod-row-slurm-slurmd-gpu-003]")
    expect(slurmd).to_contain_text("StatefulSet")
    expect(slurmd.locator("[data-testid=pod-no-auto-replace]")).to_be_visible()
    expect(page.locator("[data-testid=pod-row-gpu-operator-dcgm-exporter-gpu-003]")).to_contain_text(
        "DaemonSet")
    page.locator("#readings-h").scroll_into_view_if_needed()
    screenshot(page, "node-readings-pods", publish=True)
    stack.manage("fleetwatch", "sim", "--node", "gpu-003", "--no-auto-replace", "off")
    page.goto("/")
    expect(page.locator("[data-testid=attention-source-kubernetes]")).to_have_count(
        0, timeout=LIVE)
    expect(page).to_have_title("(1) Dashboard · FleetWatch", timeout=LIVE)
    page.context.close()
    assert not errors.seen, errors.seen


def _column(page: Any, testid: str, index: int) -> list[str]:
    return [t.strip() for t in page.locator(
        f"[data-testid={testid}] tbody tr td:nth-child({index})").all_inner_texts()]


def test_lists_sort_by_a_column_and_export_csv(browser: Any, stack: Stack,
                                               shared: dict[str, Any]) -> None:
    errors = Errors()
    page = _login(browser, stack, errors)
    page.goto("/nodes/")
    nodes = page.locator("[data-testid=node-table]")
    expect(nodes.locator("tbody tr").first).to_be_visible()

    # Sort by health: the failed node first (descending: failed > healthy), then back.
    header = nodes.locator("th", has_text="Health")
    header.locator("a").click()
    expect(header).to_have_attribute("aria-sort", "ascending")
    assert _column(page, "node-table", 2)[0] == "failed"
    nodes.locator("th", has_text="Node").locator("a").click()
    nodes.locator("th", has_text="Node").locator("a").click()
    expect(nodes.locator("th", has_text="Node")).to_have_attribute("aria-sort", "descending")
    shown = [name.split()[0] for name in _column(page, "node-table", 1)]
    assert shown == sorted(shown, reverse=True) and len(shown) > 1, shown

    # The CSV: the same rows in the same order, plain text, with the filters applied.
    with page.expect_download() as info:
        page.click("[data-testid=export-csv]")
    download = info.value
    assert download.suggested_filename == "fleetwatch-nodes.csv"
    with open(download.path(), newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["Node"] for r in rows][:len(shown)] == shown
    by_name = {r["Node"]: r for r in rows}
    assert by_name["gpu-003"]["Health"] == "failed"
    assert "<" not in "".join("".join(r.values()) for r in rows), "HTML in the CSV"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", by_name["gpu-003"]["Updated"])

    # Filtered: only what the page shows.
    page.goto("/nodes/?health=failed")
    with page.expect_download() as info:
        page.click("[data-testid=export-csv]")
    with open(info.value.path(), newline="", encoding="utf-8") as f:
        failed = list(csv.DictReader(f))
    assert {r["Node"] for r in failed} == {"gpu-003"}

    # The incidents list exports the incident the first test opened.
    page.goto("/incidents/?sort=-id")
    expect(page.locator(f"[data-testid=incident-row-{shared['incident']}]")).to_be_visible()
    with page.expect_download() as info:
        page.click("[data-testid=export-csv]")
    with open(info.value.path(), newline="", encoding="utf-8") as f:
        incidents = list(csv.DictReader(f))
    assert incidents[0]["#"] == str(shared["incident"])
    assert incidents[0]["Root cause"].startswith("gpu_hardware")
    # An XID 79's default severity, and nobody has taken it yet.
    assert (incidents[0]["Severity"], incidents[0]["Owner"]) == ("sev2", "")
    screenshot(page, "incidents-sorted")
    page.context.close()
    assert not errors.seen, errors.seen


def test_times_in_the_browsers_zone(browser: Any, stack: Stack) -> None:
    errors = Errors()
    page = _login(browser, stack, errors, timezone_id="Asia/Tokyo")
    page.goto("/audit/")
    first = page.locator("[data-testid=audit-table] time[data-show=full]").first
    expect(first).to_contain_text(" UTC · ")
    page.click("#tz-toggle")
    expect(page.locator("#tz-label")).to_contain_text("your browser's time zone")
    expect(first).to_contain_text("Asia/Tokyo")
    # The choice is kept across pages, and live regions are rewritten too.
    page.goto("/incidents/")
    expect(page.locator("time[data-show=full]").first).to_contain_text("Asia/Tokyo")
    page.click("#tz-toggle")
    expect(page.locator("time[data-show=full]").first).to_contain_text(" UTC · ")
    page.context.close()
    assert not errors.seen, errors.seen


def _serious(page: Any) -> list[str]:
    results = Axe().run(page)
    return [f"{page.url}: {v['id']} ({v['impact']}): {v['help']} at "
            f"{[n['target'] for n in v['nodes']][:5]}"
            for v in results.response["violations"] if v["impact"] in ("serious", "critical")]


def test_axe_finds_no_serious_violation_on_any_page(browser: Any, stack: Stack,
                                                    shared: dict[str, Any]) -> None:
    errors = Errors()
    found: list[str] = []
    anonymous = browser.new_context(viewport=VIEWPORT, base_url=stack.base)
    login = errors.watch(anonymous.new_page())
    login.goto("/login/")
    found += _serious(login)
    anonymous.close()

    page = _login(browser, stack, errors)
    incident = shared.get("incident")
    pages = ["/", "/incidents/", "/nodes/", "/nodes/gpu-003/", "/jobs/", "/audit/",
             "/sources/", "/policy/"]
    if incident:
        pages.append(f"/incidents/{incident}/")
    for url in pages:
        page.goto(url)
        # Charts drawn first: Plotly's toolbar is part of what is checked.
        for chart in page.locator("[data-chart]").all():
            expect(chart).to_have_attribute("data-state", re.compile("drawn|empty"),
                                            timeout=LIVE)
        found += _serious(page)
    # A job's page, from the jobs list.
    page.goto("/jobs/")
    page.locator("[data-testid=job-table] tbody tr a").first.click()
    page.wait_for_url(re.compile(r"/jobs/[^/]+/"))
    found += _serious(page)
    page.context.close()
    assert not found, "\n".join(found)
    assert not errors.seen, errors.seen
