"""/metrics: the Prometheus exposition parses, the fleet's numbers are the database's, the
histograms are real histograms, the optional bearer token guards it, and HTTP counts add up
exactly across several real gunicorn workers, whichever worker answers the scrape."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.db import DatabaseError, connection
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from collectors.models import Cluster, CollectorRun, SourceHealth
from incidents import metrics
from incidents.models import Incident, Remediation, Step
from tests.conftest import ROOT, stop_process_group, wait_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[dict[str, Any], Samples]:
    """The families by name and every sample by (name, labels)."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in families.values() for s in f.samples}
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def fleet_fixture() -> dict[str, Any]:
    """Incidents, steps and collector state with known numbers."""
    now = timezone.now()
    cluster, _ = Cluster.objects.get_or_create(name="metrics-lab")

    def incident(cause: str, status: str, detect: float, repair: float | None = None,
                 by: str = "") -> Incident:
        detected = now - timedelta(seconds=(repair or 0) + 10)
        return Incident.objects.create(
            cluster=cluster, root_cause=cause, confidence=0.9, explanation="x", status=status,
            fingerprint=f"{cause}-{Incident.objects.count()}", detected_at=detected,
            opened_at=detected + timedelta(seconds=detect),
            resolved_at=detected + timedelta(seconds=repair) if repair is not None else None,
            repaired_by=by)

    auto = incident("gpu_hardware", "resolved", 4, repair=200, by="automation")
    incident("gpu_hardware", "resolved", 20, repair=5000, by="person")
    incident("gpu_hardware", "open", 1)
    hot = incident("thermal", "remediating", 90)
    done = Remediation.objects.create(incident=auto, playbook="gpu_hardware", mode="auto",
                                      status="succeeded", requested_by="system")
    for order, (kind, status) in enumerate([("drain", "succeeded"), ("requeue", "succeeded"),
                                            ("resume", "failed")]):
        Step.objects.create(remediation=done, order=order, kind=kind, title=kind, status=status)
    running = Remediation.objects.create(incident=hot, playbook="thermal", mode="auto",
                                         status="running", requested_by="system")
    Step.objects.create(remediation=running, order=0, kind="drain", title="d", status="succeeded")
    Step.objects.create(remediation=running, order=1, kind="wait_cool", title="w",
                        status="waiting")
    SourceHealth.objects.create(cluster=cluster, name="slurm", healthy=True, runs=10,
                                last_run_at=now - timedelta(seconds=30),
                                last_success_at=now - timedelta(seconds=30),
                                last_duration_ms=250.0)
    SourceHealth.objects.create(cluster=cluster, name="kubernetes", healthy=False, runs=3,
                                last_run_at=now, consecutive_failures=3, failures=5,
                                last_duration_ms=5000.0,
                                last_error="connection refused")
    for ok, source in [(True, "slurm"), (False, "kubernetes"), (False, "kubernetes")]:
        CollectorRun.objects.create(cluster=cluster, source=source, started_at=now,
                                    finished_at=now, duration_ms=1.0, ok=ok)
    return {"cluster": cluster}


def assert_domain_matches_db(samples: Samples) -> None:
    """Every incident, step and source number equals what the database says now."""
    from django.db.models import Count

    for row in Incident.objects.values("root_cause", "status").annotate(n=Count("pk")):
        assert value(samples, "fleetwatch_incidents", root_cause=row["root_cause"],
                     status=row["status"]) == row["n"]
    for row in Incident.objects.values("root_cause").annotate(n=Count("pk")):
        assert value(samples, "fleetwatch_incidents_opened_total",
                     root_cause=row["root_cause"]) == row["n"]
    for row in Step.objects.values("kind", "status").annotate(n=Count("pk")):
        if row["status"] in metrics.STEP_OUTCOMES:
            assert value(samples, "fleetwatch_remediation_steps_finished", kind=row["kind"],
                         outcome=row["status"]) == row["n"]
        else:
            assert value(samples, "fleetwatch_remediation_steps_active", kind=row["kind"],
                         status=row["status"]) == row["n"]
    for health in SourceHealth.objects.select_related("cluster"):
        key = {"cluster": health.cluster.name, "source": health.name}
        assert value(samples, "fleetwatch_collector_up", **key) == (1 if health.healthy else 0)
        assert value(samples, "fleetwatch_collector_runs_total", **key) == health.runs


