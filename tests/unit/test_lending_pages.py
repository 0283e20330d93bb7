"""The capacity page, its chart and a loan's page; the same through the API: what a person
and a program see and may do (lend, approve, decline, return, retry), and the answers when an
action does not fit (409 with why)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from collectors import services as collectors
from collectors.roles import OPERATOR, VIEWER, user_with_role
from collectors.sim.fleet import SimFleet
from incidents.lending import services
from incidents.models import AuditEntry, Loan
from tests.conftest import token_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(settings: Any, tmp_path: Any) -> SimFleet:
    settings.FLEETWATCH_SIM_STATE = tmp_path / "sim-fleet.json"
    settings.FLEETWATCH_SIM_SPEED = 400.0
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    fleet = SimFleet(settings.FLEETWATCH_SIM_STATE, 400.0)
    fleet.seed(nodes=20, spares=0)
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    return fleet


def page_client(role: str) -> Client:
    client = Client()
    client.force_login(user_with_role(f"{role}-cap", role)[0])
    return client


def test_the_capacity_page_shows_use_demand_and_what_could_go(fleet: SimFleet) -> None:
    body = page_client(VIEWER).get("/capacity/").content.decode()
    assert 'data-testid="capacity-now"' in body and "Slurm training: allocated" in body
    assert 'data-testid="pool-gpu"' in body
    assert '<td data-testid="gpus-training_allocated">128</td>' in body
    assert 'data-testid="pending-jobs">0<' in body
    assert 'data-testid="lendable-gpu-017"' in body
    # A viewer sees no buttons; an operator's confirmation says what runs.
    assert "Confirm: lend gpu-017" not in body
    body = page_client(OPERATOR).get("/capacity/").content.decode()
    assert "Confirm: lend gpu-017" in body
    assert "drain it in Slurm with FleetWatch&#x27;s reason" in body
    assert "evict its inference pods through the Eviction API" in body
    chart = page_client(VIEWER).get("/capacity/chart.json?range=week").json()
    assert chart["range"] == "week" and "Slurm training: idle" in chart["gpus"]
    assert page_client(VIEWER).get("/capacity/chart.json?range=year").status_code == 400
    assert page_client(VIEWER).get("/capacity/?cluster=nope").status_code == 404


def test_one_click_lend_from_the_page(fleet: SimFleet) -> None:
    viewer = page_client(VIEWER)
    assert viewer.post("/capacity/lend", {"node": "gpu-017"}).status_code == 403
    operator = page_client(OPERATOR)
    answer = operator.post("/capacity/lend", {"node": "gpu-017"}, follow=True)
    assert "Lending gpu-017 to inference" in answer.content.decode()
    loan = Loan.objects.get(node="gpu-017")
    assert loan.status == Loan.Status.LENDING and loan.requested_by == f"user:{OPERATOR}-cap"
    refused = operator.post("/capacity/lend", {"node": "gpu-999"}, follow=True)
    assert "Not lent: gpu-999 is not a node of cluster" in refused.content.decode()
    assert operator.post("/capacity/lend", {"node": "gpu-017"},
                         HTTP_ACCEPT="application/json").status_code == 409
    detail = viewer.get(f"/capacity/loans/{loan.pk}/").content.decode()
    assert 'data-testid="loan-steps"' in detail and "loan.started" in detail
    assert operator.post(f"/capacity/loans/{loan.pk}/bogus").status_code == 404
    answer = operator.post(f"/capacity/loans/{loan.pk}/return", follow=True)
    assert "Returning to training" in answer.content.decode()
    assert Loan.objects.get(pk=loan.pk).status == Loan.Status.RETURNING


def test_the_api_lends_returns_and_says_why_not(fleet: SimFleet) -> None:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user_with_role('otto', OPERATOR)[0])}")
    now = api.get("/api/v1/capacity/").json()
    assert now["totals"]["training_allocated"] == 128
    assert [n["name"] for n in now["lendable"]] == ["gpu-017", "gpu-018", "gpu-019", "gpu-020"]
    assert now["demand"]["known"] is True and now["pools"][0]["floor"] == 10
    made = api.post("/api/v1/loans/", {"node": "gpu-018", "reason": "batch inference"},
                    format="json")
    assert made.status_code == 201 and made.json()["status"] == "lending"
    loan_id = made.json()["id"]
    again = api.post("/api/v1/loans/", {"node": "gpu-018"}, format="json")
    assert again.status_code == 409 and "already in loan" in again.json()["detail"]
    assert api.post("/api/v1/loans/", {"node": "gpu-999"}, format="json").status_code == 409
    assert api.post("/api/v1/loans/", {"node": "gpu-018", "cluster": "nope"},
                    format="json").status_code == 400
    assert api.post("/api/v1/loans/", {}, format="json").status_code == 400
    services.loan_run(loan_id)
    for _ in range(10):
        services.loan_run(loan_id)
    assert api.get(f"/api/v1/loans/{loan_id}/").json()["status"] == "lent"
    conflict = api.post(f"/api/v1/loans/{loan_id}/approve/")
    assert conflict.status_code == 409 and conflict.json()["status"] == "lent"
    back = api.post(f"/api/v1/loans/{loan_id}/return/", {"reason": "the sweep starts"},
                    format="json")
    assert back.status_code == 200 and back.json()["status"] == "returning"
    assert AuditEntry.objects.filter(data__loan=loan_id, verb="loan.returning",
                                     actor="token:otto-1").count() == 1
    history = api.get("/api/v1/capacity/history/?range=day")
    assert history.status_code == 200 and set(history.json()) == {"range", "gpus", "demand",
                                                                  "nodes"}
    assert api.get("/api/v1/capacity/history/?range=year").status_code == 400
    assert api.get("/api/v1/loans/?status=returning").json()["count"] == 1
    assert api.get("/api/v1/loans/424242/").status_code == 404
