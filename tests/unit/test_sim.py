"""The simulated fleet behaves like the systems it stands in for."""

from __future__ import annotations

import pytest

from collectors.clients.base import ClientError, NotFound, node_or_none
from collectors.clock import ManualClock
from collectors.sim.fleet import (
    SimFleet,
    SimKubernetes,
    SimProvider,
    SimSlurm,
    SimTelemetry,
    inject_slow,
    inject_xid,
)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()  # the fleet's time moves only when a test advances it


@pytest.fixture
def fleet(tmp_path, clock: ManualClock):
    f = SimFleet(tmp_path / "fleet.json", speed=200.0, clock=clock)
    f.seed()
    return f


def test_seed_runs_three_multinode_jobs_on_sixteen_nodes(fleet: SimFleet) -> None:
    slurm = SimSlurm(fleet)
    nodes = slurm.nodes()
    assert len(nodes) == 16 and all(n.state == "ALLOCATED" for n in nodes)
    jobs = slurm.jobs()
    assert [(j.job_id, j.state, len(j.nodes)) for j in jobs] == [
        ("3001", "RUNNING", 8), ("3002", "RUNNING", 4), ("3003", "RUNNING", 4)]
    topo = slurm.topology()
    assert set(topo) == {"leaf-a", "leaf-b"}
    assert len(SimTelemetry(fleet).gpu_metrics()) == 16 * 8
    assert not fleet.seed()  # a second seed keeps the running fleet


