"""API token authentication: django-rest-knox's hashed tokens, plus our revocation and a clear
answer for a token that expired or was revoked (knox would delete an expired token; we keep
the row so the token list still says who had it and when it stopped working)."""

from __future__ import annotations

import binascii
import functools
from collections.abc import Sequence
from datetime import datetime, timedelta
from hmac import compare_digest
from typing import Any, cast

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.db import connection, transaction
from django.db.models import Field, Model
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
    if connection.vendor == "postgresql":
        # One statement, its own transaction, the setting local to it: one round trip where
        # BEGIN, SET LOCAL, UPDATE and COMMIT were four.
        with connection.cursor() as cursor:
            cursor.execute(
                "WITH quiet AS (SELECT set_config('synchronous_commit', 'off', true)) "
                f'UPDATE "{ApiToken._meta.db_table}" SET "last_used_at" = %s FROM quiet '
                f'WHERE "{ApiToken._meta.pk.column}" = %s', [now, pk])
        return
    with transaction.atomic():
        commit_without_flush()
        ApiToken.objects.filter(pk=pk).update(last_used_at=now)


@functools.cache
def _token_sql() -> tuple[str, list[Field[Any, Any]], list[Field[Any, Any]]]:
    """The statement of ``_token_rows`` and the fields it reads, in its columns' order
    (written once a process)."""
    user_model = get_user_model()
    token_fields = list(ApiToken._meta.concrete_fields)
    user_fields = list(user_model._meta.concrete_fields)
    through = cast("type[Model]", user_model._meta.get_field("groups").remote_field.through)
    member = through._meta.db_table
    columns = ", ".join([*(f't."{f.column}"' for f in token_fields),
                         *(f'u."{f.column}"' for f in user_fields)])
    sql = (f'SELECT {columns}, ARRAY(SELECT g."name" FROM "{member}" m '
           f'JOIN "{Group._meta.db_table}" g ON g."id" = m."group_id" '
           'WHERE m."user_id" = u."id") '
           f'FROM "{ApiToken._meta.db_table}" t '
           f'JOIN "{user_model._meta.db_table}" u ON u."id" = t."user_id" '
           'WHERE t."token_key" = %s')
    return sql, token_fields, user_fields


def _loaded(model: type[Model], fields: list[Field[Any, Any]], values: Sequence[Any]) -> Any:
    """An instance of ``model`` from a row's raw values, converted as the ORM would."""
    converted = []
    for f, value in zip(fields, values, strict=True):
        for convert in f.get_db_converters(connection):
            value = convert(value, f, connection)
        converted.append(value)
    return model.from_db(connection.alias, [f.attname for f in fields], converted)


def _token_rows(key: str) -> list[ApiToken]:
    """The tokens with this key (its first characters, as knox stores it), each with its
    user and the user's group names (its role), in one statement written once (PostgreSQL).
    Every API request reads this and a push makes few statements: the ORM compiled it anew
    for each request, which took as long as running it."""
    sql, token_fields, user_fields = _token_sql()
    rows = []
    with connection.cursor() as cursor:
        cursor.execute(sql, [key])
        for values in cursor.fetchall():
            row = _loaded(ApiToken, token_fields, values[:len(token_fields)])
            row.user = _loaded(get_user_model(), user_fields, values[len(token_fields):-1])
            row.group_names = [g for g in values[-1] if g is not None]
            rows.append(row)
    return rows


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
        key = text[:CONSTANTS.TOKEN_KEY_LENGTH]
        rows = (_token_rows(key) if connection.vendor == "postgresql" else
                ApiToken.objects.filter(token_key=key).select_related("user"))
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
                groups_known(row.user, row.group_names)
            now = timezone.now()
            if row.last_used_at is None or now - row.last_used_at > _LAST_USED_EVERY:
                _last_used_record(row.pk, now)
            return row.user, row
        raise exceptions.AuthenticationFailed("Invalid token.")

    def authenticate_header(self, request: Any) -> str:
        return "Token"
