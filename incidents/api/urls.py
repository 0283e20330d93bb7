from __future__ import annotations

from django.urls import path
from rest_framework.routers import DefaultRouter

from incidents.api import webhooks as webhook_api
from incidents.api.views import (
    IncidentViewSet,
    NodeViewSet,
    RemediationViewSet,
    SignalIngestView,
)

router = DefaultRouter()
router.register("incidents", IncidentViewSet, basename="incident")
router.register("nodes", NodeViewSet, basename="node")
router.register("remediations", RemediationViewSet, basename="remediation")
webhook_api.register(router)
urlpatterns = [path("signals/", SignalIngestView.as_view(), name="signal-ingest"),
               *router.urls]
