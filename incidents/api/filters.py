"""The API's list filters (django-filter). A value that does not parse (a date that is not
one, a status that does not exist) answers 400 naming the parameter; it is never ignored, so
a typo cannot silently widen a query.

Times are ISO 8601 with an offset (``2026-12-03T10:00:00Z``); ``since`` is inclusive, ``until``
too. Nodes and jobs are named as the sources name them (``gpu-003``, Slurm job ids)."""

from __future__ import annotations

from datetime import UTC, datetime

from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet
from django_filters import rest_framework as django_filters
from django_filters.fields import IsoDateTimeField

from collectors.models import Gpu, Job, Node, Signal
from incidents.filters import IntegerFilter
from incidents.models import AuditEntry, Incident, Remediation, RootCause, Step
from incidents.selectors import json_list_has


class UtcDateTimeField(IsoDateTimeField):
    def to_python(self, value: object) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        # Given in UTC to the database: PostgreSQL refuses offsets beyond 15:59 (ISO 8601
        # allows 23:59), and an error there would be a 500 for what is bad input.
        try:
            return parsed.astimezone(UTC)
        except OverflowError:
            raise ValidationError("Date/time out of range.", code="invalid") from None


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcDateTimeField


class ClusterFilter(django_filters.FilterSet):
    """Shared by the fleet lists: one FleetWatch may watch several clusters."""

    cluster = django_filters.CharFilter(field_name="cluster__name", help_text="cluster name")


class NodeFilter(ClusterFilter):
    name = django_filters.CharFilter(lookup_expr="icontains", help_text="part of the name")
    health = django_filters.ChoiceFilter(choices=Node.Health.choices)
    pool = django_filters.CharFilter()
    leaf_switch = django_filters.CharFilter()
    in_service = django_filters.BooleanFilter()
    slurm_state = django_filters.CharFilter(lookup_expr="iexact")

    class Meta:
        model = Node
        fields = ["cluster", "name", "health", "pool", "leaf_switch", "in_service", "slurm_state"]


class GpuFilter(django_filters.FilterSet):
    cluster = django_filters.CharFilter(field_name="node__cluster__name", help_text="cluster name")
    node = django_filters.CharFilter(field_name="node__name", help_text="node name")
    health = django_filters.ChoiceFilter(choices=Node.Health.choices)
    index = IntegerFilter()
    last_xid = IntegerFilter(help_text="the last XID code seen on the GPU")

    class Meta:
        model = Gpu
        fields = ["cluster", "node", "health", "index", "last_xid"]


class JobFilter(ClusterFilter):
    state = django_filters.CharFilter(lookup_expr="iexact", help_text="Slurm state, e.g. RUNNING")
    user = django_filters.CharFilter(lookup_expr="iexact")
    node = django_filters.CharFilter(method="_node", help_text="jobs that ran on this node")

    class Meta:
        model = Job
        fields = ["cluster", "state", "user", "node"]

    def _node(self, qs: QuerySet[Job], name: str, value: str) -> QuerySet[Job]:
        return qs.filter(nodes__icontains=json_list_has(value))


class SignalFilter(ClusterFilter):
    source = django_filters.ChoiceFilter(choices=Signal.Source.choices)
    kind = django_filters.CharFilter(help_text="xid, slurm_node_state, pushed_kernel, ...")
    node = django_filters.CharFilter(field_name="node_name", help_text="node name")
    job = django_filters.CharFilter(field_name="job_id", help_text="Slurm job id")
    gpu = IntegerFilter(field_name="gpu_index", help_text="GPU index on its node")
    code = IntegerFilter(help_text="XID or other numeric code")
    since = UtcDateTimeFilter(field_name="observed_at", lookup_expr="gte")
    until = UtcDateTimeFilter(field_name="observed_at", lookup_expr="lte")

    class Meta:
        model = Signal
        fields = ["cluster", "source", "kind", "node", "job", "gpu", "code", "since", "until"]


class IncidentFilter(ClusterFilter):
    status = django_filters.ChoiceFilter(choices=Incident.Status.choices)
    open = django_filters.BooleanFilter(method="_open", help_text="true: not resolved yet")
    root_cause = django_filters.ChoiceFilter(choices=RootCause.choices)
    node = django_filters.CharFilter(method="_node",
                                     help_text="incidents that blame this node or leaf switch")
    job = django_filters.CharFilter(method="_job", help_text="incidents that hit this job")
    since = UtcDateTimeFilter(field_name="opened_at", lookup_expr="gte",
                                             help_text="opened at or after")
    until = UtcDateTimeFilter(field_name="opened_at", lookup_expr="lte",
                                             help_text="opened at or before")

    class Meta:
        model = Incident
        fields = ["cluster", "status", "open", "root_cause", "node", "job", "since", "until"]

    def _open(self, qs: QuerySet[Incident], name: str, value: bool) -> QuerySet[Incident]:
        resolved = Q(status=Incident.Status.RESOLVED)
        return qs.exclude(resolved) if value else qs.filter(resolved)

    def _node(self, qs: QuerySet[Incident], name: str, value: str) -> QuerySet[Incident]:
        return qs.filter(Q(nodes__icontains=json_list_has(value)) | Q(switch=value))

    def _job(self, qs: QuerySet[Incident], name: str, value: str) -> QuerySet[Incident]:
        return qs.filter(jobs__icontains=json_list_has(value))


class RemediationFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=Remediation.Status.choices)
    mode = django_filters.ChoiceFilter(choices=Remediation.Mode.choices)
    playbook = django_filters.CharFilter()
    incident = IntegerFilter(field_name="incident_id")

    class Meta:
        model = Remediation
        fields = ["status", "mode", "playbook", "incident"]


class StepFilter(django_filters.FilterSet):
    remediation = IntegerFilter(field_name="remediation_id")
    incident = IntegerFilter(field_name="remediation__incident_id")
    status = django_filters.ChoiceFilter(choices=Step.Status.choices)
    kind = django_filters.CharFilter(help_text="drain_and_cancel, replace_node, ...")

    class Meta:
        model = Step
        fields = ["remediation", "incident", "status", "kind"]


class AuditFilter(django_filters.FilterSet):
    actor = django_filters.CharFilter(help_text="exactly: system, user:NAME or token:NAME")
    verb = django_filters.CharFilter(lookup_expr="startswith",
                                     help_text="a verb or its prefix: remediation. matches all")
    target = django_filters.CharFilter(lookup_expr="icontains")
    ok = django_filters.BooleanFilter(help_text="false: the failed calls and refusals")
    incident = IntegerFilter(field_name="incident_id")
    remediation = IntegerFilter(field_name="remediation_id")
    step = IntegerFilter(field_name="step_id")
    since = UtcDateTimeFilter(field_name="at", lookup_expr="gte")
    until = UtcDateTimeFilter(field_name="at", lookup_expr="lte")

    class Meta:
        model = AuditEntry
        fields = ["actor", "verb", "target", "ok", "incident", "remediation", "step", "since",
                  "until"]
