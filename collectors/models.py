"""Fleet state as FleetWatch last saw it, and the normalized signals the sources produced."""

from __future__ import annotations

import math
import re
from typing import Any

from django.db import models
from django.utils import timezone

from collectors.knowledge.slurm import SLURM_OPERATOR_REASON_PREFIX

# Deeper than this, a stored value is cut (the door refuses such nesting; older rows may
# hold it, and walking or encoding them must not exhaust the stack).
JSON_SAFE_DEPTH = 64
_REPLACEMENT = "\ufffd"
_UNSAFE_CHARS = re.compile("[\x00\ud800-\udfff]")


def json_safe(value: Any, _depth: int = 0) -> Any:
    """``value`` with what strict JSON, PostgreSQL or UTF-8 cannot hold replaced: NUL and lone
    surrogates in strings (and keys) become U+FFFD, infinities and NaN become ``None``, nesting
    past ``JSON_SAFE_DEPTH`` becomes a note. The value itself when nothing needed replacing,
    so the common case copies nothing."""
    if isinstance(value, str):
        return _UNSAFE_CHARS.sub(_REPLACEMENT, value) if not value.isascii() or "\x00" in value \
            else value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict | list | tuple) and _depth >= JSON_SAFE_DEPTH:
        return f"[nested deeper than {JSON_SAFE_DEPTH} levels: left out]"
    if isinstance(value, dict):
        out, changed = {}, False
        for k, v in value.items():
            safe_k = json_safe(k, _depth) if isinstance(k, str) else k
            safe_v = json_safe(v, _depth + 1)
            changed = changed or safe_k is not k or safe_v is not v
            out[safe_k] = safe_v
        return out if changed else value
    if isinstance(value, list | tuple):
        items = [json_safe(v, _depth + 1) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value


# What a JSON text holds when json_safe may have something to replace: an escaped NUL or
# surrogate, or the NaN/Infinity tokens Python writes (a false alarm only costs a walk).
_UNSAFE_JSON_TEXT = re.compile(r"\\u(?:0000|[dD][89a-fA-F])|NaN|Infinity|\x00")


class SafeJSONField(models.JSONField):
    """A JSONField whose reads never hand out what readers cannot encode.

    SQLite keeps the JSON text as it was written, so a row stored before the door refused
    them can hold a lone surrogate or a NUL, escaped (PostgreSQL's jsonb refuses both, and
    SQLite's JSON check refuses NaN): every reader (API, pages, exports, diagnosis) gets them
    replaced (see ``json_safe``)."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        unsafe = isinstance(value, str) and _UNSAFE_JSON_TEXT.search(value) is not None
        value = super().from_db_value(value, expression, connection)
        return json_safe(value) if unsafe else value


class Cluster(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=200, blank=True)

    def __str__(self) -> str:
        return self.name


class Node(models.Model):
    class Health(models.TextChoices):
        HEALTHY = "healthy", "healthy"
        DEGRADED = "degraded", "degraded"
        FAILED = "failed", "failed"
        UNKNOWN = "unknown", "unknown"

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="nodes")
    # The machine's name: the Kubernetes node's and the host's, which kernel, NVML and
    # dcgm-exporter records carry.
    name = models.CharField(max_length=128)
    # Slurm's name for this machine where it differs (Slinky: the slurmd pod's NodeName, e.g.
    # "slinky-0", runs on Kubernetes node "gpu-node-a"); blank means the same as ``name``.
    slurm_name = models.CharField(max_length=128, blank=True, db_index=True)
    pool = models.CharField(max_length=64, blank=True, help_text="node pool (gpu, spare, rma)")
    leaf_switch = models.CharField(max_length=64, blank=True)
    in_service = models.BooleanField(default=True)
    # Slurm side: the base state (IDLE, ALLOCATED, MIXED, DOWN, ...) and its flags (DRAIN, ...).
    slurm_state = models.CharField(max_length=32, blank=True)
    slurm_flags = models.JSONField(default=list, blank=True)
    slurm_reason = models.CharField(max_length=256, blank=True)
    # Kubernetes side. ``None`` means the source has not reported: never read it as not ready.
    k8s_ready = models.BooleanField(null=True)
    # The Ready condition's status as last reported: "True", "False", "Unknown", or "" when
    # Kubernetes never reported the node (k8s_ready alone cannot tell Unknown from never).
    k8s_ready_status = models.CharField(max_length=8, blank=True)
    k8s_unschedulable = models.BooleanField(default=False)
    k8s_annotations = models.JSONField(default=dict, blank=True)
    # Every other node condition as last reported, type -> [status, reason, message]: what
    # normalize.k8s_condition_changes compares against (health tools' verdicts among them).
    k8s_conditions = models.JSONField(default=dict, blank=True)
    # The node's labels and taints as last reported (shown on its page).
    k8s_labels = models.JSONField(default=dict, blank=True)
    k8s_taints = models.JSONField(default=list, blank=True)
    # The NIC summary (worst port state, link_downed summed over ports) and, per port
    # ("mlx5_0/1"), the last readings the change detection compares against.
    nic_state = models.CharField(max_length=16, blank=True)
    nic_link_downed = models.IntegerField(null=True)
    nic_ports = models.JSONField(default=dict, blank=True)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.UNKNOWN)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster", "name"], name="node_unique_name")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.slurm_flags or "DRAINED" in self.slurm_flags

    @property
    def drained_by_operator(self) -> bool:
        """Drained or set DOWN by Slinky's slurm-operator, which undoes it itself."""
        return self.slurm_reason.startswith(SLURM_OPERATOR_REASON_PREFIX)

    @property
    def slurm_display(self) -> str:
        return "+".join([self.slurm_state, *self.slurm_flags]) if self.slurm_state else "unknown"


class Gpu(models.Model):
    # No foreign key constraint in the database (db_constraint=False): PostgreSQL checks one
    # row at a time, at commit, and for the 100,000 GPUs a first poll creates that was 0.5 to
    # 0.7 s of it (issue 18). Nothing is lost by it: FleetWatch never deletes a node (one gone
    # from its sources is marked so), GPU rows are written only by the telemetry collector
    # for node ids it has just read under the source's lock, and the ORM still cascades a
    # deletion and joins as before. No index of its own either (db_index=False): the unique
    # (node, index) index serves every look-up by node, and keeping a second one up to date
    # was a third of inserting those GPUs.
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus",
                             db_constraint=False, db_index=False)
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=64, blank=True)
    utilization = models.FloatField(null=True)
    temperature = models.FloatField(null=True)
    last_xid = models.IntegerField(default=0)
    last_xid_at = models.DateTimeField(null=True)
    # The last readings change detection compares against (dcgm-exporter fields).
    clock_event_reasons = models.IntegerField(default=0)
    dbe_total = models.FloatField(null=True)
    row_remap_failure = models.BooleanField(default=False)
    health = models.CharField(
        max_length=16, choices=Node.Health.choices, default=Node.Health.UNKNOWN
    )
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index")]
        ordering = ["node__name", "index"]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index}"


