"""Every mutating API call leaves an audit entry naming who made it (``token:NAME`` or
``user:NAME``) and how it ended, whatever the endpoint and whether it was accepted or refused:
a refused approve is as much a part of the story as an accepted one.

A middleware rather than a hook in each view, so a new endpoint cannot forget it. It writes
after the view has answered (and its transaction has committed), so the audit lock is never
held across the view's work (see incidents/audit.py). Anonymous calls are refused before any
view runs and are not audited (they are logged); their volume is nobody's to control.

A refused push of signals gets one more entry saying why (``push_refused_record``).

An accepted push (signals from agents and monitors, Prometheus's remote write) is data coming
in, not an action: it is not audited (the access log names who sent it, and what it brought is
stored as signals). Auditing it took the audit trail's lock once per push, so in a storm of
agents every push queued behind every other and behind diagnosis."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponseBase

from collectors.roles import actor_from_request
from collectors.services import IngestRejected
from incidents.audit import audit_record

_SAFE = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# The intake endpoints (URL names in the API's namespace), audited only when refused.
_INTAKE = frozenset({"api:signal-list", "api:prometheus-write-list"})


class ApiAuditMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        if request.method in _SAFE or not request.path.startswith("/api/"):
            return response
        user = getattr(request, "user", None)  # DRF sets it on the Django request too
        if user is None or not user.is_authenticated:
            return response
        code = response.status_code
        match = getattr(request, "resolver_match", None)
        if code < 300 and match is not None and match.view_name in _INTAKE:
            return response
        audit_record("api.call", f"{request.method} {request.path}"[:200],
                     actor=actor_from_request(request), ok=code < 400, result=str(code),
                     data={"status": code})
        return response


def push_refused_record(sender: object, request: HttpRequest, error: IngestRejected,
                        signals: int, **kwargs: object) -> None:
    """A refused push of signals, with why (the api.call entry above only says it was
    refused): connected to ``collectors.api.views.push_refused``."""
    audit_record("signals.refused", f"POST {request.path}"[:200],
                 actor=actor_from_request(request), ok=False, result=str(error)[:500],
                 data={"status": error.status, "records": error.refused[:20],
                       "signals": signals})
