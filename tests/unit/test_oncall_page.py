"""The incident page for the person on call: acknowledge, take, assign, severity, notes and
resolve from the page (each once, each on the timeline under the person's name), what a viewer
sees (no control) and gets (403), the timeline's filter and folded audit entries, one
explanation, a title built from parts, and the chart's stored nodes, roles and time range."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client

from collectors import services as collectors
from collectors.models import Job
from collectors.roles import OPERATOR, user_with_role
from collectors.sim.fleet import SimFleet
from incidents import lifecycle
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Incident

pytestmark = pytest.mark.django_db

EXPLANATION = "XID 79 (GPU has fallen off the bus) on gpu-003"


@pytest.fixture
def incident(sim_fleet: SimFleet, settings: Any, django_capture_on_commit_callbacks: Any) -> Any:
    settings.FLEETWATCH_POLICY_MODE = "approve"
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    cluster = collectors.cluster_default()
    with django_capture_on_commit_callbacks():
        made, _ = lifecycle.incident_record(cluster.pk, Diagnosis(
            root_cause="gpu_hardware", nodes=("gpu-003",), confidence=0.97,
            playbook="replace_node", explanation=EXPLANATION,
            detected_at=datetime.now(UTC) - timedelta(seconds=20), jobs=("3001",)))
    return made


@pytest.fixture
def ops(client: Client, operator: Any) -> Client:
    client.force_login(operator)
    return client


def _page(client: Client, incident: Incident, query: str = "") -> str:
    response = client.get(f"/incidents/{incident.pk}/{query}")
    assert response.status_code == 200
    return response.content.decode()


def _messages(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


def _timeline(client: Client, incident: Incident, query: str = "") -> str:
    return client.get(f"/incidents/{incident.pk}/timeline{query}").content.decode()


def test_acknowledge_take_note_and_resolve_from_the_page_each_on_the_timeline(
        ops: Client, incident: Incident) -> None:
    page = _page(ops, incident)
    assert 'data-testid="acknowledged" class="warn">Not acknowledged' in page
    assert 'data-severity="sev2"' in page and "SEV2 major" in page  # gpu_hardware's default

    done = ops.post(f"/incidents/{incident.pk}/acknowledge", follow=True)
    assert "Acknowledged: you have it." in _messages(done)
    twice = ops.post(f"/incidents/{incident.pk}/acknowledge", follow=True)
    assert any("was acknowledged by user:olivia" in m for m in _messages(twice))
    assert ops.post(f"/incidents/{incident.pk}/acknowledge",
                    HTTP_ACCEPT="application/json").status_code == 409

    ops.post(f"/incidents/{incident.pk}/take")
    assert Incident.objects.get(pk=incident.pk).owner.username == "olivia"
    page = _page(ops, incident)
    assert "Owner <b>olivia</b>" in page and 'id="take"' not in page  # nothing left to take

    key = re.search(r'name="key" value="([^"]+)"', page)
    assert key, "the note form carries its key"
    form = {"text": "Asked DC ops to reseat GPU 5", "key": key.group(1)}
    assert ops.post(f"/incidents/{incident.pk}/note", form).status_code == 302
    twice = ops.post(f"/incidents/{incident.pk}/note", form, follow=True)  # a double click
    assert any("this note was already added" in m for m in _messages(twice))
    assert AuditEntry.objects.filter(verb="incident.noted").count() == 1

    resolved = ops.post(f"/incidents/{incident.pk}/resolve", {"note": "reseated; burn-in ok"},
                        follow=True)
    assert "Resolved." in _messages(resolved)
    again = ops.post(f"/incidents/{incident.pk}/resolve", {"note": "again"}, follow=True)
    assert any("already resolved" in m for m in _messages(again))

    timeline = _timeline(ops, incident)
    assert re.search(r'data-type="note">.*?<b>olivia</b>\s*<div class="detail note">'
                     r"Asked DC ops to reseat GPU 5", timeline, re.S)
    for verb in ("incident.acknowledged", "incident.assigned", "incident.resolved_by_hand"):
        assert re.search(rf"<b>olivia</b> <code>{verb}</code>", timeline), verb
    assert "reseated; burn-in ok" in timeline
    # Resolved: no acknowledge, take or resolve control is left; notes still can be added.
    page = _page(ops, incident)
    for gone in ('id="acknowledge"', 'id="take"', 'id="resolve-toggle"', 'id="assign-toggle"'):
        assert gone not in page, gone
    assert 'id="note-toggle"' in page


def test_an_empty_note_is_400_and_a_long_one_is_shown_again_with_what_was_typed(
        ops: Client, incident: Incident) -> None:
    empty = ops.post(f"/incidents/{incident.pk}/note", {"text": "   ", "key": "a"})
    assert empty.status_code == 400
    assert "A note needs some text." in empty.content.decode()
    long = "reseat " * 700  # past the 4000 characters a note holds
    refused = ops.post(f"/incidents/{incident.pk}/note", {"text": long, "key": "b"})
    body = refused.content.decode()
    assert refused.status_code == 400 and "at most 4000 characters" in body
    assert "reseat reseat reseat" in body  # nothing typed is lost
    assert '<details data-testid="control-note" open>' in body
    assert not AuditEntry.objects.filter(verb="incident.noted").exists()


def test_assign_and_severity_from_the_page(ops: Client, incident: Incident) -> None:
    user_with_role("petra", OPERATOR)
    page = _page(ops, incident)
    assert '<option value="petra">petra</option>' in page
    ops.post(f"/incidents/{incident.pk}/assign", {"owner": "petra"})
    assert Incident.objects.get(pk=incident.pk).owner.username == "petra"
    assert ops.post(f"/incidents/{incident.pk}/assign", {"owner": "mallory"}).status_code == 400
    done = ops.post(f"/incidents/{incident.pk}/severity", {"severity": "sev1"}, follow=True)
    assert "Severity: SEV1 critical." in _messages(done)
    assert ops.post(f"/incidents/{incident.pk}/severity", {"severity": "sev9"}).status_code == 400
    assert 'data-severity="sev1"' in _page(ops, incident)
    entry = AuditEntry.objects.get(verb="incident.severity")
    assert entry.actor == "user:olivia" and entry.result == "SEV2 major → SEV1 critical"


def test_a_viewer_sees_no_on_call_control_and_forged_posts_get_403(
        client: Client, viewer: Any, incident: Incident) -> None:
    client.force_login(viewer)
    for url in (f"/incidents/{incident.pk}/", f"/incidents/{incident.pk}/live"):
        page = client.get(url).content.decode()
        assert 'data-testid="oncall-controls"' not in page
        for control in ("Acknowledge", "Take ownership", "Assign…", "Severity…", "Add a note",
                        "Resolve…"):
            assert control not in page, (url, control)
    for action, body in (("acknowledge", {}), ("take", {}), ("assign", {"owner": "victor"}),
                         ("severity", {"severity": "sev1"}), ("note", {"text": "hi"}),
                         ("resolve", {"note": "x"})):
        assert client.post(f"/incidents/{incident.pk}/{action}", body).status_code == 403, action
    fresh = Incident.objects.get(pk=incident.pk)
    assert fresh.acknowledged_at is None and fresh.owner is None and fresh.status != "resolved"
    assert fresh.severity == "sev2"


def test_timeline_filters_folds_audit_and_says_the_explanation_once(
        ops: Client, incident: Incident) -> None:
    ops.post(f"/incidents/{incident.pk}/note", {"text": "looking", "key": "n1"})
    page = _page(ops, incident)
    assert page.count(EXPLANATION) == 1
    everything = _timeline(ops, incident)
    assert 'data-type="signal"' in everything and 'data-type="audit"' in everything
    assert 'data-type="note"' in everything and 'data-type="diagnosis"' in everything
    # Audit entries are folded: each one a closed <details> whose summary says who did what.
    assert re.search(r'data-type="audit">\s*(\{#.*?#\})?\s*<details><summary>', everything, re.S)
    assert "<details open" not in everything
    notes_only = _timeline(ops, incident, "?show=note")
    assert 'data-type="note"' in notes_only and 'data-type="diagnosis"' in notes_only
    for hidden in ("signal", "audit", "step"):
        assert f'data-type="{hidden}"' not in notes_only, hidden
    # The page keeps its filter in its boxes; the timeline polls with them (hx-include), and a
    # box ticked redraws it in place (htmx), while without JavaScript the form reloads the page.
    page = _page(ops, incident, "?show=signal&show=audit")
    assert 'id="show-signal" checked' in page and 'id="show-note" checked' not in page
    assert (f'id="incident-timeline" hx-get="/incidents/{incident.pk}/timeline" '
            'hx-include="#timeline-filter" hx-trigger="every 3s"') in page
    form = re.search(r'<form method="get" class="tl-filter" id="timeline-filter"[^>]*>', page)
    assert form and f'hx-get="/incidents/{incident.pk}/timeline"' in form.group(0)
    assert 'hx-target="#incident-timeline"' in form.group(0)


def test_the_title_is_built_from_parts() -> None:
    from incidents.selectors import incident_title

    both = Incident(pk=7, root_cause="switch_failure", nodes=["gpu-018"], switch="leaf-b")
    assert incident_title(both)["text"] == (
        "Incident #7: switch failure on gpu-018 · leaf switch leaf-b")
    switch_only = Incident(pk=8, root_cause="switch_failure", nodes=[], switch="leaf-b")
    assert incident_title(switch_only)["text"] == "Incident #8: switch failure on leaf switch leaf-b"
    storm = Incident(pk=9, root_cause="thermal", nodes=["a", "b"], storm=True)
    assert incident_title(storm)["text"] == "Incident #9: storm of thermal on 2 nodes"


def test_the_page_title_never_runs_a_node_into_the_switch(ops: Client, incident: Incident) -> None:
    Incident.objects.filter(pk=incident.pk).update(switch="leaf-b")
    page = _page(ops, incident)
    h1 = re.sub(r"<[^>]+>", "", page.split('data-testid="incident-title">')[1].split("</h1>")[0])
    assert re.sub(r"\s+", " ", h1).strip() == (
        f"Incident #{incident.pk}: GPU hardware on gpu-003 · leaf switch leaf-b")


def test_the_chart_draws_the_nodes_kept_at_opening_with_roles_and_a_time_range(
        ops: Client, incident: Incident) -> None:
    job_nodes = set(Job.objects.get(slurm_id="3001").nodes)
    assert incident.nodes_charted[0] == "gpu-003" and set(incident.nodes_charted) == job_nodes
    # The job moves on: the chart still draws the nodes it had when the incident opened.
    Job.objects.filter(slurm_id="3001").update(nodes=["gpu-015"])
    chart = ops.get(f"/incidents/{incident.pk}/chart.json").json()
    assert set(chart["series"]) == job_nodes and "gpu-015" not in chart["series"]
    assert chart["roles"]["gpu-003"] == "failed"
    assert {chart["roles"][n] for n in job_nodes - {"gpu-003"}} == {"involved"}
    assert chart["range"] == "incident"
    wide = ops.get(f"/incidents/{incident.pk}/chart.json?range=6h").json()
    assert wide["range"] == "6h"
    bad = ops.get(f"/incidents/{incident.pk}/chart.json?range=forever")
    assert bad.status_code == 400 and "range: expected one of" in bad.json()["detail"]
    # The spare brought in is drawn as the replacement.
    step = incident.remediations.get().steps.order_by("-order").first()
    type(step).objects.filter(pk=step.pk).update(result={"new_node": "gpu-016"})
    chart = ops.get(f"/incidents/{incident.pk}/chart.json").json()
    assert chart["roles"]["gpu-016"] == "replacement" and "gpu-016" in chart["series"]
    page = _page(ops, incident, "?range=6h")
    assert f'data-src="/incidents/{incident.pk}/chart.json?range=6h"' in page
    assert '<option value="6h" selected>' in page
