from __future__ import annotations

from django.urls import path, register_converter

from incidents import views


class PageAction:
    """The actions a page's buttons post (views.PAGE_ACTIONS); any other is a 404."""

    regex = "|".join(views.PAGE_ACTIONS)

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(PageAction, "page_action")

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("dashboard/live", views.dashboard_live, name="dashboard-live"),
    path("dashboard/gpu-grid.json", views.gpu_grid, name="gpu-grid"),
    path("nodes/", views.node_list, name="node-list"),
    path("nodes/<str:name>/", views.node_detail, name="node-detail"),
    path("nodes/<str:name>/telemetry.json", views.node_telemetry, name="node-telemetry"),
    path("jobs/", views.job_list, name="job-list"),
    path("jobs/<str:slurm_id>/", views.job_detail, name="job-detail"),
    path("incidents/", views.incident_list, name="incident-list"),
    path("incidents/<int:pk>/", views.incident_detail, name="incident-detail"),
    path("incidents/<int:pk>/live", views.incident_live, name="incident-live"),
    path("incidents/<int:pk>/chart.json", views.incident_chart, name="incident-chart"),
    path("incidents/<int:pk>/replay.json", views.incident_replay, name="incident-replay"),
    path("incidents/<int:pk>/postmortem.md", views.incident_postmortem,
         name="incident-postmortem"),
    path("incidents/<int:pk>/<page_action:action>", views.incident_action,
         name="incident-action"),
    path("audit/", views.audit_list, name="audit-list"),
    path("audit/verify", views.audit_verify, name="audit-verify"),
    path("sources/", views.source_list, name="source-list"),
    path("policy/", views.policy_page, name="policy"),
    path("demo/inject", views.inject_fault, name="inject-fault"),
]
