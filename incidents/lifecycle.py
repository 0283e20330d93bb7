"""An incident's lifecycle: opened (or extended) for a diagnosis, acknowledged by a person,
resolved by hand. A confident diagnosis with a playbook opens its remediation at once.
"""

from __future__ import annotations

from datetime import UTC, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from collectors.knowledge import SEVERITY_FOR, RootCause
from collectors.models import Job
from collectors.roles import SYSTEM
from incidents.audit import audit_lock, audit_record
from incidents.diagnosis import Diagnosis
from incidents.models import Evidence, Incident, Remediation
from incidents.remediation import policy
from incidents.remediation.transitions import remediation_open, remediation_stop
from incidents.retry import retry_transient
from incidents.status import InvalidTransition, incident_event, incident_resolve

# Below this a diagnosis opens an incident for a person to read, but no remediation.
AUTO_REMEDIATION_MIN_CONFIDENCE = 0.8


@retry_transient
def incident_record(cluster_id: int, diagnosis: Diagnosis,
                    drill_id: int | None = None) -> tuple[Incident, bool]:
    """Open an incident for a diagnosis, or extend the one already open for the same fault.

    A fault that keeps showing (a gauge re-read, the same XID injected twice, a second
    diagnosis run) is one incident with more evidence, never a second remediation.

    ``drill_id``: the diagnosis is of a fire drill's synthetic fault (incidents.drills): its
    incident is that drill's, apart from any real one (its own fingerprint), and marked so.
    """
    for _ in range(3):
        try:
            with transaction.atomic():
                audit_lock()  # before the incident's row lock: see incidents/audit.py
                return _incident_record(cluster_id, diagnosis, drill_id)
        except IntegrityError:
            continue  # another worker opened it between our lookup and insert: extend that
    raise RuntimeError(f"could not record incident {diagnosis.fingerprint}")


# A drill's incident's fingerprint: never the same as a real fault's, nor another drill's.
DRILL_FINGERPRINT = "drill-{}:{}"


def _incident_record(cluster_id: int, diagnosis: Diagnosis,
                     drill_id: int | None = None) -> tuple[Incident, bool]:
    now = timezone.now()
    recent = now - timedelta(minutes=settings.FLEETWATCH_DEDUPE_MINUTES)
    fingerprint = (diagnosis.fingerprint if drill_id is None
                   else DRILL_FINGERPRINT.format(drill_id, diagnosis.fingerprint))
    existing = (
        Incident.objects.select_for_update()
        .filter(cluster_id=cluster_id, fingerprint=fingerprint)
        .filter(~Q(status=Incident.Status.RESOLVED) | Q(resolved_at__gte=recent))
        .order_by("-opened_at")
        .first()
    )
    if (existing is None and drill_id is None
            and diagnosis.root_cause == RootCause.NODE_UNREACHABLE):
        # A node FleetWatch is repairing (draining, rebooting, replacing) stops answering
        # because of the repair: that is the repair's evidence, not a new incident.
        holding = policy.remediation_holding(cluster_id, diagnosis.nodes)
        if holding is not None:
            existing = Incident.objects.select_for_update().get(pk=holding.incident_id)
    if existing is not None:
        added = _evidence_add(existing, diagnosis.evidence)
        if added:
            audit_record("incident.extended", f"incident {existing.pk}", incident=existing,
                         result=f"{added} more signal(s) for the same fault")
        return existing, False
    explanation = diagnosis.explanation if drill_id is None else (
        f"Fire drill {drill_id} (a synthetic fault FleetWatch injected to test its own repair "
        f"loop): {diagnosis.explanation}")
    incident = Incident.objects.create(
        cluster_id=cluster_id, root_cause=diagnosis.root_cause, confidence=diagnosis.confidence,
        explanation=explanation, playbook=diagnosis.playbook, drill_id=drill_id,
        fingerprint=fingerprint, nodes=list(diagnosis.nodes),
        jobs=list(diagnosis.jobs), switch=diagnosis.switch or "",
        detected_at=diagnosis.detected_at, opened_at=now,
        severity=SEVERITY_FOR[RootCause(diagnosis.root_cause)],
        nodes_charted=_nodes_involved(cluster_id, diagnosis.nodes, diagnosis.jobs),
    )
    _evidence_add(incident, diagnosis.evidence)
    audit_record("incident.opened", f"incident {incident.pk}", incident=incident,
                 result=explanation,
                 data={"root_cause": diagnosis.root_cause, "confidence": diagnosis.confidence,
                       **({"drill": drill_id} if drill_id is not None else {})})
    incident_event("incident.opened", incident)
    if (diagnosis.confidence >= AUTO_REMEDIATION_MIN_CONFIDENCE
            and policy.playbook_base(incident) is not None):
        remediation_open(incident, actor=SYSTEM, automatic=True)
    return incident, True


