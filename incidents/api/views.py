"""REST endpoints under /api/v1/. Thin: they validate input, read through the selectors and
change state only through the services, as the pages do.

Each view says in ``access`` what each of its calls needs (see permissions.py); the schema
prints it in every operation's description.

Objects are addressed by what people call them where that is unique enough: clusters and
tokens by name, nodes by name and jobs by Slurm id (with ``?cluster=`` where several clusters
share a name), everything else by id.

Answers: 400 with the fields at fault; 404 naming what was not found; 409 when an action does
not fit the current state (with ``status``, the state it is in); 413 for an oversized push;
422 for a pushed signal naming a node FleetWatch does not know."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from collectors import services as collectors
from collectors.models import Cluster, Gpu, Node, Signal
from collectors.roles import actor_from_request, push_rights
from incidents import selectors, services
from incidents.api import filters
from incidents.api.pagination import AuditCursor, SignalCursor
from incidents.api.permissions import ADMIN_ONLY, INGEST, OPERATE, READ
from incidents.api.serializers import (
    AuditEntrySerializer,
    AuditVerifySerializer,
    ClusterSerializer,
    ConflictSerializer,
    ErrorSerializer,
    GpuDetailSerializer,
    IncidentSerializer,
    JobSerializer,
    NodeSerializer,
    PolicySerializer,
    RemediationSerializer,
    ResolveSerializer,
    SignalBatchSerializer,
    SignalSerializer,
    SourceSerializer,
    StepSerializer,
    StoredSerializer,
    TimelineItemSerializer,
    TokenCreatedSerializer,
    TokenCreateSerializer,
    TokenSerializer,
)
from incidents.audit import audit_record
from incidents.models import ApiToken, AuditEntry, Incident, Remediation, Step
from incidents.tokens import TokenError, token_create, token_revoke

READ_ONLY = {"list": READ, "retrieve": READ}
CONFLICT = OpenApiResponse(ConflictSerializer, description="Does not fit the current state")
CLUSTER_PARAM = OpenApiParameter(
    "cluster", str, description="the cluster's name, where several clusters share the name")


def conflict(detail: str, state: str) -> Response:
    return Response({"detail": detail, "status": state}, status=status.HTTP_409_CONFLICT)


class NamedNotFound:
    """A 404 that says what was looked for ("no incident 12"), not DRF's generic text."""

    def get_object(self) -> Any:
        try:
            return super().get_object()  # type: ignore[misc]
        except Http404:
            view: Any = self
            lookup = view.kwargs.get(view.lookup_url_kwarg or view.lookup_field)
            name = getattr(view, "not_found_name", "") or \
                view.get_queryset().model._meta.verbose_name
            raise NotFound(f"no {name} {lookup}") from None


# --- the fleet ------------------------------------------------------------------------------


class ClusterViewSet(NamedNotFound, viewsets.ReadOnlyModelViewSet):
    serializer_class = ClusterSerializer
    queryset = Cluster.objects.order_by("name")
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    access = READ_ONLY


@extend_schema(parameters=[OpenApiParameter("name", str, OpenApiParameter.PATH,
                                            description="the node's name")])
class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """Nodes as FleetWatch last saw them, with their GPUs."""

    serializer_class = NodeSerializer
    queryset = Node.objects.select_related("cluster").prefetch_related("gpus").order_by("name")
    filterset_class = filters.NodeFilter
    ordering_fields = ["name", "updated_at", "health", "leaf_switch", "pool"]
    lookup_field = "name"
    # Host names may have dots (``node1.rack2``): anything up to the next slash.
    lookup_value_regex = "[^/]+"
    access = READ_ONLY

    @extend_schema(parameters=[CLUSTER_PARAM])
    def retrieve(self, request: Request, name: str = "") -> Response:
        return super().retrieve(request, name=name)

    def get_object(self) -> Node:
        name, cluster = self.kwargs["name"], self.request.query_params.get("cluster")
        node = selectors.node_get(name, cluster)
        if node is None:
            raise NotFound(f"no node {name}" + (f" in cluster {cluster}" if cluster else ""))
        return node


