"""The fleet's endpoints under /api/v1/ (see views.py). They join the project's one API router
(``register``), so the API keeps one root listing every endpoint and one URL namespace."""

from __future__ import annotations

from rest_framework.routers import BaseRouter

from collectors.api import views


def register(router: BaseRouter) -> None:
    router.register("clusters", views.ClusterViewSet, basename="cluster")
    router.register("nodes", views.NodeViewSet, basename="node")
    router.register("gpus", views.GpuViewSet, basename="gpu")
    router.register("jobs", views.JobViewSet, basename="job")
    router.register("signals", views.SignalViewSet, basename="signal")
    router.register("sources", views.SourceViewSet, basename="source")
    router.register("agent", views.AgentViewSet, basename="agent")
    router.register("prometheus/write", views.PrometheusWriteViewSet, basename="prometheus-write")
