"""The remediation engine: each playbook against the simulated fleet (run step by step in this
process, so no broker is needed), each executor against recorded fake clients where the
simulation cannot produce the fault, the modes, the safety rails and the ownership rule."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from collectors import services as collectors
from collectors.clients import Clients
from collectors.clients.base import (
    ActionResult,
    ClientError,
    GpuMetric,
    K8sNode,
    NicPort,
    NotFound,
    ProviderStatus,
    SlurmJob,
    SlurmNode,
    SlurmReservation,
)
from collectors.clock import ManualClock
from collectors.models import Node
from collectors.sim.fleet import SimFleet
from incidents import lifecycle, status
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Incident, Remediation, Step
from incidents.remediation import engine, policy, steps, transitions
from incidents.remediation.playbooks import FOR_ROOT_CAUSE, PLAYBOOKS, playbook_get
from incidents.remediation.steps import EXECUTORS, Done, StepContext, Wait
from tests.conftest import steps_queued, token_for

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)


def diag(root_cause: str, nodes: tuple[str, ...] = ("gpu-003",), **kw: Any) -> Diagnosis:
    return Diagnosis(root_cause=root_cause, nodes=nodes, confidence=0.95,
                     playbook=FOR_ROOT_CAUSE[root_cause], explanation=f"{root_cause} test",
                     detected_at=NOW, jobs=kw.pop("jobs", ("3001",)), **kw)


@pytest.fixture
def cluster(sim_fleet: SimFleet, settings: Any) -> Any:
    settings.FLEETWATCH_SIM_SPEED = 400.0  # a 120 s grace passes in 0.3 s
    sim_fleet.speed = 400.0
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    return collectors.cluster_default()


def open_incident(cluster: Any, d: Diagnosis, capture: Any) -> Incident:
    with capture():  # keep the first step off the broker: the test runs it
        incident, _ = lifecycle.incident_record(cluster.pk, d)
    return incident


def drive(rem: Remediation, capture: Any, *, rounds: int = 400,
          between: Callable[[], None] | None = None) -> Remediation:
    """Run the remediation's steps in this process until it stops moving: each round runs
    (or re-checks) the first unfinished step, as the worker's queue would."""
    for _ in range(rounds):
        rem.refresh_from_db()
        if rem.status != Remediation.Status.RUNNING:
            return rem
        step = rem.steps.exclude(status__in=Step.DONE).order_by("order").first()
        if step is None:
            return rem
        with capture():
            engine.step_run(step.pk, "poll")
        if between is not None:
            between()
        time.sleep(0.02)
    rem.refresh_from_db()
    return rem


def calls(rem: Remediation) -> list[tuple[str, str]]:
    return list(AuditEntry.objects.filter(remediation=rem).exclude(call="")
                .order_by("id").values_list("verb", "target"))


# --- the catalogue --------------------------------------------------------------------------


def test_every_root_cause_has_a_playbook_of_known_steps() -> None:
    for root_cause, name in FOR_ROOT_CAUSE.items():
        playbook = playbook_get(name)
        assert playbook is not None and playbook.root_cause in (root_cause, "gpu_memory")
    for playbook in PLAYBOOKS.values():
        assert playbook.steps and all(s.kind in EXECUTORS for s in playbook.steps)
    # Some playbooks must never act on a node.
    hands_off = {"cordon_and_drain", "replace_node", "reboot", "reset_or_reboot", "down_node"}
    assert not {s.kind for s in PLAYBOOKS["hold_switch"].steps} & hands_off
    assert [s.kind for s in PLAYBOOKS["notify_owner"].steps] == ["notify_owner"]
    # The risky steps carry their risk class, so they can have modes of their own.
    risky = {s.kind: s.risk for p in PLAYBOOKS.values() for s in p.steps if s.risk}
    assert risky == {"replace_node": "replace", "reset_or_reboot": "reset_gpu",
                     "reboot": "reboot", "reboot_request": "reboot",
                     "replace_if_not_back": "replace", "wait_checkpoint": "replace_working",
                     "prove_healthy": "return_to_service"}


# --- playbooks on the simulated fleet ----------------------------------------------------------


