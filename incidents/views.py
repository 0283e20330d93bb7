"""Pages. Thin: read through selectors, change through services, check roles on every POST.

Who may open a page at all (a signed-in person with a role, as for the API) is checked for
every view here by fleetwatch.middleware.PageAccessMiddleware."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import BadRequest, PermissionDenied
from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_POST

from collectors.clients.base import ClientError
from collectors.models import json_safe
from collectors.roles import ADMIN, actor_name, role_of
from collectors.sim import faults
from incidents import deliveries, selectors, services
from incidents.audit import audit_record
from incidents.filters import AuditFilter, IncidentFilter, JobFilter, NodeFilter
from incidents.models import Incident, Remediation, Step
from incidents.remediation.playbooks import playbook_get

PAGE_SIZE = 50


def _require_operator(request: HttpRequest) -> None:
    if not request.user.has_perm("incidents.operate"):
        raise PermissionDenied("operators only")


def _list_status(filters: Any) -> int:
    # A filter value that does not parse (an incident number that is not one) shows the list
    # with the form's error, as a 400, as the API answers: never silently unfiltered.
    return 400 if filters.is_bound and not filters.is_valid() else 200


def _json(data: Any, **kwargs: Any) -> JsonResponse:
    # A stored non-finite reading (PostgreSQL's float8 keeps Infinity) would be written as the
    # token Infinity, which browsers' JSON.parse refuses: the chart would break.
    return JsonResponse(json_safe(data), **kwargs)


def _paginate(request: HttpRequest, rows: QuerySet[Any], per_page: int = PAGE_SIZE) -> Page:
    # get_page: a page number out of range shows the last page rather than an error.
    return Paginator(rows, per_page).get_page(request.GET.get("page"))


def _grid_group(request: HttpRequest) -> tuple[str | None, bool]:
    """The grid's group from the query: ``group=*`` all nodes, ``group=`` the nodes with no
    leaf (or pool), absent: the dashboard chooses."""
    group = request.GET.get("group")
    return (None if group == "*" else group), group is not None


def _dashboard_context(request: HttpRequest) -> dict[str, object]:
    group, given = _grid_group(request)
    return selectors.dashboard(request.GET.get("by", "leaf"), group, group_given=given)


def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "incidents/dashboard.html", _dashboard_context(request))


def dashboard_live(request: HttpRequest) -> HttpResponse:
    return render(request, "partials/dashboard_live.html", _dashboard_context(request))


def gpu_grid(request: HttpRequest) -> JsonResponse:
    return _json(selectors.gpu_grid(request.GET.get("by", "leaf"), _grid_group(request)[0]))


def node_list(request: HttpRequest) -> HttpResponse:
    facets = selectors.node_facets()
    filters = NodeFilter(request.GET, queryset=selectors.nodes_for_list(), facets=facets)
    page = _paginate(request, filters.qs)
    return render(request, "incidents/node_list.html", {
        "filter": filters, "page": page, "facets": facets,
        "rows": selectors.nodes_gpu_summary(list(page))}, status=_list_status(filters))


def _node_or_404(request: HttpRequest, name: str) -> Any:
    node = selectors.node_get(name, request.GET.get("cluster"))
    if node is None:
        raise Http404(f"no node {name}")
    return node


def node_detail(request: HttpRequest, name: str) -> HttpResponse:
    node = _node_or_404(request, name)
    return render(request, "incidents/node_detail.html", selectors.node_detail(node))


def node_telemetry(request: HttpRequest, name: str) -> JsonResponse:
    node = _node_or_404(request, name)
    try:
        minutes = min(max(int(request.GET.get("minutes", "60")), 1), 24 * 60)
    except ValueError:
        minutes = 60
    return _json(selectors.node_telemetry(node, minutes))


def job_list(request: HttpRequest) -> HttpResponse:
    filters = JobFilter(request.GET, queryset=selectors.jobs_for_list(),
                        facets=selectors.job_facets())
    return render(request, "incidents/job_list.html",
                  {"filter": filters, "page": _paginate(request, filters.qs)},
                  status=_list_status(filters))


def job_detail(request: HttpRequest, slurm_id: str) -> HttpResponse:
    job = selectors.job_get(slurm_id, request.GET.get("cluster"))
    if job is None:
        raise Http404(f"no job {slurm_id}")
    return render(request, "incidents/job_detail.html", selectors.job_detail(job))


def incident_list(request: HttpRequest) -> HttpResponse:
    filters = IncidentFilter(request.GET, queryset=selectors.incidents_for_list())
    return render(request, "incidents/incident_list.html",
                  {"filter": filters, "page": _paginate(request, filters.qs)},
                  status=_list_status(filters))


def _incident_context(request: HttpRequest, incident: Incident) -> dict[str, object]:
    remediation = selectors.remediation_current(incident)
    playbook = playbook_get(incident.playbook)
    steps = list(remediation.steps.all()) if remediation else []
    failed_step = next((s for s in steps if s.status == Step.Status.FAILED), None)
    return {
        "incident": incident,
        "remediation": remediation,
        "steps": steps,
        "awaiting_step": next((s for s in steps if s.status == Step.Status.AWAITING_APPROVAL),
                              None),
        "playbook": playbook,
        "timeline": selectors.incident_timeline(incident),
        "deliveries": deliveries.incident_deliveries(incident.pk),
        # What a webhook receiver answered may hold internal details: admins only, as in the API.
        "show_receiver_answers": role_of(request.user) == ADMIN,
        "can_start": remediation is None or remediation.status in (
            Remediation.Status.CANCELLED, Remediation.Status.FAILED,
            Remediation.Status.OBSERVED),
        # Retry is offered only where the service accepts it: a failed remediation with a
        # failed step.
        "failed_step": failed_step if remediation and
        remediation.status == Remediation.Status.FAILED else None,
        "steps_after_failed": [s for s in steps if failed_step and s.order > failed_step.order],
        "pending_steps": [s for s in steps if s.status in (Step.Status.PENDING,
                                                          Step.Status.BLOCKED)],
    }


def incident_detail(request: HttpRequest, pk: int) -> HttpResponse:
    incident = get_object_or_404(Incident.objects.select_related("cluster"), pk=pk)
    return render(request, "incidents/incident_detail.html", _incident_context(request, incident))


def incident_live(request: HttpRequest, pk: int) -> HttpResponse:
    incident = get_object_or_404(Incident, pk=pk)
    return render(request, "partials/incident_live.html", _incident_context(request, incident))


def incident_chart(request: HttpRequest, pk: int) -> JsonResponse:
    incident = get_object_or_404(Incident, pk=pk)
    return _json(selectors.incident_chart(incident))


def incident_replay(request: HttpRequest, pk: int) -> JsonResponse:
    incident = get_object_or_404(Incident, pk=pk)
    response = _json(selectors.incident_replay(incident), json_dumps_params={"indent": 1})
    response["Content-Disposition"] = f'attachment; filename="incident-{pk}.replay.json"'
    return response


def incident_postmortem(request: HttpRequest, pk: int) -> HttpResponse:
    """The incident as a Markdown postmortem, ready to paste into a review document."""
    incident = get_object_or_404(Incident.objects.select_related("cluster"), pk=pk)
    text = render_to_string("incidents/postmortem.md", selectors.incident_postmortem(incident))
    response = HttpResponse(text, content_type="text/markdown; charset=utf-8")
    response["Content-Disposition"] = f'inline; filename="incident-{pk}-postmortem.md"'
    return response


ACTIONS = {
    "approve": services.remediation_approve,
    "continue": services.remediation_continue,
    "cancel": services.remediation_cancel,
    "retry": services.remediation_retry,
}
# What the person sees after a confirmed click.
DONE_MESSAGES = {
    "approve": "Approved: the remediation runs now.",
    "continue": "Continued: the remediation goes on.",
    "cancel": "Cancelled: nothing more will run; what was done stays done.",
    "retry": "Retrying the failed step.",
}
# Every action a page may post; the URL takes only these (incidents/urls.py), so an unknown
# one is the site's 404 page.
PAGE_ACTIONS = ("start", *ACTIONS)


def _form_id(request: HttpRequest, name: str) -> int:
    """An id from a form field; a missing or malformed one is a 400 (not a 500 from int())."""
    value = request.POST.get(name, "").strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        raise BadRequest(f"{name}: expected an id (digits)")
    return int(value)


@require_POST
def incident_action(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    _require_operator(request)
    incident = get_object_or_404(Incident, pk=pk)
    try:
        if action == "start":
            opened = services.remediation_open(incident, actor=actor_name(request.user),
                                               user=request.user)
            if opened.created:
                messages.success(request, "Remediation started.")
            else:
                messages.info(request, f"Nothing started: remediation {opened.remediation.pk} "
                                       f"is already {opened.remediation.get_status_display()}.")
        elif action in ACTIONS:
            rem = get_object_or_404(Remediation, pk=_form_id(request, "remediation"),
                                    incident=incident)
            ACTIONS[action](rem.pk, request.user)
            messages.success(request, DONE_MESSAGES[action])
        else:
            raise Http404("no such action")
    except services.InvalidTransition as exc:
        messages.warning(request, str(exc))
        if request.headers.get("Accept") == "application/json":
            return JsonResponse({"error": str(exc)}, status=409)
    return redirect("incident-detail", pk=incident.pk)


@require_POST
def inject_fault(request: HttpRequest) -> HttpResponse:
    """The demo's "inject fault" control: only on the simulated fleet, only for operators."""
    if not settings.FLEETWATCH_DEMO_CONTROLS:
        raise PermissionDenied("demo controls are off")
    _require_operator(request)
    kind = request.POST.get("kind", "xid")
    try:
        what = faults.fault_inject(
            kind, node=request.POST.get("node", ""), gpu=int(request.POST.get("gpu") or 0),
            code=int(request.POST.get("code") or 79), switch=request.POST.get("switch", ""),
        )
    except (ClientError, ValueError) as exc:
        messages.error(request, f"Not injected: {exc}")
        return redirect("dashboard")
    audit_record("demo.inject", what, actor=actor_name(request.user), result=what)
    messages.success(request, f"Injected {what}. The next collection picks it up.")
    return redirect("dashboard")


def audit_list(request: HttpRequest) -> HttpResponse:
    filters = AuditFilter(request.GET, queryset=selectors.audit_for_list())
    return render(request, "incidents/audit_list.html", {
        "filter": filters, "page": _paginate(request, filters.qs),
        "verify": selectors.audit_verify_status()}, status=_list_status(filters))


def audit_verify(request: HttpRequest) -> HttpResponse:
    """Walk the audit chain now (it reads the whole table: only when asked). htmx swaps the
    result into the audit page; without JavaScript, back to the page, which shows it."""
    verify = selectors.audit_verify_status(run=True)
    if request.headers.get("HX-Request"):
        return render(request, "partials/audit_verify.html", {"verify": verify})
    return redirect("audit-list")


def source_list(request: HttpRequest) -> HttpResponse:
    return render(request, "incidents/source_list.html",
                  {"sources": selectors.sources_overview()})


def policy_page(request: HttpRequest) -> HttpResponse:
    return render(request, "incidents/policy.html", selectors.policy_overview())
