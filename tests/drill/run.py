"""The failure drill's orchestrator: "GPU died, training didn't", on real parts.

    python -m tests.drill.run --out reports/drill [--grace 120 --scrape 15 ...]

It starts, on this machine and in a temporary directory:

- a real Slurm cluster (``tests/harness/slurm_cluster.py``): gpu-001..gpu-004 in service and
  gpu-005, the spare, drained by FleetWatch ("fleetwatch: spare pool"); KillWait is the SIGTERM
  grace (``--grace``) and ``--cred-expire`` the wait Slurm imposes on a requeued job;
- the simulated dcgm-exporter (``collectors/sim/exporter.py``) for the five nodes,
  scraped by a real Prometheus every ``--scrape`` seconds. A node's GPUs are reported busy
  while a rank of a training job is stepping on it (its heartbeat file is fresh) and idle
  otherwise, so the utilisation FleetWatch charts is the job's real progress;
- the Kubernetes test server (``tests/harness/k8s_server.py``) with a Node and a slurmd pod
  per in-service node, and a node pool that brings gpu-005 when a member is deleted;
- FleetWatch's web server (gunicorn), worker and beat, configured by environment variables
  alone for real sources (``FLEETWATCH_FLEET=real``, ``FLEETWATCH_PROVIDER=kubernetes``).

Then it submits, with plain ``sbatch --requeue``, the training job (``tests/drill/train.py``)
on two nodes. A blocker job of another team holds gpu-001 and gpu-004 and the spare is
drained, so the job can only start on gpu-002 and gpu-003 (a requeued job keeps its ReqNodeList,
so ``-w`` would pin it to the dead node forever); once requeued it can only run on gpu-002 and
the spare. After ``--progress-steps`` steps it kills GPU 3 of gpu-003: XID 79 in the exporter
(the Prometheus path) or an ``NVRM: Xid`` line in the node agent's kernel log (``--fault-path
agent``), and the job's rank on that node hangs in its CUDA call. FleetWatch is left alone
(with ``--no-auto-replace``, the node's pod opts out and an operator continues through the
REST API). The drill waits for the incident to resolve and the job to pass its checkpoint on
the replacement node, then writes the report (``tests/drill/report.py``).

Everything the report says is observed: this process's clock for the injection, Prometheus's
own sample timestamps, FleetWatch's rows (signals, incident, steps, audit entries), a poller of
``squeue``/``sinfo`` and the Kubernetes server, and the training job's log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.harness.processes import stop_process_group
from tests.harness.slurm_cluster import free_port, scontrol_fields

ROOT = Path(__file__).resolve().parents[2]
NODES = ["gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-005"]
LEAVES = {"leaf-a": ["gpu-001", "gpu-002", "gpu-003"], "leaf-b": ["gpu-004", "gpu-005"]}
SPARE = "gpu-005"
HEALTHY_RANK = "gpu-002"  # the job's other node: it keeps its place through the repair
FAILED = "gpu-003"
FAILED_GPU = 3
BLOCKER_NODES = "gpu-001,gpu-004"
SPARE_REASON = "fleetwatch: spare pool"
CLUSTER = "drill"
NO_AUTO_REPLACE = "fleetwatch.io/no-auto-replace"
CHART_STEP = 15.0  # collectors.selectors reads Prometheus range queries at this step
XID79_LINE = ("NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, "
              "GPU has fallen off the bus.")


class DrillError(RuntimeError):
    pass


@dataclass
class DrillConfig:
    """What a run of the drill looks like. The defaults are the production-like run."""

    grace: int = 120  # Slurm KillWait: SIGTERM, then SIGKILL this much later
    scrape: float = 15.0  # Prometheus scrape interval (s)
    collect: float = 5.0  # FLEETWATCH_COLLECT_INTERVAL
    step_poll: float = 1.0  # FLEETWATCH_STEP_POLL_SECONDS
    cred_expire: int = 120  # Slurm's AuthInfo cred_expire: a requeued job's BeginTime wait
    provider_delay: float = 20.0  # the node pool's new VM registers this long after the delete
    provider_ready_delay: float = 10.0  # ... and turns Ready this much later
    step_seconds: float = 1.0  # one training step
    checkpoint_every: int = 10
    progress_steps: int = 30  # steps the job makes before the fault
    after_steps: int = 5  # steps past the checkpoint after the resume
    fault_path: str = "prometheus"  # or "agent"
    no_auto_replace: bool = False
    timeout: float = 900.0  # for the whole repair
    out: Path | None = None
    workdir: Path | None = None  # default: a fresh temporary directory
    keep_workdir: bool = False

    def label(self) -> str:
        variant = "agent" if self.fault_path == "agent" else "prometheus"
        return variant + ("-no-auto-replace" if self.no_auto_replace else "")


@dataclass
class Observation:
    at: float
    what: str
    value: str


@dataclass
class DrillResult:
    config: DrillConfig
    job_id: str = ""
    blocker_id: str = ""
    incident_id: int | None = None
    remediation_id: int | None = None
    injected_at: float = 0.0
    xid_scraped_at: float | None = None
    approval: dict[str, Any] = field(default_factory=dict)
    observations: list[Observation] = field(default_factory=list)
    train_log: list[dict[str, Any]] = field(default_factory=list)
    chart: dict[str, Any] = field(default_factory=dict)
    page_status: int = 0
    page_html: str = ""
    web_url: str = ""
    k8s_failed_node_last: dict[str, Any] | None = None
    slurm_failed_node: dict[str, str] = field(default_factory=dict)
    job_nodes_after: str = ""
    restarted_at: float | None = None  # the new run's StartTime, as Slurm recorded it
    report: dict[str, Any] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)


# --- small helpers ----------------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.25, explain: Callable[[], str] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    extra = f"\n{explain()}" if explain is not None else ""
    raise DrillError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def read_train_log(path: Path) -> list[dict[str, Any]]:
    records = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


# --- the simulated exporter follows the job ---------------------------------------------------


class GpuLoad(threading.Thread):
    """Makes the simulated dcgm-exporter report a node's GPUs busy while a training rank is
    stepping there (its heartbeat is fresh) and idle otherwise. In the simulated fleet's file a
    busy node is a node with a RUNNING job on it; each busy node gets its own stand-in job, so a
    fault on one node never idles another through the simulation's own hang model."""

    def __init__(self, fleet: Any, heartbeats: Path, fresh: float) -> None:
        super().__init__(name="drill-gpu-load", daemon=True)
        self.fleet, self.heartbeats, self.fresh = fleet, heartbeats, fresh
        self.stopping = threading.Event()

    def busy(self) -> set[str]:
        now = time.time()
        found = set()
        with contextlib.suppress(FileNotFoundError):
            for beat in self.heartbeats.iterdir():
                with contextlib.suppress(OSError):
                    if now - beat.stat().st_mtime < self.fresh:
                        found.add(beat.name)
        return found

    def sync(self) -> None:
        from collectors.sim import fleet as sim

        busy = self.busy()
        with self.fleet.transaction() as state:
            jobs = state["jobs"]
            for key in [k for k in jobs if jobs[k]["nodes"][0] not in busy]:
                del jobs[key]
            for node in sorted(busy - {j["nodes"][0] for j in jobs.values()}):
                if node not in state["nodes"]:
                    continue
                key = str(90000 + NODES.index(node) if node in NODES else 99999)
                job = sim._new_job(key, "drill-train", "drill", 1)
                job.update(state="RUNNING", nodes=[node], started_at=time.time())
                jobs[key] = job

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            with contextlib.suppress(Exception):  # a torn read of a heartbeat: next tick
                self.sync()


