"""Benchmark: server time of the operator's pages with 12,500 nodes, 100,000 GPUs and 10,000
incidents in PostgreSQL.

Run by ``make bench`` under tests/harness/with-services.sh, in a database of its own
(``<DATABASE_URL's name>_bench``, created and dropped here, as the collectors bench does).

The fleet is bulk-created with the shares a month of a real fleet has:

- 12,500 nodes (8 GPUs each) on 391 leaf switches of 32, in pools gpu / spare / rma; about
  1 % failed (one failed GPU each), 0.5 % unknown, 2 % drained, 1 % cordoned; 781 jobs of
  16 nodes;
- 10,000 incidents over 28 days, root causes mixed; all but 100 resolved (60 % by automation),
  30 remediating, 40 awaiting approval, 30 needing attention; each with its playbook's
  remediation and steps (56,000 steps), three signals (the cause on the node, the Slurm
  state change, the job's failure) linked as evidence, and its audit trail (opened,
  remediation created, approved, per step started / the outside call / succeeded, resolved:
  about 200,000 entries, hash-chained as audit_record writes them);
- 150,000 other signals (state flaps, thermal and link events) spread over the same month;
- the focus incident (remediating for 3 minutes) with its job's 16 nodes' GPU samples every
  5 s from 5 minutes before it (its chart);
- 3,000 collector runs and the three sources' health.

Then ``VACUUM ANALYZE`` (a live database has planner statistics), and each page is requested
through Django's test Client as a logged-in operator (sessions, auth, CSRF, messages and the
template rendering all included; no network, no browser): one cold request, then N timed ones,
reporting the best and the median, with the query count and the response size. The charts'
JSON is shown too (the pages fetch it after loading).

Target: each page under 300 ms (the median) on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

NODES = 12_500
GPUS_PER_NODE = 8
INCIDENTS = 10_000
LEAF_SIZE = 32
JOB_NODES = 16
BACKGROUND_SIGNALS = 150_000
TARGET_MS = 300.0
ROOT_CAUSES = ["gpu_hardware"] * 4 + ["gpu_memory", "nvlink", "network_flap", "thermal",
                                       "node_unreachable", "application_error"]
# Pages the target is about; the rest of the rows are what they fetch.
REQUIRED = {"dashboard", "dashboard live part", "incident list", "incident list, filtered",
            "incident page", "incident live part", "nodes list", "nodes list, filtered", "audit log",
            "audit log, filtered"}


def build(seed: int = 7) -> dict[str, Any]:
    """Bulk-create the fleet; return what the pages are requested for."""
    from django.contrib.auth.models import User
    from django.utils import timezone

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
    from incidents.audit import entry_hash
    from incidents.models import AuditEntry, Evidence, Incident, Remediation, Step
    from incidents.remediation.playbooks import FOR_ROOT_CAUSE, playbook_get

    rng = random.Random(seed)
    now = timezone.now()
    cluster = Cluster.objects.create(name="bench")
    for name in ("slurm", "kubernetes", "telemetry"):
        SourceHealth.objects.create(cluster=cluster, name=name, healthy=True, last_run_at=now,
                                    last_success_at=now - timedelta(seconds=2), runs=500_000)

    names = [f"gpu{i:05d}" for i in range(NODES)]
    failed = set(rng.sample(range(NODES), NODES // 100))
    unknown = set(rng.sample(range(NODES), NODES // 200)) - failed

    def health(i: int) -> str:
        return "failed" if i in failed else "unknown" if i in unknown else "healthy"

    nodes = Node.objects.bulk_create([
        Node(cluster=cluster, name=names[i], leaf_switch=f"leaf-{i // LEAF_SIZE:03d}",
             pool="rma" if i % 500 == 7 else "spare" if i % 50 == 9 else "gpu",
             in_service=i % 500 != 7,
             slurm_state="DOWN" if i in failed else "IDLE" if i % 50 == 9 else "ALLOCATED",
             slurm_flags=["DRAIN"] if i in failed or i % 100 == 3 else [],
             slurm_reason="fleetwatch: gpu_hardware" if i in failed else "",
             k8s_ready=i not in unknown, k8s_ready_status="Unknown" if i in unknown else "True",
             k8s_unschedulable=i in failed, nic_state="ACTIVE", nic_link_downed=0,
             health=health(i), updated_at=now)
        for i in range(NODES)], batch_size=2000)
    Gpu.objects.bulk_create([
        Gpu(node=n, index=g, uuid=f"GPU-{n.name}-{g}", utilization=float(rng.randrange(80, 100)),
            temperature=float(rng.randrange(50, 78)),
            health="failed" if n.health == "failed" and g == 5 else
            "unknown" if n.health == "unknown" else "healthy",
            last_xid=79 if n.health == "failed" and g == 5 else 0,
            last_xid_at=now if n.health == "failed" and g == 5 else None, updated_at=now)
        for n in nodes for g in range(GPUS_PER_NODE)], batch_size=5000)
    jobs = Job.objects.bulk_create([
        Job(cluster=cluster, slurm_id=str(500000 + j), name=f"train-{j}", user=f"user{j % 50}",
            state="RUNNING", nodes=names[j * JOB_NODES:(j + 1) * JOB_NODES],
            restart_count=j % 4, step=10_000 + j, checkpoint_step=9_500 + j,
            started_at=now - timedelta(days=2), updated_at=now)
        for j in range(NODES // JOB_NODES)])

    # Incidents, newest first: the first 100 are the open ones.
    open_status = (["running"] * 30 + ["awaiting_approval"] * 40 + ["failed"] * 30)
    incidents = []
    for k in range(INCIDENTS):
        i = rng.randrange(len(jobs) * JOB_NODES)  # a node that runs a job
        cause = ROOT_CAUSES[k % len(ROOT_CAUSES)]
        detected = now - timedelta(minutes=4 * k + 3)
        rem_status = open_status[k] if k < len(open_status) else "succeeded"
        status = {"awaiting_approval": "open", "running": "remediating",
                  "failed": "needs_attention"}.get(rem_status, "resolved")
        resolved = status == "resolved"
        incidents.append(Incident(
            cluster=cluster, root_cause=cause, confidence=0.9, playbook=FOR_ROOT_CAUSE[cause],
            explanation=f"XID 79 (GPU has fallen off the bus) on {names[i]} GPU 5; job "
                        f"{jobs[i // JOB_NODES].slurm_id} also ran on 15 other nodes: victims.",
            status=status, fingerprint=f"{cause}:{names[i]}:{k}", nodes=[names[i]],
            jobs=[jobs[i // JOB_NODES].slurm_id], detected_at=detected,
            opened_at=detected + timedelta(seconds=2),
            resolved_at=detected + timedelta(minutes=3) if resolved else None,
            phases={"detect": 2.0, "total": 180.0} if resolved else {},
            repaired_by=("automation", "automation", "person")[k % 3] if resolved else ""))
    incidents = Incident.objects.bulk_create(incidents, batch_size=2000)
    statuses = {inc.pk: (open_status[k] if k < len(open_status) else "succeeded")
                for k, inc in enumerate(incidents)}
    rems = Remediation.objects.bulk_create([
        Remediation(incident=inc, playbook=inc.playbook, mode="approve" if k % 3 == 2 else "auto",
                    status=statuses[inc.pk], requested_by="system", nodes=list(inc.nodes),
                    approved_by="user:olivia" if k % 3 == 2 and statuses[inc.pk] != "awaiting_approval"
                    else "", created_at=inc.opened_at,
                    started_at=inc.opened_at + timedelta(seconds=1),
                    finished_at=inc.resolved_at)
        for k, inc in enumerate(incidents)], batch_size=2000)

    def step_status(rem: str, order: int) -> str:
        if rem == "succeeded":
            return "succeeded"
        if rem == "running":
            return "succeeded" if order < 3 else "waiting" if order == 3 else "pending"
        if rem == "failed":
            return "succeeded" if order < 3 else "failed" if order == 3 else "pending"
        return "pending"

    steps = []
    for rem in rems:
        playbook = playbook_get(rem.playbook)
        assert playbook is not None, rem.playbook
        for order, spec in enumerate(playbook.steps, start=1):
            status = step_status(rem.status, order)
            begun = rem.created_at + timedelta(seconds=10 * order)
            steps.append(Step(
                remediation=rem, order=order, kind=spec.kind, title=spec.title, status=status,
                started_at=None if status == "pending" else begun,
                finished_at=begun + timedelta(seconds=8) if status in ("succeeded", "failed")
                else None, attempts=0 if status == "pending" else 1,
                detail=f"{rem.nodes[0]}: {spec.kind} done" if status == "succeeded" else "",
                error="scontrol requeue: Invalid job id" if status == "failed" else ""))
    steps = Step.objects.bulk_create(steps, batch_size=5000)

    # Each incident's own signals, then the month's background of other events.
    signals = []
    for inc in incidents:
        at = inc.detected_at
        signals += [
            Signal(cluster=cluster, source="dcgm", kind="xid", node_name=inc.nodes[0], gpu_index=5,
                   code=79, message=f"XID 79 on {inc.nodes[0]} GPU 5", observed_at=at),
            Signal(cluster=cluster, source="slurm", kind="slurm_node_state",
                   node_name=inc.nodes[0], value="DOWN+DRAIN",
                   message=f"{inc.nodes[0]} is DOWN+DRAIN", observed_at=at + timedelta(seconds=4)),
            Signal(cluster=cluster, source="slurm", kind="job_state", job_id=inc.jobs[0],
                   value="FAILED", message=f"job {inc.jobs[0]} RUNNING -> FAILED",
                   observed_at=at + timedelta(seconds=6)),
        ]
    mine = Signal.objects.bulk_create(signals, batch_size=5000)
    Evidence.objects.bulk_create([
        Evidence(incident=inc, signal=mine[3 * k + s], role="cause" if s == 0 else "symptom")
        for k, inc in enumerate(incidents) for s in range(3)], batch_size=5000)
    kinds = [("slurm", "slurm_node_state", "IDLE"), ("dcgm", "thermal", "HW_SLOWDOWN"),
             ("nic", "link_state", "DOWN"), ("kubernetes", "k8s_condition", "NotReady")]
    Signal.objects.bulk_create([
        Signal(cluster=cluster, source=src, kind=kind, node_name=names[rng.randrange(NODES)],
               value=value, message=f"{kind} {value}",
               observed_at=now - timedelta(seconds=rng.randrange(28 * 86400)))
        for src, kind, value in (kinds[b % 4] for b in range(BACKGROUND_SIGNALS))],
        batch_size=5000)

    # The audit trail, in time order and hash-chained as audit_record chains it.
    by_rem: dict[int, list[Any]] = {}
    for step in steps:
        by_rem.setdefault(step.remediation_id, []).append(step)
    drafts: list[dict[str, Any]] = []
    for inc, rem in zip(incidents, rems, strict=True):
        base = {"request_id": "", "call": "", "ok": True, "result": "", "duration_ms": None,
                "data": {}, "incident_id": inc.pk, "remediation_id": rem.pk, "step_id": None}
        drafts.append({**base, "at": inc.opened_at, "actor": "system", "verb": "incident.opened",
                       "target": f"incident {inc.pk}", "remediation_id": None})
        drafts.append({**base, "at": rem.created_at, "actor": "system",
                       "verb": "remediation.created", "target": f"incident {inc.pk}"})
        if rem.approved_by:
            drafts.append({**base, "at": rem.created_at + timedelta(seconds=5),
                           "actor": rem.approved_by, "verb": "remediation.approved",
                           "target": f"incident {inc.pk}"})
        for step in by_rem[rem.pk]:
            if step.started_at is None:
                continue
            at = step.started_at
            drafts.append({**base, "at": at, "actor": "system", "verb": "step.started",
                           "target": step.kind, "step_id": step.pk, "result": step.title})
            drafts.append({**base, "at": at + timedelta(seconds=1), "actor": "system",
                           "verb": f"slurm.{step.kind}", "target": inc.nodes[0],
                           "step_id": step.pk, "duration_ms": 41.5, "ok": step.status != "failed",
                           "call": f"scontrol update nodename={inc.nodes[0]} state=DRAIN"})
            if step.finished_at is not None:
                drafts.append({**base, "at": step.finished_at, "actor": "system",
                               "verb": f"step.{step.status}", "target": step.kind,
                               "step_id": step.pk, "ok": step.status != "failed",
                               "result": step.detail or step.error})
        if inc.resolved_at:
            drafts.append({**base, "at": inc.resolved_at, "actor": "system",
                           "verb": "incident.resolved", "target": f"incident {inc.pk}",
                           "result": "detect 2.0s, total 180.0s"})
    drafts.sort(key=lambda d: d["at"])
    prev = ""
    entries = []
    for fields in drafts:
        digest = entry_hash(fields, prev)
        entries.append(AuditEntry(**fields, prev_hash=prev, hash=digest))
        prev = digest
    AuditEntry.objects.bulk_create(entries, batch_size=5000)

    # The focus incident: the newest, a gpu_hardware one remediating since 3 minutes ago;
    # its job's 16 nodes sampled every 5 s from 5 minutes before it to now (its chart).
    focus = incidents[0]
    assert focus.root_cause == "gpu_hardware" and focus.status == "remediating"
    resolved = next(inc for inc in incidents[100:] if inc.root_cause == "gpu_hardware")
    job = next(j for j in jobs if j.slurm_id == focus.jobs[0])
    start = focus.detected_at - timedelta(minutes=5)
    ticks = int((now - start).total_seconds() // 5)
    by_name = {n.name: n for n in nodes}
    GpuSample.objects.bulk_create([
        GpuSample(node=by_name[name], gpu_index=g, at=start + timedelta(seconds=5 * t),
                  utilization=95.0, temperature=65.0)
        for name in job.nodes for g in range(GPUS_PER_NODE) for t in range(ticks)],
        batch_size=5000)
    CollectorRun.objects.bulk_create([
        CollectorRun(cluster=cluster, source=("slurm", "kubernetes", "telemetry")[k % 3],
                     started_at=now - timedelta(seconds=5 * k + 1), finished_at=now,
                     duration_ms=900.0, ok=True, counts={"nodes": NODES}, warnings=[])
        for k in range(3000)], batch_size=5000)
    from collectors.roles import OPERATOR, user_with_role

    user, _ = user_with_role("olivia", OPERATOR, "bench-pass-1")
    return {"user": User.objects.get(pk=user.pk), "focus": focus, "resolved": resolved,
            "node": focus.nodes[0], "job": job.slurm_id,
            "counts": {"nodes": Node.objects.count(), "gpus": Gpu.objects.count(),
                       "incidents": Incident.objects.count(), "steps": Step.objects.count(),
                       "signals": Signal.objects.count(), "audit": AuditEntry.objects.count(),
                       "samples": GpuSample.objects.count()}}


def pages(fleet: dict[str, Any]) -> list[tuple[str, str]]:
    from urllib.parse import quote

    from collectors import selectors

    focus, resolved = fleet["focus"].pk, fleet["resolved"].pk
    # The grid the dashboard draws: the group it opens on (the leaf with the most failed GPUs).
    group = selectors.gpu_group_default(selectors.gpu_groups("leaf"), fleet["counts"]["nodes"])
    return [
        ("dashboard", "/"),
        ("dashboard live part", "/dashboard/live"),
        ("dashboard GPU grid (JSON)", f"/dashboard/gpu-grid.json?by=leaf&group={quote(group or '*')}"),
        ("incident list", "/incidents/"),
        ("incident list, filtered", "/incidents/?status=resolved&root_cause=gpu_hardware&range=7d"),
        ("incident page", f"/incidents/{focus}/"),
        ("incident page, resolved", f"/incidents/{resolved}/"),
        ("incident live part", f"/incidents/{focus}/live"),
        ("incident chart (JSON)", f"/incidents/{focus}/chart.json"),
        ("nodes list", "/nodes/"),
        ("nodes list, filtered", "/nodes/?health=failed&q=gpu1"),
        ("node page", f"/nodes/{fleet['node']}/"),
        ("audit log", "/audit/"),
        ("audit log, filtered", "/audit/?actor=olivia&verb=remediation&range=7d"),
    ]


def measure(fleet: dict[str, Any], repeat: int) -> list[dict[str, Any]]:
    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    # The test Client's host; setup_test_environment() would add it, but also instruments
    # template rendering, which would slow every page down.
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    client = Client()
    client.force_login(fleet["user"])
    rows = []
    for name, url in pages(fleet):
        start = time.perf_counter()
        response = client.get(url)
        cold = time.perf_counter() - start
        assert response.status_code == 200, (url, response.status_code)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            response = client.get(url)
            times.append(time.perf_counter() - start)
            assert response.status_code == 200, (url, response.status_code)
        with CaptureQueriesContext(connection) as queries:
            client.get(url)
        median = statistics.median(times)
        slowest = max(queries.captured_queries, key=lambda q: float(q["time"]))
        rows.append({"page": name, "url": url, "cold_ms": cold * 1000,
                     "sql_ms": sum(float(q["time"]) for q in queries.captured_queries) * 1000,
                     "slowest_query_ms": float(slowest["time"]) * 1000,
                     "slowest_query": slowest["sql"][:300],
                     "best_ms": min(times) * 1000, "median_ms": median * 1000,
                     "queries": len(queries.captured_queries), "kib": len(response.content) / 1024,
                     "required": name in REQUIRED, "meets": median * 1000 < TARGET_MS})
        print(f"{name:32} median {median * 1000:7.1f} ms", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="timed requests per page")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    from tests.bench.collectors import _drop_database, _setup_database

    admin, name = _setup_database()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
    os.environ["FLEETWATCH_STORE_GPU_SAMPLES"] = "1"  # the focus incident's chart reads them
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    try:
        call_command("migrate", verbosity=0)
        start = time.perf_counter()
        fleet = build()
        built = time.perf_counter() - start
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE")
        print(f"built the fleet in {built:.0f} s: {fleet['counts']}", file=sys.stderr)
        rows = measure(fleet, args.repeat)
    finally:
        _drop_database(admin, name)
    c = fleet["counts"]
    lines = ["# Page benchmark", "",
             f"Server time of the operator's pages (Django test Client, logged in as an "
             f"operator: middleware, queries and template rendering; no network or browser) "
             f"with {c['nodes']:,} nodes, {c['gpus']:,} GPUs, {c['incidents']:,} incidents "
             f"({c['steps']:,} steps), {c['signals']:,} signals and {c['audit']:,} audit "
             f"entries in PostgreSQL. One cold request, then {args.repeat} timed; the "
             "queries of one more (their count, their time together and the slowest).", "",
             "| page | URL | cold | best | median | queries | in SQL | slowest query | size |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        page = r["page"] if r["required"] else f"*{r['page']}*"
        lines.append(f"| {page} | `{r['url']}` | {r['cold_ms']:.0f} ms | {r['best_ms']:.0f} ms "
                     f"| {r['median_ms']:.0f} ms | {r['queries']} | {r['sql_ms']:.0f} ms "
                     f"| {r['slowest_query_ms']:.0f} ms "
                     f"| {r['kib']:.0f} KiB |")
    required = [r for r in rows if r["required"]]
    slow = [r["page"] for r in required if not r["meets"]]
    worst = max(required, key=lambda r: r["median_ms"])
    lines += ["", f"Target: each page under {TARGET_MS:.0f} ms (median). "
              + (f"All {len(required)} pages meet it; the slowest is the {worst['page']} "
                 f"({worst['median_ms']:.0f} ms)." if not slow else
                 f"Missed by: {', '.join(slow)}.")
              + " Rows in italics are what the pages fetch after loading (the charts' JSON) "
              "or other pages, shown for reference. The live parts are what the open pages "
              "poll (the dashboard's every 3 s, the incident page's every 2 s)."]
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-pages.md").write_text(report)
    (args.out / "bench-pages.json").write_text(json.dumps(
        {"counts": c, "repeat": args.repeat, "target_ms": TARGET_MS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
