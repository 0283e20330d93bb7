"""The small interfaces every source implements, real or simulated.

Read methods return plain dataclasses that look like what the real system reports; action
methods check the current state first (so a retried step does nothing twice) and return an
``ActionResult`` that names the outside call made, for the audit trail.

Every capability is declared here and every implementation has every member (a test holds
each class to its protocol), so a caller never asks "does this client have X?". What a backend
cannot offer answers plainly instead: a change feed or a history the source does not keep
answers ``None`` / empty ("read the whole state"), an action it cannot take raises
``ClientError(permanent=True)``.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple, Protocol, TypeVar


class ClientError(Exception):
    """A source or an action failed. ``permanent`` errors are not worth retrying."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class NotFound(ClientError):
    """The source answered that the named object does not exist (Kubernetes' 404, a node the
    simulation does not have): permanent, and a fact about the object, not a failure to read
    it. A caller asking after one node tells it apart from a source it could not read."""


class EvictionBlocked(ClientError):
    """An eviction the pod's PodDisruptionBudget refuses for now (the Eviction API's 429):
    transient, and worth saying as such ("waiting for the budget"), not as a failure."""


@dataclass(frozen=True)
class ActionResult:
    call: str  # the outside call, as an operator would type it
    changed: bool  # False when the state was already what was asked for
    detail: str = ""
    data: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # base state: IDLE, ALLOCATED, MIXED, DOWN, FUTURE, ...
    flags: tuple[str, ...] = ()  # DRAIN, NOT_RESPONDING, ...
    reason: str = ""
    partition: str = ""
    # How many GPUs the node has in Slurm (its gpu GRES); None where Slurm did not say.
    gpus: int | None = None


@dataclass(frozen=True)
class SlurmReservation:
    """An advanced reservation (``scontrol show reservation``)."""

    name: str
    nodes: tuple[str, ...]
    users: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    end_time: float | None = None  # epoch seconds; None: unset or infinite


@dataclass(frozen=True)
class CheckJobSpec:
    """A batch job FleetWatch submits to check a node (the return-to-service gate): run
    ``script`` (a ``/bin/sh`` script) on ``node`` alone (the whole node, every GPU), inside
    ``reservation``, with ``minutes`` as its time limit, its output into ``output`` (a path
    on the node; ``%j`` is the job id)."""

    name: str
    node: str
    reservation: str
    script: str
    minutes: int
    output: str
    partition: str = ""
    gpus: int | None = None  # the GPUs to ask for (--gres=gpu:N); None: none asked


@dataclass(frozen=True)
class PodCheckSpec:
    """A Kubernetes Job FleetWatch creates to check a node of a pool Kubernetes schedules (the
    return-to-service gate's Kubernetes path): one pod running ``script`` (``/bin/sh -c``) in
    ``image`` on ``node`` alone, asking for ``gpus`` GPUs (``nvidia.com/gpu``: every GPU the
    node offers), no retry, ``minutes`` as its deadline. ``labels`` mark it as FleetWatch's
    (``fleetwatch.io/gate``: the gate's key), so the gate finds it again after a crash."""

    name: str  # the Job's name: a DNS-1123 label of at most 63 characters
    namespace: str
    node: str
    image: str
    script: str
    minutes: int
    gpus: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckJob:
    """What the scheduler says of a check job (a Slurm batch job or a Kubernetes Job, in
    Slurm's words: PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, CANCELLED), and its output
    where FleetWatch can read it."""

    job_id: str
    name: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, CANCELLED, NODE_FAIL, ...
    exit_code: int | None = None  # once ended
    state_reason: str = ""
    nodes: tuple[str, ...] = ()
    output: str | None = None  # its output's text; None: not readable from here


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    name: str
    user: str
    state: str  # PENDING, RUNNING, COMPLETING, CANCELLED, NODE_FAIL, ...
    nodes: tuple[str, ...] = ()
    restart_count: int = 0
    # What the training loop itself reports (step counter, last checkpoint): the simulation
    # exposes it; a real site reads it from the job's log or a metrics endpoint.
    step: int | None = None
    checkpoint_step: int | None = None
    resumed_from_step: int | None = None
    started_at: float | None = None
    exit_code: int | None = None  # the return code, once the job has ended
    state_reason: str = ""  # Slurm's reason: NodeDown, Resources, JobHeldUser, ...
    # The GPU indices the job holds per node (Slurm's gres_detail "gpu:2(IDX:4-5)"); a node
    # missing here means the source did not say, never "no GPU".
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # When it was submitted (Slurm moves this to the requeue time on a requeue) and the two
    # comments Slurm keeps on a job: FleetWatch writes why it stopped or requeued the job into
    # one of them (DESIGN.md, Ownership), so `scontrol show job`, sacct and squeue show it.
    submitted_at: float | None = None
    admin_comment: str = ""
    comment: str = ""
    # How many GPUs the job asks for in all (--gpus, or --gres=gpu:N times its nodes): what a
    # PENDING job waits for, the demand lending reads. None: Slurm did not say.
    gpus_requested: int | None = None


