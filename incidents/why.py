"""Why did my job die? One answer, read from FleetWatch's records, for the job's page, the
``why`` command and ``GET /api/v1/jobs/ID/why/`` alike (each only renders it).

The answer's first line says what stopped the job, when, on which node and GPU, what
FleetWatch did and where the job resumed; whether the job itself was at fault (an application
error) is said plainly with the evidence. The same one-line fault text is what the remediation
writes into the job's Slurm comment (``fault_summary``), so Slurm and FleetWatch tell one story.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

from django.urls import reverse
from django.utils import timezone

from collectors import selectors as fleet
from collectors.clients.base import ClientError
from collectors.clients.notify import absolute_url
from collectors.knowledge.causes import RootCause
from collectors.knowledge.xid import xid_info
from collectors.models import Job, Signal
from collectors.selectors import json_list_has
from incidents.models import Evidence, Incident, Remediation, Step
from incidents.templatetags.fleetwatch_ui import duration_text

ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


@dataclass(frozen=True)
class Fault:
    text: str  # "XID 79 (GPU has fallen off the bus) on gpu-003 GPU 5"
    node: str
    gpu: int | None
    at: datetime | None
    signal: Signal | None


def _cause_signals(incident: Incident) -> list[Signal]:
    ids = (Evidence.objects.filter(incident=incident).order_by("signal__observed_at", "signal_id")
           .values_list("signal_id", "role"))
    causes = [pk for pk, role in ids if role == "cause"] or [pk for pk, _ in ids]
    rows = {s.pk: s for s in Signal.objects.filter(pk__in=causes)}
    return [rows[pk] for pk in causes if pk in rows]


def fault_summary(incident: Incident, job: Job | None = None) -> Fault:
    """What broke, in one line: the first cause signal (the job's own node first)."""
    signals = _cause_signals(incident)
    if job is not None:
        mine = [s for s in signals if s.node_name in (job.nodes or []) or s.job_id == job.slurm_id]
        signals = mine or signals
    first = signals[0] if signals else None
    label = RootCause(incident.root_cause).label
    node = (first.node_name if first else "") or (incident.nodes[0] if incident.nodes else "")
    gpu = first.gpu_index if first else None
    if first is not None and first.kind == "xid" and first.code is not None:
        info = xid_info(first.code)
        what = f"XID {first.code}" + (f" ({info.meaning})" if info else "")
    elif incident.root_cause == RootCause.SWITCH_FAILURE and incident.switch:
        what = f"{label} ({incident.switch})"
    else:
        what = label
    where = f" on {node}" if node else ""
    where += f" GPU {gpu}" if gpu is not None else ""
    return Fault(what + where, node, gpu, first.observed_at if first else incident.detected_at,
                 first)


def job_link(cluster: str, job_id: str) -> str:
    """The job's page, absolute when FLEETWATCH_BASE_URL is set; "" when it is not (a bare
    path in a Slurm comment or an e-mail would lead nowhere)."""
    url = absolute_url(reverse("job-detail", args=[job_id]) + f"?cluster={quote(cluster)}")
    return url if url.startswith("http") else ""


@dataclass
class Why:
    job: str
    cluster: str
    user: str
    state: str
    headline: str
    stopped_by: str  # fault, application, nothing, unknown
    job_at_fault: bool
    fault: str = ""
    root_cause: str = ""
    at: datetime | None = None
    node: str = ""
    gpu: int | None = None
    incident: int | None = None
    incident_url: str = ""
    action: str = ""
    requeued_at: datetime | None = None
    resumed_from_step: int | None = None
    steps_lost: int | None = None
    downtime_seconds: float | None = None
    evidence: list[str] = field(default_factory=list)
    restarts: int = 0
    submitted_at: datetime | None = None
    first_started_at: datetime | None = None
    started_at: datetime | None = None
    slurm_comment: str = ""
    link: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat()
        return out


def _when(at: datetime | None) -> str:
    return f"{at:%Y-%m-%d %H:%M:%S} UTC" if at else "at an unknown time"


def _steps_for(remediation: Remediation | None) -> dict[str, Step]:
    return {s.kind: s for s in remediation.steps.all()} if remediation else {}


def _action(job: Job, incident: Incident, remediation: Remediation | None
            ) -> tuple[str, datetime | None, int | None]:
    """What FleetWatch did to the job: (words, when it requeued it, the step it reached)."""
    if remediation is None:
        return "FleetWatch took no action on it", None, None
    steps = _steps_for(remediation)
    steps_at_stop: int | None = None
    for step in steps.values():
        stopped = (step.result or {}).get("steps_at_stop", {})
        if job.slurm_id in stopped and stopped[job.slurm_id] is not None:
            steps_at_stop = int(stopped[job.slurm_id])
        if job.slurm_id in (step.result or {}).get("requeued", []):
            return ("FleetWatch stopped it and requeued it", step.finished_at or step.started_at,
                    steps_at_stop)
    for step in steps.values():
        if job.slurm_id in (step.result or {}).get("signalled", []):
            return "FleetWatch stopped it; the requeue has not happened yet", None, steps_at_stop
    if remediation.status == Remediation.Status.AWAITING_APPROVAL:
        return "FleetWatch's repair waits for a person's approval", None, None
    if remediation.status == Remediation.Status.OBSERVED:
        return "FleetWatch only observed (observe mode): it did not touch the job", None, None
    return f"FleetWatch's repair is {remediation.get_status_display()}", None, None


def job_why(job: Job) -> Why:
    """The answer for ``job`` (see the module docstring)."""
    base: dict[str, Any] = {"job": job.slurm_id, "cluster": job.cluster.name, "user": job.user,
            "state": job.state, "restarts": job.restart_count,
            "submitted_at": job.submitted_at, "first_started_at": job.first_started_at,
            "started_at": job.started_at,
            "slurm_comment": job.admin_comment if job.admin_comment.startswith("fleetwatch:")
            else job.comment if job.comment.startswith("fleetwatch:") else "",
            "link": job_link(job.cluster.name, job.slurm_id)}
    incident = (Incident.objects.filter(cluster=job.cluster,
                                        jobs__icontains=json_list_has(job.slurm_id))
                .order_by("-detected_at", "-id").first())
    if incident is None:
        if job.state in ENDED:
            headline = (f"Job {job.slurm_id} ended {job.state}; FleetWatch saw no fault of the "
                        "fleet behind it (look at the job's own output)")
            return Why(**base, headline=headline, stopped_by="unknown", job_at_fault=False)
        return Why(**base, headline=f"Job {job.slurm_id} is {job.state or 'unknown to Slurm'}; "
                   "FleetWatch has seen no fault that hit it", stopped_by="nothing",
                   job_at_fault=False)

    fault = fault_summary(incident, job)
    incident_link = absolute_url(reverse("incident-detail", args=[incident.pk]))
    common: dict[str, Any] = {**base, "fault": fault.text, "root_cause": incident.root_cause, "at": fault.at,
              "node": fault.node, "gpu": fault.gpu, "incident": incident.pk,
              "incident_url": incident_link}
    if incident.root_cause == RootCause.APPLICATION_ERROR:
        evidence = [f"{s.observed_at:%H:%M:%S} {s.node_name} {s.get_source_display()}: "
                    f"{s.message}" for s in _cause_signals(incident)[:5]]
        headline = (f"Job {job.slurm_id} died of its own error at {_when(fault.at)} on "
                    f"{fault.node or 'its node'}: an application error, not the fleet's fault "
                    f"(incident {incident.pk}); FleetWatch did not requeue it")
        return Why(**common, headline=headline, stopped_by="application", job_at_fault=True,
                   evidence=evidence, action="FleetWatch left the job as it ended")

    remediation = incident.remediations.order_by("-created_at").first()
    action, requeued_at, steps_at_stop = _action(job, incident, remediation)
    resumed = job.resumed_from_step if job.restart_count else None
    lost = (max(0, steps_at_stop - resumed) if steps_at_stop is not None and resumed is not None
            else None)
    downtime = None
    if fault.at and job.started_at and requeued_at and job.started_at > fault.at:
        downtime = (job.started_at - fault.at).total_seconds()
    words = [f"{fault.text} stopped job {job.slurm_id} at {_when(fault.at)}", action]
    if resumed is not None and job.state == "RUNNING":
        back = f"it resumed from step {resumed}"
        if lost is not None:
            back += f" ({lost} step{'s' if lost != 1 else ''} lost)"
        if downtime is not None:
            back += f" after {duration_text(downtime)} down"
        words.append(back)
    elif requeued_at is not None:
        words.append(f"it is {job.state or 'queued'}, waiting to run again")
    headline = "; ".join(words) + f" (incident {incident.pk})"
    evidence = [f"{s.observed_at:%H:%M:%S} {s.node_name} {s.get_source_display()}: {s.message}"
                for s in _cause_signals(incident)[:5]]
    return Why(**common, headline=headline, stopped_by="fault", job_at_fault=False,
               action=action, requeued_at=requeued_at, resumed_from_step=resumed,
               steps_lost=lost, downtime_seconds=downtime, evidence=evidence)


# The longest a job's chart reaches back: a job of weeks would be more samples than a page.
CHART_MAX_HOURS = 24


def job_chart(job: Job) -> dict[str, Any]:
    """The job's GPUs over its life (since it first started, at most CHART_MAX_HOURS), with
    the fault that stopped it marked: its GPUs now, and the faulty GPU it was on."""
    why = job_why(job)
    end = timezone.now()
    begin = job.first_started_at or job.started_at or job.submitted_at or end - timedelta(hours=1)
    start = max(begin - timedelta(minutes=5), end - timedelta(hours=CHART_MAX_HOURS))
    wanted: dict[str, set[int] | None] = {
        node: set((job.gpus or {}).get(node, [])) or None for node in job.nodes or []}
    if why.node:
        held = wanted.get(why.node, set())
        wanted[why.node] = None if held is None else held | ({why.gpu} if why.gpu is not None
                                                             else set())
    out: dict[str, Any] = {"job": job.slurm_id, "start": start.isoformat(), "end": end.isoformat(),
                           "fault_at": why.at.isoformat() if why.at else None,
                           "utilization": {}, "temperature": {}}
    try:
        points = fleet.telemetry_points(job.cluster, sorted(wanted), start, end)
    except ClientError as exc:
        return {**out, "error": f"telemetry unavailable: {exc}"}
    for node, gpu, at, util, temp in sorted(points, key=lambda p: (p[0], p[1], p[2])):
        gpus = wanted.get(node)
        if gpus is not None and gpu not in gpus:
            continue
        for key, value in (("utilization", util), ("temperature", temp)):
            if value is not None:
                series = out[key].setdefault(f"{node} GPU {gpu}", {"x": [], "y": []})
                series["x"].append(at.isoformat())
                series["y"].append(round(value, 1))
    return out