def test_gpu_memory_resets_the_gpu_checks_it_and_resumes(
        cluster: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    from collectors.sim.faults import fault_inject

    fault_inject("xid", node="gpu-003", gpu=2, code=48)
    collectors.collect_source("telemetry")
    incident = open_incident(cluster, diag("gpu_memory"), django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks,
                between=lambda: collectors.collect_source("slurm"))
    assert rem.status == "succeeded", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    assert [v for v, _ in calls(rem)] == [
        "notify", "slurm.drain", "slurm.comment", "slurm.cancel", "slurm.requeue",
        "slurm.comment", "provider.reset_gpu",
        # the acceptance checks: reserved, resumed inside the reservation, checked, released
        "slurm.reserve", "slurm.resume", "slurm.submit_check", "slurm.unreserve",
        "slurm.resume"]
    node = sim_fleet.snapshot()["nodes"]["gpu-003"]
    assert not node["drained"] and node["gpus"][2]["last_xid"] == 0
    assert sim_fleet.snapshot()["jobs"]["3001"]["state"] == "RUNNING"
    incident.refresh_from_db()
    assert incident.status == "resolved" and incident.repaired_by == "automation"
    assert {"detect", "decide", "drain", "requeue", "replace", "resume"} <= set(incident.phases)


def test_a_gpu_memory_fault_back_within_a_week_replaces_the_node_and_marks_it_for_rma(
        cluster: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any,
        settings: Any) -> None:
    settings.FLEETWATCH_COOLDOWN_MINUTES = 0
    first = open_incident(cluster, diag("gpu_memory"), django_capture_on_commit_callbacks)
    transitions.remediation_cancel(first.remediations.get().pk, None)  # type: ignore[arg-type]
    status.incident_resolve(first)
    # Resolved long enough ago not to be the same incident again (FLEETWATCH_DEDUPE_MINUTES);
    # its remediation acted (a cancelled one that did nothing would not count).
    Incident.objects.filter(pk=first.pk).update(resolved_at=NOW - timedelta(hours=3))
    Remediation.objects.filter(incident=first).update(status="failed")
    second = open_incident(cluster, replace(diag("gpu_memory"), detected_at=NOW + timedelta(
        hours=1)), django_capture_on_commit_callbacks)
    rem = second.remediations.get()
    assert rem.playbook == "replace_and_rma"
    assert "mark_rma" in rem.steps.values_list("kind", flat=True)
    created = AuditEntry.objects.get(remediation=rem, verb="remediation.created")
    assert "GPU memory fault again on gpu-003" in created.result


def test_nvlink_reboots_then_resumes(cluster: Any, sim_fleet: SimFleet,
                                     django_capture_on_commit_callbacks: Any) -> None:
    from collectors.sim.faults import fault_inject

    fault_inject("xid", node="gpu-005", gpu=1, code=74)
    incident = open_incident(cluster, diag("nvlink", ("gpu-005",), jobs=("3001",)),
                             django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks,
                between=lambda: collectors.collect_source("slurm"))
    assert rem.status == "succeeded", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    assert ("provider.reboot", "gpu-005") in calls(rem)
    assert sim_fleet.snapshot()["nodes"]["gpu-005"]["gpus"][1]["last_xid"] == 0


def test_a_flapping_link_keeps_the_node_drained_until_stable(
        cluster: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any,
        settings: Any) -> None:
    from collectors.sim.faults import fault_inject

    # 3 s: longer than the repair takes to reach the wait (drain, stop, comment, requeue)
    settings.FLEETWATCH_RECOVERY_STABLE_MINUTES = 0.05
    fault_inject("link-flap", node="gpu-004")
    collectors.collect_source("telemetry")
    incident = open_incident(cluster, diag("network_flap", ("gpu-004",)),
                             django_capture_on_commit_callbacks)
    seen_waiting: list[str] = []

    def watch() -> None:
        step = Step.objects.get(remediation__incident=incident, kind="wait_link_stable")
        if step.status == "pending":
            # The link keeps flapping until the wait begins, however long the steps before it
            # take on a loaded machine: the wait must then see a link not yet stable.
            fault_inject("link-flap", node="gpu-004")
        collectors.collect_source("telemetry")
        collectors.collect_source("slurm")
        step.refresh_from_db()
        if step.status == "waiting":
            seen_waiting.append(step.detail)

    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks, between=watch)
    assert rem.status == "succeeded", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    assert seen_waiting, "the node went back before its link had been stable"
    assert [v for v, _ in calls(rem)][-1] == "slurm.resume"
    assert not sim_fleet.snapshot()["nodes"]["gpu-004"]["drained"]


def test_a_dead_switch_holds_its_nodes_then_releases_them_and_touches_nothing_else(
        cluster: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any,
        settings: Any) -> None:
    from collectors.sim.faults import fault_inject

    settings.FLEETWATCH_RECOVERY_STABLE_MINUTES = 0.01
    fault_inject("switch-down", switch="leaf-b")
    collectors.collect_source("telemetry")
    leaf_b = tuple(f"gpu-{n:03d}" for n in range(9, 17))
    incident = open_incident(cluster, diag("switch_failure", leaf_b, switch="leaf-b",
                                           jobs=()), django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks, rounds=800,
                between=lambda: collectors.collect_source("telemetry"))
    assert rem.status == "succeeded", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    verbs = {v for v, _ in calls(rem)}
    assert verbs <= {"notify", "slurm.drain", "slurm.cancel", "slurm.comment", "slurm.requeue",
                     "slurm.resume"}
    assert sorted(t for v, t in calls(rem) if v == "slurm.drain") == sorted(leaf_b)
    assert sorted(t for v, t in calls(rem) if v == "slurm.resume") == sorted(leaf_b)
    state = sim_fleet.snapshot()
    assert not any(state["nodes"][n]["drained"] or state["nodes"][n]["unschedulable"]
                   for n in leaf_b)


