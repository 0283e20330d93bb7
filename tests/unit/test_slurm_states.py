"""What Slurm 25.11's node states mean to diagnosis, as a real 25.11 cluster shows them
(../shared/slurm/RECIPE.md, section 7; tests/integration/test_slurm.py and test_slinky.py)."""

from __future__ import annotations

from typing import Any

import pytest

from incidents.diagnosis import replay

NODE = "gpu-node-d"


def slurm_states(*states: tuple[str, list[str], str]) -> dict[str, Any]:
    return {"format": replay.FORMAT, "name": "slurm-25.11-states", "topology": {}, "jobs": [],
            "signals": [{"at": at, "source": "slurm", "node": NODE, "node_state": state,
                         "reason": reason} for at, state, reason in states]}


def verdicts(doc: dict[str, Any]) -> list[tuple[str, list[str]]]:
    return [(i["root_cause"], i["nodes"]) for i in replay.diagnose_document(doc)["incidents"]]


def test_a_node_just_resumed_and_not_yet_pinged_is_not_unreachable() -> None:
    # 25.11 after a RESUME: IDLE+NOT_RESPONDING for a few seconds, the old reason kept.
    doc = slurm_states(("2026-12-04T10:00:00Z", ["IDLE", "DRAIN"], "fleetwatch: incident 9"),
                       ("2026-12-04T10:05:00Z", ["IDLE", "NOT_RESPONDING"],
                        "fleetwatch: incident 9"))
    assert verdicts(doc) == []


@pytest.mark.parametrize("states", [
    # A node that stops answering: no reason yet, then slurmctld sets it DOWN.
    [("2026-12-04T10:00:00Z", ["ALLOCATED", "NOT_RESPONDING"], "")],
    [("2026-12-04T10:00:00Z", ["DOWN", "NOT_RESPONDING"], "Not responding")],
])
def test_a_node_that_stops_answering_still_is(states: list[tuple[str, list[str], str]]) -> None:
    assert verdicts(slurm_states(*states)) == [("node_unreachable", [NODE])]


def test_the_operators_drain_is_maintenance_not_a_fault() -> None:
    doc = slurm_states(("2026-12-04T10:00:00Z", ["IDLE", "DRAIN"],
                        "slurm-operator: Node is cordoned"))
    result = replay.diagnose_document(doc)
    assert result["incidents"] == []
    assert any("slurm-operator" in n["text"] and "not a fault" in n["text"]
               for n in result["notes"])
