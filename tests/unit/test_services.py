"""Incident and remediation services against the database (PostgreSQL under make test)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import transaction

from collectors import services as collectors
from collectors.models import Node, Signal, SourceHealth
from collectors.sim.fleet import SimFleet
from incidents import diagnosing, lifecycle, status
from incidents.diagnosis import Diagnosis
from incidents.models import (
    AppendOnlyError,
    AuditEntry,
    DiagnosisState,
    Incident,
    Remediation,
    Step,
)
from incidents.remediation import engine, transitions

pytestmark = pytest.mark.django_db

DIAG = Diagnosis(root_cause="gpu_hardware", nodes=("gpu-003",), confidence=0.97,
                 playbook="replace_node", explanation="XID 79 on gpu-003",
                 detected_at=datetime(2026, 12, 2, 10, 0, tzinfo=UTC), jobs=("3001",))


@pytest.fixture
def cluster(sim_fleet: SimFleet) -> Any:
    return collectors.cluster_default()


def test_collectors_fill_state_and_announce_only_changes(cluster: Any, sim_fleet: SimFleet,
                                                         django_capture_on_commit_callbacks: Any
                                                         ) -> None:
    for source in ("slurm", "kubernetes", "telemetry"):
        assert collectors.collect_source(source).healthy
    node = Node.objects.get(name="gpu-003")
    assert node.slurm_state == "ALLOCATED" and node.k8s_ready is True
    assert node.leaf_switch == "leaf-a" and node.health == "healthy"
    assert node.gpus.count() == 8
    # The first look at a healthy fleet is not news; only the jobs it finds running are.
    assert set(Signal.objects.values_list("kind", "value")) == {("slurm_job_state", "RUNNING")}
    Signal.objects.all().delete()

    collectors.collect_source("telemetry")
    assert not Signal.objects.exists()
    from collectors.sim.faults import fault_inject

    fault_inject("xid", node="gpu-003", gpu=5, code=79)
    with django_capture_on_commit_callbacks() as callbacks:
        result = collectors.collect_source("telemetry")
    [signal] = Signal.objects.all()
    assert (signal.kind, signal.node_name, signal.gpu_index, signal.code) == ("xid", "gpu-003", 5, 79)
    assert result.signal_ids == [signal.pk]
    # Diagnosis was told in the same transaction: due from the XID on, a run already queued
    # by the first collection (not yet started), so nothing more is queued.
    state = DiagnosisState.objects.get(cluster=cluster)
    assert state.pending_since is not None and state.pending_since <= signal.observed_at
    assert state.queued_at is not None and callbacks == []
    assert collectors.collect_source("telemetry").signal_ids == []  # gauge unchanged
    assert Node.objects.get(name="gpu-003").health == "failed"
    # The queued run diagnoses everything marked, the XID included.
    [incident] = diagnosing.diagnosis_run(cluster.pk)
    assert (incident.root_cause, incident.nodes) == ("gpu_hardware", ["gpu-003"])
    state.refresh_from_db()
    assert (state.pending_since, state.queued_at, state.running_since, state.runs) == (
        None, None, None, 1)


def test_a_source_that_is_down_is_recorded_and_fails_no_node(cluster: Any) -> None:
    collectors.collect_source("slurm")
    from collectors.sim.faults import source_outage_set

    source_outage_set("slurm", down=True)
    result = collectors.collect_source("slurm")
    assert not result.healthy and "unreachable" in result.error
    health = SourceHealth.objects.get(name="slurm")
    assert health.healthy is False and health.consecutive_failures == 1
    assert Signal.objects.get(kind="collector_health").data["healthy"] is False
    assert Node.objects.filter(slurm_state="ALLOCATED").count() == 16  # unchanged
    assert not Incident.objects.exists()
    # Back up: the run of failures ends, the count of all failures (for /metrics) stays.
    collectors.collect_source("slurm")
    source_outage_set("slurm", down=False)
    collectors.collect_source("slurm")
    health.refresh_from_db()
    assert (health.healthy, health.consecutive_failures, health.failures) == (True, 0, 2)


def test_an_incident_resolved_by_hand_cannot_be_remediated_or_resolved_again(
        cluster: Any, settings: Any) -> None:
    settings.FLEETWATCH_POLICY_MODE = "approve"
    incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    waiting = incident.remediations.get()
    assert waiting.status == "awaiting_approval"
    lifecycle.incident_resolve_by_hand(incident.pk, actor="user:olivia", note="riser reseated")
    incident.refresh_from_db()
    waiting.refresh_from_db()
    # Nobody will approve it now: the waiting remediation is cancelled with the incident.
    assert (incident.status, waiting.status) == ("resolved", "cancelled")
    assert incident.repaired_by == "person"
    with pytest.raises(status.InvalidTransition, match="already resolved"):
        lifecycle.incident_resolve_by_hand(incident.pk, actor="user:olivia")
    with pytest.raises(status.InvalidTransition, match="is resolved; nothing to remediate"):
        transitions.remediation_open(incident, actor="user:olivia")
    assert incident.remediations.count() == 1


def test_the_same_diagnosis_twice_is_one_incident_and_one_remediation(cluster: Any) -> None:
    first, created = lifecycle.incident_record(cluster.pk, DIAG)
    again, created_again = lifecycle.incident_record(cluster.pk, DIAG)
    assert created and not created_again and first.pk == again.pk
    assert Remediation.objects.count() == 1
    rem = Remediation.objects.get()
    assert rem.status == "running" and rem.requested_by == "system"
    assert list(rem.steps.values_list("kind", flat=True)) == [
        "notify", "drain_and_cancel", "requeue", "check_no_auto_replace", "cordon_and_drain",
        "replace_node", "prove_healthy", "resume"]
    # Start pressed while it runs: the running one is returned, nothing new is created.
    opened = transitions.remediation_open(first, actor="user:x")
    assert not opened.created and opened.remediation.pk == rem.pk


def test_low_confidence_opens_an_incident_but_no_remediation(cluster: Any) -> None:
    from dataclasses import replace

    incident, _ = lifecycle.incident_record(cluster.pk, replace(DIAG, confidence=0.4))
    assert incident.status == "open" and not incident.remediations.exists()


def test_observe_mode_records_what_it_would_do_and_calls_nothing(
    cluster: Any, settings: Any
) -> None:
    settings.FLEETWATCH_POLICY_MODE = "observe"
    incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    rem = incident.remediations.get()
    assert rem.status == "observed"
    assert set(rem.steps.values_list("status", flat=True)) == {"skipped"}
    assert rem.steps.get(order=2).detail.startswith("observe mode: would drain the Slurm node")
    assert not AuditEntry.objects.exclude(call="").exists()


def test_approving_twice_is_refused_the_second_time(cluster: Any, settings: Any,
                                                   operator: Any) -> None:
    settings.FLEETWATCH_POLICY_MODE = "approve"
    incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    rem = incident.remediations.get()
    assert rem.status == "awaiting_approval"
    transitions.remediation_approve(rem.pk, operator)
    with pytest.raises(status.InvalidTransition, match="nothing to approve"):
        transitions.remediation_approve(rem.pk, operator)
    assert AuditEntry.objects.filter(verb="remediation.approved").count() == 1


def test_a_step_runs_its_outside_calls_once(cluster: Any, sim_fleet: SimFleet,
                                            django_capture_on_commit_callbacks: Any) -> None:
    collectors.collect_source("slurm")
    with django_capture_on_commit_callbacks():  # keep the step off the broker: run it here
        incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    notify = incident.remediations.get().steps.get(order=1)
    with django_capture_on_commit_callbacks() as queued:
        assert engine.step_run(notify.pk) == "succeeded"
    assert len(queued) == 1  # the next step was queued
    assert engine.step_run(notify.pk) == "step already succeeded"  # a duplicate delivery
    assert AuditEntry.objects.filter(verb="notify").count() == 1

    drain = incident.remediations.get().steps.get(order=2)
    with django_capture_on_commit_callbacks():
        assert engine.step_run(drain.pk) == "waiting"  # the hung job is inside its grace
        assert engine.step_run(drain.pk, "poll") in {"waiting", "succeeded"}
    assert AuditEntry.objects.filter(verb="slurm.drain").count() == 1
    assert AuditEntry.objects.filter(verb="slurm.cancel").count() == 1
    drain.refresh_from_db()
    assert drain.attempts == 1 and drain.checks == 1


def test_a_cancelled_remediation_runs_no_more_steps(cluster: Any, operator: Any,
                                                    django_capture_on_commit_callbacks: Any
                                                    ) -> None:
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    rem = incident.remediations.get()
    transitions.remediation_cancel(rem.pk, operator)
    assert engine.step_run(rem.steps.get(order=1).pk) == "step already cancelled"
    assert set(rem.steps.values_list("status", flat=True)) == {Step.Status.CANCELLED}
    incident.refresh_from_db()
    assert incident.status == "needs_attention"
    with pytest.raises(status.InvalidTransition):
        transitions.remediation_cancel(rem.pk, operator)


def test_the_audit_trail_is_append_only(cluster: Any) -> None:
    incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    entry = AuditEntry.objects.filter(incident=incident).first()
    entry.result = "rewritten"
    with pytest.raises(AppendOnlyError):
        entry.save()
    with pytest.raises(AppendOnlyError):
        entry.delete()
    with pytest.raises(AppendOnlyError), transaction.atomic():
        AuditEntry.objects.all().update(result="x")
    with pytest.raises(AppendOnlyError), transaction.atomic():
        AuditEntry.objects.all().delete()


def test_the_live_pipeline_blames_a_dead_leaf_not_its_nodes(cluster: Any, sim_fleet: SimFleet,
                                                            django_capture_on_commit_callbacks: Any
                                                            ) -> None:
    from collectors.sim.faults import fault_inject

    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    fault_inject("switch-down", switch="leaf-a")
    with django_capture_on_commit_callbacks():
        ids = [i for source in ("telemetry", "kubernetes", "slurm")
               for i in collectors.collect_source(source).signal_ids]
    assert Signal.objects.filter(pk__in=ids, source="nic").count() >= 8
    incidents = diagnosing.diagnose_signals(ids)
    assert {(i.root_cause, i.switch) for i in incidents} == {("switch_failure", "leaf-a")}
    [incident] = Incident.objects.all()
    assert sorted(incident.nodes) == [f"gpu-{n:03d}" for n in range(1, 9)]
    assert "no node is blamed" in incident.explanation
    # The switch's playbook holds work off its nodes; it never cordons, reboots or replaces.
    rem = incident.remediations.get()
    assert rem.playbook == "hold_switch"
    assert list(rem.steps.values_list("kind", flat=True)) == [
        "notify", "hold_switch_nodes", "requeue_dead_jobs", "wait_switch_healthy",
        "release_switch_nodes"]
    # Diagnosing the same window again extends the incident; it does not open another.
    assert [i.pk for i in diagnosing.diagnose_signals(ids)] == [incident.pk]
    assert Incident.objects.count() == 1


def test_a_failed_remediation_of_a_resolved_incident_cannot_be_retried(
        cluster: Any, settings: Any) -> None:
    settings.FLEETWATCH_POLICY_MODE = "approve"
    incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    rem = incident.remediations.get()
    # It failed at its second step; then a person fixed the node by hand and resolved it.
    Remediation.objects.filter(pk=rem.pk).update(status="failed")
    Step.objects.filter(remediation=rem, order=2).update(status="failed", error="boom")
    Incident.objects.filter(pk=incident.pk).update(status="resolved")
    with pytest.raises(status.InvalidTransition, match="is resolved; remediation"):
        transitions.remediation_retry(rem.pk, None, actor="user:olivia")
    assert Remediation.objects.get(pk=rem.pk).status == "failed"
    assert Incident.objects.get(pk=incident.pk).status == "resolved"
