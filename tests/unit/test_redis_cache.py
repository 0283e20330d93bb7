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



def test_count_and_peek_counts_as_add_and_incr_would_in_one_round_trip(
        cache: RedisCache) -> None:
    # A new counter starts at 1 and expires after the timeout given; the other is read.
    assert cache.count_and_peek("now", 30, "before") == (1, 0)
    cache.set("before", 7, 30)
    assert cache.count_and_peek("now", 30, "before") == (2, 7)
    assert cache.get("now") == 2  # the throttle's refusal takes one back with decr
    assert cache.decr("now") == 1
    client = cache._cache.get_client()
    ttl = client.ttl(cache.make_and_validate_key("now"))
    assert 0 < ttl <= 30  # set when made, not pushed back by the counting
    assert cache.count_and_peek("now", 999, "missing") == (2, 0)
    assert client.ttl(cache.make_and_validate_key("now")) <= 30
    cache.delete_many(["now", "before"])
