"""Who may call what: the caller's role (viewer, operator, admin, or a node agent) and, for a
token, its scopes. Both must allow the call.

Each view says what its calls need in ``access``: a map from a viewset action ("list",
"approve") or an HTTP method to one of READ, OPERATE, INGEST or ADMIN. Unlisted: reading needs
READ, anything else OPERATE.

- READ: any person with a role; a token needs the ``read`` scope.
- OPERATE: operators and admins; a token needs ``operate``.
- INGEST: node agents (for their own node, checked by the ingest service) and operators; a
  token needs ``ingest``.
- ADMIN: admins only; a token needs ``operate`` (there is no admin scope: an admin's token
  with ``operate`` is as strong as the admin).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from collectors.roles import ADMIN_ONLY, INGEST, OPERATE, READ, role_allows, role_of

_SCOPE_FOR = {READ: "read", OPERATE: "operate", INGEST: "ingest", ADMIN_ONLY: "operate"}
# What a view may need in its ``access`` table, for all of one viewset's reads.
READ_ONLY = {"list": READ, "retrieve": READ}


@runtime_checkable
class ScopedToken(Protocol):
    """What the API reads of an API token (the incidents app's ``ApiToken``, which its token
    authentication sets as ``request.auth``; a browser session sets none): its key's digest
    (``pk``), its name and its scopes."""

    pk: Any
    name: str
    scopes: list[str]


def token_of(request: Request) -> ScopedToken | None:
    """The token the call came with, or None (a browser session, or no one)."""
    auth = request.auth
    return auth if isinstance(auth, ScopedToken) else None


def access_needed(request: Request, view: Any) -> str:
    table: dict[str, str] = getattr(view, "access", {}) or {}
    action = getattr(view, "action", None)
    if action and action in table:
        return table[action]
    if request.method in table:
        return table[str(request.method)]
    return READ if request.method in SAFE_METHODS else OPERATE


class FleetWatchAccess(BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False  # DRF answers 401 with the Token challenge
        need = access_needed(request, view)
        role = role_of(request.user)
        if not role_allows(role, need):
            raise PermissionDenied(
                f"this needs the {'admin' if need == ADMIN_ONLY else need} permission, and "
                f"{'you have no role' if role is None else f'your role is {role}'}")
        token = token_of(request)
        if token is not None and _SCOPE_FOR[need] not in (token.scopes or []):
            raise PermissionDenied(
                f"token {token.name!r} lacks the {_SCOPE_FOR[need]!r} scope "
                f"(it has {', '.join(token.scopes or []) or 'none'})")
        return True
