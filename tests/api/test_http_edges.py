"""Bad input at the door is a 400, 404 or 411, never a 500: bodies the database could not
store, NUL bytes in URLs and forms, ids longer than any id, chunked bodies, unknown actions.

Each example is one an outside probe found answering 500. Runs on PostgreSQL under
``make test``; ``test_the_same_on_sqlite`` runs this file again on SQLite, where ids beyond
64 bits used to raise OverflowError."""

from __future__ import annotations

import http.client
import json
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from collectors.api.parsers import MAX_DEPTH
from collectors.models import GpuSample, Signal
from collectors.roles import ADMIN, OPERATOR, user_with_role
from incidents.models import ApiToken
from tests.api.test_metrics import Gunicorn, gunicorn  # noqa: F401  (the fixture)
from tests.api.test_permissions import schema_operations
from tests.api.world import NODE, World, build_world, signal_body
from tests.conftest import rerun_on_sqlite, token_for

ROOT = Path(__file__).resolve().parent.parent.parent
BIG = "99999999999999999999"  # 20 digits: more than a 64-bit id


@pytest.fixture
def world(db: None, settings: Any) -> World:
    return build_world(settings)


@pytest.fixture
def api(world: World) -> APIClient:
    """An admin's token with every scope: may call everything."""
    client = APIClient()
    user = user_with_role("ada-edges", ADMIN)[0]
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user)}")
    return client


@pytest.fixture
def page(world: World) -> Client:
    client = Client()
    client.force_login(user_with_role("olga-edges", OPERATOR)[0])
    return client


def _push(api: APIClient, raw: str) -> Any:
    return api.generic("POST", "/api/v1/signals/", raw.encode(), content_type="application/json")


# --- bodies ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "problem"), [
    ('"x\\u0000y"', "NUL"),
    ('"\\ud800"', "surrogate"),
    ("1e999", "finite"),
    ("NaN", "finite"),
    ("-Infinity", "finite"),
    ("123456789012345678901234567890", "64-bit"),
])
def test_a_pushed_record_the_database_cannot_store_is_a_400_naming_the_field(
        api: APIClient, extra: str, problem: str) -> None:
    good = json.dumps(signal_body()["signals"][0])
    bad = good[:-1] + f', "extra": {{"note": {extra}}}}}'
    before = Signal.objects.count()
    response = _push(api, f'{{"signals": [{good}, {good}, {good}, {bad}]}}')
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["field"] == "signals[3].extra.note" and problem in body["detail"], body
    assert body["detail"].startswith("signals[3].extra.note: ")
    assert Signal.objects.count() == before  # nothing of the batch was stored


def test_a_bad_key_is_named_by_its_object(api: APIClient) -> None:
    response = _push(api, '{"signals": [{"extra": {"a\\u0000": 1}}]}')
    assert response.status_code == 400 and response.json()["field"] == "signals[0].extra"


@pytest.mark.parametrize("depth", [MAX_DEPTH + 5, 100_000])
def test_deeply_nested_json_is_a_400(api: APIClient, depth: int) -> None:
    response = _push(api, "[" * depth + "]" * depth)
    assert response.status_code == 400, response.content
    assert "nested deeper" in response.json()["detail"]


def test_a_body_that_is_not_utf8_is_a_400(api: APIClient) -> None:
    response = api.generic("POST", "/api/v1/signals/", b'{"signals": ["\xff\xfe"]}',
                           content_type="application/json")
    assert response.status_code == 400 and "not UTF-8" in response.json()["detail"]


def test_a_token_for_a_user_with_a_nul_in_the_name_is_a_400(api: APIClient) -> None:
    response = api.post("/api/v1/tokens/", {"name": "nul-user", "user": "ada\x00",
                                            "scopes": ["read"]}, format="json")
    assert response.status_code == 400 and response.json()["field"] == "user"
    assert not ApiToken.objects.filter(name="nul-user").exists()


def test_a_good_push_still_goes_through(api: APIClient) -> None:
    body = signal_body()
    body["signals"][0]["extra"] = {"temps": [40.5, -1, 0], "ok": True, "none": None,
                                   "text": "café ✓ \U0001f680"}
    assert api.post("/api/v1/signals/", body, format="json").status_code in (201, 202)