# The job comments a site may have FleetWatch write why it stopped a job into
# (FLEETWATCH_SLURM_COMMENT_FIELD): the admin comment (only operators may set it, so a user
# cannot forge FleetWatch's word) or the user-visible comment.
JOB_COMMENT_FIELDS = ("admin_comment", "comment")
# Between FleetWatch's words and what the comment held before (a user's own `--comment`).
JOB_COMMENT_SEPARATOR = " | "


# A Kubernetes taint: (key, value, effect), effect one of knowledge.kubernetes.TAINT_EFFECTS.
Taint = tuple[str, str, str]


@dataclass(frozen=True)
class K8sNode:
    name: str
    ready: bool | None  # the Ready condition; None when its status is Unknown
    unschedulable: bool
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    ready_reason: str = ""  # the condition's reason: KubeletReady, NodeStatusUnknown, ...
    # Every other condition the node carries, type -> (status, reason, message): the kubelet's
    # pressures and the verdicts health tools write (NVSentinel's SysLogsXIDError, Node Problem
    # Detector's KernelDeadlock, AKS's IBLinkFlapping, ...).
    conditions: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    # spec.taints as (key, value, effect): what keeps pods off the node besides the cordon.
    taints: tuple[Taint, ...] = ()
    gpus: int | None = None  # status.allocatable nvidia.com/gpu; None: none advertised


@dataclass(frozen=True)
class K8sPod:
    namespace: str
    name: str
    node: str
    labels: dict[str, str] = field(default_factory=dict)
    owner_kind: str = ""  # DaemonSet pods are never evicted
    phase: str = "Running"
    mirror: bool = False  # a static pod's mirror: the kubelet's to remove, not the API's
    ready: bool | None = None
    uid: str = ""
    annotations: dict[str, str] = field(default_factory=dict)
    terminating: bool = False
    gpus: int = 0  # nvidia.com/gpu its containers ask for (limits, else requests)


@dataclass(slots=True)
class GpuMetric:
    """One GPU's dcgm-exporter sample, keyed as the exporter labels it (Hostname, gpu).

    Treat it as immutable. Not ``frozen``: a poll builds 100,000 of these, and a frozen
    dataclass's __init__ costs several times more."""

    node: str
    gpu: int
    uuid: str
    utilization: float | None
    temperature: float | None
    last_xid: int  # DCGM_FI_DEV_XID_ERRORS: the value of the last XID, a gauge
    power_w: float | None = None  # DCGM_FI_DEV_POWER_USAGE
    clock_event_reasons: int = 0  # DCGM_FI_DEV_CLOCKS_EVENT_REASONS bitmask
    memory_temperature: float | None = None  # DCGM_FI_DEV_MEMORY_TEMP
    dbe_total: float | None = None  # DCGM_FI_DEV_ECC_DBE_VOL_TOTAL (a running total)
    row_remap_failure: int = 0  # DCGM_FI_DEV_ROW_REMAP_FAILURE (0/1)
    nvlink_errors: float | None = None  # DCGM_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL, summed
    pcie_replays: float | None = None  # DCGM_FI_DEV_PCIE_REPLAY_COUNTER
    model: str = ""  # the modelName label
    # DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS (a running total; None: not reported, or 0 where
    # a query leaves the quiet GPUs out): its rise is an uncorrectable memory error, the
    # memory-fault signal where the exporter does not export the row-remap failure flag.
    uncorrectable_remapped_rows: float | None = None


