"""The Incidents and Audit lists as django-tables2 tables, on the fleet lists' base
(collectors/tables.py): every column sorts in the database, the whole filtered list exports
as CSV, each ``value_*`` is the cell's fact as plain text."""

from __future__ import annotations

from typing import Any

import django_tables2 as tables
from django.template.defaultfilters import truncatechars
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from collectors.roles import actor_shown
from collectors.tables import ListTable, iso, time_column
from incidents.drills import DRILL_PHASES
from incidents.models import AuditEntry, Drill, Incident
from incidents.templatetags.fleetwatch_ui import duration, duration_text, ms_duration, percent


class IncidentTable(ListTable):
    export_name = "incidents"
    id = tables.Column(verbose_name="#")
    # SEV1 is the worst: an ascending sort puts it first (the values sort as their numbers).
    severity = tables.Column(verbose_name="Severity", order_by=("severity", "-opened_at"))
    root_cause = tables.Column(verbose_name="Root cause")
    nodes = tables.Column(verbose_name="Nodes / switch", order_by=("nodes", "switch"))
    jobs = tables.Column(order_by=("jobs", "id"))
    status = tables.Column()
    # By name, the unowned after the owned (``unowned``: selectors.incidents_for_list).
    owner = tables.Column(verbose_name="Owner", accessor="owner__username", default="-",
                          order_by=("unowned", "owner__username", "-opened_at"))
    cluster = tables.Column(verbose_name="Cluster", accessor="cluster__name")
    opened_at = time_column("Opened", full=True)
    # Sorted by resolution time less opening time (annotated in selectors.incidents_for_list);
    # shown from the phases, which measure it from detection.
    repair_time = tables.Column(verbose_name="Time to repair", empty_values=())

    class Meta(ListTable.Meta):
        model = Incident
        fields = ("id", "severity", "root_cause", "nodes", "jobs", "status", "owner", "cluster",
                  "opened_at", "repair_time")
        row_attrs = {"data-testid": lambda record: f"incident-row-{record.pk}"}

    def render_id(self, record: Incident) -> SafeString:
        link = format_html('<a href="{}">#{}</a>', reverse("incident-detail", args=[record.pk]),
                           record.pk)
        if record.drill_id is None:
            return link
        # A fire drill's incident says so wherever it is listed (incidents.drills).
        return format_html('{} <a class="badge drill" href="{}" title="fire drill {}: a '
                           'synthetic fault">drill</a>', link,
                           reverse("drill-detail", args=[record.drill_id]), record.drill_id)

    def value_id(self, record: Incident) -> int:
        return record.pk

    def render_severity(self, record: Incident) -> SafeString:
        return format_html('<span class="badge sev-{}">{}</span>', record.severity,
                           record.get_severity_display())

    def value_severity(self, record: Incident) -> str:
        return record.severity

    def value_owner(self, record: Incident) -> str:
        return record.owner.get_username() if record.owner is not None else ""

    def render_root_cause(self, record: Incident) -> SafeString:
        return format_html('{} <span class="muted small">{}</span>',
                           record.get_root_cause_display(), percent(record.confidence))

    def value_root_cause(self, record: Incident) -> str:
        return f"{record.root_cause} ({percent(record.confidence)})"

    def render_nodes(self, record: Incident) -> str:
        if record.storm:
            return f"storm: {len(record.nodes)} nodes"
        return ", ".join(record.nodes) + record.switch

    def value_nodes(self, record: Incident) -> str:
        return " ".join([*record.nodes, record.switch]).strip()

    def render_jobs(self, value: list[str]) -> str:
        return ", ".join(value) or "-"

    def value_jobs(self, value: list[str]) -> str:
        return " ".join(value)

    def render_status(self, record: Incident) -> SafeString:
        return format_html('<span class="badge st-{}">{}</span>', record.status,
                           record.get_status_display())

    def value_status(self, record: Incident) -> str:
        return record.status

    def value_opened_at(self, record: Incident) -> str:
        return iso(record.opened_at)

    def render_repair_time(self, record: Incident) -> SafeString | str:
        if not record.resolved_at:
            return "-"
        return format_html("{}{}", duration((record.phases or {}).get("total")), format_html(
            ' <span class="muted small">by {}</span>', record.repaired_by)
            if record.repaired_by else "")

    def value_repair_time(self, record: Incident) -> Any:
        return (record.phases or {}).get("total", "") if record.resolved_at else ""


