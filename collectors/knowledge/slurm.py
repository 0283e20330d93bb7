"""Slurm conventions FleetWatch reads and writes (stdlib only: importable everywhere)."""

from __future__ import annotations

import re
from collections.abc import Iterable


def index_ranges(indices: Iterable[int]) -> str:
    """GPU indices as Slurm writes them in gres_detail: (4, 5) -> "4-5", (0, 3, 4) -> "0,3-4"."""
    out: list[str] = []
    run: list[int] = []
    for g in sorted(set(indices)):
        if run and g == run[-1] + 1:
            run.append(g)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [g]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


# SchedMD's slurm-operator (Slinky): each Slurm node is a slurmd pod of a NodeSet. Its pods carry
# these labels (api/v1beta1 well-known labels); the Slurm node name is the pod's hostname
# (label pod-hostname on current releases, else spec.hostname, else the pod's name).
SLINKY_POD_NAME_LABEL = "nodeset.slinky.slurm.net/pod-name"
SLINKY_POD_HOSTNAME_LABEL = "nodeset.slinky.slurm.net/pod-hostname"
# The operator's own drains and DOWNs (a cordoned Kubernetes node, a pod terminating) carry
# this prefix; it undoes them itself and leaves every other reason alone, as FleetWatch does.
SLURM_OPERATOR_REASON_PREFIX = "slurm-operator:"


# scontrol shows who set a reason and when: "Low RealMemory ... [slurm@2024-12-19T11:03:34]".
# The user "slurm" (SlurmUser) is slurmctld itself, reacting to what the node reported.
_SET_BY = re.compile(r"\[(?P<user>[^@\]\s]+)@[^\]]*\]\s*$")


def drained_by(reason: str) -> str:
    """Who a Slurm reason says drained a node, in words for a person."""
    if reason.startswith(SLURM_OPERATOR_REASON_PREFIX):
        return "slurm-operator (its Kubernetes node is cordoned or its slurmd pod went away)"
    m = _SET_BY.search(reason)
    if m and m.group("user") == "slurm":
        return "slurmctld"
    return "an administrator"