# A storm incident's fingerprint: one open storm per root cause and cluster (the unique
# constraint on open fingerprints holds it).
STORM_FINGERPRINT = "storm:{}"
# Nodes named in a storm incident's explanation; the rest are counted (the incident keeps all).
STORM_NODES_NAMED = 12


@retry_transient
def storm_record(cluster_id: int, root_cause: str, diagnoses: list[Diagnosis]) -> Incident:
    """Record diagnoses of one root cause that came past the storm brake as one storm
    incident: opened by the first of them, grown by the rest, in one transaction whatever
    their number (5,000 incidents opened one by one, each with its audit entries, policy
    decision and steps, took minutes; and a storm is one event to look at, not 5,000).

    It holds every node and signal of the storm, waits for a person (no playbook runs over a
    storm: policy.playbook_choose) and tells the webhook subscribers once when it opens."""
    for _ in range(3):
        try:
            with transaction.atomic():
                audit_lock()  # before the incident's row lock: see incidents/audit.py
                return _storm_record(cluster_id, RootCause(root_cause), diagnoses)
        except IntegrityError:
            continue  # another worker opened it between our lookup and insert: grow that
    raise RuntimeError(f"could not record the {root_cause} storm")


def _storm_record(cluster_id: int, cause: RootCause, diagnoses: list[Diagnosis]) -> Incident:
    fingerprint = STORM_FINGERPRINT.format(cause)
    storm = (Incident.objects.select_for_update()
             .filter(cluster_id=cluster_id, fingerprint=fingerprint, storm=True)
             .exclude(status=Incident.Status.RESOLVED).first())
    nodes = sorted({n for d in diagnoses for n in d.nodes}.union(storm.nodes if storm else ()))
    jobs = sorted({j for d in diagnoses for j in d.jobs}.union(storm.jobs if storm else ()))
    detected = min([d.detected_at for d in diagnoses]
                   + ([storm.detected_at] if storm else []))
    named = ", ".join(nodes[:STORM_NODES_NAMED]) + (
        f" and {len(nodes) - STORM_NODES_NAMED} more" if len(nodes) > STORM_NODES_NAMED else "")
    explanation = (
        f"Storm: {cause.label} on {len(nodes)} nodes since "
        f"{detected.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC, "
        f"past the storm brake (more than {settings.FLEETWATCH_STORM_INCIDENTS} {cause} "
        f"incidents in {settings.FLEETWATCH_STORM_MINUTES} min): more likely one event (a "
        "rack or its power feed, a switch, a driver or firmware rollout) than that many "
        f"separate faults. Automation of {cause} is paused; nothing runs from this incident. "
        f"Nodes: {named}. One of them: {diagnoses[0].explanation}")
    if storm is None:
        storm = Incident.objects.create(
            cluster_id=cluster_id, root_cause=cause, storm=True, fingerprint=fingerprint,
            confidence=min(d.confidence for d in diagnoses), explanation=explanation,
            nodes=nodes, jobs=jobs, detected_at=detected, status=Incident.Status.NEEDS_ATTENTION,
            severity=SEVERITY_FOR[cause], nodes_charted=nodes[:CHART_NODES_MAX])
        opened = True
    else:
        storm.nodes, storm.jobs, storm.detected_at = nodes, jobs, detected
        storm.explanation = explanation
        storm.save(update_fields=["nodes", "jobs", "detected_at", "explanation"])
        opened = False
    added = _evidence_add(storm, tuple(dict.fromkeys(s for d in diagnoses for s in d.evidence)))
    if opened:
        audit_record("incident.opened", f"incident {storm.pk}", incident=storm,
                     result=explanation, data={"root_cause": cause, "storm": True,
                                               "nodes": len(nodes)})
        incident_event("incident.opened", storm)
    elif added:
        # Audited, not announced: a storm grows at every diagnosis run while it lasts, and a
        # subscriber paged for each run would be paged by the storm itself.
        audit_record("incident.extended", f"incident {storm.pk}", incident=storm,
                     result=f"{added} more signal(s) of the storm; {len(nodes)} nodes now")
    return storm


