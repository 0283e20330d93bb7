"""A scheduled fire drill end to end: a real `celery worker` with its beat on real PostgreSQL
and Redis, the simulated fleet standing in for Slurm, Kubernetes, DCGM and the provider. The
beat starts the drill on its schedule; the drill checks its canary, injects a synthetic XID 79
through the ingest service, the worker diagnoses it, opens the drill's incident and runs the
playbook as a rehearsal (every outside call "would call") up to the provider; the drill times
each phase and passes. Its report is in the API, and the canary and its jobs are untouched.

(`tests/drill/` is something else: `make drill`, the test harness's own failure drill on real
Slurm. This is FleetWatch's in-product drill, README "Fire drills".)"""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from collectors.models import Job, Node
from incidents.models import AuditEntry, Drill, Incident
from tests.conftest import Worker, token_for, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

CANARY = "gpu-016"


@pytest.fixture
def worker_env() -> dict[str, str]:
    # A drill every 20 s: the first one 20 s after the beat starts, once the fleet is read.
    return {"FLEETWATCH_DRILL_SCHEDULE": "20s", "FLEETWATCH_DRILL_NODES": CANARY,
            "FLEETWATCH_DRILL_BUDGET_SECONDS": "60", "FLEETWATCH_WATCHDOG_SECONDS": "2"}


def test_a_scheduled_drill_runs_end_to_end_and_reports_in_the_api(
        celery_worker_process: Worker, sim_state: Any, operator: Any) -> None:
    # Job 3003 ends on its own: gpu-013..016 fall idle, and the canary is free.
    call_command("fleetwatch", "sim", "--finish-job", "3003")
    wait_for(lambda: Node.objects.filter(name=CANARY, gpus__isnull=False).exists(), 30,
             "the first collection of the simulated fleet")
    before = sim_state()

    def finished() -> Drill | None:
        return Drill.objects.filter(trigger=Drill.Trigger.SCHEDULE).exclude(
            status=Drill.Status.RUNNING).order_by("pk").first()
    try:
        drill = wait_for(finished, 120, "a scheduled drill to finish")
    except AssertionError:
        print(celery_worker_process.output())
        raise
    assert drill.status == Drill.Status.PASSED, (drill.reason, drill.events)
    print(f"scheduled drill {drill.pk} phases (s): {drill.phases}")  # for the record, with -s
    assert (drill.node, drill.mode, drill.requested_by) == (CANARY, "observe", "system")
    assert drill.phases["total"] <= 60
    for phase in ("inject", "detect", "decide", "first_action", "drain", "requeue", "replace"):
        assert 0 <= drill.phases[phase] <= drill.phases["total"], phase

    incident = Incident.objects.get(drill=drill)
    assert (incident.root_cause, incident.nodes, incident.status) == (
        "gpu_hardware", [CANARY], Incident.Status.RESOLVED)
    would = list(AuditEntry.objects.filter(remediation__incident=incident,
                                           data__would_call=True).order_by("pk")
                 .values_list("verb", flat=True))
    assert would == ["notify", "slurm.drain", "k8s.cordon", "k8s.evict", "provider.replace"]
    assert not AuditEntry.objects.filter(remediation__incident=incident).exclude(
        call="").exists()
    # Nothing changed outside: the canary, its pods, the spares, the running jobs.
    after = sim_state()
    assert after["nodes"][CANARY] == before["nodes"][CANARY]
    assert after["replacements"] == {}
    assert [p for p in after["pods"] if p["node"] == CANARY] == [
        p for p in before["pods"] if p["node"] == CANARY]
    assert {j["id"]: j["state"] for j in after["jobs"].values()} == {
        "3001": "RUNNING", "3002": "RUNNING", "3003": "COMPLETED"}
    assert Job.objects.filter(state="RUNNING").count() == 2
    # Not the on-call's: no real incident, nothing to page about.
    assert not Incident.objects.real().exists()

    # The report, in the API.
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator, ('read',))}")
    listed = api.get("/api/v1/drills/?trigger=schedule&status=passed").json()
    assert drill.pk in [d["id"] for d in listed["results"]]
    report = api.get(f"/api/v1/drills/{drill.pk}/").json()
    assert (report["status"], report["node"], report["incident"]) == (
        "passed", CANARY, incident.pk)
    assert set(report["phases"]) >= {"inject", "detect", "decide", "first_action", "total"}
    assert report["remediation"]["status"] == "succeeded"
    titles = [t["title"] for t in report["timeline"]]
    assert "canary chosen" in titles and "fault injected" in titles and "passed" in titles
    assert f"would call provider.replace {CANARY}" in titles
