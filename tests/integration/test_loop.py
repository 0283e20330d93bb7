"""The XID 79 self-healing loop end to end: real Celery worker and beat, real PostgreSQL,
real Redis, the simulated fleet standing in for Slurm, Kubernetes, DCGM and the provider."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from collectors.models import CollectorRun, Job, Node
from incidents.models import AuditEntry, Incident, Remediation, Step
from incidents.remediation import transitions
from tests.conftest import Worker, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

STEP_KINDS = ["notify", "drain_and_cancel", "requeue", "check_no_auto_replace",
              "cordon_and_drain", "replace_node", "prove_healthy", "resume"]


def _last_run() -> int:
    last = CollectorRun.objects.order_by("-pk").first()
    return last.pk if last is not None else 0


def _collections_after(run: int, cycles: int) -> None:
    """Wait (with a deadline) until the worker's beat has run ``cycles`` more telemetry
    collections: time has passed for the loop to act, measured by the loop itself."""
    wait_for(lambda: CollectorRun.objects.filter(pk__gt=run, source="telemetry").count()
             >= cycles, 10 + 2 * cycles, f"{cycles} more telemetry collections")


def _fleet_collected() -> bool:
    return Node.objects.filter(in_service=True, gpus__isnull=False).distinct().count() >= 16 \
        and Job.objects.filter(state="RUNNING").count() == 3


def _incident(worker: Worker, status: str, timeout: float = 120) -> Incident:
    def find() -> Incident | None:
        return Incident.objects.filter(status=status).first()
    try:
        return wait_for(find, timeout, f"an incident with status {status}")
    except AssertionError:
        print(worker.output())
        raise


def test_xid79_heals_without_a_person(celery_worker_process: Worker, sim_state: Any) -> None:
    wait_for(_fleet_collected, 30, "the first collection of the simulated fleet")
    victim_job = Job.objects.get(nodes__contains=["gpu-003"], state="RUNNING")
    assert victim_job.slurm_id == "3001"

    call_command("fleetwatch", "inject", "xid", "--node", "gpu-003", "--gpu", "5", "--code", "79")
    incident = _incident(celery_worker_process, Incident.Status.RESOLVED)

    assert incident.root_cause == "gpu_hardware"
    assert incident.nodes == ["gpu-003"]
    assert incident.jobs == ["3001"]
    assert "XID 79" in incident.explanation
    remediation = incident.remediations.get()
    assert remediation.status == Remediation.Status.SUCCEEDED
    assert remediation.requested_by == "system"
    steps = list(remediation.steps.order_by("order"))
    assert [s.kind for s in steps] == STEP_KINDS
    assert all(s.status == Step.Status.SUCCEEDED for s in steps), [(s.kind, s.status) for s in steps]
    assert all(s.started_at and s.finished_at for s in steps)
    # The hung job cannot checkpoint on SIGTERM: the step waited out the grace period.
    assert steps[1].checks >= 1
    assert steps[1].result["jobs"] == ["3001"]
    new_node = steps[5].result["new_node"]
    assert new_node == "gpu-017"

    # Every outside call is in the audit trail, in order, each with its result.
    calls = list(AuditEntry.objects.filter(remediation=remediation).exclude(call="")
                 .values_list("verb", "target", "ok"))
    # The job's comment is written before it is stopped (Slurm refuses an ended job's update)
    # and again once it is requeued; its owner has no address here, so nobody is messaged.
    assert [v for v, _, _ in calls] == [
        "notify", "slurm.drain", "slurm.comment", "slurm.cancel", "slurm.requeue",
        "slurm.comment", "k8s.cordon", "k8s.evict", "provider.replace",
        # the replacement's acceptance checks (the return-to-service gate), then the resume
        # step, which finds it in service already
        "slurm.reserve", "slurm.resume", "slurm.submit_check", "slurm.unreserve",
        "slurm.resume"]
    assert all(ok for _, _, ok in calls)
    assert ("slurm.drain", "gpu-003", True) in calls
    assert ("slurm.resume", new_node, True) in calls
    assert AuditEntry.objects.filter(remediation=remediation, verb="gate.passed",
                                     target=new_node).exists()
    verbs = set(AuditEntry.objects.filter(incident=incident).values_list("verb", flat=True))
    assert {"incident.opened", "remediation.created", "step.started", "step.succeeded",
            "remediation.succeeded", "incident.resolved"} <= verbs
    assert set(incident.phases) >= {"detect", "first_action", "total", *STEP_KINDS}

    # The outside world, as the simulated Slurm and Kubernetes now report it.
    state = sim_state()
    bad = state["nodes"]["gpu-003"]
    assert bad["drained"] and bad["reason"].startswith("fleetwatch:")
    assert bad["unschedulable"]
    assert bad["annotations"]["fleetwatch.io/cordoned-by"] == "fleetwatch"
    assert [p["name"] for p in state["pods"] if p["node"] == "gpu-003"] == [
        "dcgm-exporter-gpu-003"]  # the DaemonSet pod stays, the slurmd pod was evicted
    new = state["nodes"][new_node]
    assert new["in_service"] and not new["drained"] and new["ready"]
    job = state["jobs"]["3001"]
    assert job["state"] == "RUNNING"
    assert job["restart_count"] == 1
    assert new_node in job["nodes"] and "gpu-003" not in job["nodes"]
    # Resumed from the last checkpoint written before the fault.
    assert job["resumed_from_step"] == steps[1].result["checkpoints"]["3001"]
    assert job["resumed_from_step"] > 0

    # FleetWatch's own view of the job catches up on the next collection.
    wait_for(lambda: Job.objects.filter(slurm_id="3001", state="RUNNING",
                                        restart_count=1).exists(), 10, "job 3001 running again")

    # Injecting the same fault again runs nothing twice.
    before = AuditEntry.objects.order_by("-pk").first().pk
    runs = _last_run()
    call_command("fleetwatch", "inject", "xid", "--node", "gpu-003", "--gpu", "5", "--code", "79")
    _collections_after(runs, 3)  # several collection cycles
    assert Incident.objects.count() == 1
    assert Remediation.objects.count() == 1
    assert not AuditEntry.objects.filter(pk__gt=before, call__gt="").exists()


def test_no_auto_replace_label_stops_before_cordon(
    celery_worker_process: Worker, sim_state: Any, operator: Any
) -> None:
    wait_for(_fleet_collected, 30, "the first collection of the simulated fleet")
    call_command("fleetwatch", "sim", "--node", "gpu-010", "--no-auto-replace", "on")
    call_command("fleetwatch", "inject", "xid", "--node", "gpu-010", "--gpu", "2", "--code", "79")

    incident = _incident(celery_worker_process, Incident.Status.NEEDS_ATTENTION)
    remediation = incident.remediations.get()
    assert remediation.status == Remediation.Status.BLOCKED
    assert "fleetwatch.io/no-auto-replace" in remediation.blocked_reason
    statuses = list(remediation.steps.order_by("order").values_list("status", flat=True))
    assert statuses == ["succeeded"] * 3 + ["blocked"] + ["pending"] * 4
    state = sim_state()
    assert state["nodes"]["gpu-010"]["drained"]  # drained and requeued, as before the check
    assert not state["nodes"]["gpu-010"]["unschedulable"]  # but not cordoned
    assert state["replacements"] == {}

    # The page says why, and offers the choice to the operator.
    client = Client()
    client.force_login(operator)
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert "carry fleetwatch.io/no-auto-replace=true" in page
    assert "Continue anyway" in page and "Stop here" in page

    # The person chooses to continue; the playbook goes on and heals the node.
    response = client.post(f"/incidents/{incident.pk}/continue",
                           {"remediation": remediation.pk})
    assert response.status_code == 302
    # A second press finds nothing to continue and changes nothing.
    client.post(f"/incidents/{incident.pk}/continue", {"remediation": remediation.pk})
    resolved = _incident(celery_worker_process, Incident.Status.RESOLVED)
    assert resolved.pk == incident.pk
    assert AuditEntry.objects.filter(verb="remediation.continued", actor="user:olivia").count() == 1
    assert AuditEntry.objects.filter(verb="provider.replace").count() == 1
    assert sim_state()["nodes"]["gpu-010"]["unschedulable"]


@pytest.mark.parametrize("policy_mode", ["approve"])
def test_approve_mode_waits_for_one_click(
    celery_worker_process: Worker, sim_state: Any, operator: Any, viewer: Any
) -> None:
    wait_for(_fleet_collected, 30, "the first collection of the simulated fleet")
    call_command("fleetwatch", "inject", "xid", "--node", "gpu-014", "--gpu", "0", "--code", "79")
    incident = _incident(celery_worker_process, Incident.Status.OPEN)
    remediation = wait_for(lambda: incident.remediations.first(), 10, "a remediation")
    assert remediation.status == Remediation.Status.AWAITING_APPROVAL
    _collections_after(_last_run(), 2)  # the worker keeps collecting and diagnosing meanwhile
    # Nothing touched yet; the one outside call is the page asking on-call for the approval.
    [page] = AuditEntry.objects.exclude(call="")
    assert (page.verb, page.target, page.data["page"]) == ("notify", "on-call", "approval")
    assert page.remediation_id == remediation.pk
    assert not sim_state()["nodes"]["gpu-014"]["drained"]

    # A viewer cannot approve, even with a hand-made POST.
    as_viewer = Client()
    as_viewer.force_login(viewer)
    assert as_viewer.post(f"/incidents/{incident.pk}/approve",
                          {"remediation": remediation.pk}).status_code == 403

    client = Client()
    client.force_login(operator)
    page = client.get(f"/incidents/{incident.pk}/").content.decode()
    assert "Confirm: approve and run" in page and "gpu-014" in page
    first = client.post(f"/incidents/{incident.pk}/approve", {"remediation": remediation.pk})
    second = client.post(f"/incidents/{incident.pk}/approve", {"remediation": remediation.pk},
                         follow=True)
    assert first.status_code == 302
    assert "nothing to approve" in second.content.decode()

    resolved = _incident(celery_worker_process, Incident.Status.RESOLVED)
    assert resolved.pk == incident.pk
    remediation.refresh_from_db()
    assert remediation.approved_by == "user:olivia"
    assert AuditEntry.objects.filter(verb="remediation.approved").count() == 1
    assert AuditEntry.objects.filter(verb="slurm.drain").count() == 1
    assert AuditEntry.objects.filter(verb="provider.replace").count() == 1
    # Pressing "start" on a healed incident does not run the playbook again.
    assert not transitions.remediation_open(incident, actor="user:olivia", user=operator).created
    assert Remediation.objects.count() == 1
