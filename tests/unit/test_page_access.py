"""The pages follow the API's role rules: every page, as the URL resolver lists them (so a new
page cannot be forgotten), sends anonymous visitors to the login page, answers 403 to a
signed-in user without a role (and to a node agent's user), and opens for a viewer. Actions
(POST) want an operator, as in the API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from collectors.roles import OPERATOR, VIEWER, agent_user, user_with_role
from tests.api.world import JOB, NODE, World, build_world

# Views anyone may open; the API and the admin site check their callers themselves.
PUBLIC = {"login", "logout", "healthz", "metrics", "api-schema", "api-docs", "api-redoc"}


def _patterns(resolvers: list[Any], prefix: str = "", namespace: str = "",
              ) -> Iterator[tuple[str, URLPattern, str]]:
    for entry in resolvers:
        if isinstance(entry, URLResolver):
            yield from _patterns(entry.url_patterns, prefix + str(entry.pattern),
                                 entry.namespace or namespace)
        else:
            yield prefix + str(entry.pattern), entry, namespace


def page_patterns() -> list[tuple[str, str]]:
    """(route, name) of every page: all routes but the API's, the admin's and PUBLIC."""
    found = []
    for route, pattern, namespace in _patterns(get_resolver().url_patterns):
        if namespace in ("api", "admin") or pattern.name in PUBLIC:
            continue
        found.append((route, pattern.name or route))
    return found


def _url(route: str, world: World) -> str:
    pk = world.drill.pk if route.startswith("drills/") else world.incident.pk
    values = {"<int:pk>": str(pk), "<str:name>": NODE, "<str:slurm_id>": JOB,
              "<page_action:action>": "approve", "<int:loan>": str(world.loan.pk),
              "<loan_action:action>": "approve"}
    for key, value in values.items():
        route = route.replace(key, value)
    assert "<" not in route and "(" not in route, f"no example value for {route}: add one"
    return "/" + route


@pytest.fixture
def world(db: None, settings: Any) -> World:
    return build_world(settings)


def test_the_walk_finds_every_page_family() -> None:
    names = {name for _, name in page_patterns()}
    assert {"dashboard", "incident-list", "incident-detail", "incident-replay",
            "incident-postmortem", "audit-list", "node-list", "job-list", "source-list",
            "policy", "incident-action", "inject-fault", "drill-list", "drill-detail",
            "drill-run", "capacity", "loan-detail", "loan-action"} <= names


@pytest.mark.parametrize(("route", "name"), page_patterns())
def test_every_page_needs_a_role(route: str, name: str, world: World) -> None:
    url = _url(route, world)
    anonymous = Client().get(url)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/?next="), \
        (url, anonymous.status_code)

    nobody = Client()
    nobody.force_login(User.objects.create_user("nora", password="no-role-pass-1"))
    for method in ("get", "post"):
        response = getattr(nobody, method)(url)
        assert response.status_code == 403, (method, url, response.status_code)
    assert b"no role" in nobody.get(url).content

    agent = Client()
    agent.force_login(agent_user(NODE))
    assert agent.get(url).status_code == 403, url

    viewer = Client()
    viewer.force_login(user_with_role("victor-pages", VIEWER)[0])
    got = viewer.get(url)
    # Open to a viewer (405: the route only takes POST; the view then wants an operator).
    assert got.status_code in (200, 302, 405), (url, got.status_code)
    assert viewer.post(url).status_code == 403, url


def test_a_viewer_cannot_act_and_an_operator_can(world: World) -> None:
    url = f"/incidents/{world.incident.pk}/approve"
    viewer = Client()
    viewer.force_login(user_with_role("victor-act", VIEWER)[0])
    assert viewer.post(url, {"remediation": world.remediation.pk}).status_code == 403
    operator = Client()
    operator.force_login(user_with_role("olga-act", OPERATOR)[0])
    response = operator.post(url, {"remediation": world.remediation.pk})
    assert response.status_code == 302
    world.remediation.refresh_from_db()
    assert world.remediation.status != "awaiting_approval"
