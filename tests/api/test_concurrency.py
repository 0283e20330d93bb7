"""People and programs acting on the same remediations at once, while a worker runs their
steps: every answer is a 200, 201 or 409 (never a 500 "deadlock detected"), no step is failed
by a collision, each outside action is made once, each approval and cancel is recorded once,
and the audit chain still verifies.

Threads share one PostgreSQL database (each its own connection), as gunicorn's and Celery's
processes do; the "worker" threads run ``engine.step_run`` for each step message the
services queue, the way ``incidents.tasks.run_step`` does."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from typing import Any
from unittest import mock

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from collectors import services as collectors
from collectors.roles import OPERATOR, user_with_role
from collectors.sim.fleet import SimFleet
from incidents import lifecycle, tasks
from incidents.audit import audit_verify
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Incident, Remediation, Step
from incidents.remediation import engine, transitions
from incidents.remediation.playbooks import FOR_ROOT_CAUSE
from tests.conftest import token_for

pytestmark = pytest.mark.django_db(transaction=True)

NODES = ("gpu-001", "gpu-002", "gpu-003", "gpu-004")
CYCLES = 10  # per node: 40 remediate/approve/cancel cycles in all


@pytest.fixture
def fleet(sim_fleet: SimFleet, settings: Any) -> list[Incident]:
    if connection.vendor != "postgresql":
        pytest.skip("row locks and advisory locks are PostgreSQL's; SQLite runs one writer")
    settings.FLEETWATCH_POLICY_MODE = "approve"
    settings.FLEETWATCH_API_RATE = "100000/min"
    settings.FLEETWATCH_SIM_SPEED = sim_fleet.speed = 400.0
    settings.FLEETWATCH_STEP_POLL_SECONDS = 0.05
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    cluster = collectors.cluster_default()
    incidents = []
    for node in NODES:
        diagnosis = Diagnosis(root_cause="nvlink", nodes=(node,), confidence=0.95,
                              playbook=FOR_ROOT_CAUSE["nvlink"], explanation=f"nvlink {node}",
                              detected_at=timezone.now(), jobs=())
        with mock.patch.object(tasks.run_step, "apply_async"):
            incident, _ = lifecycle.incident_record(cluster.pk, diagnosis)
        incidents.append(incident)
    return incidents


def test_remediate_approve_cancel_from_many_threads(fleet: list[Incident]) -> None:
    user = user_with_role("racer", OPERATOR)[0]
    key = token_for(user)
    messages: queue.Queue[tuple[int, str, float]] = queue.Queue()
    answers: Counter[int] = Counter()
    errors: list[str] = []
    drivers_done = threading.Event()

    def queued(args: list[Any], countdown: float | None = None, **_: Any) -> None:
        messages.put((args[0], args[1], time.monotonic() + min(countdown or 0, 0.05)))

    def call(client: APIClient, path: str) -> Any:
        try:
            response = client.post(path)
        except Exception as exc:  # the test client raises what the view raised
            errors.append(f"POST {path}: {type(exc).__name__}: {exc}")
            return None
        answers[response.status_code] += 1
        if response.status_code not in (200, 201, 409):
            errors.append(f"POST {path}: {response.status_code} {response.content[:300]!r}")
        return response

    def driver(incident: Incident) -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
        try:
            for _ in range(CYCLES):
                started = call(client, f"/api/v1/incidents/{incident.pk}/remediate/")
                rem = started.json().get("id") if started is not None and \
                    started.status_code in (200, 201) else None
                if rem is None:
                    continue
                call(client, f"/api/v1/remediations/{rem}/approve/")
                time.sleep(random.uniform(0, 0.05))  # let the worker start a step or not
                call(client, f"/api/v1/remediations/{rem}/cancel/")
        finally:
            connection.close()

    def clicker(incident: Incident) -> None:
        # A second person on the same incident, pressing approve and cancel as they come.
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
        try:
            while not drivers_done.is_set():
                call(client, f"/api/v1/incidents/{incident.pk}/"
                             f"{random.choice(['approve', 'cancel'])}/")
        finally:
            connection.close()

    def worker() -> None:
        try:
            while not (drivers_done.is_set() and messages.empty()):
                try:
                    step_id, reason, due = messages.get(timeout=0.1)
                except queue.Empty:
                    continue
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    engine.step_run(step_id, reason)
                except Exception as exc:
                    errors.append(f"step {step_id}: {type(exc).__name__}: {exc}")
        finally:
            connection.close()

    with mock.patch.object(tasks.run_step, "apply_async", side_effect=queued):
        threads = [threading.Thread(target=worker) for _ in range(3)]
        people = [threading.Thread(target=clicker, args=(i,)) for i in fleet]
        drivers = [threading.Thread(target=driver, args=(i,)) for i in fleet]
        for t in threads + people + drivers:
            t.start()
        for t in drivers:
            t.join(timeout=240)
        drivers_done.set()
        for t in threads + people:
            t.join(timeout=60)

    assert not errors, errors[:5]
    assert answers[201] >= len(fleet)  # the cycles did run (and did not all bounce off a 409)
    # No step failed: the sim fleet does what it is asked; a failure here was a collision.
    assert not Step.objects.filter(status=Step.Status.FAILED).exists(), list(
        Step.objects.filter(status=Step.Status.FAILED).values_list("error", flat=True))
    assert not Remediation.objects.filter(status=Remediation.Status.FAILED).exists()
    # Each remediation approved at most once and cancelled at most once.
    per_rem = Counter(AuditEntry.objects.filter(
        verb__in=["remediation.approved", "remediation.cancelled"]).values_list(
        "remediation_id", "verb"))
    assert per_rem and max(per_rem.values()) == 1
    # Each outside action of each step made (and recorded as made) once.
    calls = Counter(AuditEntry.objects.exclude(call="").filter(ok=True, step__isnull=False)
                    .values_list("step_id", "verb", "target"))
    assert not calls or max(calls.values()) == 1, calls.most_common(3)
    result = audit_verify()
    assert result.ok and result.checked == AuditEntry.objects.count(), str(result)


def test_a_deadlock_lost_is_run_again(fleet: list[Incident]) -> None:
    # Two transactions lock two rows in opposite orders: PostgreSQL aborts one ("deadlock
    # detected"); retry_transient runs it again and both end with their change made.
    from collectors.models import Node
    from incidents.retry import retry_transient

    a, b = (Node.objects.get(name=n).pk for n in NODES[:2])
    both_hold_one = threading.Barrier(2)
    done: list[str] = []
    failures: list[str] = []
    runs: Counter[str] = Counter()

    @retry_transient
    def lock_both(first: int, second: int, label: str) -> None:
        from django.db import transaction

        runs[label] += 1
        with transaction.atomic():
            Node.objects.select_for_update().get(pk=first)
            if runs[label] == 1:
                both_hold_one.wait(timeout=10)
            Node.objects.select_for_update().get(pk=second)
            Node.objects.filter(pk=first).update(pool=label)
        done.append(label)

    def run(first: int, second: int, label: str) -> None:
        try:
            lock_both(first, second, label)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(a, b, "ab")),
               threading.Thread(target=run, args=(b, a, "ba"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures and sorted(done) == ["ab", "ba"]
    assert sorted(runs.values()) == [1, 2]  # one of them lost the deadlock and ran again


def test_a_database_error_in_a_step_is_not_its_failure(fleet: list[Incident]) -> None:
    # The step's run meets a real database error while recording its outside call (here a
    # lock timeout behind another transaction holding the audit lock): the step is queued
    # again, spends none of its attempts, and succeeds when run again.
    from django.db import transaction

    from incidents.audit import audit_lock
    from incidents.remediation.steps import EXECUTORS

    rem = fleet[0].remediations.get()
    with mock.patch.object(tasks.run_step, "apply_async"):
        transitions.remediation_approve(rem.pk, None, actor="user:test")
    step = rem.steps.get(order=1)
    holding, release = threading.Event(), threading.Event()

    def hold_audit_lock() -> None:
        try:
            with transaction.atomic():
                audit_lock()
                holding.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    real = EXECUTORS[step.kind]

    def blocked(ctx: Any) -> Any:
        holder = threading.Thread(target=hold_audit_lock)
        holder.start()
        holding.wait(timeout=10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        try:
            return real(ctx)
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = 0")
            release.set()
            holder.join()

    with mock.patch.dict(EXECUTORS, {step.kind: blocked}), \
            mock.patch.object(tasks.run_step, "apply_async") as queued:
        assert engine.step_run(step.pk) == "database error; queued again"
    step.refresh_from_db()
    assert step.status == Step.Status.RUNNING and step.attempts == 1 and not step.error
    assert step.lease_until is None and "database error" in step.detail
    queued.assert_called_once_with(args=[step.pk, "recheck"], countdown=5.0)
    with mock.patch.object(tasks.run_step, "apply_async"):
        assert engine.step_run(step.pk, "recheck") == "succeeded"
    assert audit_verify().ok
