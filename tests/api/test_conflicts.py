"""Actions that do not fit the state answer 409 with the state, and names taken at the same
moment answer 400: never a 500 from the database's constraints."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client
from rest_framework.test import APIClient

from collectors.roles import ADMIN, OPERATOR, user_with_role
from incidents.models import ApiToken, Remediation, WebhookSubscription
from tests.api.world import World, build_world
from tests.conftest import token_for


@pytest.fixture
def world(db: None, settings: Any) -> World:
    return build_world(settings)


def _api(role: str) -> APIClient:
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Token {token_for(user_with_role(f'{role}-c', role)[0])}")
    return client


def test_retrying_a_failed_remediation_while_a_newer_one_is_live_is_409(world: World) -> None:
    # The failed repair's incident got a newer remediation meanwhile (a person pressed start).
    newer = Remediation.objects.create(
        incident=world.failed.incident, playbook="cool_down", mode="approve",
        status=Remediation.Status.AWAITING_APPROVAL, requested_by="user:someone",
        nodes=list(world.failed.nodes))
    api = _api(OPERATOR)
    for path in (f"/api/v1/remediations/{world.failed.pk}/retry/",
                 f"/api/v1/steps/{world.failed_step.pk}/retry/"):
        response = api.post(path)
        assert response.status_code == 409, response.content
        body = response.json()
        assert body["status"] == "failed"
        assert f"remediation {newer.pk}" in body["detail"] and "awaiting approval" in body["detail"]
    # The page's button: the same refusal, as a message (or a 409 for a program asking JSON).
    page = Client()
    page.force_login(user_with_role("page-op", OPERATOR)[0])
    url = f"/incidents/{world.failed.incident_id}/retry"
    asked = page.post(url, {"remediation": world.failed.pk}, HTTP_ACCEPT="application/json")
    assert asked.status_code == 409 and f"remediation {newer.pk}" in asked.json()["error"]
    shown = page.post(url, {"remediation": world.failed.pk}, follow=True)
    assert shown.status_code == 200 and f"remediation {newer.pk}" in shown.content.decode()
    world.failed.refresh_from_db()
    world.failed_step.refresh_from_db()
    assert world.failed.status == "failed" and world.failed_step.status == "failed"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["token", "webhook"])
def test_the_same_name_at_the_same_moment_is_a_400(settings: Any, kind: str) -> None:
    # Another admin's create of the same name is in flight (inserted, not yet committed):
    # ours passes the "is the name free" check, then meets the unique constraint.
    if connection.vendor != "postgresql":
        pytest.skip("SQLite runs one writer at a time: the name is seen taken, as tested above")
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    admin = user_with_role("racing-admin", ADMIN)[0]
    api = _api(ADMIN)
    inserted, finish = threading.Event(), threading.Event()

    def other_admin() -> None:
        try:
            with transaction.atomic():
                if kind == "token":
                    ApiToken.objects.create(user=admin, name="same", scopes=["read"])
                else:
                    WebhookSubscription.objects.create(name="same", url="https://example.com/h",
                                                       secret="s" * 32)
                inserted.set()
                finish.wait(timeout=30)
        finally:
            connection.close()

    other = threading.Thread(target=other_admin)
    other.start()
    assert inserted.wait(timeout=30)
    # Our insert waits on the other's uncommitted row; let it commit a moment later.
    threading.Timer(0.5, finish.set).start()
    if kind == "token":
        response = api.post("/api/v1/tokens/", {"name": "same", "user": admin.username,
                                                "scopes": ["read"]}, format="json")
    else:
        response = api.post("/api/v1/webhooks/", {"name": "same", "url": "https://example.com/x"},
                            format="json")
    other.join()
    assert response.status_code == 400, response.content
    assert "name" in response.json()
    model = ApiToken if kind == "token" else WebhookSubscription
    assert model.objects.filter(name="same").count() == 1
