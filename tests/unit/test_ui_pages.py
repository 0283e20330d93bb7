"""The operator's pages: what each one shows and filters, the postmortem export, the retry
control, what a viewer sees, and SQL query counts that do not grow with the fleet."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from collectors import selectors
from collectors import services as collectors
from collectors.models import (
    Cluster,
    CollectorRun,
    Gpu,
    GpuSample,
    Job,
    Node,
    Signal,
    SourceHealth,
)
from collectors.sim import fleet as sim
from collectors.sim.fleet import SimFleet
from incidents import lifecycle
from incidents.audit import audit_record
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Incident, Remediation, Step
from incidents.remediation import transitions
from incidents.templatetags.fleetwatch_ui import duration_text, relative, when
from tests.conftest import steps_queued

pytestmark = pytest.mark.django_db

NOW = timezone.now()


# --- a fleet built in bulk ------------------------------------------------------------------

@dataclass
class Fleet:
    cluster: Cluster
    focus: Incident  # remediating, with a running remediation, signals and audit entries
    failed: Incident  # its remediation failed at step 3
    resolved: Incident
    nodes: int = 0
    jobs: int = 0
    incidents: int = 0


STEP_TITLES = [("notify", "Notify the on-call channel"),
               ("drain_and_cancel", "Drain the Slurm node and cancel its jobs with SIGTERM"),
               ("requeue", "Requeue the cancelled jobs"),
               ("cordon_and_drain", "Cordon and drain the Kubernetes node")]


def _step_status(rem_status: str, order: int) -> str:
    if rem_status == "succeeded":
        return "succeeded"
    if rem_status == "failed":
        return {1: "succeeded", 2: "succeeded", 3: "failed"}.get(order, "pending")
    return {1: "succeeded", 2: "running"}.get(order, "pending")


def _remediations(pairs: list[tuple[Incident, str]]) -> None:
    rems = Remediation.objects.bulk_create([
        Remediation(incident=inc, playbook="replace_node", mode="auto", status=status,
                    requested_by="system", nodes=list(inc.nodes), started_at=NOW,
                    finished_at=None if status == "running" else NOW)
        for inc, status in pairs])
    steps = []
    for rem in rems:
        for order, (kind, title) in enumerate(STEP_TITLES, start=1):
            status = _step_status(rem.status, order)
            steps.append(Step(
                remediation=rem, order=order, kind=kind, title=title, status=status,
                started_at=None if status == "pending" else NOW - timedelta(minutes=5),
                finished_at=NOW - timedelta(minutes=4) if status in ("succeeded", "failed")
                else None,
                error="scontrol requeue 3000: Invalid job id" if status == "failed" else ""))
    Step.objects.bulk_create(steps)


def _incident(cluster: Cluster, i: int, status: str, node: str, job: str,
              **extra: Any) -> Incident:
    return Incident(cluster=cluster, root_cause=("gpu_hardware", "gpu_memory", "thermal",
                                                 "network_flap")[i % 4],
                    confidence=0.9, explanation=f"XID 79 on {node}", playbook="replace_node",
                    status=status, fingerprint=f"fp-{i}", nodes=[node], jobs=[job],
                    detected_at=NOW - timedelta(minutes=10 + i),
                    opened_at=NOW - timedelta(minutes=9 + i), **extra)


def grow(fleet: Fleet, *, nodes: int, incidents: int, audit: int) -> Fleet:
    """Add nodes (8 GPUs each, a signal each), jobs, incidents (a live remediation for each
    open one), audit entries and collector runs: everything a bigger fleet has more of."""
    cluster, first = fleet.cluster, fleet.nodes
    states = ["IDLE", "ALLOCATED", "MIXED", "DOWN"]
    node_rows = Node.objects.bulk_create([
        Node(cluster=cluster, name=f"gpu-{i:05d}", pool="spare" if i % 10 == 9 else "gpu",
             leaf_switch=f"leaf-{i // 8:03d}", slurm_state=states[i % 4],
             slurm_flags=["DRAIN"] if i % 7 == 3 else [], k8s_ready=i % 11 != 5,
             k8s_ready_status="True" if i % 11 != 5 else "False",
             k8s_unschedulable=i % 13 == 0, nic_state="ACTIVE",
             health="failed" if i % 9 == 2 else "healthy", updated_at=NOW)
        for i in range(first, first + nodes)])
    Gpu.objects.bulk_create([
        Gpu(node=n, index=g, uuid=f"GPU-{n.name}-{g}", utilization=float((n.pk * 7 + g) % 100),
            temperature=40.0 + g, health="failed" if n.health == "failed" and g == 5 else "healthy",
            last_xid=79 if n.health == "failed" and g == 5 else 0,
            last_xid_at=NOW if n.health == "failed" and g == 5 else None)
        for n in node_rows for g in range(8)])
    Signal.objects.bulk_create([
        Signal(cluster=cluster, source="dcgm", kind="xid", node=n, node_name=n.name, gpu_index=5,
               code=79, message=f"XID 79 on {n.name}",
               observed_at=NOW - timedelta(minutes=10, seconds=k % 50))
        for k, n in enumerate(node_rows)])
    names = [f"gpu-{i:05d}" for i in range(first + nodes)]
    new_jobs = max(1, nodes // 4)
    Job.objects.bulk_create([
        Job(cluster=cluster, slurm_id=str(3000 + j), name=f"train-{j}", user=f"u{j % 5}",
            state="RUNNING" if j % 3 else "PENDING",
            nodes=[names[k % len(names)] for k in range(j * 4, j * 4 + 4)],
            restart_count=j % 3, step=1000 + j, checkpoint_step=900 + j,
            resumed_from_step=900 + j if j % 3 else None, started_at=NOW, updated_at=NOW)
        for j in range(fleet.jobs, fleet.jobs + new_jobs)])
    made = Incident.objects.bulk_create([
        _incident(cluster, i, "resolved" if i % 3 else "open", names[i % len(names)],
                  str(3000 + i % (fleet.jobs + new_jobs)),
                  resolved_at=NOW - timedelta(minutes=i % 60) if i % 3 else None,
                  phases={"total": 300.0 + i} if i % 3 else {},
                  repaired_by=("automation", "person")[i % 2] if i % 3 else "")
        for i in range(fleet.incidents + 3, fleet.incidents + 3 + incidents)])
    _remediations([(inc, "running") for inc in made if inc.status == "open"])
    targets = [fleet.focus, *made]
    AuditEntry.objects.bulk_create([
        AuditEntry(at=NOW - timedelta(seconds=k + 1), actor="user:olivia" if k % 4 == 0
                   else "system",
                   verb=("step.succeeded", "slurm.drain", "remediation.created", "k8s.cordon")[k % 4],
                   target=targets[k % len(targets)].nodes[0],
                   call="scontrol update NodeName=x State=DRAIN" if k % 2 else "",
                   ok=k % 17 != 0, result="done", incident=targets[k % len(targets)])
        for k in range(audit)])
    GpuSample.objects.bulk_create([
        GpuSample(node=n, gpu_index=g, at=NOW - timedelta(minutes=m), utilization=90.0 - m,
                  temperature=60.0 + g)
        for n in node_rows[:4] for g in range(8) for m in range(0, 12, 2)])
    CollectorRun.objects.bulk_create([
        CollectorRun(cluster=cluster, source=("slurm", "kubernetes", "telemetry")[k % 3],
                     started_at=NOW - timedelta(seconds=5 * k + 1), finished_at=NOW,
                     duration_ms=12.0, ok=k % 5 != 0, error="" if k % 5 else "timed out",
                     counts={"nodes": nodes}, warnings=[])
        for k in range(max(30, nodes))])
    fleet.nodes += nodes
    fleet.jobs += new_jobs
    fleet.incidents += incidents
    return fleet


def build_fleet(nodes: int, *, incidents: int, audit: int) -> Fleet:
    """A fleet of ``nodes`` GPU nodes with three incidents the tests look at (the same
    whatever the size) and ``incidents`` more."""
    global NOW  # the fleet's "now", so ages and lags read exactly
    NOW = timezone.now()
    cluster = Cluster.objects.create(name="lab")
    for name in ("kubernetes", "slurm", "telemetry"):
        SourceHealth.objects.create(
            cluster=cluster, name=name, healthy=name != "slurm", last_run_at=NOW,
            last_success_at=NOW - timedelta(seconds=30),
            last_error="slurmctld timed out" if name == "slurm" else "", runs=10)
    # gpu-00002 (failed) runs job 3000; gpu-00001 and gpu-00003 are the other incidents' nodes.
    focus, failed, resolved = Incident.objects.bulk_create([
        _incident(cluster, 0, "remediating", "gpu-00002", "3000"),
        _incident(cluster, 1, "needs_attention", "gpu-00001", "3000"),
        _incident(cluster, 2, "resolved", "gpu-00003", "3000",
                  resolved_at=NOW - timedelta(minutes=1), repaired_by="automation",
                  phases={"detect": 1.5, "drain": 4.0, "total": 420.0}),
    ])
    _remediations([(focus, "running"), (failed, "failed"), (resolved, "succeeded")])
    return grow(Fleet(cluster, focus, failed, resolved), nodes=nodes, incidents=incidents,
                audit=audit)


# The pages whose query count must not grow with the fleet.
def bounded_pages(fleet: Fleet) -> dict[str, str]:
    return {
        "dashboard": "/",
        "dashboard-live": "/dashboard/live",
        "gpu-grid": "/dashboard/gpu-grid.json",
        "incident-list": "/incidents/",
        "incident-list-filtered": "/incidents/?status=resolved&root_cause=gpu_hardware&range=7d",
        "incident": f"/incidents/{fleet.focus.pk}/",
        "incident-live": f"/incidents/{fleet.focus.pk}/live",
        "incident-chart": f"/incidents/{fleet.focus.pk}/chart.json",
        "postmortem": f"/incidents/{fleet.focus.pk}/postmortem.md",
        "node-list": "/nodes/",
        "node-list-filtered": "/nodes/?health=failed&drained=no&q=gpu",
        "node": "/nodes/gpu-00002/",
        "job-list": "/jobs/",
        "job": "/jobs/3000/",
        "audit": "/audit/",
        "audit-filtered": "/audit/?actor=system&verb=slurm&range=24h",
        "sources": "/sources/",
        "policy": "/policy/",
        "capacity": "/capacity/",
        "capacity-chart": "/capacity/chart.json?range=week",
    }


# Generous enough for session, user and permission lookups; far below one query per row.
QUERY_BOUND = 20


def _count_queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return len(ctx.captured_queries)


@pytest.fixture(autouse=True)
def _own_sim_state(settings: Any, tmp_path: Path) -> None:
    """A node's page reads the simulated fleet's file: a test's own (unseeded unless the test
    asks for ``sim_fleet``), never the data dir's."""
    settings.FLEETWATCH_SIM_STATE = tmp_path / "sim-fleet.json"