class GpuViewSet(NamedNotFound, viewsets.ReadOnlyModelViewSet):
    serializer_class = GpuDetailSerializer
    queryset = Gpu.objects.select_related("node").order_by("node__name", "index")
    filterset_class = filters.GpuFilter
    ordering_fields = ["index", "temperature", "utilization", "last_xid", "updated_at"]
    access = READ_ONLY


@extend_schema(parameters=[OpenApiParameter("slurm_id", str, OpenApiParameter.PATH,
                                            description="the Slurm job id")])
class JobViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = JobSerializer
    queryset = selectors.jobs_for_list()
    filterset_class = filters.JobFilter
    ordering_fields = ["updated_at", "started_at", "slurm_id", "restart_count"]
    lookup_field = "slurm_id"
    lookup_value_regex = "[^/]+"
    access = READ_ONLY

    @extend_schema(parameters=[CLUSTER_PARAM])
    def retrieve(self, request: Request, slurm_id: str = "") -> Response:
        return super().retrieve(request, slurm_id=slurm_id)

    def get_object(self) -> Any:
        slurm_id, cluster = self.kwargs["slurm_id"], self.request.query_params.get("cluster")
        job = selectors.job_get(slurm_id, cluster)
        if job is None:
            raise NotFound(f"no job {slurm_id}" + (f" in cluster {cluster}" if cluster else ""))
        return job


class SignalViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Signals: read them (oldest first, cursor-paged: follow ``next``), or push a batch."""

    serializer_class = SignalSerializer
    queryset = Signal.objects.select_related("cluster")
    pagination_class = SignalCursor
    filter_backends = [DjangoFilterBackend]  # the cursor fixes the order
    filterset_class = filters.SignalFilter
    access = {"list": READ, "create": INGEST}

    @property
    def throttle_scope(self) -> str:
        # Pushes have their own budget: an agent catching up must not starve its reads.
        return "ingest" if self.action == "create" else "token"

    @extend_schema(
        request=SignalBatchSerializer,
        parameters=[OpenApiParameter(
            "Idempotency-Key", str, OpenApiParameter.HEADER, required=False,
            description="1 to 128 visible ASCII characters, one per batch: the same batch sent "
                        "again with it (a retry) is stored once, and its answer carries "
                        "\"replayed\": true and the Idempotent-Replayed header")],
        responses={201: StoredSerializer,
                   403: OpenApiResponse(ErrorSerializer, description="A record this caller "
                                        "may not push (source or node), named"),
                   413: OpenApiResponse(ErrorSerializer, description="Batch or body over the "
                                        "limit"),
                   422: OpenApiResponse(ErrorSerializer, description="Unknown node(s), or an "
                                        "Idempotency-Key used for another batch")},
        description="Push a batch of signals (node agents, other monitors), in the replay "
                    "format. All or nothing: a batch with one bad record stores nothing. What "
                    "a caller may push follows from who it is: an agent's token, its own "
                    "node's kernel, dcgm and nic records; any other ingest token, those and "
                    "job_log records for known nodes; nobody, collector, slurm or kubernetes "
                    "records (403, audited).")
    def create(self, request: Request) -> Response:
        signals = request.data.get("signals") if isinstance(request.data, dict) else None
        if isinstance(signals, list) and len(signals) > settings.FLEETWATCH_INGEST_MAX_BATCH:
            return Response({"detail": f"batch of {len(signals)} signals is over the limit of "
                             f"{settings.FLEETWATCH_INGEST_MAX_BATCH}; split it"},
                            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        batch = SignalBatchSerializer(data=request.data)
        batch.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key")
        # Keys are per token (its digest, shortened: a token's key is never stored), else
        # per signed-in person.
        auth_id = getattr(request.auth, "pk", None)
        caller = f"token:{str(auth_id)[:48]}" if auth_id is not None else f"user:{request.user.pk}"
        try:
            result = collectors.signals_ingest(
                collectors.cluster_default(), batch.validated_data["signals"],
                rights=push_rights(request.user),
                idempotency=(caller, key) if key is not None else None)
        except collectors.IngestRejected as exc:
            # The api.call entry says a push was refused; this one says why.
            audit_record("signals.refused", f"POST {request.path}"[:200],
                         actor=actor_from_request(request), ok=False, result=str(exc)[:500],
                         data={"status": exc.status, "records": exc.refused[:20],
                               "signals": len(batch.validated_data["signals"])})
            return Response({"detail": str(exc)}, status=exc.status)
        if result.replayed:
            return Response({"stored": result.stored, "replayed": True},
                            status=status.HTTP_201_CREATED,
                            headers={"Idempotent-Replayed": "true"})
        return Response({"stored": result.stored}, status=status.HTTP_201_CREATED)

    def handle_exception(self, exc: Exception) -> Response:
        if isinstance(exc, RequestDataTooBig):
            # Django's own answer would be an HTML 400.
            return Response(
                {"detail": f"request body over the limit of {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} "
                           "bytes (DATA_UPLOAD_MAX_MEMORY_SIZE, room for "
                           f"FLEETWATCH_INGEST_MAX_BATCH={settings.FLEETWATCH_INGEST_MAX_BATCH} "
                           "signals of the largest size); split the batch"},
                status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        return super().handle_exception(exc)


# --- incidents and their repair -------------------------------------------------------------


def _remediation_act(request: Request, fn: Callable[..., Remediation],
                     rem: Remediation) -> Response:
    """Run one of the remediation services; 409 with the state when it does not fit."""
    try:
        # Named as the token when a program called (token:NAME), else the person.
        fn(rem.pk, request.user, actor=actor_from_request(request))
    except services.InvalidTransition as exc:
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
              "remediate": OPERATE, "approve": OPERATE, "cancel": OPERATE, "resolve": OPERATE}

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
            services.incident_acknowledge(incident.pk, actor=actor_from_request(request))
        except services.InvalidTransition as exc:
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
            opened = services.remediation_open(incident, actor=actor_from_request(request),
                                               user=request.user)
        except services.InvalidTransition as exc:
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
        return _remediation_act(request, services.remediation_approve, rem)

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel the incident's live remediation: what was done stays done."""
        rem = self._live(self.get_object())
        if isinstance(rem, Response):
            return rem
        return _remediation_act(request, services.remediation_cancel, rem)

    @extend_schema(request=ResolveSerializer, responses={200: IncidentSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def resolve(self, request: Request, pk: str | None = None) -> Response:
        """Say it is over (fixed by hand, or not a fault). A remediation still waiting for
        approval is cancelled; one running must be cancelled first (409)."""
        incident = self.get_object()
        body = ResolveSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            services.incident_resolve_by_hand(incident.pk, actor=actor_from_request(request),
                                              note=body.validated_data["note"])
        except services.InvalidTransition as exc:
            incident.refresh_from_db()
            return conflict(str(exc), incident.status)
        return self._fresh(incident.pk)


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
        return _remediation_act(request, services.remediation_approve, self.get_object())

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"], url_path="continue")
    def continue_(self, request: Request, pk: str | None = None) -> Response:
        """Override a blocking check (or an observe-mode step) and let the playbook go on."""
        return _remediation_act(request, services.remediation_continue, self.get_object())

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Stop it: nothing more runs; what was done stays done."""
        return _remediation_act(request, services.remediation_cancel, self.get_object())

    @extend_schema(request=None, responses=ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        """Run the failed step of a failed remediation again."""
        return _remediation_act(request, services.remediation_retry, self.get_object())


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
            services.remediation_retry(rem.pk, request.user, actor=actor_from_request(request))
        except services.InvalidTransition as exc:
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


# --- sources, policy, tokens ----------------------------------------------------------------


class SourceViewSet(viewsets.ViewSet):
    """Each collector's health and its recent runs (a handful of rows: not paged)."""

    access = {"list": READ}

    @extend_schema(responses=SourceSerializer(many=True))
    def list(self, request: Request) -> Response:
        return Response(SourceSerializer(selectors.sources_overview(), many=True).data)


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
