"""The incidents app's REST endpoints under /api/v1/: incidents, remediations, steps, the
audit trail, the policy and API tokens (the fleet's are collectors/api/views.py). Thin: they
validate input, read through the selectors and change state only through the services, as
the pages do.

Each view says in ``access`` what each of its calls needs (collectors/api/permissions.py);
the schema prints it in every operation's description.

Objects are addressed by id, tokens by name.

Answers: 400 with the fields at fault; 404 naming what was not found; 409 when an action does
not fit the current state (with ``status``, the state it is in)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from collectors import selectors as fleet_selectors
from collectors.api.pagination import AuditCursor
from collectors.api.permissions import ADMIN_ONLY, OPERATE, READ, READ_ONLY
from collectors.api.serializers import ConflictSerializer
from collectors.api.views import NamedNotFound
from collectors.roles import actor_from_request
from incidents import drills, filters, lifecycle, oncall, selectors
from incidents.api.serializers import (
    AssignSerializer,
    AuditEntrySerializer,
    AuditVerifySerializer,
    DrillConflictSerializer,
    DrillReportSerializer,
    DrillSerializer,
    IncidentSerializer,
    JobWhySerializer,
    NoteOutSerializer,
    NoteSerializer,
    PolicySerializer,
    RemediationSerializer,
    ResolveSerializer,
    SeveritySerializer,
    StepSerializer,
    TimelineItemSerializer,
    TokenCreatedSerializer,
    TokenCreateSerializer,
    TokenSerializer,
)
from incidents.models import ApiToken, AuditEntry, Drill, Incident, Remediation, Step
from incidents.remediation import transitions
from incidents.status import InvalidTransition
from incidents.tokens import TokenError, token_create, token_revoke
from incidents.why import job_why

CONFLICT = OpenApiResponse(ConflictSerializer, description="Does not fit the current state")


def conflict(detail: str, state: str) -> Response:
    return Response({"detail": detail, "status": state}, status=status.HTTP_409_CONFLICT)


# --- incidents and their repair -------------------------------------------------------------


def _remediation_act(request: Request, fn: Callable[..., Remediation],
                     rem: Remediation) -> Response:
    """Run one of the remediation services; 409 with the state when it does not fit."""
    try:
        # Named as the token when a program called (token:NAME), else the person.
        fn(rem.pk, request.user, actor=actor_from_request(request))
    except InvalidTransition as exc:
        rem.refresh_from_db()
        return conflict(str(exc), rem.status)
    rem = Remediation.objects.prefetch_related("steps").get(pk=rem.pk)
    return Response(RemediationSerializer(rem).data)


ACTION_RESPONSES = {200: RemediationSerializer, 409: CONFLICT}


class IncidentViewSet(NamedNotFound, viewsets.ReadOnlyModelViewSet):
    """Incidents: what broke, why, and what FleetWatch did about it."""

    serializer_class = IncidentSerializer
    queryset = selectors.incidents_for_list().prefetch_related("remediations__steps")
    filterset_class = filters.IncidentFilter
    ordering_fields = ["opened_at", "detected_at", "resolved_at", "confidence"]
    access = {**READ_ONLY, "timeline": READ, "replay": READ, "acknowledge": OPERATE,
              "remediate": OPERATE, "approve": OPERATE, "cancel": OPERATE, "resolve": OPERATE,
              "assign": OPERATE, "severity": OPERATE, "notes": OPERATE}

    def _fresh(self, pk: int) -> Response:
        return Response(IncidentSerializer(self.get_queryset().get(pk=pk)).data)

    @extend_schema(responses=TimelineItemSerializer(many=True))
    @action(detail=True, methods=["get"], filter_backends=[], pagination_class=None)
    def timeline(self, request: Request, pk: str | None = None) -> Response:
        """The incident's story in time order: the signals around it, the diagnosis, each
        step of its repair and every audit entry (as on the incident page)."""
        items = selectors.incident_timeline(self.get_object())
        return Response(TimelineItemSerializer(items, many=True).data)

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["get"], filter_backends=[], pagination_class=None)
    def replay(self, request: Request, pk: str | None = None) -> Response:
        """The incident's signals as a replay file (shared/REPLAY.md)."""
        return Response(selectors.incident_replay(self.get_object()))

    @extend_schema(request=None, responses={200: IncidentSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def acknowledge(self, request: Request, pk: str | None = None) -> Response:
        """Say someone has it. Once: a second acknowledgement answers 409 naming the first."""
        incident = self.get_object()
        try:
            lifecycle.incident_acknowledge(incident.pk, actor=actor_from_request(request))
        except InvalidTransition as exc:
            return conflict(str(exc), incident.status)
        return self._fresh(incident.pk)

    @extend_schema(request=None, responses={201: RemediationSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def remediate(self, request: Request, pk: str | None = None) -> Response:
        """Start the incident's remediation, as a person pressing "start": its playbook runs
        in auto mode (risky steps keep their own modes). 409 when one is already running,
        waiting or succeeded, when the incident is resolved, or when no playbook fits."""
        incident = self.get_object()
        try:
            opened = transitions.remediation_open(incident, actor=actor_from_request(request),
                                               user=request.user)
        except InvalidTransition as exc:
            return conflict(str(exc), incident.status)
        rem = Remediation.objects.prefetch_related("steps").get(pk=opened.remediation.pk)
        if not opened.created:
            return conflict(f"remediation {rem.pk} is already {rem.get_status_display()}; "
                            "nothing started", rem.status)
        return Response(RemediationSerializer(rem).data, status=status.HTTP_201_CREATED)

    def _live(self, incident: Incident) -> Remediation | Response:
        rem = selectors.remediation_live(incident)
        if rem is None:
            return conflict(f"incident {incident.pk} has no remediation running or waiting "
                            "for a person", incident.status)
        return rem

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: str | None = None) -> Response:
        """Approve the incident's remediation waiting for a person (or its risky step)."""
        rem = self._live(self.get_object())
        if isinstance(rem, Response):
            return rem
        return _remediation_act(request, transitions.remediation_approve, rem)

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel the incident's live remediation: what was done stays done."""
        rem = self._live(self.get_object())
        if isinstance(rem, Response):
            return rem
        return _remediation_act(request, transitions.remediation_cancel, rem)

    @extend_schema(request=ResolveSerializer, responses={200: IncidentSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def resolve(self, request: Request, pk: str | None = None) -> Response:
        """Say it is over (fixed by hand, or not a fault). A remediation still waiting for
        approval is cancelled; one running must be cancelled first (409)."""
        incident = self.get_object()
        body = ResolveSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            lifecycle.incident_resolve_by_hand(incident.pk, actor=actor_from_request(request),
                                              note=body.validated_data["note"])
        except InvalidTransition as exc:
            incident.refresh_from_db()
            return conflict(str(exc), incident.status)
        return self._fresh(incident.pk)


    # --- the person on call (incidents.oncall) ---

    @extend_schema(request=AssignSerializer, responses={200: IncidentSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def assign(self, request: Request, pk: str | None = None) -> Response:
        """Give the incident an owner (an operator's or admin's username), or none (null).
        409 when it already has that owner, or is resolved."""
        incident = self.get_object()
        body = AssignSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            oncall.incident_assign(incident.pk, body.validated_data["owner"],
                                   actor=actor_from_request(request))
        except InvalidTransition as exc:
            return conflict(str(exc), incident.status)
        return self._fresh(incident.pk)

    @extend_schema(request=SeveritySerializer,
                   responses={200: IncidentSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def severity(self, request: Request, pk: str | None = None) -> Response:
        """Set the incident's severity (it starts at its root cause's default). 409 when it
        already has that severity."""
        incident = self.get_object()
        body = SeveritySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            oncall.incident_severity_set(incident.pk, body.validated_data["severity"],
                                         actor=actor_from_request(request))
        except InvalidTransition as exc:
            return conflict(str(exc), incident.status)
        return self._fresh(incident.pk)

    @extend_schema(request=NoteSerializer, responses={201: NoteOutSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def notes(self, request: Request, pk: str | None = None) -> Response:
        """Write a note on the incident's timeline (it is an audit entry: who, when, text).
        Empty text: 400. A second note with the same ``key``: 409."""
        incident = self.get_object()
        body = NoteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            entry = oncall.incident_note_add(incident.pk, body.validated_data["text"],
                                             actor=actor_from_request(request),
                                             key=body.validated_data["key"])
        except oncall.OnCallError as exc:
            raise ValidationError({"text": [str(exc).removeprefix("text: ")]}) from None
        except InvalidTransition as exc:
            return conflict(str(exc), incident.status)
        return Response(NoteOutSerializer(entry).data, status=status.HTTP_201_CREATED)


class RemediationViewSet(NamedNotFound, viewsets.ReadOnlyModelViewSet):
    """Remediations, and the actions a person takes on one. An action that does not fit the
    remediation's state (approving one that already finished, or that someone else approved
    a moment ago) answers 409 with what it is now."""

    serializer_class = RemediationSerializer
    queryset = Remediation.objects.select_related("incident").prefetch_related(
        "steps").order_by("-created_at", "-id")
    filterset_class = filters.RemediationFilter
    ordering_fields = ["created_at", "started_at", "finished_at"]
    access = {**READ_ONLY, "approve": OPERATE, "continue_": OPERATE, "cancel": OPERATE,
              "retry": OPERATE}

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: str | None = None) -> Response:
        """Approve a remediation waiting for a person, or the risky step it stopped at."""
        return _remediation_act(request, transitions.remediation_approve, self.get_object())

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"], url_path="continue")
    def continue_(self, request: Request, pk: str | None = None) -> Response:
        """Override a blocking check (or an observe-mode step) and let the playbook go on."""
        return _remediation_act(request, transitions.remediation_continue, self.get_object())

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Stop it: nothing more runs; what was done stays done."""
        return _remediation_act(request, transitions.remediation_cancel, self.get_object())

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        """Run the failed step of a failed remediation again."""
        return _remediation_act(request, transitions.remediation_retry, self.get_object())


class StepViewSet(NamedNotFound, viewsets.ReadOnlyModelViewSet):
    """The steps of remediations, each with what it did and what it is waiting for."""

    serializer_class = StepSerializer
    queryset = Step.objects.select_related("remediation").order_by("-remediation_id", "order")
    filterset_class = filters.StepFilter
    ordering_fields = ["started_at", "finished_at", "order"]
    access = {**READ_ONLY, "retry": OPERATE}

    @extend_schema(request=None, responses={200: StepSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        """Run this step again: it must be the failed step of a failed remediation. The
        calls it completed before it failed are not made again."""
        step = self.get_object()
        rem = step.remediation
        if step.status != Step.Status.FAILED or rem.status != Remediation.Status.FAILED:
            return conflict(f"step {step.pk} is {step.get_status_display()} in a remediation "
                            f"that is {rem.get_status_display()}; only the failed step of a "
                            "failed remediation can be retried", step.status)
        try:
            transitions.remediation_retry(rem.pk, request.user, actor=actor_from_request(request))
        except InvalidTransition as exc:
            step.refresh_from_db()
            return conflict(str(exc), step.status)
        step.refresh_from_db()
        return Response(StepSerializer(step).data)


class AuditEntryViewSet(NamedNotFound, viewsets.ReadOnlyModelViewSet):
    """The audit trail: read-only, oldest first (the chain's order), cursor-paged."""

    serializer_class = AuditEntrySerializer
    queryset = AuditEntry.objects.all()
    pagination_class = AuditCursor
    filter_backends = [DjangoFilterBackend]
    filterset_class = filters.AuditFilter
    access = {**READ_ONLY, "verify": READ}

    @extend_schema(responses=AuditVerifySerializer)
    @action(detail=False, methods=["get"], filter_backends=[], pagination_class=None)
    def verify(self, request: Request) -> Response:
        """Walk the hash chain now (it reads the whole trail) and say whether it holds."""
        result = selectors.audit_verify_status(run=True)
        assert result is not None  # run=True always walks the chain
        return Response(AuditVerifySerializer({
            "ok": result["ok"], "checked": result["checked"], "first_bad": result["bad_id"],
            "detail": result["text"], "reason": result["reason"],
            "unchained": result["unchained"], "head": result["head"]}).data)


# --- fire drills ----------------------------------------------------------------------------


class DrillViewSet(NamedNotFound, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Fire drills: FleetWatch proving its own repair loop on a canary node (a synthetic XID 79
    through its own pipeline, the playbook run in observe mode or on the canary), newest
    first. Starting one is an operator's (as on the drills page)."""

    serializer_class = DrillSerializer
    queryset = selectors.drills_for_list()
    filterset_class = filters.DrillFilter
    ordering_fields = ["started_at", "finished_at"]
    access = {**READ_ONLY, "create": OPERATE}

    @extend_schema(responses=DrillReportSerializer)
    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """A drill's report: result and reason, phases (live while it runs), its incident,
        its remediation with its steps, and its timeline (would-be and real calls)."""
        report = selectors.drill_report(self.get_object())
        return Response(DrillReportSerializer(report["drill"], context={
            "phases": report["phase_map"], "remediation": report["remediation"],
            "timeline": report["timeline"]}).data)

    @extend_schema(request=None, responses={
        201: DrillSerializer,
        409: OpenApiResponse(DrillConflictSerializer, description="A drill is running already; "
                             "none was started")})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Start a drill now (FLEETWATCH_DRILL_MODE, _NODES, _BUDGET_SECONDS). One runs at a
        time: while one does, 409 names it and nothing starts. The drill runs in a worker;
        follow it at /api/v1/drills/ID/."""
        try:
            started = drills.drill_start(trigger=Drill.Trigger.MANUAL,
                                         actor=actor_from_request(request))
        except drills.DrillError as exc:
            raise ValidationError({"detail": str(exc)}) from None
        drill = Drill.objects.prefetch_related("incidents").get(pk=started.drill.pk)
        if not started.created:
            return Response({"detail": f"fire drill {drill.pk} is running (started "
                                       f"{drill.started_at.isoformat()} by "
                                       f"{drill.requested_by}); no second drill was started",
                             "status": drill.status, "drill": drill.pk},
                            status=status.HTTP_409_CONFLICT)
        return Response(DrillSerializer(drill).data, status=status.HTTP_201_CREATED)


# --- sources, policy, tokens ----------------------------------------------------------------


class PolicyView(GenericAPIView):
    """The remediation policy in force: the default mode, each root cause's playbook and
    mode, the risky steps' modes, the playbooks and the safety budgets."""

    serializer_class = PolicySerializer
    access = {"GET": READ}

    def get(self, request: Request) -> Response:
        policy = {**selectors.policy_overview(), "budgets": selectors.policy_budgets()}
        return Response(PolicySerializer(policy).data)


@extend_schema(parameters=[OpenApiParameter("name", str, OpenApiParameter.PATH,
                                            description="the token's name")])
class TokenViewSet(NamedNotFound, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """API tokens (admins only). The key is shown once, in the answer that creates it; the
    list shows names, owners, scopes and state, never keys."""

    serializer_class = TokenSerializer
    queryset = ApiToken.objects.select_related("user").order_by("-created", "name")
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    not_found_name = "token"
    ordering_fields = ["created", "name", "last_used_at"]
    access = {"list": ADMIN_ONLY, "retrieve": ADMIN_ONLY, "create": ADMIN_ONLY,
              "revoke": ADMIN_ONLY}

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        body = TokenCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        try:
            row, key = token_create(data["user"], data["name"], data["scopes"],
                                    ttl_days=data.get("days"), actor=actor_from_request(request))
        except TokenError as exc:  # a name taken at the same moment is a field error too
            raise ValidationError({exc.field: [str(exc)]} if exc.field
                                  else {"detail": str(exc)}) from None
        return Response({**TokenSerializer(row).data, "key": key},
                        status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: TokenSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, name: str | None = None) -> Response:
        """Revoke now; calls with it answer 401 from then on. Twice: 409."""
        token = self.get_object()
        if not token_revoke(token, actor=actor_from_request(request)):
            return conflict(f"token {token.name!r} was already revoked by {token.revoked_by} "
                            f"at {token.revoked_at.isoformat() if token.revoked_at else '?'}",
                            token.state)
        return Response(TokenSerializer(token).data)


@extend_schema(parameters=[OpenApiParameter("slurm_id", str, OpenApiParameter.PATH,
                                            description="the Slurm job id"),
                           OpenApiParameter("cluster", str, description="the job's cluster "
                                            "(the first one holding that id when absent)")])
class JobWhyView(GenericAPIView):
    """Why a job died: what stopped it, when, where, what FleetWatch did and where it
    resumed; whether the job itself was at fault. The job's page says the same."""

    serializer_class = JobWhySerializer
    access = {"GET": READ}

    def get(self, request: Request, slurm_id: str) -> Response:
        cluster = request.query_params.get("cluster")
        job = fleet_selectors.job_get(slurm_id, cluster)
        if job is None:
            raise NotFound(f"no job {slurm_id}" + (f" in cluster {cluster}" if cluster else ""))
        return Response(JobWhySerializer(job_why(job)).data)
