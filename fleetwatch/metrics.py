"""``/metrics`` in the Prometheus exposition format.

Two kinds of metric, counted two ways so both are right however many gunicorn workers there are
and whichever of them answers a scrape:

- The fleet's (incidents, time to detect and to repair, remediation steps, collectors) are read
  from the database at scrape time by ``DomainCollector``: the database is the one truth every
  worker shares, so there is nothing to add up. The queries are GROUP BY aggregates (a few
  rows back whatever the number of incidents).
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
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Seconds. Detection is signal-to-incident: seconds normally, minutes when a source lags.
DETECT_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600)
# Repair is detection-to-resolved: minutes for a drain and requeue, hours for a replacement.
REPAIR_BUCKETS: tuple[float, ...] = (60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800,
                                     86400, 259200)
HTTP_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# Step outcomes. A retry sends a failed step back to pending, so these counts can fall: they
# are gauges of the steps in each outcome now, not counters (a counter that drops reads as a
# reset to Prometheus, and rate() would spike).
STEP_OUTCOMES = ("succeeded", "failed", "skipped", "cancelled")

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


def _seconds(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value) / 1e6  # SQLite hands a DurationField aggregate back as microseconds


def _histogram_rows(queryset: Any, group_by: Sequence[str], start: str, end: str,
                    buckets: Sequence[float]) -> list[dict[str, Any]]:
    """Per group: a count of rows at or under each bucket's bound, the total and the sum of
    ``end - start``. One query, every bucket a filtered COUNT."""
    from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum

    duration = ExpressionWrapper(F(end) - F(start), output_field=DurationField())
    counts = {f"le_{i}": Count("pk", filter=Q(duration__lte=timedelta(seconds=bound)))
              for i, bound in enumerate(buckets)}
    return list(queryset.alias(duration=duration).values(*group_by).order_by()
                .annotate(count=Count("pk"), total=Sum("duration"), **counts))


def _histogram(name: str, documentation: str, labels: Sequence[str], rows: list[dict[str, Any]],
               buckets: Sequence[float]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    for row in rows:
        cumulative = [(_bound(b), float(row[f"le_{i}"])) for i, b in enumerate(buckets)]
        cumulative.append(("+Inf", float(row["count"])))
        family.add_metric([str(row[label]) for label in labels], cumulative,
                          _seconds(row["total"]))
    return family


def _bound(value: float) -> str:
    return repr(float(value))


class DomainCollector:
    """The fleet's metrics, computed from the database on every scrape."""

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        up = GaugeMetricFamily("fleetwatch_metrics_database_up",
                               "1 when the scrape could read the database, else 0.")
        try:
            families = (list(self._incidents()) + list(self._steps()) + list(self._collectors())
                        + list(self._audit()))
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

    def _incidents(self) -> Iterator[Metric]:
        from django.db.models import Count

        from incidents.models import Incident, RootCause

        current = GaugeMetricFamily("fleetwatch_incidents", "Incidents now, by root cause and status.",
                                    labels=["root_cause", "status"])
        opened = CounterMetricFamily("fleetwatch_incidents_opened",
                                     "Incidents opened since the database began, by root cause.",
                                     labels=["root_cause"])
        counts = {(r["root_cause"], r["status"]): r["n"] for r in
                  Incident.objects.values("root_cause", "status").order_by().annotate(n=Count("pk"))}
        causes = list(RootCause.values) + sorted({c for c, _ in counts} - set(RootCause.values))
        # Every cause and status, zeros included: a series that is absent until the first
        # incident breaks rate() and alerts written against it.
        for cause in causes:
            for status in Incident.Status.values:
                current.add_metric([cause, status], counts.get((cause, status), 0))
            opened.add_metric([cause], sum(n for (c, _), n in counts.items() if c == cause))
        yield current
        yield opened

        yield _histogram(
            "fleetwatch_incident_detect_seconds",
            "Time to detect: from the first signal of a fault to its incident opening.",
            ["root_cause"],
            _histogram_rows(Incident.objects.all(), ["root_cause"], "detected_at", "opened_at",
                            DETECT_BUCKETS), DETECT_BUCKETS)
        # Time to repair as the dashboard's mean time to repair counts it (detection to
        # resolution), automation and people apart.
        yield _histogram(
            "fleetwatch_incident_repair_seconds",
            "Time to repair: from the first signal of a fault to its incident resolving.",
            ["root_cause", "repaired_by"],
            _histogram_rows(Incident.objects.filter(status=Incident.Status.RESOLVED,
                                                    resolved_at__isnull=False)
                            .exclude(repaired_by=""), ["root_cause", "repaired_by"],
                            "detected_at", "resolved_at", REPAIR_BUCKETS), REPAIR_BUCKETS)

    def _steps(self) -> Iterator[Metric]:
        from django.db.models import Count

        from incidents.models import Step

        done = GaugeMetricFamily("fleetwatch_remediation_steps_finished",
                                 "Remediation steps that ended, by kind and outcome.",
                                 labels=["kind", "outcome"])
        active = GaugeMetricFamily("fleetwatch_remediation_steps_active",
                                   "Remediation steps not finished yet, by kind and status.",
                                   labels=["kind", "status"])
        for row in Step.objects.values("kind", "status").order_by().annotate(n=Count("pk")):
            family = done if row["status"] in STEP_OUTCOMES else active
            family.add_metric([row["kind"], row["status"]], row["n"])
        yield done
        yield active

    def _collectors(self) -> Iterator[Metric]:
        from django.utils import timezone

        from collectors.models import SourceHealth

        labels = ["cluster", "source"]
        up = GaugeMetricFamily("fleetwatch_collector_up",
                               "1 when the source's last collection succeeded, else 0.", labels=labels)
        lag = GaugeMetricFamily(
            "fleetwatch_collector_lag_seconds",
            "Seconds since the source was last read successfully (+Inf: never).", labels=labels)
        last_success = GaugeMetricFamily("fleetwatch_collector_last_success_timestamp_seconds",
                                         "When the source was last read successfully.",
                                         labels=labels)
        failures = GaugeMetricFamily("fleetwatch_collector_consecutive_failures",
                                     "Failed collections in a row.", labels=labels)
        duration = GaugeMetricFamily("fleetwatch_collector_last_duration_seconds",
                                     "How long the last collection took.", labels=labels)
        runs = CounterMetricFamily("fleetwatch_collector_runs", "Collections run.", labels=labels)
        errors = CounterMetricFamily("fleetwatch_collector_errors",
                                     "Collections that failed.", labels=labels)
        now = timezone.now()
        for row in SourceHealth.objects.values(
                "cluster__name", "name", "healthy", "last_run_at", "last_success_at",
                "last_duration_ms", "consecutive_failures", "runs", "failures"):
            key = [row["cluster__name"], row["name"]]
            up.add_metric(key, 1 if row["healthy"] else 0)
            if row["last_success_at"] is not None:
                lag.add_metric(key, max(0.0, (now - row["last_success_at"]).total_seconds()))
                last_success.add_metric(key, row["last_success_at"].timestamp())
            elif row["last_run_at"] is not None:  # it runs, but has never once succeeded
                lag.add_metric(key, float("inf"))
            failures.add_metric(key, row["consecutive_failures"])
            if row["last_duration_ms"] is not None:
                duration.add_metric(key, row["last_duration_ms"] / 1000)
            runs.add_metric(key, row["runs"])
            errors.add_metric(key, row["failures"])
        yield from (up, lag, last_success, failures, duration, runs, errors)


    def _audit(self) -> Iterator[Metric]:
        """The audit trail's head, so Prometheus keeps a copy the database cannot rewrite: a
        count that falls, or a head that changes while the count does not, is a trail cut or
        rewritten (see incidents/audit.py)."""
        from incidents.audit import audit_head

        head = audit_head()
        entries = GaugeMetricFamily("fleetwatch_audit_entries", "Entries in the audit trail.")
        entries.add_metric([], head.count)
        last_id = GaugeMetricFamily("fleetwatch_audit_head_id",
                                    "Id of the audit trail's newest entry (0: none).")
        last_id.add_metric([], head.last_id or 0)
        # The first 52 bits of the newest entry's hash: exact in a float, so Prometheus keeps it
        # as it was, and changes() shows every new head.
        value = GaugeMetricFamily("fleetwatch_audit_head",
                                  "First 52 bits of the newest audit entry's hash, as a number.")
        value.add_metric([], float(int(head.hash[:13], 16)) if head.hash else 0.0)
        info = GaugeMetricFamily("fleetwatch_audit_head_info",
                                 "The newest audit entry's hash (label), always 1.",
                                 labels=["head"])
        info.add_metric([head.hash], 1)
        yield from (entries, last_id, value, info)


# --- the view ----------------------------------------------------------------------------------


def registry_for_scrape() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    directory = multiprocess_dir()
    if directory:
        MultiProcessCollector(registry, path=directory)
    else:
        registry.register(_ThisProcess())  # type: ignore[arg-type]
    registry.register(DomainCollector())  # type: ignore[arg-type]
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
        from incidents.api.permissions import role_of

        return role_of(user) in ("viewer", "operator", "admin")
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
