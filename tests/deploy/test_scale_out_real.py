"""FleetWatch scaled out as the manifests lay it out, in podman containers of the one image
(web, one worker per queue with two for remediate, beat), on REAL sources: a Slurm 25.11
cluster reached through slurmrestd with JWT (tests/harness/slurm_cluster.py; FleetWatch mints
its tokens from slurmctld's key, mounted read-only as a Secret would be), the Kubernetes test
server (tests/harness/k8s_server.py; a kubeconfig mounted read-only) with its node-pool
stand-in as the provider (FLEETWATCH_PROVIDER=kubernetes), and a real Prometheus scraping the
simulated dcgm-exporter. The containers run on the host's network, so loopback ports work.

The image has no Slurm binaries: FleetWatch's requeue through slurmrestd runs ``scontrol
requeue`` with the same JWT (slurmrestd has no requeue endpoint). The Slurm 25.11 client (its
prefix, read-only), the four shared libraries it and its auth plugins need that the image
lacks (libjwt, libjansson, libb64, libmunge: copied from this machine, same Debian release, on
LD_LIBRARY_PATH) and the cluster's slurm.conf folder are mounted into the containers, as a
deployment adds scontrol to FleetWatch's Pods (README, "How requeue works"); no munged runs
and no munge key is mounted: scontrol authenticates to slurmctld with the JWT alone.

An XID 79 on gpu-003 GPU 5 is put into the exporter's gauge; Prometheus scrapes it, the
containerised collectors query it, diagnosis opens a gpu_hardware incident and the
replace_node playbook runs through real Slurm and the Kubernetes server. The remediate worker
running the Kubernetes drain is SIGKILLed while its eviction is refused by a
PodDisruptionBudget (429, retried inside the call) and a second remediate worker runs; the
budget is relaxed only after the kill. The playbook finishes; each outside action is audited
as a change exactly once, and Slurm (slurmctld's log, the job's restart count, its SIGTERM
marks), the Kubernetes server (its request log, the evictions it let through) and the on-call
webhook receiver saw each change once.

What "heals" means here (the replace_node playbook replaces the broken machine, it does not
repair it): the incident is resolved; the job FleetWatch requeued runs again, in Slurm, on
gpu-002 and the spare gpu-005 it brought in; the spare is in service in Slurm (no longer
drained) and Ready and schedulable in Kubernetes; gpu-003 stays drained in Slurm with
FleetWatch's reason and its Kubernetes Node is gone (replaced by the pool)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from collectors.sim import fleet as sim
from collectors.sim.exporter import SimExporter
from collectors.sim.fleet import SimFleet
from tests.deploy.test_agent_deploy import limits
from tests.deploy.test_scale_out import query, subprocess_run, wait
from tests.deploy.test_server_image import (
    PODMAN,
    Fleet,
    free_port,
    podman_logs,
    wait_for_health,
    wait_for_log,
)
from tests.harness.prometheus import PrometheusServer, ScrapeTarget
from tests.harness.slurm_cluster import SlurmCluster, missing_binaries, scontrol_fields
from tests.integration.test_kubernetes import _server_module, kubectl
from tests.integration.test_playbook_real import (
    FAILED,
    GPU_STATE,
    LEAVES,
    NODES,
    ROOT,
    SPARE,
    SPARE_REASON,
    TRAIN_SCRIPT,
    EvictionSpy,
    k8s_seed,
)

pytestmark = [pytest.mark.image, pytest.mark.timeout(1200)]

RELEASE = "25.11"
TRAINER = "train/trainer-1"  # the training job's pod on gpu-003 (k8s_seed)
UID = 10001  # the image's user


@dataclass
class RealSources:
    oncall: OnCall
    slurm: SlurmCluster
    k8s: Any
    prometheus: PrometheusServer
    gpus: SimFleet
    spy: EvictionSpy
    secrets: Path


def slurm_client_libs(image: str, prefix: Path, into: Path) -> Path:
    """The shared libraries the Slurm client and its auth plugins load (libjwt, libjansson,
    libmunge, ...) that the image lacks, copied from this machine (the same Debian release as
    the image's base): what a site adding scontrol to FleetWatch's Pods ships with it."""
    into.mkdir()
    listing = subprocess.run([*PODMAN, "run", "--rm", "--network", "none", *limits(),
                              "--entrypoint", "ls", image, "/usr/lib/x86_64-linux-gnu",
                              "/usr/lib"], capture_output=True, text=True, timeout=120,
                             check=False)
    assert listing.returncode == 0, listing.stderr
    present = set(listing.stdout.split())
    libs: set[str] = set()
    for binary in (prefix / "bin" / "scontrol", *(prefix / "lib" / "slurm").glob("auth_*.so")):
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30,
                             check=True).stdout
        libs |= {line.split("=>")[1].split("(")[0].strip() for line in out.splitlines()
                 if "=>" in line and str(prefix) not in line}
    skip = ("libc.so", "libm.so", "libresolv.so", "ld-linux")
    for lib in sorted(libs):
        if lib and not Path(lib).name.startswith(skip) and Path(lib).name not in present:
            shutil.copy(lib, into / Path(lib).name)
    into.chmod(0o755)
    return into


class OnCall:
    """The on-call channel's webhook receiver (FLEETWATCH_NOTIFY_WEBHOOK_URL): every POST it
    was sent, answered 200."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.received: list[dict[str, Any]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                received.append({"event": self.headers.get("X-FleetWatch-Event"),
                                 "delivery": self.headers.get("X-FleetWatch-Delivery"),
                                 **json.loads(body or b"{}")})
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class MountedFleet(Fleet):
    """The image's containers with read-only mounts beside /data (Secrets, a ConfigMap)."""

    mounts: list[str]

    def options(self, name: str | None = None, **env: str) -> list[str]:
        opts = super().options(name, **env)
        for mount in self.mounts:
            opts += ["-v", mount]
        return opts


