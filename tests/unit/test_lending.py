"""Lending against the simulated fleet (its Slurm and Kubernetes twins), the loan's steps run
in this process (no broker): lend and return, each outside call audited once and never made
twice after a crash, FleetWatch refusing what is not its own (an administrator's drain or
cordon), the floor and the ceiling for a person's click too, the modes of the automatic
policy, the drain deadline, a repair taking over a lent node, and the capacity figures."""

from __future__ import annotations

import time
from typing import Any

import pytest

from collectors import services as collectors
from collectors.clients.base import K8S_LENT
from collectors.models import Cluster
from collectors.sim.fleet import SimFleet, submit_job
from incidents import gates
from incidents.lending import selectors, services, steps
from incidents.lending.services import LendRefused
from incidents.models import AuditEntry, CapacitySnapshot, GateRun, Loan, Remediation
from incidents.selectors import gate_status
from incidents.status import InvalidTransition

pytestmark = pytest.mark.django_db

IDLE = ("gpu-017", "gpu-018", "gpu-019", "gpu-020")  # the sim's jobs fill gpu-001..016


@pytest.fixture
def fleet(settings: Any, tmp_path: Any) -> SimFleet:
    settings.FLEETWATCH_SIM_STATE = tmp_path / "sim-fleet.json"
    settings.FLEETWATCH_SIM_SPEED = 400.0
    fleet = SimFleet(settings.FLEETWATCH_SIM_STATE, 400.0)
    fleet.seed(nodes=20, spares=0)
    settings.FLEETWATCH_LEND_MODES = {"*": "auto"}
    settings.FLEETWATCH_LEND_FLOOR = {"*": "50%"}
    settings.FLEETWATCH_LEND_CEILING = {"*": "25%"}
    settings.FLEETWATCH_LEND_TAINTS = [("fleetwatch.io/inference", "true", "NoSchedule")]
    collect()
    return fleet


def collect() -> None:
    for source in ("slurm", "kubernetes", "telemetry"):
        assert collectors.collect_source(source).healthy


def cluster() -> Cluster:
    return collectors.cluster_default()


def run(loan: Loan, rounds: int = 30) -> Loan:
    """Run the loan's steps as a worker's queue would, until it waits for nothing."""
    for _ in range(rounds):
        services.loan_run(loan.pk)
        loan.refresh_from_db()
        if loan.status not in Loan.RUNNING:
            return loan
    return loan


def calls(loan: Loan, verb: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(data__loan=loan.pk, verb=verb))


def node_of(fleet: SimFleet, name: str) -> dict[str, Any]:
    return fleet.snapshot()["nodes"][name]


def add_inference_pod(fleet: SimFleet, node: str, name: str = "llm-serve-0") -> None:
    with fleet.transaction() as state:
        state["pods"].append({"namespace": "inference", "name": name, "node": node,
                              "labels": {"app": "llm-serve"}, "owner_kind": "ReplicaSet"})