@dataclass(frozen=True)
class NicPort:
    """An InfiniBand/RoCE port as sysfs shows it (state, and the link_downed counter total)."""

    node: str
    device: str
    port: int
    state: str  # ACTIVE / DOWN
    link_downed: int
    link_error_recovery: int = 0
    symbol_error: int = 0


@dataclass(frozen=True)
class K8sEvent:
    """A Kubernetes Event about a node (core/v1 or events.k8s.io/v1, normalized)."""

    node: str
    reason: str  # NodeNotReady, NodeReady, Rebooted, ...
    message: str
    type: str = "Normal"  # Normal / Warning
    at: float | None = None  # epoch seconds (lastTimestamp / eventTime)
    namespace: str = "default"
    name: str = ""


@dataclass(frozen=True)
class Replacement:
    old_node: str
    new_node: str  # may be "" until the provider knows (a node pool names it when it comes)
    ready: bool
    detail: str = ""
    call: str = ""  # the outside call made, for the audit trail
    # What the caller keeps and hands back to replacement_status(node, data), so any worker
    # can follow the replacement without the provider holding state.
    data: dict[str, object] = field(default_factory=dict)


# (nodes changed, newest resourceVersion, relisted): a list the first time (or after a 410
# Gone), then a watch from the cursor.
NodeChanges = tuple[list[K8sNode], str, bool]
# (node events, cursor): each event API listed once, then watched from its own cursor.
EventChanges = tuple[list[K8sEvent], dict[str, Any]]


class HistoryPoint(NamedTuple):
    at: float  # epoch seconds
    utilization: float | None
    temperature: float | None


# node -> GPU index -> points in time order
GpuHistory = dict[str, dict[int, list[HistoryPoint]]]

GpuKey = tuple[str, int]  # (node, GPU index)
# (node, GPU index) -> DCGM field -> [(epoch seconds, value), ...] in time order
GpuFieldHistory = dict[GpuKey, dict[str, list[tuple[float, float]]]]


@dataclass
class TelemetryChanges:
    """One poll's answer from ``TelemetryClient.changes``.

    ``complete_gpus``: every GPU with a series is in ``gpus`` (the first poll); otherwise only
    the GPUs with a new utilisation/temperature sample or a non-quiet fault field, and a GPU
    absent from ``gpus`` is unchanged, never missing. Fault fields of a GPU in ``gpus`` are
    always current (absent from their sparse query: the quiet value). ``unsampled_*``: GPUs in
    ``gpus`` whose utilisation or temperature had no new sample (the None there means "as
    before"). ``present``: for the nodes that report fewer GPUs than at the last poll and the
    nodes the caller watches, the GPU indexes with a utilisation or temperature series now (a
    node with none is absent: nothing is known of it). ``complete_ports``:
    every port is in ``ports``; otherwise only ports that are not ACTIVE or changed lately.
    A whole read (no change feed) is complete and has no cursor."""

    gpus: list[GpuMetric]
    ports: list[NicPort]
    cursor: dict[str, Any] = field(default_factory=dict)
    complete_gpus: bool = True
    complete_ports: bool = True
    unsampled_utilization: set[GpuKey] = field(default_factory=set)
    unsampled_temperature: set[GpuKey] = field(default_factory=set)
    present: dict[str, set[int]] = field(default_factory=dict)


