"""The engine on small hand-made windows, and the ``diagnose`` command on files."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from collectors.clients.base import GpuMetric
from collectors.normalize import xid_changes
from incidents.diagnosis import JobInfo, Observation, diagnose, diagnose_window

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "tests" / "scenarios"
T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
NODES = ("gpu-001", "gpu-002", "gpu-003", "gpu-004")
JOB = JobInfo("4123", "alice", NODES)
TOPOLOGY = {"leaf-a": list(NODES), "leaf-b": ["gpu-005", "gpu-006", "gpu-007", "gpu-008"]}
XID79 = "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
WATCHDOG = "[Rank 8] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=88) ran for 600013 ms"


def obs(seconds: float, source: str, ident: int | None = None, **fields: Any) -> Observation:
    return Observation.from_record({"source": source, **fields}, T0 + timedelta(seconds=seconds),
                                   id=ident)


def test_xid79_blames_only_the_node_that_reported_it() -> None:
    window = [
        obs(0, "dcgm", 1, node="gpu-002", gpu=5, metric="DCGM_FI_DEV_XID_ERRORS", value=79),
        *[obs(600, "job_log", 10 + i, job="4123", node=n, message=WATCHDOG)
          for i, n in enumerate(["gpu-001", "gpu-003", "gpu-004"])],
        obs(610, "slurm", 20, job="4123", job_state="NODE_FAIL", nodes=list(NODES)),
    ]
    [d] = diagnose(window, TOPOLOGY, [JOB])
    assert (d.root_cause, d.nodes, d.playbook) == ("gpu_hardware", ("gpu-002",), "replace_node")
    assert d.jobs == ("4123",) and d.confidence > 0.9
    assert set(d.evidence) >= {1, 10, 11, 12}
    # The explanation cites the line, the GPU, the time and the victims.
    for words in ("XID 79", "GPU has fallen off the bus", "GPU 5", "10:00:00", "gpu-001",
                  "symptoms, not causes"):
        assert words in d.explanation


def test_a_gauge_that_keeps_reading_79_is_one_fault_and_a_new_code_is_news() -> None:
    window = [obs(15 * k, "dcgm", k, node="gpu-002", gpu=5, metric="DCGM_FI_DEV_XID_ERRORS",
                  value=79) for k in range(20)]
    [d] = diagnose(window)
    assert d.evidence == (0,)
    assert diagnose([obs(0, "dcgm", node="gpu-003", gpu=1, metric="DCGM_FI_DEV_XID_ERRORS",
                         value=0)]) == []


def test_the_same_fault_from_dcgm_and_the_kernel_log_is_one_diagnosis() -> None:
    window = [obs(0, "dcgm", 1, node="gpu-002", gpu=5, metric="DCGM_FI_DEV_XID_ERRORS", value=79),
              obs(5, "kernel", 2, node="gpu-002", message=XID79)]
    [d] = diagnose(window)
    assert d.evidence == (1, 2)
    assert d.fingerprint == "gpu_hardware:gpu-002"


def test_application_xids_blame_the_job_not_the_node() -> None:
    window = [obs(0, "dcgm", node=n, gpu=g, metric="DCGM_FI_DEV_XID_ERRORS", value=13)
              for n in NODES for g in range(8)]
    [d] = diagnose(window, TOPOLOGY, [JOB])
    assert (d.root_cause, d.nodes, d.job) == ("application_error", (), "4123")


def test_a_leaf_losing_its_links_blames_the_switch_and_a_lone_flap_blames_its_node() -> None:
    window = [obs(k * 0.3, "nic", node=n, device="mlx5_0", port=1, state="DOWN")
              for k, n in enumerate(NODES)]
    window += [obs(300, "nic", node="gpu-006", device="mlx5_0", port=1, state="DOWN"),
               obs(305, "nic", node="gpu-006", device="mlx5_0", port=1, state="ACTIVE")]
    found = {(d.root_cause, d.switch, d.nodes) for d in diagnose(window, TOPOLOGY)}
    assert found == {("switch_failure", "leaf-a", NODES), ("network_flap", None, ("gpu-006",))}


def test_one_source_saying_the_whole_fleet_went_away_is_a_source_outage() -> None:
    nodes = [*NODES, *TOPOLOGY["leaf-b"]]
    window = [obs(i * 0.2, "slurm", node=n, node_state=["IDLE", "NOT_RESPONDING"])
              for i, n in enumerate(nodes)]
    result = diagnose_window(window, TOPOLOGY)
    assert result.diagnoses == []
    [note] = [n for n in result.notes if n.kind == "source_outage"]
    assert note.source == "slurm" and "8 of 8 nodes" in note.text
    # The same report for one node, with nothing else to explain it, is that node.
    [d] = diagnose(window[:1], TOPOLOGY)
    assert (d.root_cause, d.nodes) == ("node_unreachable", ("gpu-001",))


def test_a_collector_reporting_itself_down_mutes_its_node_states() -> None:
    window = [obs(0, "collector", name="kubernetes", healthy=False, error="apiserver timeout"),
              obs(10, "kubernetes", node="gpu-003", condition="Ready", status="Unknown",
                  reason="NodeStatusUnknown")]
    result = diagnose_window(window, TOPOLOGY)
    assert result.diagnoses == []
    assert any(n.kind == "source_outage" and "apiserver timeout" in n.text for n in result.notes)


def test_sustained_thermal_slowdown_when_hot_but_not_when_only_warm() -> None:
    def gpu(temp: float, mask: int) -> list[Observation]:
        out = []
        for k in range(10):
            out.append(obs(15 * k, "dcgm", node="gpu-004", gpu=2, metric="DCGM_FI_DEV_GPU_TEMP",
                           value=temp))
            out.append(obs(15 * k, "dcgm", node="gpu-004", gpu=2,
                           metric="DCGM_FI_DEV_CLOCKS_EVENT_REASONS", value=mask))
        return out

    [d] = diagnose(gpu(93, 0x40))
    assert (d.root_cause, d.nodes) == ("thermal", ("gpu-004",))
    assert "hw thermal slowdown" in d.explanation and "93 C" in d.explanation
    assert diagnose(gpu(84, 0)) == []          # warm at full clocks
    assert diagnose(gpu(60, 0x80)) == []       # power brake, not heat
    assert diagnose(gpu(93, 0x40)[:4]) == []   # two scrapes are a blip, not sustained


def _clocks(node: str, masks: list[int], temp: float, step: float = 15) -> list[Observation]:
    out = []
    for k, mask in enumerate(masks):
        out.append(obs(step * k, "dcgm", node=node, gpu=1, metric="DCGM_FI_DEV_GPU_TEMP",
                       value=temp))
        out.append(obs(step * k, "dcgm", node=node, gpu=1,
                       metric="DCGM_FI_DEV_CLOCKS_EVENT_REASONS", value=mask))
    return out


def test_a_gpu_bouncing_off_its_thermal_limit_is_one_sustained_slowdown() -> None:
    [d] = diagnose(_clocks("gpu-003", [0x40, 0] * 10, 91))
    assert (d.root_cause, d.nodes) == ("thermal", ("gpu-003",))
    # Two separate one-scrape touches a few minutes apart are not.
    assert diagnose(_clocks("gpu-003", [0x40] + [0] * 12 + [0x40, 0], 91)) == []


def test_hw_slowdown_is_heat_when_hot_and_power_when_the_brake_is_set() -> None:
    [d] = diagnose(_clocks("gpu-001", [0x8] * 10, 94))
    assert (d.root_cause, d.nodes) == ("thermal", ("gpu-001",))
    assert diagnose(_clocks("gpu-001", [0x8] * 10, 62)) == []      # slowed, but not hot
    assert diagnose(_clocks("gpu-001", [0x88] * 10, 94)) == []     # the power brake


def test_a_collector_is_recognised_by_the_words_in_its_name() -> None:
    for name in ("kube-apiserver", "K8s-East", "kubernetes"):
        window = [obs(0, "collector", name=name, healthy=False, error="etcd timeout"),
                  obs(10, "kubernetes", node="gpu-003", condition="Ready", status="Unknown",
                      reason="NodeStatusUnknown")]
        assert diagnose(window, TOPOLOGY) == [], name


def test_link_error_recovery_drifting_up_over_hours_is_not_a_flap() -> None:
    drift = [obs(600 * k, "nic", node="gpu-002", device="mlx5_0", port=1,
                 counter="link_error_recovery", value=40 + k) for k in range(12)]
    assert diagnose(drift, TOPOLOGY) == []
    burst = [obs(20 * k, "nic", node="gpu-002", device="mlx5_0", port=1,
                 counter="link_error_recovery", value=40 + 2 * k) for k in range(5)]
    [d] = diagnose(burst, TOPOLOGY)
    assert (d.root_cause, d.nodes) == ("network_flap", ("gpu-002",))


def test_a_node_whose_gpu_failed_going_down_with_its_link_is_one_fault() -> None:
    window = [obs(0, "kernel", node="gpu-002", message=XID79),
              obs(200, "kubernetes", node="gpu-002", condition="Ready", status="Unknown",
                  reason="NodeStatusUnknown"),
              obs(201, "nic", node="gpu-002", device="mlx5_0", port=1, state="DOWN"),
              obs(500, "nic", node="gpu-002", device="mlx5_0", port=1, state="ACTIVE")]
    result = diagnose_window(window, TOPOLOGY, [JOB])
    assert [(d.root_cause, d.nodes) for d in result.diagnoses] == [("gpu_hardware", ("gpu-002",))]
    assert any("after its GPU fault" in n.text for n in result.notes)


def test_most_of_a_leaf_going_quiet_at_once_is_the_switch_even_without_link_reports() -> None:
    topology = {**TOPOLOGY, "leaf-c": ["gpu-009", "gpu-010", "gpu-011", "gpu-012"]}
    window = [obs(i, "kubernetes", node=n, condition="Ready", status="Unknown",
                  reason="NodeStatusUnknown") for i, n in enumerate(NODES[:3])]
    window += [obs(30 + i, "slurm", node=n, node_state=["DOWN", "NOT_RESPONDING"],
                   reason="Not responding") for i, n in enumerate(NODES[:3])]
    [d] = diagnose(window, topology)
    assert (d.root_cause, d.switch) == ("switch_failure", "leaf-a")
    assert "kept answering" in d.explanation
    # Two nodes of a leaf are two nodes.
    found = {(d.root_cause, d.nodes) for d in diagnose(window[:2] + window[3:5], topology)}
    assert found == {("node_unreachable", ("gpu-001",)), ("node_unreachable", ("gpu-002",))}


def test_an_application_xid_follows_a_gpu_across_jobs_placed_by_their_output() -> None:
    first, second = JobInfo("a1", "ann", ("gpu-003",)), JobInfo("a2", "ben", ("gpu-003",))
    xid13 = ("NVRM: Xid (PCI:0000:3b:00): 13, pid=881, name=python, Graphics SM Warp Exception "
             "on (GPC 4, TPC 2, SM 1): Out Of Range Register")
    window = [obs(0, "job_log", job="a1", node="gpu-003", message="step 10 loss 3.1"),
              obs(300, "kernel", node="gpu-003", message=xid13),
              obs(301, "job_log", job="a1", node="gpu-003",
                  message="RuntimeError: CUDA error: an illegal instruction was encountered"),
              obs(1200, "job_log", job="a2", node="gpu-003", message="step 1 loss 2.7"),
              obs(1800, "kernel", node="gpu-003", message=xid13),
              obs(1801, "job_log", job="a2", node="gpu-003",
                  message="RuntimeError: CUDA error: an illegal instruction was encountered")]
    [d] = diagnose(window, TOPOLOGY, [first, second])
    assert (d.root_cause, d.nodes, d.jobs) == ("gpu_hardware", ("gpu-003",), ("a1", "a2"))


def test_an_application_xid_in_two_mig_instances_is_not_one_gpu_following_jobs() -> None:
    first, second = JobInfo("m1", "ann", ("gpu-003",)), JobInfo("m2", "ben", ("gpu-003",))

    def xid13(instance: int) -> str:
        return (f"NVRM: Xid (PCI:0000:3b:00 GPU-I:{instance:02d}): 13, pid=881, name=python, "
                "Graphics SM Warp Exception on (GPC 4, TPC 2, SM 1): Out Of Range Register")

    crash = "RuntimeError: CUDA error: an illegal instruction was encountered"
    window = [obs(0, "job_log", job="m1", node="gpu-003", message="step 10 loss 3.1"),
              obs(300, "kernel", node="gpu-003", message=xid13(1)),
              obs(301, "job_log", job="m1", node="gpu-003", message=crash),
              obs(1200, "job_log", job="m2", node="gpu-003", message="step 1 loss 2.7"),
              obs(1800, "kernel", node="gpu-003", message=xid13(2)),
              obs(1801, "job_log", job="m2", node="gpu-003", message=crash)]
    found = {(d.root_cause, d.job) for d in diagnose(window, TOPOLOGY, [first, second])}
    assert found == {("application_error", "m1"), ("application_error", "m2")}


def test_dcgm_labels_as_strings_keep_each_gpu_apart() -> None:
    # XID 119 once on GPU 1; the other GPUs keep reading 0. Read as one GPU, the gauge would
    # flip 0 -> 119 -> 0 on every scrape and look like a repeated XID 119.
    window = [obs(15 * k + g * 0.01, "dcgm", node="gpu-001", gpu=str(g),
                  metric="DCGM_FI_DEV_XID_ERRORS", value=str(119 if g == 1 and k >= 2 else 0))
              for k in range(10) for g in range(4)]
    assert diagnose(window) == []


def test_xid154_asking_for_any_action_blames_the_node_and_none_does_not() -> None:
    def xid154(text: str) -> list[Observation]:
        return [obs(0, "kernel", node="gpu-004", message="NVRM: Xid (PCI:0000:3b:00): 154, "
                    f"pid='<unknown>', name=<unknown>, GPU recovery action changed from {text}")]

    for target in ("0x1 (GPU Reset Required)", "0x2 (Node Reboot Required)", "0x3 (Drain P2P)",
                   "0x4 (Drain and Reset)"):
        [d] = diagnose(xid154(f"0x2 (Node Reboot Required) to {target}"))
        assert (d.root_cause, d.nodes) == ("gpu_hardware", ("gpu-004",)), target
    assert diagnose(xid154("0x1 (GPU Reset Required) to 0x0 (None)")) == []


def test_oom_in_one_job_and_a_flap_in_another_are_two_diagnoses() -> None:
    other = JobInfo("5000", "bob", ("gpu-005", "gpu-006"))
    window = [obs(0, "nic", node="gpu-002", device="mlx5_0", port=1, state="DOWN"),
              obs(4, "nic", node="gpu-002", device="mlx5_0", port=1, state="ACTIVE"),
              obs(10, "job_log", job="4123", node="gpu-003",
                  message="NET/IB : Got completion from peer 10.0.0.2<4000> with status=12"),
              obs(20, "job_log", job="5000", node="gpu-006",
                  message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"),
              obs(21, "slurm", job="5000", job_state=["FAILED"], nodes=["gpu-005", "gpu-006"],
                  exit_code={"status": ["FAILED"], "return_code": 1})]
    found = {(d.root_cause, d.nodes, d.job) for d in diagnose(window, TOPOLOGY, [JOB, other])}
    assert found == {("network_flap", ("gpu-002",), None), ("application_error", (), "5000")}


def test_xid_gauge_collector_fires_on_change_only() -> None:
    m = GpuMetric("gpu-001", 3, "GPU-x", 0.0, None, 79)
    assert len(xid_changes(0, m)) == 1
    assert xid_changes(79, m) == []  # the next scrape of the same gauge is not a new fault
    assert xid_changes(0, GpuMetric("gpu-001", 3, "GPU-x", 90.0, 50.0, 0)) == []


def _diagnose_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", "fleetwatch", "diagnose", *args],
                          cwd=ROOT, capture_output=True, text=True, check=False,
                          env={"PATH": "/usr/bin:/bin", "FLEETWATCH_DATA_DIR": "/tmp/fw-cli"})


def test_replay_of_the_xid79_example_blames_the_right_node() -> None:
    result = _diagnose_cli(str(SCENARIOS / "example-xid79-peers-timeout.json"))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["scenario"] == "example-xid79-peers-timeout"
    [incident] = out["incidents"]
    assert (incident["root_cause"], incident["nodes"], incident["playbook"]) == (
        "gpu_hardware", ["node0204"], "replace_node")
    assert 0 < incident["confidence"] <= 1 and "node0204" in incident["explanation"]


def test_replay_of_bad_files_names_each_and_still_diagnoses_the_rest(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    other_format = tmp_path / "other.json"
    other_format.write_text('{"format": "something-else/2", "signals": []}')
    naive_time = tmp_path / "naive.json"
    naive_time.write_text(json.dumps({"format": "fleetwatch-replay/1", "signals": [
        {"at": "2026-12-02T10:00:00", "source": "kernel", "node": "n1", "message": XID79}]}))
    wrong_type = tmp_path / "wrong.json"
    wrong_type.write_text(json.dumps({"format": "fleetwatch-replay/1", "jobs": {"id": 1},
                                      "signals": []}))
    good = SCENARIOS / "example-maintenance-drain.json"
    result = _diagnose_cli(str(broken), str(other_format), str(naive_time), str(wrong_type),
                           str(good), "--pretty")
    assert result.returncode == 2
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 4
    assert errors[0].startswith(f"{broken}: not valid JSON")
    assert errors[1] == f"{other_format}: not a fleetwatch-replay/1 document"
    assert errors[2].startswith(f"{naive_time}: signal 0: time") and "UTC offset" in errors[2]
    assert errors[3] == f"{wrong_type}: 'jobs' must be a list"
    [only] = json.loads(result.stdout)
    assert only["scenario"] == "example-maintenance-drain" and only["incidents"] == []


def test_replay_refuses_unknown_sources_signals_without_time_and_missing_files(
        tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"format": "fleetwatch-replay/1", "signals": [
        {"at": "2026-12-02T10:00:00Z", "source": "kernel", "node": "n1", "message": XID79},
        {"at": "2026-12-02T10:00:01Z", "source": "syslog", "node": "n1", "message": "hi"}]}))
    no_time = tmp_path / "no-time.json"
    no_time.write_text(json.dumps({"format": "fleetwatch-replay/1", "signals": [
        {"source": "kernel", "node": "n1", "message": XID79}]}))
    missing = tmp_path / "missing.json"
    good = SCENARIOS / "example-xid79-peers-timeout.json"
    result = _diagnose_cli(str(unknown), str(no_time), str(missing), str(good))
    assert result.returncode == 2
    errors = result.stderr.strip().splitlines()
    assert errors == [
        f"{unknown}: signal 1: unknown source 'syslog' (expected one of kernel, dcgm, nic, "
        "slurm, kubernetes, job_log, collector, gpud)",
        f"{no_time}: signal 0: 'at' must be an RFC 3339 string",
        f"{missing}: cannot read: No such file or directory",
    ]
    [only] = [json.loads(line) for line in result.stdout.splitlines()]
    assert only["scenario"] == "example-xid79-peers-timeout"


def test_check_mode_exits_1_when_a_verdict_differs_from_expect(tmp_path: Path) -> None:
    doc = json.loads((SCENARIOS / "example-xid79-peers-timeout.json").read_text())
    doc["expect"] = [{"root_cause": "gpu_hardware", "nodes": ["node0203"]}]
    wrong = tmp_path / "wrong-expect.json"
    wrong.write_text(json.dumps(doc))
    result = _diagnose_cli("--check", str(wrong))
    assert result.returncode == 1
    assert "missing [['gpu_hardware', 'node0203']]" in result.stderr
    assert "unexpected [['gpu_hardware', 'node0204']]" in result.stderr
