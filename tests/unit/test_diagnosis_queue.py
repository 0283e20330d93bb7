"""Coalesced diagnosis: a burst of pushes queues one diagnosis per cluster, a run takes
everything marked since the last one, and nothing marked is lost to a failed run, a killed
worker or a lost message (issue 23: a burst of pushes starved detection).

Against the database (PostgreSQL under make test); the real worker and broker are in
tests/integration/test_burst.py."""

from __future__ import annotations

import gc
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from collectors import queueing
from collectors import services as collectors
from collectors.models import Signal
from collectors.roles import OPERATOR, user_with_role
from collectors.sim.fleet import SimFleet
from incidents import diagnosing
from incidents.models import DiagnosisState, Incident
from tests.conftest import token_for

pytestmark = pytest.mark.django_db

XID79 = "NVRM: Xid (PCI:0000:8a:00): 79, pid=2231, name=python, GPU has fallen off the bus."


def diagnoses_queued(callbacks: list[Callable[[], Any]]) -> int:
    """How many on-commit callbacks send a diagnosis run (others queue steps, webhooks)."""
    return sum(1 for c in callbacks if getattr(c, "task", None) == queueing.DIAGNOSE_CLUSTER)


@pytest.fixture
def cluster(sim_fleet: SimFleet) -> Any:
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    cluster = collectors.cluster_default()
    # The first collections' own mark: start every test with nothing due.
    DiagnosisState.objects.filter(cluster=cluster).update(pending_since=None, queued_at=None)
    return cluster


def telemetry(node: str, n: int) -> list[dict[str, Any]]:
    at = timezone.now().isoformat()
    return [{"at": at, "source": "dcgm", "node": node, "gpu": i % 8,
             "metric": "DCGM_FI_DEV_GPU_UTIL", "value": i % 100} for i in range(n)]


def xid(node: str) -> list[dict[str, Any]]:
    return [{"at": timezone.now().isoformat(), "source": "kernel", "node": node,
             "message": XID79}]


def state(cluster: Any) -> DiagnosisState:
    return DiagnosisState.objects.get(cluster=cluster)


def test_a_burst_of_pushes_queues_one_diagnosis_that_sees_them_all(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION="Token " + token_for(
        user_with_role("ingester", OPERATOR)[0], ("read", "ingest")))
    with django_capture_on_commit_callbacks() as queued:
        for i in range(40):
            batch = xid("gpu-007") if i == 25 else telemetry("gpu-002", 20)
            answer = api.post("/api/v1/signals/", {"signals": batch}, format="json")
            assert answer.status_code == 201, answer.content
    assert diagnoses_queued(queued) == 1  # 40 pushes, one diagnosis queued
    assert Signal.objects.filter(node_name="gpu-002").count() == 39 * 20

    [incident] = diagnosing.diagnosis_run(cluster.pk)  # the queued run
    assert (incident.root_cause, incident.nodes) == ("gpu_hardware", ["gpu-007"])
    done = state(cluster)
    assert (done.pending_since, done.queued_at, done.running_since, done.runs) == (
        None, None, None, 1)
    # Nothing new since: the next run reads nothing and opens nothing.
    assert diagnosing.diagnosis_run(cluster.pk) == []


