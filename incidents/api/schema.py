"""The OpenAPI schema's FleetWatch parts (drf-spectacular): the token scheme, the error answers
every operation can give, and the access each operation needs, in its description.

The error answers are documented here once rather than on each view, so a client generated
from the schema (and schemathesis, which checks every answer against it) knows that any call
may be refused (401, 403, 429), that a call naming an object may find none (404), and that a
call with a body or query parameters may be told what is wrong with them (400)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from rest_framework.permissions import SAFE_METHODS

from collectors.api.serializers import ErrorSerializer
from collectors.roles import ADMIN_ONLY, INGEST, OPERATE, READ

_ACCESS_TEXT = {
    READ: "read: any role (viewer, operator, admin); a token needs the `read` scope",
    OPERATE: "operate: operators and admins; a token needs the `operate` scope",
    INGEST: "ingest: node agents (their own node only), operators and admins; a token needs "
            "the `ingest` scope",
    ADMIN_ONLY: "admin: admins only; a token needs the `operate` scope",
}

_VALIDATION = {
    "description": "Bad input: the fields (or query parameters) and what is wrong with each",
    "content": {"application/json": {"schema": {
        "type": "object", "additionalProperties": {},
        "example": {"since": ["Enter a valid date/time."]}}}},
}


class TokenAuthScheme(OpenApiAuthenticationExtension):
    target_class = "incidents.api.auth.ScopedTokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema: AutoSchema) -> dict[str, Any]:
        return build_bearer_security_scheme_object(header_name="Authorization",
                                                   token_prefix="Token")


class FleetWatchSchema(AutoSchema):
    def _is_list_view(self, serializer: Any = None) -> bool:
        # A viewset whose "list" answers one object (GET /api/v1/agent/) says so: without
        # this the schema would describe an array.
        if getattr(self.view, "answers_one_object", False):
            return False
        return bool(super()._is_list_view(serializer))

    def access_needed(self) -> str:
        """What the operation needs, read from the view's ``access`` table as
        ``FleetWatchAccess`` reads it."""
        table: dict[str, str] = getattr(self.view, "access", {}) or {}
        action = getattr(self.view, "action", None)
        if action and action in table:
            return table[action]
        if self.method in table:
            return table[self.method]
        return READ if self.method in SAFE_METHODS else OPERATE

    def get_operation(self, path: str, path_regex: str, path_prefix: str, method: str,
                      registry: Any) -> dict[str, Any] | None:
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        # Here rather than in get_description, which @extend_schema(description=) replaces.
        access = f"**Access:** {_ACCESS_TEXT[self.access_needed()]}."
        text = operation.get("description", "")
        operation["description"] = f"{text}\n\n{access}" if text else access
        error = {"content": {"application/json": {
            "schema": self.resolve_serializer(ErrorSerializer, "response").ref}}}
        responses: dict[str, Any] = operation["responses"]
        # A call that changes something may carry a malformed body even where none is needed.
        has_input = self.method not in SAFE_METHODS or any(
            p.get("in") == "query" for p in operation.get("parameters", []))
        if has_input:
            responses.setdefault("400", _VALIDATION)
        responses.setdefault("401", {**error, "description": "No valid credentials (no "
                                     "token, or one unknown, expired or revoked)"})
        responses.setdefault("403", {**error, "description": "The role or the token's scopes "
                                     "do not allow this"})
        if "requestBody" in operation:
            responses.setdefault("415", {**error, "description": "The body is not JSON"})
        if "{" in path:
            responses.setdefault("404", {**error, "description": "No such object"})
        responses.setdefault("429", {**error, "description": "Too many calls: wait as "
                                     "Retry-After says"})
        return operation