# --- URLs and forms -------------------------------------------------------------------------


@pytest.mark.parametrize("url", [f"/api/v1/nodes/{NODE}%00/", "/api/v1/tokens/x%00/",
                                 "/api/v1/clusters/%00/", f"/api/v1/jobs/%00{NODE}/"])
def test_a_nul_in_an_api_path_is_a_json_404(api: APIClient, url: str) -> None:
    response = api.get(url)
    assert response.status_code == 404 and "NUL" in response.json()["detail"]


@pytest.mark.parametrize("url", [
    "/api/v1/nodes/?cluster=%00",
    "/api/v1/incidents/?node=gpu%00",
    "/api/v1/signals/?kind=%00",
    f"/api/v1/jobs/?%00={NODE}",
])
def test_a_nul_in_an_api_url_is_a_json_400(api: APIClient, url: str) -> None:
    response = api.get(url)
    assert response.status_code == 400 and "NUL" in response.json()["detail"]


@pytest.mark.parametrize(("url", "status"), [
    ("/?group=%00", 400), ("/dashboard/live?group=a%00", 400),
    ("/dashboard/gpu-grid.json?group=%00", 400), (f"/nodes/{NODE}/?cluster=%00", 400),
    ("/incidents/?node=%00", 400), ("/audit/?actor=%00", 400),
    (f"/nodes/{NODE}%00/", 404), ("/jobs/x%00/", 404),
])
def test_a_nul_in_a_page_url_is_a_400_or_404(page: Client, url: str, status: int) -> None:
    response = page.get(url)
    assert response.status_code == status and "NUL" in response.content.decode()


@pytest.mark.parametrize(("value", "status"), [("\x00", 400), ("abc", 400), ("", 400),
                                                ("1.5", 400), (BIG, 400), ("0", 404)])
def test_a_page_form_id_that_is_not_one_is_a_400(page: Client, world: World, value: str,
                                                 status: int) -> None:
    response = page.post(f"/incidents/{world.incident.pk}/approve", {"remediation": value})
    assert response.status_code == status
    world.remediation.refresh_from_db()
    assert world.remediation.status == "awaiting_approval"


def test_an_unknown_page_action_is_the_404_page_and_echoes_nothing(page: Client,
                                                                   world: World) -> None:
    action = "%3Cscript%3Ealert(1)%3C%2Fscript%3E"
    response = page.post(f"/incidents/{world.incident.pk}/{action}")
    assert response.status_code == 404
    assert b"<script>" not in response.content and b"alert(1)" not in response.content


def test_the_404_page_echoes_nothing(page: Client, settings: Any) -> None:
    settings.DEBUG = False
    response = page.get("/no-such-page/%3Cscript%3Ealert(1)%3C%2Fscript%3E")
    assert response.status_code == 404 and b"alert(1)" not in response.content


# --- ids beyond 64 bits ---------------------------------------------------------------------


def _id_paths() -> list[str]:
    return sorted({path for method, path in schema_operations() if "{id}" in path})


def test_every_id_path_with_twenty_digits_is_a_404(api: APIClient) -> None:
    paths = _id_paths()
    assert "/api/v1/incidents/{id}/" in paths and "/api/v1/webhook-deliveries/{id}/" in paths
    for method, template in sorted(schema_operations()):
        if "{id}" not in template:
            continue
        url = template.replace("{id}", BIG)
        response = api.generic(method, url, b"{}", content_type="application/json")
        assert response.status_code == 404, (method, url, response.status_code)


@pytest.mark.parametrize("query", [
    f"/api/v1/remediations/?incident={BIG}", f"/api/v1/steps/?incident={BIG}",
    f"/api/v1/steps/?remediation={BIG}", f"/api/v1/audit/?incident={BIG}",
    f"/api/v1/audit/?remediation={BIG}", f"/api/v1/audit/?step={BIG}",
    f"/api/v1/signals/?gpu={BIG}", "/api/v1/signals/?code=1e999", f"/api/v1/gpus/?index={BIG}",
    "/api/v1/gpus/?last_xid=NaN", "/api/v1/audit/?incident=abc", "/api/v1/steps/?incident=1.5",
])
def test_an_id_filter_that_cannot_be_an_id_is_a_400_naming_it(api: APIClient, query: str) -> None:
    response = api.get(query)
    assert response.status_code == 400, response.content
    assert urlsplit(query).query.split("=")[0] in response.json()


