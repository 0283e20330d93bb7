from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from collectors.clients.base import GpuMetric
from collectors.normalize import xid_changes
from incidents.diagnosis import JobInfo, Observation, diagnose

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "tests" / "scenarios"  # copies of shared/scenarios, so a clone is self-contained
T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
JOB = JobInfo("4123", "alice", ("gpu-001", "gpu-002", "gpu-003", "gpu-004"))


def test_xid79_blames_only_the_node_that_reported_it() -> None:
    observations = [
        Observation(T0, "dcgm", "xid", "gpu-002", 5, code=79, id=1),
        *[Observation(T0 + timedelta(minutes=10), "job_log", "job_log", n, job="4123",
                      message="Watchdog caught collective operation timeout", id=10 + i)
          for i, n in enumerate(["gpu-001", "gpu-003", "gpu-004"])],
    ]
    [d] = diagnose(observations, {"leaf-a": list(JOB.nodes)}, [JOB])
    assert (d.root_cause, d.nodes, d.playbook) == ("gpu_hardware", ("gpu-002",), "replace_node")
    assert d.jobs == ("4123",)
    assert d.evidence == (1,)
    assert d.confidence > 0.9
    assert "GPU has fallen off the bus" in d.explanation and "GPU 5" in d.explanation


def test_a_kernel_xid_line_is_read_too() -> None:
    line = ("NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, "
            "GPU has fallen off the bus.")
    [d] = diagnose([Observation(T0, "kernel", "kernel_log", "gpu-007", message=line)])
    assert d.nodes == ("gpu-007",)


def test_application_and_memory_xids_do_not_open_a_hardware_incident() -> None:
    observations = [Observation(T0, "dcgm", "xid", "gpu-001", 0, code=13),
                    Observation(T0, "dcgm", "xid", "gpu-001", 0, code=31)]
    assert diagnose(observations) == []


def test_the_same_fault_seen_twice_is_one_diagnosis() -> None:
    observations = [Observation(T0, "dcgm", "xid", "gpu-002", 5, code=79, id=1),
                    Observation(T0 + timedelta(seconds=5), "kernel", "kernel_log", "gpu-002",
                                message="NVRM: Xid (PCI:0000:ab:00): 79, pid=1, name=x", id=2)]
    [d] = diagnose(observations)
    assert d.evidence == (1, 2)
    assert d.fingerprint == "gpu_hardware:gpu-002"


def test_xid_gauge_fires_on_change_only() -> None:
    m = GpuMetric("gpu-001", 3, "GPU-x", 0.0, None, 79)
    assert len(xid_changes(0, m)) == 1
    assert xid_changes(79, m) == []  # the next scrape of the same gauge is not a new fault
    assert xid_changes(0, GpuMetric("gpu-001", 3, "GPU-x", 90.0, 50.0, 0)) == []


def _diagnose_cli(*files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", "fleetwatch", "diagnose", *files],
                          cwd=ROOT, capture_output=True, text=True, check=False,
                          env={"PATH": "/usr/bin:/bin", "FLEETWATCH_DATA_DIR": "/tmp/fw-cli"})


def test_replay_of_the_xid79_example_blames_the_right_node(tmp_path: Path) -> None:
    result = _diagnose_cli(str(SCENARIOS / "example-xid79-peers-timeout.json"))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["scenario"] == "example-xid79-peers-timeout"
    assert [(i["root_cause"], i["nodes"]) for i in out["incidents"]] == [
        ("gpu_hardware", ["node0204"])]


def test_replay_of_a_bad_file_names_it_and_still_diagnoses_the_rest(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    good = SCENARIOS / "example-maintenance-drain.json"
    result = _diagnose_cli(str(bad), str(good))
    assert result.returncode == 2
    assert f"{bad}: not valid JSON" in result.stderr
    assert json.loads(result.stdout)["incidents"] == []
