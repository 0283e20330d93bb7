"""Collector services: read a source, update the current state, store signals, announce them.

Collectors never import ``incidents``. They announce new signals with a Django signal sent in
the transaction that stored them (signals_stored); whoever listens decides what they mean.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import django.dispatch
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import Field, Q
from django.utils import timezone

from collectors import normalize, queueing
from collectors.bulk import append_rows, insert_missing, update_columns
from collectors.clients import Clients, get_clients
from collectors.clients.base import (
    ClientError,
    GpuMetric,
    K8sEvent,
    KubernetesClient,
    NicPort,
    SlurmClient,
    TelemetryChanges,
    TelemetryClient,
)
from collectors.knowledge import dcgm
from collectors.knowledge.xid import takes_gpu_out
from collectors.models import (
    Cluster,
    CollectionWanted,
    CollectorRun,
    Gpu,
    GpuSample,
    Job,
    Node,
    PushReceipt,
    Signal,
    SourceHealth,
    json_safe,
)
from collectors.normalize import SignalDraft
from collectors.push import DRILL_MARK, INGEST_SOURCES, PushRights
from collectors.sources import cluster_names, sources_of

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class CollectResult:
    source: str
    healthy: bool
    signal_ids: list[int]
    error: str = ""
    skipped: bool = False  # the previous run of this collector was still reading


def cluster_default() -> Cluster:
    """The cluster pushes and commands that name none go to (FLEETWATCH_CLUSTER)."""
    return cluster_get(settings.FLEETWATCH_CLUSTER)


# Cluster rows by name, kept per process for the pushes (signals_ingest): a cluster's row is
# made once and then never changes or goes (a cluster no longer watched keeps its history),
# and reading it was one of the eight statements of every push. The push's node look-up,
# made by the cluster's name, says which row the nodes belong to now: a kept row that is not
# that one (rolled back in a test, its id since given to another cluster on SQLite) is read
# again.
_push_clusters: dict[str, Cluster] = {}


_PUSH_NODES_SQL = (f'SELECT n."name", n."id", n."cluster_id" FROM "{Node._meta.db_table}" n '
                   f'JOIN "{Cluster._meta.db_table}" c ON c."id" = n."cluster_id" '
                   'WHERE c."name" = %s AND n."name" = ANY(%s)')


def _push_nodes(name: str, names: Collection[str]) -> tuple[Cluster, dict[str, int]]:
    """The cluster called ``name`` and the ids of those of its nodes that exist."""
    rows: list[tuple[str, int, int]] = []
    if names and connection.vendor == "postgresql":
        # Written out: the ORM compiling it took as long as running it, on every push.
        with connection.cursor() as cursor:
            cursor.execute(_PUSH_NODES_SQL, [name, sorted(names)])
            rows = cursor.fetchall()
    elif names:
        rows = list(Node.objects.filter(cluster__name=name, name__in=names).values_list(
            "name", "pk", "cluster_id"))
    cluster = _push_clusters.get(name)
    if (cluster is None or {c for _, _, c in rows} != {cluster.pk}
            or name not in cluster_names()):
        cluster = _push_clusters[name] = cluster_get(name)  # ClientError for an unknown name
    return cluster, {node: pk for node, pk, c in rows if c == cluster.pk}


def cluster_get(name: str) -> Cluster:
    """The cluster's row, made on first use; raises ClientError for a cluster FleetWatch
    has no settings for (FLEETWATCH_CLUSTERS)."""
    known = cluster_names()
    if name not in known:
        raise ClientError(f"unknown cluster {name!r}; this FleetWatch watches "
                          f"{', '.join(known)}", permanent=True)
    what = "the simulated fleet" if sources_of(name).fleet == "sim" else "real sources"
    cluster, _ = Cluster.objects.get_or_create(name=name, defaults={"description": what})
    return cluster


@dataclass
class RunLog:
    """What one collector run read, for its CollectorRun row."""

    counts: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class _RunBusy(Exception):
    """Another run of the same collector holds its row."""


def collect_source(source: str, cluster_name: str | None = None, *,
                   clients: Clients | None = None, urgent: bool = False) -> CollectResult:
    """Run one collector on one cluster (None: the default one). A source that cannot be
    read marks itself unhealthy and changes no node: a missing source is never read as a
    failed node.

    Runs of one collector never overlap: a scheduled run that finds the previous one still
    reading is skipped (the next beat reads the same source anyway), instead of waiting on
    its row and holding a worker process that diagnosis and remediation need. ``urgent``
    (the doorbell's): wait for the running one and read after it, since it may have read
    before the fault that rang."""
    collector = COLLECTORS.get(source)
    if collector is None:
        raise ValueError(f"unknown source {source!r}; known: {', '.join(COLLECTORS)}")
    cluster = cluster_get(cluster_name) if cluster_name else cluster_default()
    # From here on a doorbell queues another run: this one may read too early for it.
    CollectionWanted.objects.filter(cluster=cluster, source=source).delete()
    clients = clients or get_clients(cluster.name)
    started, started_at = time.monotonic(), timezone.now()
    run = RunLog()
    try:
        with transaction.atomic():
            commit_without_flush()
            # Lock this source's health row first: two runs of one collector (a slow scrape
            # overlapping the next beat) never read at once, so a change is announced once.
            _source_lock(cluster, source, wait=urgent)
            drafts = collector(cluster, clients, run)
            ids = signals_store(cluster, drafts)
            health_changes = source_health_record(cluster, source, None, started)
            ids += signals_store(cluster, health_changes)
            run.counts["signals"] = len(ids)
            _run_record(cluster, source, started_at, started, run, "")
            signals_announce(ids)
        return CollectResult(source, True, ids)
    except _RunBusy:
        log.info("collector %s of %s skipped: its previous run is still reading", source,
                 cluster.name)
        return CollectResult(source, True, [], skipped=True)
    except (ClientError, SoftTimeLimitExceeded) as exc:
        # A source slower than the task's time limit is as down as one that refuses: it
        # turns red with the reason, and changes no node.
        if isinstance(exc, SoftTimeLimitExceeded):
            exc = ClientError(f"{source} did not answer within the task time limit "
                              "(FLEETWATCH_TASK_SOFT_TIME_LIMIT)")
        log.warning("collector %s failed: %s", source, exc)
        with transaction.atomic():
            health_changes = source_health_record(cluster, source, str(exc), started)
            ids = signals_store(cluster, health_changes)
            _run_record(cluster, source, started_at, started, RunLog(), str(exc))
            signals_announce(ids)
        return CollectResult(source, False, ids, str(exc))


def commit_without_flush() -> None:
    """This transaction's commit does not wait for PostgreSQL to flush its WAL to disk
    (``synchronous_commit`` off, for it alone). Only for writes a database crash may lose:
    it can lose the last few hundred milliseconds of commits.

    - A collector's poll: it writes up to 100,000 rows, and at a first poll the wait for that
      flush was 0.4 s of 2.5. A poll lost so is undone whole (readings, signals and the
      cursor together, never a torn state), so the next poll reads the same changes again.
    - A token's ``last_used_at``, for people reading the token list (incidents.api.auth).

    Everything else keeps the default: people's actions, remediation, and a node agent's
    push above all (the agent forgets a line once its push is answered, so that answer must
    mean it is on disk). Call it first thing in an ``atomic()`` block that is the whole
    transaction: in a block nested in another, it would apply to the outer one's commit."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")


def _source_lock(cluster: Cluster, source: str, *, wait: bool) -> None:
    """Take the source's row for this transaction; raise _RunBusy rather than wait for it
    unless ``wait``. (SQLite takes no row locks: its one worker's runs take turns anyway.)"""
    rows = SourceHealth.objects.select_for_update(nowait=not wait)
    try:
        with transaction.atomic():  # a savepoint: the refusal must not spoil the transaction
            rows.get_or_create(cluster=cluster, name=source)
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == "55P03":  # lock_not_available
            raise _RunBusy from exc
        raise


def _run_record(cluster: Cluster, source: str, started_at: datetime, started: float,
                run: RunLog, error: str) -> None:
    CollectorRun.objects.create(
        cluster=cluster, source=source, started_at=started_at, finished_at=timezone.now(),
        duration_ms=(time.monotonic() - started) * 1000, ok=not error, error=error[:2000],
        counts=run.counts, warnings=run.warnings[:50])


def _client_warnings(client: SlurmClient | KubernetesClient | TelemetryClient,
                     run: RunLog) -> None:
    """Records a source sent that its client could not parse (kept out of the data)."""
    for warning in client.last_warnings:
        run.warnings.append(str(warning)[:500])


def source_health_record(
    cluster: Cluster, source: str, error: str | None, started: float
) -> list[SignalDraft]:
    health, _ = SourceHealth.objects.select_for_update().get_or_create(cluster=cluster,
                                                                        name=source)
    was = health.healthy
    now = timezone.now()
    health.healthy = error is None
    health.last_run_at = now
    health.last_duration_ms = (time.monotonic() - started) * 1000
    health.runs += 1
    if error is None:
        health.last_success_at = now
        health.consecutive_failures = 0
        health.last_error = ""
    else:
        health.consecutive_failures += 1
        health.failures += 1
        health.last_error = error[:2000]
    health.save()
    if was == health.healthy:
        return []
    if was is None and health.healthy:
        return []  # a source's first good run is not news
    return [SignalDraft("collector", "collector_health", value=str(health.healthy).lower(),
                        message=f"{source} {'recovered' if health.healthy else 'down'}"
                        + (f": {error}" if error else ""),
                        data={"name": source, "healthy": health.healthy, "error": error or ""})]


def signals_store(
    cluster: Cluster, drafts: Iterable[SignalDraft], *, observed_at: datetime | None = None,
    node_ids: dict[str, int] | None = None,
) -> list[int]:
    """Store the drafts; their ids. ``node_ids``: the cluster's node name -> id for the
    drafts' nodes, when the caller has read them already (a push, on its hot path)."""
    drafts = list(drafts)
    if not drafts:
        return []
    now = timezone.now()
    nodes = node_ids if node_ids is not None else _node_ids(
        cluster, {d.node for d in drafts if d.node})
    # Stored in a form every reader and both databases take: NUL, lone surrogates and
    # non-finite numbers (from a push, or a source that sent them) are replaced (json_safe).
    rows = [
        Signal(cluster=cluster, source=d.source, kind=d.kind, node_id=nodes.get(d.node),
               node_name=json_safe(d.node), gpu_index=d.gpu, job_id=json_safe(d.job),
               code=d.code, value=json_safe(d.value), message=json_safe(d.message),
               data=json_safe(d.data), observed_at=d.observed_at or observed_at or now,
               ingested_at=now)
        for d in drafts
    ]
    # PostgreSQL and SQLite >= 3.35 return the new primary keys from bulk_create.
    return [s.pk for s in Signal.objects.bulk_create(rows)]


class IngestRejected(Exception):
    """A pushed batch that cannot be stored; nothing of it was. ``refused``: the records at
    fault, as ``signals[i].field: why`` (for the answer and the audit entry)."""

    def __init__(self, message: str, *, status: int = 422,
                 refused: list[str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.refused = refused or []


@dataclass(frozen=True)
class IngestResult:
    ids: list[int]
    stored: int
    # A retry under an Idempotency-Key already used for this batch: nothing new was stored.
    replayed: bool = False


SIGNAL_FIELDS = ("at", "source", "node", "gpu", "job", "message")
IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,128}")


def _push_refusals(batch: list[dict[str, Any]], rights: PushRights) -> list[str]:
    """What ``rights`` do not allow in a batch, one line per record at fault."""
    refused = []
    for i, record in enumerate(batch):
        source, node = record.get("source"), record.get("node") or ""
        if source not in rights.sources:
            why = ("whether a source is up is only what FleetWatch's own collectors see"
                   if source == "collector" else f"FleetWatch reads {source} itself"
                   if source in ("slurm", "kubernetes") else "not a source it may push")
            refused.append(f"signals[{i}].source: {rights.who} may not push {source!r} records "
                           f"({why}); it may push {', '.join(sorted(rights.sources))}")
        elif DRILL_MARK in record and not rights.drill:
            refused.append(f"signals[{i}].{DRILL_MARK}: only FleetWatch's own fire drills mark "
                           "a signal as a drill")
        elif rights.node is not None and node != rights.node:
            # An agent speaks for its own node only: a record naming another node, or none
            # (a job or a switch, which it cannot vouch for), rejects the batch.
            refused.append(f"signals[{i}].node: {rights.who} may only push signals for "
                           f"{rights.node}, not {node or 'records that name no node'}")
    return refused


def signals_ingest(cluster: Cluster | str, batch: list[dict[str, Any]], *,
                   rights: PushRights | None = None,
                   idempotency: tuple[str, str] | None = None) -> IngestResult:
    """Store a batch of pushed signals (replay-format records, validated by the caller's
    serializer) and announce them to diagnosis. All or nothing: one bad record rejects the
    batch, so an agent that retries never leaves half a batch behind.

    ``cluster``: its row, or its name (ClientError if FleetWatch does not watch it), whose
    row is then read once per process.

    ``rights``: what the caller may push (collectors.roles.push_rights; by default what any
    ingest token may). ``idempotency``: (caller, key) from the Idempotency-Key header: a batch
    already stored under it is not stored again, and the answer says so."""
    rights = rights or PushRights("an ingest token", INGEST_SOURCES)
    refused = _push_refusals(batch, rights)
    if refused:
        shown = "; ".join(refused[:5]) + (f"; and {len(refused) - 5} more" if len(refused) > 5
                                          else "")
        raise IngestRejected(f"refused, nothing stored: {shown}", status=403, refused=refused)
    names = {r["node"] for r in batch if r.get("node")}
    if isinstance(cluster, str):
        cluster, known = _push_nodes(cluster, names)
    else:
        known = _node_ids(cluster, names)
    if names - known.keys():
        raise IngestRejected(f"unknown node(s): {', '.join(sorted(names - known.keys()))}")
    if idempotency is not None and not IDEMPOTENCY_KEY.fullmatch(idempotency[1]):
        raise IngestRejected("Idempotency-Key must be 1 to 128 visible ASCII characters",
                             status=400)
    drafts = []
    for record in batch:
        data = {k: v for k, v in record.items() if k not in SIGNAL_FIELDS}
        drafts.append(SignalDraft(
            record["source"], f"pushed_{record['source']}", node=record.get("node") or "",
            gpu=record.get("gpu"), job=record.get("job") or "",
            value=str(data.get("value", data.get("state", "")))[:128],
            message=record.get("message") or "", data=data, observed_at=record["at"]))
    with transaction.atomic():
        if idempotency is not None:
            replayed = _push_receipt(idempotency, _batch_digest(batch), len(drafts))
            if replayed is not None:
                return replayed
        ids = signals_store(cluster, drafts, node_ids=known)
        # The batch's earliest moment is known here: diagnosis need not read it back.
        # (A caller that is not the API may hand over text times: then the listener reads.)
        known_at = all(isinstance(d.observed_at, datetime) for d in drafts)
        signals_announce(ids, earliest={cluster.pk: min(
            d.observed_at for d in drafts if d.observed_at is not None)} if known_at else None)
    return IngestResult(ids, len(ids))


def _node_ids(cluster: Cluster, names: Collection[str]) -> dict[str, int]:
    if not names:
        return {}
    return dict(Node.objects.filter(cluster=cluster, name__in=names).values_list("name", "pk"))


def _batch_digest(batch: list[dict[str, Any]]) -> str:
    text = json.dumps(batch, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _push_receipt(idempotency: tuple[str, str], digest: str, count: int) -> IngestResult | None:
    """Claim the key for this batch, or the earlier push's answer if it was claimed. The
    unique constraint decides between two pushes sent at once: the second one's insert waits
    for the first to commit (or roll back), then fails and reads its receipt."""
    caller, key = idempotency
    try:
        with transaction.atomic():
            PushReceipt.objects.create(caller=caller, key=key, digest=digest, stored=count)
        return None
    except IntegrityError:
        earlier = PushReceipt.objects.get(caller=caller, key=key)
    if earlier.digest != digest:
        raise IngestRejected(
            f"Idempotency-Key {key!r} was used at {earlier.created_at:%Y-%m-%d %H:%M:%S} UTC for "
            "a different batch; nothing stored (a new batch needs a new key)", status=422)
    return IngestResult([], earlier.stored, replayed=True)


# Sent with the ids of newly stored signals, inside the transaction that stored them;
# incidents listens (collectors never import it). Its listener marks diagnosis due in the same
# transaction and queues at most one run per cluster, so a burst of pushes cannot pile up
# one diagnosis per batch (incidents.diagnosing.diagnosis_request).
signals_stored = django.dispatch.Signal()


# --- the telemetry doorbell: Prometheus's remote write ---------------------------------------
#
# Polling Prometheus every FLEETWATCH_COLLECT_INTERVAL finds a fault up to one interval after
# the scrape that brought it. Prometheus can instead send each scrape's fresh samples to
# ``POST /api/v1/prometheus/write/``; a fault field among them whose value a poll would read,
# and that differs from the last one seen, queues the cluster's telemetry collection at once.
# The collection then reads Prometheus as any poll does (fault fields are read at its "now"),
# so what is stored and announced comes from one path; the doorbell only says "now".
#
# Fault values seen are remembered DOORBELL_MEMORY_SECONDS (in the cache, shared by the web
# workers), so a fault's gauge that stays at 79 rings once, not at every scrape; a repeat of
# the same value after that rings once more (one extra collection, nothing stored twice).
DOORBELL_MEMORY_SECONDS = 600
# While a rung collection waits in the queue, further rings queue nothing (it will read them):
# a CollectionWanted row, deleted by the collection as it starts. One older than this is a
# lost message, and is asked again.
DOORBELL_PENDING_SECONDS = 60


def _collection_ask(cluster: Cluster, source: str) -> bool:
    """True when this call asked for the collection (none was waiting)."""
    stale = timezone.now() - timedelta(seconds=DOORBELL_PENDING_SECONDS)
    CollectionWanted.objects.filter(cluster=cluster, source=source, asked_at__lt=stale).delete()
    _, created = CollectionWanted.objects.get_or_create(cluster=cluster, source=source)
    return created


def telemetry_doorbell(cluster: Cluster, series: Iterable[Any]) -> bool:
    """A remote write from the cluster's Prometheus (``remote_write.Series``): queue a
    telemetry collection now when it holds a fault value not seen before. True: one was
    queued."""
    from django.core.cache import cache
    from kombu.exceptions import OperationalError

    from collectors.clients.prometheus import fault_sample

    if "telemetry" not in sources_of(cluster.name).sources:
        return False
    latest: dict[str, float] = {}
    for s in series:
        for _, value in s.samples[-1:]:  # the newest sample of each series
            hit = fault_sample(s.labels, value)
            if hit is not None:
                key = "fw:doorbell:" + hashlib.sha256(
                    f"{cluster.pk}\0{hit[0]}\0{hit[1]}\0{hit[2]}".encode()).hexdigest()[:32]
                latest[key] = value
    if not latest:
        return False
    seen = cache.get_many(list(latest))
    new = {key: value for key, value in latest.items() if seen.get(key) != value}
    if not new:
        return False
    cache.set_many(new, timeout=DOORBELL_MEMORY_SECONDS)
    if not _collection_ask(cluster, "telemetry"):
        log.info("doorbell: %d new fault value(s) in %s; its collection is already queued",
                 len(new), cluster.name)
        return False  # a rung collection is queued: it will read these too
    try:
        queueing.enqueue(queueing.COLLECT_SOURCE, "telemetry", cluster.name, True,
                         on_commit=False)
    except OperationalError:
        # The broker is away: forget this write, so Prometheus's retry (it retries a 5xx)
        # rings again; the regular poll reads the fault meanwhile anyway.
        cache.delete_many(list(new))
        CollectionWanted.objects.filter(cluster=cluster, source="telemetry").delete()
        raise
    log.info("doorbell: %d new fault value(s) in %s; telemetry collection queued", len(new),
             cluster.name)
    return True


def signals_announce(signal_ids: list[int],
                     earliest: dict[int, datetime] | None = None) -> None:
    """Tell diagnosis (in the storing transaction). ``earliest``: cluster id -> the earliest
    observation among them, when the caller knows it (else the listener reads it)."""
    if not signal_ids:
        return
    signals_stored.send(sender=Signal, signal_ids=list(signal_ids), earliest=earliest)


def _nodes_ensure(cluster: Cluster, names: Iterable[str]) -> dict[str, int]:
    """The ids of the cluster's nodes by name, creating the ones a source reports for the
    first time. Collectors for different sources run at once and may meet new nodes together:
    inserting in name order makes them queue behind each other instead of deadlocking."""
    ids = dict(Node.objects.filter(cluster=cluster).values_list("name", "id"))
    new = sorted(set(names) - set(ids))
    if new:
        insert_missing(Node(cluster=cluster), ["name"], [(n,) for n in new])
        ids = dict(Node.objects.filter(cluster=cluster).values_list("name", "id"))
    return ids


def collect_slurm(cluster: Cluster, clients: Clients, run: RunLog) -> list[SignalDraft]:
    # A client's warnings are those of its last read: collect them after each one.
    topology = clients.slurm.topology()
    _client_warnings(clients.slurm, run)
    reported = clients.slurm.nodes()
    _client_warnings(clients.slurm, run)
    jobs = clients.slurm.jobs()
    _client_warnings(clients.slurm, run)
    run.counts.update(nodes=len(reported), jobs=len(jobs))
    leaf_of = {node: leaf for leaf, members in topology.items() for node in members}
    ids = _nodes_ensure(cluster, (s.name for s in reported))
    stored = {row[0]: row[1:] for row in Node.objects.filter(cluster=cluster).values_list(
        "name", "slurm_state", "slurm_flags", "slurm_reason", "leaf_switch", "in_service")}
    drafts: list[SignalDraft] = []
    now = timezone.now()
    changed = []
    for seen in reported:
        state, flags, reason, leaf, in_service = stored[seen.name]
        previous = normalize.SlurmNodeSeen(state, tuple(flags), reason) if state else None
        drafts += normalize.slurm_node_changes(previous, seen)
        new = (seen.state, list(seen.flags), seen.reason, leaf_of.get(seen.name, leaf), True)
        if new != (state, flags, reason, leaf, in_service):
            changed.append((ids[seen.name], *new, now))
    # Only the columns this source owns: the other collectors write theirs concurrently, and
    # an unchanged node is not rewritten (at 12,500 nodes that is most of the cost).
    update_columns(Node, ["slurm_state", "slurm_flags", "slurm_reason", "leaf_switch",
                          "in_service", "updated_at"], changed)
    run.counts["nodes_changed"] = len(changed)
    # The nodes Slurm no longer lists, found in the rows read above rather than with a
    # NOT IN of every name Slurm lists (12,500 parameters to bind, every poll). A node
    # another collector creates meanwhile is judged at the next poll.
    in_slurm = {s.name for s in reported}
    gone = [ids[name] for name, row in stored.items()
            if row[4] and name not in in_slurm and name in ids]
    if gone:
        Node.objects.filter(id__in=gone, in_service=True).update(in_service=False,
                                                                 updated_at=now)

    stored_jobs = {slurm_id: (state, submitted, first_start) for slurm_id, state, submitted,
                   first_start in Job.objects.filter(cluster=cluster).values_list(
                       "slurm_id", "state", "submitted_at", "first_started_at")}
    known = {slurm_id: row[0] for slurm_id, row in stored_jobs.items()}
    rows = []
    for seen in jobs:
        drafts += normalize.slurm_job_changes(known.get(seen.job_id), seen)
        _, first_submit, first_start = stored_jobs.get(seen.job_id, ("", None, None))
        rows.append(Job(
            submitted_at=_earliest(first_submit, seen.submitted_at),
            first_started_at=_earliest(first_start, seen.started_at),
            admin_comment=seen.admin_comment, comment=seen.comment,
            gpus_requested=seen.gpus_requested, state_reason=seen.state_reason[:64],
            cluster=cluster, slurm_id=seen.job_id, name=seen.name, user=seen.user,
            state=seen.state, nodes=list(seen.nodes),
            gpus={node: list(indices) for node, indices in seen.gpus.items()},
            restart_count=seen.restart_count,
            step=seen.step, checkpoint_step=seen.checkpoint_step,
            resumed_from_step=seen.resumed_from_step,
            started_at=datetime.fromtimestamp(seen.started_at, tz=UTC) if seen.started_at
            else None, updated_at=now))
    # One upsert (INSERT ... ON CONFLICT DO UPDATE) per batch instead of a query per job.
    Job.objects.bulk_create(
        rows, update_conflicts=True, unique_fields=["cluster", "slurm_id"],
        update_fields=["name", "user", "state", "nodes", "gpus", "restart_count", "step",
                       "checkpoint_step", "resumed_from_step", "started_at", "submitted_at",
                       "first_started_at", "admin_comment", "comment", "gpus_requested",
                       "state_reason", "updated_at"],
        batch_size=2000)
    return drafts


def _earliest(stored: datetime | None, seen: float | None) -> datetime | None:
    """The first time kept: Slurm moves a requeued job's submit and start times forward."""
    now = datetime.fromtimestamp(seen, tz=UTC) if seen else None
    if stored is None or now is None:
        return stored or now
    return min(stored, now)


def collect_kubernetes(cluster: Cluster, clients: Clients, run: RunLog) -> list[SignalDraft]:
    """Node state and node events. A client with change feeds (the real API) is listed once
    and then watched from the last resourceVersion, so a run reads only what changed and a
    410 Gone relists; the cursors live in the source's health row."""
    health = SourceHealth.objects.get(cluster=cluster, name="kubernetes")
    cursor = dict(health.cursor)
    k8s = clients.kubernetes
    node_changes = k8s.node_changes(cursor.get("nodes"), WATCH_SECONDS)
    if node_changes is not None:
        reported, cursor["nodes"], relisted = node_changes
        run.counts["relisted"] = int(relisted)
    else:  # no change feed (the simulation): list them all
        reported = k8s.nodes()
    run.counts["nodes"] = len(reported)
    ids = _nodes_ensure(cluster, (s.name for s in reported))
    stored = {row[0]: row[1:] for row in Node.objects.filter(cluster=cluster).values_list(
        "name", "k8s_ready_status", "k8s_unschedulable", "k8s_annotations", "pool",
        "k8s_conditions", "k8s_labels", "k8s_taints")}
    drafts: list[SignalDraft] = []
    now = timezone.now()
    changed = []
    for seen in reported:
        status, unschedulable, annotations, pool, conditions, labels, taints = stored[seen.name]
        drafts += normalize.k8s_node_changes(status, unschedulable, seen)
        drafts += normalize.k8s_condition_changes(status, conditions, seen)
        new = (normalize.ready_status(seen.ready), seen.unschedulable, seen.annotations,
               seen.labels.get("fleetwatch.io/pool", pool), normalize.k8s_conditions_stored(seen),
               seen.labels, [list(t) for t in seen.taints])
        if new != (status, unschedulable, annotations, pool, conditions, labels, taints):
            changed.append((ids[seen.name], seen.ready, *new, now))
    update_columns(Node, ["k8s_ready", "k8s_ready_status", "k8s_unschedulable",
                          "k8s_annotations", "pool", "k8s_conditions", "k8s_labels",
                          "k8s_taints", "updated_at"], changed)
    run.counts["nodes_changed"] = len(changed)
    first = cursor.get("events") is None
    event_changes = k8s.event_changes(cursor.get("events"), WATCH_SECONDS)
    if event_changes is not None:  # None: the source keeps no node events (the simulation)
        events, cursor["events"] = event_changes
        if first:
            # The first list holds up to an hour of old events: only the ones recent enough
            # to matter to diagnosis are news.
            since = time.time() - settings.FLEETWATCH_DIAGNOSIS_WINDOW_MINUTES * 60
            events = [e for e in events if e.at is not None and e.at >= since]
        drafts += _k8s_event_drafts(events, run)
    _slurm_names_keep(cluster, k8s.slurm_nodes(), run)
    _client_warnings(k8s, run)
    health.cursor = cursor
    health.save(update_fields=["cursor"])
    return drafts


def _slurm_names_keep(cluster: Cluster, found: dict[str, str] | None, run: RunLog) -> None:
    """Slinky: keep each machine's Slurm name (its slurmd pod's hostname) in Node.slurm_name,
    which the Slurm client's naming layer reads. None: no slurmd pods to ask (simulation)."""
    if found is None:
        return
    by_machine = {machine: slurm for slurm, machine in found.items()}
    run.counts["slurmd_pods"] = len(found)
    rows = Node.objects.filter(cluster=cluster).values_list("id", "name", "slurm_name")
    now = timezone.now()
    changed = []
    for pk, name, slurm_name in rows:
        if name in by_machine:
            new = by_machine[name]
        elif slurm_name in found:
            new = ""  # the pod now runs on another machine
        else:
            # The pod is gone (scaled away, being replaced): the last mapping stays, so what
            # Slurm still says of that node lands on the right machine.
            new = slurm_name
        new = "" if new == name else new  # the same name needs no mapping
        if new != slurm_name:
            changed.append((pk, new, now))
    update_columns(Node, ["slurm_name", "updated_at"], changed)


# How long one collector run keeps a Kubernetes watch open for changes (whole seconds: the
# API's timeoutSeconds). Short, so the beat interval stays the pace.
WATCH_SECONDS = 1


def _k8s_event_drafts(events: list[K8sEvent], run: RunLog) -> list[SignalDraft]:
    drafts = [SignalDraft("kubernetes", "k8s_event", node=e.node, value=e.reason,
                          message=e.message, data={"event_reason": e.reason, "type": e.type},
                          observed_at=datetime.fromtimestamp(e.at, tz=UTC) if e.at else None)
              for e in events]
    run.counts["events"] = len(drafts)
    return drafts


GPU_COLUMNS = ["uuid", "last_xid", "last_xid_at", "utilization", "temperature",
               "clock_event_reasons", "dbe_total", "row_remap_failure", "health", "updated_at"]
# What change detection compares against, per GPU row.
GPU_STORED = ("node_id", "index", "id", "last_xid", "last_xid_at", "clock_event_reasons",
              "dbe_total", "row_remap_failure", "uuid", "utilization", "temperature", "health")


def collect_telemetry(cluster: Cluster, clients: Clients, run: RunLog) -> list[SignalDraft]:
    """GPU readings and faults, and NIC ports. A client with ``changes`` (Prometheus) is read
    whole once and then for what changed since the last poll, with a cursor kept in the
    source's health row: a GPU or port it does not mention is unchanged, never failed."""
    with gc_paused():
        return _collect_telemetry(cluster, clients, run)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for one unit of bulk work (a telemetry poll, a
    diagnosis run). Such work makes hundreds of thousands of short-lived objects (decoded
    answers, observations and their facts), and each collection they set off walks every
    object the worker holds: for a telemetry poll that was three times the decoding itself.
    Reference counting frees them anyway; a cycle made meanwhile waits for the next
    collection."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _collect_telemetry(cluster: Cluster, clients: Clients, run: RunLog) -> list[SignalDraft]:
    telemetry = clients.telemetry
    health = SourceHealth.objects.get(cluster=cluster, name="telemetry")
    cursor = dict(health.cursor or {})
    changes = telemetry.changes(cursor, _gpu_nodes_unquiet(cluster) if cursor else ())
    # No change feed (the simulation): every poll reads every GPU and port, complete.
    read = changes if changes is not None else \
        TelemetryChanges(telemetry.gpu_metrics(), telemetry.nic_ports())
    _client_warnings(telemetry, run)  # this client keeps both reads' warnings
    run.counts.update(gpus=len(read.gpus), nic_ports=len(read.ports),
                      incremental=int(not read.complete_gpus))
    ids = _nodes_ensure(cluster, [m.node for m in read.gpus] + [p.node for p in read.ports]
                        + list(read.present))
    drafts = _gpus(cluster, ids, read, run)
    drafts += _nics(cluster, ids, read.ports, read.complete_ports, run)
    if read.cursor != health.cursor:
        health.cursor = read.cursor
        health.save(update_fields=["cursor"])
    return drafts


def _gpu_rows(cluster: Cluster, node_ids: Collection[int] | None
              ) -> dict[tuple[int, int], tuple[Any, ...]]:
    """Stored GPU rows by (node id, index): every GPU of the cluster, or of these nodes."""
    if node_ids is None:
        rows: Iterable[tuple[Any, ...]] = Gpu.objects.filter(node__cluster=cluster).order_by() \
            .values_list(*GPU_STORED)
    elif not node_ids:
        return {}
    elif connection.vendor == "postgresql":
        # One array parameter: a few thousand ids as IN (%s, ...) cost more to send than
        # the rows they select.
        # Concrete fields, each with a column (the cast tells mypy it is no reverse relation).
        fields = [cast("Field[Any, Any]", Gpu._meta.get_field(name)) for name in GPU_STORED]
        columns = ", ".join(f'"{f.column}"' for f in fields)
        with connection.cursor() as cursor:
            cursor.execute(f'SELECT {columns} FROM "{Gpu._meta.db_table}" '
                           'WHERE "node_id" = ANY(%s)', [sorted(node_ids)])
            rows = cursor.fetchall()
    else:
        rows = Gpu.objects.filter(node_id__in=sorted(node_ids)).order_by().values_list(*GPU_STORED)
    return {(r[0], r[1]): r[2:] for r in rows}


def _gpu_nodes_unquiet(cluster: Cluster) -> set[str]:
    """Nodes with a GPU whose stored fault fields are not quiet. An incremental answer that
    leaves such a GPU out says its fields went quiet (their queries are sparse), if the GPU
    still reports: the client lists these nodes' GPUs to tell."""
    return set(Gpu.objects.filter(node__cluster=cluster).filter(
        ~Q(last_xid=0) | ~Q(clock_event_reasons=0) | Q(dbe_total__isnull=False)
        | Q(row_remap_failure=True)).order_by().values_list("node__name", flat=True).distinct())


def _gpus(cluster: Cluster, ids: dict[str, int], read: TelemetryChanges,
          run: RunLog) -> list[SignalDraft]:
    complete = read.complete_gpus
    answer = {(ids[m.node], m.gpu): m for m in read.gpus}
    # Every GPU of every node the answer touches (a node's health is all of its GPUs'), and
    # of the nodes listed because their GPUs may have gone quiet or silent.
    node_ids = None if complete else {n for n, _ in answer} | {ids[n] for n in read.present}
    stored = _gpu_rows(cluster, node_ids)
    created = set(answer) - set(stored)
    # A GPU seen for the first time is judged against a new row's defaults and inserted
    # with its values below (pk None): inserting defaults and then updating every row
    # doubled the first poll's writes.
    template = Gpu()
    blank = (None, *(getattr(template, name) for name in GPU_STORED[3:]))
    for key in sorted(created):
        stored[key] = blank
    names = {v: k for k, v in ids.items()}
    answered_nodes = {m.node for m in read.gpus}
    now = timezone.now()
    drafts: list[SignalDraft] = []
    rows = []  # (pk, *GPU_COLUMNS) of the rows where more than the readings moved
    readings = []  # (pk, utilization, temperature, updated_at) of the rows where only they did
    new_rows = []  # (node_id, index, *GPU_COLUMNS) of the GPUs seen for the first time
    # ... and of those with quiet fault fields (nearly all): only what differs between them,
    # the rest comes from the template (COPY's cost goes with the values sent).
    new_quiet = []  # (node_id, index, uuid, utilization, temperature, health)
    samples: list[tuple[Any, ...]] = []  # (node_id, gpu_index, at, utilization, temperature)
    touched: set[int] = set()  # nodes with a GPU read or judged this poll
    failing: set[int] = set()  # nodes with a failed GPU, read or as stored
    keep_samples = sources_of(cluster.name).store_gpu_samples
    unsampled_u, unsampled_t = read.unsampled_utilization, read.unsampled_temperature
    failed_health = Node.Health.FAILED
    for key, (pk, last_xid, last_xid_at, clocks, dbe, remap, uuid, util, temp,
              stored_health) in stored.items():
        node_id = key[0]
        m = answer.get(key)
        if m is None:
            m = _gpu_unreported(names[node_id], key[1], stored[key], read, answered_nodes)
            if m is None:  # nothing new about it: as stored
                if stored_health == failed_health:
                    failing.add(node_id)
                continue
            m_uuid, m_util, m_temp = m.uuid, m.utilization, m.temperature
            silent = m_util is None and m_temp is None
            # No new readings; gone silent, its fault fields are as stored (no news there).
            sampled, faults = False, not silent
        else:
            # The GPU as stored where the answer has nothing newer, held in locals: a
            # dataclasses.replace() per GPU costs a second at 100,000 GPUs.
            gpu_key = (m.node, m.gpu)
            fill_u, fill_t = gpu_key in unsampled_u, gpu_key in unsampled_t
            m_uuid, m_util, m_temp = m.uuid or uuid, m.utilization, m.temperature
            if m.node in read.present and m.gpu not in read.present[m.node]:
                # Its series ended after the readings it sent (they are read a little in the
                # past, the node's GPUs are listed now): silent.
                fill_u = fill_t = False
                m_util = m_temp = None
            # A reading with no new sample since the last poll is what was stored.
            if fill_u:
                m_util = util
            if fill_t:
                m_temp = temp
            sampled, faults = not (fill_u and fill_t), True
            silent = m_util is None and m_temp is None
            if not sampled and key in created:
                silent = False  # never read yet: unknown, not silent (read at its next scrape)
        if faults and (m.last_xid != last_xid
                       or (m.clock_event_reasons | clocks) & dcgm.THERMAL_BITS
                       or m.dbe_total != dbe or bool(m.row_remap_failure) != remap):
            seen = replace(m, uuid=m_uuid, utilization=m_util, temperature=m_temp)
            drafts += normalize.gpu_changes(normalize.GpuSeen(last_xid, clocks, dbe, remap),
                                            seen)
        # A GPU with no readings at all has gone (off the bus); one missing field is a site
        # that does not collect it, never a failure.
        failed = takes_gpu_out(m.last_xid) or bool(m.row_remap_failure) or silent
        touched.add(node_id)
        if failed:
            failing.add(node_id)
        health = failed_health if failed else Node.Health.HEALTHY
        # A row is written only when something in it moved: most GPUs' readings are as
        # they were at the last poll. Where only the readings moved (the usual change), only
        # they are written: the write's cost goes with the values sent.
        if pk is None:
            if (m.last_xid, m.clock_event_reasons, m.dbe_total, m.row_remap_failure) \
                    == (0, 0, None, 0):
                new_quiet.append((node_id, key[1], m_uuid, m_util, m_temp, health))
            else:
                new_rows.append((node_id, key[1], m_uuid, m.last_xid,
                                 now if m.last_xid != last_xid else last_xid_at, m_util,
                                 m_temp, m.clock_event_reasons, m.dbe_total,
                                 bool(m.row_remap_failure), health, now))
        elif (m.last_xid != last_xid or m.clock_event_reasons != clocks or m.dbe_total != dbe
                or bool(m.row_remap_failure) != remap or m_uuid != uuid
                or health != stored_health):
            rows.append((pk, m_uuid, m.last_xid,
                         now if m.last_xid != last_xid else last_xid_at, m_util,
                         m_temp, m.clock_event_reasons, m.dbe_total,
                         bool(m.row_remap_failure), health, now))
        elif m_util != util or m_temp != temp:
            readings.append((pk, m_util, m_temp, now))
        if keep_samples and sampled:
            samples.append((node_id, m.gpu, now, m_util, m_temp))
    drafts += _remapped_rows_drafts(cluster, answer, created, names, run)
    insert_missing(Gpu(updated_at=now), ["node_id", "index", "uuid", "utilization",
                                         "temperature", "health"], new_quiet)
    insert_missing(template, ["node_id", "index", *GPU_COLUMNS], new_rows)
    update_columns(Gpu, GPU_COLUMNS, rows)
    update_columns(Gpu, ["utilization", "temperature", "updated_at"], readings)
    run.counts["gpus_changed"] = len(rows) + len(readings)
    run.counts["gpus_created"] = len(new_rows) + len(new_quiet)
    append_rows(GpuSample, ["node_id", "gpu_index", "at", "utilization", "temperature"],
                samples)
    # A node's health is its GPUs': only the nodes this poll judged, only where it moved.
    nodes = Node.objects.filter(cluster=cluster)
    if not complete and len(touched) < 2000:
        nodes = nodes.filter(id__in=sorted(touched))
    moved = []
    for node_id, was in nodes.order_by().values_list("id", "health"):
        health = failed_health if node_id in failing else Node.Health.HEALTHY
        if node_id in touched and was != health:
            moved.append((node_id, health))
    update_columns(Node, ["health"], moved)
    return drafts


# The telemetry run count of GPUs with rows remapped for uncorrectable errors; its presence
# on an earlier run says FleetWatch read the field before.
REMAPPED_ROWS_COUNT = "remapped_rows"


def _remapped_rows_drafts(cluster: Cluster, answer: dict[tuple[int, int], GpuMetric],
                          created: set[tuple[int, int]], names: dict[int, str],
                          run: RunLog) -> list[SignalDraft]:
    """Signals for the GPUs whose count of rows remapped for uncorrectable errors rose.

    The client reads only the GPUs with a count above 0 (most have none), so this looks at a
    handful. The count last recorded is the value of the GPU's latest signal for the field
    (the Gpu table has no column for it). A GPU with none was at 0 (its series was left out
    as quiet) if FleetWatch already knew it and an earlier run read the field (its run
    counts say ``remapped_rows``); otherwise this is its first reading, a baseline: a GPU
    new this poll, or every GPU on the first poll after an upgrade to a FleetWatch that reads
    the field, whose rows may have been remapped long ago."""
    counted = {key: m for key, m in answer.items() if m.uncorrectable_remapped_rows is not None}
    run.counts[REMAPPED_ROWS_COUNT] = len(counted)
    if not counted:
        return []
    last: dict[tuple[str, int], float] = {}
    recorded = Signal.objects.filter(
        cluster=cluster, kind="dcgm_field", data__metric=dcgm.UNCORRECTABLE_REMAPPED_ROWS,
        node_name__in=sorted({names[n] for n, _ in counted})
    ).order_by("-observed_at", "-id").values_list("node_name", "gpu_index", "data")
    for node_name, gpu_index, data in recorded.iterator():
        value = data.get("value") if isinstance(data, dict) else None
        if (gpu_index is not None and isinstance(value, int | float)
                and not isinstance(value, bool)):
            last.setdefault((node_name, gpu_index), float(value))
    read_before: bool | None = None  # asked only when a GPU has no recorded count
    drafts = []
    for key, m in counted.items():
        previous = last.get((m.node, m.gpu))
        if previous is None and key not in created:
            if read_before is None:
                read_before = CollectorRun.objects.filter(
                    cluster=cluster, source="telemetry",
                    counts__has_key=REMAPPED_ROWS_COUNT).exists()
            previous = 0.0 if read_before else None
        draft = normalize.remapped_rows_change(previous, m)
        if draft is not None:
            drafts.append(draft)
    return drafts


def _gpu_unreported(node: str, index: int, row: tuple[Any, ...], read: TelemetryChanges,
                    answered_nodes: set[str]) -> GpuMetric | None:
    """What to make of a stored GPU the answer leaves out: None when that means nothing
    changed; a GPU without readings when it went silent while its node's others still
    report; its quiet fault fields when they went quiet (an incremental answer's sparse
    queries leave such a GPU out)."""
    _, last_xid, _, clocks, dbe, remap, uuid, util, temp, _ = row
    reporting = util is not None or temp is not None
    if read.complete_gpus:
        # Every GPU with a series is in the answer: one missing from a node that answers
        # has gone silent. A node with none at all is not read as failed.
        if node not in answered_nodes or not reporting:
            return None
        present = False
    elif node in read.present:
        present = index in read.present[node]
    else:
        return None  # not listed: as before (or nothing known of the node)
    if not present:
        if not reporting:
            return None  # silent already
        return GpuMetric(node, index, uuid, None, None, last_xid,
                         clock_event_reasons=clocks, dbe_total=dbe, row_remap_failure=int(remap))
    if last_xid == 0 and clocks == 0 and dbe is None and not remap:
        return None
    return GpuMetric(node, index, uuid, util, temp, 0)


def _nics(cluster: Cluster, ids: dict[str, int], ports: list[NicPort], complete: bool,
          run: RunLog) -> list[SignalDraft]:
    """Port readings and each node's NIC summary. ``complete``: every port is in ``ports``;
    otherwise only those that changed lately, and a node's other ports are as stored."""
    by_node: dict[str, list[NicPort]] = {}
    for port in ports:
        by_node.setdefault(port.node, []).append(port)
    nodes = Node.objects.filter(cluster=cluster)
    if not complete and len(by_node) < 2000:
        nodes = nodes.filter(name__in=sorted(by_node))
    stored = {r[0]: r[1:] for r in nodes.order_by().values_list(
        "name", "nic_ports", "nic_state", "nic_link_downed")}
    drafts: list[SignalDraft] = []
    changed = []
    for name, node_ports in by_node.items():
        before, state, downed = stored[name]
        readings = dict(before)
        for port in node_ports:
            key = f"{port.device}/{port.port}"
            drafts += normalize.nic_changes(readings.get(key), port)
            readings[key] = normalize.nic_reading(port)
        if complete:
            worst = next((p.state for p in node_ports if p.state != "ACTIVE"), "ACTIVE")
            total = sum(p.link_downed for p in node_ports)
        else:
            # Some of the node's ports were read; the others' last readings stand.
            current = [readings[k] for k in sorted(readings)]
            worst = next((str(r.get("state")) for r in current if r.get("state") != "ACTIVE"),
                         "ACTIVE")
            total = sum(int(r.get("link_downed") or 0) for r in current)
        if (readings, worst, total) != (before, state, downed):
            changed.append((ids[name], readings, worst, total))
    update_columns(Node, ["nic_ports", "nic_state", "nic_link_downed"], changed)
    run.counts["nic_nodes_changed"] = len(changed)
    return drafts


COLLECTORS: dict[str, Callable[[Cluster, Clients, RunLog], list[SignalDraft]]] = {
    "slurm": collect_slurm,
    "kubernetes": collect_kubernetes,
    "telemetry": collect_telemetry,
}


def telemetry_prune() -> int:
    cutoff = timezone.now() - timedelta(hours=settings.FLEETWATCH_TELEMETRY_RETENTION_HOURS)
    deleted, _ = GpuSample.objects.filter(at__lt=cutoff).delete()
    CollectorRun.objects.filter(started_at__lt=cutoff).delete()
    # Idempotency keys outlive any agent's retries of a batch, then go.
    PushReceipt.objects.filter(created_at__lt=timezone.now() - timedelta(
        hours=settings.FLEETWATCH_INGEST_IDEMPOTENCY_HOURS)).delete()
    return deleted