class SlurmClient(Protocol):
    @property
    def last_warnings(self) -> list[str]:
        """What the latest read skipped (records that did not parse), for the run log."""
        ...

    def nodes(self) -> list[SlurmNode]: ...
    def node(self, name: str) -> SlurmNode:
        """One node as Slurm shows it now, read alone where the interface can (``scontrol
        show node NAME --json`` from 23.02 on, slurmrestd's ``node/NAME``); a name Slurm does
        not know raises NotFound (a permanent ClientError)."""
        ...

    def jobs(self) -> list[SlurmJob]: ...
    def topology(self) -> dict[str, list[str]]: ...
    def drain(self, node: str, reason: str) -> ActionResult: ...
    def down(self, node: str, reason: str) -> ActionResult:
        """Mark the node DOWN (its jobs stop). A scheduler without a separate DOWN state
        (the simulation) drains instead and says so in the result."""
        ...

    def resume(self, node: str) -> ActionResult: ...
    def reboot(self, node: str, reason: str) -> ActionResult:
        """``scontrol reboot ASAP nextstate=RESUME``: drained at once, rebooted when idle."""
        ...

    def cancel(self, job_id: str, signal: str, grace_seconds: int) -> ActionResult: ...
    def requeue(self, job_id: str) -> ActionResult: ...
    def requeue_hold(self, job_id: str) -> ActionResult:
        """Requeue and hold: the job waits, pending, until someone releases it."""
        ...

    def set_comment(self, job_id: str, text: str, field: str) -> ActionResult:
        """Write FleetWatch's ``text`` (``fleetwatch: ...``) into the job's ``field`` (one of
        ``JOB_COMMENT_FIELDS``), keeping what someone else wrote there after it
        (``job_comment``); unchanged when it already says that."""
        ...

    # --- the return-to-service gate: a reservation holding one node, check jobs in it -----

    def reservations(self) -> list[SlurmReservation]: ...
    def reserve(self, name: str, node: str) -> ActionResult:
        """Create reservation ``name`` (``fleetwatch-...``) holding ``node`` alone from now on,
        without end, for FleetWatch's own user (flags MAINT and IGNORE_JOBS): no other job
        starts there, even once the node is resumed. Unchanged when it already holds it."""
        ...

    def unreserve(self, name: str) -> ActionResult:
        """Delete FleetWatch's reservation ``name``; unchanged when it is gone already. A name
        not starting ``fleetwatch-`` is refused (not FleetWatch's)."""
        ...

    def submit_check(self, spec: CheckJobSpec) -> ActionResult:
        """Submit a check job (``data["job_id"]``); a job of that name slurmctld still holds
        is that one (a retried step submits nothing twice)."""
        ...

    def check_job(self, job_id: str, output: str = "") -> CheckJob | None:
        """A check job's state and exit code, and ``output`` (its output file, ``%j``
        expanded) read where this machine can; None once slurmctld no longer holds it."""
        ...