class GpuSample(models.Model):
    """One telemetry scrape of one GPU, kept for charts (pruned after a retention period)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="samples")
    gpu_index = models.PositiveSmallIntegerField()
    at = models.DateTimeField(db_index=True)
    utilization = models.FloatField(null=True)
    temperature = models.FloatField(null=True)

    class Meta:
        indexes = [models.Index(fields=["node", "at"])]


class Job(models.Model):
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="jobs")
    slurm_id = models.CharField(max_length=32)
    name = models.CharField(max_length=128, blank=True)
    user = models.CharField(max_length=64, blank=True)
    state = models.CharField(max_length=32, blank=True)
    nodes = models.JSONField(default=list, blank=True)
    # Which GPUs the job holds on each of its nodes, from Slurm's gres_detail:
    # {"gpu-003": [4, 5]}. A node missing here means Slurm did not say (not "no GPU").
    gpus = models.JSONField(default=dict, blank=True)
    restart_count = models.PositiveIntegerField(default=0)
    step = models.PositiveIntegerField(null=True, help_text="last training step reported")
    checkpoint_step = models.PositiveIntegerField(null=True)
    resumed_from_step = models.PositiveIntegerField(null=True)
    started_at = models.DateTimeField(null=True)
    # Slurm moves a requeued job's submit and start times to the requeue: the first ones
    # FleetWatch saw are kept here, so the job's page still tells when it really began.
    submitted_at = models.DateTimeField(null=True, help_text="first submitted (kept across requeues)")
    first_started_at = models.DateTimeField(null=True, help_text="first started (kept across requeues)")
    # The job's two comments as Slurm reports them (FleetWatch writes its "fleetwatch: ..."
    # sentence into one of them, FLEETWATCH_SLURM_COMMENT_FIELD).
    admin_comment = models.TextField(blank=True)
    comment = models.TextField(blank=True)
    # What a waiting job asks for and why it waits: Slurm's pending demand, which lending
    # reads (Resources, Priority: demand; JobHeldUser, Dependency: not yet).
    gpus_requested = models.PositiveIntegerField(null=True, blank=True,
                                                 help_text="GPUs the job asks for in all")
    state_reason = models.CharField(max_length=64, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "slurm_id"], name="job_unique_slurm_id")
        ]
        indexes = [models.Index(fields=["cluster", "state"], name="job_cluster_state")]
        ordering = ["-updated_at"]

    def __str__(self) -> str:
        return f"job {self.slurm_id}"


class Signal(models.Model):
    """A normalized observation from one source: an XID, a state change, a link event."""

    class Source(models.TextChoices):
        SLURM = "slurm", "Slurm"
        KUBERNETES = "kubernetes", "Kubernetes"
        DCGM = "dcgm", "DCGM / Prometheus"
        KERNEL = "kernel", "kernel log"
        NIC = "nic", "NIC"
        JOB_LOG = "job_log", "job log"
        COLLECTOR = "collector", "collector"
        GPUD = "gpud", "gpud (node agent)"

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="signals")
    source = models.CharField(max_length=16, choices=Source.choices)
    kind = models.CharField(max_length=48, help_text="xid, slurm_node_state, k8s_condition, ...")
    node = models.ForeignKey(
        Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="signals"
    )
    node_name = models.CharField(max_length=128, blank=True)
    gpu_index = models.PositiveSmallIntegerField(null=True, blank=True)
    job_id = models.CharField(max_length=32, blank=True)
    code = models.IntegerField(null=True, blank=True)
    value = models.CharField(max_length=128, blank=True)
    message = models.TextField(blank=True)
    data = SafeJSONField(default=dict, blank=True)
    observed_at = models.DateTimeField(db_index=True)
    ingested_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["observed_at", "id"]
        indexes = [
            models.Index(fields=["cluster", "observed_at"]),
            models.Index(fields=["node_name", "observed_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.source}:{self.kind} {self.node_name} {self.value}"


class PushReceipt(models.Model):
    """A push sent with an ``Idempotency-Key``: the same key from the same caller again (an
    agent retrying a batch whose answer it never got) is answered from here and stores
    nothing. ``digest`` is the batch's, so a key reused for another batch is refused. Kept
    FLEETWATCH_INGEST_IDEMPOTENCY_HOURS (pruned with the telemetry)."""

    caller = models.CharField(max_length=64, help_text="token:<id> or user:<id>")
    key = models.CharField(max_length=128)
    digest = models.CharField(max_length=64)
    stored = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["caller", "key"], name="push_receipt_unique_key")
        ]

    def __str__(self) -> str:
        return f"{self.caller} {self.key}: {self.stored} stored"


class CollectionWanted(models.Model):
    """A collection asked for ahead of its poll (the telemetry doorbell: a new fault in a
    Prometheus remote write) and not started yet. While one is there, more asks queue nothing;
    the collection deletes it as it starts. In the database, not the cache, so the web
    processes that ring and the workers that collect agree wherever they run; a row older
    than the doorbell's patience is a lost message and is asked again."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="+")
    source = models.CharField(max_length=32)
    asked_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster", "source"],
                                               name="collection_wanted_once")]


