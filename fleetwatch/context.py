from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest


def fleetwatch(request: HttpRequest) -> dict[str, object]:
    user = getattr(request, "user", None)
    return {
        "demo_controls": settings.FLEETWATCH_DEMO_CONTROLS,
        "policy_mode": settings.FLEETWATCH_POLICY_MODE,
        "can_operate": bool(user and user.is_authenticated and user.has_perm("incidents.operate")),
    }
