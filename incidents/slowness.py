"""Fail-slow, live: nodes alive but slower than their jobs' peers, found every few minutes.

The telemetry poll keeps utilisation, temperatures and fault fields only (it runs every few
seconds over the whole fleet, and must stay light); the figures a straggler shows (clocks,
power, PCIe links, NVLink and memory traffic) are read here instead, as history, for the
nodes of the running jobs that have peers to compare with: one range query per field from
the telemetry source (``TelemetryClient.gpu_field_history``). The jobs' own output stored as
signals (iteration times, straggler reports, pushed as ``job_log``) and the kernel's PCIe
downtrain lines are read from the database. The pure analysis (``incidents.diagnosis.slow``)
decides; each straggler becomes a ``fail_slow`` diagnosis, recorded as every diagnosis is
(``diagnosing.diagnoses_record``: an incident opened or extended, storms grouped).

A node with an open incident of another cause is left out: that fault explains its slowness
and its repair comes first. A source that cannot be read makes a scan find nothing, never a
slow node. Each figure the explanation gives is kept as a signal of the incident (source
``dcgm``, kind ``fail_slow``), so its timeline shows the numbers too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from collectors.clients import get_telemetry
from collectors.clients.base import SLURM_REASON_PREFIX, ClientError
from collectors.knowledge import PLAYBOOK_FOR, RootCause, dcgm
from collectors.models import Cluster, Job, Node, Signal
from collectors.normalize import SignalDraft
from collectors.services import signals_store
from incidents import selectors
from incidents.diagnosing import diagnoses_record
from incidents.diagnosis import Diagnosis, JobInfo, Observation, slow
from incidents.diagnosis import facts as diagnosis_facts
from incidents.models import Incident

log = logging.getLogger(__name__)

FAIL_SLOW = RootCause.FAIL_SLOW
EVIDENCE_KIND = FAIL_SLOW.value  # the kind of the signals that keep a finding's figures


def fail_slow_scan_all() -> dict[str, int]:
    """Scan every cluster (the beat's task): cluster name -> incidents recorded or found."""
    return {c.name: len(fail_slow_scan(c.pk)) for c in Cluster.objects.order_by("name")}


def fail_slow_scan(cluster_id: int, *, now: datetime | None = None) -> list[Incident]:
    """Look for stragglers among the cluster's running jobs over the last
    FLEETWATCH_FAIL_SLOW_WINDOW_MINUTES; record what is found. Returns the incidents."""
    cluster = Cluster.objects.get(pk=cluster_id)
    now = now or timezone.now()
    start = now - timedelta(minutes=settings.FLEETWATCH_FAIL_SLOW_WINDOW_MINUTES)
    jobs = _jobs_to_compare(cluster)
    if not jobs:
        return []
    step = settings.FLEETWATCH_FAIL_SLOW_STEP_SECONDS
    own = diagnosis_facts.extract(_job_output(cluster, jobs, sorted(
        {n for j in jobs for n in j.nodes}), start, now))
    # Two points a bucket: with the default 30 s step, a minute (as the replay engine's).
    limits = slow.Thresholds(bucket_s=max(2 * step, 10.0),
                             sustain_s=settings.FLEETWATCH_FAIL_SLOW_SUSTAIN_MINUTES * 60.0)
    spans = {j.id: (started, None) for j, started in _starts(cluster, jobs)}
    telemetry = get_telemetry(cluster.name)
    found: dict[str, slow.Finding] = {}
    # Whole jobs at a time, a few hundred nodes each: a fleet's history is never held at once.
    for chunk in _chunks(jobs, SCAN_NODES):
        nodes = sorted({n for j in chunk for n in j.nodes})
        try:
            history = telemetry.gpu_field_history(nodes, dcgm.FAIL_SLOW_FIELDS, start, now, step)
        except ClientError as exc:
            # Nothing is known of these nodes' pace this time: no finding, no node blamed.
            log.warning("fail-slow scan of %s: telemetry unreadable, %d nodes not compared: "
                        "%s", cluster.name, len(nodes), exc)
            continue
        readings = {key: {name: [(t, v, None) for t, v in points]
                          for name, points in fields.items()}
                    for key, fields in history.items()}
        result = slow.analyse(slow.Window(chunk, readings, own.paces, own.reports,
                                          own.downtrains, spans), limits)
        for finding in result.findings:
            kept = found.get(finding.node)
            if kept is None or finding.confidence > kept.confidence:
                found[finding.node] = finding
    explained = _nodes_with_other_faults(cluster)
    diagnoses = []
    for finding in sorted(found.values(), key=lambda f: (f.start, f.node)):
        if finding.node in explained:
            log.info("fail-slow scan of %s: %s is slower than its job's peers; its open %s "
                     "incident explains it", cluster.name, finding.node, explained[finding.node])
            continue
        diagnoses.append(_diagnosis(cluster, finding))
    if not diagnoses:
        return []
    incidents, _ = diagnoses_record(cluster, diagnoses)
    return incidents


# Nodes whose history one scan reads at a time (whole jobs; a larger job alone).
SCAN_NODES = 256


def _chunks(jobs: list[JobInfo], size: int) -> Iterable[list[JobInfo]]:
    chunk: list[JobInfo] = []
    nodes: set[str] = set()
    for job in sorted(jobs, key=lambda j: sorted(j.nodes)):
        if chunk and len(nodes | set(job.nodes)) > size:
            yield chunk
            chunk, nodes = [], set()
        chunk.append(job)
        nodes |= set(job.nodes)
    if chunk:
        yield chunk


def _jobs_to_compare(cluster: Cluster) -> list[JobInfo]:
    """The running jobs with peers to compare: several nodes, or several GPUs of one node."""
    out = []
    for job in Job.objects.filter(cluster=cluster, state="RUNNING").order_by("slurm_id"):
        nodes = tuple(job.nodes or ())
        gpus = {n: tuple(g) for n, g in (job.gpus or {}).items()}
        if len(nodes) >= 2 or (len(nodes) == 1 and len(gpus.get(nodes[0], (0, 1))) >= 2):
            out.append(JobInfo(job.slurm_id, job.user, nodes, gpus))
    return out


def _starts(cluster: Cluster, jobs: list[JobInfo]) -> Iterable[tuple[JobInfo, float | None]]:
    started = dict(Job.objects.filter(cluster=cluster, slurm_id__in=[j.id for j in jobs])
                   .values_list("slurm_id", "started_at"))
    for job in jobs:
        at = started.get(job.id)
        yield job, at.timestamp() if at else None


def _job_output(cluster: Cluster, jobs: list[JobInfo], nodes: list[str], start: datetime,
                end: datetime) -> list[Observation]:
    """The jobs' own output (iteration times, straggler reports) and the nodes' kernel PCIe
    downtrain lines in the window, as the diagnosis engine reads signals."""
    rows = Signal.objects.filter(cluster=cluster, observed_at__gte=start, observed_at__lte=end
                                 ).filter(
        Q(source=Signal.Source.JOB_LOG, job_id__in=[j.id for j in jobs])
        | Q(source=Signal.Source.KERNEL, node_name__in=nodes,
            message__contains="available PCIe bandwidth"))
    return [selectors.observation_from_signal(s) for s in rows.order_by("observed_at", "id")]


def _nodes_with_other_faults(cluster: Cluster) -> dict[str, str]:
    """Node -> the root cause of an open incident of another cause on it."""
    out: dict[str, str] = {}
    for nodes, cause in (Incident.objects.filter(cluster=cluster)
                         .exclude(status=Incident.Status.RESOLVED)
                         .exclude(root_cause=FAIL_SLOW).values_list("nodes", "root_cause")):
        for node in nodes or ():
            out.setdefault(node, cause)
    # Drained by someone else (an administrator, slurmctld): theirs to handle.
    drained = Node.objects.filter(cluster=cluster).exclude(slurm_reason="")
    for name, flags, reason in drained.values_list("name", "slurm_flags", "slurm_reason"):
        if "DRAIN" in (flags or ()) and not reason.startswith(SLURM_REASON_PREFIX):
            out.setdefault(name, f"drained by someone else ({reason})")
    return out


def _diagnosis(cluster: Cluster, found: slow.Finding) -> Diagnosis:
    """The finding as a diagnosis; its figures kept as the incident's signals the first time
    (an open incident of the same node is extended by the lifecycle without new ones)."""
    fingerprint = f"{FAIL_SLOW}:{found.node}"
    recent = timezone.now() - timedelta(minutes=settings.FLEETWATCH_DEDUPE_MINUTES)
    open_already = Incident.objects.filter(cluster=cluster, fingerprint=fingerprint).filter(
        ~Q(status=Incident.Status.RESOLVED) | Q(resolved_at__gte=recent)).exists()
    evidence: tuple[int, ...] = ()
    if not open_already:
        with transaction.atomic():
            evidence = tuple(signals_store(cluster, _evidence_drafts(found)))
    return Diagnosis(FAIL_SLOW, (found.node,), found.confidence, PLAYBOOK_FOR[FAIL_SLOW],
                     found.explanation, datetime.fromtimestamp(found.start, UTC),
                     jobs=found.jobs, evidence=evidence)


def _evidence_drafts(found: slow.Finding) -> list[SignalDraft]:
    """One signal per figure (and per narrow link) the explanation gives, at the start of the
    slow stretch. Their data carry no ``metric``: they are FleetWatch's reading of the
    history, not a sample the engine should read again as one."""
    at = datetime.fromtimestamp(found.start, UTC)
    job = found.jobs[0] if found.jobs else ""
    drafts = [
        SignalDraft(Signal.Source.DCGM, EVIDENCE_KIND, node=found.node,
                    gpu=d.gpus[0] if len(d.gpus) == 1 else None, job=job,
                    value=f"{d.change * 100:+.0f}%", message=f"{found.node} {d.text}",
                    data={"figure": d.label, "field": d.field, "gpus": list(d.gpus),
                          "reading": round(d.value, 3), "peers_median": round(d.peers, 3),
                          "change": round(d.change, 4), "seconds": d.seconds,
                          "confidence": found.confidence},
                    observed_at=at)
        for d in found.deviations]
    drafts += [SignalDraft(Signal.Source.DCGM, EVIDENCE_KIND, node=found.node, job=job,
                           value="link", message=f"{found.node} {text}",
                           data={"figure": "PCIe link"}, observed_at=at)
               for text in found.links]
    return drafts
