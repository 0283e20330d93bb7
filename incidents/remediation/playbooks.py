"""Playbooks as data: an ordered list of steps per root cause, shown before and while they run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepSpec:
    kind: str  # a key of ``incidents.remediation.steps.EXECUTORS``
    title: str


@dataclass(frozen=True)
class Playbook:
    name: str
    root_cause: str
    description: str
    steps: tuple[StepSpec, ...]


REPLACE_NODE = Playbook(
    name="replace_node",
    root_cause="gpu_hardware",
    description="Take the node out of service, restart its jobs elsewhere, bring in a spare.",
    steps=(
        StepSpec("notify", "Notify the on-call channel"),
        StepSpec("drain_and_cancel", "Drain the Slurm node and cancel its jobs with SIGTERM"),
        StepSpec("requeue", "Requeue the cancelled jobs"),
        StepSpec("check_no_auto_replace", "Check the node's pods for fleetwatch.io/no-auto-replace"),
        StepSpec("cordon_and_drain", "Cordon and drain the Kubernetes node"),
        StepSpec("replace_node", "Replace the node from spare capacity"),
        StepSpec("resume", "Resume the replacement in Slurm once healthy; wait for the jobs"),
    ),
)

PLAYBOOKS: dict[str, Playbook] = {p.name: p for p in (REPLACE_NODE,)}


def playbook_get(name: str) -> Playbook | None:
    return PLAYBOOKS.get(name)
