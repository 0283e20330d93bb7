"""The Slurm client's parsers on every JSON shape it accepts, and its error handling."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path
from typing import Any

import pytest

from collectors.clients.base import ClientError, SlurmJob, SlurmNode
from collectors.clients.slurm import (
    SlurmCli,
    classify,
    exit_return_code,
    gpu_indices,
    job_state,
    owned_reason,
    parse_jobs,
    parse_nodes,
    parse_topology,
    payload_version,
    signal_name,
    slurm_release,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"

VERSIONS = {
    # release: (nodes payload, jobs payload)
    "22.05": ("22.05-sinfo.json", "22.05-squeue.json"),
    "23.02": ("23.02-scontrol-show-nodes.json", "23.02-squeue.json"),
    "23.11": ("23.11-scontrol-show-nodes.json", "23.11-squeue.json"),
    "24.05": ("24.05-scontrol-show-nodes.json", "24.05-squeue.json"),
}

EXPECTED_NODES = [
    # gpus: the node's gpu GRES ("gpu:8"), what a check job asks for (the gate).
    SlurmNode("gpu-001", "MIXED", (), "", "gpu", 8),
    SlurmNode("gpu-002", "MIXED", (), "", "gpu", 8),
    SlurmNode("gpu-003", "IDLE", ("DRAIN",), "fleetwatch: incident 7 gpu_hardware", "gpu", 8),
    SlurmNode("gpu-004", "DOWN", (), "admin: psu swap", "gpu", 8),
]


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def by_id(jobs: list[SlurmJob]) -> dict[str, SlurmJob]:
    return {j.job_id: j for j in jobs}


@pytest.mark.parametrize("release", sorted(VERSIONS))
def test_every_release_reads_as_the_same_fleet(release: str) -> None:
    nodes_file, jobs_file = VERSIONS[release]
    # A tested version: no warning about it.
    assert payload_version(load(nodes_file))[1] is None
    assert payload_version(load(jobs_file))[1] is None

    nodes, warnings = parse_nodes(load(nodes_file))
    assert warnings == []
    assert nodes == EXPECTED_NODES

    jobs, warnings = parse_jobs(load(jobs_file))
    assert warnings == []
    jobs_by_id = by_id(jobs)
    assert sorted(jobs_by_id) == ["1", "2", "3", "4", "5"]

    failed = jobs_by_id["1"]
    assert (failed.name, failed.state, failed.exit_code, failed.nodes) == \
        ("xid-repro", "FAILED", 3, ("gpu-003",))
    killed = jobs_by_id["2"]
    assert (killed.state, killed.exit_code) == ("FAILED", 128 + 9)

    held = jobs_by_id["3"]
    assert (held.state, held.state_reason, held.restart_count, held.nodes, held.started_at) == \
        ("PENDING", "JobHeldUser", 1, (), None)

    running = jobs_by_id["4"]
    assert running.name == "llama-pretrain"
    assert running.user == "root"
    assert running.state == "RUNNING"
    assert running.nodes == ("gpu-001", "gpu-002")  # expanded from gpu-[001-002]
    assert running.started_at == 1796284428.0
    assert running.exit_code is None  # still running: no return code yet
    assert running.state_reason == ""  # Slurm's "None"
    assert (running.step, running.checkpoint_step, running.resumed_from_step) == (None, None, None)

    waiting = jobs_by_id["5"]
    assert (waiting.state, waiting.state_reason, waiting.started_at) == \
        ("PENDING", "Resources", None)


def test_all_releases_agree_exactly() -> None:
    parsed = {r: (parse_nodes(load(n))[0], parse_jobs(load(j))[0])
              for r, (n, j) in VERSIONS.items()}
    assert len({json.dumps(repr(v)) for v in parsed.values()}) == 1


@pytest.mark.parametrize(("meta", "named"), [
    ({"plugin": {"type": "", "name": "", "data_parser": "data_parser/v0.0.99"},
      "slurm": {"version": {"major": "29", "minor": "11", "micro": "0"}}}, "v0.0.99"),
    ({"plugin": {"type": "openapi/v0.0.36"}}, "openapi/v0.0.36"),
    ({"Slurm": {"version": {"major": 20, "minor": 11, "micro": 9}}}, "Slurm 20.11"),
    ({}, "names no version"),
])
def test_a_version_never_tested_is_read_with_a_warning(meta: dict[str, Any], named: str) -> None:
    # A new Slurm release whose fields did not change keeps working: its answer is read by
    # its fields, and the collector run says the version was never tested.
    payload = load("23.11-squeue.json")
    payload["meta"] = meta
    jobs, warnings = parse_jobs(payload)
    assert jobs == parse_jobs(load("23.11-squeue.json"))[0]
    assert len(warnings) == 1
    assert named in warnings[0] and "read by its fields" in warnings[0]


def test_a_field_that_no_longer_fits_is_refused_naming_it() -> None:
    # A release that renamed a field FleetWatch reads: no record can be read, and the answer
    # is refused naming the field, not taken for a cluster without nodes or jobs.
    payload = load("23.11-scontrol-show-nodes.json")
    payload["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.45"
    for record in payload["nodes"]:
        record["node_state"] = record.pop("state")
    with pytest.raises(ClientError) as err:
        parse_nodes(payload)
    assert err.value.permanent
    assert "v0.0.45" in str(err.value) and "state is None" in str(err.value)

    jobs = load("23.11-squeue.json")
    for record in jobs["jobs"]:
        record["id"] = record.pop("job_id")
    with pytest.raises(ClientError, match="no job_id"):
        parse_jobs(jobs)


def test_a_payload_without_meta_is_read_and_one_without_records_refused() -> None:
    nodes, warnings = parse_nodes({"nodes": load("22.05-sinfo.json")["nodes"]})
    assert nodes == EXPECTED_NODES
    assert "no meta" in warnings[0]
    payload = load("22.05-squeue.json")
    del payload["jobs"]
    with pytest.raises(ClientError, match="no 'jobs' list"):
        parse_jobs(payload)
    with pytest.raises(ClientError, match="not an object"):
        parse_jobs([])


def test_a_reason_left_after_resume_is_not_read_as_current() -> None:
    # 25.11 keeps a node's reason after RESUME and after ReturnToService: an IDLE node that
    # still says "XID 79" is healthy, and reads as 22.05 shows it (no reason).
    payload = load("23.11-scontrol-show-nodes.json")
    payload["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.44"
    payload["nodes"][0]["state"] = ["IDLE"]
    payload["nodes"][0]["reason"] = "fleetwatch: incident 4 XID 79"
    payload["nodes"][1]["state"] = ["IDLE", "NOT_RESPONDING"]
    payload["nodes"][1]["reason"] = "Not responding"
    nodes = parse_nodes(payload)[0]
    assert (nodes[0].state, nodes[0].flags, nodes[0].reason) == ("IDLE", (), "")
    assert nodes[1].reason == "Not responding"  # current: it explains NOT_RESPONDING
    assert nodes[2].reason == "fleetwatch: incident 7 gpu_hardware"  # drained
    assert nodes[3].reason == "admin: psu swap"  # down


def test_per_node_sinfo_records_are_read() -> None:
    # 23.02+'s `sinfo -N --json`: records under "sinfo", one node each.
    record = {"nodes": {"nodes": ["gpu-003"]}, "node": {"state": ["IDLE", "DRAIN"]},
              "reason": {"description": "fleetwatch: incident 7", "time": 1, "user": "root"},
              "partition": {"name": "gpu"}}
    payload = {"meta": {"plugin": {"data_parser": "data_parser/v0.0.44"}},
               "sinfo": [record, {**record, "nodes": {"nodes": ["gpu-001"]},
                                  "node": {"state": ["MIXED"]}, "reason": {"description": ""}}],
               "errors": [], "warnings": []}
    nodes, warnings = parse_nodes(payload)
    assert warnings == []
    assert [(n.name, n.state, n.flags, n.reason, n.partition) for n in nodes] == [
        ("gpu-003", "IDLE", ("DRAIN",), "fleetwatch: incident 7", "gpu"),
        ("gpu-001", "MIXED", (), "", "gpu")]


@pytest.mark.parametrize(("detail", "indices"), [
    ("gpu:2(IDX:4-5)", (4, 5)),
    ("gpu:a100:2(IDX:0,3)", (0, 3)),
    ("gpu:h100:3(IDX:0-1,6)", (0, 1, 6)),
    ("gpu:8(IDX:0-7)", tuple(range(8))),
    ("gpu:4(IDX:0-3),nic:1(IDX:0)", (0, 1, 2, 3)),
    ("nic:1(IDX:0),gpu:1(IDX:7)", (7,)),
    ("gpu:a100:1(IDX:2),gpu:v100:1(IDX:5)", (2, 5)),
    ("gpu(IDX:N/A)", None),
    ("", None),
    ("mps:100(0)", None),
])
def test_gres_detail_gives_the_gpus_a_job_holds(detail: str, indices: tuple[int, ...] | None) -> None:
    assert gpu_indices(detail) == indices


def test_jobs_carry_their_gpus_per_node() -> None:
    payload = load("23.11-squeue.json")
    payload["jobs"][3]["gres_detail"] = ["gpu:8(IDX:0-7)", "gpu:2(IDX:4-5)"]
    payload["jobs"][4]["gres_detail"] = ["gpu:2(IDX:0-1)"]  # pending: not held
    jobs = by_id(parse_jobs(payload)[0])
    assert jobs["4"].gpus == {"gpu-001": tuple(range(8)), "gpu-002": (4, 5)}
    assert jobs["5"].gpus == {}
    # One entry for two nodes: which is which cannot be told, so the GPUs are unknown
    # (an empty map), and the job is still read.
    payload["jobs"][3]["gres_detail"] = ["gpu:8(IDX:0-7)"]
    jobs_read, warnings = parse_jobs(payload)
    assert warnings == []
    assert by_id(jobs_read)["4"].gpus == {}
    assert by_id(jobs_read)["4"].nodes == ("gpu-001", "gpu-002")
    payload["jobs"][3]["gres_detail"] = "gpu:8(IDX:0-7)"  # not a list: the record is skipped
    jobs_read, warnings = parse_jobs(payload)
    assert "4" not in by_id(jobs_read) and "gres_detail is" in warnings[0]


@pytest.mark.parametrize("release", sorted(VERSIONS))
def test_a_malformed_record_is_skipped_and_the_rest_kept(release: str) -> None:
    nodes_file, jobs_file = VERSIONS[release]
    jobs_payload = load(jobs_file)
    jobs_payload["jobs"][2]["job_state"] = 42
    jobs_payload["jobs"][3]["nodes"] = "gpu-[001-"
    jobs_payload["jobs"].append("not a job")
    jobs, warnings = parse_jobs(jobs_payload)
    assert sorted(by_id(jobs)) == ["1", "2", "5"]
    assert len(warnings) == 3
    assert "job record 2" in warnings[0] and "job_state" in warnings[0]
    assert '"name": "vit-sweep"' in warnings[0]  # an excerpt of the record itself
    assert "bad hostlist 'gpu-[001-'" in warnings[1]
    assert "job record 5" in warnings[2]

    nodes_payload = load(nodes_file)
    del nodes_payload["nodes"][1]["name"]
    nodes, warnings = parse_nodes(nodes_payload)
    assert [n.name for n in nodes] == ["gpu-001", "gpu-003", "gpu-004"]
    assert len(warnings) == 1 and "no name" in warnings[0]


def test_the_client_reports_the_latest_reads_warnings(tmp_path: Path) -> None:
    payload = load("22.05-squeue.json")
    payload["jobs"][0]["job_id"] = None
    cli = fake_cli(tmp_path, {"squeue": f"cat <<'EOF'\n{json.dumps(payload)}\nEOF"})
    assert [j.job_id for j in cli.jobs()] == ["2", "3", "4", "5"]
    assert len(cli.last_warnings) == 1
    assert "no job_id" in cli.last_warnings[0]


def test_hostlists_are_expanded() -> None:
    payload = load("23.11-squeue.json")
    payload["jobs"][3]["nodes"] = "gpu-[001-003,010],dgx-a100-[07-08]"
    job = by_id(parse_jobs(payload)[0])["4"]
    assert job.nodes == ("gpu-001", "gpu-002", "gpu-003", "gpu-010", "dgx-a100-07", "dgx-a100-08")


def test_topology_keeps_leaves_only() -> None:
    assert parse_topology((FIXTURES / "22.05-topology.txt").read_text()) == {
        "leaf-a": ["gpu-001", "gpu-002"], "leaf-b": ["gpu-003", "gpu-004"]}
    text = ("SwitchName=s1 Level=0 LinkSpeed=1 Nodes=gpu-[001-016]\n"
            "SwitchName=s2 Level=0 LinkSpeed=1 Nodes=gpu-[017-018,020]\n"
            "SwitchName=core Level=1 LinkSpeed=1 Nodes=gpu-[001-020] Switches=s[1-2]\n")
    leaves = parse_topology(text)
    assert sorted(leaves) == ["s1", "s2"]
    assert len(leaves["s1"]) == 16 and leaves["s1"][-1] == "gpu-016"
    assert leaves["s2"] == ["gpu-017", "gpu-018", "gpu-020"]
    assert parse_topology("") == {}


def test_list_states_fold_like_22_05() -> None:
    # 22.05 prints the flag in place of the base state; the list shapes name both.
    assert job_state("COMPLETING") == "COMPLETING"
    assert job_state(["CANCELLED", "COMPLETING"]) == "COMPLETING"
    assert job_state(["RUNNING"]) == "RUNNING"
    assert job_state(["PENDING", "REQUEUED"]) == "REQUEUED"
    payload = load("23.11-scontrol-show-nodes.json")
    payload["nodes"][0]["state"] = ["DOWN", "DRAIN", "NOT_RESPONDING"]
    node = parse_nodes(payload)[0][0]
    assert (node.state, node.flags) == ("DOWN", ("DRAIN", "NOT_RESPONDING"))


@pytest.mark.parametrize(("value", "code"), [
    (0, 0), (768, 3), (9, 137), (15, 143),  # 22.05: the raw wait status
    ({"set": True, "infinite": False, "number": 256}, 1),  # 23.02
    ({"status": ["ERROR"], "return_code": {"set": True, "infinite": False, "number": 2},
      "signal": {"id": {"set": False, "infinite": False, "number": 0}, "name": ""}}, 2),
    ({"status": ["SIGNALED"], "return_code": {"set": False, "infinite": False, "number": 0},
      "signal": {"id": {"set": True, "infinite": False, "number": 9}, "name": "KILL"}}, 137),
    ({"status": ["SUCCESS"], "return_code": 0}, 0),
    (None, None),
])
def test_exit_codes_from_every_shape(value: Any, code: int | None) -> None:
    assert exit_return_code(value) == code


def test_payload_errors_fail_the_read() -> None:
    # 22.05's sinfo --json with slurmctld down: exit status 0, no nodes, one error.
    payload = load("22.05-sinfo.json")
    payload["nodes"] = []
    payload["errors"] = [{"error": "Unspecified error", "errno": -1}]
    with pytest.raises(ClientError, match="Unspecified error") as err:
        parse_nodes(payload)
    assert not err.value.permanent


@pytest.mark.parametrize(("message", "permanent"), [
    ("scancel: error: Kill job error on job id 99: Invalid job id specified", True),
    ("slurm_update error: Invalid node name specified", True),
    ("Only batch jobs are accepted or processed for job 4", True),
    ("Requested operation is presently disabled for job 3", True),
    ("slurm_load_jobs error: Unable to contact slurm controller (connect failure)", False),
    ("slurm_load_node error: Socket timed out on send/recv operation", False),
    ("something new", None),
])
def test_error_classification(message: str, permanent: bool | None) -> None:
    assert classify(message) is permanent


def test_small_helpers() -> None:
    assert owned_reason("incident 3 gpu_hardware") == "fleetwatch: incident 3 gpu_hardware"
    assert owned_reason("fleetwatch: incident 3") == "fleetwatch: incident 3"
    assert owned_reason("two\nlines") == "fleetwatch: two lines"
    assert [signal_name(s) for s in ("TERM", "SIGTERM", "15", "sigusr1", 9)] == \
        ["TERM", "TERM", "TERM", "USR1", "KILL"]
    assert slurm_release("slurm-wlm 22.05.8") == (22, 5)
    assert slurm_release("slurm 23.11.4") == (23, 11)


# --- the command runner, against stand-in executables ----------------------------------------


def fake_cli(tmp_path: Path, scripts: dict[str, str], **kwargs: Any) -> SlurmCli:
    """A SlurmCli whose bin_dir holds small shell scripts in place of Slurm's commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\necho run >> {tmp_path}/{name}.calls\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return SlurmCli(bin_dir=str(bin_dir), backoff=0.01, **kwargs)


