"""What a pushed signal may say, by who pushes it: plain data, read by the ingest service and
by collectors.roles, which decides whose token is whose (collectors depend on no project code)."""

from __future__ import annotations

from dataclasses import dataclass

# What a push may say follows from who sends it. A node agent sees its own node's hardware and
# kernel: the NVML readings and XIDs it reports as ``dcgm``, the kernel log, the NIC counters.
# Another monitor (an operator's or admin's token with the ``ingest`` scope) adds job logs, for
# any node FleetWatch knows. Nobody pushes ``collector`` records (whether a source is up is
# only what FleetWatch's own collectors saw: a pushed "slurm is down" would make diagnosis set
# aside real node failures), nor Slurm or Kubernetes state, which FleetWatch reads from them.
# gpud: the events of the node's own gpud, which the agent forwards (collectors/agent/gpud.py)
# and a site's own forwarder may push too; diagnosis weighs them as another tool's verdict.
AGENT_SOURCES = frozenset({"kernel", "dcgm", "nic", "gpud"})
INGEST_SOURCES = frozenset({"kernel", "dcgm", "nic", "job_log", "gpud"})


# The key that marks a stored signal as a fire drill's synthetic fault ("<drill id>:<nonce>",
# incidents.drills): diagnosis sets such signals apart from the real ones. Only FleetWatch's
# own drills may send it; a push carrying it is refused (it could hide a real fault).
DRILL_MARK = "fleetwatch_drill"


@dataclass(frozen=True)
class PushRights:
    """What one caller may push: these sources, about this node only (``None``: any known
    node, or none); ``drill``: records marked as a fire drill's (FleetWatch's own drills)."""

    who: str
    sources: frozenset[str]
    node: str | None = None
    drill: bool = False