class SourceHealth(models.Model):
    """Whether a collector could read its source the last time it ran."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="sources")
    name = models.CharField(max_length=32)
    healthy = models.BooleanField(null=True)
    last_run_at = models.DateTimeField(null=True)
    last_success_at = models.DateTimeField(null=True)
    last_error = models.TextField(blank=True)
    last_duration_ms = models.FloatField(null=True)
    consecutive_failures = models.PositiveIntegerField(default=0)
    runs = models.PositiveIntegerField(default=0)
    # Every failed run ever, for the fleetwatch_collector_errors_total counter (the run history
    # is pruned, so it cannot be counted from CollectorRun).
    failures = models.PositiveIntegerField(default=0)
    # Where the source's change feed was read up to (Kubernetes event resourceVersions, ...).
    cursor = models.JSONField(default=dict, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "name"], name="source_unique_name")
        ]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name}: {'up' if self.healthy else 'down'}"


class CollectorRun(models.Model):
    """One run of one collector: when, how long, what it read, what went wrong.

    Pruned with the telemetry. ``warnings`` holds records the source sent that could not be
    parsed (the error and an excerpt); the rest of that run's data was kept."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="collector_runs")
    source = models.CharField(max_length=32)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    duration_ms = models.FloatField()
    ok = models.BooleanField()
    error = models.TextField(blank=True)
    counts = models.JSONField(default=dict, blank=True)
    warnings = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["source", "started_at"])]

    def __str__(self) -> str:
        return f"{self.source} run at {self.started_at:%H:%M:%S}: {'ok' if self.ok else 'failed'}"
