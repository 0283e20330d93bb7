"""The return-to-service gate on real Slurm 22.05 and 25.11 (tests/harness/slurm_cluster.py),
through the Slurm CLI client on both and through slurmrestd on 25.11: the reservation holding
the node, the check job in it (deploy/checks/fleetwatch-check, with a simulated GPU state per
node: the harness's nodes have no GPU), a pass that puts the node back into service with the
reservation gone, a fail and a check that cannot run that leave it drained with a
``fleetwatch:`` reason and no reservation, and a user job asking for the node meanwhile that
never lands there. Everything is read back with Slurm's own tools (``scontrol``, ``squeue``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors.clients.base import ActionResult, SlurmClient
from collectors.clients.slurm import SlurmCli
from incidents.remediation import gate
from tests.conftest import wait_for
from tests.harness.slurm_cluster import SlurmCluster, SlurmInstall, scontrol_fields

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "deploy" / "checks"
NODES = ["gpu-001", "gpu-002"]
NODE = "gpu-002"
HEALTHY = {"gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3"} for i in range(8)],
           "figures": {"gemm_tflops": 640.0, "membw_gbps": 2950.0}}
BROKEN = {"gpus": [*({"index": i} for i in range(7)),
                   {"index": 7, "healthy": False, "error": "XID 79: fallen off the bus"}]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            slurm_install: SlurmInstall) -> Iterator[SlurmCluster]:
    root = tmp_path_factory.mktemp("gate")
    with SlurmCluster(root, NODES, {"leaf-a": NODES}, kill_wait=2,
                      install=slurm_install) as running:
        (root / "state").mkdir(exist_ok=True)
        (root / "checks").mkdir(exist_ok=True)
        yield running


def rest_client(cluster: SlurmCluster) -> SlurmClient:
    from tests.integration.test_slurmrestd import rest_client as make

    return make(cluster)


def clients(cluster: SlurmCluster) -> list[tuple[str, SlurmClient]]:
    found: list[tuple[str, SlurmClient]] = [
        ("cli", SlurmCli(env=cluster.env, timeout=10, retries=1, backoff=0.2))]
    if cluster.rest:
        found.append(("rest", rest_client(cluster)))
    return found


def sh(cluster: SlurmCluster, *args: str) -> str:
    return cluster.run(*args, check=True).stdout


def node_fields(cluster: SlurmCluster) -> dict[str, str]:
    return scontrol_fields(sh(cluster, "scontrol", "show", "node", NODE))


def reservations(cluster: SlurmCluster) -> str:
    """``scontrol show reservation`` as an operator reads it."""
    return cluster.run("scontrol", "show", "reservation").stdout


def user_job(cluster: SlurmCluster) -> str:
    """A user's job asking for the node by name: it waits while the node is drained."""
    out = sh(cluster, "sbatch", "--parsable", "-o", "/dev/null", "-J", "someone-else",
             "-w", NODE, "--wrap", "sleep 300")
    return out.strip().split(";")[0]


def squeue(cluster: SlurmCluster, job: str, fmt: str = "%T") -> str:
    return cluster.run("squeue", "-h", "-j", job, "-o", fmt).stdout.strip()


def plan(cluster: SlurmCluster, key: str, command: str | None = None) -> gate.GatePlan:
    return gate.GatePlan(
        key=key, node=NODE, repair="replace",
        checks=(gate.PlannedCheck("fleetwatch-check",
                                  command or f"{CHECKS}/fleetwatch-check", 5),),
        output_dir=str(cluster.root / "checks"), start_seconds=90.0,
        gpu_model="NVIDIA H100 80GB HBM3", thresholds={"gemm_tflops": 550.0},
        environment={"FLEETWATCH_CHECK_STATE": str(cluster.root / "state"),
                     "FLEETWATCH_CHECK_SECONDS": "1"})


