from __future__ import annotations

from rest_framework.routers import DefaultRouter

from incidents.api.views import IncidentViewSet, NodeViewSet

router = DefaultRouter()
router.register("incidents", IncidentViewSet, basename="incident")
router.register("nodes", NodeViewSet, basename="node")
urlpatterns = router.urls
