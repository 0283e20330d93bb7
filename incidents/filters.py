"""The pages' list filters (django-filter, as the API uses): what a person can narrow a list
by. Each list view applies one to a selector's queryset."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import django_filters
from django import forms
from django.db.models import Q, QuerySet
from django.utils import timezone

from collectors.models import Cluster, Job, Node
from incidents.models import AuditEntry, Incident, RootCause
from incidents.selectors import json_list_has

# "Last hour / day / week / month": the quick time ranges every list offers.
RANGES = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7),
          "30d": timedelta(days=30)}
RANGE_CHOICES = [("1h", "last hour"), ("24h", "last 24 hours"), ("7d", "last 7 days"),
                 ("30d", "last 30 days")]
YES_NO = [("yes", "yes"), ("no", "no")]


INT64_MAX = 2**63 - 1


class IntegerFilter(django_filters.NumberFilter):
    """A whole number a 64-bit column can hold, for ids and codes. Anything else (``abc``,
    ``1.5``, ``1e999``, twenty digits) is a form error naming the parameter: the API answers
    400, the pages show the error. django-filter's NumberFilter takes decimals of any size,
    and SQLite cannot even compare one beyond 64 bits with a key (OverflowError: a 500)."""

    field_class = forms.IntegerField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("min_value", -INT64_MAX - 1)
        kwargs.setdefault("max_value", INT64_MAX)
        super().__init__(*args, **kwargs)


class _DateTimeLocal(forms.DateTimeInput):
    input_type = "datetime-local"

    def __init__(self) -> None:
        super().__init__(format="%Y-%m-%dT%H:%M")


def _since(field: str) -> Any:
    def method(qs: QuerySet[Any], name: str, value: str) -> QuerySet[Any]:
        delta = RANGES.get(value)
        return qs.filter(**{f"{field}__gte": timezone.now() - delta}) if delta else qs
    return method


def _choice(**kwargs: Any) -> django_filters.ChoiceFilter:
    # "any" reads better than Django's "---------" as the no-filter choice.
    return django_filters.ChoiceFilter(**{"empty_label": "any", **kwargs})


def _cluster_choices() -> list[tuple[str, str]]:
    return [(c, c) for c in Cluster.objects.order_by("name").values_list("name", flat=True)]


class NodeFilter(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name")
    slurm_state = _choice(label="Slurm state", choices=[])
    drained = _choice(label="Drained", choices=YES_NO, method="_drained")
    health = _choice(choices=Node.Health.choices)
    pool = _choice(choices=[])
    # A text box with suggestions, not a select: a big fleet has hundreds of leaf switches.
    leaf_switch = django_filters.CharFilter(label="Leaf switch", widget=forms.TextInput(
        attrs={"list": "leaf-switches", "size": 10}))
    in_service = _choice(label="In service", choices=YES_NO,
                                             method="_in_service")

    class Meta:
        model = Node
        fields = ["q", "slurm_state", "drained", "health", "pool", "leaf_switch", "in_service"]

    def __init__(self, *args: Any, facets: dict[str, list[str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The choices are the values the fleet has (read once by the view's selector).
        for name, key in (("slurm_state", "slurm_states"), ("pool", "pools")):
            self.filters[name].extra["choices"] = [(v, v) for v in facets[key]]

    def _drained(self, qs: QuerySet[Node], name: str, value: str) -> QuerySet[Node]:
        drained = (Q(slurm_flags__icontains=json_list_has("DRAIN"))
                   | Q(slurm_flags__icontains=json_list_has("DRAINED")))
        return qs.filter(drained) if value == "yes" else qs.exclude(drained)

    def _in_service(self, qs: QuerySet[Node], name: str, value: str) -> QuerySet[Node]:
        return qs.filter(in_service=value == "yes")


class JobFilter(django_filters.FilterSet):
    q = django_filters.CharFilter(method="_search", label="Job id or name")
    state = _choice(choices=[])
    user = django_filters.CharFilter(lookup_expr="iexact")
    node = django_filters.CharFilter(method="_node", label="Node")

    class Meta:
        model = Job
        fields = ["q", "state", "user", "node"]

    def __init__(self, *args: Any, facets: dict[str, list[str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters["state"].extra["choices"] = [(v, v) for v in facets["states"]]

    def _search(self, qs: QuerySet[Job], name: str, value: str) -> QuerySet[Job]:
        return qs.filter(Q(slurm_id=value) | Q(name__icontains=value))

    def _node(self, qs: QuerySet[Job], name: str, value: str) -> QuerySet[Job]:
        return qs.filter(nodes__icontains=json_list_has(value))


class IncidentFilter(django_filters.FilterSet):
    status = _choice(choices=Incident.Status.choices)
    open = _choice(label="Open", choices=YES_NO, method="_open")
    root_cause = _choice(label="Root cause", choices=RootCause.choices)
    cluster = _choice(field_name="cluster__name", choices=_cluster_choices)
    node = django_filters.CharFilter(method="_node", label="Node")
    range = _choice(label="Opened", choices=RANGE_CHOICES,
                                        method=_since("opened_at"))
    since = django_filters.DateTimeFilter(field_name="opened_at", lookup_expr="gte",
                                          label="Opened from (UTC)", widget=_DateTimeLocal())
    until = django_filters.DateTimeFilter(field_name="opened_at", lookup_expr="lte",
                                          label="Opened until (UTC)", widget=_DateTimeLocal())

    class Meta:
        model = Incident
        fields = ["status", "open", "root_cause", "cluster", "node", "range", "since", "until"]

    def _open(self, qs: QuerySet[Incident], name: str, value: str) -> QuerySet[Incident]:
        resolved = Q(status=Incident.Status.RESOLVED)
        return qs.exclude(resolved) if value == "yes" else qs.filter(resolved)

    def _node(self, qs: QuerySet[Incident], name: str, value: str) -> QuerySet[Incident]:
        return qs.filter(Q(nodes__icontains=json_list_has(value)) | Q(switch=value))


class AuditFilter(django_filters.FilterSet):
    actor = django_filters.CharFilter(lookup_expr="icontains",
                                      help_text="system, user:NAME, token:NAME")
    verb = django_filters.CharFilter(lookup_expr="startswith", help_text="e.g. remediation.")
    target = django_filters.CharFilter(lookup_expr="icontains")
    incident = IntegerFilter(field_name="incident_id", label="Incident #", min_value=1)
    failed = _choice(empty_label="all", label="Failed calls only", choices=[("yes", "yes")],
                                         method="_failed")
    range = _choice(label="When", choices=RANGE_CHOICES, method=_since("at"))
    since = django_filters.DateTimeFilter(field_name="at", lookup_expr="gte",
                                          label="From (UTC)", widget=_DateTimeLocal())
    until = django_filters.DateTimeFilter(field_name="at", lookup_expr="lte",
                                          label="Until (UTC)", widget=_DateTimeLocal())

    class Meta:
        model = AuditEntry
        fields = ["actor", "verb", "target", "incident", "failed", "range", "since", "until"]

    def _failed(self, qs: QuerySet[AuditEntry], name: str, value: str) -> QuerySet[AuditEntry]:
        return qs.filter(ok=False) if value == "yes" else qs
