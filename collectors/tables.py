"""The Nodes and Jobs lists as django-tables2 tables: every column sorts (``?sort=``, in the
database, so a sorted page is the right page of the whole list) and the whole filtered list
exports as CSV (``?_export=csv``). Cells render as the pages always showed them; each
``value_*`` is the same fact as plain text for the CSV.

Incidents' lists (incidents, audit) are in incidents/tables.py, on the same base."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import django_tables2 as tables
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from collectors.models import Job, Node


def iso(value: datetime | None) -> str:
    """A time for the CSV: ISO 8601 in UTC, as the API writes it."""
    return "" if value is None else value.astimezone(UTC).isoformat(timespec="seconds").replace(
        "+00:00", "Z")


def time_column(verbose_name: str, full: bool = False) -> tables.TemplateColumn:
    """A time as the pages show it (the ``when``/``ago`` filters of incidents' template tags,
    through the template engine: collectors do not import incidents); ISO UTC in the CSV."""
    return tables.TemplateColumn(
        "{% load fleetwatch_ui %}{{ value|" + ("when" if full else "ago") + " }}",
        verbose_name=verbose_name)


# A cell a spreadsheet would run as a formula (a job's name is whatever its user typed).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(value: Any) -> Any:
    """A text cell that starts like a formula, quoted with a leading apostrophe (OWASP's
    advice for CSV injection); numbers, and the lists' "-" for nothing, stay as they are."""
    if not isinstance(value, str) or value == "-" or not value.startswith(FORMULA_START):
        return value
    try:
        float(value)
    except ValueError:
        return "'" + value
    return value


class ListTable(tables.Table):
    """The lists' common shape: our table template (sortable headers with aria-sort, the
    site's pager), a CSV name, and CSV cells a spreadsheet will not run."""

    export_name = "list"

    def as_values(self, exclude_columns: Any = None) -> Any:
        for row in super().as_values(exclude_columns):
            yield [csv_safe(cell) for cell in row]

    class Meta:
        template_name = "partials/table.html"
        attrs = {"class": "sortable"}


class NodeTable(ListTable):
    export_name = "nodes"
    name = tables.Column(verbose_name="Node")
    health = tables.Column()
    slurm = tables.Column(verbose_name="Slurm", accessor="slurm_state",
                          order_by=("slurm_state", "name"))
    kubernetes = tables.Column(verbose_name="Kubernetes", accessor="k8s_ready_status",
                               order_by=("k8s_ready_status", "k8s_unschedulable", "name"))
    nic_state = tables.Column(verbose_name="NIC", default="-")
    gpus = tables.Column(verbose_name="GPUs", accessor="gpus_healthy",
                         order_by=("gpus_failed", "gpus_healthy", "name"))
    pool = tables.Column(default="-")
    leaf_switch = tables.Column(verbose_name="Leaf", default="-")
    cluster = tables.Column(verbose_name="Cluster", accessor="cluster__name")
    updated_at = time_column("Updated")

    class Meta(ListTable.Meta):
        model = Node
        fields = ("name", "health", "slurm", "kubernetes", "nic_state", "gpus", "pool",
                  "leaf_switch", "cluster", "updated_at")
        row_attrs = {"data-testid": lambda record: f"node-row-{record.name}"}

    def render_name(self, record: Node) -> SafeString:
        url = reverse("node-detail", args=[record.name])
        return format_html(
            '<a href="{}?cluster={}">{}</a>{}{}', url, record.cluster.name, record.name,
            format_html(' <span class="muted small">Slurm: {}</span>', record.slurm_name)
            if record.slurm_name else "",
            SafeString(' <span class="badge">out of service</span>')
            if not record.in_service else "")

    def value_name(self, record: Node) -> str:
        return record.name

    def render_health(self, record: Node) -> SafeString:
        return format_html('<span class="badge h-{}">{}</span>', record.health,
                           record.get_health_display())

    def value_health(self, record: Node) -> str:
        return record.health

    def render_slurm(self, record: Node) -> SafeString:
        return format_html("{}{}", record.slurm_display, format_html(
            '<div class="muted small">{}</div>', record.slurm_reason)
            if record.slurm_reason else "")

    def value_slurm(self, record: Node) -> str:
        return record.slurm_display + (f" ({record.slurm_reason})" if record.slurm_reason else "")

    def render_kubernetes(self, record: Node) -> SafeString:
        ready = render_to_string("partials/k8s_ready.html",
                                 {"status": record.k8s_ready_status}).strip()
        return format_html("{}{}", SafeString(ready),
                           " · cordoned" if record.k8s_unschedulable else "")

    def value_kubernetes(self, record: Node) -> str:
        ready = {"True": "ready", "False": "not ready", "Unknown": "unknown"}.get(
            record.k8s_ready_status, "not reported")
        return ready + (", cordoned" if record.k8s_unschedulable else "")

    def render_gpus(self, record: Any) -> SafeString:
        return format_html("{}/{} ok{}", record.gpus_healthy, record.gpus_total, format_html(
            ' · <span class="bad-t">{} failed</span>', record.gpus_failed)
            if record.gpus_failed else "")

    def value_gpus(self, record: Any) -> str:
        return f"{record.gpus_healthy}/{record.gpus_total} healthy, {record.gpus_failed} failed"

    def value_updated_at(self, value: datetime) -> str:
        return iso(value)


class JobTable(ListTable):
    export_name = "jobs"
    slurm_id = tables.Column(verbose_name="Job")
    name = tables.Column()
    user = tables.Column()
    state = tables.Column(default="-")
    nodes = tables.Column(verbose_name="Nodes", order_by=("nodes", "slurm_id"))
    restart_count = tables.Column(verbose_name="Restarts")
    step = tables.Column(verbose_name="Step / checkpoint", empty_values=(),
                         order_by=("step", "checkpoint_step"))
    cluster = tables.Column(verbose_name="Cluster", accessor="cluster__name")
    updated_at = time_column("Updated")

    class Meta(ListTable.Meta):
        model = Job
        fields = ("slurm_id", "name", "user", "state", "nodes", "restart_count", "step",
                  "cluster", "updated_at")
        row_attrs = {"data-testid": lambda record: f"job-row-{record.slurm_id}"}

    def render_slurm_id(self, record: Job) -> SafeString:
        return format_html('<a href="{}?cluster={}">{}</a>',
                           reverse("job-detail", args=[record.slurm_id]), record.cluster.name,
                           record.slurm_id)

    def value_slurm_id(self, record: Job) -> str:
        return record.slurm_id

    def render_nodes(self, value: list[str]) -> int:
        return len(value)

    def value_nodes(self, value: list[str]) -> str:
        # The CSV has the names themselves (the page only has room for how many).
        return " ".join(value)

    def render_step(self, record: Job) -> str:
        def dash(v: int | None) -> str:
            return "-" if v is None else str(v)
        return f"{dash(record.step)} / {dash(record.checkpoint_step)}"

    def value_updated_at(self, value: datetime) -> str:
        return iso(value)