def test_training_progresses_and_checkpoints(fleet: SimFleet, clock: ManualClock) -> None:
    clock.advance(0.5)  # 100 simulated seconds: ~16 steps at 6 s each
    job = SimSlurm(fleet).jobs()[0]
    assert job.step >= 10
    assert job.checkpoint_step == (job.step // 10) * 10


def test_hung_job_loses_progress_since_its_last_checkpoint(fleet: SimFleet, clock: ManualClock) -> None:
    slurm = SimSlurm(fleet)
    clock.advance(0.4)
    with fleet.transaction() as state:
        inject_xid(state, "gpu-003", 5, 79, clock.now())
    stalled = slurm.jobs()[0].step
    clock.advance(0.2)
    assert slurm.jobs()[0].step == stalled  # NCCL hangs: no more steps
    checkpoint = slurm.jobs()[0].checkpoint_step
    result = slurm.cancel("3001", "TERM", 10)
    assert "hung" in result.detail
    assert slurm.jobs()[0].state == "RUNNING"  # still inside its grace period
    clock.advance(0.1)  # 10 s grace / 200
    job = slurm.jobs()[0]
    assert job.state == "CANCELLED"
    assert job.checkpoint_step == checkpoint  # SIGTERM could not write a new one


def test_healthy_job_checkpoints_on_sigterm_and_resumes_there(fleet: SimFleet, clock: ManualClock) -> None:
    slurm = SimSlurm(fleet)
    clock.advance(0.3)
    slurm.cancel("3002", "TERM", 120)
    clock.advance(0.1)
    job = next(j for j in slurm.jobs() if j.job_id == "3002")
    assert job.state == "CANCELLED"
    saved = job.checkpoint_step
    assert saved == job.step  # written on SIGTERM, not rounded down to a periodic one
    assert slurm.requeue("3002").changed
    assert not slurm.requeue("3002").changed  # already pending or running: a retry is a no-op
    job = next(j for j in slurm.jobs() if j.job_id == "3002")
    assert job.state == "RUNNING" and job.restart_count == 1
    assert job.resumed_from_step == saved


def test_drain_is_idempotent_and_resume_respects_ownership(fleet: SimFleet) -> None:
    slurm = SimSlurm(fleet)
    assert slurm.drain("gpu-001", "fleetwatch: test").changed
    assert not slurm.drain("gpu-001", "fleetwatch: test").changed
    assert slurm.resume("gpu-001").changed
    slurm.drain("gpu-002", "admin: bad DIMM")
    with pytest.raises(ClientError, match="drained by someone else") as err:
        slurm.resume("gpu-002")
    assert err.value.permanent


def test_cordon_evict_and_uncordon(fleet: SimFleet) -> None:
    k8s = SimKubernetes(fleet)
    assert k8s.cordon("gpu-004", "fleetwatch: test").changed
    node = next(n for n in k8s.nodes() if n.name == "gpu-004")
    assert node.unschedulable and node.annotations["fleetwatch.io/cordoned-by"] == "fleetwatch"
    pods = {p.name: p for p in k8s.pods_on_node("gpu-004")}
    assert pods["dcgm-exporter-gpu-004"].owner_kind == "DaemonSet"
    with pytest.raises(ClientError, match="DaemonSet"):
        k8s.evict("gpu-operator", "dcgm-exporter-gpu-004")
    assert k8s.evict("slurm", "slurmd-gpu-004").changed
    assert not k8s.evict("slurm", "slurmd-gpu-004").changed
    assert k8s.uncordon("gpu-004").changed
    assert not next(n for n in k8s.nodes() if n.name == "gpu-004").annotations


def test_replacement_comes_from_the_spare_pool_once(fleet: SimFleet, clock: ManualClock) -> None:
    provider = SimProvider(fleet)
    first = provider.replace("gpu-005")
    again = provider.replace("gpu-005")
    assert first.new_node == again.new_node == "gpu-017"
    assert not first.ready
    clock.advance(0.7)  # 120 s of provisioning at 200x
    status = provider.replacement_status("gpu-005")
    assert status is not None and status.ready
    new = next(n for n in SimSlurm(fleet).nodes() if n.name == "gpu-017")
    assert new.flags == ("DRAIN",) and new.reason.startswith("fleetwatch:")
    assert SimSlurm(fleet).node("gpu-017") == new  # one node read alone, as the list has it
    assert any(n.name == "gpu-017" and n.ready for n in SimKubernetes(fleet).nodes())


def test_xid_79_gpu_reports_no_utilisation(fleet: SimFleet, clock: ManualClock) -> None:
    with fleet.transaction() as state:
        inject_xid(state, "gpu-009", 1, 79, clock.now())
    metrics = {(m.node, m.gpu): m for m in SimTelemetry(fleet).gpu_metrics()}
    assert metrics[("gpu-009", 1)].last_xid == 79
    assert metrics[("gpu-009", 1)].utilization is None
    assert metrics[("gpu-001", 0)].utilization > 50


def test_one_slurm_node_and_a_name_slurm_does_not_know(fleet: SimFleet) -> None:
    slurm = SimSlurm(fleet)
    listed = {n.name: n for n in slurm.nodes()}
    assert all(slurm.node(name) == node for name, node in listed.items())
    # A spare pool node is not in Slurm until it replaces one; no node at all, neither.
    for name in ("gpu-017", "gpu-999"):
        with pytest.raises(NotFound) as err:
            slurm.node(name)
        assert err.value.permanent
        assert node_or_none(slurm, name) is None


def test_a_down_source_raises_instead_of_reporting_an_empty_fleet(fleet: SimFleet) -> None:
    with fleet.transaction() as state:
        state["down_sources"] = ["slurm"]
    with pytest.raises(ClientError, match="unreachable"):
        SimSlurm(fleet).nodes()
    with pytest.raises(ClientError, match="unreachable") as err:
        node_or_none(SimSlurm(fleet), "gpu-001")  # a failed read, not "no such node"
    assert not isinstance(err.value, NotFound)
    assert SimKubernetes(fleet).nodes()  # the others still answer


def test_unknown_targets_are_clear_errors(fleet: SimFleet, clock: ManualClock) -> None:
    with pytest.raises(ClientError, match="unknown node 'gpu-999'"):
        SimSlurm(fleet).drain("gpu-999", "fleetwatch: x")
    with fleet.transaction() as state, pytest.raises(ClientError, match="has no GPU 9"):
        inject_xid(state, "gpu-001", 9, 79, clock.now())


def test_sim_show_prints_a_short_summary_not_a_dump(sim_fleet: SimFleet, settings) -> None:
    """`manage.py fleetwatch sim --show`: nodes by state, GPUs by health, the faults injected,
    the jobs; `--show --json` keeps the whole state for scripts."""
    import json
    from io import StringIO

    from django.core.management import call_command

    slurm = SimSlurm(sim_fleet)
    with sim_fleet.transaction() as state:
        inject_xid(state, "gpu-003", 5, 79, sim_fleet.clock.now())
    slurm.drain("gpu-003", "fleetwatch: incident 1 gpu_hardware")
    SimProvider(sim_fleet).replace("gpu-003")

    out = StringIO()
    call_command("fleetwatch", "sim", "--show", stdout=out)
    text = out.getvalue()
    lines = text.splitlines()
    assert len(lines) < 25 and "{" not in text
    assert lines[0] == "nodes"
    assert lines[1].split()[:2] == ["busy", "15"] and "+11 more" in lines[1]
    rows = [line.split(None, 2) for line in lines[1:lines.index("gpus (in service)")]]
    assert rows[1:] == [["provisioning", "1", "gpu-017"], ["rma", "1", "gpu-003"],
                        ["spare", "2", "gpu-018, gpu-019"]]
    # In service: gpu-003's GPUs left with it; gpu-017's are not in yet.
    assert "  healthy      120" in lines
    assert "  XID 79 on gpu-003 GPU 5 (off the bus)" in lines
    assert lines[lines.index("jobs") + 1].split() == ["id", "name", "user", "state", "nodes",
                                                       "step", "restarts"]
    assert lines[lines.index("jobs") + 2].split()[:5] == ["3001", "llama-70b-pretrain", "alice",
                                                          "RUNNING", "8"]

    out = StringIO()
    call_command("fleetwatch", "sim", "--show", "--json", stdout=out)
    assert json.loads(out.getvalue())["nodes"]["gpu-003"]["pool"] == "rma"


def test_a_slowness_that_is_not_a_number_is_refused(fleet: SimFleet) -> None:
    """The state file is written with orjson, which keeps NaN as null: a slowness of NaN
    percent or minutes would be stored as one no later read can take, so it is refused."""
    for percent, minutes in ((float("nan"), 0.0), (30.0, float("nan")), (30.0, float("inf"))):
        with fleet.transaction() as state, pytest.raises(ClientError, match="must be numbers"):
            inject_slow(state, "gpu-001", 0, "clock", percent, 0.0, minutes)
    assert "slow" not in fleet.snapshot()["nodes"]["gpu-001"]["gpus"][0]


def test_a_state_file_written_by_the_json_module_still_reads(fleet: SimFleet) -> None:
    # Files written before orjson wrote them may hold what orjson does not read (NaN).
    import json

    state = json.loads(fleet.path.read_text())
    state["nodes"]["gpu-001"]["sim_note"] = float("nan")
    fleet.path.write_text(json.dumps(state))
    assert len(SimSlurm(fleet).nodes()) == 16
    fleet.path.write_text("[]")  # JSON, but no fleet
    with pytest.raises(ClientError, match="holds no fleet"):
        SimSlurm(fleet).nodes()


def test_telemetry_of_a_few_nodes_is_theirs_alone(fleet: SimFleet) -> None:
    telemetry = SimTelemetry(fleet)
    whole = {(m.node, m.gpu): m for m in telemetry.gpu_metrics()}
    few = {(m.node, m.gpu): m for m in telemetry.gpu_metrics(["gpu-003", "gpu-009"])}
    assert set(few) == {(n, g) for n in ("gpu-003", "gpu-009") for g in range(8)}
    assert all((few[k].uuid, few[k].last_xid) == (whole[k].uuid, whole[k].last_xid)
               for k in few)
    assert telemetry.gpu_metrics([]) == [] and telemetry.gpu_metrics(["gpu-999"]) == []


def test_one_kubernetes_node_read_alone_and_an_unknown_one_is_none(fleet: SimFleet) -> None:
    k8s = SimKubernetes(fleet)
    assert node_or_none(k8s, "gpu-002") == k8s.node("gpu-002")
    assert node_or_none(k8s, "gpu-999") is None
    with pytest.raises(NotFound):
        k8s.node("gpu-999")
