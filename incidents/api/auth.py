"""API token authentication: django-rest-knox's hashed tokens, plus our revocation and a clear
answer for a token that expired or was revoked (knox would delete an expired token; we keep
the row so the token list still says who had it and when it stopped working)."""

from __future__ import annotations

import binascii
from datetime import datetime, timedelta
from hmac import compare_digest
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.contrib.postgres.aggregates import ArrayAgg
from django.db import connection, transaction
from django.db.models import Value
from django.utils import timezone
from knox.auth import TokenAuthentication
from knox.crypto import hash_token
from knox.settings import CONSTANTS
from rest_framework import exceptions
from rest_framework.authentication import get_authorization_header

from collectors.api.throttles import auth_failure_record, auth_failures_check
from collectors.roles import groups_known
from collectors.services import commit_without_flush
from incidents.models import ApiToken

# last_used_at is for people reading the token list; a write per request would be waste.
_LAST_USED_EVERY = timedelta(minutes=1)


def _last_used_record(pk: str, now: datetime) -> None:
    """A token's last_used_at: its own transaction, whose commit does not wait for the WAL
    flush. A storm's pushes each come with a token unused for a minute (an agent's), and
    this commit waiting for the disk, besides the push's own, was a second flush a push."""
    if connection.in_atomic_block:  # a caller's transaction (a test's): it decides
        ApiToken.objects.filter(pk=pk).update(last_used_at=now)
        return
    with transaction.atomic():
        commit_without_flush()
        ApiToken.objects.filter(pk=pk).update(last_used_at=now)


class ScopedTokenAuthentication(TokenAuthentication):
    """``Authorization: Token fw_...``. Sets ``request.auth`` to the ``ApiToken``."""

    def authenticate(self, request: Any) -> tuple[AbstractBaseUser, ApiToken] | None:
        if not get_authorization_header(request).lower().startswith(b"token "):
            return None  # no token here: another scheme (the session) may answer
        auth_failures_check(request)
        try:
            return super().authenticate(request)
        except exceptions.AuthenticationFailed:
            auth_failure_record(request)
            raise

    def authenticate_credentials(self, token: bytes) -> tuple[AbstractBaseUser, ApiToken]:
        try:
            text = token.decode("utf-8")
            digest = hash_token(text)
        except (UnicodeDecodeError, TypeError, binascii.Error, ValueError):
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        rows = ApiToken.objects.filter(
            token_key=text[:CONSTANTS.TOKEN_KEY_LENGTH]).select_related("user")
        if connection.vendor == "postgresql":
            # The user's groups (its role) in the same statement: every request asks for
            # them, and a push makes few statements (SQLite reads them on first use).
            rows = rows.annotate(group_names=ArrayAgg("user__groups__name", default=Value([])))
        for row in rows:
            if not compare_digest(digest, row.digest):
                continue
            if row.revoked_at is not None:
                raise exceptions.AuthenticationFailed(
                    f"token {row.name!r} was revoked at {row.revoked_at.isoformat()}")
            if row.expired:
                raise exceptions.AuthenticationFailed(
                    f"token {row.name!r} expired at {row.expiry.isoformat()}")
            if not row.user.is_active:
                raise exceptions.AuthenticationFailed("the token's user is inactive")
            if hasattr(row, "group_names"):
                groups_known(row.user, (g for g in row.group_names if g is not None))
            now = timezone.now()
            if row.last_used_at is None or now - row.last_used_at > _LAST_USED_EVERY:
                _last_used_record(row.pk, now)
            return row.user, row
        raise exceptions.AuthenticationFailed("Invalid token.")

    def authenticate_header(self, request: Any) -> str:
        return "Token"
