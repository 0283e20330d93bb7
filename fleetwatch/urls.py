from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from fleetwatch.metrics import metrics_view
from fleetwatch.views import healthz

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    # The OpenAPI 3 schema and its reference pages (assets served from the sidecar package,
    # so the docs work with no internet access).
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="api-schema"), name="api-redoc"),
    # Namespaced: the API's route names (incident-detail, ...) would otherwise clash with the
    # pages' and reverse() would give the HTML page.
    path("api/v1/", include(("incidents.api.urls", "api"), namespace="api")),
    path("", include("incidents.urls")),
]