def sbatch(cluster: SlurmCluster, *args: str) -> str:
    out = cluster.run("sbatch", "--parsable", "-o", "/dev/null", *args, check=True)
    return out.stdout.strip().split(";")[0]


def job_fields(cluster: SlurmCluster, job: str) -> dict[str, str]:
    return scontrol_fields(cluster.run("scontrol", "show", "job", job, check=True).stdout)


def node_fields(cluster: SlurmCluster, node: str) -> dict[str, str]:
    return scontrol_fields(cluster.run("scontrol", "show", "node", node, check=True).stdout)


@pytest.fixture
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealSources]:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed (missing {', '.join(missing)}): run `make test`")
    root = tmp_path_factory.mktemp("rs")
    # The GPUs of gpu-001..gpu-005, served in dcgm-exporter's format, scraped every second.
    gpus = SimFleet(root / "gpus.json", 1.0)
    gpus.seed(nodes=len(NODES), spares=0)
    exporter = SimExporter(gpus.path, 1.0)
    address = f"127.0.0.1:{exporter.start()}"
    prometheus = PrometheusServer(root / "prometheus", [ScrapeTarget(address, job="dcgm")], "1s")
    # The training job's pods and a budget that lets none of them out (test_playbook_real):
    # the drain's eviction is refused (429) until the test relaxes it.
    k8s = _server_module().K8sTestServer(
        k8s_seed(), bookmark_interval=0.3, kubeconfig_path=root / "kubeconfig.yaml",
        pools={"gpu": {"spares": [SPARE], "delay": 0.5, "ready_delay": 0.5}})
    spy = EvictionSpy(k8s)
    k8s.evict = spy
    slurm = SlurmCluster(root / "slurm", NODES, LEAVES, kill_wait=2, release=RELEASE)
    oncall = OnCall()
    try:
        k8s.start()
        prometheus.start()
        slurm.start()
        (slurm.root / "marks").mkdir()
        (slurm.root / "train.sh").write_text(TRAIN_SCRIPT.format(marks=slurm.root / "marks"))
        slurm.run("scontrol", "update", f"nodename={SPARE}", "state=DRAIN",
                  f"reason={SPARE_REASON}", check=True)
        # The spare's acceptance checks run on its slurmd (this machine), not in a container:
        # the check program from this checkout, a simulated GPU state for the spare.
        for sub in ("gpu-state", "checks"):
            (slurm.root / sub).mkdir()
        (slurm.root / "gpu-state" / f"{SPARE}.json").write_text(json.dumps(GPU_STATE["passes"]))
        # What the containers get as Secrets: slurmctld's JWT key, the kubeconfig, a copy of
        # topology.conf (slurmrestd serves none); readable by the image's user only.
        secrets = root / "secrets"
        secrets.mkdir()
        shutil.copy(slurm.jwt_key, secrets / "jwt_hs256.key")
        shutil.copy(k8s.kubeconfig_path, secrets / "kubeconfig.yaml")
        shutil.copy(slurm.conf.parent / "topology.conf", secrets / "topology.conf")
        for path in (secrets, *secrets.iterdir()):
            os.chown(path, UID, 0)
            path.chmod(0o500 if path.is_dir() else 0o400)
        yield RealSources(oncall, slurm, k8s, prometheus, gpus, spy, secrets)
    finally:
        oncall.stop()
        slurm.stop()
        prometheus.stop()
        k8s.stop()
        exporter.stop()


