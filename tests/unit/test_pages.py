"""Pages, roles, CSRF, the read-only API and /healthz, through Django's test client."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.test import Client

from collectors import services as collectors
from collectors.sim.fleet import SimFleet
from incidents import diagnosing, lifecycle
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Remediation
from incidents.remediation import engine
from tests.conftest import steps_queued, token_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def incident(sim_fleet: SimFleet, settings: Any, django_capture_on_commit_callbacks: Any) -> Any:
    settings.FLEETWATCH_POLICY_MODE = "approve"
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    cluster = collectors.cluster_default()
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(cluster.pk, Diagnosis(
            root_cause="gpu_hardware", nodes=("gpu-003",), confidence=0.97,
            playbook="replace_node", explanation="XID 79 (GPU has fallen off the bus) on gpu-003",
            detected_at=datetime.now(UTC), jobs=("3001",)))
    return incident


def test_pages_need_a_login(client: Client) -> None:
    for url in ("/", "/incidents/", "/incidents/1/"):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_login_page_and_logging_in(client: Client, operator: Any) -> None:
    assert b'name="password"' in client.get("/login/").content
    response = client.post("/login/", {"username": "olivia", "password": "operator-pass-1"})
    assert response.status_code == 302 and response["Location"] == "/"


def test_dashboard_shows_counts_grid_and_open_incidents(client: Client, operator: Any,
                                                        incident: Any) -> None:
    client.force_login(operator)
    page = client.get("/").content.decode()
    assert "/static/vendor/plotly-cartesian-4.1.1.min.js" in page  # served locally, no CDN
    assert "cdn" not in page.lower()
    assert f"/incidents/{incident.pk}/" in page and "GPU hardware" in page
    assert "Inject" in page  # demo control for operators
    grid = client.get("/dashboard/gpu-grid.json").json()
    assert len(grid["z"]) == 16 and len(grid["z"][0]) == 8
    assert client.get("/static/vendor/plotly-cartesian-4.1.1.min.js").status_code == 200


def test_incident_page_shows_the_diagnosis_plan_and_controls(client: Client, operator: Any,
                                                             incident: Any) -> None:
    client.force_login(operator)
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert "XID 79 (GPU has fallen off the bus) on gpu-003" in page
    assert "Drain the Slurm node and cancel its jobs with SIGTERM" in page
    assert "Confirm: approve and run" in page
    assert "Diagnosis: GPU hardware" in page  # in the timeline
    chart = client.get(f"/incidents/{incident.pk}/chart.json").json()
    assert "gpu-003" in chart["series"]


def test_viewer_sees_no_controls_and_a_forged_post_is_forbidden(client: Client, viewer: Any,
                                                                incident: Any) -> None:
    client.force_login(viewer)
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert "Confirm: approve" not in page and "Inject" not in page
    rem = incident.remediations.get()
    for action in ("approve", "cancel", "start", "continue"):
        response = client.post(f"/incidents/{incident.pk}/{action}", {"remediation": rem.pk})
        assert response.status_code == 403
    assert client.post("/demo/inject", {"kind": "xid", "node": "gpu-001"}).status_code == 403
    rem.refresh_from_db()
    assert rem.status == Remediation.Status.AWAITING_APPROVAL


def test_posts_without_a_csrf_token_are_refused(operator: Any, incident: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    rem = incident.remediations.get()
    response = client.post(f"/incidents/{incident.pk}/approve", {"remediation": rem.pk})
    assert response.status_code == 403
    rem.refresh_from_db()
    assert rem.status == Remediation.Status.AWAITING_APPROVAL


def test_operator_approves_once_with_their_name_in_the_audit(
    client: Client, operator: Any, incident: Any, django_capture_on_commit_callbacks: Any
) -> None:
    client.force_login(operator)
    rem = incident.remediations.get()
    with django_capture_on_commit_callbacks() as queued:
        client.post(f"/incidents/{incident.pk}/approve", {"remediation": rem.pk})
        second = client.post(f"/incidents/{incident.pk}/approve", {"remediation": rem.pk},
                             HTTP_ACCEPT="application/json")
    assert second.status_code == 409 and "nothing to approve" in second.json()["error"]
    assert steps_queued(queued) == 1  # one first step queued, not two
    entry = AuditEntry.objects.get(verb="remediation.approved")
    assert entry.actor == "user:olivia"


def test_demo_inject_control_reaches_the_simulated_fleet(client: Client, operator: Any,
                                                         sim_fleet: SimFleet) -> None:
    client.force_login(operator)
    response = client.post("/demo/inject", {"kind": "xid", "node": "gpu-002", "gpu": "4",
                                            "code": "79"}, follow=True)
    assert "Injected XID 79 on gpu-002 GPU 4" in response.content.decode()
    assert sim_fleet.snapshot()["nodes"]["gpu-002"]["gpus"][4]["last_xid"] == 79
    bad = client.post("/demo/inject", {"kind": "xid", "node": "nope"}, follow=True)
    assert "Not injected: unknown node &#x27;nope&#x27;" in bad.content.decode()


def test_api_needs_a_token_and_is_read_only(client: Client, operator: Any, incident: Any) -> None:
    assert client.get("/api/v1/incidents/").status_code == 401
    token_key = token_for(operator)
    auth = {"HTTP_AUTHORIZATION": f"Token {token_key}"}
    body = client.get("/api/v1/incidents/", **auth).json()
    assert body["count"] == 1
    assert body["results"][0]["root_cause"] == "gpu_hardware"
    assert body["results"][0]["remediations"][0]["status"] == "awaiting_approval"
    nodes = client.get("/api/v1/nodes/?leaf_switch=leaf-b", **auth).json()
    assert nodes["count"] == 8 and all(n["leaf_switch"] == "leaf-b" for n in nodes["results"])
    assert client.post("/api/v1/incidents/", {}, **auth).status_code == 405
    assert client.get("/api/v1/incidents/", HTTP_AUTHORIZATION="Token wrong").status_code == 401


def test_healthz_reports_database_and_broker(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok", "broker": "ok"}


def test_an_incident_exports_as_a_replay_file_that_reaches_the_same_verdict(
    client: Client, viewer: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any
) -> None:
    from collectors.sim.faults import fault_inject
    from incidents.diagnosis.replay import check, diagnose_document

    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    fault_inject("xid", node="gpu-006", gpu=2, code=79)
    with django_capture_on_commit_callbacks():
        ids = collectors.collect_source("telemetry").signal_ids
        [incident] = diagnosing.diagnose_signals(ids)
    client.force_login(viewer)
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert f'href="/incidents/{incident.pk}/replay.json"' in page
    response = client.get(f"/incidents/{incident.pk}/replay.json")
    assert response.status_code == 200
    assert "attachment" in response["Content-Disposition"]
    doc = response.json()
    assert doc["format"] == "fleetwatch-replay/1"
    assert doc["expect"] == [{"root_cause": "gpu_hardware", "nodes": ["gpu-006"]}]
    assert {"source": "dcgm", "node": "gpu-006", "gpu": 2, "metric": "DCGM_FI_DEV_XID_ERRORS",
            "value": 79}.items() <= next(s for s in doc["signals"] if s["source"] == "dcgm").items()
    assert doc["topology"]["leaf-a"][0] == "gpu-001"
    # Replayed offline, the export reaches the verdict the live pipeline reached.
    assert check(doc, diagnose_document(doc))["ok"]
    token_key = token_for(viewer)
    api = client.get(f"/api/v1/incidents/{incident.pk}/replay/",
                     HTTP_AUTHORIZATION=f"Token {token_key}").json()
    assert api["expect"] == doc["expect"] and len(api["signals"]) == len(doc["signals"])


def test_chart_says_why_it_is_empty_when_prometheus_is_down(client: Client, operator: Any,
                                                            incident: Any, settings: Any) -> None:
    settings.FLEETWATCH_FLEET, settings.FLEETWATCH_STORE_GPU_SAMPLES = "real", False
    settings.FLEETWATCH_PROMETHEUS_URL = "http://127.0.0.1:9"  # nothing listens there
    client.force_login(operator)
    chart = client.get(f"/incidents/{incident.pk}/chart.json").json()
    assert chart["series"] == {} and chart["error"].startswith("telemetry unavailable")
    assert client.get(f"/incidents/{incident.pk}/").status_code == 200  # the page still works


def test_a_step_waiting_for_approval_says_so_and_what_approving_runs(
        client: Client, operator: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_STEP_MODES = {"reboot": "approve"}
    cluster = collectors.cluster_default()
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(cluster.pk, Diagnosis(
            "nvlink", ("gpu-005",), 0.95, "reboot_node", "XID 74 on gpu-005",
            datetime(2026, 12, 3, 10, 0, tzinfo=UTC)))
    rem = incident.remediations.get()
    reboot = rem.steps.get(kind="reboot")
    with django_capture_on_commit_callbacks():  # the steps before it are done; it is next
        rem.steps.filter(order__lt=reboot.order).update(status="succeeded")
        assert engine.step_run(reboot.pk) == "awaiting approval"
    client.force_login(operator)
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert "Waiting for approval:" in page and "needs a person&#x27;s approval" in page
    assert "This lets step 4 run now: <b>reboot the node</b> for <b>gpu-005</b>" in page
    assert "approve first</span>" in page  # the step's own mode is shown
