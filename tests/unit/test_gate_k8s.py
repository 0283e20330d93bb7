"""The return-to-service gate on a pool Kubernetes schedules (incidents/remediation/gate_k8s.py)
on the simulated fleet: the node held by a cordon and a taint, the checks as Jobs, and each
verdict; the manifest and the Job's states as the real client reads them. The real API side:
tests/integration/test_gate_k8s.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from collectors.clients.base import (
    K8S_CORDON_REASON,
    K8S_CORDONED_BY,
    K8S_GATE,
    ActionResult,
    CheckJob,
    PodCheckSpec,
)
from collectors.clients.kubernetes import check_job_manifest, check_job_state
from collectors.knowledge.acceptance import CHECKS, Repair, selection_parse
from collectors.models import Node
from collectors.sim.fleet import SimFleet, SimKubernetes, set_check_verdict
from incidents import gates
from incidents.models import AuditEntry
from incidents.remediation import gate
from incidents.remediation.gate_k8s import gate_poll_kubernetes, job_name
from tests.unit.test_gate import advance_until_final, free_nodes
from tests.unit.test_remediation import cluster

__all__ = ["cluster"]
pytestmark = pytest.mark.django_db

CHECK = gate.PlannedCheck("fleetwatch-check", "true", 5)


def plan_for(node: str, **overrides: Any) -> gate.GatePlan:
    values: dict[str, Any] = {
        "key": "k1", "node": node, "repair": "replace", "start_seconds": 60.0,
        "checks": (CHECK,), "scheduler": gate.KUBERNETES, "namespace": "fleetwatch",
        "image": "registry.example/fleetwatch:1"}
    return gate.GatePlan(**(values | overrides))


class Calls:
    def __init__(self) -> None:
        self.made: list[str] = []

    def __call__(self, verb: str, target: str, fn: Any, *args: Any) -> ActionResult:
        self.made.append(verb)
        result: ActionResult = fn(*args)
        return result


def run_gate(k8s: SimKubernetes, plan: gate.GatePlan, calls: Calls,
             state: dict[str, Any] | None = None) -> tuple[gate.Progress, dict[str, Any]]:
    state = {} if state is None else state
    for _ in range(400):
        progress = gate_poll_kubernetes(k8s, plan, state, calls, time.time())
        if progress.final:
            return progress, state
        time.sleep(0.02)
    raise AssertionError(progress)


def node_of(fleet: SimFleet, name: str) -> dict[str, Any]:
    node: dict[str, Any] = fleet.snapshot()["nodes"][name]
    return node


def test_a_node_that_passes_is_uncordoned_and_its_taint_removed(sim_fleet: SimFleet) -> None:
    free_nodes(sim_fleet)
    k8s = SimKubernetes(sim_fleet)
    calls = Calls()
    progress, state = run_gate(k8s, plan_for("gpu-016"), calls)
    assert progress.status == gate.PASSED, progress
    assert calls.made == ["k8s.relabel", "k8s.cordon", "k8s.submit_check", "k8s.uncordon",
                          "k8s.relabel"]
    node = node_of(sim_fleet, "gpu-016")
    assert not node["unschedulable"] and K8S_GATE not in node["annotations"]
    assert not any(t[0] == K8S_GATE for t in node.get("taints") or [])
    result = state["results"][0]
    assert result["verdict"] == "passed" and result["job_id"] == "fleetwatch-check-k1-fleetwatch-check"
    assert result["output_path"] == "kubectl logs -n fleetwatch job/fleetwatch-check-k1-fleetwatch-check"


def test_while_checking_the_node_is_cordoned_and_tainted_for_the_check_alone(
        sim_fleet: SimFleet) -> None:
    free_nodes(sim_fleet)
    k8s = SimKubernetes(sim_fleet)
    state: dict[str, Any] = {}
    progress = gate_poll_kubernetes(k8s, plan_for("gpu-016"), state, Calls(), time.time())
    assert progress.status == gate.RUNNING and "check fleetwatch-check" in progress.detail
    node = k8s.node("gpu-016")
    assert node.unschedulable and node.annotations[K8S_CORDONED_BY] == "fleetwatch"
    assert (K8S_GATE, "k1", "NoSchedule") in node.taints
    assert "acceptance checks before service (gate k1)" in node.annotations[K8S_CORDON_REASON]


def test_a_node_that_fails_stays_cordoned_with_the_verdict_as_its_reason(
        sim_fleet: SimFleet) -> None:
    free_nodes(sim_fleet)
    with sim_fleet.transaction() as state:
        set_check_verdict(state, "gpu-016", "fail")
    k8s = SimKubernetes(sim_fleet)
    progress, state = run_gate(k8s, plan_for("gpu-016"), Calls())
    assert progress.status == gate.FAILED
    assert "acceptance check fleetwatch-check failed on gpu-016" in progress.detail
    node = k8s.node("gpu-016")
    assert node.unschedulable and node.annotations[K8S_CORDONED_BY] == "fleetwatch"
    assert node.annotations[K8S_CORDON_REASON].startswith(
        "fleetwatch: acceptance check fleetwatch-check failed on gpu-016")
    assert not any(t[0] == K8S_GATE for t in node.taints)  # the cordon holds it now
    assert '"ok": false' in state["results"][0]["output"]


def test_someone_elses_cordon_is_theirs_and_no_check_runs(sim_fleet: SimFleet) -> None:
    free_nodes(sim_fleet)
    with sim_fleet.transaction() as state:
        state["nodes"]["gpu-016"]["unschedulable"] = True  # kubectl cordon, no FleetWatch mark
    k8s = SimKubernetes(sim_fleet)
    calls = Calls()
    progress, _ = run_gate(k8s, plan_for("gpu-016"), calls)
    assert progress.status == gate.CANNOT_RUN
    assert "cordoned by someone else" in progress.detail
    assert "k8s.submit_check" not in calls.made and "k8s.uncordon" not in calls.made
    assert k8s.node("gpu-016").unschedulable


def test_a_pod_still_on_the_node_is_waited_for_and_a_job_that_never_starts_is_deleted(
        sim_fleet: SimFleet) -> None:
    # An inference pod holds gpu-001's GPUs: the check cannot start beside it.
    with sim_fleet.transaction() as fleet:
        fleet["pods"].append({"namespace": "serving", "name": "llm-0", "node": "gpu-001",
                              "labels": {"app": "llm"}, "owner_kind": "StatefulSet",
                              "gpus": 8})
    k8s = SimKubernetes(sim_fleet)
    state: dict[str, Any] = {}
    plan = plan_for("gpu-001", start_seconds=0.2)
    first = gate_poll_kubernetes(k8s, plan, state, Calls(), time.time())
    assert first.status == gate.RUNNING
    assert first.detail.startswith(
        "waiting for pod(s) serving/llm-0 on gpu-001 to end before its acceptance checks ("
    )  # slurmd's and the DaemonSets' pods hold no GPU
    time.sleep(0.3)
    calls = Calls()
    progress, _ = run_gate(k8s, plan, calls, state)
    assert progress.status == gate.CANNOT_RUN and k8s.node("gpu-001").unschedulable
    assert "waiting for pod(s) serving/llm-0" in progress.detail
    assert "k8s.submit_check" not in calls.made
    # Past its hold, a check Job that never started is deleted, not left to start unguarded.
    state2: dict[str, Any] = {"held": True, "tainted": True, "gpus": 8}
    calls2 = Calls()
    progress2, state2 = run_gate(k8s, plan_for("gpu-001", key="k2", start_seconds=0.2), calls2,
                                 state2)
    assert progress2.status == gate.CANNOT_RUN and "did not start in" in progress2.detail
    assert "k8s.cancel_check" in calls2.made
    assert k8s.check_job("fleetwatch", state2["jobs"]["fleetwatch-check"]) is None


def test_without_an_image_the_gate_cannot_run_and_says_which_setting(
        cluster: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_KUBERNETES_POOLS = frozenset({"gpu"})
    settings.FLEETWATCH_GATE_IMAGE = ""
    free_nodes(sim_fleet)
    Node.objects.filter(name="gpu-014").update(pool="gpu")
    gate_id = gates.node_gate_start("gpu-014", "back from a repair", repair=Repair.MANUAL)
    found = advance_until_final(gate_id, django_capture_on_commit_callbacks)
    assert found["status"] == "cannot_run" and "FLEETWATCH_GATE_IMAGE" in found["detail"]


def test_node_gate_start_on_a_kubernetes_pool_runs_a_job_and_audits_each_call(
        cluster: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_KUBERNETES_POOLS = frozenset({"gpu"})
    settings.FLEETWATCH_GATE_IMAGE = "registry.example/fleetwatch:1"
    free_nodes(sim_fleet)
    Node.objects.filter(name="gpu-014").update(pool="gpu")
    with sim_fleet.transaction() as state:
        state["nodes"]["gpu-014"].update(unschedulable=True, annotations={
            K8S_CORDONED_BY: "fleetwatch", K8S_CORDON_REASON: "fleetwatch: repaired"})
    gate_id = gates.node_gate_start("gpu-014", "after a repair", repair=Repair.MANUAL)
    found = advance_until_final(gate_id, django_capture_on_commit_callbacks)
    assert (found["status"], found["in_service"]) == ("passed", True), found
    verbs = list(AuditEntry.objects.filter(data__gate=found["key"]).order_by("id")
                 .values_list("verb", flat=True))
    # The repair's cordon is FleetWatch's: the gate keeps it while checking, lifts it after.
    assert verbs == ["gate.requested", "k8s.relabel", "k8s.submit_check", "k8s.uncordon",
                     "k8s.relabel", "gate.passed"]
    assert not node_of(sim_fleet, "gpu-014")["unschedulable"]
    assert not node_of(sim_fleet, "gpu-014")["drained"]  # Slurm untouched: not the gate's


# --- the Job as the API server gets it and gives it back -----------------------------------------


def test_the_check_job_is_pinned_to_the_node_with_every_gpu_and_no_retry() -> None:
    spec = PodCheckSpec(name="fleetwatch-check-k1-gemm", namespace="fw", node="gpu-a",
                        image="img:1", script="echo hi", minutes=20, gpus=8,
                        labels={K8S_GATE: "k1"})
    job = check_job_manifest(spec)
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 1200
    assert pod["restartPolicy"] == "Never"
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchFields"][0]
    assert term == {"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert pod["containers"][0]["command"] == ["/bin/sh", "-c", "echo hi"]
    assert {"operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert job["metadata"]["labels"][K8S_GATE] == "k1"


def test_job_names_are_dns_labels() -> None:
    assert job_name("r12-1", "dcgm-diag-2") == "fleetwatch-check-r12-1-dcgm-diag-2"
    long = job_name("r123456789-99", "a-site-check-with-a-very-long-name-indeed-" * 2)
    assert len(long) <= 63 and long == long.lower() and not long.endswith("-")
    assert long != job_name("r123456789-99", "a-site-check-with-a-very-long-name-indeed-" * 3)
    assert job_name("K_1", "Site.Check") == "fleetwatch-check-k-1-site-check"


def _job(*conditions: tuple[str, str]) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": t, "status": "True", "reason": r,
                                       "message": "m"} for t, r in conditions]}}


def _pod(phase: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "status": {"phase": phase, **status}}


def _terminated(code: int) -> dict[str, Any]:
    return {"containerStatuses": [{"name": "check", "state": {"terminated": {"exitCode": code}}}]}


@pytest.mark.parametrize(("job", "pod", "expected"), [
    (_job(("SuccessCriteriaMet", ""), ("Complete", "")), _pod("Succeeded", **_terminated(0)),
     ("COMPLETED", 0)),
    (_job(("FailureTarget", "BackoffLimitExceeded"), ("Failed", "BackoffLimitExceeded")),
     _pod("Failed", **_terminated(1)), ("FAILED", 1)),
    (_job(("Failed", "BackoffLimitExceeded")), _pod("Failed", **_terminated(127)),
     ("FAILED", 127)),
    (_job(("Failed", "DeadlineExceeded")), None, ("TIMEOUT", None)),
    (_job(), _pod("Running"), ("RUNNING", None)),
    (_job(), None, ("PENDING", None)),
    (_job(), _pod("Pending", conditions=[{"type": "PodScheduled", "status": "False",
                                          "reason": "Unschedulable",
                                          "message": "0/3 nodes are available"}]),
     ("PENDING", None)),
])
def test_a_jobs_state_reads_as_a_slurm_jobs(job: dict[str, Any], pod: dict[str, Any] | None,
                                            expected: tuple[str, int | None]) -> None:
    state, code, _ = check_job_state(job, pod)
    assert (state, code) == expected


def test_why_a_check_job_waits_is_the_schedulers_or_the_kubelets_word() -> None:
    unscheduled = _pod("Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 1 node(s) had untolerated taint {a: b}"}])
    assert check_job_state(_job(), unscheduled)[2] == (
        "Unschedulable: 0/3 nodes are available: 1 node(s) had untolerated taint {a: b}")
    pulling = _pod("Pending", containerStatuses=[{"name": "check", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image \"img:1\""}}}])
    assert check_job_state(_job(), pulling)[2].startswith("ImagePullBackOff: Back-off pulling")
    # A check program missing in the image exits 127: the gate reads it as could-not-run.
    missing = gate.check_verdict(CheckJob("j", "j", "FAILED", 127))
    assert missing == gate.CANNOT_RUN


def test_no_check_configured_on_a_kubernetes_pool_lifts_fleetwatchs_cordon_and_says_so(
        cluster: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_KUBERNETES_POOLS = frozenset({"gpu"})
    settings.FLEETWATCH_GATE_IMAGE = "registry.example/fleetwatch:1"
    settings.FLEETWATCH_GATE_CHECKS = selection_parse("gpu:*=none", CHECKS)
    free_nodes(sim_fleet)
    Node.objects.filter(name__in=["gpu-014", "gpu-015"]).update(pool="gpu")
    with sim_fleet.transaction() as state:
        state["nodes"]["gpu-014"].update(unschedulable=True, annotations={
            K8S_CORDONED_BY: "fleetwatch", K8S_CORDON_REASON: "fleetwatch: repaired"})
        state["nodes"]["gpu-015"].update(unschedulable=True, annotations={})  # someone's
    found = advance_until_final(gates.node_gate_start("gpu-014", "back", repair=Repair.MANUAL),
                                django_capture_on_commit_callbacks)
    assert found["status"] == "unchecked" and "goes back unchecked" in found["detail"]
    assert not node_of(sim_fleet, "gpu-014")["unschedulable"]
    found = advance_until_final(gates.node_gate_start("gpu-015", "back", repair=Repair.MANUAL),
                                django_capture_on_commit_callbacks)
    assert found["status"] == "unchecked"
    assert node_of(sim_fleet, "gpu-015")["unschedulable"]  # not FleetWatch's to lift
