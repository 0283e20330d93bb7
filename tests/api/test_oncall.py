"""The person on call through the API: acknowledge, assign, severity, notes and resolve with a
note, each once (a second identical call is 409, not a second effect), each audited under the
caller's name, each refused to a viewer (403) and each on the incident's timeline."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from collectors.knowledge import SEVERITY_FOR, RootCause
from collectors.roles import OPERATOR, VIEWER, user_with_role
from incidents.audit import audit_verify
from incidents.models import AuditEntry, Incident
from tests.api.world import World, build_world
from tests.conftest import token_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(db: None, settings: Any) -> World:
    return build_world(settings)


def _client(username: str, role: str, scopes: tuple[str, ...] = ("read", "operate")) -> APIClient:
    client = APIClient()
    user = user_with_role(username, role)[0]
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user, scopes, name=username)}")
    return client


@pytest.fixture
def ops(world: World) -> APIClient:
    return _client("oscar", OPERATOR)


def _url(world: World, action: str) -> str:
    return f"/api/v1/incidents/{world.incident.pk}/{action}/"


def test_an_incident_opens_at_its_root_causes_severity_with_no_owner(
        ops: APIClient, world: World) -> None:
    body = ops.get(f"/api/v1/incidents/{world.incident.pk}/").json()
    assert body["severity"] == SEVERITY_FOR[RootCause(world.incident.root_cause)].value
    assert body["owner"] is None and body["acknowledged_by"] == ""
    # The nodes its chart draws were kept when it opened: the blamed node first.
    assert body["nodes_charted"][0] == world.incident.nodes[0]


def test_acknowledge_twice_is_409_naming_the_first(ops: APIClient, world: World) -> None:
    assert ops.post(_url(world, "acknowledge")).status_code == 200
    again = ops.post(_url(world, "acknowledge"))
    assert again.status_code == 409 and "acknowledged by token:oscar" in again.json()["detail"]
    assert AuditEntry.objects.filter(verb="incident.acknowledged").count() == 1


def test_assign_to_an_operator_then_nobody_and_refuse_strangers(
        ops: APIClient, world: World) -> None:
    user_with_role("petra", OPERATOR)
    user_with_role("vic", VIEWER)
    done = ops.post(_url(world, "assign"), {"owner": "petra"}, format="json")
    assert done.status_code == 200 and done.json()["owner"] == "petra"
    twice = ops.post(_url(world, "assign"), {"owner": "petra"}, format="json")
    assert twice.status_code == 409 and "already owned by petra" in twice.json()["detail"]
    # Only someone who may act can own it: a viewer or an unknown name is a 400 on the field.
    for who in ("vic", "nobody"):
        refused = ops.post(_url(world, "assign"), {"owner": who}, format="json")
        assert refused.status_code == 400 and "owner" in refused.json(), who
    cleared = ops.post(_url(world, "assign"), {"owner": None}, format="json")
    assert cleared.status_code == 200 and cleared.json()["owner"] is None
    verbs = list(AuditEntry.objects.filter(incident=world.incident, verb__startswith=
                                           "incident.").values_list("verb", "actor", "result"))
    assert ("incident.assigned", "token:oscar", "owner petra") in verbs
    assert ("incident.unassigned", "token:oscar", "no owner (was petra)") in verbs


def test_severity_changes_once_and_refuses_unknown_values(ops: APIClient, world: World) -> None:
    done = ops.post(_url(world, "severity"), {"severity": "sev1"}, format="json")
    assert done.status_code == 200 and done.json()["severity"] == "sev1"
    assert ops.post(_url(world, "severity"), {"severity": "sev1"},
                    format="json").status_code == 409
    bad = ops.post(_url(world, "severity"), {"severity": "p0"}, format="json")
    assert bad.status_code == 400 and "severity" in bad.json()
    entry = AuditEntry.objects.get(verb="incident.severity")
    assert entry.actor == "token:oscar" and entry.result.endswith("→ SEV1 critical")
    assert Incident.objects.get(pk=world.incident.pk).severity == "sev1"


def test_notes_need_text_land_on_the_timeline_and_a_repeated_key_is_409(
        ops: APIClient, world: World) -> None:
    for empty in ({"text": ""}, {"text": "   "}, {}):
        refused = ops.post(_url(world, "notes"), empty, format="json")
        assert refused.status_code == 400 and "text" in refused.json(), empty
    assert ops.post(_url(world, "notes"), {"text": "x" * 4001},
                    format="json").status_code == 400
    done = ops.post(_url(world, "notes"), {"text": "GPU 5 reseated by DC ops", "key": "k1"},
                    format="json")
    assert done.status_code == 201
    assert done.json()["actor"] == "token:oscar" and done.json()["text"] == "GPU 5 reseated by DC ops"
    again = ops.post(_url(world, "notes"), {"text": "GPU 5 reseated by DC ops", "key": "k1"},
                     format="json")
    assert again.status_code == 409
    timeline = ops.get(_url(world, "timeline")).json()
    notes = [i for i in timeline if i["type"] == "note"]
    assert [n["text"] for n in notes] == ["GPU 5 reseated by DC ops"]
    assert notes[0]["audit"]["actor"] == "token:oscar"
    # A note is an audit entry: the chain still verifies.
    assert audit_verify().ok


def test_resolve_with_a_note_twice_is_409(ops: APIClient, world: World) -> None:
    done = ops.post(_url(world, "resolve"), {"note": "not a fault: planned test"}, format="json")
    assert done.status_code == 200 and done.json()["status"] == "resolved"
    again = ops.post(_url(world, "resolve"), {"note": "again"}, format="json")
    assert again.status_code == 409 and again.json()["status"] == "resolved"
    assert list(AuditEntry.objects.filter(verb="incident.resolved_by_hand").values_list(
        "result", flat=True)) == ["not a fault: planned test"]
    # Nobody owns a resolved incident anew.
    assert ops.post(_url(world, "assign"), {"owner": "oscar"},
                    format="json").status_code == 409


@pytest.mark.parametrize(("action", "body"), [
    ("acknowledge", None), ("assign", {"owner": "oscar"}), ("severity", {"severity": "sev1"}),
    ("notes", {"text": "hello"}), ("resolve", {"note": "done"})])
def test_a_viewer_gets_403_and_nothing_changes(world: World, action: str, body: Any) -> None:
    user_with_role("oscar", OPERATOR)
    viewer = _client("vanna", VIEWER, ("read",))
    assert viewer.post(_url(world, action), body, format="json").status_code == 403
    incident = Incident.objects.get(pk=world.incident.pk)
    assert incident.status != "resolved" and incident.owner is None
    assert incident.acknowledged_at is None and incident.severity == world.incident.severity
    assert not AuditEntry.objects.filter(verb__in=[
        "incident.acknowledged", "incident.assigned", "incident.severity", "incident.noted",
        "incident.resolved_by_hand"]).exists()


def test_the_schema_lists_the_on_call_actions(ops: APIClient) -> None:
    schema = ops.get("/api/schema/?format=json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for action in ("acknowledge", "assign", "severity", "notes", "resolve"):
        assert "post" in paths[f"/api/v1/incidents/{{id}}/{action}/"], action
    assert "requestBody" in paths["/api/v1/incidents/{id}/notes/"]["post"]