@pytest.fixture
def real(migrated: Fleet, sources: RealSources) -> MountedFleet:
    fleet = MountedFleet.__new__(MountedFleet)
    fleet.__dict__.update(migrated.__dict__)  # the same names list: the fixture removes them
    slurm = sources.slurm
    prefix = slurm.install.prefix
    assert prefix is not None
    libs = slurm_client_libs(fleet.image, prefix, slurm.root / "client-libs")
    print("mounted for scontrol:", sorted(p.name for p in libs.iterdir()))
    fleet.mounts = [f"{sources.secrets}:/secrets:ro", f"{prefix}:{prefix}:ro",
                    f"{slurm.conf.parent}:{slurm.conf.parent}:ro", f"{libs}:/opt/slurm-libs:ro"]
    fleet.env.update({
        "FLEETWATCH_FLEET": "real", "FLEETWATCH_CLUSTER": "lab",
        "FLEETWATCH_SLURM_TRANSPORT": "rest", "FLEETWATCH_SLURMRESTD_URL": slurm.rest_url,
        "FLEETWATCH_SLURM_USER": "root",
        "FLEETWATCH_SLURM_JWT_KEY_FILE": "/secrets/jwt_hs256.key",
        "FLEETWATCH_SLURMCTLD_URL": slurm.slurmctld_url,
        "FLEETWATCH_SLURM_TOPOLOGY_FILE": "/secrets/topology.conf",
        "FLEETWATCH_SLURM_BIN_DIR": str(prefix / "bin"),
        "FLEETWATCH_SLURM_CONF": str(slurm.conf), "FLEETWATCH_SLURM_TIMEOUT": "8",
        "LD_LIBRARY_PATH": "/opt/slurm-libs",
        "FLEETWATCH_KUBECONFIG": "/secrets/kubeconfig.yaml",
        "FLEETWATCH_PROMETHEUS_URL": sources.prometheus.url,
        "FLEETWATCH_PROVIDER": "kubernetes",
        "FLEETWATCH_NOTIFY_WEBHOOK_URL": sources.oncall.url,
        "FLEETWATCH_WEBHOOK_ALLOW_HOSTS": "127.0.0.1",
        "FLEETWATCH_POLICY_MODE": "auto", "FLEETWATCH_SLURM_GRACE_SECONDS": str(slurm.kill_wait),
        # One node of a three-node leaf is a third of it: above the default 25 % budget.
        "FLEETWATCH_BUDGET_MAX_PERCENT": "50",
        "FLEETWATCH_COLLECT_INTERVAL": "2", "FLEETWATCH_STEP_POLL_SECONDS": "0.5",
        "FLEETWATCH_WATCHDOG_SECONDS": "2", "FLEETWATCH_STEP_LEASE_SECONDS": "8",
        "FLEETWATCH_LOG_LEVEL": "INFO",
        # The return-to-service gate: paths on the nodes (the check job's output is not
        # readable from the containers: the exit status is the verdict).
        "FLEETWATCH_GATE_CHECK_DIR": str(ROOT / "deploy" / "checks"),
        "FLEETWATCH_GATE_OUTPUT_DIR": str(slurm.root / "checks"),
        "FLEETWATCH_GATE_ENV": (f"FLEETWATCH_CHECK_STATE={slurm.root / 'gpu-state'},"
                                "FLEETWATCH_CHECK_SECONDS=1")})
    return fleet