class KubernetesClient(Protocol):
    @property
    def last_warnings(self) -> list[str]:
        """What the latest read skipped (malformed objects, an expired watch), for the run log."""
        ...

    def nodes(self) -> list[K8sNode]: ...
    def node(self, name: str) -> K8sNode:
        """One node as it is now; an unknown name raises NotFound (a permanent ClientError)."""
        ...

    def pods_on_node(self, node: str) -> list[K8sPod]: ...
    def node_changes(self, cursor: str | None, timeout_seconds: float) -> NodeChanges | None:
        """The nodes changed since ``cursor`` (see ``NodeChanges``); None from a source with
        no change feed (the simulation): the caller lists ``nodes()`` instead."""
        ...

    def event_changes(self, cursor: dict[str, Any] | None,
                      timeout_seconds: float) -> EventChanges | None:
        """Node events since ``cursor`` (see ``EventChanges``); None from a source that keeps
        no node events (the simulation)."""
        ...

    def cordon(self, node: str, reason: str) -> ActionResult: ...
    def uncordon(self, node: str) -> ActionResult: ...
    def evict(self, namespace: str, pod: str) -> ActionResult:
        """Through the Eviction API, honouring PodDisruptionBudgets: a budget that holds the
        pod raises ``EvictionBlocked`` (try again later)."""
        ...

    def relabel(self, node: str, labels: Mapping[str, str | None],
                add_taints: Sequence[Taint], remove_taints: Sequence[str],
                annotations: Mapping[str, str | None]) -> ActionResult:
        """Set the node's ``labels`` (None removes one), add ``add_taints`` (a taint with the
        same key and effect is replaced), remove the taints named in ``remove_taints``
        (``key`` or ``key:Effect``) and set ``annotations`` (FleetWatch's ``fleetwatch.io/``
        marks), all in one change; unchanged when the node already is so."""
        ...

    def slurm_nodes(self) -> dict[str, str] | None:
        """{Slurm node name: Kubernetes node} from slurm-operator's slurmd pods (Slinky);
        None from a source that runs no Slurm in pods (the simulation)."""
        ...

    def submit_check(self, spec: PodCheckSpec) -> ActionResult:
        """Create the check Job (``data["job_id"]``: its name); a Job of that name that exists
        already is that one (a retried step creates nothing twice)."""
        ...

    def check_job(self, namespace: str, name: str) -> CheckJob | None:
        """The check Job's state in Slurm's words (PENDING until its pod runs, with the
        scheduler's or the kubelet's reason; RUNNING; COMPLETED; FAILED; TIMEOUT past its
        deadline), its pod's exit code and, once ended, its pod's log; None once the Job is
        gone."""
        ...

    def cancel_check(self, namespace: str, name: str) -> ActionResult:
        """Delete the check Job and its pod (a gate that gave up on it); unchanged when it is
        gone already. A Job without FleetWatch's ``fleetwatch.io/gate`` label is refused."""
        ...


class TelemetryClient(Protocol):
    @property
    def last_warnings(self) -> list[str]:
        """What the latest reads skipped (series that did not parse), for the run log."""
        ...

    def gpu_metrics(self, nodes: Sequence[str] | None = None) -> list[GpuMetric]:
        """Every GPU with a series; with ``nodes``, only theirs (a remediation step asks
        about its node: the whole fleet's answer is 100,000 GPUs' worth at 12,500 nodes)."""
        ...

    def nic_ports(self) -> list[NicPort]: ...
    def changes(self, cursor: Mapping[str, Any] | None,
                watch: Iterable[str] = ()) -> TelemetryChanges | None:
        """What changed since the poll that returned ``cursor``; ``watch``: nodes whose GPUs
        to list in ``present``. None from a source with no change feed (the simulation): the
        caller reads ``gpu_metrics()`` and ``nic_ports()`` whole."""
        ...

    def gpu_history(self, nodes: Sequence[str], start: datetime, end: datetime,
                    step_seconds: float = 15.0) -> GpuHistory:
        """Utilisation and temperature of the nodes' GPUs over a time range, for charts; a
        source that keeps no history answers ``{}`` (no samples)."""
        ...

    def gpu_readings(self, nodes: Sequence[str],
                     fields: Sequence[str]) -> dict[tuple[str, int], dict[str, float]]:
        """The latest value of each named dcgm-exporter field (``collectors.knowledge.dcgm``
        names) for the nodes' GPUs: ``{(node, gpu): {field: value}}``, for a node's page.
        A field the source does not report for a GPU is absent, never 0; a GPU with none of
        them is absent. Not for polls: it reads whatever it is asked, uncached."""
        ...

    def gpu_field_history(self, nodes: Sequence[str], fields: Sequence[str], start: datetime,
                          end: datetime, step_seconds: float) -> GpuFieldHistory:
        """The named DCGM fields (``collectors.knowledge.dcgm`` names) of the nodes' GPUs from
        ``start`` to ``end``, one point per ``step_seconds``: what the fail-slow analysis
        compares, read as history because the telemetry poll keeps none of it. A counter is
        its running total, as exported. A field or GPU with no samples in the range is
        absent; a source that keeps no history answers ``{}``."""
        ...


