"""Appending to the audit trail."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

from incidents.models import AuditEntry, Incident, Remediation, Step

SYSTEM = "system"


def actor_name(user: AbstractBaseUser | AnonymousUser | None) -> str:
    if user is None or not user.is_authenticated:
        return SYSTEM
    return f"user:{user.get_username()}"


def audit_record(
    verb: str,
    target: str,
    *,
    actor: str = SYSTEM,
    call: str = "",
    ok: bool = True,
    result: str = "",
    incident: Incident | None = None,
    remediation: Remediation | None = None,
    step: Step | None = None,
    data: dict[str, Any] | None = None,
) -> AuditEntry:
    if remediation is not None and incident is None:
        incident = remediation.incident
    return AuditEntry.objects.create(
        actor=actor, verb=verb, target=target[:200], call=call, ok=ok, result=result,
        incident=incident, remediation=remediation, step=step, data=data or {},
    )