def test_containers_on_real_slurm_prometheus_and_kubernetes_heal_an_xid_79_once(
        real: MountedFleet, sources: RealSources, database_url: str) -> None:
    f, slurm, k8s = real, sources.slurm, sources.k8s
    # gpu-001 and gpu-004 busy, gpu-005 drained: the training job can only land on 002+003,
    # and once requeued only on 002 and the spare (test_playbook_real's placement).
    blocker = sbatch(slurm, "-J", "other-team", "-N", "2", "-w", "gpu-001,gpu-004",
                     "--gres=gpu:8", "--wrap", "sleep 600")
    job = sbatch(slurm, "--requeue", "-J", "llama-pretrain", "-N", "2", "--gres=gpu:8",
                 str(slurm.root / "train.sh"))
    wait(lambda: job_fields(slurm, job)["JobState"] == "RUNNING", 30, f"job {job} to run")
    assert job_fields(slurm, job)["NodeList"] == "gpu-[002-003]"

    port = free_port()
    started = time.monotonic()
    web = f.start("web", PORT=str(port))
    wait_for_health(web, port)
    print(f"podman run (web, real fleet) -> /healthz 200: {time.monotonic() - started:.1f} s")
    for queue in ("collect", "diagnose", "default"):
        wait_for_log(f.start("worker", queue, "--concurrency", "1"), "ready.")
    first = f.start("worker", "remediate", "--concurrency", "1")
    wait_for_log(first, "ready.")
    f.start("beat")

    def logs() -> str:
        return "\n".join(f"--- {name}\n{podman_logs(name)[-3000:]}" for name in f.names)

    def explain() -> str:
        return logs() + "\n" + json.dumps(query(
            database_url, "SELECT kind, status, detail, done_calls::text FROM incidents_step "
                          "ORDER BY \"order\""), default=str) + "\n" + json.dumps(query(
            database_url, "SELECT name, healthy, last_error FROM collectors_sourcehealth"),
            default=str)

    # Every source healthy from inside the containers, every GPU read through Prometheus.
    wait(lambda: query(database_url, "SELECT count(*) FROM collectors_sourcehealth "
                                     "WHERE healthy")[0][0] == 3, 120,
         "slurm, kubernetes and telemetry healthy", explain)
    wait(lambda: query(database_url, "SELECT count(*) FROM collectors_gpu")[0][0]
         == 8 * len(NODES), 60, "every GPU from Prometheus", explain)
    wait(lambda: query(database_url, "SELECT count(*) FROM collectors_job WHERE state = "
                                     "'RUNNING' AND slurm_id = %s", job)[0][0] == 1, 60,
         f"job {job} collected from slurmrestd", explain)
    assert query(database_url, "SELECT count(*) FROM incidents_incident")[0][0] == 0

    # XID 79 on gpu-003 GPU 5, in the exporter's gauge: scrape, PromQL, collector, diagnosis.
    with sources.gpus.transaction() as state:
        sim.inject_xid(state, FAILED, 5, 79, time.time())

    # The only remediate worker is in the drain's eviction, refused by the budget; a second
    # one starts; the first is killed inside that call.
    wait(lambda: 429 in sources.spy.of("trainer-1"), 180,
         "the drain's eviction refused by the budget", explain)
    second = f.start("worker", "remediate", "--concurrency", "1")
    wait_for_log(second, "ready.")
    assert query(database_url, "SELECT status FROM incidents_step WHERE kind = "
                               "'cordon_and_drain'") == [("running",)]
    subprocess_run([*PODMAN, "kill", "--signal", "KILL", first])
    assert not sources.spy.of("trainer-1").count(201)  # nothing evicted before the kill
    # The on-call lowers the budget: the next eviction is let through.
    kubectl(k8s, "patch", "pdb", "trainer", "-n", "train", "--type=merge",
            "-p", '{"spec": {"minAvailable": 1}}')

    def resolved() -> bool:
        rows = query(database_url, "SELECT status FROM incidents_incident")
        return bool(rows) and rows[0][0] == "resolved"

    wait(resolved, 240, "the incident resolved", explain)

    print(json.dumps(query(database_url, "SELECT kind, status, detail FROM incidents_step "
                                         "ORDER BY \"order\""), default=str, indent=1))
    (incident_id, root_cause, nodes), = query(
        database_url, "SELECT id, root_cause, nodes::text FROM incidents_incident")
    assert (root_cause, json.loads(nodes)) == ("gpu_hardware", [FAILED])
    steps = query(database_url, "SELECT kind, status FROM incidents_step ORDER BY \"order\"")
    (rem_id,), = query(database_url, "SELECT id FROM incidents_remediation")
    assert [kind for kind, _ in steps] == [
        "notify", "drain_and_cancel", "requeue", "check_no_auto_replace", "cordon_and_drain",
        "replace_node", "prove_healthy", "resume"], steps
    assert all(status == "succeeded" for _, status in steps), steps

    # The audit trail: each outside change exactly once, although a worker died mid-step.
    entries = query(database_url, "SELECT verb, target, ok, data::text, call FROM "
                                  "incidents_auditentry WHERE call <> ''")
    changed = Counter((verb, target) for verb, target, ok, data, _ in entries
                      if ok and json.loads(data).get("changed"))
    assert changed == {
        ("notify", "on-call"): 1, ("slurm.drain", FAILED): 1, ("slurm.cancel", f"job {job}"): 1,
        ("slurm.comment", f"job {job} stopped"): 1, ("slurm.requeue", f"job {job}"): 1,
        ("slurm.comment", f"job {job} requeued"): 1, ("k8s.cordon", FAILED): 1,
        ("k8s.evict", TRAINER): 1, ("provider.replace", FAILED): 1,
        # The spare's acceptance checks over slurmrestd; the resume step then changes nothing.
        ("slurm.reserve", f"{SPARE} (fleetwatch-gate-r{rem_id}-1)"): 1,
        ("slurm.resume", f"{SPARE} (fleetwatch-gate-r{rem_id}-1)"): 1,
        ("slurm.submit_check", f"{SPARE} fleetwatch-check-r{rem_id}-1-fleetwatch-check"): 1,
        ("slurm.unreserve", f"{SPARE} (fleetwatch-gate-r{rem_id}-1)"): 1}, changed
    calls = {verb: call for verb, target, ok, data, call in entries
             if ok and json.loads(data).get("changed")}
    # Through slurmrestd (drain, cancel, resume) and scontrol with the JWT (requeue).
    assert calls["slurm.drain"].startswith("POST /slurm/v0.0.44/node/"), calls
    assert calls["slurm.requeue"] == f"scontrol requeue {job}", calls

    # The on-call channel got the incident's notification once.
    assert [(r["event"], r.get("subject")) for r in sources.oncall.received] == [
        ("incident.notify", f"FleetWatch incident {incident_id}: gpu_hardware on {FAILED}")], \
        sources.oncall.received
    # What the Kubernetes server saw: one cordon patch, one eviction let through (the
    # refused ones before it are the budget's), one Node deleted by the provider.
    seen = list(k8s.requests)
    assert sum(1 for m, path, _ in seen if (m, path.split("?")[0]) ==
               ("PATCH", f"/api/v1/nodes/{FAILED}")) == 1, seen
    assert sources.spy.of("trainer-1").count(201) == 1, sources.spy.answers
    assert sum(1 for m, path, _ in seen if (m, path.split("?")[0]) ==
               ("DELETE", f"/api/v1/nodes/{FAILED}")) == 1, seen

    # slurmctld's own log: one drain of gpu-003 (FleetWatch's reason), one resume of the
    # spare, and the job started twice: its first run and the one after the single requeue.
    ctld = (slurm.root / "log" / "slurmctld.log").read_text(errors="replace").splitlines()
    assert sum(1 for line in ctld if f"update_node: node {FAILED} reason set to: fleetwatch:"
               in line) == 1, ctld[-40:]
    assert sum(1 for line in ctld if f"update_node: node {SPARE} state set to IDLE"
               in line) == 1, ctld[-40:]
    # A start is logged by whichever scheduler made it: the backfill scheduler ("Started
    # JobId=N in ...") or the main one ("sched: Allocate JobId=N NodeList=...").
    starts = [line for line in ctld
              if f"Started JobId={job} " in line or f"sched: Allocate JobId={job} " in line]
    assert len(starts) == 2, ctld[-40:]
    # What Slurm shows: gpu-003 drained with FleetWatch's reason; the job got its SIGTERM
    # once, was requeued once and runs again on gpu-002 and the spare, which is in service.
    shown = node_fields(slurm, FAILED)
    assert "DRAIN" in shown["State"] and shown["Reason"].startswith(
        f"fleetwatch: incident {incident_id} gpu_hardware"), shown
    assert sorted(p.name for p in (slurm.root / "marks").iterdir()) == [f"{job}.0"]
    shown = job_fields(slurm, job)
    assert (shown["JobState"], shown["Restarts"], shown["NodeList"]) == (
        "RUNNING", "1", "gpu-[002,005]"), shown
    spare = node_fields(slurm, SPARE)
    assert "DRAIN" not in spare["State"] and "DOWN" not in spare["State"], spare
    assert job_fields(slurm, blocker)["JobState"] == "RUNNING"
    # Kubernetes: the old Node gone, the spare Ready and schedulable.
    nodes = json.loads(kubectl(k8s, "get", "nodes", "-o", "json").stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    assert FAILED not in by_name and SPARE in by_name, sorted(by_name)
    assert not by_name[SPARE]["spec"].get("unschedulable"), by_name[SPARE]
    assert {c["type"]: c["status"] for c in by_name[SPARE]["status"]["conditions"]}["Ready"] \
        == "True"

    # The killed worker is the only container that stopped.
    for name in f.names:
        state = subprocess.run([*PODMAN, "inspect", "--format", "{{.State.Running}}", name],
                               capture_output=True, text=True, timeout=60, check=True)
        assert state.stdout.strip() == ("false" if name == first else "true"), name
