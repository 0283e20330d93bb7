"""The person on call in a real browser (headless Chromium) against the live stack: an
operator opens the incident an injected XID 79 made, acknowledges it, hands it to a colleague,
writes a note and resolves it with a note, and sees each on the incident's timeline under their
name, without the audit's detail unfolded; the timeline's filter shows only what it asks for.
A page that logs a console error or throws fails the test."""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import OPERATOR, VIEWPORT, Errors, Stack, screenshot

pytestmark = pytest.mark.browser

LIVE = 60_000  # ms: a collection or a diagnosis, on a busy shared machine
COLLEAGUE = ("oona", "oncall-pass-123")


def _login(browser: Any, stack: Stack, who: tuple[str, str], errors: Errors) -> Any:
    context = browser.new_context(viewport=VIEWPORT, base_url=stack.base)
    page = errors.watch(context.new_page())
    page.goto("/login/")
    page.fill("#id_username", who[0])
    page.fill("#id_password", who[1])
    page.click("button[type=submit]")
    expect(page.locator("[data-testid=whoami]")).to_contain_text(who[0])
    return page


def test_on_call_acknowledges_assigns_notes_and_resolves_with_a_note(
        browser: Any, stack: Stack) -> None:
    stack.manage("shell", "-c", "from collectors.roles import user_with_role; "
                 f"user_with_role({COLLEAGUE[0]!r}, 'operator', {COLLEAGUE[1]!r})")
    errors = Errors()
    page = _login(browser, stack, OPERATOR, errors)
    expect(page.locator("[data-testid=count-healthy] b")).to_have_text("16", timeout=LIVE)
    page.select_option("#inject-kind", "xid")
    page.fill("#inject-node", "gpu-005")
    page.fill("#inject-gpu", "2")
    page.fill("#inject-code", "79")
    page.click("#inject-submit")
    expect(page.locator("[data-testid=messages]")).to_contain_text("Injected")
    row = page.locator("[data-testid^=open-incident-]", has_text="gpu-005")
    expect(row).to_have_count(1, timeout=LIVE)
    row.locator("a").first.click()
    page.wait_for_url(re.compile(r"/incidents/\d+/$"))
    incident_url = page.url

    title = page.locator("[data-testid=incident-title]")
    expect(title).to_contain_text("GPU hardware on gpu-005")
    expect(page.locator("[data-testid=severity]")).to_have_text("SEV2 major")
    expect(page.locator("[data-testid=acknowledged]")).to_have_text("Not acknowledged")
    timeline = page.locator("[data-testid=timeline]")

    # Acknowledge: said at once, kept on the live card, and on the timeline under my name.
    page.click("#acknowledge")
    expect(page.locator("[data-testid=messages]")).to_contain_text("Acknowledged: you have it.")
    expect(page.locator("[data-testid=acknowledged]")).to_contain_text(f"by {OPERATOR[0]}")
    expect(page.locator("#acknowledge")).to_have_count(0)
    acked = timeline.locator("li[data-type=audit]", has_text="incident.acknowledged")
    expect(acked).to_contain_text(OPERATOR[0])
    # Folded: the summary says who did what; the record (hash, request) opens on a click.
    expect(acked.locator("details")).not_to_have_attribute("open", "")
    expect(acked.locator(".detail.small")).to_be_hidden()
    acked.locator("summary").click()
    expect(acked.locator(".detail.small")).to_be_visible()
    expect(acked.locator(".detail.small")).to_contain_text("hash")

    # Assign it to a colleague.
    page.click("#assign-toggle")
    page.select_option("#id_owner", COLLEAGUE[0])
    page.click("#confirm-assign")
    expect(page.locator("[data-testid=messages]")).to_contain_text(f"Owner: {COLLEAGUE[0]}.")
    expect(page.locator("[data-testid=owner]")).to_have_text(f"Owner {COLLEAGUE[0]}")
    expect(timeline.locator("li[data-type=audit]", has_text="incident.assigned")).to_contain_text(
        f"owner {COLLEAGUE[0]}")

    # A note: on the timeline as a note, with who wrote it.
    page.click("#note-toggle")
    page.fill("#id_text", "DC ops asked to reseat GPU 2; job requeued by hand")
    page.click("#confirm-note")
    expect(page.locator("[data-testid=messages]")).to_contain_text("Note added to the timeline.")
    note = timeline.locator("li[data-type=note]")
    expect(note).to_have_count(1)
    expect(note).to_be_visible()
    expect(note).to_contain_text(OPERATOR[0])
    expect(note).to_contain_text("DC ops asked to reseat GPU 2; job requeued by hand")

    # Resolve with a note: the status turns, and the note reads on the timeline unfolded.
    page.click("#resolve-toggle")
    expect(page.locator("[data-testid=control-resolve] form")).to_contain_text("gpu-005")
    page.fill("#id_note", "GPU reseated, burn-in passed")
    page.click("#confirm-resolve")
    expect(page.locator("[data-testid=messages]")).to_contain_text("Resolved.")
    expect(page.locator("[data-testid=incident-status]")).to_have_attribute(
        "data-status", "resolved")
    resolved = timeline.locator("li[data-type=audit]", has_text="incident.resolved_by_hand")
    expect(resolved.locator("[data-testid=said]")).to_be_visible()
    expect(resolved.locator("[data-testid=said]")).to_have_text("GPU reseated, burn-in passed")
    expect(page.locator("#resolve-toggle")).to_have_count(0)
    screenshot(page, "incident-on-call", publish=True, full_page=True)

    # The timeline's filter: notes only, redrawn as each box is unticked, without a reload;
    # the address keeps the filter, and it stays so while the timeline refreshes.
    page.evaluate("window.__fwNoReload = true")
    for kind in ("signal", "step", "audit"):
        page.uncheck(f"#show-{kind}")
        expect(timeline.locator(f"li[data-type={kind}]")).to_have_count(0)
    expect(page).to_have_url(re.compile(r"\?show=note$"))
    expect(timeline.locator("li[data-type=note]")).to_have_count(1)
    expect(timeline.locator("li[data-type=diagnosis]")).to_have_count(1)
    page.wait_for_timeout(3500)  # one refresh of the timeline region
    for kind in ("signal", "step", "audit"):
        expect(timeline.locator(f"li[data-type={kind}]")).to_have_count(0)
    expect(page.locator("#show-audit")).not_to_be_checked()
    assert page.evaluate("window.__fwNoReload === true"), "the filter reloaded the page"
    # Ticked again, the audit entries come back in place; a reload keeps the filter.
    page.check("#show-audit")
    expect(timeline.locator("li[data-type=audit]").first).to_be_visible()
    expect(page).to_have_url(re.compile(r"\?show=note&show=audit$"))
    page.reload()
    expect(page.locator("#show-audit")).to_be_checked()
    expect(page.locator("#show-signal")).not_to_be_checked()
    expect(timeline.locator("li[data-type=signal]")).to_have_count(0)

    # Without JavaScript the filter is a form that reloads the page, filtered.
    plain = browser.new_context(viewport=VIEWPORT, base_url=stack.base,
                                java_script_enabled=False,
                                storage_state=page.context.storage_state())
    nojs = errors.watch(plain.new_page())
    nojs.goto(incident_url)
    for kind in ("signal", "step", "note"):
        nojs.uncheck(f"#show-{kind}")
    nojs.click("#timeline-filter-apply")
    nojs.wait_for_url(re.compile(r"show=audit"))
    expect(nojs.locator("[data-testid=timeline] li[data-type=audit]").first).to_be_attached()
    expect(nojs.locator("[data-testid=timeline] li[data-type=note]")).to_have_count(0)
    plain.close()

    # The chart's time range is a choice; the page draws what it asks for.
    page.goto(incident_url)
    page.select_option("#chart-range-select", "1h")
    page.click("#chart-range-apply")
    page.wait_for_url(re.compile(r"range=1h"))
    expect(page.locator("#util-chart")).to_have_attribute("data-state", "drawn", timeout=LIVE)
    expect(page.locator("#util-chart .legendtext", has_text="gpu-005 (failed)")).to_have_count(1)
    page.context.close()
    assert not errors.seen, errors.seen
