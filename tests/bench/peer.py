"""Benchmark: FleetWatch side by side with the peer (Prometheus + Alertmanager) on one XID.

Run by ``make bench`` under tests/harness/with-services.sh. One simulated dcgm-exporter
(``collectors.sim.exporter``, the simulated fleet's GPUs in dcgm-exporter's format) and one
real Slurm cluster (tests/harness/slurm_cluster.py: slurmctld and a slurmd per node) are shared
by every profile. Each profile then gets, one after another:

- the peer: Debian's ``prometheus`` scraping the exporter at the profile's interval, with an
  alert rule on the XID field (``DCGM_FI_DEV_XID_ERRORS > 0``), and Debian's
  ``prometheus-alertmanager`` grouping per GPU and routing to a webhook receiver run here;
- FleetWatch at its default settings (``FLEETWATCH_FLEET=real``, a Celery worker with beat on
  Redis, PostgreSQL in a database of its own) reading that same Prometheus and that Slurm
  (and the Kubernetes test server, tests/harness/k8s_server.py, as a real fleet has one).

Profiles of the peer (what a team gets by default, what it usually sets, the tightest usual):

- defaults: scrape and evaluation every 1m, no ``for``, Alertmanager's group_wait of 30s;
- usual: scrape and evaluation every 15s, ``for: 1m``, group_wait 30s;
- tight: scrape and evaluation every 5s, no ``for``, group_wait 0s.

Phase luck is sampled, not fixed: every run starts FleetWatch's worker afresh at a random
moment (its collections tick from when its beat started), reloads Prometheus with a rule
group of a new name (Prometheus evaluates a group at an offset it derives from the group's
name), and sleeps a random share of the scrape interval before it injects. Each run then
injects XID 79 on one GPU of a node no earlier run touched (a fresh fault, a fresh
Alertmanager group and a fresh FleetWatch incident), and measures from the moment the
exporter's state holds it:

- scraped: the first sample of it in Prometheus (its timestamp), which both sides wait for;
- peer webhook: the webhook receiver got the firing alert for that GPU;
- FleetWatch incident: the incident's ``opened_at``;
- FleetWatch first action: the first outside call of its remediation in the audit trail
  (the on-call notification: a JSON webhook to the same receiver, whose arrival is timed too);
- FleetWatch drain: the ``slurm.drain`` call (scontrol, on the real slurmctld) done.

``--remote-write`` adds FleetWatch's web (gunicorn, production config) and a ``remote_write``
section to Prometheus pointing at ``POST /api/v1/prometheus/write`` with an ingest token, so
FleetWatch gets the fault fields right after each scrape instead of on its next query.

Bench-only policy limits, none of which is on the timing path of a single fault: the fleet
budget and the storm brake are raised (a run per node, many incidents within minutes, is the
experiment here, not a storm), and replacements wait for approval (there are no spares).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.bench.burst import _free_port, _get, _wait, on_own_database

ROOT = Path(__file__).resolve().parent.parent.parent
XID = 79  # GPU fallen off the bus: a node FleetWatch takes out of service at once
DEFAULT_RUNS = {"tight": 10, "usual": 5, "defaults": 3}
ALERTMANAGER_ENV = "FLEETWATCH_ALERTMANAGER_BIN"


@dataclass(frozen=True)
class Profile:
    name: str
    scrape_s: int  # Prometheus scrape and rule evaluation interval
    for_s: int  # the alert rule's ``for``
    group_wait_s: int  # Alertmanager's route group_wait

    @property
    def worst_peer_s(self) -> float:
        """The peer's slowest expected webhook: a scrape, an evaluation, ``for`` (rounded up to
        an evaluation) and group_wait."""
        return 2 * self.scrape_s + self.for_s + self.group_wait_s + self.scrape_s


PROFILES = {
    "defaults": Profile("defaults", 60, 0, 30),
    "usual": Profile("usual", 15, 60, 30),
    "tight": Profile("tight", 5, 0, 0),
}


# --- the peer's webhook receiver and Alertmanager ---------------------------------------------


class WebhookReceiver:
    """Both sides' webhook target: the first arrival of Alertmanager's firing alert per
    (node, GPU) at ``url``, and of FleetWatch's on-call notification per node at
    ``fleetwatch_url``."""

    def __init__(self) -> None:
        self.arrivals: dict[tuple[str, str], float] = {}
        self.fleetwatch: dict[str, float] = {}
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.time()  # before reading the body: the webhook's arrival
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.end_headers()
                with contextlib.suppress(ValueError):
                    if self.path.startswith("/fleetwatch"):
                        receiver.record_fleetwatch(json.loads(body), arrived)
                    else:
                        receiver.record(json.loads(body), arrived)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alert"
        self.fleetwatch_url = f"http://127.0.0.1:{self.server.server_address[1]}/fleetwatch"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def record(self, payload: Mapping[str, Any], arrived: float) -> None:
        with self._lock:
            self.posts += 1
            for alert in payload.get("alerts", []):
                labels = alert.get("labels", {})
                if alert.get("status") == "firing":
                    key = (str(labels.get("Hostname", "")), str(labels.get("gpu", "")))
                    self.arrivals.setdefault(key, arrived)

    def record_fleetwatch(self, payload: Mapping[str, Any], arrived: float) -> None:
        with self._lock:
            for node in payload.get("nodes") or []:
                self.fleetwatch.setdefault(str(node), arrived)

    def fleetwatch_arrival(self, node: str) -> float | None:
        with self._lock:
            return self.fleetwatch.get(node)

    def arrival(self, node: str, gpu: int) -> float | None:
        with self._lock:
            return self.arrivals.get((node, str(gpu)))

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def alertmanager_binary() -> str:
    for candidate in (os.environ.get(ALERTMANAGER_ENV), "/usr/bin/prometheus-alertmanager"):
        if candidate and Path(candidate).exists():
            return candidate
    sys.exit("peer bench: Alertmanager was not found (looked at $FLEETWATCH_ALERTMANAGER_BIN "
             "and /usr/bin/prometheus-alertmanager): apt-get install prometheus-alertmanager")


@contextlib.contextmanager
def alertmanager(root: Path, profile: Profile, webhook: str) -> Iterator[str]:
    """Debian's Alertmanager with one route: every alert grouped per GPU (Hostname, gpu) and
    sent to ``webhook`` after the profile's group_wait. Yields its host:port."""
    from tests.harness.processes import stop_process_group

    root.mkdir(parents=True, exist_ok=True)
    config = {
        "route": {"receiver": "bench", "group_by": ["Hostname", "gpu"],
                  "group_wait": f"{profile.group_wait_s}s",
                  # Alertmanager's defaults: they only matter for a group's later alerts.
                  "group_interval": "5m", "repeat_interval": "4h"},
        "receivers": [{"name": "bench",
                       "webhook_configs": [{"url": webhook, "send_resolved": False}]}],
    }
    (root / "alertmanager.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
    port = _free_port()
    address = f"127.0.0.1:{port}"
    log = root / "alertmanager.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [alertmanager_binary(), f"--config.file={root / 'alertmanager.yml'}",
             f"--storage.path={root / 'data'}", f"--web.listen-address={address}",
             "--cluster.listen-address=",  # no gossip: one instance, no peers to wait for
             "--log.level=warn"],
            cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: proc.poll() is not None or _get(f"http://{address}/-/ready") == 200, 30,
              "Alertmanager")
        if proc.poll() is not None:
            sys.exit(f"peer bench: Alertmanager exited:\n{log.read_text()[-2000:]}")
        yield address
    finally:
        stop_process_group(proc)


