"""The diagnosis-quality bench's scoring (tests/bench/quality.py) on small replay documents
whose expectations are set against what the engine finds: one right, one blaming a healthy
node, one missing a fault, one blaming the right node for the wrong cause."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.bench import quality

XID79 = "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def doc(name: str, xid_on: list[str], expect: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": "fleetwatch-replay/1", "name": name,
        "topology": {"leaf-a": ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]},
        "signals": [{"at": f"2026-12-02T10:00:0{i}Z", "source": "kernel", "node": node,
                     "message": XID79} for i, node in enumerate(xid_on)],
        "expect": expect,
    }


SCENARIOS = [
    ("right", doc("right", ["gpu-002"], [{"root_cause": "gpu_hardware", "nodes": ["gpu-002"]}])),
    ("healthy", doc("healthy", ["gpu-002", "gpu-003"],
                    [{"root_cause": "gpu_hardware", "nodes": ["gpu-002"]}])),
    ("missed", doc("missed", [], [{"root_cause": "gpu_hardware", "nodes": ["gpu-001"]}])),
    ("wrong-cause", doc("wrong-cause", ["gpu-002"], [{"root_cause": "thermal",
                                                      "nodes": ["gpu-002"]}])),
]


def test_counts_matrix_and_healthy_nodes() -> None:
    report = quality.score(SCENARIOS)

    assert (report["right"], report["scenarios"]) == (1, 4)
    assert [w["scenario"] for w in report["wrong"]] == ["healthy", "missed", "wrong-cause"]
    wrong_cause = report["wrong"][2]
    assert wrong_cause["expected"] == [["thermal", "gpu-002"]]
    assert wrong_cause["got"] == [["gpu_hardware", "gpu-002"]]

    gpu = report["causes"]["gpu_hardware"]
    assert (gpu["expected"], gpu["tp"], gpu["fp"], gpu["fn"]) == (3, 2, 2, 1)
    assert gpu["precision"] == 0.5
    assert abs(gpu["recall"] - 2 / 3) < 1e-9
    thermal = report["causes"]["thermal"]
    assert (thermal["expected"], thermal["tp"], thermal["fp"], thermal["fn"]) == (1, 0, 0, 1)
    assert thermal["precision"] is None
    assert thermal["recall"] == 0
    assert report["causes"]["fail_slow"]["expected"] == 0  # every label has a row

    m = report["matrix"]
    assert m["gpu_hardware"]["gpu_hardware"] == 2   # right, and the expected node of "healthy"
    assert m["none"]["gpu_hardware"] == 1           # gpu-003, healthy, blamed
    assert m["gpu_hardware"]["none"] == 1           # gpu-001 missed
    assert m["thermal"]["gpu_hardware"] == 1        # gpu-002 expected thermal, blamed gpu_hardware
    assert sum(sum(row.values()) for row in m.values()) == 5

    # The wrong cause's node is named by an expectation: only gpu-003 is healthy and blamed.
    assert report["healthy_nodes_blamed"] == 1
    assert report["healthy_blamed"] == [{"scenario": "healthy", "node": "gpu-003",
                                         "cause": "gpu_hardware"}]


def test_symptomatic_node_of_a_switch_failure_is_not_healthy() -> None:
    expect = [{"root_cause": "switch_failure", "switch": "leaf-a", "nodes": ["gpu-002"]}]
    report = quality.score([("switch", doc("switch", ["gpu-002"], expect))])
    assert report["healthy_nodes_blamed"] == 0
    assert report["matrix"]["switch_failure"]["none"] == 1          # leaf-a missed
    assert report["matrix"]["switch_failure"]["gpu_hardware"] == 1  # its node blamed instead
    assert report["right"] == 0


def test_cli_writes_reports_and_fails_loudly(tmp_path: Path) -> None:
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    for name, document in SCENARIOS[:2]:
        (scenarios / f"{name}.json").write_text(json.dumps(document))
    (scenarios / "broken.json").write_text("{not json")

    assert quality.main([str(scenarios), "--out", str(tmp_path / "out")]) == 1
    report = json.loads((tmp_path / "out" / "bench-quality.json").read_text())
    assert (report["right"], report["scenarios"], report["healthy_nodes_blamed"]) == (1, 3, 1)
    assert any("not valid JSON" in w.get("error", "") for w in report["wrong"])
    md = (tmp_path / "out" / "bench-quality.md").read_text()
    assert "gpu-003 blamed for gpu_hardware" in md

    assert quality.main([str(scenarios / "right.json"), "--out", str(tmp_path / "ok")]) == 0
    assert quality.main([str(scenarios), "--no-fail", "--out", str(tmp_path / "nf")]) == 0
