"""What the API endpoints answer: filters, paging, the actions and their 409s, bad input."""

from __future__ import annotations

from base64 import b64encode
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from collectors.models import Signal
from collectors.roles import ADMIN, OPERATOR, VIEWER, user_with_role
from incidents.models import ApiToken, AuditEntry, Incident, Remediation, Step
from tests.api.world import JOB, NODE, OTHER_NODE, World, build_world, signal_body
from tests.conftest import token_for


@pytest.fixture
def world(db: None, settings: Any) -> World:
    return build_world(settings)


def _client(role: str, name: str = "", scopes: tuple[str, ...] = ("read", "operate", "ingest"),
            ) -> APIClient:
    user = user_with_role(f"{role}-api", role)[0]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user, scopes, name=name or None)}")
    return client


@pytest.fixture
def api(world: World) -> APIClient:
    """An operator's program: a token named ``ops-bot`` with every scope."""
    return _client(OPERATOR, "ops-bot")


# --- the fleet ------------------------------------------------------------------------------


def test_nodes_filter_order_and_answer_by_name(api: APIClient, world: World) -> None:
    Node = type(world.node)
    Node.objects.filter(name=OTHER_NODE).update(health="failed", in_service=False)
    body = api.get("/api/v1/nodes/?health=failed").json()
    assert [n["name"] for n in body["results"]] == [OTHER_NODE] and body["count"] == 1
    assert api.get("/api/v1/nodes/?in_service=true").json()["count"] == 1
    assert [n["name"] for n in api.get("/api/v1/nodes/?ordering=-name").json()["results"]] == [
        OTHER_NODE, NODE]
    node = api.get(f"/api/v1/nodes/{NODE}/").json()
    assert node["name"] == NODE and [g["index"] for g in node["gpus"]] == [0, 1]
    missing = api.get("/api/v1/nodes/gpu-999.rack2/")
    assert missing.status_code == 404 and missing.json() == {"detail": "no node gpu-999.rack2"}
    assert api.get(f"/api/v1/nodes/{NODE}/?cluster=elsewhere").status_code == 404
    bad = api.get("/api/v1/nodes/?health=sick")
    assert bad.status_code == 400 and "health" in bad.json()


def test_gpus_jobs_and_clusters(api: APIClient, world: World) -> None:
    gpus = api.get(f"/api/v1/gpus/?node={NODE}&index=1").json()
    assert gpus["count"] == 1 and gpus["results"][0]["node"] == NODE
    assert api.get(f"/api/v1/jobs/?node={OTHER_NODE}&state=running").json()["count"] == 1
    assert api.get("/api/v1/jobs/?user=nobody").json()["count"] == 0
    assert api.get(f"/api/v1/jobs/{JOB}/").json()["nodes"] == [NODE, OTHER_NODE]
    assert api.get("/api/v1/jobs/777/").json() == {"detail": "no job 777"}
    assert api.get(f"/api/v1/clusters/{world.cluster.name}/").json()["name"] == world.cluster.name
    assert api.get("/api/v1/gpus/999999/").json() == {"detail": "no gpu 999999"}


# --- signals --------------------------------------------------------------------------------


def test_signals_page_by_cursor_and_filter(api: APIClient, world: World) -> None:
    start = timezone.now() - timedelta(hours=1)
    Signal.objects.bulk_create([
        Signal(cluster=world.cluster, source="kernel", kind="pushed_kernel", node_name=NODE,
               message=f"line {i}", observed_at=start + timedelta(seconds=i)) for i in range(5)])
    first = api.get("/api/v1/signals/?source=kernel&page_size=2").json()
    assert [s["message"] for s in first["results"]] == ["line 0", "line 1"]
    second = api.get(first["next"]).json()
    assert [s["message"] for s in second["results"]] == ["line 2", "line 3"]
    since = (start + timedelta(seconds=3)).isoformat()
    later = api.get("/api/v1/signals/", {"source": "kernel", "since": since}).json()
    assert [s["message"] for s in later["results"]] == ["line 3", "line 4"]
    xid = api.get(f"/api/v1/signals/?code=79&node={NODE}&job={JOB}&gpu=1").json()["results"]
    assert [s["id"] for s in xid] == [world.signal.pk]


