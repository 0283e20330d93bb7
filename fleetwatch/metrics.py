"""``/metrics`` in the Prometheus exposition format.

Two kinds of metric, counted two ways so both are right however many gunicorn workers there are
and whichever of them answers a scrape:

- The fleet's (incidents, time to detect and to repair, remediation steps, collectors) are read
  from the database at scrape time: the database is the one truth every worker shares, so
  there is nothing to add up. Each app says what it counts in its own ``metrics`` module
  (``COLLECTORS``, found through the app registry); ``DomainCollector`` runs them all.
- HTTP requests are counted where they happen, in each worker. Under gunicorn, deploy/gunicorn.
  conf.py sets PROMETHEUS_MULTIPROC_DIR (a fresh folder per start) and prometheus_client keeps
  each worker's counts in a file there; a scrape sums the files of all workers, alive or dead.
  Without it (tests, runserver, one process) the counts live in this process.

Labels carry only names from fixed sets (root causes, statuses, step kinds, source and cluster
names, URL pattern names): never a path, a user or a token.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from collectors.roles import READ, role_allows, role_of
from fleetwatch.apps import app_modules

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

HTTP_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

# --- HTTP, counted per process -----------------------------------------------------------------
# Not registered in prometheus_client's global registry: the view builds a registry per scrape,
# from the worker files (multiprocess) or from these objects (one process).
HTTP_REQUESTS = Counter("fleetwatch_http_requests", "HTTP requests answered, by URL pattern name.",
                        ["view", "method", "status"], registry=None)
HTTP_DURATION = Histogram("fleetwatch_http_request_duration_seconds",
                          "Time to answer an HTTP request, by URL pattern name.",
                          ["view", "method"], buckets=HTTP_BUCKETS, registry=None)


def http_observe(method: str, view: str, status: int, seconds: float) -> None:
    """Count one answered request (RequestLogMiddleware calls this)."""
    method = method if method in _METHODS else "other"
    HTTP_REQUESTS.labels(view, method, str(status)).inc()
    HTTP_DURATION.labels(view, method).observe(seconds)


class _ThisProcess:
    """The HTTP metrics of this process, for a registry built per scrape."""

    def collect(self) -> Iterable[Metric]:
        yield from HTTP_REQUESTS.collect()
        yield from HTTP_DURATION.collect()


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


# --- the fleet, read from the database ---------------------------------------------------------


class Collector(Protocol):
    """What an app lists in ``<app>/metrics.py``'s ``COLLECTORS``: prometheus_client's custom
    collector interface."""

    def collect(self) -> Iterable[Metric]: ...


def app_collectors() -> list[Collector]:
    """Every installed app's ``metrics.COLLECTORS`` (collectors/metrics.py,
    incidents/metrics.py): each app says what it counts; this module only exposes it."""
    return [collector for module in app_modules("metrics")
            for collector in module.COLLECTORS]


class DomainCollector:
    """The fleet's metrics, computed from the database on every scrape by the apps' collectors,
    with whether the database could be read and how long that took."""

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        up = GaugeMetricFamily("fleetwatch_metrics_database_up",
                               "1 when the scrape could read the database, else 0.")
        try:
            # All read before any is yielded: a scrape that loses the database half way says
            # so, rather than exposing half the families.
            families = [family for collector in app_collectors()
                        for family in collector.collect()]
        except DatabaseError as exc:  # every scrape would repeat the traceback: one line
            log.warning("metrics: the database could not be read: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        yield from families
        up.add_metric([], 1)
        yield up
        took = GaugeMetricFamily("fleetwatch_metrics_collect_seconds",
                                 "Time the last scrape spent reading the database.")
        took.add_metric([], time.perf_counter() - started)
        yield took


# --- the view ----------------------------------------------------------------------------------


def registry_for_scrape() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    directory = multiprocess_dir()
    if directory:
        MultiProcessCollector(registry, path=directory)
    else:
        registry.register(_ThisProcess())
    registry.register(DomainCollector())
    return registry


def _allowed(request: HttpRequest) -> bool:
    """Open unless FLEETWATCH_METRICS_TOKEN is set; then ``Authorization: Bearer <it>``, or a
    signed-in person (the UI's roles)."""
    token = settings.FLEETWATCH_METRICS_TOKEN
    if not token:
        return True
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return True
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return role_allows(role_of(user), READ)
    return False


def metrics_view(request: HttpRequest) -> HttpResponse:
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405, headers={"Allow": "GET, HEAD"})
    if not _allowed(request):
        return HttpResponse("metrics need Authorization: Bearer <FLEETWATCH_METRICS_TOKEN>\n",
                            status=401, content_type="text/plain",
                            headers={"WWW-Authenticate": 'Bearer realm="metrics"'})
    # The text format 0.0.4 unless the scraper asks for OpenMetrics or text 1.0.0.
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encode(registry_for_scrape()), content_type=content_type)
