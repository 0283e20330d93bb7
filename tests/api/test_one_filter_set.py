"""One filter set per model serves its page and its API endpoint: the same class, so a
parameter either works on both or on neither, and a bad value is a 400 on both."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from collectors import filters as fleet_filters
from collectors import views as fleet_pages
from collectors.api import views as fleet_api
from collectors.models import Node
from collectors.roles import ADMIN, OPERATOR, user_with_role
from incidents import filters as incident_filters
from incidents import views as incident_pages
from incidents.api import views as incident_api
from incidents.audit import audit_record
from tests.api.world import NODE, OTHER_NODE, World, build_world
from tests.conftest import token_for


@pytest.fixture
def world(db: None, settings: Any) -> World:
    return build_world(settings)


@pytest.fixture
def api(world: World) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user_with_role('ada-f', ADMIN)[0])}")
    return client


@pytest.fixture
def page(world: World) -> Client:
    client = Client()
    client.force_login(user_with_role("olga-f", OPERATOR)[0])
    return client


def test_each_list_has_one_filter_set_for_its_page_and_its_endpoint() -> None:
    assert fleet_api.NodeViewSet.filterset_class is fleet_pages.NodeFilter is fleet_filters.NodeFilter
    assert fleet_api.JobViewSet.filterset_class is fleet_pages.JobFilter is fleet_filters.JobFilter
    assert incident_api.IncidentViewSet.filterset_class is incident_pages.IncidentFilter \
        is incident_filters.IncidentFilter
    assert incident_api.AuditEntryViewSet.filterset_class is incident_pages.AuditFilter \
        is incident_filters.AuditFilter


def _nodes(html: str) -> list[str]:
    return re.findall(r'data-testid="node-row-([^"]+)"', html)


def test_the_pages_parameters_work_on_the_api_and_the_apis_on_the_pages(
        api: APIClient, page: Client, world: World) -> None:
    Node.objects.filter(name=OTHER_NODE).update(slurm_flags=["IDLE", "DRAIN"], in_service=False)
    names = [n["name"] for n in api.get("/api/v1/nodes/?q=002&drained=yes").json()["results"]]
    assert names == [OTHER_NODE]
    assert api.get("/api/v1/nodes/?drained=no&in_service=yes").json()["count"] == 1
    assert _nodes(page.get(f"/nodes/?name={NODE}").content.decode()) == [NODE]
    assert _nodes(page.get("/nodes/?in_service=false").content.decode()) == [OTHER_NODE]
    assert api.get("/api/v1/jobs/?q=train").json()["count"] == 1
    assert api.get("/api/v1/incidents/?range=24h&open=yes").json()["count"] == 2
    assert page.get(f"/incidents/?job={world.job.slurm_id}").status_code == 200


@pytest.mark.parametrize("query", ["in_service=maybe", "drained=2", "health=sick"])
def test_a_bad_value_is_a_400_on_both(api: APIClient, page: Client, query: str) -> None:
    assert api.get(f"/api/v1/nodes/?{query}").status_code == 400
    assert page.get(f"/nodes/?{query}").status_code == 400


def test_an_actor_is_matched_whole_or_by_its_name(api: APIClient, world: World) -> None:
    for actor in ("token:ci", "token:ci-2", "user:olivia"):
        audit_record("test.actor", actor, actor=actor)

    def actors(query: str) -> set[str]:
        return {e["actor"] for e in api.get(f"/api/v1/audit/?verb=test.actor&{query}")
                .json()["results"]}

    assert actors("actor=token:ci") == {"token:ci"}
    assert actors("actor=olivia") == {"user:olivia"}
    assert actors("actor=ci") == {"token:ci", "token:ci-2"}
    assert actors("failed=yes") == set() and len(actors("ok=true")) == 3
