"""A token's last_used_at, as the token list shows it: set by a request, at most once a
minute, in a transaction of its own (whose commit does not wait for the disk, on
PostgreSQL) so that it never rides on the caller's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from collectors.roles import ADMIN, user_with_role
from incidents.models import ApiToken
from tests.conftest import token_for

# Outside a test transaction, as a server's requests are.
pytestmark = pytest.mark.django_db(transaction=True)


def listed_last_used(admin: APIClient, name: str) -> str | None:
    [row] = [t for t in admin.get("/api/v1/tokens/").json()["results"] if t["name"] == name]
    return row["last_used_at"]


def test_a_request_records_when_its_token_was_last_used_at_most_once_a_minute() -> None:
    admin = APIClient()
    admin.credentials(HTTP_AUTHORIZATION="Token " + token_for(
        user_with_role("root", ADMIN)[0], ("read", "operate"), name="root-bot"))
    key = token_for(user_with_role("dash", ADMIN)[0], ("read",), name="dash")
    assert listed_last_used(admin, "dash") is None
    reader = APIClient()
    reader.credentials(HTTP_AUTHORIZATION="Token " + key)
    assert reader.get("/api/v1/nodes/").status_code == 200
    first = ApiToken.objects.get(name="dash").last_used_at
    assert first is not None and listed_last_used(admin, "dash") is not None
    assert reader.get("/api/v1/nodes/").status_code == 200
    assert ApiToken.objects.get(name="dash").last_used_at == first  # within the minute
    ApiToken.objects.filter(name="dash").update(last_used_at=first - timedelta(minutes=2))
    assert reader.get("/api/v1/nodes/").status_code == 200
    assert ApiToken.objects.get(name="dash").last_used_at > first - timedelta(seconds=1)
    assert ApiToken.objects.get(name="dash").last_used_at <= timezone.now()
