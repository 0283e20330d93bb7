"""The gpu_hardware playbook (replace_node) against real parts: a real Slurm cluster
(tests/harness/slurm_cluster.py: slurmctld, five slurmd, munged) and the Kubernetes test server
with its node-pool stand-in (tests/harness/k8s_server.py), through the real clients
(SlurmCli, KubernetesApi, KubernetesPoolProvider + SlurmRebootProvider). Only GPU telemetry
comes from the simulator, over five simulated nodes named like the real ones: GPU health is not
what this test is about, and the resume step only needs "these GPUs report, with no XID".

The replacement then goes through the return-to-service gate (incidents/remediation/gate.py)
for real: a reservation holding the spare, FleetWatch's own check program
(deploy/checks/fleetwatch-check) as a Slurm job in it, reading a simulated GPU state for the
spare (these slurmd have no GPU). A spare whose check passes is back in service, its reservation
gone, and the job runs on it; one whose check fails never reaches service: drained with the
check's verdict as its reason, the job still waiting, the remediation failed for a person.

The engine runs in this process (no broker): each round runs or re-checks the first unfinished
step, as a worker's queue would. What it did is checked with the real tools (``scontrol``,
``squeue``, ``kubectl``), the test server's request log and the audit trail.

Placement, and why the job is not submitted with ``-w gpu-002,gpu-003``: ``scontrol requeue``
keeps a job's ReqNodeList, so a requeued job that named the failed node stays PENDING forever
("ReqNodeNotAvail, UnavailableNodes:gpu-003") and the resume step waits until its deadline.
Instead a blocker job holds gpu-001 and gpu-004 and the spare gpu-005 is drained, so the
training job (``-N 2``) can only start on gpu-002 and gpu-003; once requeued it can only run
again on gpu-002 and the spare, which proves the spare was brought into service.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from collectors import services as collectors
from collectors.clients import Clients
from collectors.clients.base import K8S_CORDONED_BY, ActionResult
from collectors.clients.kubernetes import KubernetesApi
from collectors.clients.providers import (
    REPLACES_ANNOTATION,
    CompositeProvider,
    KubernetesPoolProvider,
    SlurmRebootProvider,
)
from collectors.clients.slurm import SlurmCli
from collectors.sim.fleet import SimFleet, SimTelemetry
from incidents import lifecycle
from incidents.audit import audit_verify
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, GateRun, Incident, Remediation, Step
from incidents.remediation import engine
from incidents.remediation.playbooks import FOR_ROOT_CAUSE
from tests.conftest import wait_for
from tests.harness.slurm_cluster import SlurmCluster, SlurmInstall, missing_binaries, scontrol_fields
from tests.integration.test_kubernetes import _server_module, kubectl

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

ROOT = Path(__file__).resolve().parents[2]
NODES = [f"gpu-00{i}" for i in range(1, 6)]
LEAVES = {"leaf-a": ["gpu-001", "gpu-002", "gpu-003"], "leaf-b": ["gpu-004", "gpu-005"]}
SPARE = "gpu-005"
FAILED = "gpu-003"
SPARE_REASON = "fleetwatch: spare pool"
# What the check program reads for the spare instead of real GPUs (FLEETWATCH_CHECK_STATE).
GPU_STATE = {
    "passes": {"gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3"} for i in range(8)]},
    "fails": {"gpus": [*({"index": i} for i in range(8) if i != 5),
                       {"index": 5, "healthy": False, "error": "XID 79: fallen off the bus"}]},
}

# A training job in miniature: loops until SIGTERM, then leaves a marker named after the job
# and the how-many-th run it is (what a checkpoint-on-SIGTERM handler would do) and exits.
TRAIN_SCRIPT = """#!/bin/bash
trap 'echo SIGTERM > "{marks}/$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"; exit 0' TERM
while true; do sleep 0.1; done
"""


def _pod(name: str, node: str, **extra: Any) -> dict[str, Any]:
    return {"namespace": "train", "name": name, "node": node,
            "labels": {"app": "trainer", "fleetwatch.io/slurm-job": "llama-pretrain"},
            "owner": {"kind": "StatefulSet", "name": "trainer"}, **extra}


def k8s_seed() -> dict[str, Any]:
    daemon = [{"namespace": "kube-system", "name": f"dcgm-exporter-{n}", "node": n,
               "labels": {"app": "dcgm-exporter"},
               "owner": {"kind": "DaemonSet", "name": "dcgm-exporter"}} for n in NODES[:4]]
    return {
        "nodes": [{"name": n, "labels": {"fleetwatch.io/pool": "gpu"}} for n in NODES[:4]],
        # The training job's pods on its two nodes, and a budget that allows none of them out
        # (minAvailable = the number of pods): the first eviction is answered 429.
        "pods": [_pod("trainer-0", "gpu-002"), _pod("trainer-1", FAILED), *daemon],
        "poddisruptionbudgets": [{"namespace": "train", "name": "trainer",
                                  "selector": {"app": "trainer"}, "minAvailable": 2}],
    }


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory,
            slurm_install: SlurmInstall) -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed here (missing {', '.join(missing)}): "
                    "`apt-get install -y slurm-wlm munge`, as `make test`'s bootstrap does")
    root = tmp_path_factory.mktemp("slurm-pb")
    with SlurmCluster(root, NODES, LEAVES, kill_wait=2, install=slurm_install) as running:
        (root / "marks").mkdir()
        (root / "gpu-state").mkdir()
        (root / "checks").mkdir()
        (root / "train.sh").write_text(TRAIN_SCRIPT.format(marks=root / "marks"))
        # The spare: out of service, drained by FleetWatch (so FleetWatch may resume it).
        running.run("scontrol", "update", f"nodename={SPARE}", "state=DRAIN",
                    f"reason={SPARE_REASON}", check=True)
        yield running


@pytest.fixture
def k8s(tmp_path: Path) -> Iterator[Any]:
    server = _server_module().K8sTestServer(
        k8s_seed(), bookmark_interval=0.3, kubeconfig_path=tmp_path / "kubeconfig.yaml",
        # The node pool brings the spare when a member is deleted: NotReady first, then Ready.
        pools={"gpu": {"spares": [SPARE], "delay": 0.5, "ready_delay": 0.5}})
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RecordingNotifier:
    """The on-call channel: what the playbook told it (delivery is not under test here)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, object]]] = []

    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult:
        self.sent.append((subject, payload))
        return ActionResult("notify on-call (recorded by the test)", True, subject)


