"""REST endpoints: incidents and nodes to read, signals to push (the full API, with actions,
grows in its own issue)."""

from __future__ import annotations

from django.conf import settings
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from collectors import services as collectors
from collectors.models import Node
from fleetwatch.roles import agent_node
from incidents import selectors
from incidents.api.serializers import IncidentSerializer, NodeSerializer, SignalBatchSerializer
from incidents.models import Incident


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


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = NodeSerializer
    queryset = Node.objects.select_related("cluster").prefetch_related("gpus").order_by("name")
    filterset_fields = ["health", "leaf_switch", "pool", "in_service"]
    ordering_fields = ["name", "updated_at"]


class SignalIngestView(APIView):
    """POST a batch of signals (node agents, other monitors). All or nothing."""

    def post(self, request: Request) -> Response:
        signals = request.data.get("signals") if isinstance(request.data, dict) else None
        if isinstance(signals, list) and len(signals) > settings.FLEETWATCH_INGEST_MAX_BATCH:
            return Response({"detail": f"batch of {len(signals)} signals is over the limit of "
                             f"{settings.FLEETWATCH_INGEST_MAX_BATCH}; split it"},
                            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        batch = SignalBatchSerializer(data=request.data)
        batch.is_valid(raise_exception=True)
        own = agent_node(request.user)
        if own is None and not request.user.has_perm("incidents.operate"):
            return Response({"detail": "only node agents and operators may push signals"},
                            status=status.HTTP_403_FORBIDDEN)
        try:
            ids = collectors.signals_ingest(collectors.cluster_default(),
                                            batch.validated_data["signals"], only_node=own)
        except collectors.IngestRejected as exc:
            return Response({"detail": str(exc)}, status=exc.status)
        return Response({"stored": len(ids)}, status=status.HTTP_201_CREATED)
