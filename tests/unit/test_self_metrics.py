"""The /metrics families the alert rules and the Grafana dashboard need (deploy/prometheus/
fleetwatch-alerts.yaml, deploy/grafana/fleetwatch.json): the fleet's nodes and GPUs, steps past
their deadline, the storm brake, deliveries and coalesced diagnosis. Each equals what the
selectors and services it is read from say, so a number on the dashboard is the one the pages
show and the policy applies."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from prometheus_client.core import Metric

from collectors.metrics import FleetCollector
from collectors.models import Cluster, Gpu, Node
from collectors.selectors import fleet_counts
from incidents.metrics import IncidentsCollector
from incidents.models import Delivery, DiagnosisState, Incident, Remediation, Step
from incidents.remediation import policy
from tests.conftest import rerun_on_sqlite


def samples(collector: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    families: list[Metric] = list(collector.collect())
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def v(got: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return got[(name, frozenset(labels.items()))]


def test_nodes_and_gpus_are_the_dashboards_counts(db: None) -> None:
    cluster = Cluster.objects.create(name="fleet-lab")
    specs = [("n1", "healthy", "IDLE", [], True), ("n2", "failed", "DOWN", ["DRAIN"], True),
             ("n3", "degraded", "ALLOCATED", [], True), ("n4", "healthy", "IDLE", [], False)]
    for name, health, state, flags, in_service in specs:
        node = Node.objects.create(cluster=cluster, name=name, health=health, slurm_state=state,
                                   slurm_flags=flags, in_service=in_service,
                                   k8s_unschedulable=name == "n2")
        for index in range(2):
            Gpu.objects.create(node=node, index=index,
                               health="failed" if name == "n2" and index == 0 else "healthy")
    got = samples(FleetCollector())
    counts = fleet_counts()
    assert v(got, "fleetwatch_nodes", health="healthy") == counts["healthy"] == 1  # n4 is out
    assert v(got, "fleetwatch_nodes", health="failed") == 1
    assert v(got, "fleetwatch_nodes", health="degraded") == 1
    assert v(got, "fleetwatch_nodes", health="unknown") == 0
    assert v(got, "fleetwatch_nodes_slurm_state", state="IDLE") == 1
    assert v(got, "fleetwatch_nodes_slurm_state", state="DOWN") == 1
    assert v(got, "fleetwatch_nodes_flagged", flag="drained") == 1
    assert v(got, "fleetwatch_nodes_flagged", flag="cordoned") == 1
    # GPUs in service: those of n1..n3; their health sums to that.
    gpus = {h: v(got, "fleetwatch_gpus", health=h) for h in ("healthy", "failed", "unknown")}
    assert gpus == {"healthy": 5, "failed": 1, "unknown": 0}
    assert sum(gpus.values()) == counts["gpus"] == 6


def _incident(cluster: Cluster, n: int, cause: str = "gpu_hardware", **kw: Any) -> Incident:
    now = timezone.now()
    return Incident.objects.create(cluster=cluster, root_cause=cause, confidence=0.9,
                                   explanation="x", fingerprint=f"{cause}-{n}",
                                   detected_at=now, opened_at=now, **kw)


def test_steps_past_their_deadline_are_overdue(db: None) -> None:
    cluster = Cluster.objects.create(name="steps-lab")
    rem = Remediation.objects.create(incident=_incident(cluster, 1), playbook="p", mode="auto",
                                     status="running", requested_by="system")
    now = timezone.now()
    started = now - timedelta(minutes=30)
    Step.objects.create(remediation=rem, order=0, kind="drain", title="d", status="running",
                        started_at=started, deadline=now - timedelta(minutes=5))
    Step.objects.create(remediation=rem, order=1, kind="wait_back", title="w", status="waiting",
                        started_at=now - timedelta(seconds=10),
                        deadline=now + timedelta(minutes=5))
    Step.objects.create(remediation=rem, order=2, kind="drain", title="d2", status="succeeded",
                        started_at=started, deadline=now - timedelta(minutes=5))
    got = samples(IncidentsCollector())
    assert v(got, "fleetwatch_remediation_steps_overdue", kind="drain") == 1
    assert v(got, "fleetwatch_remediation_steps_overdue", kind="wait_back") == 0
    assert 1790 <= v(got, "fleetwatch_remediation_step_oldest_seconds", kind="drain") < 1900
    assert v(got, "fleetwatch_remediation_step_oldest_seconds", kind="wait_back") < 100


def test_storm_brake_as_the_policy_applies_it(db: None, settings: Any) -> None:
    settings.FLEETWATCH_STORM_INCIDENTS, settings.FLEETWATCH_STORM_MINUTES = 3, 10
    cluster = Cluster.objects.create(name="storm-lab")
    _incident(cluster, 0, cause="application_error")  # never counts towards the brake
    for n in range(1, 3):
        _incident(cluster, n)
    # Another cluster's storm is its own: it neither counts here nor brakes this one.
    other = Cluster.objects.create(name="calm-lab")
    got = samples(IncidentsCollector())
    lab = {"cluster": "storm-lab"}
    assert v(got, "fleetwatch_storm_incidents", **lab) == policy.storm_count(cluster.pk) == 2
    assert v(got, "fleetwatch_storm_threshold") == 3
    assert v(got, "fleetwatch_storm_brake_engaged", **lab) == 0
    _incident(cluster, 3)
    got = samples(IncidentsCollector())
    assert v(got, "fleetwatch_storm_incidents", **lab) == 3
    assert v(got, "fleetwatch_storm_brake_engaged", **lab) == 1 and policy.storm_brake_on(3)
    assert v(got, "fleetwatch_storm_incidents", cluster="calm-lab") == 0
    assert v(got, "fleetwatch_storm_brake_engaged", cluster="calm-lab") == 0
    assert policy.storm_count(other.pk) == 0


def test_deliveries_by_channel_and_status(db: None) -> None:
    now = timezone.now()
    Delivery.objects.create(channel="subscription", status="failed", event="incident.opened")
    Delivery.objects.create(channel="subscription", status="delivered", event="incident.opened")
    Delivery.objects.create(channel="subscription", status="pending", event="incident.opened",
                            created_at=now - timedelta(minutes=40))
    Delivery.objects.create(channel="slack", status="pending", created_at=now)
    got = samples(IncidentsCollector())
    assert v(got, "fleetwatch_deliveries", channel="subscription", status="failed") == 1
    assert v(got, "fleetwatch_deliveries", channel="subscription", status="delivered") == 1
    assert v(got, "fleetwatch_deliveries", channel="email", status="failed") == 0  # zeros too
    oldest = v(got, "fleetwatch_deliveries_pending_oldest_seconds", channel="subscription")
    assert 2390 <= oldest < 2500
    assert v(got, "fleetwatch_deliveries_pending_oldest_seconds", channel="slack") < 60
    assert v(got, "fleetwatch_deliveries_pending_oldest_seconds", channel="webhook") == 0


def test_diagnosis_queue_per_cluster(db: None) -> None:
    now = timezone.now()
    idle = Cluster.objects.create(name="idle-lab")
    busy = Cluster.objects.create(name="busy-lab")
    DiagnosisState.objects.create(cluster=idle, runs=7, last_run_at=now, last_run_ms=250.0)
    DiagnosisState.objects.create(cluster=busy, runs=2, queued_at=now - timedelta(minutes=10),
                                  pending_since=now - timedelta(minutes=12),
                                  running_since=now - timedelta(seconds=30),
                                  running_from=now - timedelta(minutes=15))
    got = samples(IncidentsCollector())
    assert v(got, "fleetwatch_diagnosis_queued_seconds", cluster="idle-lab") == 0
    assert v(got, "fleetwatch_diagnosis_pending_seconds", cluster="idle-lab") == 0
    assert v(got, "fleetwatch_diagnosis_runs_total", cluster="idle-lab") == 7
    assert v(got, "fleetwatch_diagnosis_last_run_seconds", cluster="idle-lab") == 0.25
    assert 590 <= v(got, "fleetwatch_diagnosis_queued_seconds", cluster="busy-lab") < 700
    assert 25 <= v(got, "fleetwatch_diagnosis_running_seconds", cluster="busy-lab") < 100
    # The oldest of what waits: the running run's claim is older than the pending mark.
    assert 890 <= v(got, "fleetwatch_diagnosis_pending_seconds", cluster="busy-lab") < 1000


@pytest.mark.skipif(connection.vendor == "sqlite", reason="this run is the SQLite one")
def test_the_same_on_sqlite(tmp_path: Any) -> None:
    """The embedded demo's database: its aggregates of times come back differently typed."""
    rerun_on_sqlite(__file__, tmp_path, "not sqlite")