@pytest.mark.parametrize(("query", "field"), [
    ("since=notadate", "since"), ("until=2026-13-40T00:00:00Z", "until"),
    ("source=gossip", "source"), ("gpu=x", "gpu"), ("cursor=garbage", "cursor"),
    # A cursor that decodes but whose position is not a time (edited by hand).
    (f"cursor={b64encode(b'p=yesterday').decode()}", "cursor"),
    # A time so early that it has no UTC equivalent.
    ("since=0001-01-01T00:00:00%2B01:00", "since"),
])
def test_signal_queries_with_bad_values_answer_400(api: APIClient, world: World, query: str,
                                                   field: str) -> None:
    response = api.get(f"/api/v1/signals/?{query}")
    assert response.status_code == 400 and field in response.json()


def test_offsets_postgresql_cannot_store_still_filter(api: APIClient, world: World) -> None:
    # ISO 8601 allows offsets up to 23:59; PostgreSQL only to 15:59: the filter asks in UTC.
    response = api.get("/api/v1/signals/?since=0514-10-07T07:55:31-21:46")
    assert response.status_code == 200 and len(response.json()["results"]) == 1


def test_bad_limits_fall_back_to_the_default(api: APIClient, world: World) -> None:
    for query in ("limit=-1", "limit=x", "offset=-5", "limit=100000"):
        assert api.get(f"/api/v1/incidents/?{query}").status_code == 200, query
    assert api.get("/api/v1/signals/?page_size=-1").status_code == 200


def test_push_stores_all_or_nothing_and_names_unknown_nodes(api: APIClient, world: World,
                                                            settings: Any) -> None:
    before = Signal.objects.count()
    body = signal_body(NODE)
    body["signals"].append({**body["signals"][0], "node": "gpu-404"})
    refused = api.post("/api/v1/signals/", body, format="json")
    assert refused.status_code == 422 and refused.json() == {"detail": "unknown node(s): gpu-404"}
    invalid = api.post("/api/v1/signals/", {"signals": [{"source": "kernel"}]}, format="json")
    assert invalid.status_code == 400
    assert invalid.json() == {"signals": {"0": {"at": ["This field is required."]}}}
    settings.FLEETWATCH_INGEST_MAX_BATCH = 1
    big = api.post("/api/v1/signals/", {"signals": body["signals"] * 2}, format="json")
    assert big.status_code == 413
    assert Signal.objects.count() == before  # nothing half-written
    stored = api.post("/api/v1/signals/", signal_body(NODE), format="json")
    assert stored.status_code == 201 and stored.json() == {"stored": 1}
    malformed = api.generic("POST", "/api/v1/signals/", "{not json",
                            content_type="application/json")
    assert malformed.status_code == 400 and "JSON parse error" in malformed.json()["detail"]


# --- incidents ------------------------------------------------------------------------------


def test_incident_list_filters(api: APIClient, world: World) -> None:
    assert api.get("/api/v1/incidents/?status=needs_attention").json()["count"] == 1
    assert api.get("/api/v1/incidents/?root_cause=gpu_hardware").json()["results"][0]["id"] == \
        world.incident.pk
    assert api.get(f"/api/v1/incidents/?node={OTHER_NODE}").json()["count"] == 1
    assert api.get(f"/api/v1/incidents/?job={JOB}").json()["count"] == 1
    assert api.get("/api/v1/incidents/?open=false").json()["count"] == 0
    since = (timezone.now() - timedelta(minutes=30)).isoformat()
    assert api.get("/api/v1/incidents/", {"since": since}).json()["count"] == 1
    assert api.get("/api/v1/incidents/?root_cause=gremlins").status_code == 400
    assert api.get("/api/v1/incidents/424242/").json() == {"detail": "no incident 424242"}


