"""A storm is one event (issue 18): faults of one root cause past the storm brake join one
storm incident, recorded in one transaction, instead of opening one incident (with its
audit entries, policy decision and steps) each; the first faults keep their own incidents
and remediations, a fault of another kind is not held by the storm, and nothing runs from
the storm incident itself.

Against the database (PostgreSQL under make test), through the real ingest and diagnosis run
(the worker, broker and web server are in tests/bench/storm.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from collectors import services as collectors
from collectors.sim.fleet import SimFleet
from incidents import diagnosing, selectors
from incidents.diagnosis import diagnose
from incidents.models import AuditEntry, DiagnosisState, Evidence, Incident, Remediation
from incidents.remediation import policy
from incidents.remediation.transitions import remediation_open
from incidents.status import InvalidTransition
from tests.conftest import token_for

pytestmark = pytest.mark.django_db

XID79 = "NVRM: Xid (PCI:0000:8a:00): 79, pid=2231, name=python, GPU has fallen off the bus."
XID48 = "NVRM: Xid (PCI:0000:3b:00): 48, pid=1911, name=python, An uncorrectable double bit error"


@pytest.fixture
def cluster(sim_fleet: SimFleet, settings: Any) -> Any:
    settings.FLEETWATCH_STORM_INCIDENTS = 3
    settings.FLEETWATCH_BUDGET_MAX_NODES = 16  # the fleet budget is another test's rail
    settings.FLEETWATCH_BUDGET_MAX_PERCENT = 100
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    cluster = collectors.cluster_default()
    DiagnosisState.objects.filter(cluster=cluster).update(pending_since=None, queued_at=None)
    return cluster


def push(cluster: Any, nodes: list[str], message: str = XID79) -> None:
    for node in nodes:
        collectors.signals_ingest(cluster, [{"at": timezone.now(), "source": "kernel",
                                             "node": node, "message": message}])


def run(cluster: Any, capture: Any) -> None:
    with capture():  # the remediations' first steps stay off the broker
        while True:
            diagnosing.diagnosis_run(cluster.pk)
            if DiagnosisState.objects.get(cluster=cluster).pending_since is None:
                return


def nodes(n: int, start: int = 1) -> list[str]:
    return [f"gpu-{i:03d}" for i in range(start, start + n)]


def test_a_storm_past_the_brake_is_one_incident_and_the_first_faults_keep_theirs(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    push(cluster, nodes(8))
    audit_before = AuditEntry.objects.count()
    run(cluster, django_capture_on_commit_callbacks)

    alone = list(Incident.objects.filter(storm=False).order_by("pk"))
    [storm] = Incident.objects.filter(storm=True)
    # The brake's three open on their own and are repaired as ever; the other five are one
    # event, for a person.
    assert len(alone) == 3 and all(i.remediations.count() == 1 for i in alone)
    assert sorted(storm.nodes) == sorted(set(nodes(8)) - {n for i in alone for n in i.nodes})
    assert storm.root_cause == alone[0].root_cause
    assert storm.status == Incident.Status.NEEDS_ATTENTION
    assert not storm.remediations.exists() and storm.playbook == ""
    assert storm.explanation.startswith(f"Storm: {storm.get_root_cause_display()} on 5 nodes")
    assert "more than 3" in storm.explanation and "nothing runs from this incident" in \
        storm.explanation
    assert Evidence.objects.filter(incident=storm).count() == 5
    # One audit entry for the storm's opening, not five incidents' worth.
    opened = AuditEntry.objects.filter(pk__gt=audit_before, verb="incident.opened")
    assert opened.filter(incident=storm).count() == 1 and opened.count() == 4
    assert policy.storm_by_cause(cluster.pk)[storm.root_cause] == 4

    # A run over the same window (nothing new) records nothing again.
    audit_after = AuditEntry.objects.count()
    DiagnosisState.objects.filter(cluster=cluster).update(
        pending_since=timezone.now() - timezone.timedelta(seconds=5))
    run(cluster, django_capture_on_commit_callbacks)
    assert AuditEntry.objects.count() == audit_after
    assert Incident.objects.count() == 4


def test_stragglers_join_the_storm_and_another_fault_is_not_held_by_it(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    push(cluster, nodes(6))
    run(cluster, django_capture_on_commit_callbacks)
    [storm] = Incident.objects.filter(storm=True)
    assert len(storm.nodes) == 3

    # The storm goes on: two more nodes join the same incident (one entry says so), and a
    # double-bit ECC error elsewhere is its own incident with its remediation running.
    push(cluster, nodes(2, start=7))
    push(cluster, ["gpu-012"], XID48)
    run(cluster, django_capture_on_commit_callbacks)
    storm.refresh_from_db()
    assert len(storm.nodes) == 5 and set(nodes(2, start=7)) <= set(storm.nodes)
    assert Incident.objects.filter(storm=True).count() == 1
    grew = AuditEntry.objects.get(incident=storm, verb="incident.extended")
    assert "2 more signal(s) of the storm; 5 nodes now" in grew.result
    other = Incident.objects.get(nodes=["gpu-012"])
    assert other.root_cause != storm.root_cause and not other.storm
    rem = other.remediations.get()
    assert rem.status == Remediation.Status.RUNNING and rem.hold_reason == ""
    # ... and recorded before the storm's join in that run: it did not wait for it.
    assert AuditEntry.objects.get(incident=other, verb="incident.opened").pk < grew.pk


def test_nothing_runs_from_a_storm_incident(
        cluster: Any, django_capture_on_commit_callbacks: Any, operator: Any) -> None:
    push(cluster, nodes(5))
    run(cluster, django_capture_on_commit_callbacks)
    storm = Incident.objects.get(storm=True)
    with pytest.raises(InvalidTransition, match=r"groups a storm of .* on 2 nodes: no playbook"):
        remediation_open(storm, actor="user:olivia")
    # Through the API, as a person pressing "start": a 409 saying why, and the incident
    # says what it is.
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator)}")
    answer = client.post(f"/api/v1/incidents/{storm.pk}/remediate/")
    assert answer.status_code == 409 and "no playbook runs over a storm" in answer.json()["detail"]
    got = client.get(f"/api/v1/incidents/{storm.pk}/").json()
    assert got["storm"] is True and len(got["nodes"]) == 2
    assert not Remediation.objects.filter(incident=storm).exists()
    # The pages name it a storm and count its nodes rather than listing hundreds in a title.
    page = Client()
    page.force_login(operator)
    html = page.get(f"/incidents/{storm.pk}/").content.decode()
    assert f"storm of {storm.get_root_cause_display()} on 2 nodes</h1>" in html
    assert all(f">{n}</a>" in html for n in storm.nodes)
    assert "storm: 2 nodes" in page.get("/incidents/").content.decode()


def test_application_errors_are_never_a_storm(cluster: Any) -> None:
    """A job's own error is that job's, however many jobs fail at once."""
    assert policy.storm_room(cluster.pk, "application_error") is None
    assert policy.storm_room(cluster.pk, "gpu_hardware") == 3


def test_a_run_skips_what_is_recorded_already_and_not_what_brings_a_new_signal(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    def window_diagnoses() -> list[Any]:
        observations = selectors.observations_between(
            cluster, timezone.now() - timedelta(minutes=30), timezone.now())
        return diagnose(observations, selectors.topology(cluster), selectors.jobs_info(cluster))

    push(cluster, nodes(5))
    run(cluster, django_capture_on_commit_callbacks)
    storm = Incident.objects.get(storm=True)
    diagnoses = window_diagnoses()
    done = diagnosing._recorded_already(cluster.pk, diagnoses)
    # Every fault of the window is held already: its own incident's, or the storm's.
    assert set(done) == {d.fingerprint for d in diagnoses} and len(diagnoses) == 5
    assert {done[d.fingerprint].pk for d in diagnoses if set(d.nodes) <= set(storm.nodes)} == \
        {storm.pk}
    assert len({i.pk for i in done.values()}) == 4  # three of their own and the storm

    # A second line on a storm member's node and on a node with its own incident: both
    # diagnoses now bring a signal their incident lacks, and are recorded again.
    alone = Incident.objects.filter(storm=False).first()
    assert alone is not None
    member = sorted(storm.nodes)[0]
    push(cluster, [member, alone.nodes[0]])
    done = diagnosing._recorded_already(cluster.pk, window_diagnoses())
    missing = {d.nodes for d in window_diagnoses() if d.fingerprint not in done}
    assert missing == {(member,), (alone.nodes[0],)}
    run(cluster, django_capture_on_commit_callbacks)
    assert diagnosing._recorded_already(cluster.pk, window_diagnoses()).keys() == \
        {d.fingerprint for d in window_diagnoses()}
