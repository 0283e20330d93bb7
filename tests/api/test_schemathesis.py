"""Schemathesis against the generated OpenAPI schema, on a live server with an operator's
token that has every scope: every operation, reads and actions alike, with generated input
(valid and invalid). No answer may be a server error, or have a status code or a body the
schema does not describe. The admin-only operations (tokens, changing webhooks) are called
with an admin's token, so that they too get past the permission check.

Kept quick (a few examples per operation): it runs in every ``make test``."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from fleetwatch.roles import ADMIN, OPERATOR, user_with_role
from tests.api.test_permissions import NEEDS
from tests.api.world import build_world
from tests.conftest import token_for

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture
def fuzz_world(live_server: Any, settings: Any) -> dict[str, Any]:
    """A fleet with one of everything, and the operator's token (all scopes). Built afresh for
    each operation (live_server flushes the database after each test), so one operation's
    actions never decide what the next one finds."""
    world = build_world(settings)
    operator = token_for(user_with_role("fuzz-operator", OPERATOR)[0], name="schemathesis")
    admin = token_for(user_with_role("fuzz-admin", ADMIN)[0], name="schemathesis-admin")
    return {"world": world, "base_url": live_server.url,
            "operator": {"Authorization": f"Token {operator}"},
            "admin": {"Authorization": f"Token {admin}"}}


# Generated at import (schemathesis's lazy fixture loader does not work with pytest 9); the
# schema the server serves is this same document (test_schema.py).
schema = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))
# Not every method on every path: DRF's 405 for those is tested enough elsewhere, and each
# costs a request per operation.
schema.config.phases.coverage.unexpected_methods = set()


@schema.parametrize()
@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_api_answers_as_its_schema_says(case: Any, fuzz_world: dict[str, Any]) -> None:
    who = "admin" if NEEDS[case.method.upper(), case.operation.path] == "admin" else "operator"
    call = {"base_url": fuzz_world["base_url"], "headers": fuzz_world[who], "checks": CHECKS,
            "timeout": 20}
    case.call_and_validate(**call)
    # Generated ids seldom name a real object, so each example is also sent to the world's
    # objects: the actions then really act (approve, cancel, resolve, revoke, retry), with
    # generated bodies and query strings, and what follows meets the state they left.
    real = fuzz_world["world"].path_parameters(case.operation.path)
    if real and real != case.path_parameters:
        case.path_parameters = {**(case.path_parameters or {}), **real}
        case.call_and_validate(**call)