class AuditTable(ListTable):
    export_name = "audit"
    id = tables.Column(verbose_name="#")
    at = time_column("When", full=True)
    actor = tables.Column()
    verb = tables.Column()
    target = tables.Column()
    call = tables.Column(verbose_name="Outside call / result", empty_values=(),
                         order_by=("call", "ok", "id"))
    incident = tables.Column(accessor="incident_id", default="-")

    class Meta(ListTable.Meta):
        model = AuditEntry
        fields = ("id", "at", "actor", "verb", "target", "call", "incident")
        row_attrs = {"data-testid": lambda record: f"audit-row-{record.pk}",
                     "class": lambda record: "" if record.ok else "row-bad"}

    def value_at(self, record: AuditEntry) -> str:
        return iso(record.at)

    def render_verb(self, value: str) -> SafeString:
        return format_html("<code>{}</code>", value)

    def value_verb(self, value: str) -> str:
        return value

    def render_call(self, record: AuditEntry) -> SafeString | str:
        result = truncatechars(record.result, 300)
        if not record.call:
            return result
        return format_html(
            "<code>{}</code> → {}{}{}", record.call,
            "ok" if record.ok else SafeString('<span class="error">failed</span>'),
            format_html(' <span class="muted small">{}</span>', ms_duration(record.duration_ms))
            if record.duration_ms is not None else "",
            format_html('<div class="muted small">{}</div>', result) if result else "")

    def value_call(self, record: AuditEntry) -> str:
        # The whole result (the page cuts it at 300 characters).
        if not record.call:
            return record.result
        return f"{record.call} -> {'ok' if record.ok else 'failed'}: {record.result}"

    def render_incident(self, value: int) -> SafeString:
        return format_html('<a href="{}">#{}</a>', reverse("incident-detail", args=[value]),
                           value)

    def value_incident(self, value: int | None) -> Any:
        return value or ""


class DrillTable(ListTable):
    """Fire drills (incidents.drills): result, canary, mode, each phase's time, the budget."""

    export_name = "drills"
    id = tables.Column(verbose_name="#")
    status = tables.Column(verbose_name="Result")
    node = tables.Column(verbose_name="Canary", default="-")
    mode = tables.Column()
    trigger = tables.Column(verbose_name="Started")
    started_at = time_column("When", full=True)
    phases = tables.Column(verbose_name="Phases", orderable=False, empty_values=())
    total = tables.Column(verbose_name="Took", accessor="finished_at", empty_values=(),
                          order_by=("finished_at", "started_at"))
    budget_seconds = tables.Column(verbose_name="Budget")
    incident = tables.Column(verbose_name="Incident", empty_values=(), orderable=False)

    class Meta(ListTable.Meta):
        model = Drill
        fields = ("id", "status", "node", "mode", "trigger", "started_at", "phases", "total",
                  "budget_seconds", "incident")
        row_attrs = {"data-testid": lambda record: f"drill-row-{record.pk}",
                     "class": lambda record: "row-bad" if record.status == "failed" else ""}

    def render_id(self, record: Drill) -> SafeString:
        return format_html('<a href="{}">#{}</a>', reverse("drill-detail", args=[record.pk]),
                           record.pk)

    def value_id(self, record: Drill) -> int:
        return record.pk

    def render_status(self, record: Drill) -> SafeString:
        reason = truncatechars(record.reason, 160)
        return format_html('<span class="badge dr-{}">{}</span>{}', record.status,
                           record.get_status_display(),
                           format_html('<div class="muted small">{}</div>', reason)
                           if reason else "")

    def value_status(self, record: Drill) -> str:
        return f"{record.status}: {record.reason}" if record.reason else record.status

    def render_mode(self, record: Drill) -> str:
        return record.mode

    def value_started_at(self, record: Drill) -> str:
        return iso(record.started_at)

    def render_trigger(self, record: Drill) -> str:
        return "schedule" if record.trigger == Drill.Trigger.SCHEDULE else \
            f"by {actor_shown(record.requested_by)}"

    def render_phases(self, record: Drill) -> SafeString | str:
        phases = record.phases or {}
        shown = [(p, phases[p]) for p in DRILL_PHASES if p in phases and p != "total"]
        if not shown:
            return "-"
        return format_html_join(" ", '<span class="phase">{} <b>{}</b></span>',
                                ((p.replace("_", " "), duration_text(v)) for p, v in shown))

    def value_phases(self, record: Drill) -> str:
        return " ".join(f"{p}={v}" for p, v in (record.phases or {}).items())

    def render_total(self, record: Drill) -> str:
        return duration_text(record.duration_seconds) if record.finished_at else (
            "running" if record.status == Drill.Status.RUNNING else "-")

    def value_total(self, record: Drill) -> Any:
        return record.duration_seconds if record.finished_at else ""

    def render_budget_seconds(self, record: Drill) -> SafeString | str:
        text = duration_text(record.budget_seconds)
        return format_html('{} <span class="error">over</span>', text) if record.over_budget \
            else text

    def value_budget_seconds(self, record: Drill) -> float:
        return record.budget_seconds

    def render_incident(self, record: Drill) -> SafeString | str:
        incident = next(iter(record.incidents.all()), None)
        if incident is None:
            return "-"
        return format_html('<a href="{}">#{}</a>', reverse("incident-detail",
                                                            args=[incident.pk]), incident.pk)

    def value_incident(self, record: Drill) -> Any:
        incident = next(iter(record.incidents.all()), None)
        return incident.pk if incident is not None else ""
