"""Fire drills (incidents.drills) against the simulated fleet, run step by step in this process
(no broker): a drill that passes and changes nothing (observe mode), one that drains and
cordons the canary for real and puts it back (canary mode), one skipped because the canary
runs a job, one that fails (and alerts, and sets the metric), one over its budget, one whose
follow-up died (the watchdog finishes it), a second start while one runs; and a drill's
incident kept apart from the real ones (no real-incident figure, rail or page counts it)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.core import mail
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from collectors import queueing
from collectors import services as collectors
from collectors.clients.base import ClientError
from collectors.env import env_schedule
from collectors.models import Signal
from collectors.push import DRILL_MARK
from collectors.sim.faults import job_finish
from collectors.sim.fleet import SimFleet
from incidents import diagnosing, drills, selectors
from incidents.models import AuditEntry, Delivery, DiagnosisState, Drill, Incident, Remediation, Step
from incidents.remediation import engine, policy
from incidents.remediation.steps import EXECUTORS
from tests.conftest import token_for

pytestmark = pytest.mark.django_db

CANARY = "gpu-016"  # job 3003 (gpu-013..016) finishes in the fixture: its nodes fall idle
WOULD_CALLS = ["notify", "slurm.drain", "k8s.cordon", "k8s.evict", "provider.replace"]


@pytest.fixture
def fleet(sim_fleet: SimFleet, settings: Any) -> SimFleet:
    settings.FLEETWATCH_SIM_SPEED = sim_fleet.speed = 400.0
    settings.FLEETWATCH_DRILL_NODES = [CANARY]
    settings.FLEETWATCH_DRILL_MODE = "observe"
    settings.FLEETWATCH_DRILL_BUDGET_SECONDS = 300.0
    settings.FLEETWATCH_POLICY_MODE = "auto"
    job_finish("3003")
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    return sim_fleet


def queued(callbacks: list[Callable[[], Any]], task: str) -> list[tuple[Any, ...]]:
    return [c.args for c in callbacks if getattr(c, "task", None) == task]  # type: ignore[attr-defined]


def run_drill(capture: Any, *, follow: bool = True, actor: str = "user:olivia") -> Drill:
    """A drill as the workers would run it, each message handled here in turn: started,
    begun (canary checked, fault stored), diagnosed, its steps run, followed to its end."""
    with capture() as started:
        drill = drills.drill_start(trigger=Drill.Trigger.MANUAL, actor=actor).drill
    assert queued(started, queueing.DRILL_BEGIN) == [(drill.pk,)]
    with capture() as begun:
        drills.drill_begin(drill.pk)
    drill.refresh_from_db()
    if drill.status != Drill.Status.RUNNING:
        return drill
    # Diagnosis is marked due as for any stored signal (its run is queued, or was already).
    assert DiagnosisState.objects.get(cluster_id=drill.cluster_id).pending_since is not None
    assert queued(begun, queueing.DRILL_FOLLOW) == [(drill.pk,)]
    with capture():
        diagnosing.diagnosis_run(drill.cluster_id)
    rem = Remediation.objects.filter(incident__drill=drill).first()
    for _ in range(50):
        if rem is None:
            break
        rem.refresh_from_db()
        step = rem.steps.exclude(status__in=Step.DONE).order_by("order").first()
        if rem.status != Remediation.Status.RUNNING or step is None:
            break
        with capture():
            engine.step_run(step.pk, "poll")
    if follow:
        with capture():
            drills.drill_follow(drill.pk)
    drill.refresh_from_db()
    return drill


def node_state(fleet: SimFleet, node: str = CANARY) -> dict[str, Any]:
    state = fleet.snapshot()
    n = state["nodes"][node]
    return {"drained": n["drained"], "reason": n["reason"], "cordoned": n["unschedulable"],
            "pods": sorted(p["name"] for p in state["pods"] if p["node"] == node),
            "replacements": state["replacements"]}


def metrics(client: Client) -> dict[str, float]:
    text = client.get("/metrics").content.decode()
    return {s.name + (str(sorted(s.labels.items())) if s.labels else ""): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


# --- a drill that passes ------------------------------------------------------------------------


def test_observe_drill_runs_the_loop_to_the_provider_and_changes_nothing(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, client: Client) -> None:
    before = node_state(fleet)
    drill = run_drill(django_capture_on_commit_callbacks)

    assert drill.status == Drill.Status.PASSED, drill.reason
    assert (drill.node, drill.mode, drill.reason, drill.over_budget) == (
        CANARY, "observe", "", False)
    # The synthetic fault went through the ingest service, marked as this drill's.
    assert drill.signal is not None and drill.signal.node_name == CANARY
    assert drill.signal.data[DRILL_MARK] == f"{drill.pk}:{drill.nonce}"
    assert "Xid" in drill.signal.message and "79" in drill.signal.message

    # The real pipeline ran: diagnosis, the lifecycle, the policy, the engine.
    incident = Incident.objects.get(drill=drill)
    assert (incident.root_cause, incident.nodes, incident.status) == (
        "gpu_hardware", [CANARY], Incident.Status.RESOLVED)
    assert incident.fingerprint == f"drill-{drill.pk}:gpu_hardware:{CANARY}"
    assert incident.explanation.startswith(f"Fire drill {drill.pk}")
    rem = incident.remediations.get()
    assert (rem.playbook, rem.status) == ("replace_node", Remediation.Status.SUCCEEDED)
    kinds = dict(rem.steps.values_list("kind", "status"))
    # Past the provider: not run (the acceptance checks of the spare and its resume).
    assert kinds.pop("prove_healthy") == kinds.pop("resume") == Step.Status.SKIPPED
    assert set(kinds.values()) == {Step.Status.SUCCEEDED}
    # Each step's words say it was a rehearsal, not that the node was drained.
    drained = rem.steps.get(kind="drain_and_cancel").detail
    assert drained.startswith(f"Rehearsed by fire drill {drill.pk} (no call made): ")

    # Every outside call only recorded, in the playbook's order; none made.
    entries = AuditEntry.objects.filter(remediation=rem).order_by("pk")
    assert [e.verb for e in entries if e.data.get("would_call")] == WOULD_CALLS
    assert not entries.exclude(call="").exists()
    assert AuditEntry.objects.filter(verb="remediation.rehearsed", remediation=rem).exists()
    assert node_state(fleet) == before

    # Timed per phase, each within the whole (the report lists them in the loop's order).
    assert set(drill.phases) == {"inject", "detect", "decide", "first_action", "drain",
                                 "requeue", "replace", "cleanup", "total"}
    assert all(0 <= v <= drill.phases["total"] for v in drill.phases.values())
    assert drill.finished_at is not None and drill.alerted_at is None

    # Nobody paged: no delivery, no webhook event; and the drill's report reads it all.
    assert not Delivery.objects.exists()
    report = selectors.drill_report(drill)
    assert next(t for t in report["timeline"] if t["type"] == "would")["title"] == \
        "would call notify on-call"
    assert metrics(client)["fleetwatch_drill_last_result"] == 1.0


def test_a_drill_incident_counts_towards_no_real_figure_rail_or_page(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, client: Client,
        settings: Any, operator: Any) -> None:
    settings.FLEETWATCH_STORM_INCIDENTS = 1  # one real incident would engage the brake
    settings.FLEETWATCH_BUDGET_MAX_NODES = 1
    with django_capture_on_commit_callbacks() as callbacks:
        drill = drills.drill_start(trigger=Drill.Trigger.MANUAL, actor="user:olivia").drill
    with django_capture_on_commit_callbacks():
        drills.drill_begin(drill.pk)
    with django_capture_on_commit_callbacks() as callbacks:
        diagnosing.diagnosis_run(drill.cluster_id)
    # Mid-drill: its remediation runs and holds the canary, yet no rail counts it.
    rem = Remediation.objects.get(incident__drill=drill)
    assert rem.status == Remediation.Status.RUNNING and rem.hold_reason == ""
    cluster = drill.cluster_id
    assert policy.storm_count(cluster) == 0
    assert policy.nodes_in_remediation(cluster) == set()
    assert policy.budget_exceeded(cluster, ["gpu-001"]) == ""
    assert policy.remediation_holding(cluster, [CANARY]) is None
    # Not the on-call's: not in the attention area, the open incidents or the repairs.
    needs = selectors.attention()
    assert needs["count"] == 0 and needs["open_incidents"] == []
    assert selectors.repairs_in_flight() == []
    # No webhook event, no page queued.
    assert queued(callbacks, queueing.PAGE_PERSON) == []
    assert not [c for c in callbacks if "incident_event" in getattr(c, "__qualname__", "")]
    samples = metrics(client)
    assert samples["fleetwatch_incidents_opened_total[('root_cause', 'gpu_hardware')]"] == 0
    assert samples[f"fleetwatch_storm_incidents[('cluster', '{drill.cluster.name}')]"] == 0
    assert samples["fleetwatch_drill_running"] == 1
    # Marked on the incidents list, and on its own page.
    pages = Client()
    pages.force_login(operator)
    listing = pages.get("/incidents/").content.decode()
    assert f'href="/drills/{drill.pk}/"' in listing and ">drill</a>" in listing
    page = pages.get(f"/incidents/{rem.incident_id}/").content.decode()
    assert 'data-testid="drill-banner"' in page and "not a real fault" in page
    real_only = pages.get("/incidents/?drill=no").content.decode()
    assert f"incident-row-{rem.incident_id}" not in real_only


# --- canary mode -----------------------------------------------------------------------------------


def test_canary_drill_drains_and_cordons_for_real_then_puts_the_canary_back(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, settings: Any) -> None:
    settings.FLEETWATCH_DRILL_MODE = "canary"
    before = node_state(fleet)
    drill = run_drill(django_capture_on_commit_callbacks, follow=False)
    during = node_state(fleet)
    assert during["drained"] and during["reason"].startswith("fleetwatch: incident ")
    assert during["cordoned"]
    assert during["pods"] == before["pods"]  # evictions stay "would call"
    assert during["replacements"] == {}  # and so does the provider

    with django_capture_on_commit_callbacks():
        drills.drill_follow(drill.pk)
    drill.refresh_from_db()
    assert drill.status == Drill.Status.PASSED, drill.reason
    assert drill.canary_before == {"slurm_state": "IDLE", "slurm_flags": [], "slurm_reason": "",
                                   "k8s_known": True, "k8s_unschedulable": False}
    assert node_state(fleet) == before
    made = list(AuditEntry.objects.exclude(call="").filter(data__drill=drill.pk)
                .values_list("verb", flat=True)) + list(
        AuditEntry.objects.exclude(call="").filter(remediation__incident__drill=drill)
        .values_list("verb", flat=True))
    assert sorted(made) == ["k8s.cordon", "k8s.uncordon", "slurm.drain", "slurm.resume"]
    assert [e["what"] for e in drill.events].count("canary put back") == 2


def test_a_real_fault_on_the_canary_mid_drill_keeps_the_drain_for_its_repair(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, settings: Any) -> None:
    """The drill drained the canary for real; meanwhile a real fault hits it. The real repair
    finds the node drained already (its own drain a no-op): the drill's clean-up must not
    resume the node under it."""
    from incidents import lifecycle
    from incidents.diagnosis import Diagnosis

    settings.FLEETWATCH_DRILL_MODE = "canary"
    drill = run_drill(django_capture_on_commit_callbacks, follow=False)
    with django_capture_on_commit_callbacks():
        real, _ = lifecycle.incident_record(drill.cluster_id, Diagnosis(
            root_cause="gpu_memory", nodes=(CANARY,), confidence=0.95, playbook="reset_gpu",
            explanation="uncorrectable ECC", detected_at=drill.started_at))
    assert real.drill_id is None
    with django_capture_on_commit_callbacks() as callbacks:
        drills.drill_follow(drill.pk)
    drill.refresh_from_db()
    assert drill.status == Drill.Status.FAILED
    assert f"was not put back: in real incident {real.pk} now" in drill.reason
    assert node_state(fleet)["drained"] and node_state(fleet)["cordoned"]
    assert queued(callbacks, queueing.DRILL_ALERT) == [(drill.pk,)]


def test_canary_mode_leaves_a_node_someone_else_drained_alone(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, settings: Any) -> None:
    settings.FLEETWATCH_DRILL_MODE = "canary"
    with fleet.transaction() as state:
        state["nodes"][CANARY].update(drained=True, reason="admin: reseating cables")
    drill = run_drill(django_capture_on_commit_callbacks)
    assert drill.status == Drill.Status.SKIPPED
    assert "drained in Slurm (admin: reseating cables)" in drill.reason
    assert node_state(fleet)["reason"] == "admin: reseating cables"


# --- skipped, failed, over budget, stuck -----------------------------------------------------------


def test_a_canary_with_a_job_is_skipped_and_nothing_is_touched(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, settings: Any) -> None:
    settings.FLEETWATCH_DRILL_NODES = ["gpu-001"]
    before = fleet.snapshot()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        drill = run_drill(django_capture_on_commit_callbacks)
    assert drill.status == Drill.Status.SKIPPED
    assert drill.reason == "no canary free: gpu-001: runs job 3001 (alice, RUNNING)"
    assert drill.signal is None and drill.node == ""
    assert not Incident.objects.exists()
    assert fleet.snapshot()["jobs"]["3001"]["state"] == "RUNNING"
    assert fleet.snapshot()["nodes"]["gpu-001"] == before["nodes"]["gpu-001"]
    assert queued(callbacks, queueing.DRILL_ALERT) == []  # skipped is not failed
    assert AuditEntry.objects.filter(verb="drill.skipped").count() == 1


def test_without_drill_nodes_an_idle_node_is_the_canary(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, settings: Any) -> None:
    settings.FLEETWATCH_DRILL_NODES = []
    drill = run_drill(django_capture_on_commit_callbacks)
    assert drill.status == Drill.Status.PASSED, drill.reason
    assert drill.node == "gpu-013"  # the first idle one; gpu-001..012 run jobs
    refused = [e["detail"] for e in drill.events if e["what"] == "candidate refused"]
    assert refused[0] == "gpu-001: runs job 3001 (alice, RUNNING)" and len(refused) == 12


def test_a_failed_drill_alerts_the_on_call_and_sets_the_metric(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, client: Client,
        settings: Any, monkeypatch: Any) -> None:
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.FLEETWATCH_NOTIFY_EMAIL = ["oncall@example.com"]
    settings.FLEETWATCH_BASE_URL = "https://fleetwatch.example"

    def broken(ctx: Any) -> Any:
        raise ClientError("slurmctld refused the connection", permanent=True)

    monkeypatch.setitem(EXECUTORS, "drain_and_cancel", broken)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        drill = run_drill(django_capture_on_commit_callbacks)
    assert drill.status == Drill.Status.FAILED
    assert drill.reason.startswith("remediation ") and "failed at step 2 drain_and_cancel: " \
        "slurmctld refused the connection" in drill.reason
    incident = Incident.objects.get(drill=drill)
    assert incident.status == Incident.Status.RESOLVED  # cleaned up
    assert mail.outbox == []  # the drill's own notify step only said it would

    # The alert: queued as the drill failed; one message per on-call channel, through the
    # delivery model.
    assert queued(callbacks, queueing.DRILL_ALERT) == [(drill.pk,)]
    drills.drill_alert(drill.pk)
    drills.drill_alert(drill.pk)  # once
    [sent] = mail.outbox
    assert sent.subject == f"[FleetWatch] FleetWatch fire drill {drill.pk} failed on {CANARY}"
    assert "slurmctld refused the connection" in sent.body
    assert f"https://fleetwatch.example/drills/{drill.pk}/" in sent.body
    [row] = Delivery.objects.all()
    assert (row.channel, row.status, row.event, row.incident_id) == (
        "email", "delivered", "drill.failed", incident.pk)
    drill.refresh_from_db()
    assert drill.alerted_at is not None
    samples = metrics(client)
    assert samples["fleetwatch_drill_last_result"] == 0.0
    assert samples["fleetwatch_drill_failures_total"] == 1.0
    assert samples["fleetwatch_drill_last_success_timestamp_seconds"] == 0.0


def test_a_drill_that_finishes_past_its_budget_fails_over_budget(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, client: Client) -> None:
    drill = run_drill(django_capture_on_commit_callbacks, follow=False)
    rem = Remediation.objects.get(incident__drill=drill)
    Drill.objects.filter(pk=drill.pk).update(deadline=rem.finished_at - timedelta(seconds=1))
    with django_capture_on_commit_callbacks() as callbacks:
        drills.drill_follow(drill.pk)
    drill.refresh_from_db()
    assert drill.status == Drill.Status.FAILED and drill.over_budget
    assert drill.reason.startswith("took ") and "over its budget of 300 s" in drill.reason
    assert queued(callbacks, queueing.DRILL_ALERT) == [(drill.pk,)]
    assert metrics(client)["fleetwatch_drill_last_result"] == 0.0


def test_a_drill_nothing_follows_any_more_is_finished_by_the_watchdog(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    """A worker died with the drill's messages: diagnosis never ran, nothing follows it. The
    watchdog finishes it once its budget is spent, saying where it stood."""
    with django_capture_on_commit_callbacks():
        drill = drills.drill_start(trigger=Drill.Trigger.SCHEDULE, actor="system").drill
    with django_capture_on_commit_callbacks():
        drills.drill_begin(drill.pk)
    with django_capture_on_commit_callbacks() as callbacks:
        assert drills.drills_rescue() == [drill.pk]  # never followed: followed now
    drill.refresh_from_db()
    assert drill.status == Drill.Status.RUNNING  # within its budget: left running
    assert queued(callbacks, queueing.DRILL_FOLLOW) == [(drill.pk,)]
    with django_capture_on_commit_callbacks():
        assert drills.drills_rescue() == []  # its follow-ups live: no second chain
    Drill.objects.filter(pk=drill.pk).update(deadline=drill.started_at)
    with django_capture_on_commit_callbacks() as callbacks:
        drills.drills_rescue()
    drill.refresh_from_db()
    assert drill.status == Drill.Status.FAILED and drill.over_budget
    assert drill.reason == ("not done within its budget of 300 s "
                            "(FLEETWATCH_DRILL_BUDGET_SECONDS): the fault was stored but no "
                            "incident opened (is diagnosis running?)")
    assert queued(callbacks, queueing.DRILL_ALERT) == [(drill.pk,)]
    # Its fault, still in the diagnosis window, opens nothing once the drill is over.
    with django_capture_on_commit_callbacks():
        diagnosing.diagnosis_run(drill.cluster_id)
    assert not Incident.objects.exists()


def test_a_lost_start_is_begun_again_by_the_watchdog(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    with django_capture_on_commit_callbacks():
        drill = drills.drill_start(trigger=Drill.Trigger.SCHEDULE, actor="system").drill
    Drill.objects.filter(pk=drill.pk).update(started_at=drill.started_at - timedelta(minutes=1))
    with django_capture_on_commit_callbacks():
        drills.drills_rescue()
        drills.drills_rescue()  # a second look injects nothing more
    drill.refresh_from_db()
    assert drill.signal_id is not None and drill.node == CANARY
    assert AuditEntry.objects.filter(verb="drill.injected").count() == 1


# --- one at a time -----------------------------------------------------------------------------


def test_a_second_start_while_one_runs_starts_nothing(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, operator: Any,
        viewer: Any) -> None:
    with django_capture_on_commit_callbacks():
        first = drills.drill_start(trigger=Drill.Trigger.MANUAL, actor="user:olivia")
    again = drills.drill_start(trigger=Drill.Trigger.SCHEDULE, actor="system")
    assert first.created and not again.created and again.drill.pk == first.drill.pk
    assert drills.drill_scheduled() == f"drill {first.drill.pk} is still running"

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator)}")
    answer = api.post("/api/v1/drills/", format="json")
    assert answer.status_code == 409
    assert answer.json()["drill"] == first.drill.pk and "no second drill" in answer.json()["detail"]

    page = Client()
    page.force_login(operator)
    shown = page.post("/drills/run", follow=True).content.decode()
    assert f"Fire drill #{first.drill.pk} is already running" in shown
    as_viewer = Client()
    as_viewer.force_login(viewer)
    assert as_viewer.post("/drills/run").status_code == 403
    assert Drill.objects.count() == 1


def test_the_api_starts_a_drill_and_reports_it(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any, operator: Any) -> None:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator)}")
    with django_capture_on_commit_callbacks() as callbacks:
        created = api.post("/api/v1/drills/", format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    assert (body["status"], body["mode"], body["trigger"], body["requested_by"]) == (
        "running", "observe", "manual", f"token:{operator.username}-1")
    assert queued(callbacks, queueing.DRILL_BEGIN) == [(body["id"],)]
    drill = Drill.objects.get(pk=body["id"])
    Drill.objects.filter(pk=drill.pk).update(status=Drill.Status.FAILED)  # let another start
    drill = run_drill(django_capture_on_commit_callbacks)
    report = api.get(f"/api/v1/drills/{drill.pk}/").json()
    assert report["status"] == "passed" and report["node"] == CANARY
    assert report["incident"] == Incident.objects.get(drill=drill).pk
    assert report["phases"]["total"] == drill.phases["total"]
    assert [s["kind"] for s in report["remediation"]["steps"]][-3:] == [
        "replace_node", "prove_healthy", "resume"]
    assert [t["title"] for t in report["timeline"] if t["type"] == "would"] == [
        f"would call {v} {t}" for v, t in zip(WOULD_CALLS, [
            "on-call", CANARY, CANARY, f"slurm/slurmd-{CANARY}", CANARY], strict=True)]
    listed = api.get("/api/v1/drills/?status=passed").json()
    assert [d["id"] for d in listed["results"]] == [drill.pk]
    incident = api.get(f"/api/v1/incidents/{report['incident']}/").json()
    assert incident["drill"] == drill.pk
    assert api.get("/api/v1/incidents/?drill=false").json()["count"] == 0


# --- the door and the schedule -----------------------------------------------------------------------


def test_a_pushed_signal_cannot_claim_to_be_a_drill(fleet: SimFleet, operator: Any) -> None:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator)}")
    answer = api.post("/api/v1/signals/", {"signals": [{
        "at": "2026-12-05T10:00:00Z", "source": "kernel", "node": "gpu-005",
        "message": "NVRM: Xid (PCI:0000:9b:00): 79, GPU has fallen off the bus.",
        DRILL_MARK: "1:guess"}]}, format="json")
    assert answer.status_code == 403
    assert f"signals[0].{DRILL_MARK}: only FleetWatch's own fire drills" in answer.json()["detail"]
    assert not Signal.objects.filter(source="kernel").exists()


def test_the_schedule_setting_reads_intervals_and_cron() -> None:
    assert env_schedule("S", {}) is None
    assert env_schedule("S", {"S": "6h"}) == 21600.0
    assert env_schedule("S", {"S": "0 3 * * *"}) == "0 3 * * *"
    assert env_schedule("S", {"S": "@daily"}) == "0 0 * * *"
    from django.core.exceptions import ImproperlyConfigured
    for bad in ("6x", "0 25 * * *", "0.5s"):
        with pytest.raises(ImproperlyConfigured):
            env_schedule("S", {"S": bad})


def test_the_beat_schedules_drills_only_when_asked(settings: Any) -> None:
    from celery.schedules import crontab

    from fleetwatch.celery import _beat_schedule, app

    settings.FLEETWATCH_DRILL_SCHEDULE = None
    _beat_schedule(app)
    assert "drill" not in app.conf.beat_schedule
    assert app.conf.beat_schedule["drills-rescue"]["task"] == queueing.DRILLS_RESCUE
    settings.FLEETWATCH_DRILL_SCHEDULE = "30 2 * * 1"
    _beat_schedule(app)
    entry = app.conf.beat_schedule["drill"]
    assert entry["task"] == queueing.DRILL_SCHEDULED
    assert entry["schedule"] == crontab(minute="30", hour="2", day_of_week="1")
    settings.FLEETWATCH_DRILL_SCHEDULE = 3600.0
    _beat_schedule(app)
    assert app.conf.beat_schedule["drill"]["schedule"] == 3600.0