@dataclass(frozen=True)
class ProviderStatus:
    """What a node provider says of a node it manages."""

    node: str
    state: str  # ready, provisioning, rebooting, resetting, replaced, failed, unknown
    detail: str = ""


class NodeProvider(Protocol):
    """Where nodes come from and go back to: the simulation, Slurm's own reboot, a Kubernetes
    node pool, a site's program. Every method is idempotent: asking again for what is already
    under way returns its progress instead of starting it twice."""

    def replace(self, node: str) -> Replacement: ...
    def replacement_status(self, node: str,
                           data: Mapping[str, object] | None = None) -> Replacement | None: ...
    def reboot(self, node: str, reason: str) -> ActionResult: ...
    def reset_gpu(self, node: str, gpu: int | None) -> ActionResult: ...
    def status(self, node: str) -> ProviderStatus: ...


class NoProvider:
    """Real sources with no node provider configured: a replacement, reboot or reset is
    refused, plainly, and the remediation stops there for a person."""

    def _refuse(self, what: str, node: str) -> ClientError:
        return ClientError(f"no node provider is configured to {what} {node} "
                           "(FLEETWATCH_PROVIDER)", permanent=True)

    def replace(self, node: str) -> Replacement:
        raise self._refuse("replace", node)

    def replacement_status(self, node: str,
                           data: Mapping[str, object] | None = None) -> Replacement | None:
        return None

    def reboot(self, node: str, reason: str) -> ActionResult:
        raise self._refuse("reboot", node)

    def reset_gpu(self, node: str, gpu: int | None) -> ActionResult:
        raise self._refuse("reset a GPU of", node)

    def status(self, node: str) -> ProviderStatus:
        return ProviderStatus(node, "unknown", "no node provider configured")


# FleetWatch's ownership markers (DESIGN.md, "Ownership").
SLURM_REASON_PREFIX = "fleetwatch:"
# ...and its reservations' and check jobs' names start with this.
SLURM_NAME_PREFIX = "fleetwatch-"


def job_comment(current: str, text: str) -> str:
    """The comment with FleetWatch's ``text`` in place of its earlier words: what someone else
    wrote (a user's ``sbatch --comment``) is kept after the separator; FleetWatch's own earlier
    sentence is replaced, so a job requeued twice says the latest story once."""
    text = " ".join(text.replace(JOB_COMMENT_SEPARATOR, "; ").split())
    if not text.startswith(SLURM_REASON_PREFIX):
        text = f"{SLURM_REASON_PREFIX} {text}"
    theirs = current.strip()
    if theirs.startswith(SLURM_REASON_PREFIX):
        theirs = theirs.partition(JOB_COMMENT_SEPARATOR)[2].strip()
    return f"{text}{JOB_COMMENT_SEPARATOR}{theirs}" if theirs else text


def taint_named(taint: Taint, spec: str) -> bool:
    """Whether ``spec`` (``key`` or ``key:Effect``, as ``kubectl taint KEY[:EFFECT]-`` names
    one) names ``taint``."""
    key, _, effect = spec.partition(":")
    return taint[0] == key and (not effect or taint[2] == effect)