def test_lend_then_return_each_call_audited_once(fleet: SimFleet) -> None:
    loan = services.loan_lend(None, "gpu-017", actor="user:olivia", reason="try it")
    assert loan.status == Loan.Status.LENDING and loan.step == "lend_check"
    loan = run(loan)
    assert loan.status == Loan.Status.LENT, loan.detail
    node = node_of(fleet, "gpu-017")
    assert node["drained"] and node["reason"] == f"fleetwatch: lent to inference (loan {loan.pk})"
    assert node["labels"]["fleetwatch.io/lent-to"] == "inference"
    assert node["taints"] == [["fleetwatch.io/inference", "true", "NoSchedule"]]
    assert node["annotations"][K8S_LENT] == f"loan {loan.pk}"
    assert not node["unschedulable"]
    assert [len(calls(loan, v)) for v in ("slurm.drain", "k8s.relabel")] == [1, 1]
    assert calls(loan, "k8s.relabel")[0].call.startswith("kubectl label node gpu-017")
    assert AuditEntry.objects.filter(verb="loan.started", actor="user:olivia").count() == 1

    add_inference_pod(fleet, "gpu-017")
    services.loan_return(loan.pk, actor="user:olivia", reason="training needs it")
    loan = run(Loan.objects.get(pk=loan.pk))
    assert loan.status == Loan.Status.RETURNED, loan.detail
    node = node_of(fleet, "gpu-017")
    assert not node["drained"] and node["reason"] == ""
    assert "fleetwatch.io/lent-to" not in node["labels"] and node["taints"] == []
    assert K8S_LENT not in node["annotations"] and not node["unschedulable"]
    assert not [p for p in fleet.snapshot()["pods"] if p["name"] == "llm-serve-0"]
    for verb in ("k8s.cordon", "k8s.evict", "k8s.unlabel", "k8s.uncordon", "slurm.resume"):
        assert len(calls(loan, verb)) == 1, verb
    assert calls(loan, "k8s.evict")[0].target == "gpu-017"
    assert calls(loan, "k8s.evict")[0].data["step"] == "return_evict"
    assert [e.verb for e in AuditEntry.objects.filter(data__loan=loan.pk, call="")] == [
        "loan.started", "loan.lent", "loan.returning", "loan.returned"]


