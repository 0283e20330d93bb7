"""The incidents app's pages (the fleet's own, nodes, jobs, GPUs and sources, are in
collectors/views.py). Thin: read through selectors, change through services, check roles on
every POST.

Who may open a page at all (a signed-in person with a role, as for the API) is checked for
every view here by fleetwatch.middleware.PageAccessMiddleware."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import BadRequest, ImproperlyConfigured, PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.utils.crypto import get_random_string
from django.views.decorators.http import require_POST

from collectors import selectors as fleet_selectors
from collectors.clients.base import ClientError
from collectors.roles import ADMIN, actor_name, role_of
from collectors.sim import faults
from collectors.views import grid_group, json_answer, list_page
from incidents import deliveries, drills, lifecycle, oncall, selectors, why
from incidents.audit import audit_record
from incidents.filters import AuditFilter, DrillFilter, IncidentFilter
from incidents.forms import AssignForm, NoteForm, ResolveForm, SeverityForm
from incidents.models import Drill, Incident, Remediation, Step
from incidents.remediation import transitions
from incidents.remediation.playbooks import playbook_get
from incidents.status import InvalidTransition
from incidents.tables import AuditTable, DrillTable, IncidentTable


def _require_operator(request: HttpRequest) -> None:
    if not request.user.has_perm("incidents.operate"):
        raise PermissionDenied("operators only")


def _dashboard_context(request: HttpRequest) -> dict[str, object]:
    group, given = grid_group(request)
    return selectors.dashboard(request.GET.get("by", "leaf"), group, group_given=given,
                               cluster=request.GET.get("cluster") or None)


def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "incidents/dashboard.html", _dashboard_context(request))


def dashboard_live(request: HttpRequest) -> HttpResponse:
    # ``live``: the answer carries a <title> with the attention count, which htmx puts on
    # the tab (a first render has it in <head>).
    return render(request, "partials/dashboard_live.html",
                  {**_dashboard_context(request), "live": True})


def incident_list(request: HttpRequest) -> HttpResponse:
    filters = IncidentFilter(request.GET, queryset=selectors.incidents_for_list())
    return list_page(request, "incidents/incident_list.html", filters,
                     IncidentTable(filters.qs))


def _incident_context(request: HttpRequest, incident: Incident) -> dict[str, object]:
    remediation = selectors.remediation_current(incident)
    playbook = playbook_get(incident.playbook)
    steps = list(remediation.steps.all()) if remediation else []
    failed_step = next((s for s in steps if s.status == Step.Status.FAILED), None)
    return {
        "incident": incident,
        "title": selectors.incident_title(incident),
        "remediation": remediation,
        "steps": steps,
        "awaiting_step": next((s for s in steps if s.status == Step.Status.AWAITING_APPROVAL),
                              None),
        "playbook": playbook,
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


def incident_detail(request: HttpRequest, pk: int, forms: dict[str, object] | None = None,
                    status: int = 200) -> HttpResponse:
    """The incident page. ``forms``: on-call forms refused, shown again with what was typed."""
    incident = get_object_or_404(Incident.objects.select_related("cluster", "owner"), pk=pk)
    span = request.GET.get("range", "incident")
    return render(request, "incidents/incident_detail.html", {
        **_incident_context(request, incident), **_timeline_context(request, incident),
        **_oncall_context(incident, forms or {}),
        "chart_range": span if span in selectors.CHART_RANGES else "incident",
        "chart_ranges": selectors.CHART_RANGE_LABELS}, status=status)


def incident_live(request: HttpRequest, pk: int) -> HttpResponse:
    incident = get_object_or_404(Incident.objects.select_related("owner"), pk=pk)
    return render(request, "partials/incident_live.html",
                  {**_incident_context(request, incident), **_oncall_context(incident, {})})


def _timeline_context(request: HttpRequest, incident: Incident) -> dict[str, object]:
    kinds = selectors.timeline_kinds(request.GET.getlist("show"))
    # The timeline region polls with the page's filter form (hx-include), so what it shows
    # follows the boxes ticked since the page loaded.
    return {"timeline": selectors.incident_timeline(incident, kinds), "timeline_shown": kinds,
            "timeline_kinds": selectors.TIMELINE_KINDS}


def incident_timeline(request: HttpRequest, pk: int) -> HttpResponse:
    """The incident's timeline, filtered as the page asks (``show``: TIMELINE_KINDS)."""
    incident = get_object_or_404(Incident, pk=pk)
    return render(request, "partials/incident_timeline.html",
                  {"incident": incident, **_timeline_context(request, incident)})