def relabelled(labels: Mapping[str, str], taints: Sequence[Taint],
               annotations: Mapping[str, str], set_labels: Mapping[str, str | None],
               add_taints: Sequence[Taint], remove_taints: Sequence[str],
               set_annotations: Mapping[str, str | None],
               ) -> tuple[dict[str, str], tuple[Taint, ...], dict[str, str]]:
    """A node's labels, taints and annotations after ``KubernetesClient.relabel``: what every
    implementation computes the same way (a taint added replaces the one with its key and
    effect, in place; the API server refuses two)."""
    def merged(now: Mapping[str, str], change: Mapping[str, str | None]) -> dict[str, str]:
        out = dict(now)
        for key, value in change.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    kept: list[Taint] = [(k, v, e) for k, v, e in taints
                         if not any(taint_named((k, v, e), spec) for spec in remove_taints)]
    for key, value, effect in add_taints:
        at = next((i for i, t in enumerate(kept) if (t[0], t[2]) == (key, effect)), None)
        if at is None:
            kept.append((key, value, effect))
        else:
            kept[at] = (key, value, effect)
    return merged(labels, set_labels), tuple(kept), merged(annotations, set_annotations)


def relabel_call(node: str, labels: Mapping[str, str | None], add_taints: Sequence[Taint],
                 remove_taints: Sequence[str], annotations: Mapping[str, str | None]) -> str:
    """The change ``relabel`` makes, as an operator would type it with kubectl."""
    def words(change: Mapping[str, str | None]) -> str:
        return " ".join(f"{k}-" if v is None else shlex.quote(f"{k}={v}")
                        for k, v in sorted(change.items()))

    parts = []
    if labels:
        parts.append(f"kubectl label node {node} --overwrite {words(labels)}")
    if add_taints or remove_taints:
        taints = [shlex.quote(f"{k}={v}:{e}" if v else f"{k}:{e}") for k, v, e in add_taints]
        taints += [f"{spec}-" for spec in remove_taints]
        parts.append(f"kubectl taint node {node} --overwrite {' '.join(taints)}")
    if annotations:
        parts.append(f"kubectl annotate node {node} --overwrite {words(annotations)}")
    return " && ".join(parts) or f"kubectl get node {node}  # nothing to change"


def job_comment_check(field: str) -> None:
    if field not in JOB_COMMENT_FIELDS:
        raise ClientError(f"no job comment field {field!r} (one of "
                          f"{', '.join(JOB_COMMENT_FIELDS)})", permanent=True)
K8S_ANNOTATION_PREFIX = "fleetwatch.io/"
K8S_CORDONED_BY = "fleetwatch.io/cordoned-by"
K8S_CORDON_REASON = "fleetwatch.io/cordon-reason"
K8S_CORDONED_BY_FLEETWATCH = "fleetwatch"  # K8S_CORDONED_BY's value on FleetWatch's own cordon
# On a node FleetWatch lent to inference: which loan (incidents/lending), so anyone reading the
# node with kubectl sees who made it schedulable, and FleetWatch knows the labels are its own.
K8S_LENT = "fleetwatch.io/lent"
NO_AUTO_REPLACE_LABEL = "fleetwatch.io/no-auto-replace"
# The return-to-service gate on a node of a pool Kubernetes schedules: a NoSchedule taint whose
# value is the gate's key (only the check Job tolerates it), and the label on its Jobs.
K8S_GATE = "fleetwatch.io/gate"


_NodeT_co = TypeVar("_NodeT_co", covariant=True)
_NodeT = TypeVar("_NodeT")


class _ReadsOneNode(Protocol[_NodeT_co]):
    def node(self, name: str) -> _NodeT_co: ...


def node_or_none(client: _ReadsOneNode[_NodeT], name: str) -> _NodeT | None:
    """The node called ``name`` as the source (a SlurmClient, a KubernetesClient) shows it,
    None when the source answers that it has none (NotFound: under Slinky, a dynamic Slurm
    node whose slurmd pod is away). One node's read where a step, a gate or a drill asks
    after one: at 12,500 nodes the whole list is megabytes of JSON, read at every poll of
    every step. A source that cannot be read still raises: never "no such node"."""
    try:
        return client.node(name)
    except NotFound:
        return None
