"""Collector services: read a source, update the current state, store signals, announce them.

Collectors never import ``incidents``. They announce new signals by sending the diagnosis task
by name once their transaction has committed; whoever listens decides what the signals mean.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from collectors import normalize
from collectors.clients import Clients, get_clients
from collectors.clients.base import ClientError
from collectors.models import Cluster, Gpu, GpuSample, Job, Node, Signal, SourceHealth
from collectors.normalize import SignalDraft

log = logging.getLogger(__name__)

DIAGNOSE_TASK = "incidents.tasks.diagnose_signals"
FAILING_XIDS_FOR_HEALTH = frozenset({48, 62, 63, 64, 74, 79, 94, 95, 119, 120, 140, 143})


@dataclass(frozen=True)
class CollectResult:
    source: str
    healthy: bool
    signal_ids: list[int]
    error: str = ""


def cluster_default() -> Cluster:
    cluster, _ = Cluster.objects.get_or_create(
        name=settings.FLEETWATCH_CLUSTER, defaults={"description": "the simulated fleet"}
    )
    return cluster


def collect_source(source: str, *, clients: Clients | None = None) -> CollectResult:
    """Run one collector. A source that cannot be read marks itself unhealthy and changes no
    node: a missing source is never read as a failed node."""
    collector = COLLECTORS.get(source)
    if collector is None:
        raise ValueError(f"unknown source {source!r}; known: {', '.join(COLLECTORS)}")
    clients = clients or get_clients()
    cluster = cluster_default()
    started = time.monotonic()
    try:
        with transaction.atomic():
            # Lock this source's health row first: two runs of one collector (a slow scrape
            # overlapping the next beat) take turns, so a change is announced once.
            SourceHealth.objects.select_for_update().get_or_create(cluster=cluster, name=source)
            drafts = collector(cluster, clients)
            ids = signals_store(cluster, drafts)
            health_changes = source_health_record(cluster, source, None, started)
            ids += signals_store(cluster, health_changes)
            signals_announce(ids)
        return CollectResult(source, True, ids)
    except ClientError as exc:
        log.warning("collector %s failed: %s", source, exc)
        with transaction.atomic():
            health_changes = source_health_record(cluster, source, str(exc), started)
            ids = signals_store(cluster, health_changes)
            signals_announce(ids)
        return CollectResult(source, False, ids, str(exc))


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
    cluster: Cluster, drafts: Iterable[SignalDraft], *, observed_at: datetime | None = None
) -> list[int]:
    drafts = list(drafts)
    if not drafts:
        return []
    now = timezone.now()
    nodes = {n.name: n for n in Node.objects.filter(
        cluster=cluster, name__in={d.node for d in drafts if d.node})}
    rows = [
        Signal(cluster=cluster, source=d.source, kind=d.kind, node=nodes.get(d.node),
               node_name=d.node, gpu_index=d.gpu, job_id=d.job, code=d.code, value=d.value,
               message=d.message, data=d.data, observed_at=observed_at or now, ingested_at=now)
        for d in drafts
    ]
    # PostgreSQL and SQLite >= 3.35 return the new primary keys from bulk_create.
    return [s.pk for s in Signal.objects.bulk_create(rows)]


def signals_announce(signal_ids: list[int]) -> None:
    if not signal_ids:
        return
    ids = list(signal_ids)
    transaction.on_commit(lambda: current_app.send_task(DIAGNOSE_TASK, args=[ids]))


def _nodes_ensure(cluster: Cluster, names: Iterable[str]) -> dict[str, Node]:
    """All of the cluster's nodes by name, creating the ones a source reports for the first
    time. Collectors for different sources run at once and may meet new nodes together:
    inserting in name order makes them queue behind each other instead of deadlocking."""
    Node.objects.bulk_create([Node(cluster=cluster, name=n) for n in sorted(set(names))],
                             ignore_conflicts=True)
    return {n.name: n for n in Node.objects.filter(cluster=cluster)}


def collect_slurm(cluster: Cluster, clients: Clients) -> list[SignalDraft]:
    topology = clients.slurm.topology()
    reported = clients.slurm.nodes()
    jobs = clients.slurm.jobs()
    leaf_of = {node: leaf for leaf, members in topology.items() for node in members}
    nodes = _nodes_ensure(cluster, (s.name for s in reported))
    drafts: list[SignalDraft] = []
    now = timezone.now()
    for seen in reported:
        node = nodes[seen.name]
        previous = (normalize.SlurmNodeSeen(node.slurm_state, tuple(node.slurm_flags),
                                            node.slurm_reason)
                    if node.slurm_state else None)
        drafts += normalize.slurm_node_changes(previous, seen)
        node.slurm_state, node.slurm_flags, node.slurm_reason = (
            seen.state, list(seen.flags), seen.reason)
        node.leaf_switch = leaf_of.get(seen.name, node.leaf_switch)
        node.in_service = True
        node.updated_at = now
        # Only the fields this source owns: the other collectors write theirs concurrently.
        node.save(update_fields=["slurm_state", "slurm_flags", "slurm_reason", "leaf_switch",
                                 "in_service", "updated_at"])
    in_slurm = {s.name for s in reported}
    Node.objects.filter(cluster=cluster, in_service=True).exclude(name__in=in_slurm).update(
        in_service=False, updated_at=now)

    known = {j.slurm_id: j for j in Job.objects.filter(cluster=cluster)}
    for seen in jobs:
        job = known.get(seen.job_id)
        drafts += normalize.slurm_job_changes(job.state if job else None, seen)
        if job is None:
            job = Job(cluster=cluster, slurm_id=seen.job_id)
        job.name, job.user, job.state = seen.name, seen.user, seen.state
        job.nodes = list(seen.nodes) or job.nodes
        job.restart_count = seen.restart_count
        job.step, job.checkpoint_step = seen.step, seen.checkpoint_step
        job.resumed_from_step = seen.resumed_from_step
        job.started_at = (datetime.fromtimestamp(seen.started_at, tz=UTC)
                          if seen.started_at else None)
        job.updated_at = now
        job.save()
    return drafts


def collect_kubernetes(cluster: Cluster, clients: Clients) -> list[SignalDraft]:
    reported = clients.kubernetes.nodes()
    nodes = _nodes_ensure(cluster, (s.name for s in reported))
    drafts: list[SignalDraft] = []
    now = timezone.now()
    for seen in reported:
        node = nodes[seen.name]
        drafts += normalize.k8s_node_changes(node.k8s_ready, node.k8s_unschedulable, seen)
        node.k8s_ready, node.k8s_unschedulable = seen.ready, seen.unschedulable
        node.k8s_annotations = seen.annotations
        node.pool = seen.labels.get("fleetwatch.io/pool", node.pool)
        node.updated_at = now
        node.save(update_fields=["k8s_ready", "k8s_unschedulable", "k8s_annotations", "pool",
                                 "updated_at"])
    return drafts


def collect_telemetry(cluster: Cluster, clients: Clients) -> list[SignalDraft]:
    metrics = clients.telemetry.gpu_metrics()
    ports = clients.telemetry.nic_ports()
    nodes = _nodes_ensure(cluster, [m.node for m in metrics] + [p.node for p in ports])
    Gpu.objects.bulk_create(
        [Gpu(node=nodes[m.node], index=m.gpu) for m in metrics], ignore_conflicts=True)
    gpus = {(g.node_id, g.index): g for g in Gpu.objects.filter(node__cluster=cluster)}
    previous_xid = {key: g.last_xid for key, g in gpus.items()}
    now = timezone.now()
    drafts: list[SignalDraft] = []
    samples = []
    failing: dict[str, bool] = {}
    for m in metrics:
        node = nodes[m.node]
        gpu = gpus[(node.id, m.gpu)]
        drafts += normalize.xid_changes(previous_xid[(node.id, m.gpu)], m)
        if m.last_xid != gpu.last_xid:
            gpu.last_xid_at = now
        gpu.uuid, gpu.last_xid = m.uuid, m.last_xid
        gpu.utilization, gpu.temperature = m.utilization, m.temperature
        failed = m.last_xid in FAILING_XIDS_FOR_HEALTH or m.utilization is None
        gpu.health = Node.Health.FAILED if failed else Node.Health.HEALTHY
        gpu.updated_at = now
        failing[m.node] = failing.get(m.node, False) or failed
        samples.append(GpuSample(node=node, gpu_index=m.gpu, at=now,
                                 utilization=m.utilization, temperature=m.temperature))
    Gpu.objects.bulk_update(
        list(gpus.values()),
        ["uuid", "last_xid", "last_xid_at", "utilization", "temperature", "health",
         "updated_at"],
    )
    GpuSample.objects.bulk_create(samples)
    for name, bad in failing.items():
        Node.objects.filter(pk=nodes[name].pk).update(
            health=Node.Health.FAILED if bad else Node.Health.HEALTHY)

    for port in ports:
        node = nodes[port.node]
        previous = ((node.nic_state, node.nic_link_downed)
                    if node.nic_link_downed is not None else None)
        drafts += normalize.nic_changes(previous, port)
        Node.objects.filter(pk=node.pk).update(nic_state=port.state,
                                               nic_link_downed=port.link_downed)
    return drafts


COLLECTORS: dict[str, Callable[[Cluster, Clients], list[SignalDraft]]] = {
    "slurm": collect_slurm,
    "kubernetes": collect_kubernetes,
    "telemetry": collect_telemetry,
}


def telemetry_prune() -> int:
    cutoff = timezone.now() - timedelta(hours=settings.FLEETWATCH_TELEMETRY_RETENTION_HOURS)
    deleted, _ = GpuSample.objects.filter(at__lt=cutoff).delete()
    return deleted