def test_a_step_run_again_after_a_crash_does_not_repeat_its_call(
        fleet: SimFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    loan = services.loan_lend(None, "gpu-018", actor="user:olivia")
    real = steps.EXECUTORS["lend_label"]

    def dies_after_the_call(ctx: steps.LoanContext) -> steps.Outcome:
        real(ctx)  # the relabel is made and recorded, then the worker dies
        raise SystemExit("worker killed")

    monkeypatch.setitem(steps.EXECUTORS, "lend_label", dies_after_the_call)
    with pytest.raises(SystemExit):
        run(loan)
    loan.refresh_from_db()
    assert loan.step == "lend_label" and loan.lease_until is not None
    assert loan.done_calls == ["slurm.drain gpu-018", "k8s.relabel gpu-018"]
    # The lease runs out; another worker takes the loan and runs the step again.
    Loan.objects.filter(pk=loan.pk).update(lease_until=None)
    monkeypatch.setitem(steps.EXECUTORS, "lend_label", real)
    loan = run(loan)
    assert loan.status == Loan.Status.LENT
    assert len(calls(loan, "k8s.relabel")) == len(calls(loan, "slurm.drain")) == 1


def test_an_administrators_drain_or_cordon_is_never_lent(fleet: SimFleet) -> None:
    fleet_slurm = services.get_clients().slurm
    fleet_slurm.drain("gpu-019", "admin: bad fan")  # an administrator's own words
    with fleet.transaction() as state:
        state["nodes"]["gpu-020"]["unschedulable"] = True  # cordoned, no FleetWatch mark
    collect()
    with pytest.raises(LendRefused, match=r"gpu-019 is not training capacity.*administrator"):
        services.loan_lend(None, "gpu-019", actor="user:olivia")
    with pytest.raises(LendRefused, match="cordoned in Kubernetes by someone else"):
        services.loan_lend(None, "gpu-020", actor="user:olivia")
    uses = {u.name: u for u in selectors.node_uses(cluster())}
    assert uses["gpu-019"].category == "training_drained"
    assert "administrator" in uses["gpu-019"].blocked
    # Drained between the click and the run: the lend's own check refuses, nothing changed.
    loan = services.loan_lend(None, "gpu-017", actor="user:olivia")
    fleet_slurm.drain("gpu-017", "admin: firmware")
    loan = run(loan)
    assert loan.status == Loan.Status.CANCELLED and "administrator" in loan.detail
    assert node_of(fleet, "gpu-017")["reason"] == "admin: firmware"  # theirs, untouched
    assert not calls(loan, "slurm.drain")


def test_a_lent_node_an_administrator_took_is_not_returned(fleet: SimFleet) -> None:
    loan = run(services.loan_lend(None, "gpu-017", actor="user:olivia"))
    with fleet.transaction() as state:
        node = state["nodes"]["gpu-017"]
        node["unschedulable"] = True  # an administrator cordons it, without FleetWatch's mark
    services.loan_return(loan.pk, actor="system", reason="demand")
    loan = run(Loan.objects.get(pk=loan.pk))
    assert loan.status == Loan.Status.FAILED
    assert "cordoned in Kubernetes by someone else" in loan.detail
    assert node_of(fleet, "gpu-017")["drained"]  # not resumed: theirs to decide
    assert not calls(loan, "slurm.resume") and not calls(loan, "k8s.cordon")
    assert AuditEntry.objects.filter(data__loan=loan.pk, verb="loan.stopped").count() == 1


def test_the_floor_and_the_ceiling_hold_a_persons_click_too(fleet: SimFleet,
                                                            settings: Any) -> None:
    settings.FLEETWATCH_LEND_CEILING = {"*": "1"}
    services.loan_lend(None, "gpu-017", actor="user:olivia")
    with pytest.raises(LendRefused, match="more than its ceiling of 1"):
        services.loan_lend(None, "gpu-018", actor="user:olivia")
    settings.FLEETWATCH_LEND_CEILING = {"*": "100%"}
    settings.FLEETWATCH_LEND_FLOOR = {"*": "19"}
    with pytest.raises(LendRefused, match="below its floor of 19"):
        services.loan_lend(None, "gpu-018", actor="user:olivia")
    with pytest.raises(LendRefused, match="already in loan"):
        services.loan_lend(None, "gpu-017", actor="user:olivia")


def test_the_drain_deadline_gives_a_busy_node_back(fleet: SimFleet, settings: Any) -> None:
    settings.FLEETWATCH_LEND_DRAIN_DEADLINE_MINUTES = 0  # the deadline is now
    loan = run(services.loan_lend(None, "gpu-001", actor="user:olivia"))  # job 3001 runs there
    assert loan.status == Loan.Status.RETURNED
    assert "past the deadline" in loan.return_reason
    assert not node_of(fleet, "gpu-001")["drained"]  # resumed: training goes on
    assert len(calls(loan, "slurm.resume")) == 1 and not calls(loan, "k8s.relabel")


def test_a_busy_node_waits_for_its_jobs(fleet: SimFleet) -> None:
    loan = services.loan_lend(None, "gpu-013", actor="user:olivia")  # job 3003 runs there
    services.loan_run(loan.pk)
    services.loan_run(loan.pk)
    loan.refresh_from_db()
    assert loan.step == "lend_wait_jobs" and "waiting for job(s) 3003" in loan.detail


def test_the_gate_is_asked_only_when_it_is_on(fleet: SimFleet, settings: Any,
                                              django_capture_on_commit_callbacks: Any) -> None:
    loan = run(services.loan_lend(None, "gpu-017", actor="user:olivia"))
    assert services._gate_before_resume(loan, {}) is None  # off by default
    settings.FLEETWATCH_LEND_GATE = True
    services.loan_return(loan.pk, actor="user:olivia")
    loan = run(Loan.objects.get(pk=loan.pk), rounds=8)
    # The return waits on the gate (acceptance checks as a Slurm job in a reservation holding
    # the node): the node is not given back to Slurm meanwhile.
    assert (loan.status, loan.step) == (Loan.Status.RETURNING, "return_gate")
    gate_id = loan.state["gate_id"]
    assert f"g{gate_id}" in loan.detail
    assert not calls(loan, "slurm.resume")  # the loan's own resume has not run
    for _ in range(300):
        with django_capture_on_commit_callbacks():
            gates.gate_advance(gate_id)
        if gate_status(gate_id)["final"]:
            break
        time.sleep(0.02)
    assert gate_status(gate_id)["status"] == "passed"
    loan = run(Loan.objects.get(pk=loan.pk))
    assert loan.status == Loan.Status.RETURNED and loan.state["gate_id"] == gate_id
    assert not node_of(fleet, "gpu-017")["drained"] and not node_of(fleet, "gpu-017").get(
        "reserved_by")
    # One gate: the step run again after it passed did not start another.
    assert GateRun.objects.filter(node="gpu-017").count() == 1


def test_a_node_that_fails_its_gate_is_not_given_back(fleet: SimFleet, settings: Any) -> None:
    loan = run(services.loan_lend(None, "gpu-017", actor="user:olivia"))
    settings.FLEETWATCH_LEND_GATE = True
    # Observe mode for the gate: nothing is checked, so nothing is put back unchecked.
    settings.FLEETWATCH_STEP_MODES = {"return_to_service": "observe"}
    services.loan_return(loan.pk, actor="user:olivia")
    loan = run(Loan.objects.get(pk=loan.pk))
    assert loan.status == Loan.Status.FAILED and loan.step == "return_gate"
    assert "failed the return-to-service gate" in loan.detail and "observe" in loan.detail
    assert node_of(fleet, "gpu-017")["drained"]


def tick(now: float) -> Any:
    collect()
    return services.lending_tick(None, now=now)


def test_automatic_lending_follows_demand(fleet: SimFleet, settings: Any) -> None:
    settings.FLEETWATCH_LEND_IDLE_MINUTES = 10
    settings.FLEETWATCH_LEND_QUIET_MINUTES = 10
    settings.FLEETWATCH_LEND_RETURN_AFTER_MINUTES = 5
    decision = tick(0.0)
    assert decision.lend == () and not Loan.objects.exists()
    decision = tick(600.0)
    assert [m.node for m in decision.lend] == ["gpu-017", "gpu-018"]
    loans = list(Loan.objects.order_by("node"))
    assert all(loan.automatic and loan.requested_by == "system" for loan in loans)
    for loan in loans:
        assert run(loan).status == Loan.Status.LENT
    # The ceiling (25% of 20 = 5) is not the limit here: moves per decision are (2).
    assert len(tick(660.0).lend) == 2
    for loan in Loan.objects.filter(status=Loan.Status.LENDING):
        run(loan)
    # Training wants two more nodes: pending in Slurm, demand held 5 min brings them back.
    with fleet.transaction() as state:
        submit_job(state, "big-sweep", "dana", num_nodes=4)
    assert tick(700.0).bring_back == ()
    back = tick(1000.0).bring_back
    assert len(back) == 4, back  # 4 nodes wanted, none idle in Slurm: all four come back
    assert Loan.objects.filter(status=Loan.Status.RETURNING).count() == 4
    for loan in Loan.objects.filter(status=Loan.Status.RETURNING):
        assert run(loan).status == Loan.Status.RETURNED
        assert loan.return_automatic


def test_approve_and_observe_modes(fleet: SimFleet, settings: Any) -> None:
    settings.FLEETWATCH_LEND_IDLE_MINUTES = settings.FLEETWATCH_LEND_QUIET_MINUTES = 0
    settings.FLEETWATCH_LEND_MODES = {"*": "observe"}
    tick(0.0)
    tick(60.0)
    observed = AuditEntry.objects.filter(verb="lending.observed")
    assert sorted(e.target for e in observed) == ["gpu-017", "gpu-018"]  # once, not per tick
    assert "would lend gpu-017 to inference" in observed[0].result
    assert not Loan.objects.exists()

    settings.FLEETWATCH_LEND_MODES = {"*": "approve"}
    tick(120.0)
    proposed = list(Loan.objects.filter(status=Loan.Status.PROPOSED).order_by("node"))
    assert [loan.node for loan in proposed] == ["gpu-017", "gpu-018"]
    # Proposals count as on their way out: one per idle node, none twice (the ceiling, 5,
    # is not reached: only 4 nodes are idle).
    for t in (180.0, 240.0, 300.0):
        tick(t)
    assert Loan.objects.count() == 4
    services.loan_decline(proposed[1].pk, actor="user:olivia")
    loan = services.loan_approve(proposed[0].pk, actor="user:olivia")
    assert loan.status == Loan.Status.LENDING and loan.approved_by == "user:olivia"
    assert run(loan).status == Loan.Status.LENT
    with pytest.raises(InvalidTransition):
        services.loan_approve(loan.pk, actor="user:olivia")


def test_a_hold_turns_an_automatic_lend_into_a_proposal(fleet: SimFleet, settings: Any) -> None:
    settings.FLEETWATCH_BUDGET_MAX_NODES = 1
    loan = services.loan_lend(None, "gpu-017", actor="system", automatic=True)
    assert loan.status == Loan.Status.LENDING
    held = services.loan_lend(None, "gpu-018", actor="system", automatic=True)
    assert held.status == Loan.Status.PROPOSED and "fleet budget" in held.hold_reason


def test_a_repair_takes_over_a_lent_node(fleet: SimFleet) -> None:
    from incidents.models import Incident

    loan = run(services.loan_lend(None, "gpu-017", actor="user:olivia"))
    incident = Incident.objects.create(cluster=cluster(), root_cause="gpu_hardware",
                                       confidence=0.9, explanation="XID 79",
                                       fingerprint="gpu_hardware:gpu-017", nodes=["gpu-017"],
                                       detected_at=loan.created_at)
    Remediation.objects.create(incident=incident, playbook="replace_node", mode="auto",
                               status=Remediation.Status.RUNNING, requested_by="system",
                               nodes=["gpu-017"], started_at=loan.created_at)
    tick(0.0)
    loan = run(Loan.objects.get(pk=loan.pk))
    assert loan.status == Loan.Status.RETURNED and "handed to remediation" in loan.detail
    node = node_of(fleet, "gpu-017")
    assert "fleetwatch.io/lent-to" not in node["labels"]
    assert node["drained"]  # its repair resumes it once healthy, not the loan
    assert not calls(loan, "slurm.resume")


def test_capacity_now_and_its_chart(fleet: SimFleet) -> None:
    run(services.loan_lend(None, "gpu-017", actor="user:olivia"))
    collect()
    now = selectors.capacity(cluster())
    (pool,) = now["pools"]
    counts = pool["counts"]
    assert counts["training_allocated"] == 16 * 8 and counts["training_idle"] == 3 * 8
    assert counts["inference_idle"] + counts["inference_allocated"] == 8
    assert (pool["floor"], pool["ceiling"], pool["lent"], pool["room"]) == (10, 5, 1, 4)
    assert [u.name for u in now["lendable"]] == ["gpu-018", "gpu-019", "gpu-020"]
    assert now["demand"].known and now["demand"].gpus == 0
    services.capacity_snapshot()
    chart = selectors.capacity_chart(cluster(), "day")
    assert chart["gpus"]["Kubernetes inference: idle"]["y"][-1] + \
        chart["gpus"]["Kubernetes inference: allocated"]["y"][-1] == 8
    assert chart["nodes"]["lent"]["y"] == [1]
    assert CapacitySnapshot.objects.count() == 1


def test_demand_unknown_when_slurm_is_down(fleet: SimFleet) -> None:
    from collectors.sim.fleet import set_source_down

    with fleet.transaction() as state:
        set_source_down(state, "slurm", True)
    collectors.collect_source("slurm")
    demand = selectors.pending_demand(cluster())
    assert not demand.known and "last read failed" in demand.why_unknown
    assert services.lending_tick(None, now=0.0).notes[0].startswith("Slurm's pending demand")
