"""The fleet's pages (collectors/views.py). The templates keep their names under
templates/incidents/, where every page's template lives."""

from __future__ import annotations

from django.urls import path

from collectors import views

urlpatterns = [
    path("dashboard/gpu-grid.json", views.gpu_grid, name="gpu-grid"),
    path("nodes/", views.node_list, name="node-list"),
    path("nodes/<str:name>/", views.node_detail, name="node-detail"),
    path("nodes/<str:name>/telemetry.json", views.node_telemetry, name="node-telemetry"),
    path("jobs/", views.job_list, name="job-list"),
    path("jobs/<str:slurm_id>/", views.job_detail, name="job-detail"),
    path("sources/", views.source_list, name="source-list"),
]