def assert_histograms_well_formed(families: dict[str, Any]) -> None:
    histograms = [f for f in families.values() if f.type == "histogram"]
    assert histograms
    for family in histograms:
        series: dict[frozenset[tuple[str, str]], list[tuple[float, float]]] = {}
        counts = {}
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "le")
            if s.name.endswith("_bucket"):
                series.setdefault(labels, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                counts[labels] = s.value
        for labels, buckets in series.items():
            values = [v for _, v in sorted(buckets)]
            assert values == sorted(values), f"{family.name} buckets not cumulative"
            assert sorted(buckets)[-1][0] == float("inf")
            assert values[-1] == counts[labels]


# --- in process ---------------------------------------------------------------------------------


@pytest.fixture
def scrape(client: Any) -> Any:
    def get(**headers: str) -> tuple[dict[str, Any], Samples]:
        response = client.get("/metrics", **headers)
        assert response.status_code == 200, response.content[:500]
        assert response["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(response.content.decode())
    return get


def test_fleet_metrics_equal_the_database(db: None, scrape: Any) -> None:
    fleet_fixture()
    families, samples = scrape()
    assert_domain_matches_db(samples)
    # Zero series exist for causes and statuses without incidents (alerts need them).
    assert value(samples, "fleetwatch_incidents", root_cause="nvlink", status="open") == 0
    assert value(samples, "fleetwatch_incidents", root_cause="gpu_hardware", status="resolved") == 2
    assert value(samples, "fleetwatch_incidents_opened_total", root_cause="gpu_hardware") == 3
    assert value(samples, "fleetwatch_remediation_steps_finished", kind="drain",
                 outcome="succeeded") == 2
    assert value(samples, "fleetwatch_remediation_steps_finished", kind="resume", outcome="failed") == 1
    assert value(samples, "fleetwatch_remediation_steps_active", kind="wait_cool",
                 status="waiting") == 1

    # Time to detect: 4 s, 20 s and 1 s for the GPU hardware incidents.
    detect = {"root_cause": "gpu_hardware"}
    assert value(samples, "fleetwatch_incident_detect_seconds_count", **detect) == 3
    assert value(samples, "fleetwatch_incident_detect_seconds_sum", **detect) == pytest.approx(25)
    assert value(samples, "fleetwatch_incident_detect_seconds_bucket", le="1.0", **detect) == 1
    assert value(samples, "fleetwatch_incident_detect_seconds_bucket", le="5.0", **detect) == 2
    assert value(samples, "fleetwatch_incident_detect_seconds_bucket", le="15.0", **detect) == 2
    assert value(samples, "fleetwatch_incident_detect_seconds_bucket", le="30.0", **detect) == 3
    assert value(samples, "fleetwatch_incident_detect_seconds_bucket", le="+Inf", **detect) == 3
    # Time to repair, automation and people apart: 200 s and 5000 s.
    auto = {"root_cause": "gpu_hardware", "repaired_by": "automation"}
    person = {"root_cause": "gpu_hardware", "repaired_by": "person"}
    assert value(samples, "fleetwatch_incident_repair_seconds_sum", **auto) == pytest.approx(200)
    assert value(samples, "fleetwatch_incident_repair_seconds_bucket", le="120.0", **auto) == 0
    assert value(samples, "fleetwatch_incident_repair_seconds_bucket", le="300.0", **auto) == 1
    assert value(samples, "fleetwatch_incident_repair_seconds_bucket", le="3600.0", **person) == 0
    assert value(samples, "fleetwatch_incident_repair_seconds_bucket", le="7200.0", **person) == 1
    assert ("fleetwatch_incident_repair_seconds_count",
            frozenset({"root_cause": "thermal", "repaired_by": ""}.items())) not in samples
    assert_histograms_well_formed(families)

    slurm = {"cluster": "metrics-lab", "source": "slurm"}
    kube = {"cluster": "metrics-lab", "source": "kubernetes"}
    assert 29 <= value(samples, "fleetwatch_collector_lag_seconds", **slurm) < 60
    assert value(samples, "fleetwatch_collector_lag_seconds", **kube) == float("inf")
    assert value(samples, "fleetwatch_collector_consecutive_failures", **kube) == 3
    assert value(samples, "fleetwatch_collector_last_duration_seconds", **kube) == 5.0
    assert value(samples, "fleetwatch_collector_errors_total", **kube) == 5
    assert value(samples, "fleetwatch_collector_errors_total", **slurm) == 0
    assert value(samples, "fleetwatch_metrics_database_up") == 1
    # Labels are names from fixed sets: nothing a user typed, no error text.
    text = "\n".join(str(k) for k in samples)
    assert "connection refused" not in text


def test_http_requests_counted_by_view_not_path(db: None, client: Any, scrape: Any) -> None:
    def login_count(samples: Samples) -> float:
        return samples.get(("fleetwatch_http_requests_total",
                            frozenset({"view": "login", "method": "GET", "status": "200"}.items())),
                           0.0)

    before = login_count(scrape()[1])
    for _ in range(3):
        assert client.get("/login/?next=/incidents/42/").status_code == 200
    client.get("/no/such/page/12345")
    families, samples = scrape()
    assert login_count(samples) == before + 3
    views = {dict(labels).get("view") for name, labels in samples
             if name == "fleetwatch_http_requests_total"}
    assert "unmatched" in views and not any("12345" in (v or "") for v in views)
    assert families["fleetwatch_http_request_duration_seconds"].type == "histogram"
    assert_histograms_well_formed(families)


def test_database_down_still_answers(db: None, scrape: Any) -> None:
    with mock.patch.object(metrics.IncidentsCollector, "_incidents",
                           side_effect=DatabaseError("gone")):
        _, samples = scrape()
    assert value(samples, "fleetwatch_metrics_database_up") == 0
    assert not any(name.startswith("fleetwatch_incidents") for name, _ in samples)


def test_metrics_token(db: None, client: Any, settings: Any, viewer: Any) -> None:
    settings.FLEETWATCH_METRICS_TOKEN = "scrape-me-0123456789"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    refused = client.get("/metrics", HTTP_AUTHORIZATION="Token scrape-me-0123456789")
    assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me-0123456789")
    assert ok.status_code == 200 and b"fleetwatch_incidents" in ok.content
    client.force_login(viewer)  # a person with a role may look too
    assert client.get("/metrics").status_code == 200
    assert client.post("/metrics").status_code == 405


def test_metrics_open_by_default(db: None, client: Any, settings: Any) -> None:
    settings.FLEETWATCH_METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 200


# --- several gunicorn workers -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request on its own connection (urllib closes it), so workers take turns."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


@dataclass
class Gunicorn:
    base: str
    proc: subprocess.Popen[bytes]
    log: Path
    multiproc: Path

    def worker_pids(self) -> set[int]:
        """Workers that have counted a request (prometheus_client's files are per pid)."""
        return {int(p.stem.rsplit("_", 1)[1]) for p in self.multiproc.glob("counter_*.db")}

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@pytest.fixture
def gunicorn(transactional_db: None, tmp_path: Path, request: Any) -> Iterator[Gunicorn]:
    """The project's gunicorn config with 3 workers on the test database. A test may set
    ``extra_env`` on its module for more settings."""
    if connection.vendor != "postgresql":
        pytest.fail("the gunicorn tests need PostgreSQL: run them with `make test`")
    db = connection.settings_dict
    port = free_port()
    multiproc = tmp_path / "prometheus"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update({
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "FLEETWATCH_DATA_DIR": str(tmp_path / "data"),
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        **getattr(request.module, "extra_env", {}),
    })
    log = tmp_path / "gunicorn.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py",
             "--bind", f"127.0.0.1:{port}", "--workers", "3"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Gunicorn(f"http://127.0.0.1:{port}", proc, log, multiproc)
    try:
        try:
            wait_for(lambda: http_get(f"{server.base}/login/")[0] == 200, 30, "gunicorn")
        except AssertionError:
            print(server.output())
            raise
        yield server
    finally:
        stop_process_group(proc)


def _login_requests(samples: Samples) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "fleetwatch_http_requests_total" and dict(labels).get("view") == "login")


def _login_durations(samples: Samples) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "fleetwatch_http_request_duration_seconds_count"
               and dict(labels).get("view") == "login")


