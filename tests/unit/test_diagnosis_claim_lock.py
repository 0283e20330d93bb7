"""Pushes of one cluster do not wait for each other, and a diagnosis run still reads every
push that counted on the diagnosis already marked (issue 18: the intake must not serialise
every push behind one lock). On PostgreSQL, with pushes and runs on their own connections
as gunicorn's and Celery's processes are."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import OperationalError, close_old_connections, connection, transaction
from django.utils import timezone

from collectors import services as collectors
from incidents import diagnosing
from incidents.models import DiagnosisState, Incident

pytestmark = pytest.mark.django_db(transaction=True)

XID79 = "NVRM: Xid (PCI:0000:8a:00): 79, pid=2231, name=python, GPU has fallen off the bus."


def xid(node: str) -> list[dict[str, Any]]:
    return [{"at": timezone.now(), "source": "kernel", "node": node, "message": XID79}]


def waiting_on_claim(cluster_id: int) -> bool:
    """Some session waits for the cluster's claim lock (an advisory lock not granted)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                       "AND classid = %s AND objid = %s",
                       [diagnosing.DIAGNOSIS_CLAIM_LOCK, cluster_id])
        return bool(cursor.fetchone()[0])


@pytest.fixture
def cluster(sim_fleet: Any) -> Any:
    """The simulated fleet collected once, its cluster's diagnosis neither due nor running."""
    if connection.vendor != "postgresql":
        pytest.skip("row and advisory locks: PostgreSQL (make test runs this file there)")
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    cluster = collectors.cluster_default()
    DiagnosisState.objects.filter(cluster=cluster).update(
        pending_since=None, queued_at=None, running_since=None, running_from=None)
    return cluster


def test_pushes_pass_each_other_and_the_run_waits_for_the_ones_in_flight(cluster: Any) -> None:
    # Diagnosis marked a minute ago and a run queued: what a storm's pushes find.
    DiagnosisState.objects.filter(cluster=cluster).update(
        pending_since=timezone.now() - timezone.timedelta(minutes=1), queued_at=timezone.now())

    stored, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def push_held_open() -> None:
        # A web worker's push whose transaction has not committed yet.
        try:
            with transaction.atomic():
                collectors.signals_ingest(cluster, xid("gpu-007"))
                stored.set()
                release.wait(30)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)
        finally:
            connection.close()

    runs: list[list[Incident]] = []

    def run() -> None:
        try:
            runs.append(diagnosing.diagnosis_run(cluster.pk))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    holder = threading.Thread(target=push_held_open)
    runner = threading.Thread(target=run)
    holder.start()
    try:
        assert stored.wait(10), errors
        # Another push meanwhile: it must not wait for the first to commit. (A lock wait
        # past 5 s fails it here rather than hang.)
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '5s'")
            try:
                collectors.signals_ingest(cluster, xid("gpu-009"))
            except OperationalError as exc:
                pytest.fail(f"the second push waited for the first one's lock: {exc}")

        # The queued run claims: it must wait for the open push, whose signal it has to see.
        runner.start()
        for _ in range(100):
            if waiting_on_claim(cluster.pk):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the run did not wait for the push in flight")
        assert not runs
        release.set()
        holder.join(10)
        runner.join(60)
        assert not errors, errors
        [incidents] = runs
        assert {n for i in incidents for n in i.nodes} >= {"gpu-007", "gpu-009"}
        state = DiagnosisState.objects.get(cluster=cluster)
        assert (state.pending_since, state.running_since) == (None, None)
    finally:
        release.set()
        holder.join(10)
        if runner.is_alive():
            runner.join(60)
        close_old_connections()


def test_a_push_that_must_mark_diagnosis_still_queues_one_run(cluster: Any) -> None:
    collectors.signals_ingest(cluster, xid("gpu-007"))
    state = DiagnosisState.objects.get(cluster=cluster)
    assert state.pending_since is not None and state.queued_at is not None
    queued = state.queued_at
    # Marked and queued now: the next pushes change nothing.
    collectors.signals_ingest(cluster, xid("gpu-009"))
    again = DiagnosisState.objects.get(cluster=cluster)
    assert (again.pending_since, again.queued_at) == (state.pending_since, queued)
