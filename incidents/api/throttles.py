"""Throttling per token: each token has its own budget (``FLEETWATCH_API_RATE``; pushes of
signals ``FLEETWATCH_API_INGEST_RATE``), a browser session its user's, anonymous callers their
address's. The counters live in the shared cache, so every gunicorn worker counts together."""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle

from incidents.models import ApiToken


class TokenRateThrottle(SimpleRateThrottle):
    scope = "token"

    def allow_request(self, request: Request, view: Any) -> bool:
        # The rate depends on the caller and the view, so it is chosen per request.
        if not (request.user and request.user.is_authenticated):
            self.scope = "anon"
        elif getattr(view, "throttle_scope", None) == "ingest":
            self.scope = "ingest"
        else:
            self.scope = "token"
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)

    def get_cache_key(self, request: Request, view: Any) -> str:
        if isinstance(request.auth, ApiToken):
            ident = f"t:{request.auth.pk[:32]}"  # a prefix of the digest, never the token
        elif request.user and request.user.is_authenticated:
            ident = f"u:{request.user.pk}"
        else:
            ident = f"a:{self.get_ident(request)}"
        return f"fw-throttle:{self.scope}:{ident}"
