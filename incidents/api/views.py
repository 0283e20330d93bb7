"""Read-only REST endpoints (the full API, with actions, grows in its own issue)."""

from __future__ import annotations

from rest_framework import viewsets

from collectors.models import Node
from incidents.api.serializers import IncidentSerializer, NodeSerializer
from incidents.models import Incident


class IncidentViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = IncidentSerializer
    queryset = Incident.objects.select_related("cluster").prefetch_related(
        "remediations__steps").order_by("-opened_at")
    filterset_fields = ["status", "root_cause"]
    ordering_fields = ["opened_at", "detected_at", "resolved_at"]


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = NodeSerializer
    queryset = Node.objects.select_related("cluster").prefetch_related("gpus").order_by("name")
    filterset_fields = ["health", "leaf_switch", "pool", "in_service"]
    ordering_fields = ["name", "updated_at"]
