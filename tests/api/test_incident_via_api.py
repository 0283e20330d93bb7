"""A whole incident through the REST API alone, as an automation team would drive it: a node
agent pushes the kernel's XID line, a read token watches the incident appear, an operator's
token approves the remediation, the incident resolves, and its audit entries, which name the
token that approved, verify as an unbroken chain.

Real parts: a live HTTP server, a real Celery worker and beat on Redis, PostgreSQL; the
simulated fleet stands in for Slurm, Kubernetes and the provider (the real-parts version of
this loop is the drill, tests/integration/test_drill.py)."""

from __future__ import annotations

from typing import Any

import pytest
import requests
from django.utils import timezone

from collectors.roles import OPERATOR, VIEWER, user_with_role
from incidents.tokens import agent_token_create
from tests.conftest import Worker, token_for, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

XID79 = ("NVRM: Xid (PCI:0000:8a:00): 79, pid=2231, name=python, GPU has fallen off the bus.")


@pytest.fixture
def policy_mode() -> str:
    return "approve"  # every remediation waits for a person (here: a program) to approve


class Api:
    def __init__(self, base: str, key: str) -> None:
        self.base, self.session = base, requests.Session()
        self.session.headers["Authorization"] = f"Token {key}"

    def get(self, path: str, **params: Any) -> Any:
        r = self.session.get(f"{self.base}/api/v1/{path}", params=params, timeout=10)
        assert r.status_code == 200, (path, r.status_code, r.text[:500])
        return r.json()

    def post(self, path: str, body: Any = None) -> requests.Response:
        return self.session.post(f"{self.base}/api/v1/{path}", json=body, timeout=10)


def test_an_incident_from_push_to_resolved_through_the_api_alone(
        celery_worker_process: Worker, live_server: Any) -> None:
    base = live_server.url
    agent = Api(base, agent_token_create("gpu-003")[1])
    reader = Api(base, token_for(user_with_role("rita", VIEWER)[0], ("read",), name="grafana"))
    operator = Api(base, token_for(user_with_role("otto", OPERATOR)[0], ("read", "operate"),
                                   name="chatops-bot"))

    try:
        wait_for(lambda: reader.get("nodes/", name="gpu-003")["count"] == 1, 60,
                 "the first collection of the simulated fleet")
        # 1. The node agent pushes what the kernel printed.
        pushed = agent.post("signals/", {"signals": [
            {"at": timezone.now().isoformat(), "source": "kernel", "node": "gpu-003",
             "message": XID79}]})
        assert pushed.status_code == 201, pushed.text
        assert pushed.json() == {"stored": 1}

        # 2. A program with a read token sees the incident.
        def opened() -> dict[str, Any] | None:
            found = reader.get("incidents/", node="gpu-003")["results"]
            return found[0] if found else None

        incident = wait_for(opened, 60, "the incident for gpu-003")
        assert incident["root_cause"] == "gpu_hardware"
        assert incident["nodes"] == ["gpu-003"]
        # The read token may look but not act.
        refused = reader.post(f"incidents/{incident['id']}/acknowledge/")
        assert refused.status_code == 403 and "operate" in refused.json()["detail"]

        # 3. The operator's program approves each time the remediation waits for it.
        approvals = 0

        def settled() -> dict[str, Any] | None:
            nonlocal approvals
            for rem in reader.get("remediations/", incident=incident["id"])["results"]:
                if rem["status"] == "awaiting_approval":
                    answer = operator.post(f"remediations/{rem['id']}/approve/")
                    assert answer.status_code in (200, 409), answer.text  # 409: raced a step
                    approvals += answer.status_code == 200
            current = reader.get(f"incidents/{incident['id']}/")
            return current if current["status"] == "resolved" else None

        resolved = wait_for(settled, 120, "the incident to resolve", interval=0.5)
    except AssertionError:
        print(celery_worker_process.output())
        raise
    assert approvals >= 1
    assert resolved["phases"]["total"] > 0 and "detect" in resolved["phases"]
    rem = reader.get("remediations/", incident=incident["id"])["results"][0]
    assert rem["status"] == "succeeded"
    assert rem["approved_by"] == "token:chatops-bot"

    # Approving a finished remediation: 409, with what it is now.
    again = operator.post(f"remediations/{rem['id']}/approve/")
    assert again.status_code == 409 and again.json()["status"] == "succeeded"

    # 4. The audit trail through the API: every page of the incident's entries.
    entries: list[dict[str, Any]] = []
    page = reader.get("audit/", incident=incident["id"])
    while True:
        entries += page["results"]
        if not page.get("next"):
            break
        page = reader.session.get(page["next"], timeout=10).json()
    verbs = [e["verb"] for e in entries]
    assert verbs[0] == "incident.opened" and verbs[-1] == "incident.resolved"
    approved = [e for e in entries if e["verb"] == "remediation.approved"]
    assert approved and all(e["actor"] == "token:chatops-bot" for e in approved)
    # The outside actions, each exactly once.
    calls = [e["verb"] for e in entries if e["call"]]
    assert calls.count("slurm.drain") == 1 and calls.count("k8s.cordon") == 1
    assert calls.count("provider.replace") == 1
    # The API calls themselves are audited too, naming the token, never its key.
    api_calls = reader.get("audit/", verb="api.call", actor="token:chatops-bot")["results"]
    assert any(e["target"] == f"POST /api/v1/remediations/{rem['id']}/approve/"
               and e["result"] == "200" for e in api_calls)
    assert any(e["result"] == "409" for e in api_calls)
    assert reader.get("audit/", verb="api.call", actor="token:grafana")["results"][0][
        "result"] == "403"

    verify = reader.get("audit/verify/")
    assert verify["ok"] is True and verify["checked"] >= len(entries)
