from __future__ import annotations

from django.urls import path

from incidents import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("dashboard/live", views.dashboard_live, name="dashboard-live"),
    path("dashboard/gpu-grid.json", views.gpu_grid, name="gpu-grid"),
    path("incidents/", views.incident_list, name="incident-list"),
    path("incidents/<int:pk>/", views.incident_detail, name="incident-detail"),
    path("incidents/<int:pk>/live", views.incident_live, name="incident-live"),
    path("incidents/<int:pk>/chart.json", views.incident_chart, name="incident-chart"),
    path("incidents/<int:pk>/replay.json", views.incident_replay, name="incident-replay"),
    path("incidents/<int:pk>/<str:action>", views.incident_action, name="incident-action"),
    path("demo/inject", views.inject_fault, name="inject-fault"),
]