@pytest.fixture
def ops(client: Client, operator: Any) -> Client:
    client.force_login(operator)
    return client


SMALL = {"nodes": 16, "incidents": 6, "audit": 40}
# What the bigger fleet adds: 600 nodes (4,800 GPUs), 400 incidents, 3,000 audit entries.
MORE = {"nodes": 600, "incidents": 400, "audit": 3000}


def test_page_queries_do_not_grow_with_the_fleet(
        operator: Any, django_assert_max_num_queries: Any) -> None:
    """Each page issues the same number of queries, under one bound, for a small fleet and
    for the same fleet grown forty times: no query per node, GPU, incident or entry."""
    client = Client()
    client.force_login(operator)
    fleet = build_fleet(**SMALL)
    counts: dict[str, list[int]] = {}
    for size in ("small", "big"):
        if size == "big":
            grow(fleet, **MORE)
        for name, url in bounded_pages(fleet).items():
            with django_assert_max_num_queries(QUERY_BOUND, info=name), \
                    CaptureQueriesContext(connection) as ctx:
                response = client.get(url)
            assert response.status_code == 200, (name, response.status_code)
            counts.setdefault(name, []).append(len(ctx.captured_queries))
    assert Gpu.objects.count() == 8 * (SMALL["nodes"] + MORE["nodes"])
    print("\nqueries per page, small/big:",
          ", ".join(f"{name} {small}/{big}" for name, (small, big) in counts.items()))
    grew = {name: c for name, c in counts.items() if c[1] != c[0]}
    assert not grew, f"query counts grew with the fleet: {grew}"


