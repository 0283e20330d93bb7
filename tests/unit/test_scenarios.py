"""The public scenario suite: every replay file in tests/scenarios is diagnosed correctly.

"Correctly" is REPLAY.md's measure: the set of (cause, node), (switch_failure, switch) and
(application_error, job) pairs equals the file's ``expect``. Blaming a healthy node fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from incidents.diagnosis.replay import blame, diagnose_file
from tests.scenarios import generate

HERE = Path(__file__).resolve().parents[1] / "scenarios"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "scenarios"
FILES = sorted(HERE.glob("*.json")) + (sorted(SHARED.glob("*.json")) if SHARED.is_dir() else [])
LABELS = {"gpu_hardware", "gpu_memory", "nvlink", "network_flap", "switch_failure", "thermal",
          "node_unreachable", "application_error", "fail_slow"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_scenario_is_diagnosed_correctly(path: Path) -> None:
    doc = json.loads(path.read_text())
    result = diagnose_file(path)
    got, want = blame(result["incidents"]), blame(doc["expect"])
    assert got == want, (
        f"{path.name}: missing {sorted(want - got)}, unexpected {sorted(got - want)}\n"
        + "\n".join(i["explanation"] for i in result["incidents"]))
    for incident in result["incidents"]:
        assert 0 < incident["confidence"] <= 1
        assert incident["playbook"] and incident["explanation"]


def test_the_suite_covers_every_root_cause_and_the_quiet_cases() -> None:
    docs = [json.loads(p.read_text()) for p in HERE.glob("*.json")]
    assert len(docs) >= 40
    causes = {e["root_cause"] for d in docs for e in d["expect"]}
    assert causes == LABELS
    assert sum(1 for d in docs if d["expect"] == []) >= 10
    # Every scenario carries background noise, not just its fault.
    assert all(sum(1 for s in d["signals"] if s["source"] == "dcgm") >= 20 for d in docs)


def test_the_generated_files_are_what_the_generator_writes(tmp_path: Path) -> None:
    for path in generate.main(tmp_path):
        committed = HERE / path.name
        assert committed.exists(), f"{path.name} is not committed; run generate.py"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale"