def test_incident_timeline_tells_the_story(api: APIClient, world: World) -> None:
    items = api.get(f"/api/v1/incidents/{world.incident.pk}/timeline/").json()
    types = [i["type"] for i in items]
    assert {"signal", "diagnosis", "audit"} <= set(types)
    signal = next(i for i in items if i["type"] == "signal")
    assert signal["signal"]["id"] == world.signal.pk and signal["step"] is None
    audit = [i["audit"]["verb"] for i in items if i["type"] == "audit"]
    assert "incident.opened" in audit and "test.seeded" in audit


def test_acknowledge_once_then_409(api: APIClient, world: World) -> None:
    url = f"/api/v1/incidents/{world.incident.pk}/acknowledge/"
    first = api.post(url)
    assert first.status_code == 200 and first.json()["acknowledged_by"] == "token:ops-bot"
    second = api.post(url)
    assert second.status_code == 409 and "acknowledged by token:ops-bot" in second.json()["detail"]
    assert AuditEntry.objects.filter(verb="incident.acknowledged", actor="token:ops-bot").exists()


def test_approve_and_cancel_through_the_incident(api: APIClient, world: World,
                                                 django_capture_on_commit_callbacks: Any) -> None:
    base = f"/api/v1/incidents/{world.incident.pk}"
    with django_capture_on_commit_callbacks():
        approved = api.post(f"{base}/approve/")
    assert approved.status_code == 200 and approved.json()["status"] == "running"
    assert approved.json()["approved_by"] == "token:ops-bot"
    assert api.post(f"{base}/approve/").status_code == 409  # running: nothing to approve
    cancelled = api.post(f"{base}/cancel/")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    nothing = api.post(f"{base}/cancel/")
    assert nothing.status_code == 409
    assert nothing.json()["detail"].endswith("has no remediation running or waiting for a person")


def test_remediate_starts_once(api: APIClient, world: World,
                               django_capture_on_commit_callbacks: Any) -> None:
    url = f"/api/v1/incidents/{world.incident.pk}/remediate/"
    busy = api.post(url)
    assert busy.status_code == 409 and busy.json()["status"] == "awaiting_approval"
    api.post(f"/api/v1/remediations/{world.remediation.pk}/cancel/")
    with django_capture_on_commit_callbacks():
        started = api.post(url)
    assert started.status_code == 201
    rem = Remediation.objects.get(pk=started.json()["id"])
    # A person pressing start has decided: it runs in auto mode, requested by the token.
    assert rem.status == "running" and rem.requested_by == "token:ops-bot"
    assert started.json()["steps"][0]["order"] == 1


def test_resolve_by_hand_with_a_note(api: APIClient, world: World) -> None:
    url = f"/api/v1/incidents/{world.incident.pk}/resolve/"
    assert api.post(url, {"note": 7 * "x" * 100}, format="json").status_code == 400
    done = api.post(url, {"note": "reseated the GPU"}, format="json")
    assert done.status_code == 200 and done.json()["status"] == "resolved"
    # The remediation nobody approved was cancelled with it.
    assert done.json()["remediations"][0]["status"] == "cancelled"
    assert AuditEntry.objects.get(verb="incident.resolved_by_hand").result == "reseated the GPU"
    again = api.post(url, format="json")
    assert again.status_code == 409 and again.json()["status"] == "resolved"
    assert api.post(f"/api/v1/incidents/{world.incident.pk}/remediate/").status_code == 409


def test_resolve_refuses_while_a_remediation_runs(api: APIClient, world: World) -> None:
    Remediation.objects.filter(pk=world.remediation.pk).update(status="running")
    refused = api.post(f"/api/v1/incidents/{world.incident.pk}/resolve/", format="json")
    assert refused.status_code == 409 and "cancel it before resolving" in refused.json()["detail"]
    assert Incident.objects.get(pk=world.incident.pk).status != "resolved"


