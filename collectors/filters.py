"""The fleet's list filters (django-filter): one filter set per model, used by its page and by
its API endpoint alike, so a parameter means the same on both (``/nodes/?q=gpu`` and
``/api/v1/nodes/?q=gpu``), and a value that does not parse is a 400 naming the parameter on
both: never ignored, so a typo cannot silently widen a list.

Times are ISO 8601 (``2026-12-03T10:00:00Z``; without an offset, UTC); ``since`` is inclusive,
``until`` too. Nodes and jobs are named as the sources name them (``gpu-003``, Slurm job ids).

The building blocks (``FilterSet``, ``YesNoFilter``, ``IntegerFilter``, ...) serve the
incidents app's filter sets as well."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from django import forms
from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet
from django.utils import timezone
from django.utils.choices import CallableChoiceIterator
from django_filters import rest_framework as django_filters
from django_filters.fields import IsoDateTimeField

from collectors.models import Cluster, Gpu, Job, Node, Signal
from collectors.selectors import json_list_has

# "Last hour / day / week / month": the quick time ranges the lists offer.
RANGES = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7),
          "30d": timedelta(days=30)}
RANGE_CHOICES = [("1h", "last hour"), ("24h", "last 24 hours"), ("7d", "last 7 days"),
                 ("30d", "last 30 days")]

INT64_MAX = 2**63 - 1


class FilterForm(forms.Form):
    """A filter set's form. Iterating it (as the pages' filter form does) gives the fields its
    page shows, in their order, and any other field given a bad value (so its error shows);
    validation covers every field."""

    shown: ClassVar[tuple[str, ...]] = ()

    def __iter__(self) -> Iterator[forms.BoundField]:
        if not self.shown:
            yield from super().__iter__()
            return
        names = [n for n in self.shown if n in self.fields]
        names += [n for n in self.fields if n not in names and n in self.errors]
        for name in names:
            yield self[name]


class FilterSet(django_filters.FilterSet):
    """The base of every list filter. ``page_fields``: the parameters the page's form shows,
    in its order (the others work there too, for links that carry them). ``page_labels``: the
    form's words for them, set on each instance rather than on the filter, because the API
    documents a parameter by its label where it has no help text, and a form's words ("From
    (UTC)" beside a date box) can be wrong for the API. ``page_help``: the form's help texts
    (the filters' own describe the API's parameters)."""

    page_fields: ClassVar[tuple[str, ...]] = ()
    page_labels: ClassVar[dict[str, str]] = {}
    page_help: ClassVar[dict[str, str]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, filter_ in self.filters.items():
            # A filter's help text is the API's description of it; the page's form has its
            # own (``page_help``), or none.
            filter_.extra.pop("help_text", None)
            if name in self.page_help:
                filter_.extra["help_text"] = self.page_help[name]
            if name in self.page_labels:
                filter_.label = self.page_labels[name]
            _refresh(filter_)

    def get_form_class(self) -> type[forms.Form]:
        form = super().get_form_class()
        return type(form.__name__, (FilterForm, form), {"shown": self.page_fields})

    def page_choices(self, name: str, choices: Any, empty_label: str = "any") -> None:
        """Offer ``choices`` (pairs, or a callable giving them) in a select on the page,
        without making the parameter refuse other values: the API takes any."""
        def options() -> list[tuple[str, str]]:
            return [("", empty_label), *(choices() if callable(choices) else choices)]
        self.filters[name].extra["widget"] = forms.Select(choices=CallableChoiceIterator(options))
        _refresh(self.filters[name])


def _refresh(filter_: django_filters.Filter) -> None:
    # A filter builds its form field once and keeps it (the schema generator may have built
    # it already, on the class's filter, before this instance copied it).
    filter_.__dict__.pop("_field", None)


class IntegerFilter(django_filters.NumberFilter):
    """A whole number a 64-bit column can hold, for ids and codes. Anything else (``abc``,
    ``1.5``, ``1e999``, twenty digits) is a form error naming the parameter: the API answers
    400, the pages show the error. django-filter's NumberFilter takes decimals of any size,
    and SQLite cannot even compare one beyond 64 bits with a key (OverflowError: a 500)."""

    field_class = forms.IntegerField  # type: ignore[assignment]  # whole numbers, not decimals

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("min_value", -INT64_MAX - 1)
        kwargs.setdefault("max_value", INT64_MAX)
        super().__init__(*args, **kwargs)


class _YesNoSelect(forms.Select):
    def __init__(self, attrs: dict[str, Any] | None = None) -> None:
        super().__init__(attrs, choices=[("", "any"), ("yes", "yes"), ("no", "no")])

    def format_value(self, value: Any) -> list[str]:
        # A link with ?open=true selects "yes"; a bad value selects nothing (its error shows).
        text = str(value).strip().lower() if value is not None else ""
        return [_YES_NO.get(text, text)]


_TRUE, _FALSE = ("yes", "true", "1"), ("no", "false", "0")
_YES_NO = {**dict.fromkeys(_TRUE, "yes"), **dict.fromkeys(_FALSE, "no")}


class YesNoField(forms.Field):
    """yes/no (the pages' words) or true/false, 1/0 (the API's): a bool, None when empty.
    Anything else is an error, not an ignored parameter."""

    widget = _YesNoSelect
    default_error_messages = {
        "invalid_choice": "Select a valid choice. %(value)s is not one of the available choices.",
    }

    def to_python(self, value: Any) -> bool | None:
        if value in (None, ""):
            return None
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValidationError(self.error_messages["invalid_choice"], code="invalid_choice",
                              params={"value": value})


class YesNoFilter(django_filters.BooleanFilter):
    """A yes/no parameter (documented as a boolean): see YesNoField."""

    field_class = YesNoField  # type: ignore[assignment]  # a bool or None, as NullBooleanField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Not django-filter's BooleanWidget, which reads "yes" (or any typo) as no value.
        kwargs.setdefault("widget", _YesNoSelect)
        super().__init__(*args, **kwargs)


class UtcDateTimeField(IsoDateTimeField):
    def to_python(self, value: Any) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        # Given in UTC to the database: PostgreSQL refuses offsets beyond 15:59 (ISO 8601
        # allows 23:59), and an error there would be a 500 for what is bad input.
        try:
            return parsed.astimezone(UTC)
        except OverflowError:
            raise ValidationError("Date/time out of range.", code="invalid") from None


class _DateTimeLocal(forms.DateTimeInput):
    input_type = "datetime-local"

    def __init__(self) -> None:
        super().__init__(format="%Y-%m-%dT%H:%M")


class UtcDateTimeFilter(django_filters.IsoDateTimeFilter):
    """A time, with or without its offset (a page's date box sends none: UTC)."""

    field_class = UtcDateTimeField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("widget", _DateTimeLocal())
        super().__init__(*args, **kwargs)


def choice(**kwargs: Any) -> django_filters.ChoiceFilter:
    # "any" reads better than Django's "---------" as the no-filter choice.
    return django_filters.ChoiceFilter(**{"empty_label": "any", **kwargs})


def since(field: str) -> Callable[[QuerySet[Any], str, str], QuerySet[Any]]:
    """A ``range`` filter's method: rows whose ``field`` is within the chosen range."""
    def method(qs: QuerySet[Any], name: str, value: str) -> QuerySet[Any]:
        delta = RANGES.get(value)
        return qs.filter(**{f"{field}__gte": timezone.now() - delta}) if delta else qs
    return method


def cluster_choices() -> list[tuple[str, str]]:
    return [(c, c) for c in Cluster.objects.order_by("name").values_list("name", flat=True)]


def _drained_q() -> Q:
    return (Q(slurm_flags__icontains=json_list_has("DRAIN"))
            | Q(slurm_flags__icontains=json_list_has("DRAINED")))


class NodeFilter(FilterSet):
    cluster = django_filters.CharFilter(field_name="cluster__name", help_text="cluster name")
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains",
                                  help_text="part of the name (the page's search box; as name)")
    name = django_filters.CharFilter(lookup_expr="icontains", help_text="part of the name")
    # The page offers the states the fleet has; any state is taken, in any case.
    slurm_state = django_filters.CharFilter(lookup_expr="iexact")
    drained = YesNoFilter(method="_drained", help_text="true: drained in Slurm (DRAIN or "
                                                       "DRAINED among its flags)")
    health = choice(choices=Node.Health.choices)
    pool = django_filters.CharFilter()
    # A text box with suggestions, not a select: a big fleet has hundreds of leaf switches.
    leaf_switch = django_filters.CharFilter(widget=forms.TextInput(
        attrs={"list": "leaf-switches", "size": 10}))
    in_service = YesNoFilter()

    page_fields = ("cluster", "q", "slurm_state", "drained", "health", "pool", "leaf_switch",
                   "in_service")
    page_labels = {"q": "Name", "slurm_state": "Slurm state", "drained": "Drained",
                   "leaf_switch": "Leaf switch", "in_service": "In service"}

    class Meta:
        model = Node
        fields = ["cluster", "q", "name", "slurm_state", "drained", "health", "pool",
                  "leaf_switch", "in_service"]

    def __init__(self, *args: Any, facets: dict[str, list[str]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if facets is not None:
            # The page's selects offer the values the fleet has (read once by the view).
            for name, key in (("slurm_state", "slurm_states"), ("pool", "pools")):
                self.page_choices(name, [(v, v) for v in facets[key]])
            self.page_choices("cluster", cluster_choices)

    def _drained(self, qs: QuerySet[Node], name: str, value: bool) -> QuerySet[Node]:
        return qs.filter(_drained_q()) if value else qs.exclude(_drained_q())


class GpuFilter(FilterSet):
    cluster = django_filters.CharFilter(field_name="node__cluster__name", help_text="cluster name")
    node = django_filters.CharFilter(field_name="node__name", help_text="node name")
    health = django_filters.ChoiceFilter(choices=Node.Health.choices)
    index = IntegerFilter()
    last_xid = IntegerFilter(help_text="the last XID code seen on the GPU")

    class Meta:
        model = Gpu
        fields = ["cluster", "node", "health", "index", "last_xid"]


class JobFilter(FilterSet):
    cluster = django_filters.CharFilter(field_name="cluster__name", help_text="cluster name")
    q = django_filters.CharFilter(method="_search", help_text="the Slurm job id, or part of "
                                                              "the job's name")
    # The page offers the states the jobs have; any state is taken, in any case.
    state = django_filters.CharFilter(lookup_expr="iexact", help_text="Slurm state, e.g. RUNNING")
    user = django_filters.CharFilter(lookup_expr="iexact")
    node = django_filters.CharFilter(method="_node", help_text="jobs that ran on this node")

    page_fields = ("cluster", "q", "state", "user", "node")
    page_labels = {"q": "Job id or name", "node": "Node"}

    class Meta:
        model = Job
        fields = ["cluster", "q", "state", "user", "node"]

    def __init__(self, *args: Any, facets: dict[str, list[str]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if facets is not None:
            self.page_choices("state", [(v, v) for v in facets["states"]])
            self.page_choices("cluster", cluster_choices)

    def _search(self, qs: QuerySet[Job], name: str, value: str) -> QuerySet[Job]:
        return qs.filter(Q(slurm_id=value) | Q(name__icontains=value))

    def _node(self, qs: QuerySet[Job], name: str, value: str) -> QuerySet[Job]:
        return qs.filter(nodes__icontains=json_list_has(value))


class SignalFilter(FilterSet):
    cluster = django_filters.CharFilter(field_name="cluster__name", help_text="cluster name")
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
