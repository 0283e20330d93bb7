"""The Redis cache as deployed (REDIS_URL): Django's, with one client per connection pool
(fleetwatch/cache.py). Against the Redis that make test starts: what the throttle and the
failed-login counter do with it still works, and two operations share one client."""

from __future__ import annotations

import os
import uuid

import pytest

from fleetwatch.cache import RedisCache


@pytest.fixture
def cache() -> RedisCache:
    url = os.environ.get("CELERY_BROKER_URL", "")
    if not url.startswith("redis://"):
        pytest.skip("needs the Redis make test starts (CELERY_BROKER_URL=redis://...)")
    return RedisCache(url, {"KEY_PREFIX": f"test-{uuid.uuid4().hex}"})


def test_the_cache_works_and_shares_one_client(cache: RedisCache) -> None:
    assert cache.get("missing") is None
    cache.set("history", [1.5, 2.5], 30)
    assert cache.get("history") == [1.5, 2.5]
    assert cache.add("once", 1, 30) and not cache.add("once", 2, 30)
    assert cache.incr("once") == 2
    cache.set_many({"a": 1, "b": 2}, 30)
    assert cache.get_many(["a", "b", "c"]) == {"a": 1, "b": 2}
    cache.delete_many(["a", "b", "once", "history"])
    assert cache.get_many(["a", "b", "once", "history"]) == {}
    # One client for the one server, however many operations (Django makes one each).
    client = cache._cache.get_client()
    assert cache._cache.get_client(write=True) is client