def calls(tmp_path: Path, name: str) -> int:
    log = tmp_path / f"{name}.calls"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_transient_failure_is_retried_then_reported(tmp_path: Path) -> None:
    cli = fake_cli(tmp_path, {"squeue": "echo 'slurm_load_jobs error: Unable to contact slurm "
                                        "controller (connect failure)' >&2; exit 1"}, retries=2)
    with pytest.raises(ClientError, match="Unable to contact slurm controller") as err:
        cli.jobs()
    assert not err.value.permanent
    assert calls(tmp_path, "squeue") == 3


def test_a_permanent_failure_is_not_retried(tmp_path: Path) -> None:
    cli = fake_cli(tmp_path, {"scontrol": "echo 'Invalid job id specified' >&2; exit 1"})
    with pytest.raises(ClientError) as err:
        cli._run("scontrol", "requeue", "99")
    assert err.value.permanent
    assert calls(tmp_path, "scontrol") == 1


def test_a_hung_command_times_out_as_transient(tmp_path: Path) -> None:
    cli = fake_cli(tmp_path, {"squeue": "exec sleep 5"}, timeout=0.3, retries=1)
    with pytest.raises(ClientError, match="timed out") as err:
        cli.jobs()
    assert not err.value.permanent
    assert calls(tmp_path, "squeue") == 2


