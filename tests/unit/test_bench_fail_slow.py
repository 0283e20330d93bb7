"""The fail-slow bench (tests/bench/fail_slow.py): its fleets are what it says (every GPU of
every job read each minute, stragglers where planned, the same fleet for the same seed) and its
scoring counts each node once: a straggler found or missed, a healthy node flagged or not."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from collectors.knowledge import dcgm
from tests.bench import fail_slow


def test_a_fleet_is_every_gpu_of_every_job_each_minute_and_reproducible() -> None:
    observations, jobs = fail_slow.fleet(5, 6)
    again, _ = fail_slow.fleet(5, 6)
    assert [(o.at, o.node, o.gpu, o.metric, o.value) for o in observations] == [
        (o.at, o.node, o.gpu, o.metric, o.value) for o in again]
    nodes = [n for j in jobs for n in j.nodes]
    assert len(nodes) == len(set(nodes))  # no node in two jobs
    clocks = Counter((o.node, o.gpu) for o in observations if o.metric == dcgm.SM_CLOCK)
    assert set(clocks) == {(n, g) for n in nodes for g in range(fail_slow.GPUS)}
    assert set(clocks.values()) == {fail_slow.MINUTES}
    assert all(j.straggler in j.nodes for j in jobs if j.kind is not None)


def test_scoring_counts_every_node_once(tmp_path: Path) -> None:
    report = fail_slow.score([5], 6)
    _, jobs = fail_slow.fleet(5, 6)
    stragglers = sum(1 for j in jobs if j.kind is not None)
    assert report["stragglers"] == stragglers == report["found"] + report["missed"]
    assert report["healthy_nodes"] == sum(len(j.nodes) for j in jobs) - stragglers
    assert report["healthy_nodes"] == sum(c["healthy_nodes"]
                                          for c in report["look_alikes"].values())
    assert sum(c["stragglers"] for c in report["kinds"].values()) == stragglers
    assert fail_slow.main(["--out", str(tmp_path), "--fleets", "1", "--jobs", "4"]) == 0
    assert "Precision" in (tmp_path / "bench-fail-slow.md").read_text()
