"""Root causes, risk classes, the playbook each root cause runs first and its default severity.

The labels are a contract (``../shared/DESIGN.md``): the API, the replay format, the incident
model's choices and the UI all use these strings, so they are written here once and nowhere
else. Every cause has a playbook, so every cause is an incident choice (adding one there is a
migration).
"""

from __future__ import annotations

from enum import StrEnum
from types import MappingProxyType
from typing import Final


class RootCause(StrEnum):
    GPU_HARDWARE = "gpu_hardware"
    GPU_MEMORY = "gpu_memory"
    NVLINK = "nvlink"
    NETWORK_FLAP = "network_flap"
    SWITCH_FAILURE = "switch_failure"
    THERMAL = "thermal"
    NODE_UNREACHABLE = "node_unreachable"
    APPLICATION_ERROR = "application_error"
    FAIL_SLOW = "fail_slow"  # alive, but slower than its job's peers

    @property
    def label(self) -> str:
        return CAUSE_LABELS[self]


# What a person reads (the incident model's choice labels: changing one is a migration).
CAUSE_LABELS: Final = MappingProxyType({
    RootCause.GPU_HARDWARE: "GPU hardware",
    RootCause.GPU_MEMORY: "GPU memory",
    RootCause.NVLINK: "NVLink",
    RootCause.NETWORK_FLAP: "network flap",
    RootCause.SWITCH_FAILURE: "switch failure",
    RootCause.THERMAL: "thermal",
    RootCause.NODE_UNREACHABLE: "node unreachable",
    RootCause.APPLICATION_ERROR: "application error",
    RootCause.FAIL_SLOW: "fail-slow",
})


class Risk(StrEnum):
    """Risk classes of remediation steps: each has a mode of its own (FLEETWATCH_STEP_MODES),
    so an automatic playbook can still ask a person before it replaces a node."""

    REPLACE = "replace"
    REBOOT = "reboot"
    RESET_GPU = "reset_gpu"
    # Replacing a node that still works (fail-slow): its job runs on, only slower, so taking
    # the node out costs the job a restart from its checkpoint; a person decides by default.
    REPLACE_WORKING = "replace_working"
    # Putting a repaired node back into Slurm service through its acceptance checks (the
    # return-to-service gate): approve it to have a person look first, observe to only say.
    RETURN_TO_SERVICE = "return_to_service"


RISKS: Final[tuple[Risk, ...]] = tuple(Risk)
# A risk class's mode where FLEETWATCH_STEP_MODES does not name it ("auto" for the rest).
RISK_DEFAULT_MODES: Final = MappingProxyType({Risk.REPLACE_WORKING: "approve"})


class PlaybookName(StrEnum):
    """Playbook names (their steps live in ``incidents.remediation.playbooks``)."""

    REPLACE_NODE = "replace_node"
    REPLACE_AND_RMA = "replace_and_rma"  # the escalation of a node that keeps failing
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    HOLD_FLAPPING_LINK = "hold_flapping_link"
    HOLD_SWITCH = "hold_switch"
    COOL_DOWN = "cool_down"
    RECOVER_NODE = "recover_node"
    NOTIFY_OWNER = "notify_owner"
    REPLACE_AT_CHECKPOINT = "replace_at_checkpoint"  # fail-slow: out at the job's checkpoint


# What each root cause runs first; diagnosis recommends these names too.
PLAYBOOK_FOR: Final = MappingProxyType({
    RootCause.GPU_HARDWARE: PlaybookName.REPLACE_NODE,
    RootCause.GPU_MEMORY: PlaybookName.RESET_GPU,
    RootCause.NVLINK: PlaybookName.REBOOT_NODE,
    RootCause.NETWORK_FLAP: PlaybookName.HOLD_FLAPPING_LINK,
    RootCause.SWITCH_FAILURE: PlaybookName.HOLD_SWITCH,
    RootCause.THERMAL: PlaybookName.COOL_DOWN,
    RootCause.NODE_UNREACHABLE: PlaybookName.RECOVER_NODE,
    RootCause.APPLICATION_ERROR: PlaybookName.NOTIFY_OWNER,
    RootCause.FAIL_SLOW: PlaybookName.REPLACE_AT_CHECKPOINT,
})

# The causes an incident can have: those with a playbook, in the contract's order.
INCIDENT_CAUSES: Final[tuple[RootCause, ...]] = tuple(c for c in RootCause if c in PLAYBOOK_FOR)


def choices(causes: tuple[RootCause, ...] = INCIDENT_CAUSES) -> list[tuple[str, str, str]]:
    """(member name, value, label) per cause: what a Django ``TextChoices`` is built from."""
    return [(c.name, c.value, CAUSE_LABELS[c]) for c in causes]


class Severity(StrEnum):
    """How bad an incident is for the people on call, SEV1 worst (as PagerDuty, Grafana OnCall
    and incident.io number them). An incident starts at its root cause's default
    (``SEVERITY_FOR``); an operator may change it."""

    SEV1 = "sev1"
    SEV2 = "sev2"
    SEV3 = "sev3"
    SEV4 = "sev4"

    @property
    def label(self) -> str:
        return SEVERITY_LABELS[self]


SEVERITY_LABELS: Final = MappingProxyType({
    Severity.SEV1: "SEV1 critical",
    Severity.SEV2: "SEV2 major",
    Severity.SEV3: "SEV3 minor",
    Severity.SEV4: "SEV4 low",
})

# Each root cause's default severity: a dead leaf switch takes every node under it; a lost GPU,
# bad HBM, NVLink or a node gone takes a node (and its jobs) out; a flapping link, heat or a
# slow node degrades without stopping; a user's own bug is the user's.
SEVERITY_FOR: Final = MappingProxyType({
    RootCause.SWITCH_FAILURE: Severity.SEV1,
    RootCause.GPU_HARDWARE: Severity.SEV2,
    RootCause.GPU_MEMORY: Severity.SEV2,
    RootCause.NVLINK: Severity.SEV2,
    RootCause.NODE_UNREACHABLE: Severity.SEV2,
    RootCause.NETWORK_FLAP: Severity.SEV3,
    RootCause.THERMAL: Severity.SEV3,
    RootCause.FAIL_SLOW: Severity.SEV3,
    RootCause.APPLICATION_ERROR: Severity.SEV4,
})


def severity_choices() -> list[tuple[str, str, str]]:
    """(member name, value, label) per severity, as ``choices`` gives for causes."""
    return [(s.name, s.value, SEVERITY_LABELS[s]) for s in Severity]
