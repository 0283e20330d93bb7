"""Playbooks as data: an ordered list of steps per root cause, shown before and while they run.

A step names its kind (``incidents.remediation.steps.STEP_KINDS``), a title a person reads
on the incident page, and, for the risky ones, its risk class (``collectors.knowledge.Risk``):
each risk class has a mode of its own (FLEETWATCH_STEP_MODES), so an automatic playbook can
still ask a person before it replaces a node. Names, causes and which playbook a cause runs
first come from ``collectors.knowledge.causes``; this module holds the step lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from collectors.knowledge.causes import PLAYBOOK_FOR, RISKS, PlaybookName, Risk, RootCause

__all__ = ["FOR_ROOT_CAUSE", "PLAYBOOKS", "RISKS", "Playbook", "StepSpec", "playbook_get"]

REPLACE, REBOOT, RESET_GPU = Risk.REPLACE, Risk.REBOOT, Risk.RESET_GPU
REPLACE_WORKING = Risk.REPLACE_WORKING
RETURN_TO_SERVICE = Risk.RETURN_TO_SERVICE


@dataclass(frozen=True)
class StepSpec:
    kind: str  # a key of ``incidents.remediation.steps.STEP_KINDS``
    title: str
    risk: Risk | Literal[""] = ""  # a risk class: steps with a mode of their own


@dataclass(frozen=True)
class Playbook:
    name: PlaybookName
    root_cause: RootCause
    description: str
    steps: tuple[StepSpec, ...]
    touches_nodes: bool = True  # False: notify only, never acts on a node
    # False: the fleet budget does not apply (holding work off a dead switch's nodes takes
    # nothing out of service that the switch has not already taken).
    budgeted: bool = True


NOTIFY = StepSpec("notify", "Notify the on-call channel")
DRAIN_AND_CANCEL = StepSpec("drain_and_cancel",
                            "Drain the Slurm node and cancel its jobs with SIGTERM")
REQUEUE = StepSpec("requeue", "Requeue the cancelled jobs")
RESUME_NODE = StepSpec("resume_node", "Resume the node in Slurm once it is healthy; "
                                      "wait for the jobs to run again")
# The return-to-service gate: acceptance checks under load, as Slurm jobs in a reservation
# holding the node, before any node a playbook repaired goes back into service.
PROVE_HEALTHY = StepSpec("prove_healthy", "Run the acceptance checks on the node (Slurm jobs "
                                          "in a reservation holding it); back in service only "
                                          "if they pass", RETURN_TO_SERVICE)

REPLACE_NODE = Playbook(
    name=PlaybookName.REPLACE_NODE,
    root_cause=RootCause.GPU_HARDWARE,
    description="Take the node out of service, restart its jobs elsewhere, bring in a spare.",
    steps=(
        NOTIFY,
        DRAIN_AND_CANCEL,
        REQUEUE,
        StepSpec("check_no_auto_replace", "Check the node's pods for fleetwatch.io/no-auto-replace"),
        StepSpec("cordon_and_drain", "Cordon and drain the Kubernetes node"),
        StepSpec("replace_node", "Replace the node from spare capacity", REPLACE),
        PROVE_HEALTHY,
        StepSpec("resume", "Resume the replacement in Slurm once healthy; wait for the jobs"),
    ),
)

# The replacement for a node that keeps failing: the same, and the old node marked for RMA.
REPLACE_AND_RMA = Playbook(
    name=PlaybookName.REPLACE_AND_RMA,
    root_cause=RootCause.GPU_MEMORY,
    description="The node's GPUs keep failing: replace it and send it back (RMA).",
    steps=(*REPLACE_NODE.steps[:-2],
           StepSpec("mark_rma", "Mark the old node for RMA"), *REPLACE_NODE.steps[-2:]),
)

RESET_GPU_PLAYBOOK = Playbook(
    name=PlaybookName.RESET_GPU,
    root_cause=RootCause.GPU_MEMORY,
    description="Drain and requeue, reset the GPU (or reboot the node when a reset cannot "
                "help), check the fault is gone, resume.",
    steps=(
        NOTIFY, DRAIN_AND_CANCEL, REQUEUE,
        StepSpec("reset_or_reboot", "Reset the faulty GPU, or reboot the node", RESET_GPU),
        StepSpec("verify_fault_cleared", "Check the GPU fault is gone"),
        PROVE_HEALTHY,
        RESUME_NODE,
    ),
)

REBOOT_NODE = Playbook(
    name=PlaybookName.REBOOT_NODE,
    root_cause=RootCause.NVLINK,
    description="Drain and requeue, reboot the node, check the NVLink fault is gone, resume; "
                "a fault that comes back is replaced.",
    steps=(
        NOTIFY, DRAIN_AND_CANCEL, REQUEUE,
        StepSpec("reboot", "Reboot the node", REBOOT),
        StepSpec("verify_fault_cleared", "Check the NVLink fault is gone"),
        PROVE_HEALTHY,
        RESUME_NODE,
    ),
)

HOLD_FLAPPING_LINK = Playbook(
    name=PlaybookName.HOLD_FLAPPING_LINK,
    root_cause=RootCause.NETWORK_FLAP,
    description="Requeue the job away from the node and keep the node drained until its link "
                "has been stable for a while; repeated flaps replace it.",
    steps=(
        NOTIFY, DRAIN_AND_CANCEL, REQUEUE,
        StepSpec("wait_link_stable", "Wait until the link has been stable"),
        PROVE_HEALTHY,
        RESUME_NODE,
    ),
)

HOLD_SWITCH = Playbook(
    name=PlaybookName.HOLD_SWITCH,
    root_cause=RootCause.SWITCH_FAILURE,
    description="Blame no node: notify, requeue the jobs that died, hold new work off the "
                "switch's nodes until the switch is healthy again, then release them.",
    steps=(
        NOTIFY,
        StepSpec("hold_switch_nodes", "Hold new work off the switch's nodes (Slurm drain)"),
        StepSpec("requeue_dead_jobs", "Requeue the jobs that died with the switch"),
        StepSpec("wait_switch_healthy", "Wait until every link under the switch is back"),
        StepSpec("release_switch_nodes", "Resume the switch's nodes FleetWatch held"),
    ),
    budgeted=False,
)

COOL_DOWN = Playbook(
    name=PlaybookName.COOL_DOWN,
    root_cause=RootCause.THERMAL,
    description="Drain (running work finishes), notify, resume once temperatures are normal.",
    steps=(
        StepSpec("drain", "Drain the Slurm node (running jobs finish)"),
        NOTIFY,
        StepSpec("wait_cool", "Wait until the GPUs are back to normal temperatures"),
        PROVE_HEALTHY,
        RESUME_NODE,
    ),
)

RECOVER_NODE = Playbook(
    name=PlaybookName.RECOVER_NODE,
    root_cause=RootCause.NODE_UNREACHABLE,
    description="Mark the node down, requeue its jobs, reboot it, replace it if it does not "
                "come back.",
    steps=(
        NOTIFY,
        StepSpec("down_node", "Mark the node DOWN in Slurm and requeue its jobs"),
        StepSpec("reboot_request", "Ask for a reboot of the node", REBOOT),
        StepSpec("wait_node_back", "Wait for the node to come back"),
        StepSpec("replace_if_not_back", "Replace the node if it did not come back", REPLACE),
        PROVE_HEALTHY,
        RESUME_NODE,
    ),
)

NOTIFY_OWNER = Playbook(
    name=PlaybookName.NOTIFY_OWNER,
    root_cause=RootCause.APPLICATION_ERROR,
    description="Tell the job's owner what failed; never touch a node.",
    steps=(StepSpec("notify_owner", "Notify the job's owner"),),
    touches_nodes=False,
)

# A node alive but slower than its job's peers: the job still makes progress, so nothing is
# stopped at once. The on-call channel is told; then a person approves the replacement (the
# replace_working risk class waits for approval unless FLEETWATCH_STEP_MODES says otherwise),
# asked before the wait so that the job is stopped right after a checkpoint and not whenever
# the click comes; then the node goes as in replace_node.
REPLACE_AT_CHECKPOINT = Playbook(
    name=PlaybookName.REPLACE_AT_CHECKPOINT,
    root_cause=RootCause.FAIL_SLOW,
    description="Tell the on-call channel; once a person approves, wait for the job's next "
                "checkpoint (bounded), then take the node out, requeue the job and bring in a "
                "spare.",
    steps=(
        NOTIFY,
        StepSpec("wait_checkpoint", "Replace the node at its job's next checkpoint: wait for "
                 "the checkpoint (bounded by FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES)",
                 REPLACE_WORKING),
        *REPLACE_NODE.steps[1:],
    ),
)

PLAYBOOKS: dict[str, Playbook] = {p.name: p for p in (
    REPLACE_NODE, REPLACE_AND_RMA, RESET_GPU_PLAYBOOK, REBOOT_NODE, HOLD_FLAPPING_LINK,
    HOLD_SWITCH, COOL_DOWN, RECOVER_NODE, NOTIFY_OWNER, REPLACE_AT_CHECKPOINT)}

# What each root cause runs first (the map is collectors.knowledge.causes.PLAYBOOK_FOR), as
# plain strings for the pages and the API; every playbook it names is defined above for that cause.
FOR_ROOT_CAUSE: dict[str, str] = {str(cause): str(name) for cause, name in PLAYBOOK_FOR.items()}
assert set(PLAYBOOKS) == set(PlaybookName)
# Every playbook that puts a node it repaired back into service proves it healthy first (the
# switch's nodes were not repaired: the switch was; a notification touches no node).
assert all(PROVE_HEALTHY in p.steps for p in PLAYBOOKS.values()
           if p.touches_nodes and p.name != PlaybookName.HOLD_SWITCH)
assert all(PLAYBOOKS[name].root_cause == cause for cause, name in PLAYBOOK_FOR.items())


def playbook_get(name: str) -> Playbook | None:
    return PLAYBOOKS.get(name)
