"""Read-only REST endpoints (the full API, with actions, grows in its own issue)."""

from __future__ import annotations

from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from collectors.models import Node
from incidents import selectors
from incidents.api.serializers import IncidentSerializer, NodeSerializer
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