# --- remediations and steps -----------------------------------------------------------------


def test_remediation_filters_and_actions(api: APIClient, world: World) -> None:
    body = api.get(f"/api/v1/remediations/?status=failed&incident={world.failed.incident_id}")
    assert [r["id"] for r in body.json()["results"]] == [world.failed.pk]
    gone = api.post("/api/v1/remediations/999999/approve/")
    assert gone.status_code == 404 and gone.json() == {"detail": "no remediation 999999"}
    nothing = api.post(f"/api/v1/remediations/{world.failed.pk}/continue/")
    assert nothing.status_code == 409 and nothing.json()["status"] == "failed"


def test_steps_filter_and_retry_the_failed_one(api: APIClient, world: World,
                                               django_capture_on_commit_callbacks: Any) -> None:
    steps = api.get(f"/api/v1/steps/?remediation={world.failed.pk}&status=failed").json()
    assert [s["id"] for s in steps["results"]] == [world.failed_step.pk]
    done_step = Step.objects.get(remediation=world.failed, order=1)
    refused = api.post(f"/api/v1/steps/{done_step.pk}/retry/")
    assert refused.status_code == 409 and refused.json()["status"] == "succeeded"
    with django_capture_on_commit_callbacks():
        retried = api.post(f"/api/v1/steps/{world.failed_step.pk}/retry/")
    assert retried.status_code == 200 and retried.json()["status"] == "pending"
    assert "retried by token:ops-bot" in retried.json()["detail"]
    assert api.post(f"/api/v1/steps/{world.failed_step.pk}/retry/").status_code == 409


# --- audit, sources, policy -----------------------------------------------------------------


def test_audit_filters_cursor_and_verify(api: APIClient, world: World) -> None:
    api.post(f"/api/v1/incidents/{world.incident.pk}/acknowledge/")
    mine = api.get("/api/v1/audit/?actor=token:ops-bot").json()["results"]
    # The service's entry and the middleware's record of the call, both naming the token.
    assert [e["verb"] for e in mine] == ["incident.acknowledged", "api.call"]
    assert api.get(f"/api/v1/audit/?incident={world.incident.pk}&verb=remediation.").json()[
        "results"][0]["verb"] == "remediation.created"
    page = api.get("/api/v1/audit/?page_size=1").json()
    assert len(page["results"]) == 1 and page["next"]
    ids = [page["results"][0]["id"], api.get(page["next"]).json()["results"][0]["id"]]
    assert ids == sorted(ids)
    verify = api.get("/api/v1/audit/verify/").json()
    assert verify["ok"] is True and verify["checked"] == AuditEntry.objects.count()
    assert verify["first_bad"] is None and verify["detail"].startswith("audit trail OK")


def test_sources_and_policy(api: APIClient, world: World) -> None:
    [source] = api.get("/api/v1/sources/").json()
    assert source["name"] == "slurm" and source["healthy"] is True
    assert source["recent_failed"] == 1 and len(source["recent_runs"]) == 2
    policy = api.get("/api/v1/policy/").json()
    assert policy["default_mode"] == "approve"
    gpu = next(r for r in policy["root_causes"] if r["value"] == "gpu_hardware")
    assert gpu["playbook"] == "replace_node" and set(gpu["step_modes"]) == {
        "replace", "reboot", "reset_gpu"}
    assert policy["budgets"]["max_nodes"] >= 1
    assert any(p["name"] == "replace_node" and p["steps"] for p in policy["playbooks"])


# --- tokens ---------------------------------------------------------------------------------


