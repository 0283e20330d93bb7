"""Throttling per token: each token its own budget, pushes of signals a budget of their own,
a clear 429 with Retry-After, and one count for all gunicorn workers (the cache is shared)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.core.cache import cache

from collectors.api import throttles
from tests.api.test_metrics import Gunicorn, gunicorn, http_get  # noqa: F401  (the fixture)
from tests.conftest import token_for


@pytest.fixture(autouse=True)
def _fresh_counters() -> None:
    cache.clear()


def _get(client: Any, key: str, path: str = "/api/v1/nodes/") -> Any:
    return client.get(path, HTTP_AUTHORIZATION=f"Token {key}")


def _push(client: Any, key: str) -> Any:
    # An empty batch is refused by the view (400), after the throttle has counted it.
    return client.post("/api/v1/signals/", {"signals": []}, content_type="application/json",
                       HTTP_AUTHORIZATION=f"Token {key}")


def test_each_token_has_its_own_budget(client: Any, settings: Any, operator: Any) -> None:
    settings.FLEETWATCH_API_RATE = "3/min"
    a, b = token_for(operator, name="token-a"), token_for(operator, name="token-b")
    assert [_get(client, a).status_code for _ in range(3)] == [200] * 3
    refused = _get(client, a)
    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 60
    detail = refused.json()["detail"]
    assert "Too many requests for this token: the limit is 3/min." in detail
    assert "Expected available in" in detail
    assert _get(client, b).status_code == 200  # the same user's other token is unaffected
    # The refused request did not use up more: a's count stays at its limit.
    assert _get(client, a).status_code == 429


def test_signal_pushes_have_their_own_budget(client: Any, settings: Any, operator: Any) -> None:
    settings.FLEETWATCH_API_RATE = "2/min"
    settings.FLEETWATCH_API_INGEST_RATE = "4/min"
    key = token_for(operator, name="agent-like")
    assert [_get(client, key).status_code for _ in range(2)] == [200, 200]
    assert _get(client, key).status_code == 429
    # Reads are used up; pushes still have all of theirs.
    codes = [_push(client, key).status_code for _ in range(5)]
    assert 429 not in codes[:4] and codes[4] == 429
    assert "Too many signal pushes" in _push(client, key).json()["detail"]


def test_session_users_and_anonymous_callers(client: Any, settings: Any, viewer: Any) -> None:
    settings.FLEETWATCH_API_RATE = "2/min"
    settings.FLEETWATCH_API_ANON_RATE = "1/min"
    # Anonymous callers are counted by address where a view lets them in (the schema).
    assert client.get("/api/schema/").status_code == 200
    refused = client.get("/api/schema/")
    assert refused.status_code == 429 and b"for this address" in refused.content
    client.force_login(viewer)
    assert [client.get("/api/v1/nodes/").status_code for _ in range(3)] == [200, 200, 429]
    assert "for this user" in client.get("/api/v1/nodes/").json()["detail"]


def test_a_new_window_lets_requests_through_again(client: Any, settings: Any, operator: Any,
                                                 monkeypatch: Any) -> None:
    settings.FLEETWATCH_API_RATE = "2/min"
    key = token_for(operator)
    now = [6000.0]  # the start of a minute
    monkeypatch.setattr(throttles.TokenRateThrottle, "timer", staticmethod(lambda: now[0]))
    assert [_get(client, key).status_code for _ in range(3)] == [200, 200, 429]
    now[0] += 90  # half-way through the next minute: half the last minute's 2 still count
    assert [_get(client, key).status_code for _ in range(2)] == [200, 429]
    now[0] += 60
    assert _get(client, key).status_code == 200


def test_retry_after() -> None:
    # This window full: wait for it to end.
    assert throttles.retry_after(10, 0, 10, 15.0, 60) == 45
    # Room in this window, but the last one still weighs: wait until enough of it slides out.
    assert throttles.retry_after(5, 10, 10, 0.0, 60) == 30
    assert throttles.parse_rate("1200/min") == (1200, 60)
    assert throttles.parse_rate("10/s") == (10, 1)


# The counters in Redis, as in production (REDIS_URL): its increments are atomic, so
# requests arriving at several workers at once are counted exactly.
extra_env = {"FLEETWATCH_API_RATE": "5/min",
             "FLEETWATCH_CACHE_URL": os.environ.get("CELERY_BROKER_URL", "")}


def test_one_budget_across_gunicorn_workers(gunicorn: Gunicorn, operator: Any) -> None:  # noqa: F811
    key = token_for(operator, name="many-workers")
    url = f"{gunicorn.base}/api/v1/nodes/"
    # Four at once, each on its own connection, so the three workers all take some.
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: http_get(url, {"Authorization": f"Token {key}"})[0],
                              range(12)))
    # Answered by several workers, and still five in all: they count in one place.
    assert len(gunicorn.worker_pids()) >= 2, "the requests all went to one worker"
    assert sorted(codes) == [200] * 5 + [429] * 7, codes