# --- what each page shows -------------------------------------------------------------------

ALL_PAGES = ["/", "/incidents/", "/nodes/", "/jobs/", "/audit/", "/sources/", "/capacity/",
             "/policy/"]


def test_every_page_needs_a_login(client: Client) -> None:
    fleet = build_fleet(4, incidents=0, audit=2)
    for url in [*bounded_pages(fleet).values(), "/audit/verify"]:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/login/"), url


def test_the_nav_links_every_page_and_marks_the_current_one(ops: Client) -> None:
    build_fleet(4, incidents=0, audit=2)
    page = ops.get("/nodes/").content.decode()
    nav = page[page.index('<nav aria-label="Main"'):page.index("</nav>")]
    for url in ALL_PAGES:
        assert f'href="{url}"' in nav
    assert 'href="/nodes/" data-testid="nav-nodes" aria-current="page"' in nav
    for url in ALL_PAGES:
        assert ops.get(url).status_code == 200, url


def test_dashboard_counts_groups_repairs_mttr_and_sources(ops: Client) -> None:
    fleet = build_fleet(16, incidents=6, audit=10)
    page = ops.get("/").content.decode()
    counts = selectors.fleet_counts()
    assert counts["nodes"] == 16 and counts["failed"] == 2  # gpu-00002, gpu-00011
    assert counts["drained"] == 2 and counts["gpus_failed"] == 2 and counts["gpus"] == 128
    assert f'data-testid="count-failed"><b>{counts["failed"]}</b>' in page
    assert "DOWN 4" in page  # Slurm states
    # Groups by leaf switch (8 nodes each): the failed GPUs are counted per leaf.
    assert 'data-testid="group-leaf-000"' in page and 'data-testid="group-leaf-001"' in page
    leaf0 = next(g for g in selectors.gpu_groups("leaf") if g["name"] == "leaf-000")
    assert (leaf0["nodes"], leaf0["gpus"], leaf0["failed"]) == (8, 64, 1)
    pools = {g["name"]: g for g in selectors.gpu_groups("pool")}
    assert set(pools) == {"gpu", "spare"} and pools["spare"]["nodes"] == 1
    # The repairs in flight say the step they are at; MTTR keeps automation and people apart.
    assert f'data-testid="repair-{fleet.focus.remediations.get().pk}"' in page
    assert "1/4 steps done · at step 2: Drain the Slurm node" in page
    assert 'data-testid="mttr"><dt>Automation</dt><dd>' in page
    assert "7 min" in page  # the resolved incident took 7 min (420 s... as detected->resolved)
    assert 'data-testid="source-slurm"' in page and "down: slurmctld timed out" in page
    # 30 s behind when the fleet was built; a loaded machine may take a second more to ask.
    assert re.search(r"lag 3[0-5] s", page)
    # The live part renders alone, with the same group.
    live = ops.get("/dashboard/live?by=pool&group=spare").content.decode()
    assert 'data-testid="grid-group">spare</b>' in live and "<html" not in live


def test_a_big_fleet_opens_the_grid_on_its_worst_group_and_a_click_shows_another(
        ops: Client) -> None:
    build_fleet(200, incidents=0, audit=2)
    # One more failed GPU on leaf-007 makes it the worst leaf.
    Gpu.objects.filter(node__name="gpu-00060", index=1).update(health="failed")
    page = ops.get("/").content.decode()
    assert 'data-testid="grid-group">leaf-007</b>' in page
    assert 'data-src="/dashboard/gpu-grid.json?by=leaf&amp;group=leaf-007"' in page
    grid = ops.get("/dashboard/gpu-grid.json?by=leaf&group=leaf-007").json()
    assert len(grid["z"]) == 8 and grid["total"] == 8 and not grid["truncated"]
    assert grid["y"][4] == "gpu-00060 (leaf-007)" and grid["z"][4][1] == 2
    assert "util " in grid["text"][4][1] and "last XID" in grid["text"][4][5]
    other = ops.get("/?by=leaf&group=leaf-003").content.decode()
    assert 'data-testid="grid-group">leaf-003</b>' in other
    everything = ops.get("/dashboard/gpu-grid.json?group=*").json()
    assert len(everything["z"]) == 200
    by_pool = ops.get("/dashboard/gpu-grid.json?by=pool&group=spare").json()
    assert len(by_pool["z"]) == 20 and all("(spare)" in y for y in by_pool["y"])


