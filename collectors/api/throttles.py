"""Throttling per token: each token has its own budget (``FLEETWATCH_API_RATE``; pushes of
signals ``FLEETWATCH_API_INGEST_RATE``, a budget of their own), a browser session its user's,
anonymous callers their address's. The counters live in the shared cache (Redis, or files in
the data folder), so every gunicorn worker counts together.

A sliding window approximated from two fixed ones (this minute's count plus the last minute's,
weighted by how much of it still overlaps the window): two small cache keys and an atomic
increment per request. DRF's own SimpleRateThrottle keeps a list of every request's time in
one cache value, read and rewritten whole on each request: 6,000 floats a request for an
ingest budget of 6000/min, and concurrent workers overwrite each other's lists.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from rest_framework.exceptions import Throttled
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

from collectors.api.permissions import token_of

_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def rate_for(scope: str) -> str | None:
    """The rate of a scope, read at each request so a changed setting applies at once
    (DRF's throttles copy their rates once, when the class is defined)."""
    return {"token": settings.FLEETWATCH_API_RATE, "ingest": settings.FLEETWATCH_API_INGEST_RATE,
            "anon": settings.FLEETWATCH_API_ANON_RATE}.get(scope)


def parse_rate(rate: str) -> tuple[int, int]:
    """"1200/min" -> (1200, 60): DRF's notation (the period's first letter counts)."""
    try:
        number, period = rate.split("/")
        return int(number), _PERIODS[period.strip()[0].lower()]
    except (ValueError, KeyError, IndexError):
        raise ImproperlyConfigured(f"{rate!r} is not a rate such as 1200/min") from None


def window_weight(elapsed: float, duration: float) -> float:
    """The share of the previous window that still lies within the sliding window."""
    return max(0.0, 1.0 - elapsed / duration)


def retry_after(count: int, previous: int, limit: int, elapsed: float, duration: float) -> int:
    """Whole seconds until one more request would fit (Retry-After)."""
    if count >= limit or previous <= 0:
        wait = duration - elapsed  # nothing fits until this window ends
    else:
        # previous * (1 - (elapsed + t) / duration) + count < limit
        wait = duration * (1 - (limit - count) / previous) - elapsed
    return max(1, min(math.ceil(wait), math.ceil(duration)))


class TokenRateThrottle(BaseThrottle):
    timer = staticmethod(time.time)

    def scope_for(self, request: Request, view: Any) -> str:
        if not (request.user and request.user.is_authenticated):
            return "anon"
        if getattr(view, "throttle_scope", None) == "ingest":
            return "ingest"
        return "token"

    def cache_key(self, request: Request, view: Any, scope: str) -> str:
        token = token_of(request)
        if token is not None:
            ident = f"t:{str(token.pk)[:32]}"  # a prefix of the digest, never the token
        elif request.user and request.user.is_authenticated:
            ident = f"u:{request.user.pk}"
        else:
            ident = f"a:{self.get_ident(request)}"
        return f"fw-throttle:{scope}:{ident}"

    def allow_request(self, request: Request, view: Any) -> bool:
        scope = self.scope_for(request, view)
        rate = rate_for(scope)
        if not rate:
            return True
        limit, duration = parse_rate(rate)
        key = self.cache_key(request, view, scope)
        now = self.timer()
        window = int(now // duration)
        elapsed = now - window * duration
        current, previous = f"{key}:{window}", f"{key}:{window - 1}"
        count_and_peek = getattr(cache, "count_and_peek", None)  # Redis: one round trip
        if count_and_peek is not None:
            count, before = count_and_peek(current, duration * 2 + 1, previous)
        else:
            count = self._increment(current, duration)
            before = int(cache.get(previous) or 0)
        if before * window_weight(elapsed, duration) + count <= limit:
            return True
        self._undo(current)  # a refused request does not use the budget up further
        who = ("address" if scope == "anon"
               else "token" if token_of(request) is not None else "user")
        what = "signal pushes" if scope == "ingest" else "requests"
        raise Throttled(
            wait=retry_after(count - 1, before, limit, elapsed, duration),
            detail=f"Too many {what} for this {who}: the limit is {rate}.")

    @staticmethod
    def _increment(key: str, duration: int) -> int:
        # Kept two windows: the next window reads this one as its "previous".
        if cache.add(key, 1, timeout=duration * 2 + 1):
            return 1
        try:
            return int(cache.incr(key))
        except ValueError:  # expired between add and incr
            cache.add(key, 1, timeout=duration * 2 + 1)
            return 1

    @staticmethod
    def _undo(key: str) -> None:
        with contextlib.suppress(ValueError):  # expired meanwhile: nothing to give back
            cache.decr(key)


# --- failed authentication ----------------------------------------------------------------------
# DRF authenticates and checks permissions before it throttles, so a caller guessing tokens
# would never meet TokenRateThrottle: each wrong token gets its 401 at once. Failed token
# attempts are counted per address instead (FLEETWATCH_API_ANON_RATE), before the lookup.


def _failure_key(request: Request) -> tuple[str, int, int]:
    limit, duration = parse_rate(settings.FLEETWATCH_API_ANON_RATE)
    address = BaseThrottle().get_ident(request)
    return f"fw-authfail:{address}:{int(time.time() // duration)}", limit, duration


def auth_failures_check(request: Request) -> None:
    """Refuse (429) an address that has failed to authenticate too often this window."""
    key, limit, duration = _failure_key(request)
    if int(cache.get(key) or 0) >= limit:
        raise Throttled(wait=max(1, math.ceil(duration - time.time() % duration)),
                        detail="Too many failed token attempts from this address.")


def auth_failure_record(request: Request) -> None:
    key, _, duration = _failure_key(request)
    TokenRateThrottle._increment(key, duration)