def test_counts_add_up_across_gunicorn_workers(gunicorn: Gunicorn) -> None:
    fleet_fixture()
    n = 60
    before = _login_requests(parse(http_get(f"{gunicorn.base}/metrics")[1].decode())[1])
    # Six at once, each on its own connection: the three sync workers all take some.
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: http_get(f"{gunicorn.base}/login/")[0], range(n)))
    assert codes == [200] * n
    assert len(gunicorn.worker_pids()) >= 2, "the requests all went to one worker"

    def scrapes(count: int) -> list[Samples]:
        with ThreadPoolExecutor(3) as pool:
            bodies = list(pool.map(lambda _: http_get(f"{gunicorn.base}/metrics"), range(count)))
        assert all(code == 200 for code, _ in bodies)
        return [parse(body.decode())[1] for _, body in bodies]

    for samples in scrapes(9):  # whichever worker answers, the sum is the same
        assert _login_requests(samples) == before + n
        assert _login_durations(samples) == before + n
        assert_domain_matches_db(samples)

    # A worker that dies (crash, max_requests) takes nothing with it: its counts stay in its
    # file, and gunicorn's replacement starts its own.
    victim = sorted(gunicorn.worker_pids())[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: http_get(f"{gunicorn.base}/login/")[0] == 200, 20, "a worker after the kill")
    for samples in scrapes(6):
        assert _login_requests(samples) == before + n + 1
    assert "Traceback" not in gunicorn.output()
