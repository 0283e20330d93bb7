"""Pages. Thin: read through selectors, change through services, check roles on every POST."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from collectors import simulation
from collectors.clients.base import ClientError
from collectors.models import SourceHealth
from incidents import selectors, services
from incidents.audit import actor_name, audit_record
from incidents.models import Incident, Remediation, Step
from incidents.remediation.playbooks import playbook_get


def _require_operator(request: HttpRequest) -> None:
    if not request.user.has_perm("incidents.operate"):
        raise PermissionDenied("operators only")


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "incidents/dashboard.html", _dashboard_context())


@login_required
def dashboard_live(request: HttpRequest) -> HttpResponse:
    return render(request, "partials/dashboard_live.html", _dashboard_context())


def _dashboard_context() -> dict[str, object]:
    return {
        "counts": selectors.fleet_counts(),
        "open_incidents": selectors.incidents_open()[:50],
        "recent": Incident.objects.filter(status=Incident.Status.RESOLVED)[:10],
        "sources": SourceHealth.objects.all(),
    }


@login_required
def gpu_grid(request: HttpRequest) -> JsonResponse:
    return JsonResponse(selectors.gpu_grid())


@login_required
def incident_list(request: HttpRequest) -> HttpResponse:
    incidents = Incident.objects.all()
    status = request.GET.get("status")
    if status in Incident.Status.values:
        incidents = incidents.filter(status=status)
    return render(request, "incidents/incident_list.html",
                  {"incidents": incidents[:200], "status": status,
                   "statuses": Incident.Status.choices})


def _incident_context(incident: Incident) -> dict[str, object]:
    remediation = selectors.remediation_current(incident)
    playbook = playbook_get(incident.playbook)
    steps = list(remediation.steps.all()) if remediation else []
    return {
        "incident": incident,
        "remediation": remediation,
        "steps": steps,
        "awaiting_step": next((s for s in steps if s.status == Step.Status.AWAITING_APPROVAL),
                              None),
        "playbook": playbook,
        "timeline": selectors.incident_timeline(incident),
        "can_start": remediation is None or remediation.status in (
            Remediation.Status.CANCELLED, Remediation.Status.FAILED,
            Remediation.Status.OBSERVED),
    }


@login_required
def incident_detail(request: HttpRequest, pk: int) -> HttpResponse:
    incident = get_object_or_404(Incident, pk=pk)
    return render(request, "incidents/incident_detail.html", _incident_context(incident))


@login_required
def incident_live(request: HttpRequest, pk: int) -> HttpResponse:
    incident = get_object_or_404(Incident, pk=pk)
    return render(request, "partials/incident_live.html", _incident_context(incident))


@login_required
def incident_chart(request: HttpRequest, pk: int) -> JsonResponse:
    incident = get_object_or_404(Incident, pk=pk)
    return JsonResponse(selectors.incident_chart(incident))


@login_required
def incident_replay(request: HttpRequest, pk: int) -> JsonResponse:
    incident = get_object_or_404(Incident, pk=pk)
    response = JsonResponse(selectors.incident_replay(incident), json_dumps_params={"indent": 1})
    response["Content-Disposition"] = f'attachment; filename="incident-{pk}.replay.json"'
    return response


ACTIONS = {
    "approve": services.remediation_approve,
    "continue": services.remediation_continue,
    "cancel": services.remediation_cancel,
    "retry": services.remediation_retry,
}


@login_required
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
            remediation_id = int(request.POST.get("remediation", "0") or 0)
            rem = get_object_or_404(Remediation, pk=remediation_id, incident=incident)
            ACTIONS[action](rem.pk, request.user)
            messages.success(request, f"Remediation {action} done.")
        else:
            return HttpResponse(f"unknown action {action!r}", status=400)
    except services.InvalidTransition as exc:
        messages.warning(request, str(exc))
        if request.headers.get("Accept") == "application/json":
            return JsonResponse({"error": str(exc)}, status=409)
    return redirect("incident-detail", pk=incident.pk)


@login_required
@require_POST
def inject_fault(request: HttpRequest) -> HttpResponse:
    """The demo's "inject fault" control: only on the simulated fleet, only for operators."""
    if not settings.FLEETWATCH_DEMO_CONTROLS:
        raise PermissionDenied("demo controls are off")
    _require_operator(request)
    kind = request.POST.get("kind", "xid")
    try:
        what = simulation.fault_inject(
            kind, node=request.POST.get("node", ""), gpu=int(request.POST.get("gpu") or 0),
            code=int(request.POST.get("code") or 79), switch=request.POST.get("switch", ""),
        )
    except (ClientError, ValueError) as exc:
        messages.error(request, f"Not injected: {exc}")
        return redirect("dashboard")
    audit_record("demo.inject", what, actor=actor_name(request.user), result=what)
    messages.success(request, f"Injected {what}. The next collection picks it up.")
    return redirect("dashboard")