def test_node_list_filters_and_pages(ops: Client) -> None:
    build_fleet(120, incidents=0, audit=2)
    def rows(url: str) -> list[str]:
        return re.findall(r'data-testid="node-row-([\w-]+)"', ops.get(url).content.decode())
    assert rows("/nodes/")[:3] == ["gpu-00000", "gpu-00001", "gpu-00002"]
    assert len(rows("/nodes/")) == 50
    page2 = ops.get("/nodes/?page=2").content.decode()
    assert "page 2 of 3 · 120 in all" in page2
    assert rows("/nodes/?health=failed") == [f"gpu-{i:05d}" for i in range(120) if i % 9 == 2]
    assert rows("/nodes/?leaf_switch=leaf-003") == [f"gpu-{i:05d}" for i in range(24, 32)]
    assert rows("/nodes/?pool=spare&slurm_state=ALLOCATED") == [
        f"gpu-{i:05d}" for i in range(120) if i % 10 == 9 and i % 4 == 1]
    assert rows("/nodes/?drained=yes&q=0001") == [f"gpu-{i:05d}" for i in range(10, 20)
                                                 if i % 7 == 3]
    # A filter keeps its value across pages; an unknown choice is an error, not a crash.
    assert 'href="?health=healthy&amp;page=2"' in ops.get("/nodes/?health=healthy").content.decode()
    empty = ops.get("/nodes/?q=nope").content.decode()
    assert 'data-testid="empty"' in empty and "Reset the filters" in empty


def test_node_page_gpus_jobs_signals_incidents_repairs_and_telemetry(ops: Client) -> None:
    fleet = build_fleet(16, incidents=0, audit=2)
    page = ops.get("/nodes/gpu-00002/").content.decode()
    assert 'data-testid="node-health">failed' in page
    assert 'data-testid="gpu-row-5"' in page and "XID 79" in page
    assert '<a href="/jobs/3000/?cluster=lab">3000</a>' in page  # job 3000 runs on it
    assert f'href="/incidents/{fleet.focus.pk}/"' in page  # blames it
    assert 'data-testid="node-repairs"' in page and "replace_node" in page
    assert "XID 79 on gpu-00002" in page  # its signal
    assert 'id="node-util-chart"' in page and 'id="node-temp-chart"' in page
    data = ops.get("/nodes/gpu-00002/telemetry.json?minutes=30").json()
    assert set(data["utilization"]) == {f"GPU {g}" for g in range(8)}
    assert len(data["temperature"]["GPU 3"]["y"]) == 6 and data["temperature"]["GPU 3"]["y"][0] == 63.0
    assert ops.get("/nodes/nope/").status_code == 404


def _section(page: str, testid: str) -> str:
    """The HTML of the page's section with this data-testid."""
    start = page.index(f'data-testid="{testid}"')
    return page[start:page.index("</section>", start)]


def _row(html: str, testid: str) -> str:
    start = html.index(f'data-testid="{testid}"')
    return html[start:html.index("</tr>", start)]


def _collect() -> None:
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)


def test_node_page_shows_its_gpus_readings_and_pods_read_as_it_opens(
        ops: Client, sim_fleet: SimFleet) -> None:
    _collect()
    # A node at work: boost clocks, power against its limit, NVLink traffic, a Gen5 x16 link.
    readings = _section(ops.get("/nodes/gpu-001/").content.decode(), "gpu-readings")
    assert 'data-testid="readings-unavailable"' not in readings
    assert re.findall(r'data-testid="readings-row-(\d+)"', readings) == [str(g) for g in range(8)]
    busy = _row(readings, "readings-row-0")
    assert re.search(r'readings-power-0">\d{3} W <span class="muted">of 700 W</span>', busy)
    # Boost SM clocks (a little under 1,980 MHz from scrape to scrape), memory at 2,619 MHz.
    assert re.search(r"1,9[5-8]\d MHz · 2,619 MHz", busy) and "GB/s" in busy
    assert 'readings-pcie-0">Gen5 x16 <span class="muted">of Gen5 x16</span></td>' in busy
    assert "below its maximum" not in readings and 'readings-clock-events-0">none<' in busy
    assert 'data-testid="readings-missing"' not in readings  # the sim exports them all

    # GPU 5 falls off the bus: no readings at all (not zeros), and its node's job hangs, so
    # the other GPUs idle and say so. Its pods: one blocks automatic replacement.
    with sim_fleet.transaction() as state:
        sim.inject_xid(state, "gpu-003", 5, 79, time.time())
        sim.set_no_auto_replace(state, "gpu-003", True)
    page = ops.get("/nodes/gpu-003/").content.decode()
    readings = _section(page, "gpu-readings")
    gone = _row(readings, "readings-row-5")
    assert 'data-testid="readings-none-5"' in gone and "no readings" in gone
    assert " W" not in gone and "MHz" not in gone
    idle = _row(readings, "readings-row-0")
    assert "345 MHz" in idle and 'readings-clock-events-0">gpu idle<' in idle
    pods = _section(page, "node-pods")
    slurmd = _row(pods, "pod-row-slurm-slurmd-gpu-003")
    assert "StatefulSet" in slurmd and "Running" in slurmd and "<td>yes</td>" in slurmd
    assert 'data-testid="pod-no-auto-replace"' in slurmd
    assert "fleetwatch.io/no-auto-replace=true" in slurmd
    exporter = _row(pods, "pod-row-gpu-operator-dcgm-exporter-gpu-003")
    assert "DaemonSet" in exporter and "allowed" in exporter
    assert 'data-testid="pods-unavailable"' not in page


def test_node_page_lists_the_pods_of_its_kubernetes_name_under_slinky(
        ops: Client, sim_fleet: SimFleet) -> None:
    _collect()
    # Under Slinky, Slurm calls the machine slinky-4; Kubernetes (and the page's URL) gpu-004.
    Node.objects.filter(name="gpu-004").update(slurm_name="slinky-4")
    page = ops.get("/nodes/gpu-004/").content.decode()
    assert "<code>slinky-4</code> (Slurm's name for this machine)" in page
    pods = _section(page, "node-pods")
    assert 'data-testid="pod-row-slurm-slurmd-gpu-004"' in pods and "Pods unavailable" not in pods


