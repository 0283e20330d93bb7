from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import (
    SpectacularAPIView,
    SpectacularRedocView,
    SpectacularSwaggerSplitView,
)

from fleetwatch.metrics import metrics_view
from fleetwatch.middleware import public
from fleetwatch.views import healthz

# Every view outside the API and the admin site is a page that needs a role
# (fleetwatch.middleware.PageAccessMiddleware) unless it is marked public here.
urlpatterns = [
    path("login/", public(auth_views.LoginView.as_view()), name="login"),
    path("logout/", public(auth_views.LogoutView.as_view()), name="logout"),
    path("healthz", public(healthz), name="healthz"),
    path("metrics", public(metrics_view), name="metrics"),  # its own token check
    path("admin/", admin.site.urls),
    # The OpenAPI 3 schema and its reference pages (assets served from the sidecar package,
    # so the docs work with no internet access). The split Swagger view serves its start-up
    # script as a file, so the Content-Security-Policy needs no inline scripts.
    path("api/schema/", public(SpectacularAPIView.as_view()), name="api-schema"),
    path("api/docs/", public(SpectacularSwaggerSplitView.as_view(url_name="api-schema")),
         name="api-docs"),
    path("api/redoc/", public(SpectacularRedocView.as_view(url_name="api-schema")),
         name="api-redoc"),
    # Namespaced: the API's route names (incident-detail, ...) would otherwise clash with the
    # pages' and reverse() would give the HTML page.
    path("api/v1/", include(("incidents.api.urls", "api"), namespace="api")),
    path("", include("incidents.urls")),
    path("", include("collectors.urls")),
]
