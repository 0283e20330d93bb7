"""What incidents add to ``/metrics``: incidents by root cause and status, time to detect and to
repair, remediation steps (and those past their deadline), the storm brake, deliveries,
coalesced diagnosis per cluster, fire drills and the audit trail's head, all read from the
database at scrape time (the one truth every worker shares: nothing to add up across processes). The queries are
GROUP BY aggregates: a few rows back whatever the number of incidents.

The project's ``/metrics`` view (fleetwatch/metrics.py) finds ``COLLECTORS`` here through the
app registry, as it does in every installed app; it imports no app by name. Labels carry only
names from fixed sets (root causes, statuses, step kinds, phases).

Fire drills' incidents and steps are rehearsals, not the fleet's faults: every incident and
step figure leaves them out, and the drills have their own (``fleetwatch_drill_*``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, DurationField, ExpressionWrapper, F, Min, Q, QuerySet, Sum
from django.utils import timezone
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from collectors.models import Cluster
from incidents.audit import audit_head
from incidents.drills import DRILL_PHASES
from incidents.models import Delivery, DiagnosisState, Drill, Incident, RootCause, Step
from incidents.remediation import policy

# Seconds. Detection is signal-to-incident: seconds normally, minutes when a source lags.
DETECT_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600)
# Repair is detection-to-resolved: minutes for a drain and requeue, hours for a replacement.
REPAIR_BUCKETS: tuple[float, ...] = (60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800,
                                     86400, 259200)

# Step outcomes: the statuses a step ends in. A retry sends a failed step back to pending, so
# these counts can fall: they are gauges of the steps in each outcome now, not counters (a
# counter that drops reads as a reset to Prometheus, and rate() would spike).
STEP_OUTCOMES: tuple[str, ...] = tuple(str(status) for status in Step.DONE)
# The statuses in which the engine is working a step (running it, or polling while it waits):
# each has a deadline (the engine's step_timeout), and one still here past it is stuck.
STEP_WORKING: tuple[str, ...] = (str(Step.Status.RUNNING), str(Step.Status.WAITING))


def _seconds(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value) / 1e6  # SQLite hands a DurationField aggregate back as microseconds


def _histogram_rows(queryset: QuerySet[Any], group_by: Sequence[str], start: str, end: str,
                    buckets: Sequence[float]) -> list[dict[str, Any]]:
    """Per group: a count of rows at or under each bucket's bound, the total and the sum of
    ``end - start``. One query, every bucket a filtered COUNT."""
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


class IncidentsCollector:
    """Incidents, remediation steps, the storm brake, deliveries, diagnosis and the audit
    trail's head."""

    def collect(self) -> Iterator[Metric]:
        yield from self._incidents()
        yield from self._steps()
        yield from self._storm()
        yield from self._deliveries()
        yield from self._diagnosis()
        yield from self._drills()
        yield from self._audit()

    def _incidents(self) -> Iterator[Metric]:
        current = GaugeMetricFamily("fleetwatch_incidents", "Incidents now, by root cause and status.",
                                    labels=["root_cause", "status"])
        opened = CounterMetricFamily("fleetwatch_incidents_opened",
                                     "Incidents opened since the database began, by root cause.",
                                     labels=["root_cause"])
        counts = {(r["root_cause"], r["status"]): r["n"] for r in
                  Incident.objects.real().values("root_cause", "status").order_by()
                  .annotate(n=Count("pk"))}
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
            _histogram_rows(Incident.objects.real(), ["root_cause"], "detected_at", "opened_at",
                            DETECT_BUCKETS), DETECT_BUCKETS)
        # Time to repair as the dashboard's mean time to repair counts it (detection to
        # resolution), automation and people apart.
        yield _histogram(
            "fleetwatch_incident_repair_seconds",
            "Time to repair: from the first signal of a fault to its incident resolving.",
            ["root_cause", "repaired_by"],
            _histogram_rows(Incident.objects.real().filter(status=Incident.Status.RESOLVED,
                                                           resolved_at__isnull=False)
                            .exclude(repaired_by=""), ["root_cause", "repaired_by"],
                            "detected_at", "resolved_at", REPAIR_BUCKETS), REPAIR_BUCKETS)

    def _steps(self) -> Iterator[Metric]:
        done = GaugeMetricFamily("fleetwatch_remediation_steps_finished",
                                 "Remediation steps that ended, by kind and outcome.",
                                 labels=["kind", "outcome"])
        active = GaugeMetricFamily("fleetwatch_remediation_steps_active",
                                   "Remediation steps not finished yet, by kind and status.",
                                   labels=["kind", "status"])
        steps = Step.objects.filter(remediation__incident__drill__isnull=True)
        for row in steps.values("kind", "status").order_by().annotate(n=Count("pk")):
            family = done if row["status"] in STEP_OUTCOMES else active
            family.add_metric([row["kind"], row["status"]], row["n"])
        yield done
        yield active

        # Steps the engine is working past their deadline. The engine fails a step that
        # outlives its deadline the next time it runs or polls it, so one still working past
        # it is stuck: nothing runs it any more (or its call hangs past its lease).
        now = timezone.now()
        overdue = GaugeMetricFamily(
            "fleetwatch_remediation_steps_overdue",
            "Remediation steps running or waiting past their deadline (the step's timeout), "
            "by kind.", labels=["kind"])
        oldest = GaugeMetricFamily(
            "fleetwatch_remediation_step_oldest_seconds",
            "Seconds since the longest-running unfinished step started, by kind (running or "
            "waiting steps only).", labels=["kind"])
        for row in (steps.filter(status__in=STEP_WORKING, started_at__isnull=False)
                    .values("kind").order_by()
                    .annotate(overdue=Count("pk", filter=Q(deadline__lt=now)),
                              started=Min("started_at"))):
            overdue.add_metric([row["kind"]], row["overdue"])
            oldest.add_metric([row["kind"]], max(0.0, (now - row["started"]).total_seconds()))
        yield overdue
        yield oldest

    def _storm(self) -> Iterator[Metric]:
        """The storm brake as the policy applies it (incidents.remediation.policy): per
        cluster, as it counts."""
        window = GaugeMetricFamily(
            "fleetwatch_storm_incidents",
            "Incidents opened in the cluster in the storm brake's window "
            "(FLEETWATCH_STORM_MINUTES), application errors not counted.", labels=["cluster"])
        limit = GaugeMetricFamily(
            "fleetwatch_storm_threshold",
            "Incidents in the window at which the storm brake engages "
            "(FLEETWATCH_STORM_INCIDENTS).")
        limit.add_metric([], settings.FLEETWATCH_STORM_INCIDENTS)
        engaged = GaugeMetricFamily(
            "fleetwatch_storm_brake_engaged",
            "1 when the storm brake holds a new incident's automation in the cluster for a "
            "person (for one root cause at least: it counts each on its own), else 0.",
            labels=["cluster"])
        for pk, name in Cluster.objects.values_list("pk", "name").order_by("name"):
            by_cause = policy.storm_by_cause(pk)
            window.add_metric([name], sum(by_cause.values()))
            # The brake holds each root cause on its own count: engaged when it holds any.
            engaged.add_metric([name], 1 if policy.storm_brake_on(max(by_cause.values(),
                                                                       default=0)) else 0)
        yield from (window, limit, engaged)

    def _deliveries(self) -> Iterator[Metric]:
        """Every message sent out (webhook subscriptions and step notifications): one model,
        one count. Rows can be deleted (an admin, a subscription removed), so these are gauges."""
        rows = Delivery.objects.values("channel", "status").order_by().annotate(n=Count("pk"))
        counts = {(r["channel"], r["status"]): r["n"] for r in rows}
        current = GaugeMetricFamily("fleetwatch_deliveries",
                                    "Deliveries (webhook events and notifications) by channel "
                                    "and status.", labels=["channel", "status"])
        # Every channel and status, zeros included, so a first failure is a change from 0.
        for channel in Delivery.Channel.values:
            for status in Delivery.Status.values:
                current.add_metric([channel, status], counts.get((channel, status), 0))
        yield current
        now = timezone.now()
        pending = GaugeMetricFamily(
            "fleetwatch_deliveries_pending_oldest_seconds",
            "Seconds since the oldest delivery still pending (being retried) was created, by "
            "channel; 0 when none is.", labels=["channel"])
        oldest = dict(Delivery.objects.filter(status=Delivery.Status.PENDING)
                      .values("channel").order_by().annotate(at=Min("created_at"))
                      .values_list("channel", "at"))
        for channel in Delivery.Channel.values:
            at = oldest.get(channel)
            pending.add_metric([channel], 0.0 if at is None else
                               max(0.0, (now - at).total_seconds()))
        yield pending

    def _diagnosis(self) -> Iterator[Metric]:
        """Coalesced diagnosis per cluster (incidents.diagnosing): how long a queued run has
        waited for a worker, how long the current run has taken, and how old the oldest
        signal no run has diagnosed yet is."""
        labels = ["cluster"]
        queued = GaugeMetricFamily(
            "fleetwatch_diagnosis_queued_seconds",
            "Seconds the cluster's queued diagnosis run has waited for a worker (0: none queued).",
            labels=labels)
        running = GaugeMetricFamily(
            "fleetwatch_diagnosis_running_seconds",
            "Seconds the cluster's diagnosis run in progress has taken (0: none running).",
            labels=labels)
        pending = GaugeMetricFamily(
            "fleetwatch_diagnosis_pending_seconds",
            "Age of the oldest stored signal waiting for diagnosis, by its observation time "
            "(0: none waiting).", labels=labels)
        runs = CounterMetricFamily("fleetwatch_diagnosis_runs", "Diagnosis runs finished.",
                                   labels=labels)
        took = GaugeMetricFamily("fleetwatch_diagnosis_last_run_seconds",
                                 "How long the cluster's last diagnosis run took.", labels=labels)
        now = timezone.now()

        def age(at: Any) -> float:
            return 0.0 if at is None else max(0.0, (now - at).total_seconds())

        for row in DiagnosisState.objects.values(
                "cluster__name", "queued_at", "running_since", "pending_since", "running_from",
                "runs", "last_run_ms").order_by("cluster__name"):
            key = [row["cluster__name"]]
            queued.add_metric(key, age(row["queued_at"]))
            running.add_metric(key, age(row["running_since"]))
            waiting = [t for t in (row["pending_since"], row["running_from"]) if t is not None]
            pending.add_metric(key, age(min(waiting)) if waiting else 0.0)
            runs.add_metric(key, row["runs"])
            if row["last_run_ms"] is not None:
                took.add_metric(key, row["last_run_ms"] / 1000)
        yield from (queued, running, pending, runs, took)

    def _drills(self) -> Iterator[Metric]:
        """Fire drills (incidents.drills): whether they are scheduled, the latest result and
        how long it took, failures so far, the latest success, and the latest passed drill's
        phases. The FleetWatchDrillFailed and FleetWatchNoRecentDrill alerts read these."""
        enabled = GaugeMetricFamily(
            "fleetwatch_drill_enabled",
            "1 when fire drills are scheduled (FLEETWATCH_DRILL_SCHEDULE), else 0.")
        enabled.add_metric([], 1 if settings.FLEETWATCH_DRILL_SCHEDULE is not None else 0)
        budget = GaugeMetricFamily("fleetwatch_drill_budget_seconds",
                                   "A drill's time budget (FLEETWATCH_DRILL_BUDGET_SECONDS).")
        budget.add_metric([], settings.FLEETWATCH_DRILL_BUDGET_SECONDS)
        counts = dict(Drill.objects.values_list("status").annotate(n=Count("pk")).order_by())
        running = GaugeMetricFamily("fleetwatch_drill_running", "1 while a fire drill runs.")
        running.add_metric([], 1 if counts.get(Drill.Status.RUNNING) else 0)
        # Rows are never deleted: a count of failed drills only grows.
        failures = CounterMetricFamily("fleetwatch_drill_failures",
                                       "Fire drills that failed (over their budget included).")
        failures.add_metric([], counts.get(Drill.Status.FAILED, 0))
        drills = CounterMetricFamily("fleetwatch_drills", "Fire drills finished, by result.",
                                     labels=["result"])
        for result in (Drill.Status.PASSED, Drill.Status.FAILED, Drill.Status.SKIPPED):
            drills.add_metric([result], counts.get(result, 0))
        yield from (enabled, budget, running, failures, drills)

        # The latest drill that ran (a skipped one proved nothing, either way).
        last = (Drill.objects.filter(status__in=[Drill.Status.PASSED, Drill.Status.FAILED])
                .order_by("-finished_at", "-pk").values("status", "phases").first())
        result = GaugeMetricFamily(
            "fleetwatch_drill_last_result",
            "The latest fire drill that ran: 1 passed, 0 failed (absent before the first).")
        took = GaugeMetricFamily("fleetwatch_drill_last_duration_seconds",
                                 "How long the latest fire drill that ran took, start to end.")
        if last is not None:
            result.add_metric([], 1 if last["status"] == Drill.Status.PASSED else 0)
            took.add_metric([], float((last["phases"] or {}).get("total", 0.0)))
        success = GaugeMetricFamily(
            "fleetwatch_drill_last_success_timestamp_seconds",
            "When the latest fire drill that passed finished (Unix time; 0: none has).")
        passed = (Drill.objects.filter(status=Drill.Status.PASSED)
                  .order_by("-finished_at", "-pk").values("finished_at", "phases").first())
        success.add_metric([], passed["finished_at"].timestamp()
                           if passed is not None and passed["finished_at"] else 0.0)
        phases = GaugeMetricFamily(
            "fleetwatch_drill_last_phase_seconds",
            "Seconds each phase of the latest passed fire drill took (inject, detect, decide, "
            "first_action, drain, requeue, replace, resume, cleanup, total).", labels=["phase"])
        for phase in DRILL_PHASES:
            value = (passed["phases"] or {}).get(phase) if passed is not None else None
            if value is not None:
                phases.add_metric([phase], float(value))
        yield from (result, took, success, phases)

    def _audit(self) -> Iterator[Metric]:
        """The audit trail's head, so Prometheus keeps a copy the database cannot rewrite: a
        count that falls, or a head that changes while the count does not, is a trail cut or
        rewritten (see incidents/audit.py)."""
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


COLLECTORS = (IncidentsCollector(),)
