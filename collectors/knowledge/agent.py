"""What the node agent and the server agree on: the push protocol's version and the names of
the agent's own reports. Standard library only (the agent imports it on GPU nodes).

PROTOCOL counts changes to what an agent pushes (record fields, sources, metric names). The
agent sends it with every push (``AGENT_HEADER``) and checks it against the server's range at
start (``GET /api/v1/agent/``); the server refuses a push from an agent outside its range
with 426 and says which side to upgrade."""

from __future__ import annotations

from typing import Final

# 1: the agent of `manage.py fleetwatch agent` (sent no header); 2: the packaged agent (kmsg
# sequence numbers, NVML by UUID, the agent's own reports below); 3: ``gpud`` records (the
# local gpud's events, FLEETWATCH_AGENT_GPUD_URL).
PROTOCOL: Final = 3
OLDEST_PROTOCOL: Final = 1
# "fleetwatch-agent/0.2.0 protocol=2"
AGENT_HEADER: Final = "FleetWatch-Agent"


def agent_header(version: str) -> str:
    return f"fleetwatch-agent/{version} protocol={PROTOCOL}"


def header_protocol(value: str | None) -> int | None:
    """The protocol an ``AGENT_HEADER`` value names; None when absent (an older agent or
    another monitor); -1 when present but unreadable."""
    if not value:
        return None
    for part in value.split():
        key, _, number = part.partition("=")
        if key == "protocol":
            return int(number) if number.isdigit() else -1
    return -1


# The agent's reports about itself and what it watches, as the ``event`` field of a pushed
# record (its ``source`` is what the report is about: kernel or dcgm).
KMSG_LOST: Final = "kmsg_lost"  # the kernel overwrote records before the agent read them
KERNEL_LOG_UNREADABLE: Final = "kernel_log_unreadable"  # neither /dev/kmsg nor journald
GPU_LOST: Final = "nvml_gpu_lost"  # NVML answers "GPU is lost" for a GPU it listed
GPU_BACK: Final = "nvml_gpu_back"
NVML_REINIT: Final = "nvml_reinit"  # the driver went away (reload, upgrade) and came back
NVML_UNAVAILABLE: Final = "nvml_unavailable"
GPU_COUNT_CHANGED: Final = "nvml_gpu_count_changed"
SPOOL_FULL: Final = "spool_full"  # FleetWatch away long enough to fill the spool's cap

# NVML readings that have no DCGM field name (the agent's own metric names).
NVLINK_LINKS_DOWN: Final = "FLEETWATCH_NVLINK_LINKS_DOWN"
