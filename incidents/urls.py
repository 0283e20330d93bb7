"""The incidents app's pages (the fleet's are in collectors/urls.py)."""

from __future__ import annotations

from django.urls import path, register_converter

from incidents import views
from incidents.lending import views as lending


class PageAction:
    """The actions a page's buttons post (views.PAGE_ACTIONS); any other is a 404."""

    regex = "|".join(views.PAGE_ACTIONS)

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(PageAction, "page_action")


class LoanAction(PageAction):
    """A loan's buttons (lending.views.LOAN_ACTIONS); any other is a 404."""

    regex = "|".join(lending.LOAN_ACTIONS)


register_converter(LoanAction, "loan_action")

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("dashboard/live", views.dashboard_live, name="dashboard-live"),
    path("incidents/", views.incident_list, name="incident-list"),
    path("incidents/<int:pk>/", views.incident_detail, name="incident-detail"),
    path("incidents/<int:pk>/live", views.incident_live, name="incident-live"),
    path("incidents/<int:pk>/timeline", views.incident_timeline, name="incident-timeline"),
    path("incidents/<int:pk>/chart.json", views.incident_chart, name="incident-chart"),
    path("incidents/<int:pk>/replay.json", views.incident_replay, name="incident-replay"),
    path("incidents/<int:pk>/postmortem.md", views.incident_postmortem,
         name="incident-postmortem"),
    path("incidents/<int:pk>/<page_action:action>", views.incident_action,
         name="incident-action"),
    path("audit/", views.audit_list, name="audit-list"),
    path("audit/verify", views.audit_verify, name="audit-verify"),
    path("policy/", views.policy_page, name="policy"),
    path("drills/", views.drill_list, name="drill-list"),
    path("drills/run", views.drill_run, name="drill-run"),
    path("drills/<int:pk>/", views.drill_detail, name="drill-detail"),
    path("drills/<int:pk>/live", views.drill_live, name="drill-live"),
    path("capacity/", lending.capacity_page, name="capacity"),
    path("capacity/chart.json", lending.capacity_chart, name="capacity-chart"),
    path("capacity/lend", lending.capacity_lend, name="capacity-lend"),
    path("capacity/loans/<int:loan>/", lending.loan_detail, name="loan-detail"),
    path("capacity/loans/<int:loan>/<loan_action:action>", lending.loan_action,
         name="loan-action"),
    path("demo/inject", views.inject_fault, name="inject-fault"),
    # A job's page is the fleet's (collectors); why it died and its chart are read here.
    path("jobs/<str:slurm_id>/chart.json", views.job_chart, name="job-chart"),
]
