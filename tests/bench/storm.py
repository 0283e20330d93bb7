"""Benchmark: a fault storm (issue 18, "Storm") and the push intake rate ("Intake").

Run by ``make bench`` under tests/harness/with-services.sh. The whole stack as deployed, as
tests/bench/burst.py runs it: gunicorn with the production config, a Celery worker with beat
on Redis, PostgreSQL (a database of its own, ``<DATABASE_URL's name>_storm``, created and
dropped here) and the simulated fleet standing in for Slurm and Kubernetes.

Storm (the default): the simulated fleet is seeded with ``--nodes`` nodes and a few more, and
once the first Slurm collection has stored every one of them, each of the ``--nodes`` nodes'
agents pushes one kernel XID 79 line ("fallen off the bus") through ``POST
/api/v1/signals/``, the pushes spread evenly over ``--spread`` seconds, each its own request
with its node's own agent token (``--tokens ingest``: one ingest token for all, when making
thousands of agent tokens is too slow), from a pool of ``--clients`` threads. At ``--fault-at``
seconds a node outside the storm pushes an unrelated XID 48 (double-bit ECC). Reported:

- arrival -> stored: each push's answer time less its send time (the signal is committed before
  the answer), and the server's own ``ingested_at`` less the send time;
- signal -> incident for each storm node: its incident's ``opened_at`` less its push's send
  time; how many incidents were open 10 s after the storm began and at the end, and when the
  last storm node got its incident;
- diagnosis: runs during the storm, the longest, the deepest the diagnose queue got;
- the unrelated fault: pushed -> incident -> its remediation's first action (the first audit
  entry with an outside ``call``), or the hold, when a rail (the storm brake counts incidents
  per cluster, storm included) held it for a person;
- the storm brake: remediations started, held by the brake, held by another rail.

Intake (``--intake``): ``--clients`` clients push ``--batches`` batches of ``--batch-size``
kernel chatter lines (no fault; one ingest token) to gunicorn with ``--web-workers`` workers
(1 by default: the figure is per web worker). Reported: signals/s, per-push latency, the rows
stored against those sent, the ``api.call`` audit entries written (one per push, each under
the audit trail's global lock), and what PostgreSQL sessions were waiting on, sampled every
50 ms (``pg_stat_activity``): a push queued behind another's lock shows there.

Times are the machine's clock, read here and by the server on the same machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.bench.burst import (
    ROOT,
    XID79,
    Sampler,
    _free_port,
    _get,
    _wait,
    deployed_cache,
    on_own_database,
    records,
)

XID48 = ("NVRM: Xid (PCI:0000:3b:00): 48, pid=4412, name=python3, An uncorrectable double bit "
         "error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.")
# Nodes seeded beyond the storm's: the unrelated fault's, and a few the fleet keeps idle.
EXTRA_NODES = 4


def node_name(i: int) -> str:
    """The simulated fleet's name for its ``i``-th node (collectors/sim/fleet.py new_fleet)."""
    return f"gpu-{i:03d}"


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, p95, min and max (seconds, 3 decimals) and how many."""
    if not values:
        return {"n": 0, "median": None, "p95": None, "min": None, "max": None}
    ordered = sorted(values)
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]  # nearest rank
    return {"n": len(ordered), "median": round(statistics.median(ordered), 3),
            "p95": round(p95, 3), "min": round(ordered[0], 3), "max": round(ordered[-1], 3)}


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Stack:
    """gunicorn and a Celery worker with beat on this bench's database, stopped by ``stop``."""

    def __init__(self, tmp: Path, sim_state: Path, web_workers: int, concurrency: int,
                 beat: bool = True, split: bool = False) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        env = {**os.environ, "FLEETWATCH_DATA_DIR": str(tmp / "data"),
               "FLEETWATCH_SIM_STATE": str(sim_state), "FLEETWATCH_COLLECT_INTERVAL": "5",
               # The storm is one push per node; the intake is one client's flood: the
               # per-token budget would measure the throttle, not the intake.
               "FLEETWATCH_API_INGEST_RATE": "1000000/min", "LOG_LEVEL": "WARNING",
               **deployed_cache()}
        python = sys.executable
        gunicorn = Path(python).parent / "gunicorn"
        web = [str(gunicorn)] if gunicorn.exists() else [python, "-m", "gunicorn"]
        def worker(queues: str, processes: int, with_beat: bool) -> list[str]:
            return [python, "-m", "celery", "-A", "fleetwatch", "worker", "-Q", queues,
                    "--concurrency", str(processes), "--loglevel", "WARNING",
                    "-n", f"{queues.replace(',', '-')}@%h",
                    *(["-B", "-s", str(tmp / "beat-schedule")] if with_beat else [])]

        # One worker for every queue (the embedded default's way), or one per queue as
        # deploy/kubernetes runs them (``split``): the collector's with the beat, the
        # webhooks' and pages', diagnosis's, and the repairs' with ``concurrency`` processes.
        workers = ([("worker", worker("collect", 1, beat)),
                    ("worker-default", worker("default", 1, False)),
                    ("worker-diagnose", worker("diagnose", 1, False)),
                    ("worker-remediate", worker("remediate", concurrency, False))] if split
                   else [("worker", worker("collect,diagnose,remediate,default", concurrency,
                                           beat))])
        self.names = [name for name, _ in workers] + ["web"]
        self.procs: list[subprocess.Popen[bytes]] = []
        for name, cmd in [
            *workers,
            ("web", [*web, "-c", str(ROOT / "deploy" / "gunicorn.conf.py"), "fleetwatch.wsgi",
                     "--bind", f"127.0.0.1:{self.port}", "--workers", str(web_workers)]),
        ]:
            with open(self.logs / f"{name}.log", "wb") as out:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                                   stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def stop(self) -> None:
        from tests.harness.processes import stop_process_group

        for proc in self.procs:
            stop_process_group(proc)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) so far of each service's processes (its session: the
        master and its workers), from /proc: what the work cost, whatever the wall clock."""
        tick = os.sysconf("SC_CLK_TCK")
        # Each service's (a worker per queue when split), then the workers' together.
        # Besides: every PostgreSQL process on the machine (this bench's database is the only
        # one in use) and this process (the pushing clients), so that the figures add up to
        # what the storm cost the machine.
        sessions = dict(zip((proc.pid for proc in self.procs), self.names, strict=True))
        spent = dict.fromkeys([*sessions.values(), "postgres"], 0.0)
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                head, rest = stat.read_text().rsplit(")", 1)
            except (OSError, ValueError):
                continue  # gone meanwhile
            fields = rest.split()
            name = sessions.get(int(fields[3]))  # the session id (field 6)
            if name is None and head.endswith("(postgres"):
                name = "postgres"
            if name is not None:
                spent[name] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        spent["clients"] = time.process_time()
        if len(self.procs) > 2:  # split: "worker" is the collector's (with the beat)
            spent["worker-collect"] = spent.pop("worker")
            spent["worker"] = sum(v for k, v in spent.items() if k.startswith("worker-"))
        return spent

    def log_count(self, name: str, text: str) -> int:
        """How often ``text`` appears in the logs of ``name`` (the workers: all of them)."""
        return sum(path.read_text(errors="replace").count(text)
                   for path in self.logs.glob(f"{name}*.log"))

    def log_tail(self, name: str, lines: int = 20) -> list[str]:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


class WaitSampler(threading.Thread):
    """What this database's active sessions wait on (pg_stat_activity), every 50 ms: a lock
    every push queues behind shows as a count of ``Lock/advisory`` (the audit trail's lock)
    or ``Lock/transactionid`` / ``Lock/tuple`` (a row lock) waits."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.waits: Counter[str] = Counter()
        self.samples = 0
        self.waiting_max: Counter[str] = Counter()

    @staticmethod
    def _lock_name(key: int) -> str:
        from incidents.audit import AUDIT_LOCK_KEY
        from incidents.remediation.policy import POLICY_LOCK_KEY

        unsigned = {AUDIT_LOCK_KEY % 2**64: "the audit trail's", POLICY_LOCK_KEY % 2**64:
                    "the policy's"}
        return unsigned.get(key % 2**64, f"key {key}")

    def run(self) -> None:
        from django.db import connection

        try:
            while not self.stop.wait(0.05):
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT coalesce(wait_event_type, 'CPU') || '/' || "
                        "coalesce(wait_event, '-'), count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND state = 'active' "
                        "AND pid <> pg_backend_pid() GROUP BY 1")
                    rows = cursor.fetchall()
                    # Which advisory lock they queue for: the audit trail's or the policy's
                    # (pg_locks splits the bigint key into classid, the high 32 bits, and
                    # objid, the low ones).
                    cursor.execute(
                        "SELECT classid::bigint * 4294967296 + objid::bigint, count(*) "
                        "FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                        "AND database = (SELECT oid FROM pg_database "
                        "WHERE datname = current_database()) GROUP BY 1")
                    rows += [(f"Lock/advisory: {self._lock_name(key)} lock", n)
                             for key, n in cursor.fetchall()]
                self.samples += 1
                for what, n in rows:
                    self.waits[what] += n
                    self.waiting_max[what] = max(self.waiting_max[what], n)
        finally:
            connection.close()


# --- storm ----------------------------------------------------------------------------------


class Poster:
    """A lean HTTP client for the pushing threads: a connection per request (gunicorn's sync
    workers close each one), the body encoded by the caller. This bench's load shares the
    server's cores: ``requests`` spent 0.6 ms of CPU a push (and the GIL its 64 threads
    contend for) where ``http.client`` spends 0.1, CPU a real storm's agents spend on their
    own machines. ``cpu_s``: what the pushing threads spent, summed (the intake reports it)."""

    def __init__(self, base: str) -> None:
        from urllib.parse import urlsplit

        url = urlsplit(base)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.cpu_s = 0.0
        self._lock = threading.Lock()

    def post(self, path: str, body: bytes, token: str, timeout: float = 120) -> tuple[int, str]:
        """Status and body text; OSError (http.client's errors among them) when it failed."""
        import http.client

        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers={
                "Authorization": f"Token {token}", "Content-Type": "application/json"})
            answer = conn.getresponse()
            return answer.status, answer.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def threads(self, client: Callable[[], None], n: int) -> None:
        """Run ``client`` on ``n`` threads until each returns, adding up their CPU."""
        def timed() -> None:
            start = time.thread_time()
            try:
                client()
            finally:
                with self._lock:
                    self.cpu_s += time.thread_time() - start

        threads = [threading.Thread(target=timed, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def storm_push(poster: Poster, keys: list[str], nodes: list[str], spread: float, clients: int,
               started: float, sent: list[float], answered: list[float],
               errors: list[str]) -> None:
    """Push node ``i``'s XID 79 at ``started + i * spread / len(nodes)``, its due time (or as
    soon after as a client thread is free: when the server answers slower than the pushes
    come, they go out late, as a real agent's would wait in the server's listen queue), each
    its own request; record send and answer times by index."""
    import http.client

    lock = threading.Lock()
    todo = iter(range(len(nodes)))

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            due = started + i * spread / len(nodes)
            time.sleep(max(0.0, due - time.time()))
            body = json.dumps({"signals": [{"at": _iso(time.time()), "source": "kernel",
                                            "node": nodes[i], "message": XID79}]}).encode()
            sent[i] = time.time()
            try:
                code, text = poster.post("/api/v1/signals/", body, keys[i])
            except (OSError, http.client.HTTPException) as exc:
                errors.append(f"{nodes[i]}: {exc}")
                continue
            answered[i] = time.time()
            if code != 201:
                errors.append(f"{nodes[i]}: {code} {text[:200]}")

    poster.threads(client, clients)


def run_storm(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import redis
    import requests
    from django.core.management import call_command
    from django.db import connection
    from django.db.models import Count

    from collectors.models import Node, Signal
    from collectors.roles import OPERATOR, user_with_role
    from collectors.sim.fleet import SimFleet
    from incidents.models import AuditEntry, DiagnosisState, Evidence, Incident, Remediation
    from incidents.tokens import agent_token_create, token_create

    call_command("migrate", verbosity=0)
    queue = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    queue.flushdb()  # this bench's broker database: no stale tasks
    sim_state = tmp / "sim-fleet.json"
    n = args.nodes
    SimFleet(sim_state, 20.0).seed(nodes=n + EXTRA_NODES, spares=3)
    storm_nodes = [node_name(i) for i in range(1, n + 1)]
    fault_node = node_name(n + 1)
    # Tokens before the services start: each one is an audited insert, nothing else runs.
    t = time.monotonic()
    if args.tokens == "agent":
        keys = [agent_token_create(node)[1] for node in storm_nodes]
    else:
        user, _ = user_with_role("storm-loader", OPERATOR)
        keys = [token_create(user, "storm-loader", ("ingest",), ttl_days=1)[1]] * n
    tokens_s = time.monotonic() - t
    fault_key = agent_token_create(fault_node)[1]
    reader_user, _ = user_with_role("storm-reader", OPERATOR)
    read_key = token_create(reader_user, "storm-reader", ("read",), ttl_days=1)[1]

    stack = Stack(tmp, sim_state, args.web_workers, args.worker_concurrency,
                  split=args.split_workers)
    sampler = Sampler(queue)
    waits = WaitSampler()
    fault: dict[str, Any] = {"node": fault_node}
    try:
        _wait(lambda: _get(f"{stack.base}/healthz") == 200, 120, "the web server")
        t = time.monotonic()
        everyone = [*storm_nodes, fault_node]
        _wait(lambda: Node.objects.filter(name__in=everyone).count() == len(everyone),
              args.max_wait, "the first Slurm collection to store every node")
        reader = requests.Session()
        reader.headers["Authorization"] = f"Token {read_key}"
        assert reader.get(f"{stack.base}/api/v1/nodes/{fault_node}/", timeout=30).ok
        _wait(lambda: DiagnosisState.objects.filter(pending_since__isnull=True,
                                                    running_since__isnull=True).exists(),
              args.max_wait, "the first collection's diagnosis")
        first_collection_s = time.monotonic() - t
        runs_before = sum(DiagnosisState.objects.values_list("runs", flat=True))
        audit_before = AuditEntry.objects.order_by("-id").values_list("id", flat=True).first()
        sampler.start()
        waits.start()
        cpu_before = stack.cpu_seconds()

        sent, answered, errors = [0.0] * n, [0.0] * n, []  # type: tuple[list[float], list[float], list[str]]
        started = time.time() + 0.5
        poster = Poster(stack.base)
        pusher = threading.Thread(target=storm_push, daemon=True, args=(
            poster, keys, storm_nodes, args.spread, args.clients, started, sent, answered,
            errors))
        pusher.start()

        # The unrelated fault, from its own agent, while the storm goes on.
        time.sleep(max(0.0, started + args.fault_at - time.time()))
        agent = requests.Session()
        agent.headers["Authorization"] = f"Token {fault_key}"
        fault["pushed"] = time.time()
        fault["after_start_s"] = round(fault["pushed"] - started, 3)
        answer = agent.post(f"{stack.base}/api/v1/signals/", json={"signals": [
            {"at": _iso(time.time()), "source": "kernel", "node": fault_node,
             "message": XID48}]}, timeout=120)
        fault["answered"] = time.time()
        fault["status"] = answer.status_code

        pusher.join()
        storm_pushed = time.time()

        # Every storm node's incident, by node: polled until all are there or time is up.
        opened: dict[str, float] = {}
        count_at: dict[str, int] = {}
        # Pushes that went out late (a slow intake) get a minute after the last one at least.
        deadline = max(started + args.max_wait, storm_pushed + 60)
        storm_set = set(storm_nodes)
        while time.time() < deadline:
            # When its XID was linked to an incident: its own incident's opening, or the
            # moment it joined the storm incident (opened by the storm's first past the brake).
            for node, at in Evidence.objects.filter(
                    signal__node_name__in=storm_set, signal__source="kernel",
                    signal__message=XID79).values_list("signal__node_name", "added_at"):
                opened[node] = min(opened.get(node, at.timestamp()), at.timestamp())
            if "fault_incident" not in fault:
                found = Incident.objects.filter(nodes=[fault_node]).first()
                if found is not None:
                    fault["fault_incident"] = found.pk
            if len(opened) == n and "fault_incident" in fault:
                break
            time.sleep(1.0)
        finished_waiting = time.time()
        count_at["10s"] = sum(1 for at in opened.values() if at <= started + 10)
        count_at["end"] = len(opened)

        # The unrelated fault's first action or hold (steps run on the remediate queue).
        first_action = held = None
        fault_id: int = fault.get("fault_incident", 0)  # 0: no such row
        incident = Incident.objects.filter(pk=fault_id).first()
        if incident is not None:
            fault["opened"] = incident.opened_at.timestamp()
            fault["root_cause"] = incident.root_cause

            # Its remediation's first outside call, or the hold; 60 s at most.
            until = time.time() + 60
            while time.time() < until:
                entries = AuditEntry.objects.filter(incident=incident).order_by("id")
                first_action = entries.exclude(call="").first()
                held = entries.filter(verb="remediation.held").first()
                if first_action is not None or held is not None:
                    break
                time.sleep(0.1)
            if first_action is not None:
                fault["first_action"] = first_action.at.timestamp()
                fault["first_action_call"] = first_action.call[:200]
            if held is not None:
                fault["held"] = held.at.timestamp()
                fault["held_reason"] = held.result[:300]
            rem = incident.remediations.order_by("id").first()
            fault["remediation"] = None if rem is None else {
                "status": rem.status, "playbook": rem.playbook, "hold_reason": rem.hold_reason}

        # Diagnosis caught up (nothing pending, nothing running), capped.
        t = time.time()
        caught = None
        while time.time() < t + 120:
            if DiagnosisState.objects.filter(pending_since__isnull=True,
                                             running_since__isnull=True).exists():
                caught = time.time()
                break
            time.sleep(0.25)
        sampler.stop.set()
        sampler.join(5)
        waits.stop.set()
        waits.join(5)
        cpu = {name: round(spent - cpu_before[name], 1)
               for name, spent in stack.cpu_seconds().items()}

        ingested = dict(Signal.objects.filter(node_name__in=storm_nodes, source="kernel",
                                              message=XID79)
                        .values_list("node_name", "ingested_at"))
        state = DiagnosisState.objects.get()
        storm_incidents = Incident.objects.exclude(pk=fault_id)
        grouped = {"alone": storm_incidents.filter(storm=False).count(),
                   "storm_incidents": storm_incidents.filter(storm=True).count(),
                   "nodes_in_storm_incidents": sum(
                       len(nodes) for nodes in storm_incidents.filter(storm=True)
                       .values_list("nodes", flat=True))}
        remediations = dict(Remediation.objects.filter(incident__in=storm_incidents)
                            .values_list("status").annotate(n=Count("id")))
        brake_held = Remediation.objects.filter(incident__in=storm_incidents,
                                                hold_reason__startswith="storm brake").count()
        other_held = Remediation.objects.filter(incident__in=storm_incidents).exclude(
            hold_reason="").exclude(hold_reason__startswith="storm brake").count()
        audit_entries = AuditEntry.objects.filter(id__gt=audit_before or 0).values(
            "verb").annotate(n=Count("id"))
    finally:
        sampler.stop.set()
        waits.stop.set()
        stack.stop()
        connection.close()

    # Where a diagnosis run's time goes, measured here with nothing else running (the stack
    # is stopped) on the storm's database, each in a transaction rolled back afterwards.
    profiles = {}
    if args.profile:
        profiles["rerun"] = profile_rerun(started - 60, args.profile)
        profiles["opening"] = profile_opening(storm_nodes[:args.profile])

    index = {node: i for i, node in enumerate(storm_nodes)}
    answer_s = [answered[i] - sent[i] for i in range(n) if answered[i]]
    # From when the agent would have sent it (the storm's schedule) to the answer: includes
    # the time it waited for a free client because the server answered slower than that.
    due = [started + i * args.spread / n for i in range(n)]
    due_answer_s = [answered[i] - due[i] for i in range(n) if answered[i]]
    samples = max(1, waits.samples)
    ingest_s = [ingested[node].timestamp() - sent[index[node]] for node in ingested]
    incident_s = [at - sent[index[node]] for node, at in opened.items()]
    last = max(opened.values()) if opened else None
    return {
        "mode": "storm", "nodes": n, "spread_s": args.spread, "clients": args.clients,
        "tokens": args.tokens, "tokens_made_s": round(tokens_s, 1),
        "web_workers": args.web_workers, "worker_concurrency": args.worker_concurrency,
        "split_workers": args.split_workers,
        "first_collection_s": round(first_collection_s, 1),
        "pushes_failed": len(errors), "errors": errors[:5],
        "storm_pushed_s": round(storm_pushed - started, 2),
        "signals_stored": len(ingested),
        "push_answer_s": summary(answer_s), "pushes_over_2s": sum(1 for s in answer_s if s > 2),
        "due_to_answer_s": summary(due_answer_s),
        "due_over_2s": sum(1 for s in due_answer_s if s > 2),
        "signal_due_to_incident_s": summary(
            [at - due[index[node]] for node, at in opened.items()]),
        "send_to_ingested_s": summary(ingest_s),
        "signal_to_incident_s": summary(incident_s),
        "incidents_within_10s_of_signal": sum(1 for s in incident_s if s <= 10),
        "incidents_by_10s": count_at["10s"], "incidents_at_end": count_at["end"],
        "all_incidents_after_s": None if len(opened) < n or last is None
        else round(last - started, 2),
        "waited_s": round(finished_waiting - started, 1),
        "diagnosis_runs": state.runs - runs_before,
        "diagnosis_run_ms_max": round(sampler.run_ms_max),
        "diagnose_queue_max": sampler.depth_max,
        "diagnosis_caught_up_after_s": None if caught is None else round(caught - started, 1),
        "fault": {**fault, **_fault_figures(fault)},
        "grouped": grouped, "cpu_s": cpu,
        "remediations": remediations, "storm_brake_held": brake_held,
        "other_rail_held": other_held,
        "audit_entries": {row["verb"]: row["n"] for row in audit_entries},
        "worker_log_tail": stack.log_tail("worker", 10),
        # Runs killed at the soft time limit are not counted in DiagnosisState.runs.
        "diagnosis_time_limits": stack.log_count("worker", "raised unexpected: "
                                                 "SoftTimeLimitExceeded"),
        "profiles": profiles,
        # Mean number of this database's sessions in each state per 50 ms sample.
        "pg_waits_mean": {what: round(count / samples, 2)
                          for what, count in waits.waits.most_common()},
        "pg_waits_max": dict(waits.waiting_max.most_common()),
    }


def _fault_figures(fault: dict[str, Any]) -> dict[str, float | None]:
    def since(key: str, start: str = "pushed") -> float | None:
        return round(fault[key] - fault[start], 3) if key in fault and start in fault else None

    return {"push_answer_s": since("answered"), "to_incident_s": since("opened"),
            "to_first_action_s": since("first_action"), "to_held_s": since("held"),
            "incident_to_first_action_s": since("first_action", "opened"),
            "incident_to_held_s": since("held", "opened")}


# --- where a diagnosis run's time goes ---------------------------------------------------


def _profile_top(profiler: Any, calls: int, limit: int = 18) -> list[dict[str, Any]]:
    """The project's functions by cumulative time (per call of what was profiled)."""
    import pstats

    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, ncalls, _, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if path.startswith(f"{ROOT}/") and "/.venv/" not in path and "/tests/" not in path:
            rows.append({"function": f"{Path(path).relative_to(ROOT)}:{line} {name}",
                         "calls_each": round(ncalls / calls, 1),
                         "ms_each": round(cumtime * 1000 / calls, 2)})
    return sorted(rows, key=lambda r: -r["ms_each"])[:limit]


def profile_opening(nodes: list[str]) -> dict[str, Any]:
    """``incident_record`` for a fresh one-node diagnosis on each of ``nodes`` (a GPU memory
    fault: a new fingerprint, so each opens an incident and its remediation, as the storm's
    did), after the storm's incidents: cProfile and the SQL statements, per incident."""
    import cProfile

    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from collectors.knowledge import RootCause
    from collectors.models import Cluster
    from incidents.diagnosis import Diagnosis
    from incidents.lifecycle import incident_record

    cluster = Cluster.objects.get()
    diagnoses = [Diagnosis(RootCause.GPU_MEMORY, (node,), 0.95, "", "storm bench profile",
                           timezone.now()) for node in nodes]
    profiler = cProfile.Profile()
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        t = time.perf_counter()
        profiler.enable()
        for diagnosis in diagnoses:
            incident_record(cluster.pk, diagnosis)
        profiler.disable()
        wall = time.perf_counter() - t
        transaction.set_rollback(True)
    return {"incidents": len(nodes), "ms_each": round(wall * 1000 / len(nodes), 2),
            "queries_each": round(len(queries) / len(nodes), 1),
            "top": _profile_top(profiler, len(nodes))}


def profile_rerun(since: float, limit: int) -> dict[str, Any]:
    """A diagnosis run over the storm's window (what each run after the first redoes):
    reading the window and diagnosing it, then recording up to ``limit`` of the diagnoses
    whose incident is open already (each finds it and adds nothing; opening is
    ``profile_opening``'s)."""
    import cProfile

    from django.conf import settings
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from collectors.models import Cluster
    from incidents import selectors
    from incidents.diagnosis import diagnose
    from incidents.lifecycle import incident_record
    from incidents.models import Incident

    cluster = Cluster.objects.get()
    window = timedelta(minutes=settings.FLEETWATCH_DIAGNOSIS_WINDOW_MINUTES)
    start = datetime.fromtimestamp(since, UTC) - window
    profiler = cProfile.Profile()
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        t0 = time.perf_counter()
        observations = selectors.observations_between(cluster, start, timezone.now())
        t1 = time.perf_counter()
        diagnoses = diagnose(observations, selectors.topology(cluster),
                             selectors.jobs_info(cluster))
        t2 = time.perf_counter()
        read_queries = len(queries)
        known = set(Incident.objects.values_list("fingerprint", flat=True))
        redo = [d for d in diagnoses if d.fingerprint in known][:limit]
        profiler.enable()
        for diagnosis in redo:
            incident_record(cluster.pk, diagnosis)
        profiler.disable()
        t3 = time.perf_counter()
        transaction.set_rollback(True)
    n = max(1, len(redo))
    return {"observations": len(observations), "diagnoses": len(diagnoses),
            "with_incident": len(known & {d.fingerprint for d in diagnoses}), "recorded": len(redo),
            "read_ms": round((t1 - t0) * 1000), "diagnose_ms": round((t2 - t1) * 1000),
            "record_ms": round((t3 - t2) * 1000), "record_ms_each": round((t3 - t2) * 1000 / n, 2),
            "record_queries_each": round((len(queries) - read_queries) / n, 1),
            "top": _profile_top(profiler, n, 10)}


# --- intake ---------------------------------------------------------------------------------


def intake_push(poster: Poster, key: str, batches: int, size: int, clients: int,
                latencies: list[float], errors: list[str]) -> None:
    """Push ``batches`` batches of kernel chatter from ``clients`` threads."""
    import http.client

    lock = threading.Lock()
    todo = iter(range(batches))

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None or errors:
                return
            body = json.dumps({"signals": records("kernel", i, size)}).encode()
            t = time.monotonic()
            try:
                code, text = poster.post("/api/v1/signals/", body, key)
            except (OSError, http.client.HTTPException) as exc:
                errors.append(str(exc))
                return
            if code != 201:
                errors.append(f"{code} {text[:200]}")
                return
            with lock:
                latencies.append(time.monotonic() - t)

    poster.threads(client, clients)


def run_intake(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import redis
    from django.core.management import call_command
    from django.db import connection

    from collectors.models import Node, Signal
    from collectors.roles import OPERATOR, user_with_role
    from collectors.sim.fleet import SimFleet
    from incidents.models import AuditEntry
    from incidents.tokens import token_create
    from tests.bench.burst import FLOOD_NODES

    call_command("migrate", verbosity=0)
    queue = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    queue.flushdb()
    sim_state = tmp / "sim-fleet.json"
    SimFleet(sim_state, 20.0).seed()
    user, _ = user_with_role("intake-loader", OPERATOR)
    key = token_create(user, "intake-loader", ("read", "ingest"), ttl_days=1)[1]
    stack = Stack(tmp, sim_state, args.web_workers, args.worker_concurrency)
    waits = WaitSampler()
    latencies: list[float] = []
    errors: list[str] = []
    try:
        _wait(lambda: _get(f"{stack.base}/healthz") == 200, 120, "the web server")
        _wait(lambda: Node.objects.filter(name__in=FLOOD_NODES).count() == len(FLOOD_NODES),
              120, "the first collection of the simulated fleet")
        # Warm the worker(s) (imports, first connections) before the clock starts.
        intake_push(Poster(stack.base), key, 2 * args.web_workers, args.batch_size,
                    args.web_workers, [], errors)
        before = Signal.objects.filter(node_name__in=FLOOD_NODES, source="kernel").count()
        audit_before = AuditEntry.objects.order_by("-id").values_list("id", flat=True).first()
        waits.start()
        poster = Poster(stack.base)
        t = time.monotonic()
        intake_push(poster, key, args.batches, args.batch_size, args.clients, latencies,
                    errors)
        wall = time.monotonic() - t
        waits.stop.set()
        waits.join(5)
        stored = Signal.objects.filter(node_name__in=FLOOD_NODES,
                                       source="kernel").count() - before
        api_calls = AuditEntry.objects.filter(id__gt=audit_before or 0,
                                              verb="api.call").count()
    finally:
        waits.stop.set()
        stack.stop()
        connection.close()
    if errors:
        raise SystemExit(f"storm bench (intake): pushes failed: {errors[:3]}")
    sent = args.batches * args.batch_size
    samples = max(1, waits.samples)
    return {
        "mode": "intake", "batches": args.batches, "batch_size": args.batch_size,
        "clients": args.clients, "web_workers": args.web_workers, "sent": sent,
        "stored": stored, "lost": sent - stored, "wall_s": round(wall, 2),
        "signals_per_s": round(sent / wall), "signals_per_s_per_worker":
        round(sent / wall / args.web_workers), "pushes_per_s": round(args.batches / wall, 1),
        "push_latency_s": summary(latencies), "api_call_audit_entries": api_calls,
        "load_cpu_s": round(poster.cpu_s, 1),
        # Mean number of this database's sessions in each state per 50 ms sample.
        "pg_waits_mean": {what: round(count / samples, 2)
                          for what, count in waits.waits.most_common()},
        "pg_waits_max": dict(waits.waiting_max.most_common()),
    }


# --- reports --------------------------------------------------------------------------------


def _row(label: str, s: dict[str, Any]) -> str:
    if not s.get("n"):
        return f"| {label} | none |"
    return (f"| {label} | {s['median']:.3f} | {s['p95']:.3f} | {s['min']:.3f} - {s['max']:.3f} "
            f"| {s['n']:,} |")


def storm_report(r: dict[str, Any], other: dict[str, Any] | None) -> str:
    f = r["fault"]
    lines = [
        f"# Storm benchmark: {r['nodes']:,} nodes", "",
        f"{r['nodes']:,} node agents each pushed one XID 79 line (own request, "
        f"{'its own agent token' if r['tokens'] == 'agent' else 'one shared ingest token'}) "
        f"through `POST /api/v1/signals/`, spread over {r['spread_s']:g} s from "
        f"{r['clients']} client threads (all pushed after {r['storm_pushed_s']:.1f} s); gunicorn "
        f"with {r['web_workers']} workers, "
        + ("a Celery worker per queue as deployed (collect with beat, default, diagnose, "
           f"remediate of concurrency {r['worker_concurrency']})" if r.get("split_workers")
           else f"one Celery worker of concurrency {r['worker_concurrency']} with beat")
        + ", PostgreSQL, Redis, the simulated fleet seeded "
        f"with {r['nodes'] + EXTRA_NODES:,} nodes. {_s(f.get('after_start_s'))} in, an "
        f"unrelated XID 48 on {f['node']}, not in the storm, from its own agent.", "",
        "Seconds; median, p95, min - max, count.", "",
        "| figure | median | p95 | min - max | n |", "|---|---:|---:|---:|---:|",
        _row("push sent -> answered (signal committed)", r["push_answer_s"]),
        _row("push due (storm schedule) -> answered", r["due_to_answer_s"]),
        _row("push sent -> server's ingested_at", r["send_to_ingested_s"]),
        _row("push sent -> its node's incident (opened, or the storm's joined)",
             r["signal_to_incident_s"]),
        _row("push due -> its node's incident", r["signal_due_to_incident_s"]),
        "", "| figure | value |", "|---|---:|",
        f"| signals stored / pushed | {r['signals_stored']:,} / {r['nodes']:,} "
        f"({r['pushes_failed']} pushes failed) |",
        f"| pushes answered more than 2 s after sent / after due | {r['pushes_over_2s']:,} / "
        f"{r['due_over_2s']:,} |",
        f"| incidents opened within 10 s of their signal | "
        f"{r['incidents_within_10s_of_signal']:,} of {r['nodes']:,} |",
        f"| storm incidents 10 s after the storm began / at the end | "
        f"{r['incidents_by_10s']:,} / {r['incidents_at_end']:,} |",
        "| every storm node had its incident after | "
        + (f"{r['all_incidents_after_s']:.1f} s |" if r["all_incidents_after_s"] is not None
           else f"**did not finish within {r['waited_s']:.0f} s** |"),
        f"| diagnosis runs during the storm / longest run | {r['diagnosis_runs']:,} / "
        f"{r['diagnosis_run_ms_max']:,} ms |",
        f"| diagnose queue depth, max | {r['diagnose_queue_max']} |",
        f"| incidents of their own / storm incidents (nodes in them) | "
        f"{r['grouped']['alone']:,} / {r['grouped']['storm_incidents']:,} "
        f"({r['grouped']['nodes_in_storm_incidents']:,}) |",
        f"| CPU spent from the storm to caught up: web / worker (s) | {r['cpu_s']['web']:.1f} / "
        f"{r['cpu_s']['worker']:.1f} "
        f"({1000 * (r['cpu_s']['web'] + r['cpu_s']['worker']) / r['nodes']:.1f} ms a signal)"
        + "".join(f"; {name.removeprefix('worker-')} {spent:.1f}"
                  for name, spent in r['cpu_s'].items() if name.startswith("worker-"))
        + " |",
        f"| CPU spent besides: PostgreSQL / the pushing clients (this process) (s) | "
        f"{r['cpu_s'].get('postgres', 0):.1f} / {r['cpu_s'].get('clients', 0):.1f} |",
        f"| diagnosis runs killed at the soft time limit (not counted above) | "
        f"{r.get('diagnosis_time_limits', '-')} |",
        "| diagnosis caught up after | "
        + (f"{r['diagnosis_caught_up_after_s']:.1f} s |"
           if r["diagnosis_caught_up_after_s"] is not None else "not within the wait |"),
        f"| storm remediations by status | "
        f"{', '.join(f'{k} {v}' for k, v in sorted(r['remediations'].items())) or 'none'} |",
        f"| held by the storm brake / by another rail | {r['storm_brake_held']:,} / "
        f"{r['other_rail_held']:,} |",
        "", "## The unrelated fault", "", "| figure | value |", "|---|---:|",
        f"| pushed, after the storm began | {_s(f.get('after_start_s'))} |",
        f"| push answered | {_s(f.get('push_answer_s'))} |",
        f"| pushed -> incident opened | {_s(f.get('to_incident_s'))} |",
        f"| pushed -> first action (audit entry with a call) | "
        f"{_s(f.get('to_first_action_s'))} |",
        f"| pushed -> held for a person | {_s(f.get('to_held_s'))} |",
        f"| remediation | {json.dumps(f.get('remediation'))} |",
    ]
    if f.get("held_reason"):
        lines += ["", f"Held: {f['held_reason']}"]
    lines += ["", "What this database's active sessions were doing during the storm "
              "(pg_stat_activity every 50 ms; mean sessions per sample, max):", "",
              "| state | mean | max |", "|---|---:|---:|",
              *[f"| {what} | {mean} | {r['pg_waits_max'].get(what, 0)} |"
                for what, mean in r["pg_waits_mean"].items()]]
    for name, title in [("opening", "Opening one more incident after the storm's"),
                        ("rerun", "A diagnosis run over the storm's window, every incident "
                                  "open")]:
        p = r.get("profiles", {}).get(name)
        if not p:
            continue
        lines += ["", f"## {title} (in-process, cProfile, rolled back)", ""]
        if name == "opening":
            lines.append(f"{p['incidents']} incidents: {p['ms_each']} ms and "
                         f"{p['queries_each']} SQL statements each.")
        else:
            lines.append(f"{p['observations']:,} observations read in {p['read_ms']:,} ms, "
                         f"diagnosed in {p['diagnose_ms']:,} ms: {p['diagnoses']:,} diagnoses, "
                         f"{p['with_incident']:,} with an incident open already; "
                         f"{p['recorded']:,} of those recorded again in {p['record_ms']:,} ms "
                         f"({p['record_ms_each']} ms and {p['record_queries_each']} SQL "
                         "statements each), as every run redoes for every one.")
        lines += ["", "| function | calls each | ms each (cumulative) |", "|---|---:|---:|",
                  *[f"| `{t['function']}` | {t['calls_each']} | {t['ms_each']} |"
                    for t in p["top"]]]
    if other is not None:
        lines += ["", f"## Against {other['nodes']:,} nodes", "",
                  "| figure | this run | that run |", "|---|---:|---:|"]
        for label, key in [("signal -> incident, median", "median"),
                           ("signal -> incident, p95", "p95"),
                           ("signal -> incident, max", "max")]:
            lines.append(f"| {label} | {_s(r['signal_to_incident_s'][key])} | "
                         f"{_s(other['signal_to_incident_s'][key])} |")
        for label, key in [("push answered, p95", "p95")]:
            lines.append(f"| {label} | {_s(r['push_answer_s'][key])} | "
                         f"{_s(other['push_answer_s'][key])} |")
        def per_signal(run: dict[str, Any]) -> str:
            cpu = run.get("cpu_s")
            return "-" if not cpu else f"{1000 * sum(cpu.values()) / run['nodes']:.1f}"

        lines.append(f"| CPU a signal, web + worker (ms) | {per_signal(r)} | {per_signal(other)} |")
        for label, key in [("all incidents after", "all_incidents_after_s"),
                           ("diagnosis runs", "diagnosis_runs"),
                           ("longest diagnosis run (ms)", "diagnosis_run_ms_max")]:
            lines.append(f"| {label} | {r[key]} | {other[key]} |")
    return "\n".join(lines) + "\n"


def intake_report(r: dict[str, Any]) -> str:
    lines = [
        f"# Intake benchmark: {r['web_workers']} web worker(s)", "",
        f"{r['batches']:,} batches of {r['batch_size']} kernel chatter lines (no fault) from "
        f"{r['clients']} clients through `POST /api/v1/signals/` (one ingest token), gunicorn "
        f"with {r['web_workers']} worker(s), a Celery worker with beat, PostgreSQL, Redis.", "",
        "| figure | value |", "|---|---:|",
        f"| signals/s | **{r['signals_per_s']:,}** ({r['signals_per_s_per_worker']:,} per web "
        f"worker; {r['pushes_per_s']} pushes/s) |",
        f"| sent / stored (lost) | {r['sent']:,} / {r['stored']:,} ({r['lost']:,}) |",
        f"| wall | {r['wall_s']:.1f} s |",
        f"| CPU the pushing clients spent (this process, on the same cores) | "
        f"{r.get('load_cpu_s', '-')} s |",
        f"| push latency median / p95 / min - max | {r['push_latency_s']['median']:.3f} / "
        f"{r['push_latency_s']['p95']:.3f} / {r['push_latency_s']['min']:.3f} - "
        f"{r['push_latency_s']['max']:.3f} s |",
        f"| api.call audit entries written | {r['api_call_audit_entries']:,} (one per push, "
        "each under the audit trail's global advisory lock) |",
        "", "What this database's active sessions were doing (pg_stat_activity every 50 ms; "
        "mean sessions per sample, max):", "",
        "| state | mean | max |", "|---|---:|---:|",
        *[f"| {what} | {mean} | {r['pg_waits_max'].get(what, 0)} |"
          for what, mean in r["pg_waits_mean"].items()],
    ]
    return "\n".join(lines) + "\n"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=500, help="storm: nodes that fault")
    parser.add_argument("--spread", type=float, default=10.0,
                        help="storm: seconds over which the pushes are spread")
    parser.add_argument("--fault-at", type=float, default=5.0,
                        help="storm: seconds in, the unrelated fault")
    parser.add_argument("--tokens", choices=["agent", "ingest"], default="agent",
                        help="storm: an agent token per node, or one ingest token for all")
    parser.add_argument("--profile", type=int, default=50, metavar="K",
                        help="storm: profile opening K more incidents and one diagnosis run "
                        "over the window afterwards (0: none)")
    parser.add_argument("--intake", action="store_true", help="the intake rate instead")
    parser.add_argument("--batches", type=int, default=300, help="intake: batches")
    parser.add_argument("--batch-size", type=int, default=100, help="intake: records a batch")
    parser.add_argument("--clients", type=int, default=None,
                        help="pushing at once (storm 64, intake 8)")
    parser.add_argument("--web-workers", type=int, default=None,
                        help="gunicorn workers (storm 2, make run's and the Kubernetes base's "
                        "default; the production overlay runs 4 a web pod; intake 1)")
    parser.add_argument("--worker-concurrency", type=int, default=3)
    parser.add_argument("--split-workers", action="store_true",
                        help="storm: a Celery worker per queue, as deploy/kubernetes runs them "
                        "(collect with the beat, default, diagnose, remediate), instead of one")
    parser.add_argument("--max-wait", type=float, default=300.0,
                        help="storm: stop waiting for incidents this long after it began")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    args.clients = args.clients or (8 if args.intake else 64)
    args.web_workers = args.web_workers or (1 if args.intake else 2)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.intake:
        r = on_own_database("intake", run_intake, args)
        report = intake_report(r)
        name = f"bench-intake-{args.web_workers}w" + (
            f"-batch{args.batch_size}" if args.batch_size != 100 else "")
    else:
        r = on_own_database("storm", run_storm, args)
        other_n = 5000 if args.nodes != 5000 else 500
        other_path = args.out / f"bench-storm-{other_n}.json"
        other = json.loads(other_path.read_text()) if other_path.exists() else None
        report = storm_report(r, other)
        name = (f"bench-storm-{args.nodes}" + ("-split" if args.split_workers else "")
                + (f"-w{args.web_workers}" if args.web_workers != 2 else ""))
    print(report)
    (args.out / f"{name}.md").write_text(report)
    (args.out / f"{name}.json").write_text(json.dumps(r, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