# At most this many nodes are kept for an incident's chart: more lines than anyone can read.
CHART_NODES_MAX = 32


def _nodes_involved(cluster_id: int, nodes: tuple[str, ...], jobs: tuple[str, ...]) -> list[str]:
    """The nodes involved when the incident opens: the blamed ones first, then the other nodes
    of its jobs. Kept with the incident (``nodes_charted``): by the time someone reads the
    chart the jobs have been requeued elsewhere, and their nodes now are not the ones hit."""
    others: set[str] = set()
    if jobs:
        for job_nodes in Job.objects.filter(cluster_id=cluster_id, slurm_id__in=jobs).values_list(
                "nodes", flat=True):
            others.update(job_nodes or [])
    return (list(dict.fromkeys(nodes)) + sorted(others - set(nodes)))[:CHART_NODES_MAX]


def _evidence_add(incident: Incident, signal_ids: tuple[int, ...]) -> int:
    have = set(incident.evidence.values_list("signal_id", flat=True))
    new = [Evidence(incident=incident, signal_id=sid) for sid in signal_ids if sid not in have]
    Evidence.objects.bulk_create(new, ignore_conflicts=True)
    return len(new)


@retry_transient
def incident_acknowledge(incident_id: int, *, actor: str) -> Incident:
    """Someone has it. Once per incident: a second acknowledgement says who was first."""
    with transaction.atomic():
        audit_lock()  # before any row lock: see incidents/audit.py
        incident = Incident.objects.select_for_update().get(pk=incident_id)
        if incident.status == Incident.Status.RESOLVED:
            raise InvalidTransition(f"incident {incident.pk} is resolved; nothing to "
                                    "acknowledge")
        if incident.acknowledged_at is not None:
            raise InvalidTransition(
                f"incident {incident.pk} was acknowledged by {incident.acknowledged_by} at "
                f"{incident.acknowledged_at.isoformat()}")
        incident.acknowledged_by, incident.acknowledged_at = actor, timezone.now()
        incident.save(update_fields=["acknowledged_by", "acknowledged_at"])
        audit_record("incident.acknowledged", f"incident {incident.pk}", actor=actor,
                     incident=incident)
        incident_event("incident.updated", incident)
    return incident


@retry_transient
def incident_resolve_by_hand(incident_id: int, *, actor: str, note: str = "") -> Incident:
    """A person says it is over (fixed by hand, or not a fault after all). Refused while a
    remediation is still acting: cancel it first, so nothing acts on a resolved incident. One
    that only waits for a person is cancelled with it.

    Locks in the order the remediation actions take them (policy, remediation, incident), so
    a resolve and an approve at the same moment queue rather than deadlock: whichever is
    second sees what the first did."""
    with transaction.atomic():
        policy.decisions_serialized()
        live = list(Remediation.objects.select_for_update().filter(
            incident_id=incident_id, status__in=Remediation.ACTIVE))
        incident = Incident.objects.select_for_update().get(pk=incident_id)
        if incident.status == Incident.Status.RESOLVED:
            raise InvalidTransition(f"incident {incident.pk} is already resolved")
        acting = [r for r in live if r.status != Remediation.Status.AWAITING_APPROVAL]
        if acting:
            raise InvalidTransition(
                f"remediation {acting[0].pk} is {acting[0].status}; cancel it before resolving")
        for rem in live:  # nobody approved it and nobody will now
            remediation_stop(rem, actor, "the incident was resolved by hand")
        audit_record("incident.resolved_by_hand", f"incident {incident.pk}", actor=actor,
                     incident=incident, result=note[:500])
        incident_resolve(incident)
    return incident
