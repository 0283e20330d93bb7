"""The audit trail: hash chain, tamper detection, ``fleetwatch audit verify``, request ids.

Runs on PostgreSQL under ``make test`` (the trigger tests need it); on SQLite those are skipped
and the rest still runs.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import UTC, datetime
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, connections, transaction
from django.test import Client
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from collectors import services as collectors
from collectors.request_id import current_request_id, request_id_scope
from collectors.roles import actor_from_request, actor_name
from collectors.sim.fleet import SimFleet
from incidents import lifecycle
from incidents.audit import audit_record, audit_verify
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Remediation, Step
from incidents.remediation import engine
from tests.conftest import token_for

pytestmark = pytest.mark.django_db

DIAG = Diagnosis(root_cause="gpu_hardware", nodes=("gpu-003",), confidence=0.97,
                 playbook="replace_node", explanation="XID 79 on gpu-003",
                 detected_at=datetime(2026, 12, 2, 10, 0, tzinfo=UTC), jobs=("3001",))
TRIGGER = "incidents_auditentry_append_only"

postgres_only = pytest.mark.skipif(connection.vendor != "postgresql",
                                   reason="the append-only trigger exists on PostgreSQL only")


def _entries(n: int) -> list[AuditEntry]:
    return [audit_record(f"test.{i}", f"node gpu-{i:03d}", call=f"scontrol update {i}",
                         result="ok", duration_ms=i * 1.5, data={"i": i, "big": 1e16})
            for i in range(n)]


def _tamper(sql: str, params: list[Any]) -> None:
    """What an attacker with SQL access does: the trigger off, the change, the trigger on.
    The test transaction rolls all of it back."""
    with connection.cursor() as cursor:
        # Django's foreign keys are deferred: run their pending checks now, or PostgreSQL
        # refuses to ALTER a table with trigger events still queued in this transaction.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute(f"ALTER TABLE incidents_auditentry DISABLE TRIGGER {TRIGGER}")
        cursor.execute(sql, params)
        cursor.execute(f"ALTER TABLE incidents_auditentry ENABLE TRIGGER {TRIGGER}")
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")


def _run_playbook(incident: Any, capture: Any, deadline_s: float = 60.0) -> Remediation:
    """Run each step here (not on a broker) until the remediation ends or stops."""
    rem = incident.remediations.get()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        rem.refresh_from_db()
        if rem.status != Remediation.Status.RUNNING:
            return rem
        step = rem.steps.exclude(status__in=Step.DONE).order_by("order").first()
        if step is None:
            return rem
        with capture():  # the next step is queued on commit: keep it off the broker
            engine.step_run(step.pk, "poll" if step.status == Step.Status.WAITING else "start")
        time.sleep(0.02)
    return rem


# --- the chain ------------------------------------------------------------------------------


def test_each_entry_chains_off_the_one_before() -> None:
    first, second, third = _entries(3)
    assert first.prev_hash == "" and re.fullmatch(r"[0-9a-f]{64}", first.hash)
    assert second.prev_hash == first.hash and third.prev_hash == second.hash
    stored = AuditEntry.objects.get(pk=second.pk)  # what verify reads back is what was hashed
    assert (stored.hash, stored.duration_ms, stored.data) == (second.hash, 1.5, second.data)
    result = audit_verify()
    assert result.ok and result.checked == 3 and result.head == third.hash


def test_a_real_remediation_leaves_a_chain_that_verifies(
    sim_fleet: SimFleet, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.FLEETWATCH_SIM_SPEED = 2000.0  # grace periods and provisioning in milliseconds
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(collectors.cluster_default().pk, DIAG)
    _run_playbook(incident, django_capture_on_commit_callbacks)

    calls = AuditEntry.objects.exclude(call="")
    assert {"notify", "slurm.drain"} <= set(calls.values_list("verb", flat=True))
    # Every outside call says how long it took; state changes made no call and have no time.
    assert not calls.filter(duration_ms__isnull=True).exists()
    assert all(ms >= 0 for ms in calls.values_list("duration_ms", flat=True))
    assert not AuditEntry.objects.filter(call="", duration_ms__isnull=False).exists()
    result = audit_verify()
    assert result.ok, str(result)
    assert result.checked == AuditEntry.objects.count() >= 6


# --- tampering ------------------------------------------------------------------------------


@postgres_only
def test_the_table_refuses_update_and_delete_from_any_sql_session() -> None:
    entry = _entries(1)[0]
    for sql in ("UPDATE incidents_auditentry SET result = 'x' WHERE id = %s",
                "DELETE FROM incidents_auditentry WHERE id = %s"):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), \
                connection.cursor() as cursor:
            cursor.execute(sql, [entry.pk])
    assert AuditEntry.objects.get(pk=entry.pk).result == "ok"


@postgres_only
def test_a_changed_entry_is_named() -> None:
    entries = _entries(5)
    _tamper("UPDATE incidents_auditentry SET result = 'nothing happened' WHERE id = %s",
            [entries[2].pk])
    result = audit_verify()
    assert not result.ok
    assert (result.bad_id, result.reason) == (entries[2].pk, "hash mismatch (entry changed)")
    assert result.checked == 2


@postgres_only
def test_a_changed_entry_with_its_hash_recomputed_breaks_the_next_link() -> None:
    """An attacker who knows the algorithm rewrites the row and its hash: the next entry still
    points at the old hash."""
    from incidents.audit import entry_hash

    entries = _entries(4)
    victim = AuditEntry.objects.filter(pk=entries[1].pk).values(
        "at", "actor", "request_id", "verb", "target", "call", "ok", "result", "duration_ms",
        "data", "incident_id", "remediation_id", "step_id").get()
    victim["actor"] = "system"
    victim["result"] = "forged"
    forged = entry_hash(victim, entries[1].prev_hash)
    _tamper("UPDATE incidents_auditentry SET result = 'forged', hash = %s WHERE id = %s",
            [forged, entries[1].pk])
    result = audit_verify()
    assert (result.ok, result.bad_id) == (False, entries[2].pk)
    assert result.reason == (f"prev_hash does not match entry {entries[1].pk} "
                             "(entry removed or reordered)")


@postgres_only
def test_a_removed_entry_is_a_broken_link() -> None:
    entries = _entries(5)
    _tamper("DELETE FROM incidents_auditentry WHERE id = %s", [entries[2].pk])
    result = audit_verify()
    assert (result.ok, result.bad_id) == (False, entries[3].pk)
    assert result.reason == (f"prev_hash does not match entry {entries[1].pk} "
                             "(entry removed or reordered)")


def test_verify_command_exit_codes() -> None:
    entries = _entries(3)
    out = StringIO()
    call_command("fleetwatch", "audit", "verify", stdout=out)
    assert out.getvalue().startswith("audit trail OK: 3 entries")
    if connection.vendor != "postgresql":
        return
    _tamper("UPDATE incidents_auditentry SET target = 'gpu-999' WHERE id = %s", [entries[1].pk])
    err = StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("fleetwatch", "audit", "verify", stdout=StringIO(), stderr=err)
    assert exited.value.code == 1
    assert f"entry {entries[1].pk}: hash mismatch (entry changed)" in err.getvalue()


def test_entries_from_before_the_chain_are_counted_but_only_as_a_prefix() -> None:
    def legacy() -> AuditEntry:  # as migration 0002 left rows written before it
        return AuditEntry.objects.create(actor="system", verb="old", target="x")

    legacy(), legacy()
    chained = _entries(2)
    result = audit_verify()
    assert (result.ok, result.checked, result.unchained) == (True, 2, 2)
    assert "2 earlier entries predate the hash chain" in str(result)
    late = legacy()  # an unhashed row after the chain began is not "legacy": it is forged
    result = audit_verify()
    assert (result.ok, result.bad_id) == (False, late.pk)
    assert f"prev_hash does not match entry {chained[1].pk}" in result.reason


def test_an_empty_trail_verifies() -> None:
    result = audit_verify()
    assert result.ok and result.checked == 0
    assert str(result) == "audit trail OK: 0 entries"


# --- concurrency ----------------------------------------------------------------------------


@pytest.mark.skipif(connection.vendor == "sqlite", reason=(
    "the SQLite test database is in memory with a shared cache, which answers a second writer "
    "'table is locked' at once instead of waiting; the embedded file database waits (BEGIN "
    "IMMEDIATE with a busy timeout)"))
@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_form_one_chain() -> None:
    """Writers in their own transactions (and connections) at once: none may chain off an
    entry another has chained off already. Each holds its transaction open a moment after
    appending, the window in which an unserialized writer would read a stale last hash."""
    threads_n, per_thread = 6, 8
    errors: list[BaseException] = []
    start = threading.Barrier(threads_n)

    def writer(n: int) -> None:
        try:
            start.wait()
            for i in range(per_thread):
                with transaction.atomic():
                    audit_record("test.concurrent", f"writer {n}", result=str(i))
                    time.sleep(0.002)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    hashes = list(AuditEntry.objects.order_by("id").values_list("prev_hash", "hash"))
    assert len(hashes) == threads_n * per_thread
    assert len({prev for prev, _ in hashes}) == len(hashes)  # no two share a predecessor
    result = audit_verify()
    assert result.ok and result.checked == threads_n * per_thread, str(result)


# --- request ids ----------------------------------------------------------------------------


@pytest.fixture
def awaiting(sim_fleet: SimFleet, settings: Any, django_capture_on_commit_callbacks: Any) -> Any:
    settings.FLEETWATCH_POLICY_MODE = "approve"
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(collectors.cluster_default().pk, DIAG)
    return incident


def test_a_given_request_id_comes_back_and_lands_in_the_audit(
    client: Client, operator: Any, awaiting: Any, django_capture_on_commit_callbacks: Any
) -> None:
    client.force_login(operator)
    rem = awaiting.remediations.get()
    with django_capture_on_commit_callbacks():
        response = client.post(f"/incidents/{awaiting.pk}/approve", {"remediation": rem.pk},
                               HTTP_X_REQUEST_ID="lb-7f3a.approve_1")
    assert response["X-Request-ID"] == "lb-7f3a.approve_1"
    entry = AuditEntry.objects.get(verb="remediation.approved")
    assert (entry.actor, entry.request_id) == ("user:olivia", "lb-7f3a.approve_1")
    assert audit_verify().ok
    assert current_request_id() == ""  # the request's id does not leak past it


@pytest.mark.parametrize("given", [None, "has spaces", "x" * 65, "semi;colon", ""])
def test_a_missing_or_odd_request_id_is_replaced_by_a_new_one(client: Client,
                                                              given: str | None) -> None:
    headers = {} if given is None else {"HTTP_X_REQUEST_ID": given}
    first = client.get("/healthz", **headers)["X-Request-ID"]
    second = client.get("/healthz", **headers)["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second


def test_request_id_defaults_to_the_current_one_and_can_be_given() -> None:
    assert audit_record("test.none", "x").request_id == ""
    with request_id_scope("outer"):
        assert audit_record("test.scoped", "x").request_id == "outer"
        with request_id_scope("inner"):
            assert current_request_id() == "inner"
        assert audit_record("test.given", "x", request_id="explicit").request_id == "explicit"
    assert current_request_id() == ""


def test_a_celery_task_audits_under_its_own_task_id(
    sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any
) -> None:
    from incidents.tasks import run_step

    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(collectors.cluster_default().pk, DIAG)
    notify = incident.remediations.get().steps.get(order=1)
    # apply() runs the task here, through the same prerun/postrun signals a worker sends.
    with request_id_scope("web-1"), django_capture_on_commit_callbacks():
        run_step.apply(args=[notify.pk], task_id="0b5e-task")
        assert current_request_id() == "web-1"  # restored after the task
    ids = set(AuditEntry.objects.filter(step=notify).values_list("request_id", flat=True))
    assert ids == {"task:0b5e-task"}


# --- actors ---------------------------------------------------------------------------------


class _WhoAmI(APIView):
    def post(self, request: Request) -> Response:
        return Response({"actor": actor_from_request(request)})


def test_actor_names_a_token_by_its_name_and_a_session_as_the_user(operator: Any) -> None:
    token_key = token_for(operator, name="chatops-bot")
    factory = APIRequestFactory()
    by_token = _WhoAmI.as_view()(factory.post("/x", {}, HTTP_AUTHORIZATION=f"Token {token_key}"))
    assert by_token.data == {"actor": "token:chatops-bot"}
    assert token_key not in str(by_token.data)

    session = factory.post("/x", {})
    session.user = operator  # what AuthenticationMiddleware leaves for a plain Django view
    assert actor_from_request(session) == "user:olivia"
    assert actor_name(None) == "system" and actor_name(operator) == "user:olivia"


# --- outside calls --------------------------------------------------------------------------


def test_every_outside_call_is_audited_with_its_duration_even_when_it_blows_up() -> None:
    from collectors.clients.base import ActionResult, ClientError
    from incidents.remediation.steps import StepContext

    seen: list[tuple[str, str | None, float | None]] = []
    ctx = StepContext(incident_id=1, root_cause="gpu_hardware", explanation="", nodes=["n1"],
                      clients=None, grace_seconds=0, state={}, previous={},  # type: ignore[arg-type]
                      audit=lambda verb, target, result, error, ms: seen.append((verb, error, ms)))

    def slow() -> ActionResult:
        time.sleep(0.02)
        return ActionResult(call="scontrol update nodename=n1 state=DRAIN", changed=True)

    def refused() -> ActionResult:
        raise ClientError("slurmctld said no", permanent=True)

    def buggy() -> ActionResult:
        raise KeyError("nodes")

    ctx.call("slurm.drain", "n1", slow)
    for target, fn in (("n2", refused), ("n3", buggy)):
        with pytest.raises((ClientError, KeyError)):
            ctx.call("slurm.drain", target, fn)
    [(_, ok_error, ok_ms), (_, refused_error, _), (_, bug_error, _)] = seen
    assert ok_error is None and ok_ms is not None and 15 <= ok_ms < 1000
    assert refused_error == "slurmctld said no" and bug_error == "KeyError: 'nodes'"
    assert all(ms is not None and ms >= 0 for *_, ms in seen)


def test_a_step_run_again_after_a_crash_skips_the_calls_it_had_completed() -> None:
    from collectors.clients.base import ActionResult
    from incidents.remediation.steps import StepContext

    made: list[str] = []
    saved: list[str] = []

    def drain() -> ActionResult:
        made.append("drain")
        return ActionResult(call="scontrol update nodename=n1 state=DRAIN", changed=True)

    def ctx(done: set[str]) -> StepContext:
        return StepContext(incident_id=1, root_cause="gpu_hardware", explanation="",
                           nodes=["n1"], clients=None, grace_seconds=0,  # type: ignore[arg-type]
                           state={}, previous={}, audit=lambda *a: None, done_calls=done,
                           on_call_done=saved.append)

    ctx(set()).call("slurm.drain", "n1", drain)
    assert saved == ["slurm.drain n1"]  # recorded as soon as the call returned
    # The worker died before the step saved its result; the next run has the record.
    again = ctx(set(saved)).call("slurm.drain", "n1", drain)
    assert made == ["drain"] and not again.changed and "earlier run" in again.detail
