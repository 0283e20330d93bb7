"""The incidents app's list filters: one filter set per model, used by its page and by its API
endpoint alike (see collectors/filters.py, which holds the building blocks and the fleet's
filter sets)."""

from __future__ import annotations

from typing import Any

from django.db.models import Q, QuerySet
from django_filters import rest_framework as django_filters

from collectors.filters import (
    RANGE_CHOICES,
    FilterSet,
    IntegerFilter,
    UtcDateTimeFilter,
    YesNoFilter,
    choice,
    cluster_choices,
    since,
)
from collectors.roles import SYSTEM
from collectors.selectors import json_list_has
from incidents.models import AuditEntry, Drill, Incident, Remediation, RootCause, Step


class IncidentFilter(FilterSet):
    cluster = django_filters.CharFilter(field_name="cluster__name", help_text="cluster name")
    status = choice(choices=Incident.Status.choices)
    open = YesNoFilter(method="_open", help_text="true: not resolved yet")
    root_cause = choice(choices=RootCause.choices)
    node = django_filters.CharFilter(method="_node",
                                     help_text="incidents that blame this node or leaf switch")
    job = django_filters.CharFilter(method="_job", help_text="incidents that hit this job")
    drill = YesNoFilter(method="_drill", help_text="true: fire drills' incidents only; false: "
                                                   "real faults' only")
    range = choice(choices=RANGE_CHOICES, method=since("opened_at"),
                   help_text="opened in the last hour, 24 hours, 7 or 30 days")
    since = UtcDateTimeFilter(field_name="opened_at", lookup_expr="gte",
                              help_text="opened at or after")
    until = UtcDateTimeFilter(field_name="opened_at", lookup_expr="lte",
                              help_text="opened at or before")

    page_fields = ("status", "open", "root_cause", "cluster", "node", "drill", "range", "since",
                   "until")
    page_labels = {"open": "Open", "root_cause": "Root cause", "node": "Node", "range": "Opened",
                   "drill": "Fire drill", "since": "Opened from (UTC)",
                   "until": "Opened until (UTC)"}

    class Meta:
        model = Incident
        fields = ["cluster", "status", "open", "root_cause", "node", "job", "drill", "range",
                  "since", "until"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The page offers the clusters there are (read only when the form is drawn).
        self.page_choices("cluster", cluster_choices)

    def _open(self, qs: QuerySet[Incident], name: str, value: bool) -> QuerySet[Incident]:
        resolved = Q(status=Incident.Status.RESOLVED)
        return qs.exclude(resolved) if value else qs.filter(resolved)

    def _node(self, qs: QuerySet[Incident], name: str, value: str) -> QuerySet[Incident]:
        return qs.filter(Q(nodes__icontains=json_list_has(value)) | Q(switch=value))

    def _job(self, qs: QuerySet[Incident], name: str, value: str) -> QuerySet[Incident]:
        return qs.filter(jobs__icontains=json_list_has(value))

    def _drill(self, qs: QuerySet[Incident], name: str, value: bool) -> QuerySet[Incident]:
        return qs.filter(drill__isnull=not value)


class DrillFilter(FilterSet):
    status = choice(choices=Drill.Status.choices)
    mode = choice(choices=Drill.Mode.choices)
    trigger = choice(choices=Drill.Trigger.choices)
    node = django_filters.CharFilter(help_text="the canary node")
    range = choice(choices=RANGE_CHOICES, method=since("started_at"),
                   help_text="started in the last hour, 24 hours, 7 or 30 days")

    page_fields = ("status", "mode", "trigger", "node", "range")
    page_labels = {"status": "Result", "trigger": "How started", "node": "Canary",
                   "range": "When"}

    class Meta:
        model = Drill
        fields = ["status", "mode", "trigger", "node", "range"]


class RemediationFilter(FilterSet):
    status = django_filters.ChoiceFilter(choices=Remediation.Status.choices)
    mode = django_filters.ChoiceFilter(choices=Remediation.Mode.choices)
    playbook = django_filters.CharFilter()
    incident = IntegerFilter(field_name="incident_id")

    class Meta:
        model = Remediation
        fields = ["status", "mode", "playbook", "incident"]


class StepFilter(FilterSet):
    remediation = IntegerFilter(field_name="remediation_id")
    incident = IntegerFilter(field_name="remediation__incident_id")
    status = django_filters.ChoiceFilter(choices=Step.Status.choices)
    kind = django_filters.CharFilter(help_text="drain_and_cancel, replace_node, ...")

    class Meta:
        model = Step
        fields = ["remediation", "incident", "status", "kind"]


def _whole_actor(value: str) -> bool:
    return value == SYSTEM or value.startswith(("user:", "token:"))


class AuditFilter(FilterSet):
    actor = django_filters.CharFilter(
        method="_actor", help_text="exactly: system, user:NAME or token:NAME; anything else "
                                   "matches as part of one (a NAME alone)")
    verb = django_filters.CharFilter(lookup_expr="startswith",
                                     help_text="a verb or its prefix: remediation. matches all")
    target = django_filters.CharFilter(lookup_expr="icontains")
    ok = YesNoFilter(help_text="false: the failed calls and refusals")
    incident = IntegerFilter(field_name="incident_id", min_value=1)
    remediation = IntegerFilter(field_name="remediation_id")
    step = IntegerFilter(field_name="step_id")
    failed = choice(empty_label="all", choices=[("yes", "yes")], method="_failed",
                    help_text="yes: the failed calls and refusals only (as ok=false)")
    range = choice(choices=RANGE_CHOICES, method=since("at"),
                   help_text="in the last hour, 24 hours, 7 or 30 days")
    since = UtcDateTimeFilter(field_name="at", lookup_expr="gte")
    until = UtcDateTimeFilter(field_name="at", lookup_expr="lte")

    page_fields = ("actor", "verb", "target", "incident", "failed", "range", "since", "until")
    page_labels = {"actor": "Actor contains", "verb": "Verb starts with",
                   "target": "Target contains", "incident": "Incident #",
                   "failed": "Failed calls only", "range": "When", "since": "From (UTC)",
                   "until": "Until (UTC)"}
    page_help = {"actor": "system, user:NAME, token:NAME", "verb": "e.g. remediation."}

    class Meta:
        model = AuditEntry
        fields = ["actor", "verb", "target", "ok", "incident", "remediation", "step", "failed",
                  "range", "since", "until"]

    def _actor(self, qs: QuerySet[AuditEntry], name: str, value: str) -> QuerySet[AuditEntry]:
        # A whole actor as the trail writes it is matched exactly (a program asking for
        # token:ci must not get token:ci-2's entries); a person typing a name finds it in any.
        if _whole_actor(value):
            return qs.filter(actor=value)
        return qs.filter(actor__icontains=value)

    def _failed(self, qs: QuerySet[AuditEntry], name: str, value: str) -> QuerySet[AuditEntry]:
        return qs.filter(ok=False) if value == "yes" else qs
