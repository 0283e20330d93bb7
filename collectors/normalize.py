"""Turn what a source reports into signals: pure functions, previous reading in, changes out.

Only changes become signals. dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` is the value of the
*last* XID (a gauge), so a scrape that still shows 79 is not a new fault; a Slurm node that is
still drained is not a new drain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from collectors.clients.base import GpuMetric, K8sNode, NicPort, SlurmJob, SlurmNode
from collectors.knowledge import dcgm
from collectors.knowledge.acceptance import CHECK_JOB_PREFIX


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
    observed_at: datetime | None = None  # when the source saw it, if not "now"


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
    if previous_state == now.state or now.name.startswith(CHECK_JOB_PREFIX):
        # FleetWatch's own acceptance checks: a failed one is the return-to-service gate's
        # verdict on a node (recorded there), never a job failure to diagnose.
        return []
    message = f"job {now.job_id} ({now.name}) {previous_state or 'new'} -> {now.state}"
    if now.state == "RUNNING" and now.resumed_from_step is not None:
        message += f", resumed from checkpoint step {now.resumed_from_step}"
    return [SignalDraft("slurm", "slurm_job_state", job=now.job_id, value=now.state,
                        message=message,
                        data={"job_state": now.state, "nodes": list(now.nodes),
                              "restart_count": now.restart_count,
                              # Which GPUs it held where (gres_detail), for a fault on one GPU
                              # of a node shared by several jobs.
                              **({"gpus": {n: list(g) for n, g in now.gpus.items()}}
                                 if now.gpus else {})})]


def ready_status(ready: bool | None) -> str:
    return {True: "True", False: "False", None: "Unknown"}[ready]


def k8s_node_changes(
    previous_status: str, previous_unschedulable: bool | None, now: K8sNode
) -> list[SignalDraft]:
    """``previous_status`` is the Ready status last stored ("" when never reported: the first
    look at a node is not news)."""
    drafts = []
    status = ready_status(now.ready)
    if previous_status and previous_status != status:
        reason = now.ready_reason or ("KubeletReady" if now.ready else "NodeNotReady")
        drafts.append(SignalDraft("kubernetes", "k8s_condition", node=now.name, value=status,
                                  message=f"Ready={status} ({reason})",
                                  data={"condition": "Ready", "status": status,
                                        "reason": reason}))
    if (previous_status and previous_unschedulable is not None
            and previous_unschedulable != now.unschedulable):
        verb = "cordoned" if now.unschedulable else "uncordoned"
        drafts.append(SignalDraft("kubernetes", "k8s_cordon", node=now.name, value=verb,
                                  message=f"{now.name} {verb}",
                                  data={"annotations": now.annotations}))
    return drafts


def k8s_condition_changes(previous_status: str, previous: dict[str, list[str]],
                          now: K8sNode) -> list[SignalDraft]:
    """The node's other conditions that changed since ``previous`` (type -> [status, reason,
    message] as last stored). ``previous_status`` is the Ready status last stored: "" is a
    first look at the node, not news, as for Ready. A change of message counts: NVSentinel
    keeps its condition True and lists each new fault in its message."""
    if not previous_status:
        return []
    drafts = []
    for kind, (status, reason, message) in sorted(now.conditions.items()):
        if previous.get(kind) == [status, reason, message]:
            continue
        if kind not in previous and status == "False":
            continue  # a tool adding its condition as healthy says nothing new
        drafts.append(SignalDraft("kubernetes", "k8s_condition", node=now.name, value=status,
                                  message=message or f"{kind}={status} ({reason})",
                                  data={"condition": kind, "status": status,
                                        "reason": reason}))
    return drafts


def k8s_conditions_stored(node: K8sNode) -> dict[str, list[str]]:
    """The conditions as Node.k8s_conditions keeps them (JSON: lists, not tuples)."""
    return {kind: list(value) for kind, value in node.conditions.items()}


def xid_changes(previous_xid: int | None, now: GpuMetric) -> list[SignalDraft]:
    """A new XID is a change of the last-XID gauge to a non-zero value."""
    if now.last_xid == 0 or now.last_xid == (previous_xid or 0):
        return []
    return [SignalDraft("dcgm", "xid", node=now.node, gpu=now.gpu, code=now.last_xid,
                        value=str(now.last_xid),
                        message=f"{dcgm.XID_ERRORS}={now.last_xid} on {now.node} GPU {now.gpu}",
                        data={"metric": dcgm.XID_ERRORS, "value": now.last_xid,
                              "uuid": now.uuid})]


@dataclass(frozen=True)
class GpuSeen:
    """What FleetWatch last stored for a GPU: what the next scrape is compared against."""

    last_xid: int = 0
    clock_event_reasons: int = 0
    dbe_total: float | None = None
    row_remap_failure: bool = False


def _dcgm(now: GpuMetric, metric: str, value: float, message: str,
          **extra: object) -> SignalDraft:
    return SignalDraft("dcgm", "dcgm_field", node=now.node, gpu=now.gpu, value=f"{value:g}",
                       message=message, data={"metric": metric, "value": value, **extra})


def gpu_changes(previous: GpuSeen, now: GpuMetric) -> list[SignalDraft]:
    """Telemetry that diagnosis needs, as events. A GPU held back for thermal reasons is
    reported on every scrape while it lasts (with its temperature): "sustained" is exactly
    what diagnosis must see. Everything else is reported when it changes."""
    drafts = xid_changes(previous.last_xid, now)
    where = f"{now.node} GPU {now.gpu}"
    if (now.clock_event_reasons | previous.clock_event_reasons) & dcgm.THERMAL_BITS:
        drafts.append(_dcgm(now, dcgm.CLOCKS_EVENT_REASONS, now.clock_event_reasons,
                            f"clock event reasons 0x{now.clock_event_reasons:x} on {where}"))
        if now.temperature is not None:
            drafts.append(_dcgm(now, dcgm.GPU_TEMP, now.temperature,
                                f"{now.temperature:.0f} C on {where}"))
    if (now.dbe_total is not None and previous.dbe_total is not None
            and now.dbe_total > previous.dbe_total):
        drafts.append(_dcgm(now, dcgm.ECC_DBE_VOL_TOTAL, now.dbe_total,
                            f"double-bit ECC errors {previous.dbe_total:g} -> "
                            f"{now.dbe_total:g} on {where}", previous=previous.dbe_total))
    if now.row_remap_failure and not previous.row_remap_failure:
        drafts.append(_dcgm(now, dcgm.ROW_REMAP_FAILURE, 1,
                            f"row remap failure on {where}"))
    return drafts


def remapped_rows_change(previous: float | None, now: GpuMetric) -> SignalDraft | None:
    """DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS as an event (dcgm-exporter's stock counters
    file exports it, unlike the row-remap failure flag). ``previous``: the count last
    recorded, None when none is (the first reading: a baseline, which diagnosis reads as no
    fault, since the rows may have been remapped long ago). A rise is an uncorrectable memory
    error: the same ``dcgm_field`` signal as a double-bit ECC rise, with the count before it."""
    value = now.uncorrectable_remapped_rows
    if value is None or (previous is not None and value <= previous):
        return None
    where = f"{now.node} GPU {now.gpu}"
    if previous is None:
        return _dcgm(now, dcgm.UNCORRECTABLE_REMAPPED_ROWS, value,
                     f"{value:g} rows remapped for uncorrectable errors on {where} (first reading)")
    return _dcgm(now, dcgm.UNCORRECTABLE_REMAPPED_ROWS, value,
                 f"rows remapped for uncorrectable errors {previous:g} -> {value:g} on {where}",
                 previous=previous)


def nic_changes(previous: dict[str, object] | None, now: NicPort) -> list[SignalDraft]:
    """One port's changes since its last reading (``None``: the first reading, a baseline)."""
    if previous is None:
        return []
    drafts = []
    where = f"{now.device} port {now.port}"
    base = {"device": now.device, "port": now.port}
    for counter, value in (("link_downed", now.link_downed),
                           ("link_error_recovery", now.link_error_recovery)):
        before = previous.get(counter)
        if isinstance(before, int) and value > before:
            drafts.append(SignalDraft("nic", "nic_counter", node=now.node, code=value,
                                      value=str(value), message=f"{where} {counter} {before} -> {value}",
                                      data={**base, "counter": counter, "value": value,
                                            "previous": before}))
    state = previous.get("state")
    if now.state != state:
        drafts.append(SignalDraft("nic", "nic_state", node=now.node, value=now.state,
                                  message=f"{where} {state} -> {now.state}",
                                  data={**base, "state": now.state}))
    return drafts


def nic_reading(port: NicPort) -> dict[str, object]:
    return {"state": port.state, "link_downed": port.link_downed,
            "link_error_recovery": port.link_error_recovery}
