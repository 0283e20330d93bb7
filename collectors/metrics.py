"""What collectors add to ``/metrics``: each source's health and the fleet's nodes and GPUs, read
from the database at scrape time (the ``SourceHealth``, ``Node`` and ``Gpu`` rows every worker
shares, so any worker answers a scrape right).

The project's ``/metrics`` view (fleetwatch/metrics.py) finds ``COLLECTORS`` here through the
app registry, as it does in every installed app; it imports no app by name. Labels carry only
cluster and source names.
"""

from __future__ import annotations

from collections.abc import Iterator

from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from collectors.models import Node, SourceHealth
from collectors.selectors import fleet_counts


class SourceHealthCollector:
    """Per cluster and source: up, lag, last success, failures in a row, last duration, runs
    and errors."""

    def collect(self) -> Iterator[Metric]:
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


class FleetCollector:
    """The fleet at a glance, as the dashboard counts it (``selectors.fleet_counts``): nodes in
    service by health and by Slurm state, drained, cordoned and not ready, and their GPUs by
    health. Three aggregate queries, whatever the fleet's size."""

    def collect(self) -> Iterator[Metric]:
        counts = fleet_counts()
        nodes = GaugeMetricFamily("fleetwatch_nodes", "Nodes in service, by health.",
                                  labels=["health"])
        for health in Node.Health.values:
            nodes.add_metric([health], counts[health])
        states = GaugeMetricFamily("fleetwatch_nodes_slurm_state",
                                   "Nodes in service, by Slurm base state.", labels=["state"])
        for state, n in counts["slurm_states"]:
            states.add_metric([state], n)
        flagged = GaugeMetricFamily(
            "fleetwatch_nodes_flagged",
            "Nodes in service drained in Slurm, cordoned or not Ready in Kubernetes.",
            labels=["flag"])
        for flag in ("drained", "cordoned", "k8s_not_ready"):
            flagged.add_metric([flag], counts[flag])
        gpus = GaugeMetricFamily(
            "fleetwatch_gpus",
            "GPUs of the nodes in service, by health (unknown: unknown or degraded).",
            labels=["health"])
        for health in ("healthy", "failed", "unknown"):
            gpus.add_metric([health], counts[f"gpus_{health}"])
        yield from (nodes, states, flagged, gpus)


COLLECTORS = (SourceHealthCollector(), FleetCollector())
