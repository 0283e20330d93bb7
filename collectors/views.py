"""The fleet's pages: nodes, jobs, the GPU grid and the sources. Thin: they read through
collectors.selectors and change nothing.

Who may open a page at all (a signed-in person with a role, as for the API) is checked for
every view by the project's PageAccessMiddleware. The list helpers here (paging, the status
of a filtered list, JSON that survives stored non-finite readings) serve incidents' pages
too."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django_tables2 import RequestConfig
from django_tables2.export import TableExport

from collectors import selectors
from collectors.filters import JobFilter, NodeFilter
from collectors.models import Node, json_safe
from collectors.tables import JobTable, ListTable, NodeTable

PAGE_SIZE = 50
# The query parameter that asks a list for its CSV (django-tables2's ExportMixin's name).
EXPORT_PARAM = "_export"


def list_status(filters: Any) -> int:
    """A filter value that does not parse (an incident number that is not one) shows the
    list with the form's error, as a 400, as the API answers: never silently unfiltered."""
    return 400 if filters.is_bound and not filters.is_valid() else 200


def json_answer(data: Any, **kwargs: Any) -> JsonResponse:
    # A stored non-finite reading (PostgreSQL's float8 keeps Infinity) would be written as the
    # token Infinity, which browsers' JSON.parse refuses: the chart would break.
    return JsonResponse(json_safe(data), **kwargs)


def list_page(request: HttpRequest, template: str, filters: Any, table: ListTable,
              **context: Any) -> HttpResponse:
    """A list page: the filtered rows as a sortable table, one page of it; or, with
    ``?_export=csv``, the whole filtered and sorted list as a CSV download."""
    RequestConfig(request, paginate={"per_page": PAGE_SIZE}).configure(table)
    status = list_status(filters)
    if request.GET.get(EXPORT_PARAM) == "csv" and status == 200:
        return TableExport("csv", table).response(
            f"fleetwatch-{table.export_name}.csv")
    return render(request, template, {"filter": filters, "table": table, **context},
                  status=status)


def grid_group(request: HttpRequest) -> tuple[str | None, bool]:
    """The grid's group from the query: ``group=*`` all nodes, ``group=`` the nodes with no
    leaf (or pool), absent: the dashboard chooses."""
    group = request.GET.get("group")
    return (None if group == "*" else group), group is not None


def gpu_grid(request: HttpRequest) -> JsonResponse:
    return json_answer(selectors.gpu_grid(request.GET.get("by", "leaf"), grid_group(request)[0],
                                          request.GET.get("cluster") or None))


def node_list(request: HttpRequest) -> HttpResponse:
    facets = selectors.node_facets()
    filters = NodeFilter(request.GET, queryset=selectors.nodes_for_list(), facets=facets)
    return list_page(request, "incidents/node_list.html", filters, NodeTable(filters.qs),
                     facets=facets)


def _node_or_404(request: HttpRequest, name: str) -> Node:
    node = selectors.node_get(name, request.GET.get("cluster"))
    if node is None:
        raise Http404(f"no node {name}")
    return node


def node_detail(request: HttpRequest, name: str) -> HttpResponse:
    node = _node_or_404(request, name)
    # What is stored, and what the sources say now (GPU readings, pods): the latter within a
    # few seconds, or the page says why not.
    return render(request, "incidents/node_detail.html",
                  {**selectors.node_detail(node), **selectors.node_live(node)})


def node_telemetry(request: HttpRequest, name: str) -> JsonResponse:
    node = _node_or_404(request, name)
    try:
        minutes = min(max(int(request.GET.get("minutes", "60")), 1), 24 * 60)
    except ValueError:
        minutes = 60
    return json_answer(selectors.node_telemetry(node, minutes))


def job_list(request: HttpRequest) -> HttpResponse:
    filters = JobFilter(request.GET, queryset=selectors.jobs_for_list(),
                        facets=selectors.job_facets())
    return list_page(request, "incidents/job_list.html", filters, JobTable(filters.qs))


def job_detail(request: HttpRequest, slurm_id: str) -> HttpResponse:
    job = selectors.job_get(slurm_id, request.GET.get("cluster"))
    if job is None:
        raise Http404(f"no job {slurm_id}")
    return render(request, "incidents/job_detail.html", selectors.job_detail(job))


def source_list(request: HttpRequest) -> HttpResponse:
    return render(request, "incidents/source_list.html",
                  {"sources": selectors.sources_overview()})