def test_node_page_says_why_when_telemetry_and_kubernetes_are_down(
        ops: Client, sim_fleet: SimFleet) -> None:
    _collect()
    with sim_fleet.transaction() as state:
        sim.set_source_down(state, "telemetry", True)
        sim.set_source_down(state, "kubernetes", True)
    response = ops.get("/nodes/gpu-002/")
    assert response.status_code == 200
    page = response.content.decode()
    readings = _section(page, "gpu-readings")
    assert ('data-testid="readings-unavailable">Readings unavailable: Telemetry unavailable: '
            "telemetry unreachable (simulated outage)") in readings
    assert 'data-testid="readings-table"' not in readings and " W" not in readings
    assert ('data-testid="pods-unavailable">Pods unavailable: Kubernetes unavailable: '
            "kubernetes unreachable (simulated outage)") in _section(page, "node-pods")
    # What FleetWatch stored still shows, and an unreachable source failed no GPU.
    assert 'data-testid="gpu-row-0"' in page and 'data-testid="node-health">healthy' in page


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An address that takes connections and never answers (a hung Prometheus)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_prometheus_that_does_not_answer_leaves_the_node_page_saying_so(
        ops: Client, settings: Any, silent_server: str, tmp_path: Path) -> None:
    build_fleet(4, incidents=0, audit=2)
    settings.FLEETWATCH_FLEET, settings.FLEETWATCH_STORE_GPU_SAMPLES = "real", False
    settings.FLEETWATCH_PROMETHEUS_URL = silent_server
    settings.FLEETWATCH_HTTP_TIMEOUT = 0.5
    settings.FLEETWATCH_KUBECONFIG = str(tmp_path / "no-kubeconfig")
    response = ops.get("/nodes/gpu-00002/")
    assert response.status_code == 200
    page = response.content.decode()
    readings = _section(page, "gpu-readings")
    assert "Readings unavailable: Telemetry unavailable: Prometheus at" in readings
    assert "timed out after 0.5s" in readings and 'data-testid="readings-table"' not in readings
    assert "Pods unavailable: Kubernetes unavailable: Kubernetes configuration:" in page
    assert 'data-testid="node-health">failed' in page  # as stored, whatever the outage


def test_job_list_and_job_page_with_checkpoint_and_incidents(ops: Client) -> None:
    fleet = build_fleet(16, incidents=0, audit=2)
    listing = ops.get("/jobs/").content.decode()
    assert 'data-testid="job-row-3000"' in listing and 'data-testid="job-row-3003"' in listing
    assert re.findall(r'job-row-(\d+)', ops.get("/jobs/?state=PENDING").content.decode()) == [
        "3000", "3003"]
    assert re.findall(r'job-row-(\d+)', ops.get("/jobs/?node=gpu-00005").content.decode()) == [
        "3001"]
    page = ops.get("/jobs/3001/").content.decode()
    assert 'data-testid="job-restarts">1<' in page
    assert 'data-testid="job-checkpoint">step 901<' in page
    assert 'data-testid="job-resumed">step 901 (1001 now)' in page
    assert '<a href="/nodes/gpu-00004/?cluster=lab">gpu-00004</a>' in page
    hit = ops.get("/jobs/3000/").content.decode()
    assert f'href="/incidents/{fleet.focus.pk}/"' in hit and f'href="/incidents/{fleet.failed.pk}/"' in hit
    assert 'data-testid="job-resumed">never restarted' in hit
    assert ops.get("/jobs/9999/").status_code == 404