def test_an_id_filter_that_fits_still_filters(api: APIClient, world: World) -> None:
    assert api.get(f"/api/v1/remediations/?incident={world.incident.pk}").json()["count"] == 1
    assert api.get("/api/v1/remediations/?incident=9223372036854775807").json()["count"] == 0


@pytest.mark.parametrize("url", [f"/incidents/{BIG}/", f"/incidents/{BIG}/live",
                                 f"/incidents/{BIG}/replay.json", f"/incidents/{BIG}/chart.json",
                                 f"/incidents/{BIG}/postmortem.md"])
def test_a_page_for_a_twenty_digit_id_is_a_404(page: Client, url: str) -> None:
    assert page.get(url).status_code == 404


def test_a_page_filter_that_cannot_be_an_id_is_a_400_showing_the_form(page: Client) -> None:
    response = page.get(f"/audit/?incident={BIG}")
    assert response.status_code == 400 and b"Incident #" in response.content
    assert page.get("/audit/?incident=abc").status_code == 400
    assert page.get("/audit/?incident=1").status_code == 200


@pytest.mark.skipif(connection.vendor == "sqlite", reason="this run is the SQLite one")
def test_the_same_on_sqlite(tmp_path: Path) -> None:
    # SQLite raised OverflowError for ids beyond 64 bits: run this file's tests on it too
    # (not the gunicorn one, which wants PostgreSQL).
    rerun_on_sqlite(__file__, tmp_path, "not the_same_on_sqlite and not gunicorn")


# --- chunked bodies, under gunicorn as production runs it -----------------------------------


def _raw_post(base: str, path: str, token: str, chunks: list[bytes] | None, body: bytes = b""
              ) -> tuple[int, bytes]:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
    try:
        if chunks is None:
            conn.request("POST", path, body=body, headers=headers)
        else:
            conn.request("POST", path, body=iter(chunks), headers=headers, encode_chunked=True)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_chunked_body_under_gunicorn_is_a_411_not_an_empty_push(
        gunicorn: Gunicorn, world: World, operator: Any) -> None:  # noqa: F811
    token = token_for(operator)
    body = json.dumps(signal_body()).encode()
    status, answer = _raw_post(gunicorn.base, "/api/v1/signals/", token,
                               [body[:20], body[20:]])
    assert status == 411, answer
    assert "Content-Length" in json.loads(answer)["detail"]
    status, answer = _raw_post(gunicorn.base, "/api/v1/signals/", token, None, body)
    assert status in (201, 202), answer


# --- what the pages' JSON and tables show ---------------------------------------------------


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_a_stored_infinite_reading_leaves_the_pages_json_parseable(page: Client,
                                                                   world: World) -> None:
    type(world.gpu).objects.filter(pk=world.gpu.pk).update(temperature=float("inf"),
                                                            utilization=float("nan"))
    # PostgreSQL's float8 keeps an infinite reading (and SQLite's REAL too).
    for minutes in (0, 1):
        GpuSample.objects.create(node=world.node, gpu_index=1, temperature=float("inf"),
                                 utilization=float("-inf"),
                                 at=world.incident.detected_at + timedelta(minutes=minutes))
    for url in (f"/nodes/{NODE}/telemetry.json", "/dashboard/gpu-grid.json?group=*",
                f"/incidents/{world.incident.pk}/chart.json",
                f"/incidents/{world.incident.pk}/replay.json"):
        response = page.get(url)
        assert response.status_code == 200, url
        _strict_json(response.content.decode())


def test_only_admins_see_what_a_webhook_receiver_answered_on_the_page(world: World) -> None:
    world.delivery.response = "db-7.internal refused"
    world.delivery.save(update_fields=["response"])
    url = f"/incidents/{world.incident.pk}/"
    for role, sees in ((OPERATOR, False), (ADMIN, True)):
        client = Client()
        client.force_login(user_with_role(f"{role}-hooks", role)[0])
        html = client.get(url).content.decode()
        assert ("db-7.internal refused" in html) is sees, role