def incident_chart(request: HttpRequest, pk: int) -> JsonResponse:
    incident = get_object_or_404(Incident, pk=pk)
    span = request.GET.get("range", "incident")
    if span not in selectors.CHART_RANGES:
        return JsonResponse({"detail": f"range: expected one of "
                                       f"{', '.join(selectors.CHART_RANGES)}"}, status=400)
    return json_answer(selectors.incident_chart(incident, span))


def job_chart(request: HttpRequest, slurm_id: str) -> JsonResponse:
    """The job's GPUs over its life, the fault that stopped it marked (its page's chart)."""
    job = fleet_selectors.job_get(slurm_id, request.GET.get("cluster"))
    if job is None:
        raise Http404(f"no job {slurm_id}")
    return json_answer(why.job_chart(job))


def incident_replay(request: HttpRequest, pk: int) -> JsonResponse:
    incident = get_object_or_404(Incident, pk=pk)
    response = json_answer(selectors.incident_replay(incident), json_dumps_params={"indent": 1})
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
    "approve": transitions.remediation_approve,
    "continue": transitions.remediation_continue,
    "cancel": transitions.remediation_cancel,
    "retry": transitions.remediation_retry,
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
PAGE_ACTIONS = ("start", *ACTIONS, *("acknowledge", "take", "assign", "severity", "note",
                                     "resolve"))


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
            opened = transitions.remediation_open(incident, actor=actor_name(request.user),
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
        else:  # the on-call's own (or a 404)
            refused = _oncall_act(request, incident, action)
            if refused is not None:
                return refused
    except InvalidTransition as exc:
        messages.warning(request, str(exc))
        if request.headers.get("Accept") == "application/json":
            return JsonResponse({"error": str(exc)}, status=409)
    return redirect("incident-detail", pk=incident.pk)


# --- the person on call: acknowledge, own, severity, notes, resolve (incidents.oncall) --------


def _oncall_context(incident: Incident, forms: dict[str, object]) -> dict[str, object]:
    return {
        "note_form": forms.get("note") or NoteForm(initial={"key": get_random_string(24)}),
        "resolve_form": forms.get("resolve") or ResolveForm(),
        "severity_form": SeverityForm(initial={"severity": incident.severity}),
        "assign_form": AssignForm(initial={
            "owner": incident.owner.get_username() if incident.owner else None}),
        "oncall_open": forms.get("open", ""),
    }


ONCALL_DONE = {
    "acknowledge": "Acknowledged: you have it.",
    "take": "You own this incident now.",
    "note": "Note added to the timeline.",
    "resolve": "Resolved.",
}


def _oncall_act(request: HttpRequest, incident: Incident, action: str) -> HttpResponse | None:
    """One on-call action from the page. Input it refuses: the page again, 400, with what was
    typed and why; a state it does not fit: InvalidTransition, for incident_action to say."""
    actor = actor_name(request.user)
    if action == "acknowledge":
        lifecycle.incident_acknowledge(incident.pk, actor=actor)
    elif action == "take":
        oncall.incident_assign(incident.pk, request.user, actor=actor)  # type: ignore[arg-type]
    elif action == "assign":
        assign = AssignForm(request.POST)
        if not assign.is_valid():
            raise BadRequest(f"owner: {assign.errors.get('owner', ['invalid'])[0]}")
        owner = assign.cleaned_data["owner"]
        oncall.incident_assign(incident.pk, owner, actor=actor)
        messages.success(request, f"Owner: {owner.get_username()}." if owner else "No owner now.")
        return None
    elif action == "severity":
        severity = SeverityForm(request.POST)
        if not severity.is_valid():
            raise BadRequest(f"severity: {severity.errors['severity'][0]}")
        updated = oncall.incident_severity_set(incident.pk, severity.cleaned_data["severity"],
                                               actor=actor)
        messages.success(request, f"Severity: {updated.get_severity_display()}.")
        return None
    elif action == "note":
        note = NoteForm(request.POST)
        if not note.is_valid():
            return incident_detail(request, incident.pk, {"note": note, "open": "note"}, 400)
        oncall.incident_note_add(incident.pk, note.cleaned_data["text"], actor=actor,
                                 key=note.cleaned_data["key"])
    elif action == "resolve":
        resolve = ResolveForm(request.POST)
        if not resolve.is_valid():
            return incident_detail(request, incident.pk, {"resolve": resolve,
                                                          "open": "resolve"}, 400)
        lifecycle.incident_resolve_by_hand(incident.pk, actor=actor,
                                           note=resolve.cleaned_data["note"])
    else:
        raise Http404("no such action")
    messages.success(request, ONCALL_DONE[action])
    return None


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
            cluster=request.POST.get("cluster") or None,
        )
    except (ClientError, ValueError, ImproperlyConfigured) as exc:
        messages.error(request, f"Not injected: {exc}")
        return redirect("dashboard")
    audit_record("demo.inject", what, actor=actor_name(request.user), result=what)
    messages.success(request, f"Injected {what}. The next collection picks it up.")
    return redirect("dashboard")


