"""API tokens: made, listed and revoked here (by the CLI, the admin API and the agent setup).
The key is shown once, when made; only its digest is stored."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from collectors.roles import agent_user
from incidents.audit import SYSTEM, audit_record
from incidents.models import ApiToken

SCOPES = tuple(ApiToken.Scope.values)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class TokenError(ValueError):
    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field  # the request field at fault, where there is one


def scopes_parse(scopes: Iterable[str]) -> list[str]:
    chosen = sorted({s.strip() for s in scopes if s.strip()})
    unknown = [s for s in chosen if s not in SCOPES]
    if unknown or not chosen:
        raise TokenError(f"scopes must be some of {', '.join(SCOPES)}; got "
                         f"{', '.join(unknown) or 'none'}")
    return chosen


def token_create(user: AbstractBaseUser, name: str, scopes: Iterable[str], *,
                 ttl_days: float | None = None, actor: str = SYSTEM) -> tuple[ApiToken, str]:
    """A new token for ``user``; returns the row and the key (the only time it is seen).
    ``ttl_days`` None takes FLEETWATCH_API_TOKEN_TTL_DAYS; 0 never expires."""
    chosen = scopes_parse(scopes)
    if not NAME.fullmatch(name or ""):
        raise TokenError("a token's name is 1 to 64 letters, digits, '.', '_' or '-' (it is "
                         "part of the token's URL and of the audit trail's token:NAME)")
    days = settings.FLEETWATCH_API_TOKEN_TTL_DAYS if ttl_days is None else ttl_days
    expiry = timedelta(days=days) if days and days > 0 else None
    taken = TokenError(f"a token named {name!r} exists (names stay taken after revoking, so "
                       "the audit trail's token:NAME is never ambiguous)", field="name")
    try:
        with transaction.atomic():
            if ApiToken.objects.filter(name=name).exists():
                raise taken
            row, key = ApiToken.objects.create(user=user, expiry=expiry, name=name,
                                               scopes=chosen, created_by=actor)
            audit_record("token.create", f"token:{name}", actor=actor,
                         data={"user": user.get_username(), "scopes": chosen,
                               "expiry": row.expiry.isoformat() if row.expiry else None})
    except IntegrityError:
        # Made by someone else between our look and our insert (the name is unique in the
        # database): the same answer as if we had seen it.
        raise taken from None
    return row, key


def token_revoke(token: ApiToken, *, actor: str = SYSTEM) -> bool:
    """Revoke; False when it already was (a second press changes nothing)."""
    with transaction.atomic():
        changed = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now(), revoked_by=actor)
        if changed:
            audit_record("token.revoke", f"token:{token.name}", actor=actor)
    token.refresh_from_db()
    return bool(changed)


def agent_token_create(node: str, *, actor: str = SYSTEM) -> tuple[ApiToken, str]:
    """A node agent's token: the ``ingest`` scope only, owned by ``agent:<node>``, so it may
    push signals for that node and nothing else. Makes a fresh key each time (the old key
    cannot be shown again: it is not stored); earlier agent tokens of the node stay valid
    until revoked, so a fleet can roll keys without a gap."""
    user = agent_user(node)
    n = ApiToken.objects.filter(user=user).count() + 1
    name = f"agent-{node}" if n == 1 else f"agent-{node}-{n}"
    while ApiToken.objects.filter(name=name).exists():
        n += 1
        name = f"agent-{node}-{n}"
    return token_create(user, name, ["ingest"], ttl_days=0, actor=actor)