def rule_file(root: Path, profile: Profile, group: str = "gpu") -> Path:
    """The peer's alert: any XID on a GPU, one alert per GPU (its labels carry Hostname and
    gpu from the exporter)."""
    path = root / "rules.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"groups": [{"name": group, "rules": [{
        "alert": "GpuXidError", "expr": "DCGM_FI_DEV_XID_ERRORS > 0",
        "for": f"{profile.for_s}s", "labels": {"severity": "critical"},
        "annotations": {"summary": "XID {{ $value }} on {{ $labels.Hostname }} GPU "
                                   "{{ $labels.gpu }}"}}]}]}, indent=1))
    return path


# --- FleetWatch -------------------------------------------------------------------------------


def fleetwatch_env(tmp: Path, cluster: str, prometheus: str, slurm: Any,
                   kubeconfig: Path, webhook: str) -> dict[str, str]:
    """What an operator sets for FleetWatch on this Slurm and Prometheus: nothing about
    timing, so every interval is FleetWatch's default."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLEETWATCH_SIM", "FLEETWATCH_COLLECT_INTERVAL"))}
    env.update({
        "FLEETWATCH_DATA_DIR": str(tmp / "data"),
        "FLEETWATCH_FLEET": "real",
        "FLEETWATCH_CLUSTER": cluster,
        "FLEETWATCH_KUBECONFIG": str(kubeconfig),
        "FLEETWATCH_SLURM_CONF": slurm.env["SLURM_CONF"],
        "FLEETWATCH_SLURM_BIN_DIR": slurm.bin_dir or "",
        "FLEETWATCH_PROMETHEUS_URL": prometheus,
        "FLEETWATCH_PROVIDER": "none",
        "FLEETWATCH_POLICY_MODE": "auto",
        # The on-call channel, as the peer's: a JSON webhook to the bench's receiver, so
        # FleetWatch's first action is a real outside call whose arrival is timed too.
        "FLEETWATCH_NOTIFY_WEBHOOK_URL": webhook,
        # Bench-only policy limits (see the module docstring): not on the timing path.
        "FLEETWATCH_STEP_MODES": "replace=approve,reboot=approve,reset_gpu=approve",
        "FLEETWATCH_BUDGET_MAX_NODES": "1000", "FLEETWATCH_BUDGET_MAX_PERCENT": "100",
        "FLEETWATCH_STORM_INCIDENTS": "1000",
        "LOG_LEVEL": "WARNING",
    })
    return env


def start(cmd: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=dict(env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def start_worker(env: Mapping[str, str], root: Path, log: Path) -> subprocess.Popen[bytes]:
    """A Celery worker with beat, as deployed (every queue, default concurrency)."""
    return start([sys.executable, "-m", "celery", "-A", "fleetwatch", "worker", "-B",
                  "-Q", "collect,diagnose,remediate,default", "--loglevel", "WARNING",
                  "-s", str(root / "beat-schedule")], env, log)


def wait_collected(cluster: str, fleet_size: int, since: float, profile: Profile) -> None:
    """Until a worker started at ``since`` has collected: every node from Slurm, every GPU
    from Prometheus (the defaults profile's first scrape may take its whole minute), and a
    telemetry run of its own done."""
    from datetime import UTC, datetime

    from collectors.models import CollectorRun, Gpu

    after = datetime.fromtimestamp(since, tz=UTC)
    _wait(lambda: Gpu.objects.filter(node__cluster__name=cluster).count() >= 8 * fleet_size
          and CollectorRun.objects.filter(cluster__name=cluster, source="telemetry", ok=True,
                                          started_at__gt=after).exists(),
          max(120, 3 * profile.scrape_s), f"FleetWatch's collection ({cluster})")


def ingest_token(name: str) -> str:
    from collectors.roles import OPERATOR, user_with_role
    from incidents.tokens import token_create

    user, _ = user_with_role("peer-bench", OPERATOR)
    return token_create(user, name, ("ingest",), ttl_days=1)[1]


# --- one profile ------------------------------------------------------------------------------


def first_scrape(prometheus: str, node: str, gpu: int, after: float) -> float | None:
    """When Prometheus first scraped the XID (the sample's timestamp), from its raw samples:
    what both sides wait for before anything else."""
    selector = f'DCGM_FI_DEV_XID_ERRORS{{Hostname="{node}",gpu="{gpu}"}}[15m]'
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": selector})
    with urllib.request.urlopen(url, timeout=10) as answer:
        result = json.load(answer)["data"]["result"]
    stamps = [float(t) for series in result for t, v in series["values"]
              if float(v) > 0 and float(t) >= after - 1]
    return min(stamps) if stamps else None


def one_run(run_no: int, node: str, profile: Profile, cluster: str, fleet: Any,
            webhook: WebhookReceiver, slurm: Any, prometheus: str) -> dict[str, Any]:
    from collectors.models import Signal
    from collectors.sim import fleet as sim
    from incidents.models import AuditEntry, Incident

    gpu = random.randrange(8)
    # A random phase against the scrapes (and FleetWatch's own queries): sampled, not fixed.
    time.sleep(random.uniform(0, profile.scrape_s))
    with fleet.transaction() as state:
        sim.inject_xid(state, node, gpu, XID, time.time())
    injected = time.time()  # the exporter's next page shows it from here on

    def done() -> dict[str, Any] | None:
        incident = Incident.objects.filter(cluster__name=cluster,
                                           nodes__contains=[node]).first()
        calls = (AuditEntry.objects.filter(remediation__incident=incident).exclude(call="")
                 .order_by("at", "id") if incident is not None else AuditEntry.objects.none())
        first = calls.first()
        drain = calls.filter(verb="slurm.drain", ok=True).first()
        peer = webhook.arrival(node, gpu)
        notified = webhook.fleetwatch_arrival(node)
        if None in (incident, first, drain, peer, notified):
            return None
        return {"incident": incident, "first": first, "drain": drain, "peer": peer,
                "notified": notified}

    got = _wait_or_none(done, profile.worst_peer_s + 90)
    if got is None:
        # Say what was and was not seen, and go on: a missing measure is a result too.
        incident = Incident.objects.filter(cluster__name=cluster,
                                           nodes__contains=[node]).first()
        print(f"  run {run_no + 1}: incomplete after {profile.worst_peer_s + 90:.0f} s "
              f"(incident {incident and incident.pk}, peer "
              f"{webhook.arrival(node, gpu)})", flush=True)
        return {"node": node, "gpu": gpu, "complete": False}
    state_now = slurm.node_states().get(node, "")
    scraped = first_scrape(prometheus, node, gpu, injected)
    first_action = got["first"].at.timestamp() - injected
    peer_s = got["peer"] - injected
    # Where FleetWatch's time goes: the XID's signal committed by the collection (after the
    # doorbell or a poll), then diagnosis (incident), then remediation (first action).
    evidence = Signal.objects.filter(evidence__incident=got["incident"]).order_by(
        "ingested_at").values_list("ingested_at", flat=True).first()
    return {
        "node": node, "gpu": gpu, "complete": True,
        "scraped": round(scraped - injected, 3) if scraped is not None else None,
        "stored": (round(evidence.timestamp() - injected, 3) if evidence is not None
                   else None),
        "peer_webhook": round(peer_s, 3),
        "incident": round(got["incident"].opened_at.timestamp() - injected, 3),
        "first_action": round(first_action, 3),
        "first_action_verb": got["first"].verb,
        "fleetwatch_webhook": round(got["notified"] - injected, 3),
        "drain": round(got["drain"].at.timestamp() - injected, 3),
        "drained_in_slurm": "DRAIN" in state_now,
        "ratio": round(peer_s / first_action, 2) if first_action > 0 else None,
        "first_action_before_peer": first_action < peer_s,
    }


def repair(fleet: Any, slurm: Any, nodes: list[str]) -> None:
    """The XIDs cleared from the exporter (the GPUs as a repair leaves them) and the nodes
    resumed in Slurm."""
    with fleet.transaction() as state:
        for name in nodes:
            for g in state["nodes"][name]["gpus"]:
                g.update(last_xid=0, xid_at=None, fault_at=None, fallen_off=False)
    for name in nodes:
        slurm.run("scontrol", "update", f"nodename={name}", "state=resume")


def _wait_or_none(predicate: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return None


def run_profile(profile: Profile, nodes: list[str], fleet_size: int, tmp: Path, fleet: Any,
                exporter: str, slurm: Any, kubeconfig: Path,
                remote_write: bool) -> dict[str, Any]:
    """``nodes``: one per run, each to get its XID."""
    from django.conf import settings

    from tests.harness.processes import stop_process_group
    from tests.harness.prometheus import PrometheusServer, ScrapeTarget

    root = tmp / profile.name
    cluster = f"peer-{profile.name}"
    procs: list[subprocess.Popen[bytes]] = []
    extra: dict[str, Any] = {}
    base = ""
    python = sys.executable
    # FleetWatch's own default (the bench sets none): its collection phase is sampled over it.
    collect_interval = float(settings.FLEETWATCH_COLLECT_INTERVAL)
    logs = root / "logs"
    logs.mkdir(parents=True)
    if remote_write:
        # FleetWatch's web takes the remote writes (started below, once Prometheus's address,
        # which its settings need, is known).
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        # The remote_write a site would deploy (its queue settings and the fault fields it
        # keeps), pointed at this FleetWatch with an ingest token.
        import yaml

        example = yaml.safe_load((ROOT / "deploy/prometheus/remote-write-fleetwatch.yaml")
                                 .read_text())["remote_write"][0]
        example["url"] = f"{base}/api/v1/prometheus/write/?cluster={cluster}"
        example["authorization"] = {"type": "Token",
                                    "credentials": ingest_token(f"peer-{profile.name}")}
        extra["remote_write"] = [example]
    with WebhookReceiver() as webhook, alertmanager(root / "alertmanager", profile,
                                                     webhook.url) as am:
        env = fleetwatch_env(root, cluster, "", slurm, kubeconfig, webhook.fleetwatch_url)
        extra.update({
            "global": {"evaluation_interval": f"{profile.scrape_s}s",
                       # Prometheus's default, which the harness would set to the interval.
                       "scrape_timeout": f"{min(profile.scrape_s, 10)}s"},
            "rule_files": [str(rule_file(root / "prometheus", profile))],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am]}]}]},
        })
        prometheus = PrometheusServer(root / "prometheus", [ScrapeTarget(exporter, job="dcgm")],
                                      f"{profile.scrape_s}s", extra=extra)
        env["FLEETWATCH_PROMETHEUS_URL"] = prometheus.url  # its port is chosen already
        try:
            if remote_write:
                # gunicorn with the production config, ready before Prometheus writes to it.
                gunicorn = Path(python).parent / "gunicorn"
                web = [str(gunicorn)] if gunicorn.exists() else [python, "-m", "gunicorn"]
                procs.append(start([*web, "-c", str(ROOT / "deploy" / "gunicorn.conf.py"),
                                    "fleetwatch.wsgi", "--bind", f"127.0.0.1:{port}",
                                    "--workers", "2"], env, logs / "web.log"))
                _wait(lambda: _get(f"{base}/healthz") == 200, 90, "FleetWatch's web server")
            prometheus.start()
            results = []
            runs = len(nodes)
            worker: subprocess.Popen[bytes] | None = None
            for run_no, node in enumerate(nodes):
                # Every clock here ticks at a fixed period: Prometheus's scrapes and rule
                # evaluations at offsets it derives from hashes of the target and of the rule
                # group, FleetWatch's collections from when its beat started. Left alone,
                # each profile would measure one phase of each, whatever the injection's
                # moment. So each run gets a rule group of its own name (a new evaluation
                # phase) and a FleetWatch worker started at a random moment (a new
                # collection phase), as a team's own deployment would have.
                rule_file(root / "prometheus", profile, f"gpu-run-{run_no + 1}")
                prometheus.reload()
                if worker is not None:
                    stop_process_group(worker)
                    procs.remove(worker)
                time.sleep(random.uniform(0, collect_interval))
                worker = start_worker(env, root, logs / f"worker-{run_no + 1}.log")
                procs.append(worker)
                wait_collected(cluster, fleet_size, time.time(), profile)
                results.append(one_run(run_no, node, profile, cluster, fleet, webhook, slurm,
                                       prometheus.url))
                r = results[-1]
                if r["complete"]:
                    print(f"{profile.name} run {run_no + 1}/{runs} {node} GPU {r['gpu']}: "
                          f"scraped {r['scraped']} s, peer {r['peer_webhook']:.2f} s, "
                          f"FleetWatch stored {r['stored']} s, incident "
                          f"{r['incident']:.2f} s, first action {r['first_action']:.2f} s "
                          f"({r['first_action_verb']}), webhook {r['fleetwatch_webhook']:.2f} s, "
                          f"drain {r['drain']:.2f} s", flush=True)
            # Whether FleetWatch took the writes: a remote-write run whose samples all failed
            # (an endpoint missing, a token refused) measured the scrape path only.
            sent = remote_write_counts(prometheus.url) if remote_write else {}
        except SystemExit:
            # A bench that gives up says why: the last of each FleetWatch process's log.
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", flush=True)
            raise
        finally:
            for proc in procs:
                stop_process_group(proc)
            prometheus.stop()
    return {"profile": asdict(profile), "remote_write": remote_write,
            "remote_write_samples": sent,
            "webhook_posts": webhook.posts, **summarise(results)}


def remote_write_counts(prometheus: str) -> dict[str, float]:
    """Prometheus's own counters of the samples it remote-wrote: sent, failed, dropped."""
    with urllib.request.urlopen(f"{prometheus}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    names = {"prometheus_remote_storage_samples_total": "sent",
             "prometheus_remote_storage_samples_failed_total": "failed",
             "prometheus_remote_storage_samples_dropped_total": "dropped"}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        key = names.get(line.split("{")[0].split(" ")[0])
        if key:
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    # Nearest rank: with 10 runs p95 is the slowest, as it should be with so few.
    p95 = ordered[min(len(ordered) - 1, max(0, -(-95 * len(ordered) // 100) - 1))]
    return {"median": round(statistics.median(ordered), 3), "p95": round(p95, 3),
            "min": round(ordered[0], 3), "max": round(ordered[-1], 3)}


MEASURES = ("scraped", "stored", "peer_webhook", "incident", "first_action",
            "fleetwatch_webhook", "drain", "ratio")


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    complete = [r for r in results if r["complete"]]
    out: dict[str, Any] = {
        "runs": len(results), "complete": len(complete),
        "first_action_before_peer": sum(1 for r in complete if r["first_action_before_peer"]),
        "drained_in_slurm": sum(1 for r in complete if r["drained_in_slurm"]),
        **{m: summary([r[m] for r in complete if r.get(m) is not None]) for m in MEASURES},
        "samples": results,
    }
    peer, first = out["peer_webhook"], out["first_action"]
    out["ratio_of_medians"] = (round(peer["median"] / first["median"], 2)
                               if peer and first and first["median"] > 0 else None)
    return out


# --- the whole bench --------------------------------------------------------------------------


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import redis
    from django.core.management import call_command
    from django.db import connection

    from collectors.sim.exporter import SimExporter
    from collectors.sim.fleet import SimFleet
    from tests.harness.k8s_server import K8sTestServer
    from tests.harness.slurm_cluster import SlurmCluster, missing_binaries

    missing = missing_binaries()
    if missing:
        sys.exit(f"peer bench: Slurm is not installed (missing {', '.join(missing)}): "
                 "deploy/bootstrap.sh test installs it")
    call_command("migrate", verbosity=0)
    redis.Redis.from_url(os.environ["CELERY_BROKER_URL"]).flushdb()
    # A node per run, over all profiles: every run is a fresh fault on a node nothing has
    # touched, so neither side's earlier alert, group or incident stands in the way.
    total = sum(args.runs_for[p] for p in args.profiles)
    fleet = SimFleet(tmp / "sim-fleet.json", 1.0)
    fleet.seed(nodes=max(total, 2), spares=0)
    state = json.loads(fleet.path.read_text())
    names = sorted(state["nodes"])
    leaves: dict[str, list[str]] = {}
    for name in names:
        leaves.setdefault(state["nodes"][name]["leaf"], []).append(name)
    exporter = SimExporter(fleet.path, 1.0)
    address = f"127.0.0.1:{exporter.start()}"
    slurm = SlurmCluster(tmp / "slurm", names, leaves, kill_wait=2)
    # FleetWatch on a real fleet reads Kubernetes too: the harness's API server, the nodes in
    # the gpu pool.
    k8s = K8sTestServer({"nodes": [{"name": n, "labels": {"fleetwatch.io/pool": "gpu"}}
                                   for n in names]},
                        kubeconfig_path=tmp / "kubeconfig.yaml", bookmark_interval=0.5)
    k8s.start()
    started = time.time()
    results = {}
    try:
        slurm.start()
        print(f"peer bench: {len(names)} nodes in Slurm and the exporter", flush=True)
        offset = 0
        for name in args.profiles:
            runs = args.runs_for[name]
            used = names[offset:offset + runs]
            results[name] = run_profile(PROFILES[name], used, len(names), tmp, fleet, address,
                                        slurm, k8s.kubeconfig_path, args.remote_write)
            offset += runs
            # The next profile starts on a fleet without faults: its FleetWatch and its peer
            # would otherwise open incidents and fire alerts for these nodes while it runs.
            repair(fleet, slurm, used)
    finally:
        slurm.stop()
        k8s.stop()
        exporter.stop()
        connection.close()
    return {"profiles": results, "wall_s": round(time.time() - started, 1),
            "remote_write": args.remote_write, "xid": XID}


def _fmt(s: dict[str, float] | None, unit: str = " s") -> str:
    if s is None:
        return "| n/a | n/a | n/a |"
    return (f"| {s['median']:.2f}{unit} | {s['p95']:.2f}{unit} | "
            f"{s['min']:.2f}-{s['max']:.2f}{unit} |")


def report(r: dict[str, Any]) -> str:
    path = "remote write" if r["remote_write"] else "scrape path (FleetWatch queries Prometheus)"
    lines = [
        "# FleetWatch side by side with Prometheus + Alertmanager", "",
        f"XID {r['xid']} injected into the simulated dcgm-exporter's state, one fresh node and "
        "GPU per run at a random phase of the scrape interval, FleetWatch's worker started "
        "afresh and the peer's rule group renamed per run (so their phases against the scrapes "
        "are sampled too); both sides read the same "
        "Prometheus (the profile's scrape interval) and FleetWatch drains on a real Slurm "
        f"(22.05). FleetWatch at its default settings, {path}. Seconds from the injection; "
        "ratio = peer webhook / FleetWatch first action (per run).", "",
    ]
    for name, p in r["profiles"].items():
        prof = p["profile"]
        lines += [
            f"## {name}: scrape and evaluation {prof['scrape_s']} s, for {prof['for_s']} s, "
            f"group_wait {prof['group_wait_s']} s", "",
            f"{p['complete']} of {p['runs']} runs complete." + (
                f" Remote write, Prometheus's counters: {p['remote_write_samples']}."
                if p["remote_write"] else ""), "",
            "| measure | median | p95 | min-max |", "|---|---:|---:|---:|",
            f"| Prometheus scraped the XID (both sides wait for it) {_fmt(p['scraped'])}",
            f"| peer: Alertmanager webhook {_fmt(p['peer_webhook'])}",
            f"| FleetWatch: the XID's signal stored (collection committed) "
            f"{_fmt(p['stored'])}",
            f"| FleetWatch: incident opened {_fmt(p['incident'])}",
            f"| FleetWatch: first action (on-call webhook sent) {_fmt(p['first_action'])}",
            f"| FleetWatch: its webhook arrived {_fmt(p['fleetwatch_webhook'])}",
            f"| FleetWatch: Slurm drain done {_fmt(p['drain'])}",
            f"| ratio (peer / first action) {_fmt(p['ratio'], 'x')}", "",
            f"Ratio of the medians: {p['ratio_of_medians']}x. "
            f"**FleetWatch first action before peer webhook: {p['first_action_before_peer']} of "
            f"{p['complete']}**; node drained in Slurm afterwards: {p['drained_in_slurm']} of "
            f"{p['complete']}.", "",
        ]
    tight = r["profiles"].get("tight")
    if tight and tight["complete"]:
        # Issue 18's target: at least 9 runs of 10 (the share, for another number of runs).
        # A run that did not complete counts against it.
        k, n = tight["first_action_before_peer"], tight["runs"]
        met = k >= 0.9 * n
        how = "remote-write" if r["remote_write"] else "scrape"
        lines += [f"Target (issue 18): FleetWatch's first action before the tight peer's webhook "
                  f"in at least 9 runs of 10, on the {how} path: "
                  f"**{'met' if met else 'not met'}** ({k} of {n}).", ""]
        if not met and not r["remote_write"]:
            lines += ["On the scrape path both sides wait for the same scrape; then the peer "
                      "waits for its next rule evaluation (every 5 s) and FleetWatch for its "
                      "next query of Prometheus (FLEETWATCH_COLLECT_INTERVAL, 5 s by default), "
                      "each at a phase of its own: the one whose tick comes first wins, about "
                      "half the runs each.", ""]
    lines.append(f"Bench wall time: {r['wall_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default="tight,usual,defaults",
                        help=f"comma-separated, run in this order: {', '.join(PROFILES)}")
    parser.add_argument("--runs", type=int, default=None,
                        help="runs per profile (default: " + ", ".join(
                            f"{k} {v}" for k, v in DEFAULT_RUNS.items()) + ")")
    parser.add_argument("--remote-write", action="store_true",
                        help="Prometheus also remote-writes the fault fields to FleetWatch")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    args.profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    unknown = [p for p in args.profiles if p not in PROFILES]
    if unknown or not args.profiles:
        parser.error(f"unknown profile(s) {unknown}: choose from {', '.join(PROFILES)}")
    if args.runs is not None and args.runs < 1:
        parser.error("--runs must be at least 1")
    args.runs_for = {p: args.runs or DEFAULT_RUNS[p] for p in args.profiles}
    r = on_own_database("peer", run, args)
    args.out.mkdir(parents=True, exist_ok=True)
    # One report per path, so that `make bench` keeps both: FleetWatch polling Prometheus
    # (peer.md) and Prometheus's remote write ringing its doorbell (peer-remote-write.md).
    name = "peer-remote-write" if args.remote_write else "peer"
    (args.out / f"{name}.json").write_text(json.dumps(r, indent=1))
    text = report(r)
    (args.out / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