# --- the poller: what Slurm and Kubernetes said, and when --------------------------------------


class Poller(threading.Thread):
    """Samples the job's state and nodes (squeue), the failed and spare nodes (sinfo) and their
    Kubernetes Nodes every 0.25 s and records each change with the time it was seen."""

    def __init__(self, slurm: Any, k8s: Any, job_id: str) -> None:
        super().__init__(name="drill-poller", daemon=True)
        self.slurm, self.k8s, self.job_id = slurm, k8s, job_id
        self.stopping = threading.Event()
        self.seen: list[Observation] = []
        self._last: dict[str, str] = {}
        self.lock = threading.Lock()

    def _note(self, what: str, value: str) -> None:
        if self._last.get(what) != value:
            self._last[what] = value
            with self.lock:
                self.seen.append(Observation(time.time(), what, value))

    def sample(self) -> None:
        out = self.slurm.run("squeue", "-h", "-j", self.job_id, "-o", "%T|%N|%r", timeout=10)
        if out.returncode == 0:
            state, _, rest = out.stdout.strip().partition("|")
            nodes, _, reason = rest.partition("|")
            self._note("job.state", state or "GONE")
            if state == "RUNNING":
                self._note("job.nodes", nodes)
            if state == "PENDING":
                self._note("job.reason", reason)
        states = self.slurm.node_states()
        for node in (FAILED, SPARE):
            if node in states:
                self._note(f"slurm.{node}", states[node])
        for node in (FAILED, SPARE):
            obj = self.k8s.get("nodes", "", node)
            if obj is None:
                self._note(f"k8s.{node}", "absent")
                continue
            ready = next((c.get("status") for c in obj.get("status", {}).get("conditions", [])
                          if c.get("type") == "Ready"), "Unknown")
            cordoned = bool(obj.get("spec", {}).get("unschedulable"))
            self._note(f"k8s.{node}", f"Ready={ready}" + (",cordoned" if cordoned else ""))

    def first(self, what: str, match: Callable[[str], bool], after: float = 0.0) -> float | None:
        with self.lock:
            return next((o.at for o in self.seen if o.what == what and o.at >= after
                         and match(o.value)), None)

    def run(self) -> None:
        while not self.stopping.wait(0.25):
            with contextlib.suppress(Exception):
                self.sample()


