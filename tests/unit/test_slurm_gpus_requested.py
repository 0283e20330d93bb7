"""What a job asks for in GPUs, from every shape Slurm writes it in (22.05 through 25.11):
the pending demand lending reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.clients.slurm import job_gpus_requested, parse_jobs, tres_gpus

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


@pytest.mark.parametrize(("text", "gpus"), [
    ("gres:gpu:8", 8),  # 22.05's tres_per_node
    ("gres/gpu:2", 2),  # 23.02+
    ("gres/gpu:a100:2,gres/gpu:h100:1", 3),  # typed GPUs, summed
    ("cpu=1,mem=4000M,node=1,billing=1,gres/gpu=4", 4),  # tres_req_str
    ("gres/gpu:a100=2", 2),
    ("cpu=1,mem=4000M,node=1,billing=1", None),
    ("gres/nic:1", None),
    ("", None),
])
def test_tres_strings(text: str, gpus: int | None) -> None:
    assert tres_gpus(text) == gpus


def test_per_node_times_nodes_per_job_first() -> None:
    assert job_gpus_requested({"tres_per_node": "gres:gpu:8", "node_count": 4}) == 32
    assert job_gpus_requested({"tres_per_node": "gres/gpu:2",
                               "node_count": {"set": True, "infinite": False, "number": 3}}) == 6
    assert job_gpus_requested({"tres_per_job": "gres/gpu:5", "tres_per_node": "gres/gpu:8",
                               "node_count": 2}) == 5
    # Asks per node, node count unknown: not said (never read as none).
    assert job_gpus_requested({"tres_per_node": "gres/gpu:8",
                               "node_count": {"set": False}}) is None
    assert job_gpus_requested({"tres_req_str": "cpu=1,node=1"}) == 0


@pytest.mark.parametrize("fixture", ["22.05-squeue.json", "24.05-squeue.json",
                                     "25.11/squeue-all-states.json",
                                     "25.11/rest-v0.0.44-jobs.json"])
def test_every_release_says_it(fixture: str) -> None:
    jobs, warnings = parse_jobs(json.loads((FIXTURES / fixture).read_text()))
    assert not warnings
    asked = {j.job_id: j.gpus_requested for j in jobs}
    assert all(v is not None for v in asked.values())
    if fixture.startswith("25.11"):
        # gpu-001's two jobs asked --gres=gpu:2 each, the whole-node job gpu:8.
        assert sorted(v for v in asked.values() if v) == [2, 2, 8]
    else:
        # Job 3 (requeued and held, one node) and job 5 (waits for resources: 3 nodes of 8).
        pending = {j.job_id: j.gpus_requested for j in jobs if j.state == "PENDING"}
        assert pending == {"3": 8, "5": 24}
