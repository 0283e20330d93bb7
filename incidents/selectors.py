"""Reads: turn rows into the plain data diagnosis and pages use."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from collectors.clients import get_telemetry
from collectors.clients.base import ClientError
from collectors.models import Cluster, Gpu, GpuSample, Job, Node, Signal
from incidents.diagnosis import JobInfo, Observation
from incidents.models import AuditEntry, Incident, Remediation, Step


def observation_from_signal(s: Signal) -> Observation:
    """A stored signal in the replay format's terms: the engine reads both the same way."""
    record: dict[str, Any] = {**(s.data if isinstance(s.data, dict) else {}),
                              "source": s.source, "node": s.node_name, "gpu": s.gpu_index,
                              "job": s.job_id, "message": s.message}
    if s.kind == "xid":
        record.setdefault("metric", "DCGM_FI_DEV_XID_ERRORS")
        record.setdefault("value", s.code)
    return Observation.from_record(record, s.observed_at, id=s.pk)


# Signal.data keys that are bookkeeping, not what the source said.
_EXPORT_SKIP = {"previous", "uuid", "annotations", "restart_count"}


def signal_as_replay(s: Signal) -> dict[str, Any]:
    """A stored signal as a replay file's ``signals`` entry (shared/REPLAY.md)."""
    out: dict[str, Any] = {"at": s.observed_at.astimezone(UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z"), "source": s.source}
    if s.node_name:
        out["node"] = s.node_name
    if s.gpu_index is not None:
        out["gpu"] = s.gpu_index
    if s.job_id:
        out["job"] = s.job_id
    data = s.data if isinstance(s.data, dict) else {}
    out.update({k: v for k, v in data.items() if k not in _EXPORT_SKIP})
    if s.kind == "xid":
        out.setdefault("metric", "DCGM_FI_DEV_XID_ERRORS")
        out.setdefault("value", s.code)
    if s.source in ("kernel", "job_log", "kubernetes") and s.message:
        out["message"] = s.message
    return out


def incident_replay(incident: Incident) -> dict[str, Any]:
    """The incident's window as a replay file, so a postmortem can rerun it after a rule
    changes: ``manage.py fleetwatch diagnose --check`` compares with today's verdict."""
    window = timedelta(minutes=settings.FLEETWATCH_DIAGNOSIS_WINDOW_MINUTES)
    start = incident.detected_at - window
    end = (incident.resolved_at or timezone.now()) + timedelta(minutes=1)
    rows = Signal.objects.filter(cluster=incident.cluster, observed_at__range=(start, end))
    expect: dict[str, Any] = {"root_cause": incident.root_cause, "nodes": list(incident.nodes)}
    if incident.switch:
        expect["switch"] = incident.switch
    if incident.root_cause == "application_error":
        expect.update(nodes=[], job=(incident.jobs or [""])[0])
    return {
        "format": "fleetwatch-replay/1",
        "name": f"incident-{incident.pk}-{incident.root_cause}",
        "description": f"Exported from FleetWatch incident #{incident.pk} "
                       f"({incident.get_root_cause_display()}, detected "
                       f"{incident.detected_at:%Y-%m-%d %H:%M:%S} UTC): {incident.explanation}",
        "topology": topology(incident.cluster),
        "jobs": [{"id": j.id, "user": j.user, "nodes": list(j.nodes)}
                 for j in jobs_info(incident.cluster)],
        "signals": [signal_as_replay(s) for s in rows.order_by("observed_at", "id")],
        "expect": [expect],
    }


def observations_between(cluster: Cluster, start: datetime, end: datetime) -> list[Observation]:
    rows = Signal.objects.filter(cluster=cluster, observed_at__gte=start, observed_at__lte=end)
    return [observation_from_signal(s) for s in rows.order_by("observed_at", "id")]


def topology(cluster: Cluster) -> dict[str, list[str]]:
    leaves: dict[str, list[str]] = {}
    for name, leaf in Node.objects.filter(cluster=cluster).exclude(leaf_switch="").values_list(
        "name", "leaf_switch"
    ):
        leaves.setdefault(leaf, []).append(name)
    return leaves


def jobs_info(cluster: Cluster) -> list[JobInfo]:
    return [JobInfo(j.slurm_id, j.user, tuple(j.nodes))
            for j in Job.objects.filter(cluster=cluster).exclude(nodes=[])]


def incidents_open() -> QuerySet[Incident]:
    return Incident.objects.exclude(status=Incident.Status.RESOLVED).order_by("-opened_at")


def remediation_current(incident: Incident) -> Remediation | None:
    return incident.remediations.prefetch_related("steps").order_by("-created_at").first()


def replacement_nodes(incident: Incident) -> set[str]:
    """The spares brought in for an incident (recorded by the replace_node step)."""
    return {
        step.result["new_node"]
        for rem in incident.remediations.prefetch_related("steps")
        for step in rem.steps.all()
        if isinstance(step.result, dict) and step.result.get("new_node")
    }


def incident_timeline(incident: Incident) -> list[dict[str, Any]]:
    """Everything that happened around an incident, in one time-ordered list."""
    start = incident.detected_at - timedelta(minutes=2)
    end = (incident.resolved_at or timezone.now()) + timedelta(minutes=1)
    items: list[dict[str, Any]] = [
        {"at": step.started_at, "type": "step", "step": step,
         "title": f"Step {step.order}: {step.title}"}
        for step in Step.objects.filter(remediation__incident=incident, started_at__isnull=False)
    ]
    signals = Signal.objects.filter(cluster=incident.cluster, observed_at__range=(start, end))
    watched = set(incident.nodes) | replacement_nodes(incident)
    for s in signals.order_by("observed_at"):
        if s.node_name in watched or (s.job_id and s.job_id in incident.jobs) or (
            s.source == "collector"
        ):
            items.append({"at": s.observed_at, "type": "signal", "signal": s,
                          "title": f"{s.get_source_display()}: {s.message}"})
    items.append({"at": incident.opened_at, "type": "diagnosis",
                  "title": f"Diagnosis: {incident.get_root_cause_display()} "
                           f"({incident.confidence:.0%})", "text": incident.explanation})
    for entry in AuditEntry.objects.filter(incident=incident).select_related("step"):
        items.append({"at": entry.at, "type": "audit", "entry": entry,
                      "title": f"{entry.actor} {entry.verb} {entry.target}"})
    items.sort(key=lambda i: (i["at"], {"signal": 0, "diagnosis": 1, "step": 2,
                                        "audit": 3}[i["type"]]))
    return items


def incident_chart(incident: Incident) -> dict[str, Any]:
    """Mean GPU utilisation per node around the incident, for the failed and replacement
    nodes and the other nodes of the affected jobs: from the stored samples (the simulated
    fleet), or from Prometheus range queries when FleetWatch reads a real one."""
    start = incident.detected_at - timedelta(minutes=3)
    end = (incident.resolved_at or timezone.now()) + timedelta(minutes=2)
    names = set(incident.nodes) | replacement_nodes(incident)
    for job in Job.objects.filter(cluster=incident.cluster, slurm_id__in=incident.jobs):
        names.update(job.nodes)
    chart: dict[str, Any] = {"fault_at": incident.detected_at.isoformat(), "resolved_at":
                             incident.resolved_at.isoformat() if incident.resolved_at else None}
    if settings.FLEETWATCH_STORE_GPU_SAMPLES:
        rows = (GpuSample.objects.filter(node__name__in=names, node__cluster=incident.cluster,
                                         at__range=(start, end))
                .values_list("node__name", "at", "utilization"))
        points = [(name, at, util) for name, at, util in rows]
    else:
        try:
            points = _history_points(sorted(names), start, min(end, timezone.now()))
        except ClientError as exc:
            # The page still shows everything else; the chart says why it is empty.
            return {**chart, "series": {}, "error": f"telemetry unavailable: {exc}"}
    buckets: dict[tuple[str, datetime], list[float]] = {}
    for name, at, util in points:
        buckets.setdefault((name, at), []).append(util if util is not None else 0.0)
    series: dict[str, dict[str, list[Any]]] = {}
    for (name, at), values in sorted(buckets.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s = series.setdefault(name, {"x": [], "y": []})
        s["x"].append(at.isoformat())
        s["y"].append(round(sum(values) / len(values), 1))
    return {**chart, "series": series}


def _history_points(names: list[str], start: datetime,
                    end: datetime) -> list[tuple[str, datetime, float | None]]:
    telemetry = get_telemetry()
    history = getattr(telemetry, "gpu_history", None)
    if history is None or end <= start:
        return []
    out = []
    for node, gpus in history(names, start, end, 15.0).items():
        for points in gpus.values():
            out += [(node, datetime.fromtimestamp(p.at, tz=UTC), p.utilization) for p in points]
    return out


def fleet_counts() -> dict[str, int]:
    nodes = list(Node.objects.filter(in_service=True))
    return {
        "nodes": len(nodes),
        "healthy": sum(n.health == Node.Health.HEALTHY for n in nodes),
        "failed": sum(n.health == Node.Health.FAILED for n in nodes),
        "drained": sum(n.drained for n in nodes),
        "cordoned": sum(n.k8s_unschedulable for n in nodes),
        "gpus_failed": Gpu.objects.filter(node__in_service=True,
                                          health=Node.Health.FAILED).count(),
    }


def gpu_grid() -> dict[str, Any]:
    """Node-by-GPU health for the dashboard heatmap: z 0 healthy, 1 unknown, 2 failed."""
    code = {Node.Health.HEALTHY: 0, Node.Health.UNKNOWN: 1, Node.Health.DEGRADED: 1,
            Node.Health.FAILED: 2}
    nodes = list(Node.objects.filter(in_service=True).prefetch_related("gpus")
                 .order_by("leaf_switch", "name"))
    width = max((len(n.gpus.all()) for n in nodes), default=8)
    z, text, labels = [], [], []
    for node in nodes:
        gpus = {g.index: g for g in node.gpus.all()}
        row, hover = [], []
        for i in range(width):
            g = gpus.get(i)
            row.append(code.get(g.health, 1) if g else 1)
            hover.append(
                f"{node.name} GPU {i}<br>util {g.utilization if g.utilization is not None else '-'}%"
                f"<br>temp {g.temperature if g.temperature is not None else '-'} C"
                f"<br>last XID {g.last_xid or 'none'}" if g else f"{node.name} GPU {i}: no data")
        z.append(row)
        text.append(hover)
        labels.append(f"{node.name} ({node.leaf_switch or '?'})")
    return {"z": z, "text": text, "y": labels, "x": [f"GPU {i}" for i in range(width)]}