def test_incident_list_filters_by_status_root_cause_cluster_and_time(ops: Client) -> None:
    fleet = build_fleet(16, incidents=60, audit=2)
    def ids(url: str) -> list[int]:
        return [int(i) for i in re.findall(r'data-testid="incident-row-(\d+)"',
                                           ops.get(url).content.decode())]
    everything = ids("/incidents/")
    assert len(everything) == 50 and everything[0] == fleet.focus.pk  # newest first
    assert "page 1 of 2 · 63 in all" in ops.get("/incidents/").content.decode()
    resolved = ids("/incidents/?status=resolved&page=1")
    assert resolved and all(Incident.objects.get(pk=i).status == "resolved" for i in resolved)
    thermal = set(ids("/incidents/?root_cause=thermal"))
    assert thermal == set(Incident.objects.filter(root_cause="thermal").values_list("pk", flat=True))
    assert ids("/incidents/?cluster=lab&node=gpu-00002")[0] == fleet.focus.pk
    Cluster.objects.create(name="other")
    assert ids("/incidents/?cluster=other") == []
    # Time: opened 9 + i minutes ago.
    since = (NOW - timedelta(minutes=12, seconds=30)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")
    recent = ids(f"/incidents/?since={since}")
    assert set(recent) == set(Incident.objects.filter(
        opened_at__gte=NOW - timedelta(minutes=12, seconds=30)).values_list("pk", flat=True))
    Incident.objects.filter(pk=fleet.resolved.pk).update(opened_at=NOW - timedelta(days=3))
    assert fleet.resolved.pk not in ids("/incidents/?range=24h&status=resolved")
    assert fleet.resolved.pk in ids("/incidents/?range=7d&status=resolved")
    assert ids("/incidents/?open=yes")[:2] == [fleet.focus.pk, fleet.failed.pk]


@pytest.fixture
def sim_incident(sim_fleet: SimFleet, settings: Any, django_capture_on_commit_callbacks: Any) -> Any:
    settings.FLEETWATCH_POLICY_MODE = "approve"
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    cluster = collectors.cluster_default()
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(cluster.pk, Diagnosis(
            root_cause="gpu_hardware", nodes=("gpu-003",), confidence=0.97,
            playbook="replace_node", explanation="XID 79 (GPU has fallen off the bus) on gpu-003",
            detected_at=datetime.now(UTC) - timedelta(seconds=20), jobs=("3001",)))
    return incident


def test_incident_page_charts_utilisation_and_temperature(ops: Client, sim_incident: Any) -> None:
    page = ops.get(f"/incidents/{sim_incident.pk}/").content.decode()
    assert 'id="util-chart"' in page and 'id="temp-chart"' in page
    assert 'data-field="temperature"' in page
    chart = ops.get(f"/incidents/{sim_incident.pk}/chart.json").json()
    assert "gpu-003" in chart["series"] and "gpu-003" in chart["temperature"]
    assert all(20 <= t <= 100 for t in chart["temperature"]["gpu-003"]["y"])
    # The job's other nodes are drawn too.
    job_nodes = set(Job.objects.get(slurm_id="3001").nodes)
    assert job_nodes <= set(chart["temperature"])


def test_postmortem_export_in_markdown(ops: Client, sim_incident: Any, operator: Any,
                                       django_capture_on_commit_callbacks: Any) -> None:
    rem = sim_incident.remediations.get()
    with django_capture_on_commit_callbacks(execute=True):
        transitions.remediation_approve(rem.pk, operator)
    page = ops.get(f"/incidents/{sim_incident.pk}/").content.decode()
    assert f'href="/incidents/{sim_incident.pk}/postmortem.md"' in page
    response = ops.get(f"/incidents/{sim_incident.pk}/postmortem.md")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/markdown; charset=utf-8"
    assert f'incident-{sim_incident.pk}-postmortem.md' in response["Content-Disposition"]
    text = response.content.decode()
    assert text.startswith(f"# Incident #{sim_incident.pk}: GPU hardware on gpu-003")
    for heading in ("## Summary", "## Diagnosis", "## Remediation", "## Phases",
                    "## Outside calls (audit)", "## Timeline", "## Audit entries"):
        assert heading in text, heading
    assert "XID 79 (GPU has fallen off the bus) on gpu-003" in text
    assert "- **Confidence:** 97%" in text and "- **Jobs:** 3001" in text
    assert "| 1 | Notify the on-call channel |" in text
    assert "approved by user:olivia" in text
    assert "user:olivia remediation.approved" in text
    assert "&#x27;" not in text and "&lt;" not in text  # Markdown, not HTML-escaped


def _fail_step(rem: Remediation, order: int, error: str) -> Step:
    Step.objects.filter(remediation=rem, order__lt=order).update(
        status="succeeded", started_at=NOW, finished_at=NOW)
    step = rem.steps.get(order=order)
    Step.objects.filter(pk=step.pk).update(status="failed", error=error, started_at=NOW,
                                           finished_at=NOW)
    Remediation.objects.filter(pk=rem.pk).update(status="failed", finished_at=NOW)
    return step


def test_retry_is_offered_only_for_a_failed_remediation_and_says_what_it_runs(
        ops: Client, sim_incident: Any, django_capture_on_commit_callbacks: Any) -> None:
    rem = sim_incident.remediations.get()
    page = ops.get(f"/incidents/{sim_incident.pk}/").content.decode()
    assert "Retry failed step" not in page and 'id="confirm-retry"' not in page
    _fail_step(rem, 3, "scontrol requeue 3001: Invalid job id")
    page = ops.get(f"/incidents/{sim_incident.pk}/").content.decode()
    assert 'id="retry-toggle">Retry failed step…' in page
    assert ("This runs step 3 again: <b>requeue the cancelled jobs</b> for <b>gpu-003</b>, "
            "affecting job(s) <b>3001</b>; then the rest: check the node&#x27;s pods") in page
    assert "It failed with: scontrol requeue 3001: Invalid job id." in page
    assert 'id="confirm-retry">Confirm: retry step 3' in page
    assert 'id="confirm-approve"' not in page  # nothing to approve now
    with django_capture_on_commit_callbacks() as queued:
        response = ops.post(f"/incidents/{sim_incident.pk}/retry", {"remediation": rem.pk},
                            follow=True)
    assert "Retrying the failed step." in response.content.decode()
    rem.refresh_from_db()
    assert rem.status == "running" and steps_queued(queued) == 1
    assert AuditEntry.objects.get(verb="step.retried").actor == "user:olivia"
    page = ops.get(f"/incidents/{sim_incident.pk}/").content.decode()
    assert "Retry failed step" not in page


def test_controls_name_the_nodes_jobs_and_actions_before_the_click(
        ops: Client, sim_incident: Any) -> None:
    page = ops.get(f"/incidents/{sim_incident.pk}/").content.decode()
    assert ("This runs <code>replace_node</code> on <b>gpu-003</b>, affecting job(s) <b>3001</b>: "
            "notify the on-call channel; drain the Slurm node") in page
    assert 'id="cancel-toggle">Cancel…' in page and "Nothing more will run for <b>gpu-003</b>" in page
    rem = sim_incident.remediations.get()
    Remediation.objects.filter(pk=rem.pk).update(status="cancelled")
    page = ops.get(f"/incidents/{sim_incident.pk}/").content.decode()
    assert 'id="start-toggle">Start a new remediation…' in page
    assert 'id="cancel-toggle"' not in page


def test_a_viewer_sees_no_control_on_any_page_and_a_forged_retry_is_refused(
        client: Client, viewer: Any, sim_incident: Any) -> None:
    rem = sim_incident.remediations.get()
    _fail_step(rem, 2, "boom")
    client.force_login(viewer)
    pages = [*ALL_PAGES, f"/incidents/{sim_incident.pk}/", f"/incidents/{sim_incident.pk}/live",
             "/nodes/gpu-003/", "/jobs/3001/", "/dashboard/live"]
    for url in pages:
        page = client.get(url).content.decode()
        # The only form that posts is the logout button in the header.
        posts = re.findall(r'<form[^>]*method="post"[^>]*>', page)
        assert posts in ([], ['<form method="post" action="/logout/">']), (url, posts)
        for control in ("Approve…", "Retry failed step", "Cancel…", "Start remediation",
                        "Start a new", "Inject", "Continue anyway", "Stop here"):
            assert control not in page, (url, control)
    assert 'data-testid="role">viewer<' in client.get("/").content.decode()
    for action in ("retry", "approve", "cancel", "continue", "start"):
        response = client.post(f"/incidents/{sim_incident.pk}/{action}", {"remediation": rem.pk})
        assert response.status_code == 403, action
    rem.refresh_from_db()
    assert rem.status == "failed"


def test_audit_log_filters_pages_newest_first(ops: Client) -> None:
    fleet = build_fleet(8, incidents=3, audit=130)
    def ids(url: str) -> list[int]:
        return [int(i) for i in re.findall(r'data-testid="audit-row-(\d+)"',
                                           ops.get(url).content.decode())]
    first = ids("/audit/")
    assert first == list(AuditEntry.objects.order_by("-at", "-id").values_list("pk", flat=True)[:50])
    ats = [AuditEntry.objects.get(pk=i).at for i in first]
    assert ats == sorted(ats, reverse=True)
    assert "page 1 of 3 · 130 in all" in ops.get("/audit/").content.decode()
    olivia = ids("/audit/?actor=olivia")
    assert olivia and all(AuditEntry.objects.get(pk=i).actor == "user:olivia" for i in olivia)
    assert {AuditEntry.objects.get(pk=i).verb for i in ids("/audit/?verb=slurm")} == {"slurm.drain"}
    mine = ids(f"/audit/?incident={fleet.focus.pk}")
    assert set(mine) == set(AuditEntry.objects.filter(incident=fleet.focus)
                            .values_list("pk", flat=True)[:50])
    assert all(not AuditEntry.objects.get(pk=i).ok for i in ids("/audit/?failed=yes"))
    assert ids("/audit/?target=gpu-00002")
    until = (NOW - timedelta(seconds=100)).replace(microsecond=0)
    assert set(ids(f"/audit/?until={until:%Y-%m-%dT%H:%M:%S}")) == set(
        AuditEntry.objects.filter(at__lte=until).order_by("-at", "-id")
        .values_list("pk", flat=True)[:50])


def test_audit_chain_is_verified_only_when_asked_and_shows_ok_or_the_bad_entry(
        ops: Client) -> None:
    cache.clear()
    for k in range(3):
        audit_record("test.entry", f"t{k}")
    page = ops.get("/audit/").content.decode()
    assert "has not been verified recently" in page and 'id="verify-chain"' in page
    part = ops.get("/audit/verify", HTTP_HX_REQUEST="true").content.decode()
    head = AuditEntry.objects.order_by("-id").first()
    assert head is not None
    assert 'data-ok="true"' in part and "3 entries verified" in part and head.hash in part
    assert "Chain OK" in ops.get("/audit/").content.decode()  # kept for a while
    # Without htmx the button goes back to the page, which shows the result.
    assert ops.get("/audit/verify")["Location"] == "/audit/"
    # An entry slipped in with a forged hash breaks the chain there.
    [forged] = AuditEntry.objects.bulk_create([AuditEntry(
        actor="system", verb="forged", target="x", prev_hash=head.hash, hash="0" * 64)])
    part = ops.get("/audit/verify", HTTP_HX_REQUEST="true").content.decode()
    assert 'data-ok="false"' in part
    assert f'data-testid="verify-bad-id">{forged.pk}</b>: hash mismatch' in part


def test_sources_page_health_lag_runs_and_errors(ops: Client) -> None:
    build_fleet(8, incidents=0, audit=2)
    page = ops.get("/sources/").content.decode()
    assert 'data-testid="source-slurm"' in page
    slurm = page[page.index('data-testid="source-slurm"'):page.index('data-testid="source-telemetry"')]
    assert 'data-testid="source-status">down<' in slurm
    assert "Last error: slurmctld timed out" in slurm
    assert re.search(r'data-testid="source-lag">3[0-5] s<', slurm)
    assert "Last 10 runs" in slurm and "timed out" in slurm
    assert 'data-testid="source-status">up<' in page


def test_sources_page_empty_state_says_what_to_do(ops: Client) -> None:
    page = ops.get("/sources/").content.decode()
    assert "No collector has run yet" in page and "celery -A fleetwatch worker -B" in page


def test_policy_page_playbooks_modes_rails_and_no_secrets(ops: Client, settings: Any) -> None:
    settings.FLEETWATCH_PLAYBOOK_MODES = {"thermal": "approve"}
    settings.FLEETWATCH_STEP_MODES = {"replace": "approve", "return_to_service": "observe"}
    settings.FLEETWATCH_NOTIFY_SLACK_URL = "https://hooks.slack.com/services/T0/B0/s3cr3tpath"
    settings.FLEETWATCH_NOTIFY_WEBHOOK_URL = "https://bot:hunter2@hooks.example/fw?token=abc"
    settings.FLEETWATCH_NOTIFY_WEBHOOK_SECRET = "shh-its-a-secret"
    settings.FLEETWATCH_PROVIDER_COMMAND = "/opt/site/replace --api-key=KEY123"
    settings.FLEETWATCH_PROVIDER = "command"
    page = ops.get("/policy/").content.decode()
    for name in ("replace_node", "replace_and_rma", "reset_gpu", "hold_switch", "notify_owner"):
        assert f'data-testid="playbook-{name}"' in page
    assert "risk: replace" in page and "risk: reboot" in page
    thermal = page[page.index('data-testid="mode-thermal"'):]
    thermal = thermal[:thermal.index("</tr>")]
    assert "mode-approve" in thermal
    hardware = page[page.index('data-testid="mode-gpu_hardware"'):]
    hardware = hardware[:hardware.index("</tr>")]
    # The playbook's mode, then each risk class's: replace, reboot, reset_gpu, replacing a
    # node that still works (replace_working: approve unless FLEETWATCH_STEP_MODES names it),
    # and the return-to-service gate.
    assert re.findall(r">(auto|approve|observe)</span>", hardware) == ["auto", "approve", "auto",
                                                                        "auto", "approve",
                                                                        "observe"]
    assert "risk: return_to_service" in page
    assert "FLEETWATCH_BUDGET_MAX_NODES" in page and "FLEETWATCH_STORM_INCIDENTS" in page
    assert "FLEETWATCH_COOLDOWN_MINUTES" in page and "FLEETWATCH_RMA_AFTER" in page
    assert "https://hooks.slack.com/services/…" in page
    assert "https://hooks.example/fw?…" in page and "signed (HMAC-SHA256)" in page
    assert "/opt/site/replace" in page
    for secret in ("s3cr3tpath", "hunter2", "token=abc", "shh-its-a-secret", "KEY123"):
        assert secret not in page, secret


def test_empty_states_say_what_to_do_next(ops: Client) -> None:
    assert "No incidents yet" in ops.get("/incidents/").content.decode()
    assert "No nodes yet" in ops.get("/nodes/").content.decode()
    assert "No jobs yet" in ops.get("/jobs/").content.decode()
    assert "The audit trail is empty" in ops.get("/audit/").content.decode()
    assert "No open incidents" in ops.get("/").content.decode()


def test_times_are_utc_and_relative() -> None:
    now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert relative(now - timedelta(seconds=2), now) == "just now"
    assert relative(now - timedelta(minutes=3, seconds=4), now) == "3 min ago"
    assert relative(now - timedelta(hours=2), now) == "2 h ago"
    assert relative(now + timedelta(minutes=5), now) == "in 5 min"
    assert duration_text(0.25) == "250 ms" and duration_text(4.26) == "4.3 s"
    assert duration_text(185) == "3 min 5 s" and duration_text(7200) == "2 h"
    assert duration_text(None) == "-"
    html = str(when(now))
    assert 'datetime="2026-03-01T12:00:00Z"' in html and "2026-03-01 12:00:00 UTC · " in html


def test_hundreds_of_groups_show_the_worst_as_tiles_and_the_rest_by_search(ops: Client) -> None:
    build_fleet(8 * 60, incidents=0, audit=2)  # 60 leaf switches
    Gpu.objects.update(health="healthy")
    Gpu.objects.filter(node__leaf_switch__in=["leaf-050", "leaf-059"], index=0).update(
        health="failed")
    page = ops.get("/").content.decode()
    tiles = re.findall(r'data-testid="group-(leaf-\d+)"', page)
    assert len(tiles) == selectors.GROUP_TILES_MAX
    assert tiles[:3] == ["leaf-050", "leaf-059", "leaf-000"]  # failed GPUs first
    assert 'data-testid="grid-group">leaf-050</b>' in page  # the worst one is open
    assert 'id="group-input"' in page and '<option value="leaf-049">' in page
    chosen = ops.get("/?by=leaf&group=leaf-049").content.decode()
    assert 'data-testid="group-leaf-049"' in chosen  # the chosen group gets its tile
    assert 'data-testid="grid-group">leaf-049</b>' in chosen


def test_charts_read_prometheus_range_queries_when_no_samples_are_stored(
        ops: Client, settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from collectors.clients.prometheus import HistoryPoint

    fleet = build_fleet(8, incidents=0, audit=2)
    settings.FLEETWATCH_STORE_GPU_SAMPLES = False
    at = (NOW - timedelta(minutes=5)).timestamp()
    asked: list[list[str]] = []

    class Telemetry:
        def __init__(self, cluster: str) -> None:
            pass

        def gpu_history(self, nodes: list[str], start: datetime, end: datetime,
                        step: float) -> dict[str, dict[int, list[HistoryPoint]]]:
            asked.append(list(nodes))
            return {n: {0: [HistoryPoint(at, 80.0, 70.0)], 1: [HistoryPoint(at, None, 60.0)]}
                    for n in nodes}

    monkeypatch.setattr(selectors, "get_telemetry", Telemetry)
    node = ops.get("/nodes/gpu-00002/telemetry.json").json()
    assert asked[-1] == ["gpu-00002"]
    assert node["utilization"]["GPU 0"]["y"] == [80.0] and "GPU 1" not in node["utilization"]
    assert node["temperature"]["GPU 1"]["y"] == [60.0]
    chart = ops.get(f"/incidents/{fleet.focus.pk}/chart.json").json()
    assert "gpu-00002" in asked[-1]
    # Per node, the mean over its GPUs: utilisation counts a silent GPU as idle (0).
    assert chart["series"]["gpu-00002"]["y"] == [40.0]
    assert chart["temperature"]["gpu-00002"]["y"] == [65.0]


def test_node_chart_says_why_it_is_empty_when_prometheus_is_down(
        ops: Client, settings: Any) -> None:
    build_fleet(4, incidents=0, audit=2)
    settings.FLEETWATCH_FLEET, settings.FLEETWATCH_STORE_GPU_SAMPLES = "real", False
    settings.FLEETWATCH_PROMETHEUS_URL = "http://127.0.0.1:9"  # nothing listens there
    data = ops.get("/nodes/gpu-00002/telemetry.json").json()
    assert data["error"].startswith("telemetry unavailable") and data["utilization"] == {}
    page = ops.get("/nodes/gpu-00002/")
    assert page.status_code == 200
    assert re.search(r"Readings unavailable: Telemetry unavailable: Prometheus at "
                     r"http://127\.0\.0\.1:9 unreachable", page.content.decode())


def test_a_long_incident_chart_is_bucketed(db: None) -> None:
    from datetime import UTC, datetime, timedelta

    from incidents.selectors import CHART_POINTS, _mean_series

    start = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
    # Three hours of one-second samples of two GPUs: a line of at most CHART_POINTS points.
    points = [("gpu-003", g, start + timedelta(seconds=t), 90.0 + g, 60.0)
              for t in range(0, 3 * 3600) for g in (0, 1)]
    width = 3 * 3600 / CHART_POINTS
    series = _mean_series(points, 3, start, width)["gpu-003"]
    assert len(series["x"]) <= CHART_POINTS and set(series["y"]) == {90.5}
    assert series["x"][0] == start.isoformat()