def test_admin_makes_lists_and_revokes_tokens(world: World) -> None:
    admin = _client(ADMIN, "root-bot", scopes=("read", "operate"))
    user_with_role("vera", VIEWER)
    made = admin.post("/api/v1/tokens/", {"name": "dash", "user": "vera", "scopes": ["read"],
                                          "days": 30}, format="json")
    assert made.status_code == 201 and made.json()["key"].startswith("fw_") is not None
    key = made.json()["key"]
    listed = admin.get("/api/v1/tokens/").json()["results"]
    assert {"dash", "root-bot", world.token_name} <= {t["name"] for t in listed}
    assert all("key" not in t and "digest" not in t for t in listed)
    dash = APIClient()
    dash.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert dash.get("/api/v1/incidents/").status_code == 200
    assert dash.post(f"/api/v1/incidents/{world.incident.pk}/acknowledge/").status_code == 403
    taken = admin.post("/api/v1/tokens/", {"name": "dash", "user": "vera", "scopes": ["read"]},
                       format="json")
    assert taken.status_code == 400 and "name" in taken.json()
    bad = admin.post("/api/v1/tokens/", {"name": "x", "user": "nobody", "scopes": ["root"]},
                     format="json")
    assert bad.status_code == 400 and {"user", "scopes"} <= bad.json().keys()
    revoked = admin.post("/api/v1/tokens/dash/revoke/")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    assert revoked.json()["revoked_by"] == "token:root-bot"
    again = admin.post("/api/v1/tokens/dash/revoke/")
    assert again.status_code == 409 and "already revoked" in again.json()["detail"]
    assert dash.get("/api/v1/incidents/").status_code == 401
    assert ApiToken.objects.get(name="dash").revoked_at is not None
    assert admin.get("/api/v1/tokens/nope/").json() == {"detail": "no token nope"}


def test_every_mutating_call_is_audited_with_its_caller(api: APIClient, world: World) -> None:
    api.post(f"/api/v1/remediations/{world.failed.pk}/approve/")  # refused: 409
    entry = AuditEntry.objects.filter(verb="api.call").latest("id")
    assert entry.actor == "token:ops-bot" and entry.ok is False and entry.result == "409"


def test_the_api_root_links_to_the_api_not_to_the_pages(db: None) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user_with_role('vi', VIEWER)[0])}")
    links = client.get("/api/v1/").json()
    assert links["incidents"].endswith("/api/v1/incidents/")
    assert links["nodes"].endswith("/api/v1/nodes/") and links["audit"].endswith("/api/v1/audit/")


def test_guessing_tokens_is_throttled_per_address(db: None, settings: Any) -> None:
    settings.FLEETWATCH_API_ANON_RATE = "3/min"
    client = APIClient(REMOTE_ADDR="203.0.113.9")
    answers = [client.get("/api/v1/incidents/", HTTP_AUTHORIZATION=f"Token fw_guess{i:056d}")
               .status_code for i in range(5)]
    assert answers == [401, 401, 401, 429, 429]
    # Even the right token waits out the window from that address; other addresses do not.
    good = token_for(user_with_role("vi", VIEWER)[0])
    assert client.get("/api/v1/incidents/", HTTP_AUTHORIZATION=f"Token {good}").status_code == 429
    elsewhere = APIClient(REMOTE_ADDR="203.0.113.10")
    assert elsewhere.get("/api/v1/incidents/",
                         HTTP_AUTHORIZATION=f"Token {good}").status_code == 200


def test_a_token_name_that_cannot_be_addressed_is_refused(db: None) -> None:
    admin = APIClient()
    ada = user_with_role("ada", ADMIN)[0]
    admin.credentials(HTTP_AUTHORIZATION=f"Token {token_for(ada, ('read', 'operate'))}")
    bad = admin.post("/api/v1/tokens/", {"name": "a/b", "user": "ada", "scopes": ["read"]},
                     format="json")
    assert bad.status_code == 400 and "name" in bad.json()
    good = admin.post("/api/v1/tokens/", {"name": "ci.bot-1", "user": "ada", "scopes": ["read"]},
                      format="json")
    assert good.status_code == 201
    assert admin.post("/api/v1/tokens/ci.bot-1/revoke/").status_code == 200