def sbatch(cluster: SlurmCluster, *args: str) -> str:
    out = cluster.run("sbatch", "--parsable", "-o", "/dev/null", *args, check=True)
    return out.stdout.strip().split(";")[0]


def squeue(cluster: SlurmCluster, job_id: str, fmt: str = "%T") -> str:
    return cluster.run("squeue", "-h", "-j", job_id, "-o", fmt).stdout.strip()


def scontrol(cluster: SlurmCluster, *what: str) -> dict[str, str]:
    """``scontrol show node X`` / ``show job N`` as {field: value} (Reason keeps its spaces)."""
    return scontrol_fields(cluster.run("scontrol", "show", *what, check=True).stdout)


class EvictionSpy:
    """Wraps the test server's eviction handler to record what each POST was answered (the
    request log keeps requests, not answers), so the test sees the 429 itself."""

    def __init__(self, k8s: Any) -> None:
        self.answers: list[tuple[str, int]] = []
        self._evict = k8s.evict

    def __call__(self, namespace: str, name: str, body: Any, dry_run: bool) -> Any:
        try:
            result = self._evict(namespace, name, body, dry_run)
        except Exception as e:
            self.answers.append((name, int(getattr(e, "code", 500))))
            raise
        self.answers.append((name, 201))
        return result

    def of(self, pod: str) -> list[int]:
        return [code for name, code in list(self.answers) if name == pod]


