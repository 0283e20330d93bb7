"""Slurm under Slinky names its nodes after their pods; FleetWatch reads and acts in the
machines' names (collectors/clients/naming.py), one node as the whole list names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.clients.base import NotFound, node_or_none
from collectors.clients.naming import SlurmNames
from collectors.sim.fleet import SimFleet, SimSlurm

# Slurm's name -> the machine's (the simulated Slurm's nodes are gpu-001...).
MACHINE = {"gpu-001": "machine-a", "gpu-002": "machine-b"}


@pytest.fixture
def slurm(tmp_path: Path) -> SlurmNames:
    fleet = SimFleet(tmp_path / "fleet.json", 20.0)
    fleet.seed()
    return SlurmNames(SimSlurm(fleet), lambda: MACHINE)


def test_one_node_by_its_machines_name_is_the_lists_entry(slurm: SlurmNames) -> None:
    listed = {n.name: n for n in slurm.nodes()}
    assert "machine-a" in listed and "gpu-001" not in listed
    for name in ("machine-a", "machine-b", "gpu-003"):  # gpu-003: no pod, its own name
        assert slurm.node(name) == listed[name]


def test_a_slurm_name_that_goes_by_its_machines_is_no_node_here(slurm: SlurmNames) -> None:
    for name in ("gpu-001", "gpu-999"):
        with pytest.raises(NotFound):
            slurm.node(name)
        assert node_or_none(slurm, name) is None
