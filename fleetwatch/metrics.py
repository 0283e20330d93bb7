"""``/metrics`` in the Prometheus exposition format (filled in by the metrics work)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse


def metrics_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("", content_type="text/plain; version=0.0.4")