# --- the drill ----------------------------------------------------------------------------------


class Drill:
    """Start everything (``start()``), run the scenario (``run()``), stop everything (``stop()``).

    The database and broker are given (``database_url``, ``broker_url``) and must be migrated
    and reachable; this process reads FleetWatch's rows through the Django ORM, so Django must
    be set up for that same database before ``run()``."""

    def __init__(self, config: DrillConfig, database_url: str, broker_url: str) -> None:
        self.config = config
        self.database_url, self.broker_url = database_url, broker_url
        if config.workdir is not None:
            self.root = Path(config.workdir)
            self.root.mkdir(parents=True, exist_ok=True)
            self._tmp = None
        else:
            # Short: munged's socket path has 108 bytes at most.
            self._tmp = tempfile.mkdtemp(prefix="fwdrill-", dir="/tmp")
            self.root = Path(self._tmp)
        self.run_dir = self.root / "train"
        self.logs = self.root / "logs"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exporter: Any = None
        self.prometheus: Any = None
        self.k8s: Any = None
        self.slurm: Any = None
        self.fleet: Any = None
        self.load: GpuLoad | None = None
        self.poller: Poller | None = None
        self.web_port = 0
        self.password = secrets.token_urlsafe(12)
        self.api_key = ""
        self.kmsg = self.root / "agent" / "kmsg"

    # --- lifecycle ---

    def __enter__(self) -> Drill:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start_sources()
            self._start_fleetwatch()
        except BaseException:
            self.stop()
            raise

    def _start_sources(self) -> None:
        from collectors.sim.exporter import SimExporter
        from collectors.sim.fleet import SimFleet
        from tests.harness.k8s_server import K8sTestServer
        from tests.harness.prometheus import PrometheusServer, ScrapeTarget
        from tests.harness.slurm_cluster import SlurmCluster, missing_binaries

        missing = missing_binaries()
        if missing:
            raise DrillError(f"Slurm is not installed (missing {', '.join(missing)}): "
                             "deploy/bootstrap.sh test installs it")
        for sub in (self.run_dir / "faults", self.run_dir / "heartbeat", self.logs,
                    self.kmsg.parent / "sys"):
            sub.mkdir(parents=True, exist_ok=True)
        c = self.config
        # The GPUs: five simulated nodes (gpu-005 the spare), no simulated jobs: the load
        # follows the real training job's heartbeats.
        self.fleet = SimFleet(self.root / "sim-fleet.json", 1.0)
        self.fleet.seed(nodes=len(NODES), spares=0, reset=True)
        with self.fleet.transaction() as state:
            state["jobs"] = {}
        self.exporter = SimExporter(self.fleet.path, 1.0)
        address = f"127.0.0.1:{self.exporter.start()}"
        self.load = GpuLoad(self.fleet, self.run_dir / "heartbeat",
                            fresh=max(2.0, 2.5 * c.step_seconds))
        self.load.start()
        self.prometheus = PrometheusServer(self.root / "prometheus",
                                           [ScrapeTarget(address, job="dcgm")],
                                           f"{c.scrape:g}s")
        self.prometheus.start()
        daemon = [{"namespace": "gpu-operator", "name": f"dcgm-exporter-{n}", "node": n,
                   "labels": {"app": "dcgm-exporter"},
                   "owner": {"kind": "DaemonSet", "name": "dcgm-exporter"}} for n in NODES[:4]]
        slurmd = [{"namespace": "slurm", "name": f"slurmd-{n}", "node": n,
                   "labels": {"app": "slurmd", **({NO_AUTO_REPLACE: "true"}
                                                  if c.no_auto_replace and n == FAILED else {})},
                   "owner": {"kind": "StatefulSet", "name": "slurmd"}} for n in NODES[:4]]
        self.k8s = K8sTestServer(
            {"nodes": [{"name": n, "labels": {"fleetwatch.io/pool": "gpu"}} for n in NODES[:4]],
             "pods": slurmd + daemon},
            kubeconfig_path=self.root / "kubeconfig.yaml", bookmark_interval=1.0,
            pools={"gpu": {"spares": [SPARE], "delay": c.provider_delay,
                           "ready_delay": c.provider_ready_delay}})
        self.k8s.start()
        self.slurm = SlurmCluster(self.root / "slurm", NODES, LEAVES, kill_wait=c.grace,
                                  cred_expire=c.cred_expire)
        self.slurm.start()
        self.slurm.run("scontrol", "update", f"nodename={SPARE}", "state=DRAIN",
                       f"reason={SPARE_REASON}", check=True)
        # The spare's acceptance checks (FleetWatch's own check program, run by its slurmd on
        # this machine) read a simulated GPU state: these slurmd have no GPU.
        for sub in ("gpu-state", "checks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "gpu-state" / f"{SPARE}.json").write_text(json.dumps(
            {"gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3"} for i in range(8)]}))

    def env(self) -> dict[str, str]:
        """FleetWatch's environment: only what an operator would set for real sources."""
        c = self.config
        base = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWATCH_")}
        return {
            **base,
            "DJANGO_SETTINGS_MODULE": "fleetwatch.settings",
            "DATABASE_URL": self.database_url,
            "CELERY_BROKER_URL": self.broker_url,
            "FLEETWATCH_DATA_DIR": str(self.root / "data"),
            "FLEETWATCH_FLEET": "real",
            "FLEETWATCH_CLUSTER": CLUSTER,
            "FLEETWATCH_SLURM_CONF": self.slurm.env["SLURM_CONF"],
            "FLEETWATCH_KUBECONFIG": str(self.k8s.kubeconfig_path),
            "FLEETWATCH_PROMETHEUS_URL": self.prometheus.url,
            "FLEETWATCH_PROVIDER": "kubernetes",
            "FLEETWATCH_POLICY_MODE": "auto",
            "FLEETWATCH_COLLECT_INTERVAL": f"{c.collect:g}",
            "FLEETWATCH_STEP_POLL_SECONDS": f"{c.step_poll:g}",
            "FLEETWATCH_SLURM_GRACE_SECONDS": str(c.grace),
            "FLEETWATCH_BASE_URL": f"http://127.0.0.1:{self.web_port}",
            # The return-to-service gate: the check programs where the nodes have them.
            "FLEETWATCH_GATE_CHECK_DIR": str(ROOT / "deploy" / "checks"),
            "FLEETWATCH_GATE_OUTPUT_DIR": str(self.root / "checks"),
            "FLEETWATCH_GATE_ENV": (f"FLEETWATCH_CHECK_STATE={self.root / 'gpu-state'},"
                                    "FLEETWATCH_CHECK_SECONDS=1"),
        }

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.logs / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                argv, cwd=ROOT, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def _start_fleetwatch(self) -> None:
        from collectors.roles import OPERATOR, user_with_role
        from incidents.tokens import token_create

        python = sys.executable
        bindir = Path(python).parent
        self.web_port = free_port()
        user, _ = user_with_role("drill-operator", OPERATOR, self.password)
        self.api_key = token_create(user, f"drill-operator-{secrets.token_hex(3)}",
                                    ("read", "operate"), ttl_days=1)[1]
        self._spawn("worker", [python, "-m", "celery", "-A", "fleetwatch", "worker",
                               "-Q", "collect,diagnose,remediate,default", "--concurrency", "4",
                               "--loglevel", "INFO", "-n", f"drill-{os.getpid()}@%h"])
        self._spawn("beat", [python, "-m", "celery", "-A", "fleetwatch", "beat",
                             "--loglevel", "INFO", "-s", str(self.root / "beat-schedule")])
        gunicorn = bindir / "gunicorn"
        web = [str(gunicorn)] if gunicorn.exists() else [python, "-m", "gunicorn"]
        # The production config (JSON logs, multiprocess metrics), as `make run` starts it.
        self._spawn("web", [*web, "-c", str(ROOT / "deploy" / "gunicorn.conf.py"),
                            "fleetwatch.wsgi", "--bind", f"127.0.0.1:{self.web_port}",
                            "--workers", "2"])
        if self.config.fault_path == "agent":
            from incidents.tokens import agent_token_create

            token = self.root / "agent" / "token"
            token.write_text(agent_token_create(FAILED, actor="system:drill")[1])
            token.chmod(0o600)
            self.kmsg.touch()
            self._spawn("agent", [python, "-m", "collectors.agent", "--node", FAILED,
                                  "--url", f"http://127.0.0.1:{self.web_port}",
                                  "--token-file", str(token), "--interval", "1",
                                  "--spool", str(self.root / "agent" / "spool.jsonl"),
                                  "--kmsg", str(self.kmsg), "--no-nvml", "--kernel-log", "file",
                                  "--sysfs-root", str(self.kmsg.parent / "sys")])
        import requests

        def web_up() -> bool:
            self._check_processes()
            with contextlib.suppress(requests.RequestException):
                return requests.get(f"{self.web_url}/healthz", timeout=2).status_code < 500
            return False

        wait_until(web_up, 60, "FleetWatch's web server", interval=0.5,
                   explain=lambda: _tail(self.logs / "web.log"))

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def _check_processes(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise DrillError(f"FleetWatch's {name} exited ({proc.returncode}):\n"
                                 f"{_tail(self.logs / f'{name}.log')}")

    def stop(self) -> None:
        for thread in (self.poller, self.load):
            if thread is not None:
                thread.stopping.set()
        for name in ("agent", "web", "beat", "worker"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                stop_process_group(proc)
        for part in ("slurm", "prometheus", "k8s", "exporter"):
            obj = getattr(self, part)
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.stop()
                setattr(self, part, None)
        if self._tmp is not None and not self.config.keep_workdir:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # --- the scenario ---

    def sbatch(self, *args: str) -> str:
        out = self.slurm.run("sbatch", "--parsable", *args, check=True)
        return out.stdout.strip().split(";")[0]

    def squeue(self, job: str, fmt: str = "%T") -> str:
        return str(self.slurm.run("squeue", "-h", "-j", job, "-o", fmt).stdout.strip())

    def _settled(self) -> bool:
        from collectors.models import Gpu, SourceHealth

        self._check_processes()
        health = {h.name: h.healthy for h in SourceHealth.objects.filter(cluster__name=CLUSTER)}
        return all(health.get(s) for s in ("slurm", "kubernetes", "telemetry")) and \
            Gpu.objects.filter(node__cluster__name=CLUSTER).count() == 8 * len(NODES)

    def _submit(self, result: DrillResult) -> None:
        c = self.config
        result.blocker_id = self.sbatch("-J", "other-team", "-N", "2", "-w", BLOCKER_NODES,
                                        "--gres=gpu:8", "-o", "/dev/null", "--wrap",
                                        "sleep 100000")
        wait_until(lambda: self.squeue(result.blocker_id) == "RUNNING", 60,
                   "the other team's job to run")
        script = self.run_dir / "train.sbatch"
        # exec: srun is the batch step itself, so Slurm's SIGTERM reaches the ranks directly and
        # no shell sits in between to die first.
        script.write_text(
            "#!/bin/bash\n"
            f"exec srun --ntasks-per-node=1 {sys.executable} {ROOT / 'tests/drill/train.py'} "
            f"--dir {self.run_dir} --step-seconds {c.step_seconds:g} "
            f"--checkpoint-every {c.checkpoint_every}\n")
        result.job_id = self.sbatch("--requeue", "-J", "llama-pretrain", "-N", "2",
                                    "--ntasks-per-node=1", "--gres=gpu:8",
                                    "-o", str(self.run_dir / "slurm-%j.out"), str(script))
        wait_until(lambda: self.squeue(result.job_id) == "RUNNING", 60,
                   f"job {result.job_id} to run")
        placed = self.squeue(result.job_id, "%N")
        if placed != "gpu-[002-003]":
            raise DrillError(f"job {result.job_id} landed on {placed}, not gpu-[002-003]")

    def _steps(self, restart: int | None = None) -> list[dict[str, Any]]:
        return [r for r in read_train_log(self.run_dir / "train.log")
                if r["event"] == "step" and (restart is None or r["restart"] == restart)]

    def _inject(self, result: DrillResult) -> None:
        from collectors.sim import fleet as sim

        now = time.time()
        # The GPU dies under the job: its rank hangs from now on...
        (self.run_dir / "faults" / FAILED).write_text(f"XID 79 on GPU {FAILED_GPU} at {now}\n")
        if self.config.fault_path == "agent":
            # ...and the driver says so in the kernel log, which the node agent reads.
            with self.kmsg.open("a") as kmsg:
                kmsg.write(f"3,{int(now)},{int(time.monotonic() * 1e6)},-;{XID79_LINE}\n")
        else:
            # ...and dcgm-exporter reports it: the XID gauge, and the GPU's fields go blank.
            with self.fleet.transaction() as state:
                sim.inject_xid(state, FAILED, FAILED_GPU, 79, now)
        result.injected_at = now

    def _incident(self) -> Any:
        from incidents.models import Incident

        return Incident.objects.filter(cluster__name=CLUSTER, nodes__contains=[FAILED]).first()

    def _explain(self) -> str:
        from incidents.models import Incident, Step

        lines = []
        for inc in Incident.objects.filter(cluster__name=CLUSTER):
            lines.append(f"incident {inc.pk} {inc.root_cause} {inc.status} {inc.nodes}")
            for st in Step.objects.filter(remediation__incident=inc).order_by("order"):
                lines.append(f"  {st.order} {st.kind} {st.status} {st.detail} {st.error}")
        from collectors.models import Gpu, Signal, SourceHealth

        # What FleetWatch knew of the failed node: enough to tell "never saw it" from "saw
        # it and did not call it a fault" when a run fails.
        for g in Gpu.objects.filter(node__name=FAILED).order_by("index"):
            lines.append(f"gpu {FAILED}/{g.index}: health={g.health} last_xid={g.last_xid} "
                         f"util={g.utilization} updated={g.updated_at:%H:%M:%S.%f}")
        for sig in Signal.objects.filter(node_name=FAILED).order_by("-id")[:20]:
            lines.append(f"signal {sig.observed_at:%H:%M:%S.%f} {sig.source} {sig.kind} "
                         f"gpu={sig.gpu_index} code={sig.code} {sig.value} {sig.message[:80]}")
        for h in SourceHealth.objects.all():
            lines.append(f"source {h.name}: healthy={h.healthy} runs={h.runs} "
                         f"failures={h.failures} last_error={h.last_error[:200]}")
        lines.append(f"squeue: {self.squeue(self._job_id, '%T %N %r') if self._job_id else ''}")
        lines.append(f"sinfo: {self.slurm.node_states() if self.slurm else ''}")
        lines.append("worker log:\n" + _tail(self.logs / "worker.log", 3000))
        return "\n".join(lines)

    _job_id = ""

    def _approve_through_api(self, result: DrillResult) -> None:
        """The no-auto-replace variant: the playbook stops before the cordon; an operator
        reads the remediation and lets it go on through the REST API."""
        import requests

        from incidents.models import Remediation

        rem = wait_until(lambda: Remediation.objects.filter(
            incident__cluster__name=CLUSTER, status=Remediation.Status.BLOCKED).first(),
            self.config.timeout, "the playbook to stop for a person", interval=0.5,
            explain=self._explain)
        blocked_at = time.time()
        headers = {"Authorization": f"Token {self.api_key}"}
        listed = requests.get(f"{self.web_url}/api/v1/remediations/",
                              params={"incident": rem.incident_id}, headers=headers, timeout=10)
        shown = next((r for r in listed.json().get("results", listed.json())
                      if r["id"] == rem.pk), {}) if listed.ok else {}
        # Approve: at a stop for a person (the no-auto-replace check) approving is the go-ahead
        # to continue (transitions.remediation_approve).
        answer = requests.post(f"{self.web_url}/api/v1/remediations/{rem.pk}/approve/",
                               headers=headers, timeout=10)
        result.approval = {"blocked_at": blocked_at, "status_seen": shown.get("status"),
                           "blocked_reason": shown.get("blocked_reason", rem.blocked_reason),
                           "answer": answer.status_code, "answered_at": time.time(),
                           "body": answer.json() if answer.content else {}}
        if answer.status_code != 200:
            raise DrillError(f"approve through the API answered {answer.status_code}: "
                             f"{answer.text[:500]}")

    def _login(self) -> Any:
        import requests

        session = requests.Session()
        page = session.get(f"{self.web_url}/login/", timeout=10)
        token = session.cookies.get("csrftoken") or re.search(
            r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
        session.post(f"{self.web_url}/login/", timeout=10, allow_redirects=False,
                     data={"username": "drill-operator", "password": self.password,
                           "csrfmiddlewaretoken": token},
                     headers={"Referer": f"{self.web_url}/login/"})
        return session

    def _chart_recovered(self, session: Any, result: DrillResult, resumed_at: float,
                         fault_at: float) -> bool:
        chart = session.get(f"{self.web_url}/incidents/{result.incident_id}/chart.json",
                            timeout=30).json()
        result.chart = chart
        series = chart.get("series", {})

        def points(node: str) -> list[tuple[float, float]]:
            s = series.get(node, {})
            return [(datetime.fromisoformat(x).timestamp(), float(y))
                    for x, y in zip(s.get("x", []), s.get("y", []), strict=False)]

        before = [y for t, y in points(HEALTHY_RANK) if t < fault_at]
        after = [y for t, y in points(SPARE) if t > resumed_at]
        return bool(before) and max(before) > 50 and bool(after) and max(after) > 50

    def run(self) -> DrillResult:
        from incidents.models import Incident, Remediation

        c = self.config
        result = DrillResult(config=c, web_url=self.web_url)
        wait_until(self._settled, 120, "FleetWatch to read all three sources", interval=0.5,
                   explain=lambda: _tail(self.logs / "worker.log"))
        self._submit(result)
        self._job_id = result.job_id
        self.poller = Poller(self.slurm, self.k8s, result.job_id)
        self.poller.start()
        # Progress first, and enough of it under Prometheus's eye for the chart to show the
        # job busy before the fault (two scrapes at least).
        wait_until(lambda: len(self._steps(0)) >= c.progress_steps * 2, c.timeout,
                   f"{c.progress_steps} training steps", interval=0.5,
                   explain=lambda: _tail(self.run_dir / f"slurm-{result.job_id}.out"))
        wait_until(lambda: self._busy_scrapes() >= 2, 4 * c.scrape + 30,
                   "two scrapes of the job's GPUs busy", interval=0.5)
        # The incident chart reads Prometheus at 15 s resolution: a point of the job busy
        # before the fault needs the job to have run at least that long.
        first = min(r["at"] for r in self._steps(0))
        wait_until(lambda: time.time() - first >= CHART_STEP + 1, CHART_STEP + 5,
                   "a chart point of the job at work")
        # Mid-way between two periodic checkpoints, so the report shows what the SIGTERM
        # checkpoint saved (a periodic one alone would lose up to checkpoint_every steps).
        half = max(1, c.checkpoint_every // 2)
        wait_until(lambda: self._steps(0)[-1]["step"] % c.checkpoint_every == half,
                   c.checkpoint_every * c.step_seconds + 10, "a step between two checkpoints",
                   interval=0.02)
        self._inject(result)
        incident = wait_until(self._incident, 120 + 4 * c.scrape + 4 * c.collect,
                              "an incident for the fault", interval=0.25, explain=self._explain)
        result.incident_id = incident.pk
        if c.no_auto_replace:
            self._approve_through_api(result)

        def repaired() -> bool:
            inc = Incident.objects.get(pk=result.incident_id)
            rem = inc.remediations.order_by("-pk").first()
            if rem is not None and rem.status in (Remediation.Status.FAILED,
                                                  Remediation.Status.CANCELLED):
                raise DrillError(f"remediation {rem.pk} {rem.status}:\n{self._explain()}")
            return inc.status == Incident.Status.RESOLVED

        wait_until(repaired, c.timeout, "the incident to resolve", interval=0.5,
                   explain=self._explain)
        checkpoint = self._checkpoint_before()

        def passed() -> bool:
            return any(r["step"] > checkpoint + c.after_steps for r in self._steps()
                       if r["restart"] >= 1)

        wait_until(passed, 120 + c.cred_expire, "the job to pass its checkpoint again",
                   interval=0.5, explain=self._explain)
        inc = Incident.objects.get(pk=result.incident_id)
        result.remediation_id = inc.remediations.order_by("-pk").values_list(
            "pk", flat=True).first()
        result.job_nodes_after = self.squeue(result.job_id, "%N")
        shown = scontrol_fields(self.slurm.run("scontrol", "show", "job", result.job_id,
                                               check=True).stdout)
        with contextlib.suppress(KeyError, ValueError):
            # Slurm prints local time without a zone.
            result.restarted_at = datetime.fromisoformat(shown["StartTime"]).timestamp()
        result.slurm_failed_node = scontrol_fields(
            self.slurm.run("scontrol", "show", "node", FAILED, check=True).stdout)
        result.k8s_failed_node_last = self._last_k8s_state(FAILED)
        result.xid_scraped_at = self._xid_scraped_at(result.injected_at)
        resumed = min((r["at"] for r in self._steps() if r["restart"] >= 1), default=time.time())
        session = self._login()
        page = session.get(f"{self.web_url}/incidents/{result.incident_id}/", timeout=30)
        result.page_status, result.page_html = page.status_code, page.text
        # The chart reads Prometheus at 15 s resolution: wait for a point after the resume.
        with contextlib.suppress(DrillError):
            wait_until(lambda: self._chart_recovered(session, result, resumed,
                                                     result.injected_at),
                       60 + 3 * c.scrape, "the chart to show the job busy again", interval=2)
        self.poller.stopping.set()
        self.poller.join(timeout=5)
        result.observations = list(self.poller.seen)
        result.train_log = read_train_log(self.run_dir / "train.log")
        for name in self.procs:
            result.logs[name] = _tail(self.logs / f"{name}.log", 20000)
        from tests.drill import report

        result.report = report.build(result)
        return result

    def _checkpoint_before(self) -> int:
        saved = [r["step"] for r in read_train_log(self.run_dir / "train.log")
                 if r["event"] == "checkpoint" and r["restart"] == 0]
        return max(saved, default=0)

    def _busy_scrapes(self) -> int:
        """Samples of the job's healthy node's GPU 0 above 50% utilisation in Prometheus."""
        import requests

        answer = requests.get(f"{self.prometheus.url}/api/v1/query", timeout=5, params={
            "query": f'DCGM_FI_DEV_GPU_UTIL{{Hostname="{HEALTHY_RANK}",gpu="0"}}[10m]'}).json()
        values = [float(v) for s in answer.get("data", {}).get("result", [])
                  for _, v in s.get("values", [])]
        return sum(1 for v in values if v > 50)

    def _xid_scraped_at(self, injected_at: float) -> float | None:
        """Prometheus's timestamp of the first scrape that carried the XID (its own clock)."""
        import requests

        answer = requests.get(f"{self.prometheus.url}/api/v1/query", timeout=5, params={
            "query": f'DCGM_FI_DEV_XID_ERRORS{{Hostname="{FAILED}",gpu="{FAILED_GPU}"}}[30m]'}
        ).json()
        times = [float(t) for s in answer.get("data", {}).get("result", [])
                 for t, v in s.get("values", []) if float(v) != 0 and float(t) >= injected_at - 1]
        return min(times, default=None)

    def _last_k8s_state(self, node: str) -> dict[str, Any] | None:
        """The Node as Kubernetes last had it (the pool provider deletes it)."""
        current = self.k8s.get("nodes", "", node)
        if current is not None:
            return dict(current)
        for change in reversed(self.k8s.history):
            if change.store == "nodes" and change.type == "DELETED" and \
                    change.obj["metadata"]["name"] == node:
                return dict(change.old or change.obj)
        return None


# --- the command ---------------------------------------------------------------------------------


def _scratch_database(url: str) -> str:
    """A fresh database beside the one DATABASE_URL names (``<name>_drill``), dropped and
    created again: the drill never writes into a database someone uses."""
    import dj_database_url
    import psycopg

    conf = dj_database_url.parse(url)
    name = f"{conf['NAME']}_drill" if not str(conf["NAME"]).endswith("_drill") else conf["NAME"]
    admin = dict(host=conf["HOST"] or None, port=conf["PORT"] or None, user=conf["USER"] or None,
                 password=conf["PASSWORD"] or None, dbname="postgres", autocommit=True)
    with psycopg.connect(**{k: v for k, v in admin.items() if v is not None}) as db:
        db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        db.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + f"/{name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.drill.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DrillConfig()
    parser.add_argument("--out", type=Path, default=Path("reports/drill"))
    parser.add_argument("--grace", type=int, default=d.grace, help="Slurm KillWait (s)")
    parser.add_argument("--scrape", type=float, default=d.scrape, help="scrape interval (s)")
    parser.add_argument("--collect", type=float, default=d.collect,
                        help="FLEETWATCH_COLLECT_INTERVAL (s)")
    parser.add_argument("--step-poll", type=float, default=d.step_poll)
    parser.add_argument("--cred-expire", type=int, default=d.cred_expire,
                        help="Slurm's cred_expire: a requeued job waits this long (s)")
    parser.add_argument("--provider-delay", type=float, default=d.provider_delay)
    parser.add_argument("--provider-ready-delay", type=float, default=d.provider_ready_delay)
    parser.add_argument("--step-seconds", type=float, default=d.step_seconds)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--progress-steps", type=int, default=d.progress_steps)
    parser.add_argument("--fault-path", choices=["prometheus", "agent"], default=d.fault_path)
    parser.add_argument("--no-auto-replace", action="store_true",
                        help="the node's pod opts out; an operator continues through the API")
    parser.add_argument("--timeout", type=float, default=d.timeout)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args(argv)
    config = DrillConfig(
        grace=args.grace, scrape=args.scrape, collect=args.collect, step_poll=args.step_poll,
        cred_expire=args.cred_expire, provider_delay=args.provider_delay,
        provider_ready_delay=args.provider_ready_delay, step_seconds=args.step_seconds,
        checkpoint_every=args.checkpoint_every, progress_steps=args.progress_steps,
        fault_path=args.fault_path, no_auto_replace=args.no_auto_replace,
        timeout=args.timeout, out=args.out, workdir=args.workdir,
        keep_workdir=args.keep_workdir)
    database_url = os.environ.get("DATABASE_URL", "")
    broker_url = os.environ.get("CELERY_BROKER_URL", "")
    if not database_url.startswith("postgres") or not broker_url.startswith("redis://"):
        print("the drill needs PostgreSQL and Redis: DATABASE_URL and CELERY_BROKER_URL "
              "(tests/harness/with-services.sh sets both)", file=sys.stderr)
        return 2
    database_url = _scratch_database(database_url)
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
    # This process only reads FleetWatch's rows (and migrates): none of the caller's
    # FLEETWATCH_* settings, and no sources of its own (the processes it starts have those).
    for key in [k for k in os.environ if k.startswith("FLEETWATCH_")]:
        del os.environ[key]
    os.environ["FLEETWATCH_DATA_DIR"] = tempfile.mkdtemp(prefix="fwdrill-data-")
    import django

    django.setup()
    import redis
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    redis.Redis.from_url(broker_url).flushdb()
    print(f"drill ({config.label()}): grace {config.grace}s, scrape {config.scrape:g}s, "
          f"collect {config.collect:g}s, cred_expire {config.cred_expire}s; database "
          f"{database_url.rsplit('/', 1)[1]}", flush=True)
    from tests.drill import report

    with Drill(config, database_url, broker_url) as drill:
        print(f"FleetWatch on {drill.web_url} (login drill-operator / {drill.password}); "
              f"work dir {drill.root}", flush=True)
        result = drill.run()
    paths = report.write(result, args.out)
    print(report.markdown(result.report))
    print("written: " + ", ".join(str(p) for p in paths))
    return 0 if result.report["checks"]["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
