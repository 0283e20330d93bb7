"""An incident's status: the one way it changes, the news of each change, and its end.

Every change of an incident's status goes through ``incident_status`` (or ``incident_resolve``),
which tells the webhook subscribers once the change commits. Below the lifecycle, the
remediation transitions and the step engine, which all change status: none of them imports
another to do it.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from collectors.roles import SYSTEM
from incidents import webhooks
from incidents.audit import audit_record
from incidents.models import AuditEntry, Incident, Remediation
from incidents.phases import phase_durations


class InvalidTransition(Exception):
    """The action does not fit the current state (approve a finished remediation, ...)."""


def incident_status(incident: Incident, status: str) -> None:
    """Set the incident's status (its row, and the object in hand); tell subscribers."""
    if incident.status != status:
        Incident.objects.filter(pk=incident.pk).update(status=status)
        incident.status = status
        if status != Incident.Status.RESOLVED:  # resolving sends its own event
            incident_event("incident.updated", incident)


def incident_event(event: str, incident: Incident, remediation: Remediation | None = None) -> None:
    """Tell the webhook subscribers, once the change is committed (a rolled-back change was
    never news). A fire drill's incident is no news to them: a drill pages nobody but for its
    own failure (incidents.drills)."""
    if incident.drill_id is not None:
        return
    incident_id, remediation_id = incident.pk, remediation.pk if remediation else None
    transaction.on_commit(lambda: webhooks.event_emit(event, incident_id, remediation_id))


def incident_resolve(incident: Incident, remediation: Remediation | None = None) -> None:
    """The incident is over (its remediation succeeded, or a person says so): keep how long
    each phase took and whether a person had a hand in it."""
    now = timezone.now()
    incident.status, incident.resolved_at = Incident.Status.RESOLVED, now
    incident.phases = phase_durations(incident, remediation, now)
    incident.repaired_by = _repaired_by(incident)
    incident.save(update_fields=["status", "resolved_at", "phases", "repaired_by"])
    audit_record("incident.resolved", f"incident {incident.pk}", incident=incident,
                 result=", ".join(f"{k} {v:.1f}s" for k, v in incident.phases.items()))
    incident_event("incident.resolved", incident, remediation)


def _repaired_by(incident: Incident) -> str:
    """"person" when anyone approved, continued or started something; else "automation"."""
    people = incident.audit.exclude(actor=SYSTEM).exists() or AuditEntry.objects.filter(
        remediation__incident=incident).exclude(actor=SYSTEM).exists()
    return "person" if people else "automation"
