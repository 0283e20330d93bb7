"""The diagnosis window as read from the database: leaving out the telemetry samples the engine
skips (utilisation, cold temperatures, kernel chatter) changes no verdict, no note and no
fact.

Runs on PostgreSQL under make test and on SQLite with DATABASE_URL=sqlite:///...: the rows are
picked by JSON lookups, which the two databases evaluate differently."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from collectors.models import Cluster, Signal
from incidents import selectors
from incidents.diagnosis import diagnose_window, facts

pytestmark = pytest.mark.django_db

XID79 = "NVRM: Xid (PCI:0000:8a:00): 79, pid=2231, name=python, GPU has fallen off the bus."


def store(cluster: Cluster) -> None:
    t0 = timezone.now() - timedelta(minutes=10)
    rows: list[Signal] = []

    def add(seconds: float, source: str, node: str, kind: str = "", **data: Any) -> None:
        rows.append(Signal(cluster=cluster, source=source, kind=kind or f"pushed_{source}",
                           node_name=node, gpu_index=data.get("gpu"),
                           message=data.pop("message", ""), data=data,
                           observed_at=t0 + timedelta(seconds=seconds)))

    # Idle samples from five nodes; gpu-099 sends nothing else (it still counts in the fleet).
    for i in range(400):
        node = f"gpu-0{(i % 4) + 1:02d}" if i % 5 else "gpu-099"
        add(i, "dcgm", node, gpu=i % 8, metric="DCGM_FI_DEV_GPU_UTIL", value=i % 100)
        add(i + 0.5, "dcgm", node, gpu=i % 8, metric="DCGM_FI_DEV_GPU_TEMP", value=40 + i % 30)
    # What must be read: hot temperatures during a thermal slowdown (numbers and strings), a
    # string reading that only looks cold, a boolean, an XID gauge and a kernel XID.
    for i in range(6):
        add(100 + 15 * i, "dcgm", "gpu-005", gpu=3, metric="DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
            value=0x40)
        add(100 + 15 * i, "dcgm", "gpu-005", gpu=3, metric="DCGM_FI_DEV_GPU_TEMP",
            value=92 if i % 2 else "93")
    add(300, "dcgm", "gpu-006", gpu=1, metric="DCGM_FI_DEV_GPU_TEMP", value="95")
    add(301, "dcgm", "gpu-006", gpu=1, metric="DCGM_FI_DEV_GPU_TEMP", value=True)
    add(350, "dcgm", "gpu-007", kind="xid", gpu=2, code=None, metric="DCGM_FI_DEV_XID_ERRORS",
        value=48)
    add(420, "kernel", "gpu-008", message=XID79)
    # Kernel lines: a NIC going down (read), chatter that is neither XID nor link (left out).
    add(430, "kernel", "gpu-002", message="mlx5_core 0000:3b:00.0 ibp59s0: Link down")
    for i in range(50):
        add(440 + i, "kernel", "gpu-003",
            message="mlx5_core 0000:3b:00.0: poll_health: device's health compromised")
    # The last sample of the window is an idle one: the window's end is its time.
    add(599, "dcgm", "gpu-099", gpu=0, metric="DCGM_FI_DEV_GPU_UTIL", value=3)
    Signal.objects.bulk_create(rows)


def test_leaving_idle_samples_out_changes_no_verdict() -> None:
    cluster = Cluster.objects.create(name="window")
    store(cluster)
    start, end = timezone.now() - timedelta(minutes=30), timezone.now()
    every_row = [selectors.observation_from_signal(s) for s in Signal.objects.filter(
        cluster=cluster).order_by("observed_at", "id")]
    with CaptureQueriesContext(connection) as queries:
        window = selectors.observations_between(cluster, start, end)
    topology = {"leaf-a": ["gpu-001", "gpu-002", "gpu-005", "gpu-006", "gpu-007", "gpu-008"]}

    assert len(every_row) == 868
    # The 801 idle samples and 50 chatty kernel lines are summed up in the database: two
    # stand-ins for each of the five nodes that sent them (gpu-003 among them already); the
    # 17 other rows are read in full.
    assert len(window) == 17 + 2 * 5
    assert len(queries) == 2
    full, lean = facts.extract(every_row), facts.extract(sorted(window, key=lambda o: o.at))
    assert (lean.nodes_seen, lean.first, lean.last) == (full.nodes_seen, full.first, full.last)
    assert lean.hot == full.hot and len(full.hot[("gpu-005", "GPU 3")]) == 6
    assert full.hot[("gpu-006", "GPU 1")]  # the string "95" was read, not taken for cold
    assert lean.thermal_runs == full.thermal_runs and lean.xids == full.xids
    assert lean.links == full.links and len(full.links) == 1
    verdict, verdict_lean = (diagnose_window(every_row, topology),
                             diagnose_window(window, topology))
    assert verdict_lean == verdict
    assert {d.root_cause for d in verdict.diagnoses} >= {"gpu_hardware", "thermal"}


def test_every_kernel_line_a_parser_reads_is_read_from_the_database() -> None:
    """The window leaves kernel chatter out by word; every real line a parser reads (the
    corpus in tests/fixtures/real_logs: SXids, AER, port states, the driver's own messages)
    must still be read in full, and reach the verdict reading every row reaches."""
    corpus = yaml.safe_load((Path(__file__).resolve().parents[1] / "fixtures" / "real_logs"
                             / "kernel.yaml").read_text())
    cluster = Cluster.objects.create(name="formats")
    t0 = timezone.now() - timedelta(minutes=10)
    read = [e["line"] for e in corpus["lines"] if e["expect"]["kind"] != "ignored"]
    Signal.objects.bulk_create(
        Signal(cluster=cluster, source="kernel", kind="pushed_kernel", node_name=f"gpu-{i:03d}",
               message=line, data={}, observed_at=t0 + timedelta(seconds=i))
        for i, line in enumerate(read))
    start, end = timezone.now() - timedelta(minutes=30), timezone.now()
    window = selectors.observations_between(cluster, start, end)
    assert sorted(o.message for o in window if o.message) == sorted(read)
    every_row = [selectors.observation_from_signal(s) for s in Signal.objects.filter(
        cluster=cluster).order_by("observed_at", "id")]
    assert diagnose_window(window) == diagnose_window(every_row)


def test_a_run_after_another_reads_only_the_rows_it_has_not_read() -> None:
    """Each diagnosis run reads its whole window again (in a storm, thousands of rows a few
    hundred ms apart): on PostgreSQL the observations read last time are kept, and only the
    new rows are read in full; the window is the one a fresh read gives, rows pruned since
    left out."""
    if connection.vendor != "postgresql":
        pytest.skip("kept on PostgreSQL only (SQLite may hand a rolled-back row's id out again)")
    cluster = Cluster.objects.create(name="kept")
    store(cluster)
    start, end = timezone.now() - timedelta(minutes=30), timezone.now()
    first = selectors.observations_between(cluster, start, end)
    t = timezone.now() - timedelta(minutes=1)
    Signal.objects.bulk_create([
        Signal(cluster=cluster, source="kernel", kind="pushed_kernel", node_name="gpu-011",
               message=XID79, data={}, observed_at=t),
        Signal(cluster=cluster, source="dcgm", kind="pushed_dcgm", node_name="gpu-012",
               gpu_index=1, data={"metric": "DCGM_FI_DEV_XID_ERRORS", "value": 79},
               observed_at=t)])
    Signal.objects.filter(message=XID79, node_name="gpu-008").delete()  # pruned, say
    with CaptureQueriesContext(connection) as queries:
        again = selectors.observations_between(cluster, start, end)
    # The window's ids, the two new rows in full, the idle rows' summary.
    assert len(queries) == 3
    assert 'IN (' in queries.captured_queries[1]["sql"]
    selectors._kept_windows.clear()
    fresh = selectors.observations_between(cluster, start, end)
    assert again == fresh and len(again) == len(first) + 1
    assert [(o.id, o.fields) for o in again] == [(o.id, o.fields) for o in fresh]
    assert {o.node for o in again if o.message == XID79} == {"gpu-011"}
    assert diagnose_window(again) == diagnose_window(fresh)


def test_a_window_past_the_bound_is_read_whole_each_time(monkeypatch: Any) -> None:
    """Kept windows are bounded in bytes (a worker process keeps one per cluster): past the
    bound nothing is kept, and the next run reads the window whole, as without keeping."""
    if connection.vendor != "postgresql":
        pytest.skip("kept on PostgreSQL only")
    cluster = Cluster.objects.create(name="big")
    store(cluster)
    start, end = timezone.now() - timedelta(minutes=30), timezone.now()
    monkeypatch.setattr(selectors, "KEPT_BYTES", 1000)
    first = selectors.observations_between(cluster, start, end)
    assert len(first) > 2 and not selectors._kept_windows[cluster.pk]
    with CaptureQueriesContext(connection) as queries:
        assert selectors.observations_between(cluster, start, end) == first
    assert len(queries) == 2  # the window whole and the idle rows' summary: nothing kept