def test_errors_on_stderr_with_status_zero_count(tmp_path: Path) -> None:
    # 22.05's scontrol show topology with slurmctld down exits 0.
    cli = fake_cli(tmp_path, {"scontrol": "echo 'slurm_load_topo error: Unable to contact slurm "
                                          "controller (connect failure)' >&2; exit 0"}, retries=0)
    with pytest.raises(ClientError) as err:
        cli.topology()
    assert not err.value.permanent


def test_env_reaches_the_commands(tmp_path: Path) -> None:
    payload = load("22.05-squeue.json")
    script = ('[ "$SLURM_CONF" = /etc/fleet/slurm.conf ] || exit 3\n'
              f"cat <<'EOF'\n{json.dumps(payload)}\nEOF")
    cli = fake_cli(tmp_path, {"squeue": script}, env={"SLURM_CONF": "/etc/fleet/slurm.conf"})
    assert len(cli.jobs()) == 5


def test_the_payload_is_not_changed_by_parsing() -> None:
    payload = load("24.05-squeue.json")
    before = copy.deepcopy(payload)
    parse_jobs(payload)
    assert payload == before


# --- real Slurm 25.11 answers (tests/fixtures/slurm/capture.py) ----------------------------------

CAPTURED = FIXTURES / "25.11"
NODE_ANSWERS = ["sinfo-N.json", "scontrol-show-nodes.json",
                *[f"rest-v0.0.4{v}-nodes.json" for v in range(1, 5)]]
