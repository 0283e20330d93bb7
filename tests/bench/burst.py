"""Benchmark: a fault is acted on while a flood of pushes is absorbed.

Run by ``make bench`` under tests/harness/with-services.sh. The whole stack as deployed: the
web server (gunicorn with the production config, two workers), a Celery worker and beat on
Redis, PostgreSQL (a database of its own, ``<DATABASE_URL's name>_burst``, created and dropped
here) and the simulated fleet standing in for Slurm and Kubernetes.

Clients push ``--batches`` batches of ``--batch-size`` records from eight nodes (GPU telemetry;
``--records kernel``: kernel chatter; ``--records job_log``: training output, which diagnosis
must read line by line) through ``POST /api/v1/signals/`` (an ingest token, ``--clients`` at once). When
``--fault-at`` of the batches are in, a node agent on another node pushes the kernel's XID 79
line. Reported: how long after that push the incident was opened (the server's own
``opened_at``), whether the flood was still going on then, how long the flood took, the
deepest the diagnose queue got (its Redis list, sampled every 0.2 s), the diagnosis runs and
the longest one, and how long after the last push diagnosis had caught up.

Before issue 23 each push queued a diagnosis of its own: with 200,000 records in 2,000 batches,
~1,900 waited in the queue and a new XID had no incident after 650 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
XID79 = "NVRM: Xid (PCI:0000:8a:00): 79, pid=2231, name=python, GPU has fallen off the bus."
FLOOD_NODES = [f"gpu-{n:03d}" for n in range(1, 9)]
FAULT_NODE = "gpu-012"


def _setup_database(suffix: str = "burst") -> tuple[str, str]:
    import dj_database_url
    import psycopg

    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres") or not os.environ.get("CELERY_BROKER_URL", "").startswith(
            "redis://"):
        sys.exit(f"{suffix} bench: needs DATABASE_URL (PostgreSQL) and CELERY_BROKER_URL "
                 "(Redis): run it with tests/harness/with-services.sh")
    name = f"{dj_database_url.parse(url)['NAME']}_{suffix}"
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    os.environ["DATABASE_URL"] = url.rsplit("/", 1)[0] + "/" + name
    return admin, name


class Sampler(threading.Thread):
    """The diagnose queue's depth and the diagnosis state, every 0.2 s."""

    def __init__(self, queue: Any) -> None:
        super().__init__(daemon=True)
        self.queue, self.stop = queue, threading.Event()
        self.depth_max = 0
        self.run_ms_max = 0.0

    def run(self) -> None:
        from django.db import connection

        from incidents.models import DiagnosisState

        try:
            while not self.stop.wait(0.2):
                self.depth_max = max(self.depth_max, int(self.queue.llen("diagnose")))
                state = DiagnosisState.objects.filter().values_list("last_run_ms", flat=True)
                self.run_ms_max = max([self.run_ms_max, *[ms or 0.0 for ms in state]])
        finally:
            connection.close()


def records(kind: str, n: int, size: int) -> list[dict[str, Any]]:
    """Batch ``n``: GPU telemetry (utilisation, normal temperatures) or kernel chatter, which
    diagnosis leaves out in SQL, or training output, which it must read, every line."""
    at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z"
    node = FLOOD_NODES[n % len(FLOOD_NODES)]
    if kind == "job_log":
        return [{"at": at, "source": "job_log", "node": node, "job": str(4000 + n % 8),
                 "message": f"[rank {i}] step {n * size + i} loss 2.{i:03d} lr 3e-4 "
                            f"tokens/s 41{i:03d}"} for i in range(size)]
    if kind == "kernel":
        return [{"at": at, "source": "kernel", "node": node,
                 "message": f"mlx5_core 0000:{0x10 + i % 8:02x}:00.0: poll_health:{n}: device's "
                            "health compromised - reached miss count 1"} for i in range(size)]
    # What a busy exporter sends: utilisation and (normal) temperatures per GPU.
    return [{"at": at, "source": "dcgm", "node": node, "gpu": i % 8,
             "metric": "DCGM_FI_DEV_GPU_UTIL" if i % 2 else "DCGM_FI_DEV_GPU_TEMP",
             "value": (n + i) % 100 if i % 2 else 40 + (n + i) % 30} for i in range(size)]