def test_pushes_during_a_run_add_nothing_to_the_queue_and_the_run_queues_the_next(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    collectors.signals_ingest(cluster, telemetry("gpu-002", 10))
    real = diagnosing._diagnose_from
    during: list[list[Callable[[], Any]]] = []

    def with_pushes_meanwhile(cluster_id: int, earliest: Any) -> tuple[list[Incident], bool]:
        # While this run reads its window, other pushes arrive, the XID among them.
        with django_capture_on_commit_callbacks() as queued:
            collectors.signals_ingest(cluster, telemetry("gpu-002", 10))
            collectors.signals_ingest(cluster, xid("gpu-009"))
        during.append(queued)
        return real(cluster_id, earliest)

    with (mock.patch.object(diagnosing, "_diagnose_from", with_pushes_meanwhile),
          django_capture_on_commit_callbacks() as after):
        diagnosing.diagnosis_run(cluster.pk)
    assert diagnoses_queued(during[0]) == 0  # a run holds the row: it will look again
    assert diagnoses_queued(after) == 1  # ... and it did: the next run is queued
    assert state(cluster).pending_since is not None
    [incident] = diagnosing.diagnosis_run(cluster.pk)
    assert incident.nodes == ["gpu-009"]


def test_a_second_worker_does_not_run_while_one_holds_the_row(cluster: Any) -> None:
    collectors.signals_ingest(cluster, xid("gpu-004"))
    held = timezone.now()
    DiagnosisState.objects.filter(cluster=cluster).update(running_since=held, queued_at=held)
    assert diagnosing.diagnosis_run(cluster.pk) == []
    s = state(cluster)
    # Untouched but for its queued mark: the holder will see what is pending when it ends.
    assert s.pending_since is not None and s.running_since == held and s.queued_at is None
    assert not Incident.objects.exists()


def test_a_failed_run_gives_its_claim_back(cluster: Any) -> None:
    collectors.signals_ingest(cluster, xid("gpu-004"))
    marked = state(cluster).pending_since
    collecting: list[bool] = []

    def boom(*args: Any) -> None:
        collecting.append(gc.isenabled())
        raise RuntimeError("boom")

    with (mock.patch.object(diagnosing.selectors, "topology", boom),
          pytest.raises(RuntimeError)):
        diagnosing.diagnosis_run(cluster.pk)
    s = state(cluster)
    assert (s.pending_since, s.running_since, s.running_from) == (marked, None, None)
    # The garbage collector is paused while a run reads its window, and back after it,
    # even after a run that failed (a worker left without it would keep every cycle).
    assert collecting == [False] and gc.isenabled()
    [incident] = diagnosing.diagnosis_run(cluster.pk)
    assert incident.nodes == ["gpu-004"]


def test_a_killed_workers_claim_and_a_lost_message_are_picked_up(
        cluster: Any, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    collectors.signals_ingest(cluster, xid("gpu-004"))
    marked = state(cluster).pending_since
    # A worker claimed the XID, then was killed: its lease runs out after the hard time limit.
    long_ago = timezone.now() - timedelta(seconds=settings.CELERY_TASK_TIME_LIMIT + 60)
    DiagnosisState.objects.filter(cluster=cluster).update(
        pending_since=None, running_from=marked, running_since=long_ago, queued_at=None)
    with django_capture_on_commit_callbacks() as queued:
        assert diagnosing.diagnosis_rescue() == 1
    assert diagnoses_queued(queued) == 1
    # Queued just now: the rescue does not send a second one ...
    with django_capture_on_commit_callbacks() as again:
        assert diagnosing.diagnosis_rescue() == 0
    assert diagnoses_queued(again) == 0
    # ... until that message has waited longer than any run may last (lost with the broker).
    DiagnosisState.objects.filter(cluster=cluster).update(queued_at=long_ago)
    with django_capture_on_commit_callbacks() as lost:
        assert diagnosing.diagnosis_rescue() == 1
    assert diagnoses_queued(lost) == 1
    [incident] = diagnosing.diagnosis_run(cluster.pk)  # the dead run's claim is diagnosed
    assert incident.nodes == ["gpu-004"]
    assert diagnosing.diagnosis_rescue() == 0  # nothing due any more


def test_a_lost_message_is_replaced_by_the_next_push(
        cluster: Any, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    long_ago = timezone.now() - timedelta(seconds=settings.CELERY_TASK_TIME_LIMIT + 60)
    DiagnosisState.objects.filter(cluster=cluster).update(queued_at=long_ago)
    with django_capture_on_commit_callbacks() as queued:
        collectors.signals_ingest(cluster, xid("gpu-004"))
    assert diagnoses_queued(queued) == 1


def test_old_per_batch_messages_are_honoured(cluster: Any) -> None:
    """A diagnose_signals message queued before an upgrade marks its signals due."""
    from incidents import tasks

    ids = collectors.signals_store(cluster, [])  # nothing: nothing marked
    tasks.diagnose_signals(ids)
    assert state(cluster).pending_since is None
    stored = Signal.objects.create(cluster=cluster, source="kernel", kind="pushed_kernel",
                                   node_name="gpu-004", message=XID79,
                                   observed_at=timezone.now())
    tasks.diagnose_signals([stored.pk])
    [incident] = diagnosing.diagnosis_run(cluster.pk)
    assert incident.nodes == ["gpu-004"]


def test_a_run_rerecords_only_what_it_would_change(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    """Every run re-diagnoses the whole window: an incident that already holds all of a
    diagnosis's evidence is not recorded again (no transaction, no audit lock); one with new
    evidence is extended as before."""
    with django_capture_on_commit_callbacks():
        collectors.signals_ingest(cluster, xid("gpu-007"))
        [first] = diagnosing.diagnosis_run(cluster.pk)
    linked = first.evidence.count()
    with mock.patch.object(diagnosing, "incident_record",
                           wraps=diagnosing.incident_record) as recorded:
        [again], _ = diagnosing._diagnose_from(cluster.pk, timezone.now())
        assert again.pk == first.pk and recorded.call_count == 0
        # The same fault logged once more: new evidence, so the incident is recorded (and
        # extended), still one incident.
        collectors.signals_ingest(cluster, xid("gpu-007"))
        [extended], _ = diagnosing._diagnose_from(cluster.pk, timezone.now())
        assert extended.pk == first.pk and recorded.call_count == 1
    assert first.evidence.count() > linked
    assert Incident.objects.count() == 1


XID48 = "NVRM: Xid (PCI:0000:3b:00): 48, pid=1911, name=python, An uncorrectable double bit error"


def test_a_run_out_of_budget_hands_the_rest_on_the_rarest_kind_first(
        cluster: Any, django_capture_on_commit_callbacks: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A storm of one fault: a run records new incidents for at most RECORD_BUDGET_S, the
    rarest kind first, and queues the next run for the rest; nothing is lost."""
    monkeypatch.setattr(diagnosing, "RECORD_BUDGET_S", 0.0)  # one incident per run
    for node in ("gpu-001", "gpu-002", "gpu-003"):
        collectors.signals_ingest(cluster, xid(node))
    collectors.signals_ingest(cluster, [{"at": timezone.now().isoformat(), "source": "kernel",
                                         "node": "gpu-011", "message": XID48}])
    with django_capture_on_commit_callbacks() as queued:
        [first] = diagnosing.diagnosis_run(cluster.pk)
    # The one of a kind before the storm's three, and the next run queued for the rest.
    assert first.nodes == ["gpu-011"] and first.root_cause != "gpu_hardware"
    assert diagnoses_queued(queued) == 1 and state(cluster).pending_since is not None
    runs = 1
    while state(cluster).pending_since is not None:
        diagnosing.diagnosis_run(cluster.pk)
        runs += 1
        assert runs < 10
    assert runs == 4  # one new incident each
    assert sorted(n for i in Incident.objects.all() for n in i.nodes) == [
        "gpu-001", "gpu-002", "gpu-003", "gpu-011"]