def run_gate(cluster: SlurmCluster, slurm: SlurmClient, the_plan: gate.GatePlan,
             watch: str) -> tuple[gate.Progress, dict[str, Any], list[dict[str, str]]]:
    """Poll the gate to its verdict, looking with Slurm's tools at every poll: the
    reservation, the node, the user's job ``watch``."""
    state: dict[str, Any] = {}
    made: list[tuple[str, str]] = []
    seen: list[dict[str, str]] = []

    def call(verb: str, target: str, fn: Any, *args: Any) -> ActionResult:
        result: ActionResult = fn(*args)
        made.append((verb, result.call))
        return result

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        progress = gate.gate_poll(slurm, the_plan, state, call, time.time())
        seen.append({"reservations": reservations(cluster),
                     "node": node_fields(cluster).get("State", ""),
                     "user_job": squeue(cluster, watch), "detail": progress.detail})
        if progress.final:
            state["made"] = made
            return progress, state, seen
        time.sleep(0.5)
    raise AssertionError(f"the gate never reached a verdict: {seen[-3:]}")


def write_state(cluster: SlurmCluster, data: dict[str, Any]) -> None:
    (cluster.root / "state" / f"{NODE}.json").write_text(json.dumps(data))


def drained_by_repair(cluster: SlurmCluster) -> None:
    """Where a repair leaves a node: drained by FleetWatch, idle."""
    sh(cluster, "scontrol", "update", f"nodename={NODE}", "state=DRAIN",
       "reason=fleetwatch: incident 1 gpu_hardware (replacement awaiting its checks)")


def test_a_passing_check_puts_the_node_back_and_the_reservation_is_gone(
        cluster: SlurmCluster) -> None:
    for transport, slurm in clients(cluster):
        key = f"pass-{transport}"
        write_state(cluster, HEALTHY)
        drained_by_repair(cluster)
        waiting = user_job(cluster)
        progress, state, seen = run_gate(cluster, slurm, plan(cluster, key), waiting)
        assert progress.status == gate.PASSED, (transport, progress, seen[-3:])

        # Meanwhile: the reservation held the node alone, FleetWatch's user only, as MAINT...
        held = [s for s in seen if f"fleetwatch-gate-{key}" in s["reservations"]]
        assert held, (transport, seen[:3])
        shown = scontrol_fields(held[0]["reservations"])
        assert (shown["Nodes"], shown["Users"]) == (NODE, "root"), shown
        assert "MAINT" in shown["Flags"] and "IGNORE_JOBS" in shown["Flags"], shown
        # ...the node was resumed inside it (a drained node runs nothing, not even the check),
        # and the user's job asking for it by name never started while it was held.
        assert any("DRAIN" not in s["node"] for s in held), held
        assert all(s["user_job"] == "PENDING" for s in held), held
        result = state["results"][0]
        assert result["verdict"] == "passed" and result["exit_code"] == 0, result
        assert result["result"]["ok"] is True and result["result"]["gpus"] == 8, result
        assert result["result"]["node"] == NODE  # it ran on the node, with its GPU state
        made = [verb for verb, _ in state["made"]]
        assert made == ["slurm.reserve", "slurm.resume", "slurm.submit_check",
                        "slurm.unreserve"], (transport, state["made"])

        # After: no reservation, the node in service: the user's job runs on it now.
        assert f"fleetwatch-gate-{key}" not in reservations(cluster)
        wait_for(lambda w=waiting: squeue(cluster, w) == "RUNNING", 30,
                 f"{transport}: the user's job to start on {NODE}")
        assert squeue(cluster, waiting, "%N") == NODE
        sh(cluster, "scancel", waiting)
        wait_for(lambda w=waiting: squeue(cluster, w) in ("", "COMPLETING", "CANCELLED"), 30,
                 "the user's job to go")


def test_a_failing_check_leaves_the_node_drained_with_its_reason_and_no_reservation(
        cluster: SlurmCluster) -> None:
    for transport, slurm in clients(cluster):
        key = f"fail-{transport}"
        write_state(cluster, BROKEN)
        drained_by_repair(cluster)
        waiting = user_job(cluster)
        progress, state, seen = run_gate(cluster, slurm, plan(cluster, key), waiting)
        assert progress.status == gate.FAILED, (transport, progress, seen[-3:])
        assert "GPU 7: XID 79: fallen off the bus" in progress.detail

        node = node_fields(cluster)
        assert "DRAIN" in node["State"], node
        assert node["Reason"].startswith(
            f"fleetwatch: acceptance check fleetwatch-check failed on {NODE}: GPU 7: XID 79"), node
        assert f"(gate {key})" in node["Reason"]
        assert f"fleetwatch-gate-{key}" not in reservations(cluster)
        held = [s for s in seen if f"fleetwatch-gate-{key}" in s["reservations"]]
        assert held and all(s["user_job"] == "PENDING" for s in seen), seen
        # The user's job still waits: the node went from the reservation straight back to
        # drained (drained first, then the reservation deleted).
        time.sleep(2)
        assert squeue(cluster, waiting) == "PENDING"
        result = state["results"][0]
        assert result["verdict"] == "failed" and result["exit_code"] == 1
        assert result["output_readable"] and '"ok": false' in result["output"]
        made = [verb for verb, _ in state["made"]]
        assert made == ["slurm.reserve", "slurm.resume", "slurm.submit_check", "slurm.drain",
                        "slurm.unreserve"], (transport, state["made"])
        sh(cluster, "scancel", waiting)


