"""/api/v1/: one router for the whole API (one root, one namespace), with the fleet's endpoints
(collectors/api/) and the incidents app's (views.py, webhooks.py)."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.urls import Resolver404, path, re_path, resolve
from django.views.decorators.csrf import csrf_exempt
from rest_framework.routers import DefaultRouter

from collectors.api import urls as fleet_api
from incidents.api import lending as lending_api
from incidents.api import views
from incidents.api import webhooks as webhook_api

router = DefaultRouter()
fleet_api.register(router)  # clusters, nodes, GPUs, jobs, signals, sources
router.register("incidents", views.IncidentViewSet, basename="incident")
router.register("remediations", views.RemediationViewSet, basename="remediation")
router.register("steps", views.StepViewSet, basename="step")
router.register("audit", views.AuditEntryViewSet, basename="audit")
router.register("drills", views.DrillViewSet, basename="drill")
router.register("tokens", views.TokenViewSet, basename="token")
webhook_api.register(router)
lending_api.register(router)


@csrf_exempt  # it changes nothing, and a refused CSRF check would hide the real answer
def not_found(request: HttpRequest, rest: str = "") -> JsonResponse:
    # Anything under /api/v1/ that no route takes (an id like 0.5, a typo) answers in JSON, as
    # the rest of the API does, rather than with the site's HTML 404 page.
    detail = f"no API endpoint {request.path}"
    if not request.path.endswith("/"):
        try:
            if resolve(f"{request.path}/").func is not not_found:
                detail += f"; the endpoint is {request.path}/ (with the slash)"
        except Resolver404:
            pass
    return JsonResponse({"detail": detail}, status=404)


urlpatterns = [
    path("policy/", views.PolicyView.as_view(), name="policy"),
    path("jobs/<str:slurm_id>/why/", views.JobWhyView.as_view(), name="job-why"),
    path("capacity/", lending_api.CapacityView.as_view(), name="capacity"),
    path("capacity/history/", lending_api.CapacityHistoryView.as_view(),
         name="capacity-history"),
    *router.urls,
    re_path(r"^(?P<rest>.*)$", not_found),
]
