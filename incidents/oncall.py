"""What the person on call does to an incident besides repairing it: take it or hand it to
someone (an owner), set how bad it is (a severity), and write notes on its timeline.
Acknowledging and resolving by hand are ``incidents.lifecycle``'s.

Each change is one audit entry (who, when, what), written in the transaction that makes it;
a note *is* its audit entry (the trail is append-only and hash-chained, as a note should be),
so the timeline reads notes from the trail and nothing keeps them twice. A change that would
change nothing (the owner it already has, the severity it already has, the same note form
sent twice) raises ``InvalidTransition``: a button pressed twice acts once.
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from collectors.knowledge import Severity
from incidents.audit import audit_lock, audit_record
from incidents.models import AuditEntry, Incident
from incidents.retry import retry_transient
from incidents.status import InvalidTransition, incident_event

NOTE_VERB = "incident.noted"
# A note is read on a page, not stored as a document: long enough for a paragraph or a pasted
# error, short enough to keep the timeline a timeline.
NOTE_MAX_CHARS = 4000
# What a page's note form sends so that a double click adds one note (incidents/views.py).
NOTE_KEY_MAX_CHARS = 64


class OnCallError(ValueError):
    """Input the service refuses (an empty note, an unknown severity): a 400, not a 409."""


def _locked(incident_id: int) -> Incident:
    audit_lock()  # before the incident's row lock: see incidents/audit.py
    return Incident.objects.select_for_update().get(pk=incident_id)


@retry_transient
def incident_assign(incident_id: int, owner: AbstractBaseUser | None, *, actor: str) -> Incident:
    """Give the incident an owner (someone takes it, or hands it on), or none. Refused on a
    resolved incident and when it already has that owner."""
    with transaction.atomic():
        incident = _locked(incident_id)
        if incident.status == Incident.Status.RESOLVED:
            raise InvalidTransition(f"incident {incident.pk} is resolved; nobody needs to own it")
        if incident.owner_id == (owner.pk if owner is not None else None):
            raise InvalidTransition(
                f"incident {incident.pk} is already owned by {owner.get_username()}"
                if owner is not None else f"incident {incident.pk} has no owner already")
        before = incident.owner.get_username() if incident.owner is not None else ""
        incident.owner = owner  # type: ignore[assignment]  # a User; stubs want the model
        incident.save(update_fields=["owner"])
        name = owner.get_username() if owner is not None else ""
        audit_record("incident.assigned" if owner is not None else "incident.unassigned",
                     f"incident {incident.pk}", actor=actor, incident=incident,
                     result=f"owner {name}" if name else f"no owner (was {before})",
                     data={"owner": name, "before": before})
        incident_event("incident.updated", incident)
    return incident


@retry_transient
def incident_severity_set(incident_id: int, severity: str, *, actor: str) -> Incident:
    """Set how bad it is. Allowed on a resolved incident too: a review may decide it was
    worse than it looked."""
    try:
        new = Severity(severity)
    except ValueError:
        raise OnCallError(f"severity: {severity!r} is not one of "
                          f"{', '.join(s.value for s in Severity)}") from None
    with transaction.atomic():
        incident = _locked(incident_id)
        if incident.severity == new:
            raise InvalidTransition(f"incident {incident.pk} is already {new.label}")
        before = incident.severity
        incident.severity = new.value
        incident.save(update_fields=["severity"])
        audit_record("incident.severity", f"incident {incident.pk}", actor=actor,
                     incident=incident, result=f"{Severity(before).label} → {new.label}",
                     data={"severity": new.value, "before": before})
        incident_event("incident.updated", incident)
    return incident


@retry_transient
def incident_note_add(incident_id: int, text: str, *, actor: str, key: str = "") -> AuditEntry:
    """Write a note on the incident's timeline. ``key`` (a page form's) makes a second send of
    the same form a conflict instead of a second note."""
    text = text.strip()
    if not text:
        raise OnCallError("text: a note needs some text")
    if len(text) > NOTE_MAX_CHARS:
        raise OnCallError(f"text: at most {NOTE_MAX_CHARS} characters ({len(text)} given)")
    key = key.strip()[:NOTE_KEY_MAX_CHARS]
    with transaction.atomic():
        incident = _locked(incident_id)
        if key:
            first = AuditEntry.objects.filter(incident=incident, verb=NOTE_VERB,
                                              data__key=key).first()
            if first is not None:
                raise InvalidTransition(f"this note was already added by {first.actor} at "
                                        f"{first.at.isoformat()}")
        entry = audit_record(NOTE_VERB, f"incident {incident.pk}", actor=actor,
                             incident=incident, result=text, data={"key": key} if key else {})
    return entry
