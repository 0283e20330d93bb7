"""One name per machine, whatever Slurm calls it.

FleetWatch names a machine as Kubernetes and its own node records do (the kernel log, NVML and
dcgm-exporter's ``Hostname`` carry that name). Under SchedMD's slurm-operator (Slinky) the Slurm
node is a slurmd pod whose Slurm name is the pod's hostname ("slinky-0"), not the machine's
("gpu-node-a"); other sites name them differently too. ``SlurmNames`` wraps any Slurm client so
that everything read from Slurm speaks machine names and every action towards Slurm uses
Slurm's: diagnosis, remediation and the pages never see two names for one machine.

The mapping (Slurm name -> machine) comes from the caller: collectors.services keeps it in
``Node.slurm_name`` (from the slurmd pods' ``spec.nodeName``) and adds the static map of
FLEETWATCH_SLURM_NODE_MAP. A Slurm node with no mapping keeps its own name: an unmapped node
is shown as Slurm reports it, never taken for a missing (failed) one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from collectors.clients.base import (
    ActionResult,
    CheckJob,
    CheckJobSpec,
    NotFound,
    SlurmClient,
    SlurmJob,
    SlurmNode,
    SlurmReservation,
)


def parse_node_map(text: str) -> dict[str, str]:
    """FLEETWATCH_SLURM_NODE_MAP: "slurmname=machine" pairs, separated by commas, spaces or
    new lines (a file's contents read the same). Raises ValueError naming a bad entry."""
    found: dict[str, str] = {}
    for entry in text.replace(",", " ").split():
        slurm, sep, machine = entry.partition("=")
        if not sep or not slurm or not machine:
            raise ValueError(f"{entry!r} is not slurmname=machine")
        found[slurm] = machine
    return found


class SlurmNames:
    """A SlurmClient that reads and acts in machine names; ``names()`` gives the current
    {Slurm name: machine} map (read on each call: the pods move)."""

    def __init__(self, inner: SlurmClient, names: Callable[[], Mapping[str, str]]) -> None:
        self.inner = inner
        self.names = names

    @property
    def last_warnings(self) -> list[str]:
        return self.inner.last_warnings

    def _maps(self) -> tuple[Mapping[str, str], dict[str, str]]:
        to_machine = self.names()
        return to_machine, {machine: slurm for slurm, machine in to_machine.items()}

    def _slurm(self, node: str) -> str:
        return self._maps()[1].get(node, node)

    # --- reads ---

    def nodes(self) -> list[SlurmNode]:
        to_machine = self._maps()[0]
        return [dataclasses.replace(n, name=to_machine.get(n.name, n.name))
                for n in self.inner.nodes()]

    def node(self, name: str) -> SlurmNode:
        to_machine, to_slurm = self._maps()
        if name in to_machine and name not in to_slurm:
            # A Slurm name that goes by its machine's here: nodes() never lists it.
            raise NotFound(f"Invalid node name specified: {name} is Slurm's name for "
                           f"{to_machine[name]}", permanent=True)
        return dataclasses.replace(self.inner.node(to_slurm.get(name, name)), name=name)

    def jobs(self) -> list[SlurmJob]:
        to_machine = self._maps()[0]
        return [dataclasses.replace(
            j, nodes=tuple(to_machine.get(n, n) for n in j.nodes),
            gpus={to_machine.get(n, n): g for n, g in j.gpus.items()})
            for j in self.inner.jobs()]

    def topology(self) -> dict[str, list[str]]:
        to_machine = self._maps()[0]
        return {leaf: [to_machine.get(n, n) for n in members]
                for leaf, members in self.inner.topology().items()}

    # --- node actions: Slurm's name ---

    def drain(self, node: str, reason: str) -> ActionResult:
        return self.inner.drain(self._slurm(node), reason)

    def down(self, node: str, reason: str) -> ActionResult:
        return self.inner.down(self._slurm(node), reason)

    def resume(self, node: str) -> ActionResult:
        return self.inner.resume(self._slurm(node))

    def reboot(self, node: str, reason: str) -> ActionResult:
        return self.inner.reboot(self._slurm(node), reason)

    # --- job actions: jobs have one id ---

    def cancel(self, job_id: str, signal: str, grace_seconds: int) -> ActionResult:
        return self.inner.cancel(job_id, signal, grace_seconds)

    def requeue(self, job_id: str) -> ActionResult:
        return self.inner.requeue(job_id)

    def requeue_hold(self, job_id: str) -> ActionResult:
        return self.inner.requeue_hold(job_id)

    def set_comment(self, job_id: str, text: str, field: str) -> ActionResult:
        return self.inner.set_comment(job_id, text, field)

    # --- the return-to-service gate: reservations and check jobs name Slurm's nodes ---

    def reservations(self) -> list[SlurmReservation]:
        to_machine = self._maps()[0]
        return [dataclasses.replace(r, nodes=tuple(to_machine.get(n, n) for n in r.nodes))
                for r in self.inner.reservations()]

    def reserve(self, name: str, node: str) -> ActionResult:
        return self.inner.reserve(name, self._slurm(node))

    def unreserve(self, name: str) -> ActionResult:
        return self.inner.unreserve(name)

    def submit_check(self, spec: CheckJobSpec) -> ActionResult:
        return self.inner.submit_check(dataclasses.replace(spec, node=self._slurm(spec.node)))

    def check_job(self, job_id: str, output: str = "") -> CheckJob | None:
        found = self.inner.check_job(job_id, output)
        if found is None:
            return None
        to_machine = self._maps()[0]
        return dataclasses.replace(found, nodes=tuple(to_machine.get(n, n) for n in found.nodes))