def test_a_check_that_cannot_run_holds_the_node_and_says_why(cluster: SlurmCluster) -> None:
    _, slurm = clients(cluster)[0]
    key = "missing"
    write_state(cluster, HEALTHY)
    drained_by_repair(cluster)
    waiting = user_job(cluster)
    progress, _, _ = run_gate(cluster, slurm, plan(
        cluster, key, "/opt/nowhere/fleetwatch-check"), waiting)
    assert progress.status == gate.CANNOT_RUN, progress
    assert "missing or not executable" in progress.detail and "exit 127" in progress.detail
    node = node_fields(cluster)
    assert "DRAIN" in node["State"] and node["Reason"].startswith(
        "fleetwatch: acceptance check fleetwatch-check could not run"), node
    assert f"fleetwatch-gate-{key}" not in reservations(cluster)
    assert squeue(cluster, waiting) == "PENDING"
    sh(cluster, "scancel", waiting)


def test_a_node_drained_by_someone_else_is_not_checked_nor_resumed(
        cluster: SlurmCluster) -> None:
    _, slurm = clients(cluster)[0]
    sh(cluster, "scontrol", "update", f"nodename={NODE}", "state=DRAIN",
       "reason=bios update by ops")
    progress, _, seen = run_gate(cluster, slurm, plan(cluster, "theirs"), user_job(cluster))
    assert progress.status == gate.CANNOT_RUN and "drained by someone else" in progress.detail
    node = node_fields(cluster)
    assert "DRAIN" in node["State"] and node["Reason"].startswith("bios update by ops"), node
    assert not any("fleetwatch-gate-theirs" in s["reservations"] for s in seen)
    sh(cluster, "scancel", "--name=someone-else")


def test_a_node_held_through_a_slurm_reboot_takes_no_user_job_until_it_passes(
        cluster: SlurmCluster) -> None:
    """The reboot steps hold the node in a gate reservation before ``scontrol reboot ASAP
    nextstate=RESUME``: on 22.05 a reboot puts the node back in service whatever it was (a
    drain included), and only the reservation keeps a user's job off it until the gate, which
    adopts that reservation, has passed."""
    _, slurm = clients(cluster)[0]
    write_state(cluster, HEALTHY)
    drained_by_repair(cluster)
    hold = "fleetwatch-gate-r9-hold"
    assert slurm.reserve(hold, NODE).changed
    assert not slurm.reserve(hold, NODE).changed  # a retried step makes none twice
    slurm.reboot(NODE, "fleetwatch: incident 9 nvlink")
    wait_for(lambda: NODE in cluster.reboot_requests(), 60, f"RebootProgram on {NODE}")
    cluster.complete_reboot(NODE)
    wait_for(lambda: "REBOOT" not in node_fields(cluster)["State"] and
             "NOT_RESPONDING" not in node_fields(cluster)["State"], 60, f"{NODE} back")
    back = node_fields(cluster)["State"]
    assert "DRAIN" not in back, back  # what the reboot did: back in service, but held
    waiting = user_job(cluster)
    time.sleep(3)
    assert squeue(cluster, waiting) == "PENDING"
    progress, state, seen = run_gate(cluster, slurm, plan(cluster, "r9-1"), waiting)
    assert progress.status == gate.PASSED, (progress, seen[-2:])
    assert state["reservation"] == hold and state["adopted"] is True
    assert [verb for verb, _ in state["made"]] == ["slurm.submit_check", "slurm.unreserve"]
    assert all(s["user_job"] == "PENDING" for s in seen[:-1]), seen
    assert hold not in reservations(cluster)
    wait_for(lambda: squeue(cluster, waiting) == "RUNNING", 30, "the user's job to start")
    sh(cluster, "scancel", waiting)
