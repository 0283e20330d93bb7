"""REST endpoints: incidents and nodes to read, signals to push (the full API, with actions,
grows in its own issue)."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from collectors import services as collectors
from collectors.models import Node
from fleetwatch.roles import agent_node
from incidents import selectors, services
from incidents.api.permissions import INGEST
from incidents.api.serializers import (
    IncidentSerializer,
    NodeSerializer,
    RemediationSerializer,
    SignalBatchSerializer,
)
from incidents.audit import actor_from_request
from incidents.models import Incident, Remediation


class IncidentViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = IncidentSerializer
    queryset = Incident.objects.select_related("cluster").prefetch_related(
        "remediations__steps").order_by("-opened_at")
    filterset_fields = ["status", "root_cause"]
    ordering_fields = ["opened_at", "detected_at", "resolved_at"]

    @action(detail=True, methods=["get"])
    def replay(self, request: Request, pk: str | None = None) -> Response:
        """The incident's signals as a replay file (shared/REPLAY.md)."""
        return Response(selectors.incident_replay(self.get_object()))


class CanOperate(BasePermission):
    """Reading is for every signed-in role; changing a remediation is for operators."""

    message = "operating remediations needs the operator role"

    def has_permission(self, request: Request, view: object) -> bool:
        if request.method in SAFE_METHODS:
            return bool(request.user and request.user.is_authenticated)
        return bool(request.user and request.user.has_perm("incidents.operate"))


class RemediationViewSet(viewsets.ReadOnlyModelViewSet):
    """Remediations, and the actions a person takes on one. An action that does not fit the
    remediation's state (approving one that already finished, or that someone else approved
    a moment ago) answers 409 with what it is now."""

    serializer_class = RemediationSerializer
    permission_classes = [CanOperate]
    queryset = Remediation.objects.select_related("incident").prefetch_related(
        "steps").order_by("-created_at")
    filterset_fields = ["status", "playbook", "incident"]

    def _act(self, fn: Callable[..., Remediation], pk: str | None) -> Response:
        rem = self.get_object()
        try:
            # Named as the token when a program called (token:NAME), else the person.
            fn(rem.pk, self.request.user, actor=actor_from_request(self.request))
        except services.InvalidTransition as exc:
            rem.refresh_from_db()
            return Response({"detail": str(exc), "status": rem.status},
                            status=status.HTTP_409_CONFLICT)
        rem.refresh_from_db()
        return Response(RemediationSerializer(rem).data)

    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: str | None = None) -> Response:
        return self._act(services.remediation_approve, pk)

    @action(detail=True, methods=["post"], url_path="continue")
    def continue_(self, request: Request, pk: str | None = None) -> Response:
        return self._act(services.remediation_continue, pk)

    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        return self._act(services.remediation_cancel, pk)

    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        """Run the failed step of a failed remediation again."""
        return self._act(services.remediation_retry, pk)


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = NodeSerializer
    queryset = Node.objects.select_related("cluster").prefetch_related("gpus").order_by("name")
    filterset_fields = ["health", "leaf_switch", "pool", "in_service"]
    ordering_fields = ["name", "updated_at"]


class SignalIngestView(APIView):
    """POST a batch of signals (node agents, other monitors). All or nothing."""

    access = {"POST": INGEST}
    throttle_scope = "ingest"

    def post(self, request: Request) -> Response:
        signals = request.data.get("signals") if isinstance(request.data, dict) else None
        if isinstance(signals, list) and len(signals) > settings.FLEETWATCH_INGEST_MAX_BATCH:
            return Response({"detail": f"batch of {len(signals)} signals is over the limit of "
                             f"{settings.FLEETWATCH_INGEST_MAX_BATCH}; split it"},
                            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        batch = SignalBatchSerializer(data=request.data)
        batch.is_valid(raise_exception=True)
        own = agent_node(request.user)
        try:
            ids = collectors.signals_ingest(collectors.cluster_default(),
                                            batch.validated_data["signals"], only_node=own)
        except collectors.IngestRejected as exc:
            return Response({"detail": str(exc)}, status=exc.status)
        return Response({"stored": len(ids)}, status=status.HTTP_201_CREATED)