def test_application_error_notifies_the_owner_and_touches_no_node(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    incident = open_incident(cluster, diag("application_error", (), job="3002",
                                           jobs=("3002",)), django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks)
    assert rem.status == "succeeded" and rem.nodes == []
    assert [v for v, _ in calls(rem)] == ["notify"]
    step = rem.steps.get()
    assert step.result["owners"] == ["bob"]  # the job's Slurm user


# --- executors the simulation cannot provoke: recorded fake clients ------------------------------


@dataclass
class FakeWorld:
    """Just enough of Slurm, Kubernetes, telemetry and a provider to run one executor."""

    slurm_nodes: dict[str, SlurmNode] = field(default_factory=dict)
    jobs: list[SlurmJob] = field(default_factory=list)
    k8s: dict[str, K8sNode] = field(default_factory=dict)
    gpus: list[GpuMetric] = field(default_factory=list)
    ports: list[NicPort] = field(default_factory=list)
    provider_state: str = "ready"
    made: list[str] = field(default_factory=list)
    reservations: list[SlurmReservation] = field(default_factory=list)

    def clients(self) -> Clients:
        world = self

        class Slurm:
            def nodes(self) -> list[SlurmNode]:
                return list(world.slurm_nodes.values())

            def node(self, name: str) -> SlurmNode:
                if name not in world.slurm_nodes:
                    raise NotFound(f"Invalid node name specified: {name}", permanent=True)
                return world.slurm_nodes[name]

            def jobs(self) -> list[SlurmJob]:
                return world.jobs

            def drain(self, node: str, reason: str) -> ActionResult:
                world.made.append(f"drain {node}")
                world.slurm_nodes[node] = replace(world.slurm_nodes[node], flags=("DRAIN",),
                                                  reason=reason)
                return ActionResult(f"scontrol update nodename={node} state=DRAIN", True)

            def down(self, node: str, reason: str) -> ActionResult:
                world.made.append(f"down {node}")
                world.slurm_nodes[node] = replace(world.slurm_nodes[node], state="DOWN",
                                                  reason=reason)
                return ActionResult(f"scontrol update nodename={node} state=DOWN", True)

            def resume(self, node: str) -> ActionResult:
                if not world.slurm_nodes[node].reason.startswith("fleetwatch:"):
                    raise ClientError(f"{node} was drained by someone else", permanent=True)
                world.made.append(f"resume {node}")
                world.slurm_nodes[node] = SlurmNode(node, "IDLE")
                return ActionResult(f"scontrol update nodename={node} state=RESUME", True)

            def cancel(self, job_id: str, signal: str, grace: int) -> ActionResult:
                world.made.append(f"cancel {job_id}")
                world.jobs = [replace(j, state="CANCELLED") if j.job_id == job_id else j
                              for j in world.jobs]
                return ActionResult(f"scancel {job_id}", True)

            def requeue(self, job_id: str) -> ActionResult:
                world.made.append(f"requeue {job_id}")
                world.jobs = [replace(j, state="PENDING") if j.job_id == job_id else j
                              for j in world.jobs]
                return ActionResult(f"scontrol requeue {job_id}", True)

            def set_comment(self, job_id: str, text: str, field: str) -> ActionResult:
                world.made.append(f"comment {job_id}")
                return ActionResult(f"scontrol update jobid={job_id} {field}={text}", True)

            def reservations(self) -> list[SlurmReservation]:
                return world.reservations

            def reserve(self, name: str, node: str) -> ActionResult:
                world.made.append(f"reserve {node}")
                world.reservations.append(SlurmReservation(name, (node,)))
                return ActionResult(f"scontrol create reservation {name}", True)

        class Kubernetes:
            def nodes(self) -> list[K8sNode]:
                return list(world.k8s.values())

            def node(self, name: str) -> K8sNode:
                if name not in world.k8s:
                    raise NotFound(f'nodes "{name}" not found', permanent=True)
                return world.k8s[name]

        class Telemetry:
            def gpu_metrics(self, nodes: Sequence[str] | None = None) -> list[GpuMetric]:
                return [m for m in world.gpus if nodes is None or m.node in nodes]

            def nic_ports(self) -> list[NicPort]:
                return world.ports

        class Provider:
            def reboot(self, node: str, reason: str) -> ActionResult:
                world.made.append(f"reboot {node}")
                world.provider_state = "rebooting"
                return ActionResult(f"reboot {node}", True)

            def status(self, node: str) -> ProviderStatus:
                return ProviderStatus(node, world.provider_state)

        class Notifier:
            def notify(self, subject: str, body: str, payload: dict[str, Any]) -> ActionResult:
                world.made.append(f"notify {','.join(payload.get('owners', []))}")
                return ActionResult("POST https://hooks.example/x", True, "200")

        return Clients(Slurm(), Kubernetes(), Telemetry(), Provider(),  # type: ignore[arg-type]
                       Notifier())  # type: ignore[arg-type]


def ctx_for(world: FakeWorld, kind: str, state: dict[str, Any] | None = None, **kw: Any
            ) -> StepContext:
    return StepContext(incident_id=7, root_cause=kw.pop("root_cause", "thermal"),
                       explanation="test", nodes=kw.pop("nodes", ["gpu-003"]),
                       clients=world.clients(), grace_seconds=120, state=state or {},
                       previous=kw.pop("previous", {}), audit=lambda *a: None, **kw)


def gpu(node: str, index: int, temp: float, clocks: int = 0) -> GpuMetric:
    return GpuMetric(node, index, f"GPU-{index}", 90.0, temp, 0, clock_event_reasons=clocks)


def test_thermal_waits_for_normal_temperatures_held_for_the_stable_window(settings: Any) -> None:
    settings.FLEETWATCH_RECOVERY_STABLE_MINUTES = 0.01  # 0.6 s
    world = FakeWorld(gpus=[gpu("gpu-003", 0, 91.0, 0x40), gpu("gpu-003", 1, 70.0)])
    clock = ManualClock()
    out = EXECUTORS["wait_cool"](ctx_for(world, "wait_cool", clock=clock))
    assert isinstance(out, Wait) and "GPU 0 91C" in out.detail and "thermal slowdown" in out.detail
    # Warm but not throttling is fine; cool has to last the window.
    world.gpus = [gpu("gpu-003", 0, 78.0), gpu("gpu-003", 1, 70.0)]
    out = EXECUTORS["wait_cool"](ctx_for(world, "wait_cool", clock=clock))
    assert isinstance(out, Wait) and "cool for" in out.detail
    clock.advance(0.7)
    out = EXECUTORS["wait_cool"](ctx_for(world, "wait_cool", out.result, clock=clock))
    assert isinstance(out, Done)
    # Heat coming back restarts the window.
    world.gpus = [gpu("gpu-003", 0, 85.0)]
    again = EXECUTORS["wait_cool"](ctx_for(world, "wait_cool", out.result, clock=clock))
    assert isinstance(again, Wait) and "cool_since" not in again.result


def test_unreachable_node_is_marked_down_rebooted_and_replaced_only_if_it_stays_away(
        settings: Any) -> None:
    settings.FLEETWATCH_NODE_BACK_MINUTES = 0.01
    world = FakeWorld(slurm_nodes={"gpu-003": SlurmNode("gpu-003", "ALLOCATED")},
                      jobs=[SlurmJob("3001", "train", "alice", "RUNNING", ("gpu-003", "gpu-004"))],
                      k8s={"gpu-003": K8sNode("gpu-003", None, False)})
    out = EXECUTORS["down_node"](ctx_for(world, "down_node", root_cause="node_unreachable"))
    assert isinstance(out, Done) and out.result["requeued"] == ["3001"]
    # Held in a reservation of its own from the DOWN on: ReturnToService=2 would put it back
    # in service unchecked the moment its slurmd registers.
    assert world.made == ["down gpu-003", "reserve gpu-003", "comment 3001", "cancel 3001",
                          "requeue 3001", "comment 3001"]
    assert [r.name for r in world.reservations] == ["fleetwatch-gate-r0-hold"]
    out = EXECUTORS["reboot"](ctx_for(world, "reboot"))
    assert isinstance(out, Wait) and "rebooting" in out.detail
    world.provider_state = "ready"
    assert isinstance(EXECUTORS["reboot"](ctx_for(world, "reboot", out.result)), Done)
    assert world.made.count("reboot gpu-003") == 1  # a re-check does not reboot again
    # Still not Ready in Kubernetes: after the window it is declared gone.
    clock = ManualClock()
    out = EXECUTORS["wait_node_back"](ctx_for(world, "wait_node_back", clock=clock))
    assert isinstance(out, Wait)
    clock.advance(0.7)
    out = EXECUTORS["wait_node_back"](ctx_for(world, "wait_node_back", out.result, clock=clock))
    assert isinstance(out, Done) and out.result["came_back"] is False
    # Came back instead: no replacement.
    skipped = EXECUTORS["replace_if_not_back"](ctx_for(
        world, "replace_if_not_back", previous={"wait_node_back": {"came_back": True}}))
    assert isinstance(skipped, Done) and skipped.result == {"replaced": False}


def test_resume_never_undoes_an_administrators_drain() -> None:
    world = FakeWorld(slurm_nodes={"gpu-003": SlurmNode("gpu-003", "IDLE", ("DRAIN",),
                                                        "maint: reseat HCA (bob)")},
                      k8s={"gpu-003": K8sNode("gpu-003", True, False)},
                      gpus=[gpu("gpu-003", 0, 50.0)])
    with pytest.raises(ClientError, match="someone else"):
        EXECUTORS["resume_node"](ctx_for(world, "resume_node"))
    assert "resume gpu-003" not in world.made


def test_a_switch_hold_leaves_an_administrators_drain_alone() -> None:
    world = FakeWorld(slurm_nodes={
        "gpu-009": SlurmNode("gpu-009", "IDLE", ("DRAIN",), "maint: bob"),
        "gpu-010": SlurmNode("gpu-010", "IDLE")})
    out = EXECUTORS["hold_switch_nodes"](ctx_for(world, "hold_switch_nodes",
                                                 nodes=["gpu-009", "gpu-010"], switch="leaf-b"))
    assert isinstance(out, Done)
    assert out.result == {"held": ["gpu-010"], "already_drained": ["gpu-009"]}
    out = EXECUTORS["release_switch_nodes"](ctx_for(world, "release_switch_nodes",
                                                    nodes=["gpu-009", "gpu-010"],
                                                    previous={"hold_switch_nodes": out.result}))
    assert world.made == ["drain gpu-010", "resume gpu-010"]


# --- modes ------------------------------------------------------------------------------------


def test_a_risky_step_in_approve_mode_waits_for_a_click(
        cluster: Any, settings: Any, operator: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_STEP_MODES = {"replace": "approve"}
    incident = open_incident(cluster, diag("gpu_hardware"), django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks)
    assert rem.status == "awaiting_approval"
    step = rem.steps.get(kind="replace_node")
    assert step.status == "awaiting_approval" and "needs a person's approval" in rem.hold_reason
    assert not [v for v, _ in calls(rem) if v.startswith("provider.")]
    with django_capture_on_commit_callbacks():
        transitions.remediation_approve(rem.pk, operator)
    step.refresh_from_db()
    assert step.approved_by == "user:olivia" and step.status == "pending"
    rem = drive(rem, django_capture_on_commit_callbacks,
                between=lambda: [collectors.collect_source(s) for s in ("slurm", "kubernetes",
                                                                        "telemetry")])
    assert rem.status == "succeeded"
    assert AuditEntry.objects.filter(remediation=rem, verb="step.approved",
                                     actor="user:olivia").count() == 1
    incident.refresh_from_db()
    assert incident.repaired_by == "person"


def test_a_risky_step_in_observe_mode_records_and_stops_for_a_person(
        cluster: Any, settings: Any, operator: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_STEP_MODES = {"reboot": "observe"}
    incident = open_incident(cluster, diag("nvlink"), django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks)
    assert rem.status == "blocked"
    step = rem.steps.get(kind="reboot")
    assert step.status == "blocked" and "would reboot the node (gpu-003)" in step.detail
    assert ("provider.reboot", "gpu-003") not in calls(rem)
    with django_capture_on_commit_callbacks():
        transitions.remediation_continue(rem.pk, operator)
    step.refresh_from_db()
    assert step.status == "pending" and step.approved_by == "user:olivia"


def test_playbook_modes_per_root_cause(cluster: Any, settings: Any,
                                       django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_PLAYBOOK_MODES = {"thermal": "observe", "nvlink": "approve"}
    thermal = open_incident(cluster, diag("thermal", ("gpu-006",)),
                            django_capture_on_commit_callbacks)
    nvlink = open_incident(cluster, diag("nvlink", ("gpu-007",)),
                           django_capture_on_commit_callbacks)
    hardware = open_incident(cluster, diag("gpu_hardware", ("gpu-008",)),
                             django_capture_on_commit_callbacks)
    assert thermal.remediations.get().status == "observed"
    assert nvlink.remediations.get().status == "awaiting_approval"
    assert hardware.remediations.get().status == "running"
    assert not AuditEntry.objects.filter(remediation__incident=thermal).exclude(call="").exists()


# --- safety rails ------------------------------------------------------------------------------


def test_one_remediation_per_node_at_a_time(cluster: Any, operator: Any,
                                            django_capture_on_commit_callbacks: Any) -> None:
    first = open_incident(cluster, diag("gpu_hardware"), django_capture_on_commit_callbacks)
    assert first.remediations.get().status == "running"
    second = open_incident(cluster, diag("thermal"), django_capture_on_commit_callbacks)
    rem = second.remediations.get()
    assert rem.status == "awaiting_approval"
    assert "gpu-003 already in remediation" in rem.hold_reason
    # Even a person's click waits while the first one holds the node.
    with pytest.raises(status.InvalidTransition, match="cannot start yet"):
        transitions.remediation_approve(rem.pk, operator)
    transitions.remediation_cancel(first.remediations.get().pk, operator)
    with django_capture_on_commit_callbacks():
        transitions.remediation_approve(rem.pk, operator)
    assert Remediation.objects.get(pk=rem.pk).status == "running"


def test_the_fleet_budget_holds_what_goes_beyond_it(cluster: Any, settings: Any,
                                                    django_capture_on_commit_callbacks: Any
                                                    ) -> None:
    settings.FLEETWATCH_BUDGET_MAX_NODES = 2
    settings.FLEETWATCH_BUDGET_MAX_PERCENT = 100
    statuses = [open_incident(cluster, diag("gpu_hardware", (f"gpu-00{n}",)),
                              django_capture_on_commit_callbacks).remediations.get()
                for n in (1, 2, 3)]
    assert [r.status for r in statuses] == ["running", "running", "awaiting_approval"]
    assert "fleet budget: 3 nodes would be in remediation at once, more than 2" in \
        statuses[2].hold_reason
    # A share of a leaf: leaf-a has 8 nodes, 25% allows 2.
    settings.FLEETWATCH_BUDGET_MAX_NODES, settings.FLEETWATCH_BUDGET_MAX_PERCENT = 100, 25
    rem = open_incident(cluster, diag("gpu_hardware", ("gpu-004",)),
                        django_capture_on_commit_callbacks).remediations.get()
    assert rem.status == "awaiting_approval"
    assert "of leaf switch leaf-a would be in remediation, more than 25%" in rem.hold_reason
    leaf_b = open_incident(cluster, diag("gpu_hardware", ("gpu-012",)),
                           django_capture_on_commit_callbacks).remediations.get()
    assert leaf_b.status == "running"


def test_the_storm_brake_pauses_automation(cluster: Any, settings: Any,
                                           django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_STORM_INCIDENTS, settings.FLEETWATCH_STORM_MINUTES = 3, 10
    settings.FLEETWATCH_BUDGET_MAX_PERCENT = 100  # this test is about the brake, not the budget
    rems = [open_incident(cluster, diag("thermal", (f"gpu-0{n:02d}",)),
                          django_capture_on_commit_callbacks).remediations.get()
            for n in range(1, 6)]
    assert [r.status for r in rems] == ["running"] * 3 + ["awaiting_approval"] * 2
    assert rems[3].hold_reason.startswith("storm brake: 4 incidents opened in the last 10 min")
    incident = Incident.objects.get(pk=rems[4].incident_id)
    assert incident.status == "needs_attention"


def test_cooldown_and_rma_escalation(cluster: Any, settings: Any,
                                     django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_RMA_AFTER, settings.FLEETWATCH_COOLDOWN_MINUTES = 2, 30
    first = open_incident(cluster, diag("thermal"), django_capture_on_commit_callbacks)
    rem = first.remediations.get()
    Remediation.objects.filter(pk=rem.pk).update(status="succeeded", finished_at=NOW)
    status.incident_resolve(first)
    second = open_incident(cluster, replace(diag("thermal"), explanation="again",
                                            detected_at=NOW + timedelta(hours=2)),
                           django_capture_on_commit_callbacks)
    # The same fault right after its incident resolved is that incident again (dedupe).
    assert second.pk == first.pk
    other = open_incident(cluster, diag("nvlink"), django_capture_on_commit_callbacks)
    held = other.remediations.get()
    assert held.status == "awaiting_approval" and held.hold_reason.startswith("cooldown:")
    # Twice this week already: the third is escalated for RMA and the node leaves its pool.
    Remediation.objects.filter(pk=held.pk).update(status="failed")
    third = open_incident(cluster, diag("gpu_hardware"), django_capture_on_commit_callbacks)
    rem3 = third.remediations.get()
    assert rem3.hold_reason.startswith("escalated for RMA: gpu-003 remediated 2 times")
    assert Node.objects.get(name="gpu-003").pool == "rma"
    assert AuditEntry.objects.filter(verb="node.rma", target="gpu-003").count() == 1


def test_each_rail_reads_its_own_window_of_the_nodes_history(
        cluster: Any, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    # One repair of gpu-003 two hours ago: inside the week (RMA counts it), outside a 30 min
    # cooldown, inside a 3 h one. The decision reads the history once for every rail.
    settings.FLEETWATCH_RMA_AFTER = 5
    first = open_incident(cluster, diag("thermal"), django_capture_on_commit_callbacks)
    two_hours_ago = timezone.now() - timedelta(hours=2)
    Remediation.objects.filter(incident=first).update(
        status="succeeded", created_at=two_hours_ago, finished_at=two_hours_ago)
    status.incident_resolve(first)
    settings.FLEETWATCH_COOLDOWN_MINUTES = 30
    runs = open_incident(cluster, diag("nvlink"), django_capture_on_commit_callbacks)
    assert runs.remediations.get().hold_reason == ""
    Remediation.objects.filter(incident=runs).update(status="cancelled")
    status.incident_resolve(runs)
    settings.FLEETWATCH_COOLDOWN_MINUTES = 180
    held = open_incident(cluster, diag("gpu_memory"), django_capture_on_commit_callbacks)
    rem = held.remediations.get()
    assert rem.hold_reason.startswith("cooldown: gpu-003 was remediated 1 time(s) in the last "
                                      "180 min")
    # The escalation reads the week for its own root cause only: no GPU memory repair before.
    assert rem.playbook == FOR_ROOT_CAUSE["gpu_memory"]


# --- approvals ---------------------------------------------------------------------------------


def test_approving_a_finished_remediation_is_refused(cluster: Any, settings: Any,
                                                     operator: Any,
                                                     django_capture_on_commit_callbacks: Any
                                                     ) -> None:
    settings.FLEETWATCH_POLICY_MODE = "approve"
    incident = open_incident(cluster, diag("application_error", (), job="3002",
                                           jobs=("3002",)), django_capture_on_commit_callbacks)
    rem = incident.remediations.get()
    with django_capture_on_commit_callbacks():
        transitions.remediation_approve(rem.pk, operator)
    rem = drive(rem, django_capture_on_commit_callbacks)
    assert rem.status == "succeeded"
    with pytest.raises(status.InvalidTransition, match=r"is succeeded by user:olivia; nothing to approve"):
        transitions.remediation_approve(rem.pk, operator)


@pytest.mark.django_db(transaction=True)
def test_two_people_approving_at_once_run_it_once(sim_fleet: SimFleet, settings: Any,
                                                   operator: Any, viewer: Any) -> None:
    from collectors.roles import OPERATOR, user_with_role

    if connection.vendor != "postgresql":
        pytest.skip("row locks need PostgreSQL")  # make test runs this on PostgreSQL
    settings.FLEETWATCH_POLICY_MODE = "approve"
    settings.CELERY_TASK_ALWAYS_EAGER = False
    cluster = collectors.cluster_default()
    incident, _ = lifecycle.incident_record(cluster.pk, diag("thermal"))
    rem = incident.remediations.get()
    second = user_with_role("peter", OPERATOR, "operator-pass-2")[0]
    outcomes: list[str] = []
    barrier = threading.Barrier(2)

    def approve(user: Any) -> None:
        barrier.wait()
        try:
            transitions.remediation_approve(rem.pk, user)
            outcomes.append("approved")
        except status.InvalidTransition as exc:
            outcomes.append(f"refused: {exc}")
        finally:
            connection.close()

    from unittest import mock

    with mock.patch.object(engine, "step_enqueue"):  # no broker here: the steps stay queued
        threads = [threading.Thread(target=approve, args=(u,)) for u in (operator, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(o.split(":")[0] for o in outcomes) == ["approved", "refused"]
    assert "nothing to approve" in next(o for o in outcomes if o.startswith("refused"))
    assert AuditEntry.objects.filter(remediation=rem, verb="remediation.approved").count() == 1


def test_mean_time_to_repair_keeps_automation_and_people_apart(cluster: Any) -> None:
    for n, (who, minutes) in enumerate([("automation", 4), ("automation", 6), ("person", 30)]):
        Incident.objects.create(cluster=cluster, root_cause="thermal", confidence=1,
                                explanation="x", fingerprint=f"t:{n}", nodes=[],
                                detected_at=NOW, opened_at=NOW, status="resolved",
                                resolved_at=NOW + timedelta(minutes=minutes), repaired_by=who)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy.timezone, "now", lambda: NOW + timedelta(hours=1))
        mttr = policy.mean_time_to_repair(7)
    assert mttr == {"automation": 300.0, "person": 1800.0}


def test_executors_are_reached_only_through_the_table() -> None:
    # Every executor the playbooks name is a function of this module: nothing else acts.
    assert {f.__module__ for f in EXECUTORS.values()} == {steps.__name__}


def test_api_approve_answers_409_when_there_is_nothing_to_approve(
        cluster: Any, settings: Any, operator: Any, viewer: Any, client: Any,
        django_capture_on_commit_callbacks: Any) -> None:

    settings.FLEETWATCH_POLICY_MODE = "approve"
    incident = open_incident(cluster, diag("thermal"), django_capture_on_commit_callbacks)
    rem = incident.remediations.get()
    url = f"/api/v1/remediations/{rem.pk}/approve/"
    assert client.post(url).status_code == 401
    viewer_key = token_for(viewer)
    r = client.post(url, HTTP_AUTHORIZATION=f"Token {viewer_key}")
    assert r.status_code == 403 and "operate permission" in r.json()["detail"]
    key = token_for(operator, name="olivia-bot")
    with django_capture_on_commit_callbacks():
        r = client.post(url, HTTP_AUTHORIZATION=f"Token {key}")
    assert r.status_code == 200 and r.json()["status"] == "running"
    again = client.post(url, HTTP_AUTHORIZATION=f"Token {key}")
    assert again.status_code == 409
    # The approval was made with a token: the audit trail and the answer name the token.
    assert again.json() == {"detail": f"remediation {rem.pk} is running by token:olivia-bot; "
                                      "nothing to approve", "status": "running"}
    assert AuditEntry.objects.get(verb="remediation.approved").actor == "token:olivia-bot"
    listed = client.get("/api/v1/remediations/", HTTP_AUTHORIZATION=f"Token {viewer_key}")
    assert listed.status_code == 200 and listed.json()["results"][0]["id"] == rem.pk


def test_the_watchdog_requeues_a_step_whose_message_was_lost(
        cluster: Any, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_WATCHDOG_SECONDS = 30
    incident = open_incident(cluster, diag("gpu_hardware"), django_capture_on_commit_callbacks)
    rem = incident.remediations.get()
    first = rem.steps.get(order=1)
    assert first.next_check_at is not None  # set when it was queued
    assert engine.steps_rescue() == []  # not overdue yet
    # The message vanished (worker killed, broker restarted) a minute ago.
    Step.objects.filter(pk=first.pk).update(next_check_at=NOW.replace(year=2020))
    Step.objects.filter(pk=rem.steps.get(order=2).pk).update(
        next_check_at=NOW.replace(year=2020), lease_until=NOW.replace(year=2099))
    with django_capture_on_commit_callbacks() as queued:
        assert engine.steps_rescue() == [first.pk]  # the leased one is someone's
    assert steps_queued(queued) == 1
    first.refresh_from_db()
    assert first.next_check_at > NOW.replace(year=2020)
    # Later steps, never queued, and steps of stopped remediations are left alone.
    assert rem.steps.get(order=3).next_check_at is None


def test_a_node_going_quiet_during_its_own_repair_is_not_a_new_incident(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    first = open_incident(cluster, diag("nvlink"), django_capture_on_commit_callbacks)
    assert first.remediations.get().status == "running"
    # The reboot makes the node stop answering: diagnosis says node_unreachable.
    again = open_incident(cluster, diag("node_unreachable"), django_capture_on_commit_callbacks)
    assert again.pk == first.pk and Incident.objects.count() == 1
    # Once nothing repairs it, the same symptom is an incident of its own.
    transitions.remediation_cancel(first.remediations.get().pk, None)  # type: ignore[arg-type]
    other = open_incident(cluster, diag("node_unreachable"), django_capture_on_commit_callbacks)
    assert other.pk != first.pk and other.root_cause == "node_unreachable"


def test_a_failed_step_can_be_retried_once_a_person_fixed_the_cause(
        cluster: Any, operator: Any, django_capture_on_commit_callbacks: Any) -> None:
    incident = open_incident(cluster, diag("gpu_hardware"), django_capture_on_commit_callbacks)
    rem = incident.remediations.get()
    with pytest.raises(status.InvalidTransition, match="no failed step to retry"):
        transitions.remediation_retry(rem.pk, operator)
    step = rem.steps.get(order=1)
    with django_capture_on_commit_callbacks():
        engine._step_fail(Step.objects.select_related("remediation__incident").get(
            pk=step.pk), "webhook answered 404")
    rem.refresh_from_db()
    assert rem.status == "failed"
    with django_capture_on_commit_callbacks() as queued:
        transitions.remediation_retry(rem.pk, operator)
    assert steps_queued(queued) == 1
    step.refresh_from_db()
    rem.refresh_from_db()
    assert (rem.status, step.status, step.attempts) == ("running", "pending", 0)
    assert "retried by user:olivia after: webhook answered 404" in step.detail
    assert AuditEntry.objects.filter(verb="step.retried", actor="user:olivia").count() == 1


def test_a_switch_hold_leaves_a_node_another_repair_drained() -> None:
    # gpu-011's GPU died last week: replaced, and left drained by that repair.
    world = FakeWorld(slurm_nodes={
        "gpu-011": SlurmNode("gpu-011", "IDLE", ("DRAIN",), "fleetwatch: incident 5 gpu_hardware"),
        "gpu-012": SlurmNode("gpu-012", "IDLE")})
    out = EXECUTORS["hold_switch_nodes"](ctx_for(world, "hold_switch_nodes",
                                                 nodes=["gpu-011", "gpu-012"], switch="leaf-b"))
    assert out.result == {"held": ["gpu-012"], "already_drained": ["gpu-011"]}
    EXECUTORS["release_switch_nodes"](ctx_for(world, "release_switch_nodes",
                                              previous={"hold_switch_nodes": out.result}))
    assert "resume gpu-011" not in world.made and "resume gpu-012" in world.made


def test_an_unresponsive_node_slurm_cannot_reboot_goes_on_to_the_replacement() -> None:
    world = FakeWorld(slurm_nodes={"gpu-003": SlurmNode("gpu-003", "DOWN",
                                                        ("NOT_RESPONDING",), "Not responding")})

    def refuse(node: str, reason: str) -> ActionResult:
        raise ClientError(f"{node} is not responding: Slurm reboots through its slurmd",
                          permanent=True)

    ctx = ctx_for(world, "reboot_request", root_cause="node_unreachable")
    ctx.clients.provider.reboot = refuse  # type: ignore[method-assign]
    out = EXECUTORS["reboot_request"](ctx)
    assert isinstance(out, Done) and "reboot refused" in out.detail
    assert "not responding" in out.result["refused"]


def test_a_notification_outage_does_not_hold_back_the_repair() -> None:
    world = FakeWorld()
    ctx = ctx_for(world, "notify", root_cause="gpu_hardware")

    def down(subject: str, body: str, payload: dict[str, Any]) -> ActionResult:
        raise ClientError("every notification channel failed: POST https://hooks.example/x")

    ctx.clients.notifier.notify = down  # type: ignore[method-assign]
    out = EXECUTORS["notify"](ctx)
    assert isinstance(out, Done) and out.result["sent"] is False
    assert "notification failed, repair goes on" in out.detail


def test_a_reboot_requests_time_counts_towards_the_replace_phase(cluster: Any) -> None:
    """Each step kind declares its repair phase where it is defined (steps.STEP_KINDS): a
    reboot asked of the provider is replace time, as a reboot is (it used to count nowhere)."""
    from incidents.phases import phase_durations

    incident = Incident.objects.create(
        cluster=cluster, root_cause="node_unreachable", confidence=1, explanation="x",
        fingerprint="u:reboot", nodes=["gpu-003"], detected_at=NOW,
        opened_at=NOW + timedelta(seconds=5))
    rem = Remediation.objects.create(incident=incident, playbook="node_unreachable",
                                     mode="auto", status="succeeded", requested_by="system")
    for order, kind, start, end in ((1, "down_node", 10, 20), (2, "reboot_request", 20, 80)):
        Step.objects.create(remediation=rem, order=order, kind=kind, title=kind,
                            status="succeeded", started_at=NOW + timedelta(seconds=start),
                            finished_at=NOW + timedelta(seconds=end))
    phases = phase_durations(incident, rem, NOW + timedelta(minutes=2))
    assert phases["reboot_request"] == phases["replace"] == 60.0
    assert phases["drain"] == 10.0


def test_the_storm_brake_holds_the_storms_cause_not_another_fault(
        cluster: Any, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    """A storm is one event: its incidents hold each other's automation, and a fault of
    another cause meanwhile is still repaired (the fleet budget bounds it as any)."""
    settings.FLEETWATCH_STORM_INCIDENTS, settings.FLEETWATCH_STORM_MINUTES = 3, 10
    settings.FLEETWATCH_BUDGET_MAX_PERCENT = 100
    storm = [open_incident(cluster, diag("thermal", (f"gpu-0{n:02d}",)),
                           django_capture_on_commit_callbacks).remediations.get()
             for n in range(1, 6)]
    assert [r.status for r in storm] == ["running"] * 3 + ["awaiting_approval"] * 2
    assert "more than 3 thermal incidents" in storm[4].hold_reason
    other = open_incident(cluster, diag("gpu_hardware", ("gpu-012",)),
                          django_capture_on_commit_callbacks).remediations.get()
    assert (other.status, other.hold_reason) == ("running", "")
    assert policy.storm_by_cause(cluster.pk) == {"thermal": 5, "gpu_hardware": 1}
