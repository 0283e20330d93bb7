"""The return-to-service gate on a pool Kubernetes schedules, against real parts: the Kubernetes
test server (tests/harness/k8s_server.py) with its node-pool stand-in and its job controller and
kubelet stand-in (which runs a Job's pod command here, for real), a real Slurm cluster that
knows only the training nodes, through the real clients (KubernetesApi, SlurmCli,
KubernetesPoolProvider). GPU telemetry comes from the simulator.

A GPU falls off the bus on gpu-003, a node of the ``inference`` pool, which Kubernetes schedules
and Slurm does not know. The gpu_hardware playbook passes over Slurm (nothing to drain or
requeue there), cordons the node and evicts its pod, and the pool replaces it with gpu-005. The
gate holds gpu-005 (cordoned, tainted ``fleetwatch.io/gate``), runs FleetWatch's own check
program (deploy/checks/fleetwatch-check, reading a simulated GPU state) as a batch/v1 Job pinned
to it, and reads the verdict from the pod's exit status and its log. Passed: gpu-005 is
uncordoned and a user's pod waiting for it runs; failed: it stays cordoned with the check's
verdict as its reason, the user's pod still waiting, the remediation failed for a person. What
FleetWatch did is read back with real ``kubectl`` and ``scontrol``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from collectors import services as collectors
from collectors.clients import Clients
from collectors.clients.base import K8S_CORDON_REASON, K8S_CORDONED_BY, K8S_GATE
from collectors.clients.kubernetes import KubernetesApi
from collectors.clients.providers import (
    CompositeProvider,
    KubernetesPoolProvider,
    SlurmRebootProvider,
)
from collectors.clients.slurm import SlurmCli
from collectors.sim.fleet import SimFleet, SimTelemetry
from incidents import lifecycle
from incidents.audit import audit_verify
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, GateRun, Step
from incidents.remediation import engine, gate
from incidents.remediation.gate_k8s import gate_poll_kubernetes
from incidents.remediation.playbooks import FOR_ROOT_CAUSE
from tests.conftest import wait_for
from tests.harness.slurm_cluster import SlurmCluster, SlurmInstall, missing_binaries
from tests.integration.test_kubernetes import KUBECTL, _server_module, kubectl
from tests.integration.test_playbook_real import GPU_STATE, RecordingNotifier, drive

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ["gpu-001", "gpu-002"]  # Slurm's nodes
INFERENCE = ["gpu-003", "gpu-004"]  # Kubernetes' alone
FAILED, SPARE = "gpu-003", "gpu-005"
NAMESPACE = "fleetwatch"
USER_JOB = {
    "apiVersion": "batch/v1", "kind": "Job",
    "metadata": {"name": "user-warmup", "namespace": "inference"},
    "spec": {"backoffLimit": 0, "template": {"spec": {
        "restartPolicy": "Never",
        "nodeSelector": {"kubernetes.io/hostname": SPARE},
        "containers": [{"name": "warmup", "image": "busybox",
                        "command": ["sh", "-c", "echo warmed up"]}]}}},
}


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory,
            slurm_install: SlurmInstall) -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed here (missing {', '.join(missing)})")
    root = tmp_path_factory.mktemp("slurm-gate-k8s")
    with SlurmCluster(root, TRAINING, {"leaf-a": TRAINING}, kill_wait=2,
                      install=slurm_install) as running:
        (root / "gpu-state").mkdir()
        yield running


@pytest.fixture
def k8s(tmp_path: Path) -> Iterator[Any]:
    daemon = [{"namespace": "kube-system", "name": f"dcgm-exporter-{n}", "node": n,
               "labels": {"app": "dcgm-exporter"},
               "owner": {"kind": "DaemonSet", "name": "dcgm-exporter"}}
              for n in TRAINING + INFERENCE]
    seed = {
        "nodes": [*({"name": n, "labels": {"fleetwatch.io/pool": "training"}} for n in TRAINING),
                  *({"name": n, "labels": {"fleetwatch.io/pool": "inference"}}
                    for n in INFERENCE)],
        "pods": [{"namespace": "inference", "name": "llm-0", "node": FAILED,
                  "labels": {"app": "llm"}, "owner": {"kind": "ReplicaSet", "name": "llm-7f9"}},
                 *daemon],
    }
    server = _server_module().K8sTestServer(
        seed, bookmark_interval=0.3, kubeconfig_path=tmp_path / "kubeconfig.yaml",
        pools={"inference": {"spares": [SPARE], "delay": 0.5, "ready_delay": 0.5}},
        run_pods=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def node_json(k8s: Any, name: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(kubectl(k8s, "get", "node", name, "-o", "json").stdout)
    return found


def job_json(k8s: Any, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(
        kubectl(k8s, "get", "job", "-n", namespace, name, "-o", "json").stdout)
    return found


def conditions(job: dict[str, Any]) -> set[str]:
    return {c["type"] for c in (job.get("status") or {}).get("conditions") or []
            if c.get("status") == "True"}


@pytest.mark.parametrize("verdict", ["passes", "fails"])
def test_a_kubernetes_pool_replacement_is_checked_by_a_job_before_service(
        cluster: SlurmCluster, k8s: Any, settings: Any, tmp_path: Path, monkeypatch: Any,
        django_capture_on_commit_callbacks: Any, verdict: str) -> None:
    settings.FLEETWATCH_POLICY_MODE = "auto"
    settings.FLEETWATCH_PLAYBOOK_MODES = {}
    settings.FLEETWATCH_STEP_MODES = {}
    settings.FLEETWATCH_KUBERNETES_POOLS = frozenset({"inference"})
    settings.FLEETWATCH_GATE_NAMESPACE = NAMESPACE
    settings.FLEETWATCH_GATE_IMAGE = "localhost/fleetwatch:latest"
    # The stand-in kubelet runs the pod's command on this machine: the checks are here.
    settings.FLEETWATCH_GATE_CHECK_DIR = str(ROOT / "deploy" / "checks")
    settings.FLEETWATCH_GATE_ENV = {"FLEETWATCH_CHECK_STATE": str(cluster.root / "gpu-state"),
                                    "FLEETWATCH_CHECK_SECONDS": "1"}
    settings.FLEETWATCH_GATE_START_MINUTES = 2.0
    (cluster.root / "gpu-state" / f"{SPARE}.json").write_text(json.dumps(GPU_STATE[verdict]))

    slurm = SlurmCli(env=cluster.env, timeout=10, retries=1, backoff=0.2)
    api = KubernetesApi(str(k8s.kubeconfig_path), timeout=5.0, evict_max_wait=10.0,
                        evict_backoff=(0.2, 0.5))
    fleet = SimFleet(tmp_path / "gpu-telemetry.json", speed=1.0)
    fleet.seed(nodes=5, spares=0)  # gpu-001..gpu-005 report healthy GPUs
    clients = Clients(slurm=slurm, kubernetes=api, telemetry=SimTelemetry(fleet),
                      provider=CompositeProvider(replace=KubernetesPoolProvider(api),
                                                 reboot=SlurmRebootProvider(slurm)),
                      notifier=RecordingNotifier())
    monkeypatch.setattr(engine, "get_clients", lambda cluster: clients)
    for source in ("slurm", "kubernetes", "telemetry"):
        assert collectors.collect_source(source, clients=clients).healthy

    diagnosis = Diagnosis(root_cause="gpu_hardware", nodes=(FAILED,), confidence=0.95,
                          playbook=FOR_ROOT_CAUSE["gpu_hardware"], jobs=(),
                          explanation=f"XID 79 on {FAILED} GPU 3: fallen off the bus",
                          detected_at=timezone.now())
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(collectors.cluster_default().pk, diagnosis)
    rem = incident.remediations.get()
    seen: dict[str, Any] = {}

    def between() -> None:
        done = {s.kind for s in Step.objects.filter(remediation=rem, status="succeeded")}
        if "replace_node" not in done or "prove_healthy" in done or "held" in seen:
            return
        gate_jobs = json.loads(kubectl(k8s, "get", "jobs", "-n", NAMESPACE, "-o",
                                       "json").stdout)["items"]
        if gate_jobs:
            # The gate at work, as an operator sees it: the spare cordoned and tainted, the
            # check Job pinned to it; a user's Job asking for the spare must wait.
            seen["held"] = (node_json(k8s, SPARE), kubectl(k8s, "get", "node", SPARE,
                                                           "--no-headers").stdout)
            kubectl_create(k8s, USER_JOB)

    try:
        rem = drive(rem, django_capture_on_commit_callbacks, between)
    finally:
        api.close()
    steps = list(rem.steps.order_by("order").values_list("kind", "status", "detail"))

    # Slurm was passed over: it does not know the node, and nothing was asked of it.
    details = {kind: detail for kind, _, detail in steps}
    assert details["drain_and_cancel"] == (
        f"{FAILED} is not a Slurm node (pool inference, which Kubernetes schedules): nothing to "
        "drain in Slurm"), steps
    assert not AuditEntry.objects.filter(remediation=rem, verb__startswith="slurm.").exists()
    assert SPARE not in cluster.run("sinfo", "-h", "-N", "-o", "%N").stdout
    assert k8s.provisioned == [(FAILED, SPARE, "inference")]

    # While checking: held, and the user's Job kept off it.
    assert "held" in seen, steps
    held, table = seen["held"]
    assert held["spec"]["unschedulable"] is True and "SchedulingDisabled" in table
    taint = {"key": K8S_GATE, "value": f"r{rem.pk}-1", "effect": "NoSchedule"}
    assert taint in held["spec"]["taints"]
    gate_run = GateRun.objects.get(remediation=rem)
    assert (gate_run.node, gate_run.repair, gate_run.checks) == (SPARE, "replace",
                                                                 ["fleetwatch-check"])
    job_name = f"fleetwatch-check-r{rem.pk}-1-fleetwatch-check"
    job = job_json(k8s, NAMESPACE, job_name)
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    logs = kubectl(k8s, "logs", "-n", NAMESPACE, f"job/{job_name}").stdout
    assert gate_run.results[0]["output"].strip() == logs.strip()[-4000:].strip()
    assert gate_run.results[0]["output_path"] == f"kubectl logs -n {NAMESPACE} job/{job_name}"
    node = node_json(k8s, SPARE)
    assert taint not in (node["spec"].get("taints") or [])  # released either way
    user = lambda: job_json(k8s, "inference", "user-warmup")  # noqa: E731

    if verdict == "fails":
        assert rem.status == "failed", steps
        assert gate_run.status == "failed"
        step = rem.steps.get(kind="prove_healthy")
        assert f"acceptance check fleetwatch-check failed on {SPARE}: GPU 5" in step.error
        assert conditions(job) >= {"Failed"}
        assert '"ok": false' in logs
        # Never in service: cordoned, FleetWatch's cordon, the verdict as its reason.
        assert node["spec"]["unschedulable"] is True
        annotations = node["metadata"]["annotations"]
        assert annotations[K8S_CORDONED_BY] == "fleetwatch"
        assert annotations[K8S_CORDON_REASON].startswith(
            f"fleetwatch: acceptance check fleetwatch-check failed on {SPARE}")
        assert "SchedulingDisabled" in kubectl(k8s, "get", "node", SPARE, "--no-headers").stdout
        assert rem.steps.get(kind="resume").status == "pending"
        assert "Complete" not in conditions(user())
        pods = kubectl(k8s, "get", "pods", "-n", "inference", "-l", "job-name=user-warmup",
                       "--no-headers").stdout
        assert "Pending" in pods, pods
    else:
        assert rem.status == "succeeded", steps
        assert gate_run.status == "passed" and gate_run.results[0]["result"]["gpus"] == 8
        assert conditions(job) >= {"Complete"}
        assert not node["spec"].get("unschedulable")
        assert K8S_CORDONED_BY not in node["metadata"].get("annotations", {})
        assert details["resume"] == (f"{SPARE} is not a Slurm node (pool inference, which "
                                     f"Kubernetes schedules): {SPARE} in service in Kubernetes")
        # In service: the user's Job that waited for the spare runs there now.
        wait_for(lambda: "Complete" in conditions(user()), 30, "the user's Job to run")
    # Every outside call, in order, audited once: the failed node cordoned and its pod
    # evicted, replaced; the spare held (taint, cordon), checked, then released.
    verbs = [v for v in AuditEntry.objects.filter(remediation=rem).order_by("id")
             .values_list("verb", flat=True) if v.startswith(("k8s.", "provider.", "slurm."))]
    release = (["k8s.uncordon", "k8s.relabel"] if verdict == "passes"
               else ["k8s.relabel", "k8s.relabel"])  # the verdict as its reason, the taint off
    assert verbs == ["k8s.cordon", "k8s.evict", "provider.replace", "k8s.relabel", "k8s.cordon",
                     "k8s.submit_check", *release], verbs
    assert audit_verify().ok


def kubectl_create(k8s: Any, manifest: dict[str, Any]) -> None:
    cache = Path(k8s.kubeconfig_path).parent / "kube-cache"
    done = subprocess.run([KUBECTL, "--kubeconfig", str(k8s.kubeconfig_path), "--cache-dir",
                           str(cache), "create", "-f", "-"], input=json.dumps(manifest),
                          capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cache)})
    assert done.returncode == 0, done.stderr


# --- the gate alone, through the real client, on the paths where it cannot run -----------------


@pytest.fixture
def bare_k8s(tmp_path: Path) -> Iterator[Any]:
    seed = {"nodes": [{"name": n, "labels": {"fleetwatch.io/pool": "inference"}}
                      for n in ("gpu-a", "gpu-b")]}
    server = _server_module().K8sTestServer(seed, kubeconfig_path=tmp_path / "kubeconfig.yaml",
                                            run_pods=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def poll_until_final(api: KubernetesApi, plan: gate.GatePlan, state: dict[str, Any],
                     timeout: float = 60.0) -> gate.Progress:
    made: list[str] = []

    def call(verb: str, target: str, fn: Any, *args: Any) -> Any:
        made.append(verb)
        return fn(*args)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        progress = gate_poll_kubernetes(api, plan, state, call, time.time())
        if progress.final:
            state["made"] = made
            return progress
        time.sleep(0.1)
    raise AssertionError(progress)


def bare_plan(node: str, command: str, **overrides: Any) -> gate.GatePlan:
    values: dict[str, Any] = {
        "key": "t1", "node": node, "repair": "manual", "start_seconds": 30.0,
        "checks": (gate.PlannedCheck("site-check", command, 2),),
        "scheduler": gate.KUBERNETES, "namespace": NAMESPACE, "image": "img:1"}
    return gate.GatePlan(**(values | overrides))


def test_a_check_missing_from_the_image_cannot_run_and_the_node_stays_held(
        bare_k8s: Any) -> None:
    api = KubernetesApi(str(bare_k8s.kubeconfig_path), timeout=5.0)
    state: dict[str, Any] = {}
    progress = poll_until_final(api, bare_plan("gpu-a", "/opt/nowhere/check"), state)
    assert progress.status == gate.CANNOT_RUN, progress
    assert "exit 127: the check program is missing or not executable" in progress.detail
    node = node_json(bare_k8s, "gpu-a")
    assert node["spec"]["unschedulable"] is True
    assert "could not run on gpu-a" in node["metadata"]["annotations"][K8S_CORDON_REASON]
    api.close()


def test_a_check_that_never_starts_is_deleted_and_the_node_stays_held(bare_k8s: Any) -> None:
    # Someone's NoExecute taint: the check does not tolerate it (a node going away must not
    # run a check), so its pod stays Pending with the scheduler's reason.
    kubectl(bare_k8s, "taint", "node", "gpu-b", "maintenance=now:NoExecute")
    api = KubernetesApi(str(bare_k8s.kubeconfig_path), timeout=5.0)
    state: dict[str, Any] = {}
    plan = bare_plan("gpu-b", "true", start_seconds=3.0)
    progress = poll_until_final(api, plan, state)
    assert progress.status == gate.CANNOT_RUN, progress
    assert "did not start in" in progress.detail and "untolerated taint" in progress.detail
    assert "k8s.cancel_check" in state["made"]
    listed = kubectl(bare_k8s, "get", "jobs", "-n", NAMESPACE, "-o", "name").stdout
    assert listed.strip() == ""  # deleted: it will not start later, unguarded
    pods = kubectl(bare_k8s, "get", "pods", "-n", NAMESPACE, "-o", "name").stdout
    assert pods.strip() == ""
    assert node_json(bare_k8s, "gpu-b")["spec"]["unschedulable"] is True
    api.close()


def test_the_api_server_down_mid_gate_holds_the_node_and_says_so(bare_k8s: Any) -> None:
    api = KubernetesApi(str(bare_k8s.kubeconfig_path), timeout=2.0)
    state: dict[str, Any] = {}
    plan = bare_plan("gpu-a", "sleep 30", start_seconds=4.0)
    made: list[str] = []

    def call(verb: str, target: str, fn: Any, *args: Any) -> Any:
        made.append(verb)
        return fn(*args)

    wait_for(lambda: gate_poll_kubernetes(api, plan, state, call, time.time()).detail.startswith(
        "check site-check running on gpu-a"), 30, "the check to run")
    bare_k8s.stop()
    progress = gate_poll_kubernetes(api, plan, state, call, time.time())
    assert progress.status == gate.RUNNING
    assert progress.detail.startswith("Kubernetes did not answer (")
    assert "gpu-a held cordoned and tainted fleetwatch.io/gate" in progress.detail
    time.sleep(4.5)
    progress = gate_poll_kubernetes(api, plan, state, call, time.time())
    assert progress.status == gate.CANNOT_RUN and "Kubernetes did not answer for" in progress.detail
    assert "not cleaned up yet: gpu-a held cordoned and tainted" in progress.detail
    api.close()
