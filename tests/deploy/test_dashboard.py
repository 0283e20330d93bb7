"""deploy/grafana/fleetwatch.json and the alert rules ask only for what FleetWatch serves: every
metric name in every panel's query (and every alert's expression) is a series name on a live
server's /metrics, with data behind every labelled family; every query parses as PromQL (the
real promtool); every legend names labels those series carry."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from collectors.models import Cluster, Gpu, Node
from incidents.models import Delivery, DiagnosisState, Drill, Incident, Remediation, Step
from tests.api.test_metrics import fleet_fixture
from tests.conftest import ROOT
from tests.deploy.test_alerts import RULES, rules
from tests.harness.prometheus import PrometheusError, find_promtool

DASHBOARD = ROOT / "deploy" / "grafana" / "fleetwatch.json"
TOKEN = "dashboard-scrape-0123456789"

# Series Prometheus makes itself for every target, not FleetWatch: alerts may use these.
PROMETHEUS_OWN = {"up"}

_KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left",
             "group_right", "offset", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions or
    aggregations (followed by "("), keywords, label names (inside {} or by/without/on
    lists), durations, numbers or strings."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":  # the exponent of 1e3
            continue
        if text[match.end():].lstrip().startswith("(") or match[0].lower() in _KEYWORDS:
            continue
        names.add(match[0])
    return names


def test_metric_names_reads_promql() -> None:
    assert metric_names(
        'histogram_quantile(0.9, sum by (le, repaired_by) (max without (instance) '
        '(increase(fleetwatch_incident_repair_seconds_bucket{root_cause!~"x|y"}[7d]))))'
    ) == {"fleetwatch_incident_repair_seconds_bucket"}
    assert metric_names('a_total - a_total offset 30m > 1e3 and on (job) b == bool 1') == {
        "a_total", "b"}
    assert metric_names('absent(up{job="fleetwatch"}) or vector(0)') == {"up"}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def queries() -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target) for panel in panels(dashboard)
            for target in panel.get("targets", [])]


def served_data() -> None:
    """A little of everything, so that every labelled family has series: incidents, steps
    (one past its deadline), sources, nodes and GPUs, deliveries, a diagnosis run."""
    cluster = fleet_fixture()["cluster"]
    now = timezone.now()
    for n, (health, state) in enumerate([("healthy", "IDLE"), ("failed", "DOWN")]):
        node = Node.objects.create(cluster=cluster, name=f"dash-{n}", health=health,
                                   slurm_state=state, slurm_flags=["DRAIN"] if n else [])
        Gpu.objects.create(node=node, index=0, health=health)
    rem = Remediation.objects.filter(status="running").first()
    assert rem is not None
    Step.objects.create(remediation=rem, order=9, kind="drain", title="late", status="running",
                        started_at=now - timedelta(hours=1), deadline=now - timedelta(minutes=1))
    Delivery.objects.create(channel="subscription", status="pending", event="incident.opened",
                            incident=Incident.objects.first())
    DiagnosisState.objects.create(cluster=Cluster.objects.get(pk=cluster.pk), runs=3,
                                  last_run_at=now, last_run_ms=12.0)
    # A fire drill that passed, with its phases.
    Drill.objects.create(cluster=Cluster.objects.get(pk=cluster.pk), status="passed",
                         mode="observe", trigger="schedule", requested_by="system",
                         node="dash-0", budget_seconds=300, started_at=now - timedelta(minutes=5),
                         deadline=now, finished_at=now - timedelta(minutes=4), nonce="d" * 16,
                         phases={"inject": 0.1, "detect": 1.2, "drain": 0.2, "total": 3.5})


@pytest.fixture
def exposition(live_server: Any, settings: Any) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from a live server's /metrics, read with
    the token as Prometheus would send it."""
    settings.FLEETWATCH_METRICS_TOKEN = TOKEN
    served_data()
    urllib.request.urlopen(f"{live_server.url}/login/", timeout=30).read()  # an HTTP count
    request = urllib.request.Request(f"{live_server.url}/metrics",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    served: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            served.setdefault(sample.name, set()).update(sample.labels)
    return served


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def test_dashboard_asks_only_for_served_metrics(exposition: dict[str, set[str]]) -> None:
    found = queries()
    assert len(found) >= 20
    used: set[str] = set()
    for title, target in found:
        names = metric_names(target["expr"])
        assert names, f"{title}: no metric in {target['expr']!r}"
        missing = names - set(exposition)
        assert not missing, f"panel {title!r} asks for {sorted(missing)}, not on /metrics"
        used |= names
        # A legend's {{label}} is a label of the series (or the target's, from Prometheus).
        carried = set().union(*(exposition[n] for n in names)) | {"instance", "job"}
        assert legend_labels(target.get("legendFormat", "")) <= carried, (
            f"panel {title!r}: legend {target['legendFormat']!r}")
    # What the issue asks the dashboard to show.
    for name in ("fleetwatch_nodes", "fleetwatch_gpus", "fleetwatch_incidents",
                 "fleetwatch_incidents_opened_total", "fleetwatch_incident_detect_seconds_bucket",
                 "fleetwatch_incident_repair_seconds_bucket",
                 "fleetwatch_remediation_steps_finished", "fleetwatch_collector_up",
                 "fleetwatch_collector_lag_seconds", "fleetwatch_deliveries"):
        assert name in used, f"the dashboard shows no {name}"


def test_alert_rules_ask_only_for_served_metrics(exposition: dict[str, set[str]]) -> None:
    for rule in rules():
        missing = metric_names(rule["expr"]) - set(exposition) - PROMETHEUS_OWN
        assert not missing, f"{rule['alert']} asks for {sorted(missing)}, not on /metrics"


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Each query as a recording rule, for promtool's PromQL parser."""
    try:
        promtool = find_promtool()
    except PrometheusError as exc:
        pytest.fail(f"{exc}; run the tests with `make test`")
    recorded = [{"record": f"dashboard:query_{n}", "expr": target["expr"]}
                for n, (_, target) in enumerate(queries())]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_dashboard_is_importable() -> None:
    """What Grafana needs to import it: a title and uid, unique panel ids, grid positions in
    the 24-column grid, and every query on the dashboard's Prometheus data source."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] == "fleetwatch"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    assert str(RULES.relative_to(ROOT)) in dashboard["description"]
