"""The capacity page, its chart, a loan's page, and the buttons: lend (one click, after a
confirmation that says what runs), approve, decline, return, retry. Thin: read through the
selectors, change through the services, check the operator role on every POST (who may open
a page at all is the project's PageAccessMiddleware's)."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from collectors.clients.base import ClientError
from collectors.models import Cluster
from collectors.roles import actor_name
from collectors.sources import cluster_names
from collectors.views import json_answer
from incidents.lending import selectors, services
from incidents.lending.steps import LEND_STEPS, RETURN_STEPS, TITLES
from incidents.models import AuditEntry, Loan
from incidents.status import InvalidTransition
from incidents.views import _require_operator

# The actions a loan's buttons post (the URL takes only these).
LOAN_ACTIONS = ("approve", "decline", "return", "retry")
DONE = {
    "approve": "Approved: it runs now.",
    "decline": "Declined.",
    "return": "Returning to training.",
    "retry": "Running the stopped step again.",
}


def _cluster(request: HttpRequest) -> Cluster:
    try:
        if request.method == "GET":
            return services.cluster_to_read(request.GET.get("cluster"))
        return services.cluster_named(request.POST.get("cluster"))
    except ClientError as exc:
        raise Http404(str(exc)) from None


def _back(cluster: Cluster) -> HttpResponse:
    return redirect(f"{reverse('capacity')}?cluster={cluster.name}")


def capacity_page(request: HttpRequest) -> HttpResponse:
    cluster = _cluster(request)
    span = request.GET.get("range", "day")
    return render(request, "incidents/capacity.html", {
        **selectors.capacity(cluster), "chart_range": span if span in selectors.CHART_RANGES
        else "day", "chart_ranges": list(selectors.CHART_RANGES), "clusters": cluster_names(),
        "category_labels": selectors.CATEGORY_LABELS, "categories": selectors.CATEGORIES})


def capacity_chart(request: HttpRequest) -> JsonResponse:
    span = request.GET.get("range", "day")
    if span not in selectors.CHART_RANGES:
        return JsonResponse({"detail": f"range: expected one of "
                                       f"{', '.join(selectors.CHART_RANGES)}"}, status=400)
    return json_answer(selectors.capacity_chart(_cluster(request), span,
                                                request.GET.get("pool")))


def _step_states(loan: Loan) -> list[dict[str, str]]:
    """Each step of the lend and the return, and where the loan stands in them: done, under
    way (or stopped there), to come, or not reached (a lend given up before its end)."""
    lend, back = list(LEND_STEPS), list(RETURN_STEPS)
    states: dict[str, str] = {}
    if loan.status == Loan.Status.RETURNED:
        states = {**dict.fromkeys(lend, "done" if loan.lent_at else "not reached"),
                  **dict.fromkeys(back, "done")}
    elif loan.status in (Loan.Status.LENT, Loan.Status.RETURN_PROPOSED):
        states = dict.fromkeys(lend, "done")
    elif loan.step in lend or loan.step in back:
        order = lend if loan.step in lend else back
        at = order.index(loan.step)
        states = {name: "done" if i < at else "stopped" if i == at and loan.status ==
                  Loan.Status.FAILED else "under way" if i == at else "" for i, name in
                  enumerate(order)}
        if order is back:
            states.update(dict.fromkeys(lend, "done" if loan.lent_at else "not reached"))
    return [{"name": name, "title": TITLES[name], "state": states.get(name, "")}
            for name in (*lend, *back)]


def loan_detail(request: HttpRequest, loan: int) -> HttpResponse:
    row = get_object_or_404(Loan.objects.select_related("cluster"), pk=loan)
    return render(request, "incidents/loan_detail.html", {
        "loan": row, "steps": _step_states(row),
        "audit": AuditEntry.objects.filter(data__loan=row.pk).order_by("at", "id")})


@require_POST
def capacity_lend(request: HttpRequest) -> HttpResponse:
    _require_operator(request)
    cluster = _cluster(request)
    node = request.POST.get("node", "").strip()
    try:
        loan = services.loan_lend(cluster, node, actor=actor_name(request.user),
                                  reason=request.POST.get("reason", "").strip()[:500]
                                  or "lent by hand from the capacity page")
    except InvalidTransition as exc:
        messages.warning(request, f"Not lent: {exc}")
        if request.headers.get("Accept") == "application/json":
            return JsonResponse({"error": str(exc)}, status=409)
        return _back(cluster)
    messages.success(request, f"Lending {node} to inference (loan {loan.pk}): it drains in "
                              "Slurm, then becomes schedulable in Kubernetes.")
    return _back(cluster)


@require_POST
def loan_action(request: HttpRequest, loan: int, action: str) -> HttpResponse:
    _require_operator(request)
    row = get_object_or_404(Loan.objects.select_related("cluster"), pk=loan)
    actor = actor_name(request.user)
    try:
        if action == "approve":
            services.loan_approve(row.pk, actor=actor)
        elif action == "decline":
            services.loan_decline(row.pk, actor=actor)
        elif action == "return":
            services.loan_return(row.pk, actor=actor, reason=request.POST.get(
                "reason", "").strip()[:500] or "returned by hand from the capacity page")
        elif action == "retry":
            services.loan_retry(row.pk, actor=actor)
        else:
            raise Http404("no such action")
    except InvalidTransition as exc:
        messages.warning(request, str(exc))
        if request.headers.get("Accept") == "application/json":
            return JsonResponse({"error": str(exc)}, status=409)
        return _back(row.cluster)
    messages.success(request, f"Loan {row.pk} of {row.node}: {DONE[action]}")
    return _back(row.cluster)