def relax_budget_after_first_refusal(k8s: Any, spy: EvictionSpy,
                                     done: list[str]) -> threading.Thread:
    """The budget frees up while FleetWatch retries: once the server has refused the first
    eviction of trainer-1 (429), the on-call lowers the budget with kubectl, from another
    thread, as a person would while the drain waits."""
    def run() -> None:
        wait_for(lambda: 429 in spy.of("trainer-1"), 60, "the first eviction to be refused",
                 interval=0.05)
        patched = kubectl(k8s, "patch", "pdb", "trainer", "-n", "train", "--type=merge",
                          "-p", '{"spec": {"minAvailable": 1}}')
        done.append(patched.stdout.strip())

    thread = threading.Thread(target=run, name="relax-pdb", daemon=True)
    thread.start()
    return thread


def drive(rem: Remediation, capture: Any, between: Callable[[], None], *,
          rounds: int = 600) -> Remediation:
    """tests/unit/test_remediation.py's drive(), slower between polls: each round here calls
    the real CLI and API, and a waiting step (a job's KillWait, a node joining the pool, the
    requeued job's BeginTime) needs seconds, not rounds."""
    for _ in range(rounds):
        rem.refresh_from_db()
        if rem.status != Remediation.Status.RUNNING:
            return rem
        step = rem.steps.exclude(status__in=Step.DONE).order_by("order").first()
        if step is None:
            return rem
        with capture():
            outcome = engine.step_run(step.pk, "poll")
        between()
        if outcome == "waiting":
            time.sleep(0.2)
    rem.refresh_from_db()
    return rem


def gate_settings(settings: Any, cluster: SlurmCluster) -> None:
    """The gate as a site sets it up: the check programs where the nodes have them (this
    checkout: the harness's slurmd run here), their output where FleetWatch reads it back."""
    settings.FLEETWATCH_GATE_CHECK_DIR = str(ROOT / "deploy" / "checks")
    settings.FLEETWATCH_GATE_OUTPUT_DIR = str(cluster.root / "checks")
    settings.FLEETWATCH_GATE_ENV = {"FLEETWATCH_CHECK_STATE": str(cluster.root / "gpu-state"),
                                    "FLEETWATCH_CHECK_SECONDS": "1"}
    settings.FLEETWATCH_GATE_START_MINUTES = 2.0