def flood(base: str, key: str, kind: str, batches: int, size: int, clients: int,
          pushed: list[int], errors: list[str]) -> None:
    """Push ``batches`` batches from ``clients`` threads; ``pushed[0]`` counts them."""
    import requests

    lock = threading.Lock()
    todo = iter(range(batches))

    def client() -> None:
        session = requests.Session()
        session.headers["Authorization"] = f"Token {key}"
        while True:
            with lock:
                n = next(todo, None)
            if n is None or errors:
                return
            batch = records(kind, n, size)
            for attempt in range(5):
                try:
                    answer = session.post(f"{base}/api/v1/signals/", json={"signals": batch},
                                          timeout=120)
                except requests.RequestException as exc:
                    answer = None
                    error = str(exc)
                else:
                    if answer.status_code == 201:
                        break
                    error = f"{answer.status_code} {answer.text[:200]}"
                time.sleep(1 + attempt)
            else:
                errors.append(error)
                return
            with lock:
                pushed[0] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import redis
    import requests
    from django.core.management import call_command
    from django.db import connection

    from collectors.roles import OPERATOR, user_with_role
    from collectors.sim.fleet import SimFleet
    from incidents.models import DiagnosisState, Incident
    from incidents.tokens import agent_token_create, token_create
    from tests.harness.processes import stop_process_group

    call_command("migrate", verbosity=0)
    broker = os.environ["CELERY_BROKER_URL"]
    queue = redis.Redis.from_url(broker)
    queue.flushdb()  # this bench's broker database: no stale tasks
    sim_state = tmp / "sim-fleet.json"
    SimFleet(sim_state, 20.0).seed()
    user, _ = user_with_role("burst-loader", OPERATOR)
    ingest_key = token_create(user, "burst-loader", ("read", "ingest"), ttl_days=1)[1]
    agent_key = agent_token_create(FAULT_NODE)[1]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FLEETWATCH_DATA_DIR": str(tmp / "data"),
           "FLEETWATCH_SIM_STATE": str(sim_state), "FLEETWATCH_COLLECT_INTERVAL": "5",
           "FLEETWATCH_API_INGEST_RATE": "1000000/min", "LOG_LEVEL": "WARNING"}
    env.update(deployed_cache())
    python = sys.executable
    gunicorn = Path(python).parent / "gunicorn"
    web = [str(gunicorn)] if gunicorn.exists() else [python, "-m", "gunicorn"]
    logs = tmp / "logs"
    logs.mkdir()
    procs = []
    for name, cmd in [
        ("worker", [python, "-m", "celery", "-A", "fleetwatch", "worker", "-B",
                    "-Q", "collect,diagnose,remediate,default", "--concurrency",
                    str(args.worker_concurrency), "--loglevel", "WARNING",
                    "-s", str(tmp / "beat-schedule")]),
        ("web", [*web, "-c", str(ROOT / "deploy" / "gunicorn.conf.py"), "fleetwatch.wsgi",
                 "--bind", f"127.0.0.1:{port}", "--workers", str(args.web_workers)]),
    ]:
        with open(logs / f"{name}.log", "wb") as out:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    sampler = Sampler(queue)
    try:
        _wait(lambda: _get(f"{base}/healthz") == 200, 90, "the web server")
        reader = requests.Session()
        reader.headers["Authorization"] = f"Token {ingest_key}"
        _wait(lambda: reader.get(f"{base}/api/v1/nodes/", params={"name": FAULT_NODE},
                                 timeout=10).json().get("count") == 1, 90,
              "the first collection of the simulated fleet")
        _wait(lambda: DiagnosisState.objects.filter(pending_since__isnull=True,
                                                    running_since__isnull=True).exists(),
              60, "the first collection's diagnosis")
        sampler.start()
        pushed, errors = [0], []
        started = time.time()
        pusher = threading.Thread(target=flood, daemon=True, args=(
            base, ingest_key, args.records, args.batches, args.batch_size, args.clients, pushed,
            errors))
        pusher.start()
        _wait(lambda: pushed[0] >= args.batches * args.fault_at or errors
              or not pusher.is_alive(), 3600, "the flood to reach the fault")
        fault_batch = pushed[0]
        agent = requests.Session()
        agent.headers["Authorization"] = f"Token {agent_key}"
        fault_at = time.time()
        answer = agent.post(f"{base}/api/v1/signals/", json={"signals": [
            {"at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z", "source": "kernel",
             "node": FAULT_NODE, "message": XID79}]}, timeout=120)
        assert answer.status_code == 201, answer.text

        def opened() -> Incident | None:
            return Incident.objects.filter(nodes=[FAULT_NODE]).first()

        incident = _wait(opened, args.max_wait, "the XID's incident")
        seen_at, seen_batch = time.time(), pushed[0]
        pusher.join()
        flood_done = time.time()

        def caught_up() -> bool:
            return DiagnosisState.objects.filter(pending_since__isnull=True,
                                                 running_since__isnull=True).exists()

        _wait(caught_up, 1800, "diagnosis to catch up")
        caught = time.time()
        sampler.stop.set()
        sampler.join(5)
        state = DiagnosisState.objects.get()
        from collectors.models import Signal

        source = {"telemetry": "dcgm"}.get(args.records, args.records)
        stored = Signal.objects.filter(node_name__in=FLOOD_NODES, source=source).count()
    finally:
        sampler.stop.set()
        for proc in procs:
            stop_process_group(proc)
        connection.close()
    if errors:
        raise SystemExit(f"burst bench: pushes failed: {errors[:3]}")
    latency = incident.opened_at.timestamp() - fault_at
    return {
        "kind": args.records, "batches": args.batches, "batch_size": args.batch_size,
        "clients": args.clients,
        "records": args.batches * args.batch_size, "stored": stored,
        "web_workers": args.web_workers, "worker_concurrency": args.worker_concurrency,
        "flood_s": round(flood_done - started, 1),
        "records_per_s": round(args.batches * args.batch_size / (flood_done - started)),
        "fault_after_batches": fault_batch, "fault_after_s": round(fault_at - started, 1),
        "fault_to_incident_s": round(latency, 1), "incident_seen_after_batches": seen_batch,
        "during_flood": incident.opened_at.timestamp() < flood_done
        and seen_batch < args.batches,
        "poll_seen_s": round(seen_at - fault_at, 1),
        "queue_depth_max": sampler.depth_max, "diagnosis_runs": state.runs,
        "diagnosis_run_ms_max": round(sampler.run_ms_max),
        "diagnosis_last_run_ms": round(state.last_run_ms or 0),
        "caught_up_after_flood_s": round(caught - flood_done, 1),
        "root_cause": incident.root_cause,
    }


