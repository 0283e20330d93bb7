"""Fail-slow, live: the scan (incidents.slowness) over the simulated fleet's telemetry history,
the incident it opens with its numbers, and the playbook that replaces the node at its job's
next checkpoint once a person approves (run step by step in this process, no broker).

The fleet is seeded half an hour ago (a ManualClock), so its jobs have a history to read, and
a straggler is injected twenty minutes ago; from then on the fleet runs on the real clock.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.utils import timezone

from collectors import services as collectors
from collectors.clients.base import SlurmJob, SlurmNode
from collectors.clock import ManualClock
from collectors.knowledge import RootCause
from collectors.models import Signal
from collectors.sim.fleet import SimFleet, inject_slow, set_source_down
from incidents import lifecycle, slowness
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Incident, Remediation, Step
from incidents.remediation import engine, transitions
from incidents.remediation.steps import Done, Wait, wait_checkpoint
from tests.unit.test_remediation import FakeWorld, ctx_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(settings: Any, tmp_path: Any) -> SimFleet:
    settings.FLEETWATCH_SIM_STATE = tmp_path / "sim-fleet.json"
    settings.FLEETWATCH_SIM_SPEED = 400.0  # a checkpoint every 0.15 s, a 120 s grace in 0.3 s
    clock = ManualClock(start=time.time() - 30 * 60)
    fleet = SimFleet(settings.FLEETWATCH_SIM_STATE, 400.0, clock)
    fleet.seed()
    clock.advance(10 * 60)
    with fleet.transaction() as state:  # every GPU of gpu-003 held at a power cap since then
        inject_slow(state, "gpu-003", -1, "power-cap", 35, clock.now())
    fleet = SimFleet(settings.FLEETWATCH_SIM_STATE, 400.0)  # the real clock from here on
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    return fleet


def test_the_scan_opens_a_fail_slow_incident_that_explains_the_slowness(fleet: SimFleet) -> None:
    cluster = collectors.cluster_default()
    (incident,) = slowness.fail_slow_scan(cluster.pk)
    assert incident.root_cause == RootCause.FAIL_SLOW and incident.nodes == ["gpu-003"]
    assert incident.jobs == ["3001"] and incident.playbook == "replace_at_checkpoint"
    text = incident.explanation
    assert text.startswith("gpu-003 is slower than the other 7 nodes of job 3001 (alice): "
                           "GPUs 0-7: SM clock ")
    assert "vs its peers' median 1,9" in text and "power " in text
    assert "clock-event reasons: sw power cap" in text
    # Two figures that agree: surer than one, and still below automatic repair.
    assert 0.6 < incident.confidence < lifecycle.AUTO_REMEDIATION_MIN_CONFIDENCE
    assert not incident.remediations.exists()
    # Its figures are the incident's signals, with the numbers.
    figures = list(incident.signals.filter(kind=slowness.EVIDENCE_KIND))
    clock = next(s for s in figures if s.data["figure"] == "SM clock")
    assert clock.data["reading"] < 0.85 * clock.data["peers_median"]
    assert clock.data["seconds"] >= 10 * 60 and clock.message.startswith("gpu-003 GPUs 0-7")
    # The next scan finds the same straggler: the same incident, no new signals.
    assert slowness.fail_slow_scan(cluster.pk) == [incident]
    assert incident.signals.count() == len(figures)


def test_the_beat_scans_every_cluster(fleet: SimFleet, settings: Any) -> None:
    from celery import current_app

    from collectors import queueing
    from fleetwatch.celery import _beat_schedule, app

    def scan_entry() -> dict[str, Any] | None:
        before = dict(app.conf.beat_schedule or {})
        try:
            _beat_schedule(app)
            return app.conf.beat_schedule.get("fail-slow-scan")
        finally:
            app.conf.beat_schedule = before

    settings.FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS = 120
    entry = scan_entry()
    assert entry is not None and entry["task"] == queueing.FAIL_SLOW_SCAN
    assert entry["schedule"] == 120
    settings.FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS = 0
    assert scan_entry() is None  # turned off
    # The task the entry names runs the scan of every cluster.
    current_app.loader.import_default_modules()
    current_app.tasks[queueing.FAIL_SLOW_SCAN].apply()
    assert Incident.objects.filter(root_cause=RootCause.FAIL_SLOW, nodes=["gpu-003"]).count() == 1
    assert slowness.fail_slow_scan_all() == {collectors.cluster_default().name: 1}


def test_a_node_whose_open_incident_has_another_cause_is_not_called_slow(
        fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    cluster = collectors.cluster_default()
    with django_capture_on_commit_callbacks():
        lifecycle.incident_record(cluster.pk, Diagnosis(
            "gpu_hardware", ("gpu-003",), 0.6, "replace_node", "a GPU fault", timezone.now()))
    assert slowness.fail_slow_scan(cluster.pk) == []
    assert not Incident.objects.filter(root_cause=RootCause.FAIL_SLOW).exists()


def test_telemetry_that_cannot_be_read_finds_no_straggler(fleet: SimFleet) -> None:
    with fleet.transaction() as state:
        set_source_down(state, "telemetry", True)
    assert slowness.fail_slow_scan(collectors.cluster_default().pk) == []
    assert not Incident.objects.exists()
    assert not Signal.objects.filter(kind=slowness.EVIDENCE_KIND).exists()


def drive(rem: Remediation, capture: Any, rounds: int = 400) -> Remediation:
    for _ in range(rounds):
        rem.refresh_from_db()
        if rem.status != Remediation.Status.RUNNING:
            return rem
        step = rem.steps.exclude(status__in=Step.DONE).order_by("order").first()
        if step is None:
            return rem
        with capture():
            engine.step_run(step.pk, "poll")
        for source in ("slurm", "kubernetes", "telemetry"):
            collectors.collect_source(source)
        time.sleep(0.02)
    rem.refresh_from_db()
    return rem


def test_the_node_is_replaced_at_the_jobs_next_checkpoint_once_a_person_approves(
        fleet: SimFleet, operator: Any, django_capture_on_commit_callbacks: Any) -> None:
    (incident,) = slowness.fail_slow_scan(collectors.cluster_default().pk)
    with django_capture_on_commit_callbacks():  # a person starts it
        rem = transitions.remediation_open(incident, actor="user:olivia").remediation
    rem = drive(rem, django_capture_on_commit_callbacks)
    # Notified at once; the replacement waits for a person (replace_working: approve).
    assert rem.status == "awaiting_approval"
    assert rem.steps.get(kind="notify").status == "succeeded"
    step = rem.steps.get(kind="wait_checkpoint")
    assert step.status == "awaiting_approval" and step.mode == "approve"
    assert fleet.snapshot()["jobs"]["3001"]["state"] == "RUNNING"  # nothing stopped yet
    with django_capture_on_commit_callbacks():
        transitions.remediation_approve(rem.pk, operator)
    rem = drive(rem, django_capture_on_commit_callbacks)
    assert rem.status == "succeeded", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    step.refresh_from_db()
    assert "job 3001 saved its checkpoint at step" in step.detail
    assert step.detail.endswith("taking gpu-003 out now")
    verbs = [v for v, _ in AuditEntry.objects.filter(remediation=rem).exclude(call="")
             .order_by("id").values_list("verb", "target")]
    assert verbs[0] == "notify" and verbs.index("slurm.drain") < verbs.index("provider.replace")
    assert "slurm.requeue" in verbs and verbs[-1] == "slurm.resume"
    state = fleet.snapshot()
    assert state["nodes"]["gpu-003"]["pool"] == "rma"
    job = state["jobs"]["3001"]
    assert job["state"] == "RUNNING" and "gpu-003" not in job["nodes"]
    stopped = [e for e in job["history"] if "checkpoint" in e][-1]
    # Stopped by SIGTERM, it saved a checkpoint and resumed from it, elsewhere.
    assert job["resumed_from_step"] == stopped["checkpoint"] == stopped["step"]


def test_the_checkpoint_wait_is_bounded_and_says_why_it_goes_on(settings: Any) -> None:
    settings.FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES = 30
    clock = ManualClock()
    world = FakeWorld(slurm_nodes={"gpu-003": SlurmNode("gpu-003", "ALLOCATED")},
                      jobs=[SlurmJob("77", "train", "kim", "RUNNING", ("gpu-003", "gpu-004"),
                                     checkpoint_step=400)])
    state: dict[str, Any] = {}
    outcome = wait_checkpoint(ctx_for(world, "wait_checkpoint", state, clock=clock))
    assert isinstance(outcome, Wait)
    assert "waiting for the next checkpoint of job 77" in outcome.detail
    assert "last at step 400" in outcome.detail and "30 min left" in outcome.detail
    clock.advance(31 * 60)
    outcome = wait_checkpoint(ctx_for(world, "wait_checkpoint", outcome.result, clock=clock))
    assert isinstance(outcome, Done) and outcome.result["timed_out"]
    assert outcome.detail.startswith("no checkpoint from job 77 in 31 min")


def test_a_checkpoint_line_in_the_jobs_output_ends_the_wait() -> None:
    from incidents.remediation.steps import Facts

    clock = ManualClock()
    world = FakeWorld(jobs=[SlurmJob("77", "train", "kim", "RUNNING", ("gpu-003",))])
    seen: dict[str, tuple[float, int | None] | None] = {"77": None}
    facts = Facts(last_link_change=lambda node: None, mark_rma=lambda node, why: None,
                  last_checkpoint=lambda job: seen[job])
    outcome = wait_checkpoint(ctx_for(world, "wait_checkpoint", {}, clock=clock, facts=facts))
    assert isinstance(outcome, Wait) and "watching its output" in outcome.detail
    seen["77"] = (clock.now() + 5, 1200)
    clock.advance(10)
    outcome = wait_checkpoint(ctx_for(world, "wait_checkpoint", outcome.result, clock=clock,
                                      facts=facts))
    assert isinstance(outcome, Done)
    assert outcome.detail == ("job 77 wrote a checkpoint (step 1200), as its output says: "
                              "taking gpu-003 out now")


def test_a_scan_in_small_groups_of_jobs_finds_the_same(fleet: SimFleet, monkeypatch: Any) -> None:
    from incidents.diagnosis import JobInfo

    monkeypatch.setattr(slowness, "SCAN_NODES", 4)  # each job read on its own
    jobs = [JobInfo(str(i), "u", tuple(f"n{i}-{k}" for k in range(n))) for i, n in
            enumerate((8, 2, 2, 3, 1))]
    assert [[j.id for j in c] for c in slowness._chunks(jobs, 4)] == [
        ["0"], ["1", "2"], ["3", "4"]]
    (incident,) = slowness.fail_slow_scan(collectors.cluster_default().pk)
    assert incident.nodes == ["gpu-003"] and "GPUs 0-7: SM clock" in incident.explanation