@pytest.mark.parametrize("verdict", ["passes", "fails"])
def test_gpu_hardware_playbook_on_real_slurm_and_kubernetes(
        cluster: SlurmCluster, k8s: Any, settings: Any, tmp_path: Path, monkeypatch: Any,
        django_capture_on_commit_callbacks: Any, verdict: str) -> None:
    settings.FLEETWATCH_POLICY_MODE = "auto"
    settings.FLEETWATCH_PLAYBOOK_MODES = {}
    settings.FLEETWATCH_STEP_MODES = {}
    settings.FLEETWATCH_SLURM_GRACE_SECONDS = cluster.kill_wait
    gate_settings(settings, cluster)
    (cluster.root / "gpu-state" / f"{SPARE}.json").write_text(json.dumps(GPU_STATE[verdict]))

    # gpu-001 and gpu-004 busy, gpu-005 drained: the training job can only land on 002+003.
    blocker = sbatch(cluster, "-J", "other-team", "-N", "2", "-w", "gpu-001,gpu-004",
                     "--gres=gpu:8", "--wrap", "sleep 600")
    wait_for(lambda: squeue(cluster, blocker) == "RUNNING", 30, "the blocker job to run")
    job = sbatch(cluster, "--requeue", "-J", "llama-pretrain", "-N", "2", "--gres=gpu:8",
                 str(cluster.root / "train.sh"))
    wait_for(lambda: squeue(cluster, job) == "RUNNING", 30, f"job {job} to run")
    assert squeue(cluster, job, "%N") == "gpu-[002-003]"

    slurm = SlurmCli(env=cluster.env, timeout=10, retries=1, backoff=0.2)
    api = KubernetesApi(str(k8s.kubeconfig_path), timeout=5.0, evict_max_wait=30.0,
                        evict_backoff=(0.2, 0.5))
    fleet = SimFleet(tmp_path / "gpu-telemetry.json", speed=1.0)
    fleet.seed(nodes=len(NODES), spares=0)  # gpu-001..gpu-005, every GPU healthy
    notifier = RecordingNotifier()
    clients = Clients(
        slurm=slurm, kubernetes=api, telemetry=SimTelemetry(fleet),
        provider=CompositeProvider(replace=KubernetesPoolProvider(api),
                                   reboot=SlurmRebootProvider(slurm)),
        notifier=notifier)
    # The executors get their clients through _step_context -> get_clients().
    monkeypatch.setattr(engine, "get_clients", lambda cluster: clients)

    diagnosis = Diagnosis(root_cause="gpu_hardware", nodes=(FAILED,), confidence=0.95,
                          playbook=FOR_ROOT_CAUSE["gpu_hardware"], jobs=(job,),
                          explanation=f"XID 79 on {FAILED} GPU 3: fallen off the bus",
                          detected_at=timezone.now())
    # Captured, not executed: the first step's message stays off the broker; drive() runs it.
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(collectors.cluster_default().pk, diagnosis)
    rem = incident.remediations.get()
    assert rem.status == "running" and rem.playbook == "replace_node"

    spy = EvictionSpy(k8s)
    monkeypatch.setattr(k8s, "evict", spy)  # the request handler calls server.evict()
    relaxed: list[str] = []
    helper = relax_budget_after_first_refusal(k8s, spy, relaxed)
    seen: dict[str, Any] = {}

    def between() -> None:
        """Look with the real tools at the moments that later steps change for good."""
        done = {s.kind for s in Step.objects.filter(remediation=rem, status="succeeded")}
        if "requeue" in done and "requeued" not in seen:
            # Requeued, and nowhere to run: gpu-003 drained, the spare not yet resumed.
            seen["requeued"] = (squeue(cluster, job), scontrol(cluster, "job", job))
        if "replace_node" in done and "prove_healthy" not in done:
            # The gate at work: what an operator sees of the spare meanwhile.
            seen.setdefault("gate", []).append((
                cluster.run("scontrol", "show", "reservation").stdout,
                squeue(cluster, job), scontrol(cluster, "node", SPARE)))
        if "cordon_and_drain" in done and "replace_node" not in done and "cordoned" not in seen:
            # Before the pool provider deletes the Node: cordoned, pods evicted.
            seen["cordoned"] = (kubectl(k8s, "get", "node", FAILED, "--no-headers").stdout,
                                kubectl(k8s, "get", "pods", "-A", "--field-selector",
                                        f"spec.nodeName={FAILED}", "-o", "name").stdout)

    try:
        rem = drive(rem, django_capture_on_commit_callbacks, between)
    finally:
        helper.join(timeout=60)
        api.close()
    steps = list(rem.steps.order_by("order").values_list("kind", "status", "detail"))
    incident.refresh_from_db()
    reason = f"fleetwatch: incident {incident.pk} gpu_hardware"
    # While the spare was checked: held in its reservation (FleetWatch's user alone), resumed
    # inside it, and the requeued job (which has nowhere else to go) never started on it.
    held = [(r, state, n) for r, state, n in seen.get("gate", []) if SPARE in r]
    assert held, seen.get("gate")
    assert all(state == "PENDING" for _, state, _ in seen["gate"]), seen["gate"]
    shown = scontrol_fields(held[0][0])
    assert shown["ReservationName"] == f"fleetwatch-gate-r{rem.pk}-1"
    assert (shown["Nodes"], shown["Users"]) == (SPARE, "root")
    assert "No reservations in the system" in cluster.run("scontrol", "show",
                                                           "reservation").stdout
    gate_run = GateRun.objects.get(remediation=rem)
    assert (gate_run.node, gate_run.repair, gate_run.checks) == (SPARE, "replace",
                                                                 ["fleetwatch-check"])
    if verdict == "fails":
        spare_failed(cluster, rem, incident, job, steps, gate_run)
        return
    assert rem.status == "succeeded", steps
    assert gate_run.status == "passed" and gate_run.results[0]["result"]["gpus"] == 8

    # --- Slurm, through scontrol/squeue ---
    node = scontrol(cluster, "node", FAILED)
    assert "DRAIN" in node["State"] and node["Reason"].startswith(reason), node
    assert (cluster.root / "marks" / f"{job}.0").exists(), "the job never got its SIGTERM"
    pending_state, pending = seen["requeued"]
    assert pending_state == "PENDING" and pending["Restarts"] == "1"
    shown = scontrol(cluster, "job", job)
    assert (shown["JobState"], shown["Restarts"]) == ("RUNNING", "1")
    assert squeue(cluster, job) == "RUNNING"
    assert squeue(cluster, job, "%N") == "gpu-[002,005]"  # the spare took gpu-003's place
    spare = scontrol(cluster, "node", SPARE)
    assert spare["State"] in ("ALLOCATED", "MIXED") and "Reason" not in spare, spare
    assert squeue(cluster, blocker) == "RUNNING"  # a job elsewhere is left alone

    # --- Kubernetes, through kubectl and the server's request log ---
    node_row, pods_left = seen["cordoned"]
    assert "SchedulingDisabled" in node_row
    assert pods_left.split() == [f"pod/dcgm-exporter-{FAILED}"]  # only the DaemonSet pod
    # Refused by the budget first (429, maybe more than once while kubectl patches it),
    # then evicted; the DaemonSet pod never asked for.
    answers = spy.of("trainer-1")
    assert answers[0] == 429 and answers[-1] == 201 and set(answers[:-1]) == {429}, answers
    assert relaxed == ["poddisruptionbudget.policy/trainer patched"]
    assert spy.of(f"dcgm-exporter-{FAILED}") == []
    log = [(m, p.split("?")[0]) for m, p, _ in list(k8s.requests)]
    cordon = log.index(("PATCH", f"/api/v1/nodes/{FAILED}"))
    evictions = [i for i, (m, p) in enumerate(log)
                 if m == "POST" and p == "/api/v1/namespaces/train/pods/trainer-1/eviction"]
    delete = log.index(("DELETE", f"/api/v1/nodes/{FAILED}"))
    assert cordon < evictions[0] and len(evictions) >= 2 and evictions[-1] < delete
    assert log.count(("DELETE", f"/api/v1/nodes/{FAILED}")) == 1
    assert not any(p.endswith(f"/pods/dcgm-exporter-{FAILED}/eviction") for _, p in log)
    # The Node as it was when deleted (the server keeps its last state): cordoned by FleetWatch.
    last = next(c.old for c in reversed(k8s.history)
                if c.store == "nodes" and c.type == "DELETED" and
                c.obj["metadata"]["name"] == FAILED)
    assert last["spec"]["unschedulable"] is True
    assert last["metadata"]["annotations"][K8S_CORDONED_BY] == "fleetwatch"
    rows = {line.split()[0]: line.split()[1] for line in
            kubectl(k8s, "get", "nodes", "--no-headers").stdout.splitlines()}
    assert rows == {"gpu-001": "Ready", "gpu-002": "Ready", "gpu-004": "Ready", SPARE: "Ready"}
    new = json.loads(kubectl(k8s, "get", "node", SPARE, "-o", "json").stdout)
    assert new["metadata"]["annotations"][REPLACES_ANNOTATION] == FAILED
    assert k8s.provisioned == [(FAILED, SPARE, "gpu")]
    assert k8s.get("pods", "train", "trainer-0") is not None  # the job's other pod stays

    # --- the audit trail: every outside action once, in order ---
    calls = list(AuditEntry.objects.filter(remediation=rem).exclude(call="").order_by("id"))
    acted = [(e.verb, e.target) for e in calls if e.data.get("changed")]
    assert acted == [
        ("notify", "on-call"), ("slurm.drain", FAILED), ("slurm.comment", f"job {job} stopped"),
        ("slurm.cancel", f"job {job}"), ("slurm.requeue", f"job {job}"),
        ("slurm.comment", f"job {job} requeued"), ("k8s.cordon", FAILED),
        ("k8s.evict", "train/trainer-1"), ("provider.replace", FAILED),
        # The gate: the spare held, resumed in its reservation, checked, the reservation gone
        # (the resume step after it finds the spare in service already).
        ("slurm.reserve", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)"),
        ("slurm.resume", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)"),
        ("slurm.submit_check", f"{SPARE} fleetwatch-check-r{rem.pk}-1-fleetwatch-check"),
        ("slurm.unreserve", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)"),
    ]
    assert all(e.ok for e in calls)
    evict = next(e for e in calls if e.verb == "k8s.evict")
    assert evict.data["attempts"] == len(answers), evict.data  # one audit entry, its retries
    assert "disruption-budget waits" in evict.result
    assert len(notifier.sent) == 1 and notifier.sent[0][1]["nodes"] == [FAILED]
    cordoned = Step.objects.get(remediation=rem, kind="cordon_and_drain").result
    assert cordoned["evicted"] == ["train/trainer-1"]
    assert cordoned["skipped"] == [f"kube-system/dcgm-exporter-{FAILED}"]
    resume = Step.objects.get(remediation=rem, kind="resume")
    assert resume.detail == f"{SPARE} in service; job {job} running again"
    resumed = resume.result
    assert resumed["jobs"][job]["nodes"] == ["gpu-002", SPARE]
    assert resumed["jobs"][job]["restart_count"] == 1
    assert audit_verify().ok

    assert incident.status == Incident.Status.RESOLVED
    assert incident.repaired_by == "automation"
    assert {"detect", "decide", "drain", "requeue", "replace", "resume"} <= set(incident.phases)