def on_own_database(suffix: str, run: Callable[[argparse.Namespace, Path], dict[str, Any]],
                    args: argparse.Namespace) -> dict[str, Any]:
    """``run(args, tmp)`` with Django set up on a PostgreSQL database of its own
    (``<name>_<suffix>``, dropped afterwards) and a temporary data folder."""
    sys.path.insert(0, str(ROOT))
    admin, name = _setup_database(suffix)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
    with tempfile.TemporaryDirectory(prefix=f"fleetwatch-{suffix}-") as tmp:
        os.environ["FLEETWATCH_DATA_DIR"] = str(Path(tmp) / "data")
        import django

        django.setup()
        from tests.bench.collectors import _drop_database

        try:
            return run(args, Path(tmp))
        finally:
            _drop_database(admin, name)


def deployed_cache() -> dict[str, str]:
    """The cache as deployed (REDIS_URL) when the broker is Redis: the embedded default's
    file cache lists its folder on every write (Django culls that way), which a server
    taking hundreds of pushes a second from as many tokens pays for on each one."""
    broker = os.environ.get("CELERY_BROKER_URL", "")
    return {"FLEETWATCH_CACHE_URL": broker} if broker.startswith("redis://") else {}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    import requests

    with contextlib.suppress(requests.RequestException):
        return requests.get(url, timeout=3).status_code
    return 0


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise SystemExit(f"burst bench: timed out after {timeout:.0f} s waiting for {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--records", choices=["telemetry", "kernel", "job_log"],
                        default="telemetry",
                        help="what the flood is: GPU telemetry samples or kernel chatter, which "
                        "diagnosis leaves out in SQL, or training output, which it must read")
    parser.add_argument("--clients", type=int, default=4, help="pushing at once")
    parser.add_argument("--fault-at", type=float, default=0.5,
                        help="share of the batches pushed before the XID")
    parser.add_argument("--web-workers", type=int, default=2)
    parser.add_argument("--worker-concurrency", type=int, default=3)
    parser.add_argument("--max-wait", type=float, default=900.0,
                        help="give up waiting for the incident after this many seconds")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    r = on_own_database("burst", run, args)
    lines = [
        "# Burst benchmark", "",
        f"{r['records']:,} {r['kind']} records in {r['batches']:,} batches of "
        f"{r['batch_size']} pushed "
        f"through `POST /api/v1/signals/` ({r['clients']} clients at once; gunicorn with "
        f"{r['web_workers']} workers, one Celery worker of concurrency "
        f"{r['worker_concurrency']} with beat, PostgreSQL, Redis). After "
        f"{r['fault_after_batches']:,} batches ({r['fault_after_s']:.0f} s) a node agent on "
        f"another node pushed an XID 79.", "",
        "| figure | value |", "|---|---:|",
        f"| XID pushed -> incident opened | **{r['fault_to_incident_s']:.1f} s** |",
        f"| opened while the flood went on | {'yes' if r['during_flood'] else 'no'} "
        f"(batch {r['incident_seen_after_batches']:,} of {r['batches']:,}) |",
        f"| flood | {r['flood_s']:.0f} s ({r['records_per_s']:,} records/s), "
        f"{r['stored']:,} stored |",
        f"| diagnose queue depth, max | {r['queue_depth_max']} |",
        f"| diagnosis runs | {r['diagnosis_runs']:,} (longest {r['diagnosis_run_ms_max']:,} ms, "
        f"last {r['diagnosis_last_run_ms']:,} ms) |",
        f"| diagnosis caught up after the last push | {r['caught_up_after_flood_s']:.1f} s |",
        "", "Before issue 23 (one diagnosis queued per push): ~1,900 diagnoses waiting and no "
        "incident after 650 s at 200,000 records in 2,000 batches.",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.records == "telemetry" else f"-{args.records}"
    (args.out / f"bench-burst{suffix}.md").write_text(report)
    (args.out / f"bench-burst{suffix}.json").write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
