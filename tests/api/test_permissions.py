"""The permission matrix: every API operation, as the OpenAPI schema lists them, against every
kind of caller: anonymous, a browser session in each role, a token of each role with each
scope, and a node agent's token.

The table below says what each operation needs. A new endpoint without a row fails
``test_every_operation_has_a_row``, so nobody adds one without deciding who may call it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from collectors.roles import ADMIN, OPERATOR, VIEWER, user_with_role
from incidents.tokens import agent_token_create
from tests.api.world import NODE, World, build_world, signal_body
from tests.conftest import token_for

READ, OPERATE, INGEST, ADMIN_ONLY = "read", "operate", "ingest", "admin"

NEEDS: dict[tuple[str, str], str] = {
    ("GET", "/api/v1/audit/"): READ,
    ("GET", "/api/v1/audit/{id}/"): READ,
    ("GET", "/api/v1/audit/verify/"): READ,
    ("GET", "/api/v1/drills/"): READ,
    ("GET", "/api/v1/drills/{id}/"): READ,
    ("POST", "/api/v1/drills/"): OPERATE,
    ("GET", "/api/v1/clusters/"): READ,
    ("GET", "/api/v1/clusters/{name}/"): READ,
    ("GET", "/api/v1/gpus/"): READ,
    ("GET", "/api/v1/gpus/{id}/"): READ,
    ("GET", "/api/v1/incidents/"): READ,
    ("GET", "/api/v1/incidents/{id}/"): READ,
    ("GET", "/api/v1/incidents/{id}/replay/"): READ,
    ("GET", "/api/v1/incidents/{id}/timeline/"): READ,
    ("POST", "/api/v1/incidents/{id}/acknowledge/"): OPERATE,
    ("POST", "/api/v1/incidents/{id}/assign/"): OPERATE,
    ("POST", "/api/v1/incidents/{id}/notes/"): OPERATE,
    ("POST", "/api/v1/incidents/{id}/severity/"): OPERATE,
    ("POST", "/api/v1/incidents/{id}/approve/"): OPERATE,
    ("POST", "/api/v1/incidents/{id}/cancel/"): OPERATE,
    ("POST", "/api/v1/incidents/{id}/remediate/"): OPERATE,
    ("POST", "/api/v1/incidents/{id}/resolve/"): OPERATE,
    ("GET", "/api/v1/jobs/"): READ,
    ("GET", "/api/v1/jobs/{slurm_id}/"): READ,
    ("GET", "/api/v1/jobs/{slurm_id}/why/"): READ,
    ("GET", "/api/v1/nodes/"): READ,
    ("GET", "/api/v1/nodes/{name}/"): READ,
    ("GET", "/api/v1/policy/"): READ,
    ("GET", "/api/v1/remediations/"): READ,
    ("GET", "/api/v1/remediations/{id}/"): READ,
    ("POST", "/api/v1/remediations/{id}/approve/"): OPERATE,
    ("POST", "/api/v1/remediations/{id}/cancel/"): OPERATE,
    ("POST", "/api/v1/remediations/{id}/continue/"): OPERATE,
    ("POST", "/api/v1/remediations/{id}/retry/"): OPERATE,
    ("GET", "/api/v1/signals/"): READ,
    ("POST", "/api/v1/signals/"): INGEST,
    ("GET", "/api/v1/sources/"): READ,
    ("GET", "/api/v1/agent/"): INGEST,
    ("POST", "/api/v1/prometheus/write/"): INGEST,
    ("GET", "/api/v1/steps/"): READ,
    ("GET", "/api/v1/steps/{id}/"): READ,
    ("POST", "/api/v1/steps/{id}/retry/"): OPERATE,
    ("GET", "/api/v1/tokens/"): ADMIN_ONLY,
    ("POST", "/api/v1/tokens/"): ADMIN_ONLY,
    ("GET", "/api/v1/tokens/{name}/"): ADMIN_ONLY,
    ("POST", "/api/v1/tokens/{name}/revoke/"): ADMIN_ONLY,
    ("GET", "/api/v1/webhook-deliveries/"): READ,
    ("GET", "/api/v1/webhook-deliveries/{id}/"): READ,
    ("POST", "/api/v1/webhook-deliveries/{id}/redeliver/"): ADMIN_ONLY,
    ("GET", "/api/v1/webhooks/"): READ,
    ("POST", "/api/v1/webhooks/"): ADMIN_ONLY,
    ("GET", "/api/v1/webhooks/{id}/"): READ,
    ("PUT", "/api/v1/webhooks/{id}/"): ADMIN_ONLY,
    ("PATCH", "/api/v1/webhooks/{id}/"): ADMIN_ONLY,
    ("DELETE", "/api/v1/webhooks/{id}/"): ADMIN_ONLY,
    ("POST", "/api/v1/webhooks/{id}/test/"): ADMIN_ONLY,
    ("GET", "/api/v1/capacity/"): READ,
    ("GET", "/api/v1/capacity/history/"): READ,
    ("GET", "/api/v1/loans/"): READ,
    ("POST", "/api/v1/loans/"): OPERATE,
    ("GET", "/api/v1/loans/{id}/"): READ,
    ("POST", "/api/v1/loans/{id}/approve/"): OPERATE,
    ("POST", "/api/v1/loans/{id}/decline/"): OPERATE,
    ("POST", "/api/v1/loans/{id}/return/"): OPERATE,
    ("POST", "/api/v1/loans/{id}/retry/"): OPERATE,
}

# Who may do what, by role (the issue: the UI's roles on every endpoint), and which token
# scope each need takes (admin work takes "operate": there is no admin scope).
ROLE_MAY = {READ: {VIEWER, OPERATOR, ADMIN}, OPERATE: {OPERATOR, ADMIN},
            INGEST: {"agent", OPERATOR, ADMIN}, ADMIN_ONLY: {ADMIN}}
SCOPE_FOR = {READ: "read", OPERATE: "operate", INGEST: "ingest", ADMIN_ONLY: "operate"}
ALL_SCOPES = ("read", "operate", "ingest")


@dataclass(frozen=True)
class Caller:
    name: str
    role: str | None  # None: anonymous
    session: bool = False
    scopes: tuple[str, ...] = ()

    def expect(self, need: str) -> str:
        if self.role is None:
            return "401"
        if self.role not in ROLE_MAY[need]:
            return "403"
        if not self.session and SCOPE_FOR[need] not in self.scopes:
            return "403"
        return "allowed"


CALLERS = [
    Caller("anonymous", None),
    *(Caller(f"session-{role}", role, session=True) for role in (VIEWER, OPERATOR, ADMIN)),
    *(Caller(f"token-{role}-{'+'.join(scopes)}", role, scopes=scopes)
      for role in (VIEWER, OPERATOR, ADMIN)
      for scopes in (("read",), ("operate",), ("ingest",), ALL_SCOPES)),
    Caller("agent-token", "agent", scopes=("ingest",)),
]


def schema_operations() -> set[tuple[str, str]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return {(method.upper(), path) for path, item in schema["paths"].items()
            for method in item if method in ("get", "post", "put", "patch", "delete")}


def test_every_operation_has_a_row() -> None:
    operations = schema_operations()
    assert operations - NEEDS.keys() == set(), "operations without a row in NEEDS"
    assert NEEDS.keys() - operations == set(), "rows for operations that no longer exist"


def _body(method: str, path: str, world: World) -> dict[str, Any] | None:
    if (method, path) == ("POST", "/api/v1/signals/"):
        return signal_body(NODE)  # the agent's own node: allowed callers store it
    if method in ("POST", "PUT", "PATCH"):
        return {}  # allowed callers get 400, 409 or 200: the point is they got past the gate
    return None


def _client(caller: Caller) -> APIClient:
    client = APIClient()
    if caller.role is None:
        return client
    if caller.role == "agent":
        key = agent_token_create(NODE)[1]
    else:
        user = user_with_role(f"{caller.role}-user", caller.role)[0]
        if caller.session:
            client.force_login(user)  # CSRF is not enforced here: see the test below
            return client
        key = token_for(user, caller.scopes)
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def _outcome(code: int) -> str:
    if code >= 500:
        return f"server error {code}"  # never "allowed": a crash is not a permission
    return str(code) if code in (401, 403) else "allowed"


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c.name)
def test_permission_matrix(caller: Caller, db: None, settings: Any) -> None:
    world = build_world(settings)
    client = _client(caller)
    wrong = []
    # Deletes last, so the objects the other calls address are still there for them.
    for method, path in sorted(NEEDS, key=lambda op: (op[0] == "DELETE", op[1], op[0])):
        need = NEEDS[method, path]
        url = world.path(path)
        response = client.generic(method, url, data=_body(method, path, world), format="json") \
            if method != "GET" else client.get(url)
        got, expected = _outcome(response.status_code), caller.expect(need)
        if got != expected:
            wrong.append(f"{method} {url} (needs {need}): expected {expected}, got "
                         f"{response.status_code} {response.content[:200]!r}")
    assert wrong == [], "\n".join(wrong)


def test_agent_token_pushes_only_for_its_own_node(db: None, settings: Any) -> None:
    build_world(settings)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {agent_token_create(NODE)[1]}")
    assert client.post("/api/v1/signals/", signal_body(NODE), format="json").status_code == 201
    other = client.post("/api/v1/signals/", signal_body("gpu-002"), format="json")
    assert other.status_code == 403 and "only push signals for gpu-001" in other.json()["detail"]


def test_a_session_post_needs_the_csrf_token(db: None, settings: Any) -> None:
    world = build_world(settings)
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(user_with_role("olga", OPERATOR)[0])
    url = f"/api/v1/incidents/{world.incident.pk}/acknowledge/"
    refused = client.post(url, format="json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    world.incident.refresh_from_db()
    assert world.incident.acknowledged_by == ""
    # With the token the page gives out (cookie and header), the same call goes through.
    client.get("/login/")
    csrf = client.cookies["csrftoken"].value
    accepted = client.post(url, format="json", HTTP_X_CSRFTOKEN=csrf)
    assert accepted.status_code == 200 and accepted.json()["acknowledged_by"] == "user:olga"
    # A token needs no CSRF token: it is not sent by a browser on its own.
    token_client = APIClient(enforce_csrf_checks=True)
    token_client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user_with_role('otto', OPERATOR)[0])}")
    again = token_client.post(url, format="json")
    assert again.status_code == 409  # past the gate; already acknowledged
