"""Turn what a source reports into signals: pure functions, previous reading in, changes out.

Only changes become signals. dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` is the value of the
*last* XID (a gauge), so a scrape that still shows 79 is not a new fault; a Slurm node that is
still drained is not a new drain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from collectors.clients.base import GpuMetric, K8sNode, NicPort, SlurmJob, SlurmNode


@dataclass(frozen=True)
class SignalDraft:
    source: str
    kind: str
    node: str = ""
    gpu: int | None = None
    job: str = ""
    code: int | None = None
    value: str = ""
    message: str = ""
    data: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class SlurmNodeSeen:
    state: str
    flags: tuple[str, ...]
    reason: str


def slurm_node_changes(previous: SlurmNodeSeen | None, now: SlurmNode) -> list[SignalDraft]:
    if previous is None or (previous.state, previous.flags, previous.reason) == (
        now.state, now.flags, now.reason
    ):
        return []
    shown = "+".join([now.state, *now.flags])
    message = f"{now.name} is {shown}" + (f" ({now.reason})" if now.reason else "")
    return [SignalDraft("slurm", "slurm_node_state", node=now.name, value=shown, message=message,
                        data={"node_state": [now.state, *now.flags], "reason": now.reason,
                              "previous": "+".join([previous.state, *previous.flags])})]


def slurm_job_changes(previous_state: str | None, now: SlurmJob) -> list[SignalDraft]:
    if previous_state == now.state:
        return []
    message = f"job {now.job_id} ({now.name}) {previous_state or 'new'} -> {now.state}"
    if now.state == "RUNNING" and now.resumed_from_step is not None:
        message += f", resumed from checkpoint step {now.resumed_from_step}"
    return [SignalDraft("slurm", "slurm_job_state", job=now.job_id, value=now.state,
                        message=message,
                        data={"job_state": now.state, "nodes": list(now.nodes),
                              "restart_count": now.restart_count})]


def k8s_node_changes(
    previous_ready: bool | None, previous_unschedulable: bool | None, now: K8sNode
) -> list[SignalDraft]:
    drafts = []
    if previous_ready is not None and previous_ready != now.ready:
        status = {True: "True", False: "False", None: "Unknown"}[now.ready]
        reason = "KubeletReady" if now.ready else "NodeNotReady"
        drafts.append(SignalDraft("kubernetes", "k8s_condition", node=now.name, value=status,
                                  message=f"Ready={status} ({reason})",
                                  data={"condition": "Ready", "status": status,
                                        "reason": reason}))
    if previous_unschedulable is not None and previous_unschedulable != now.unschedulable:
        verb = "cordoned" if now.unschedulable else "uncordoned"
        drafts.append(SignalDraft("kubernetes", "k8s_cordon", node=now.name, value=verb,
                                  message=f"{now.name} {verb}",
                                  data={"annotations": now.annotations}))
    return drafts


def xid_changes(previous_xid: int | None, now: GpuMetric) -> list[SignalDraft]:
    """A new XID is a change of the last-XID gauge to a non-zero value."""
    if now.last_xid == 0 or now.last_xid == (previous_xid or 0):
        return []
    return [SignalDraft("dcgm", "xid", node=now.node, gpu=now.gpu, code=now.last_xid,
                        value=str(now.last_xid),
                        message=f"DCGM_FI_DEV_XID_ERRORS={now.last_xid} on {now.node} GPU {now.gpu}",
                        data={"metric": "DCGM_FI_DEV_XID_ERRORS", "value": now.last_xid,
                              "uuid": now.uuid})]


def nic_changes(previous: tuple[str, int] | None, now: NicPort) -> list[SignalDraft]:
    if previous is None:
        return []
    drafts = []
    state, downed = previous
    where = f"{now.device} port {now.port}"
    if now.link_downed > downed:
        drafts.append(SignalDraft("nic", "nic_counter", node=now.node, code=now.link_downed,
                                  value=str(now.link_downed),
                                  message=f"{where} link_downed {downed} -> {now.link_downed}",
                                  data={"device": now.device, "port": now.port,
                                        "counter": "link_downed", "value": now.link_downed}))
    if now.state != state:
        drafts.append(SignalDraft("nic", "nic_state", node=now.node, value=now.state,
                                  message=f"{where} {state} -> {now.state}",
                                  data={"device": now.device, "port": now.port,
                                        "state": now.state}))
    return drafts