def spare_failed(cluster: SlurmCluster, rem: Remediation, incident: Incident, job: str,
                 steps: list[Any], gate_run: GateRun) -> None:
    """The spare failed its check: it never reached Slurm service."""
    assert rem.status == "failed", steps
    kinds = {kind: (status, detail) for kind, status, detail in steps}
    assert kinds["prove_healthy"][0] == "failed" and kinds["resume"][0] == "pending", kinds
    failed = Step.objects.get(remediation=rem, kind="prove_healthy")
    assert f"acceptance check fleetwatch-check failed on {SPARE}: GPU 5: XID 79" in failed.error
    assert f"{SPARE} is drained (1 of 2 failed gates before RMA)" in failed.error
    # Slurm: the spare drained again with the check's verdict, no reservation, the job waiting.
    spare = scontrol(cluster, "node", SPARE)
    assert "DRAIN" in spare["State"], spare
    assert spare["Reason"].startswith(f"fleetwatch: acceptance check fleetwatch-check failed "
                                      f"on {SPARE}: GPU 5: XID 79: fallen off the bus"), spare
    time.sleep(2)
    assert squeue(cluster, job) == "PENDING"
    # The record: the gate's verdict with the check's output, in the audit trail and on the
    # node's page (incidents.selectors feeds it).
    assert gate_run.status == "failed" and gate_run.results[0]["exit_code"] == 1
    assert '"ok": false' in gate_run.results[0]["output"]
    entry = AuditEntry.objects.get(remediation=rem, verb="gate.failed")
    assert entry.target == SPARE and not entry.ok
    assert "GPU 5: XID 79" in entry.data["results"][0]["output"]
    acted = [e.verb for e in AuditEntry.objects.filter(remediation=rem).exclude(call="")
             .order_by("id") if e.data.get("changed")]
    assert acted[-5:] == ["slurm.reserve", "slurm.resume", "slurm.submit_check", "slurm.drain",
                          "slurm.unreserve"], acted
    assert incident.status == Incident.Status.NEEDS_ATTENTION
    assert audit_verify().ok
