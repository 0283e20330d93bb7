"""Diagnosis rules: each takes the observations in a window and returns diagnoses.

Rules are pure. A rule that sees something it cannot explain returns nothing rather than a
guess; symptoms that an earlier fault explains (NCCL timeouts on a job's other ranks after
one rank's GPU fell off the bus) never blame their own nodes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from incidents.diagnosis.types import Diagnosis, JobInfo, Observation
from incidents.diagnosis.xid import xid_info

# NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
KERNEL_XID = re.compile(r"NVRM: Xid \((?P<pci>PCI:[0-9a-fA-F:.]+)\): (?P<code>\d+),")

PLAYBOOK_FOR = {
    "gpu_hardware": "replace_node",
    "gpu_memory": "reset_gpu",
    "nvlink": "reboot_node",
}


def xid_code(obs: Observation) -> int | None:
    if obs.kind == "xid" and obs.code:
        return obs.code
    if obs.source == "kernel":
        match = KERNEL_XID.search(obs.message)
        if match:
            return int(match.group("code"))
    return None


def rule_hardware_xid(
    observations: Sequence[Observation], jobs: Sequence[JobInfo]
) -> list[Diagnosis]:
    """A hardware-class XID blames the node that reported it, and only that node."""
    first: dict[str, tuple[Observation, int]] = {}
    evidence: dict[str, list[int]] = {}
    for obs in observations:
        code = xid_code(obs)
        info = xid_info(code) if code is not None else None
        if info is None or info.klass != "gpu_hardware" or not obs.node:
            continue
        first.setdefault(obs.node, (obs, code))
        if obs.id is not None:
            evidence.setdefault(obs.node, []).append(obs.id)
    diagnoses = []
    for node, (obs, code) in first.items():
        info = xid_info(code)
        assert info is not None
        affected = tuple(sorted(j.id for j in jobs if node in j.nodes))
        gpu = f" GPU {obs.gpu}" if obs.gpu is not None else ""
        peers = sorted({n for j in jobs if node in j.nodes for n in j.nodes} - {node})
        explanation = f"XID {code} ({info.meaning}) on {node}{gpu}; NVIDIA: {info.action}."
        if peers:
            explanation += (f" Its job's other nodes ({', '.join(peers)}) are victims, "
                            "not faulty.")
        diagnoses.append(Diagnosis(
            root_cause="gpu_hardware", nodes=(node,), confidence=0.97,
            playbook=PLAYBOOK_FOR["gpu_hardware"], explanation=explanation,
            detected_at=obs.at, jobs=affected, evidence=tuple(evidence.get(node, ())),
        ))
    return diagnoses