def audit_list(request: HttpRequest) -> HttpResponse:
    filters = AuditFilter(request.GET, queryset=selectors.audit_for_list())
    return list_page(request, "incidents/audit_list.html", filters, AuditTable(filters.qs),
                     verify=selectors.audit_verify_status())


def audit_verify(request: HttpRequest) -> HttpResponse:
    """Walk the audit chain now (it reads the whole table: only when asked). htmx swaps the
    result into the audit page; without JavaScript, back to the page, which shows it."""
    verify = selectors.audit_verify_status(run=True)
    if request.headers.get("HX-Request"):
        return render(request, "partials/audit_verify.html", {"verify": verify})
    return redirect("audit-list")


def policy_page(request: HttpRequest) -> HttpResponse:
    return render(request, "incidents/policy.html", selectors.policy_overview())


# --- fire drills (incidents.drills) -------------------------------------------------------------


def drill_list(request: HttpRequest) -> HttpResponse:
    filters = DrillFilter(request.GET, queryset=selectors.drills_for_list())
    return list_page(request, "incidents/drill_list.html", filters, DrillTable(filters.qs),
                     drill_settings=selectors.drill_settings(),
                     running=Drill.objects.filter(status=Drill.Status.RUNNING).first())


def drill_detail(request: HttpRequest, pk: int) -> HttpResponse:
    drill = get_object_or_404(Drill.objects.select_related("cluster", "signal"), pk=pk)
    return render(request, "incidents/drill_detail.html", selectors.drill_report(drill))


def drill_live(request: HttpRequest, pk: int) -> HttpResponse:
    """The report's live part (result, phases, timeline), which the page polls while the
    drill runs."""
    drill = get_object_or_404(Drill.objects.select_related("cluster", "signal"), pk=pk)
    return render(request, "partials/drill_report.html", selectors.drill_report(drill))


@require_POST
def drill_run(request: HttpRequest) -> HttpResponse:
    """The drills page's "run a drill now": operators only; a second press while one runs
    starts nothing and says which one runs."""
    _require_operator(request)
    try:
        started = drills.drill_start(trigger=Drill.Trigger.MANUAL,
                                     actor=actor_name(request.user))
    except drills.DrillError as exc:
        messages.error(request, f"No drill started: {exc}")
        return redirect("drill-list")
    drill = started.drill
    if started.created:
        messages.success(request, f"Fire drill #{drill.pk} started ({drill.mode} mode, budget "
                                  f"{drill.budget_seconds:g} s): this page follows it.")
    else:
        messages.info(request, f"Fire drill #{drill.pk} is already running (started "
                               f"{drill.started_at:%H:%M:%S} UTC by "
                               f"{drill.requested_by}); no second drill was started.")
    return redirect("drill-detail", pk=drill.pk)