JOB_ANSWERS = ["squeue-all-states.json", "scontrol-show-jobs.json",
               *[f"rest-v0.0.4{v}-jobs.json" for v in range(1, 5)]]


def captured(name: str) -> dict[str, Any]:
    return json.loads((CAPTURED / name).read_text())


@pytest.mark.parametrize("answer", NODE_ANSWERS)
def test_real_25_11_node_answers_read_alike(answer: str) -> None:
    nodes, warnings = parse_nodes(captured(answer))
    assert warnings == []
    assert [(n.name, n.state, n.flags, n.reason) for n in nodes] == [
        ("gpu-001", "MIXED", (), ""), ("gpu-002", "MIXED", (), ""),
        ("gpu-003", "IDLE", ("DRAIN",), "fleetwatch: incident 7 gpu_hardware"),
        ("gpu-004", "IDLE", ("DRAIN",), "slurm-operator: Node is cordoned")]


@pytest.mark.parametrize("answer", JOB_ANSWERS)
def test_real_25_11_job_answers_read_alike_with_each_jobs_gpus(answer: str) -> None:
    jobs, warnings = parse_jobs(captured(answer))
    assert warnings == []
    assert sorted((j.name, j.state, j.nodes, dict(j.gpus), j.restart_count) for j in jobs) == [
        ("cancelled", "CANCELLED", ("gpu-003",), {}, 0),  # finished jobs are listed too
        ("requeued", "PENDING", (), {}, 1),
        ("shared-a", "RUNNING", ("gpu-001",), {"gpu-001": (0, 1)}, 0),
        ("shared-b", "RUNNING", ("gpu-001",), {"gpu-001": (2, 3)}, 0),
        ("whole", "RUNNING", ("gpu-002",), {"gpu-002": tuple(range(8))}, 0)]


def test_real_25_11_grouped_sinfo_is_refused_as_it_merges_reasons() -> None:
    # Plain `sinfo --json` put gpu-004 (drained by slurm-operator) under gpu-003's FleetWatch
    # reason: read as nodes, someone else's drain would look like FleetWatch's.
    grouped = captured("sinfo-grouped.json")
    assert grouped["sinfo"][0]["nodes"]["nodes"] == ["gpu-003", "gpu-004"]
    with pytest.raises(ClientError, match="sinfo -N --json") as err:
        parse_nodes(grouped)
    assert err.value.permanent
