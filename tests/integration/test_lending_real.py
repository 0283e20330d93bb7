"""Lending on real parts: real Slurm (22.05 and 25.11: tests/harness/slurm_cluster.py) and the
Kubernetes test server (tests/harness/k8s_server.py), through the real clients (SlurmCli,
KubernetesApi). What FleetWatch did is read back with the real tools: ``scontrol show node``
and ``kubectl get node``; the test server's request log counts the eviction requests.

A node is lent (Slurm shows it drained with FleetWatch's reason, Kubernetes shows it
schedulable with the labels and the taint), an inference Deployment's pod lands on it, and it
is returned: cordoned, the pod evicted under a PodDisruptionBudget that first says no (the
loan waits and says so), labels and taint taken off, cordoned again as it was before, resumed
in Slurm. Every outside call is in the audit trail once. An administrator's drain or cordon is
never lent. Then the same under Slinky's layout: the node's slurmd pod scaled away and back.

The loan's steps run in this process (no broker), each round as a worker's would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors import services as collectors
from collectors.clients import Clients, slurm_node_names
from collectors.clients.base import K8S_CORDONED_BY, K8S_LENT
from collectors.clients.kubernetes import KubernetesApi
from collectors.clients.naming import SlurmNames
from collectors.clients.providers import SlurmRebootProvider
from collectors.clients.slurm import SlurmCli
from collectors.knowledge.slurm import SLINKY_POD_NAME_LABEL
from collectors.sim.fleet import SimFleet, SimTelemetry
from incidents.audit import audit_verify
from incidents.lending import selectors, services
from incidents.lending.services import LendRefused
from incidents.models import AuditEntry, Loan
from tests.conftest import wait_for
from tests.harness.slurm_cluster import SlurmCluster, SlurmInstall, missing_binaries, scontrol_fields
from tests.integration.test_kubernetes import _server_module, kubectl
from tests.integration.test_playbook_real import RecordingNotifier
from tests.integration.test_slinky import MACHINE, SLURM, slurmd_pod
from tests.integration.test_slurmrestd import rest_client

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

NODES = ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]
LENT = "gpu-004"
TAINT = ("fleetwatch.io/inference", "true", "NoSchedule")
# What FleetWatch's own cordon of a training node looks like (a loan restores it on return).
FLEETWATCH_CORDON = {K8S_CORDONED_BY: "fleetwatch",
                     "fleetwatch.io/cordon-reason": "fleetwatch: training node"}


def _pod(name: str, node: str, **extra: Any) -> dict[str, Any]:
    return {"namespace": "inference", "name": name, "node": node, "labels": {"app": "llm"},
            "owner": {"kind": "ReplicaSet", "name": "llm-7f9"}, **extra}


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory,
            slurm_install: SlurmInstall) -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed here (missing {', '.join(missing)})")
    root = tmp_path_factory.mktemp("slurm-lend")
    with SlurmCluster(root, NODES, {"leaf-a": NODES}, kill_wait=2,
                      install=slurm_install) as running:
        yield running


@pytest.fixture
def k8s(tmp_path: Path) -> Iterator[Any]:
    seed = {
        "nodes": [{"name": n, "labels": {"fleetwatch.io/pool": "gpu"},
                   **({"unschedulable": True, "annotations": FLEETWATCH_CORDON}
                      if n == LENT else {})} for n in NODES],
        "pods": [{"namespace": "kube-system", "name": f"dcgm-exporter-{n}", "node": n,
                  "labels": {"app": "dcgm-exporter"},
                  "owner": {"kind": "DaemonSet", "name": "dcgm-exporter"}} for n in NODES],
        # The inference service: two replicas must stay up.
        "poddisruptionbudgets": [{"namespace": "inference", "name": "llm",
                                  "selector": {"app": "llm"}, "minAvailable": 2}],
    }
    server = _server_module().K8sTestServer(seed, bookmark_interval=0.3,
                                            kubeconfig_path=tmp_path / "kubeconfig.yaml")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def lending_settings(settings: Any) -> None:
    settings.FLEETWATCH_LEND_FLOOR = {"*": "2"}
    settings.FLEETWATCH_LEND_CEILING = {"*": "2"}
    settings.FLEETWATCH_LEND_LABELS = {"fleetwatch.io/lent-to": "inference"}
    settings.FLEETWATCH_LEND_TAINTS = [TAINT]
    settings.FLEETWATCH_LEND_EVICT_RETRY_SECONDS = 1.0


def drive(loan: Loan, timeout: float = 90.0, until: tuple[str, ...] = ()) -> Loan:
    """Run the loan's steps until it stops running (or reaches a status in ``until``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        services.loan_run(loan.pk)
        loan.refresh_from_db()
        if loan.status not in Loan.RUNNING or loan.status in until:
            return loan
        time.sleep(0.2)
    return loan


def node_json(k8s: Any, name: str) -> dict[str, Any]:
    return json.loads(kubectl(k8s, "get", "node", name, "-o", "json").stdout)


def calls(loan: Loan, verb: str, ok: bool | None = None) -> list[AuditEntry]:
    rows = AuditEntry.objects.filter(data__loan=loan.pk, verb=verb)
    return list(rows if ok is None else rows.filter(ok=ok))


def evictions(k8s: Any, pod: str) -> int:
    return sum(1 for method, path, _ in list(k8s.requests)
               if method == "POST" and path.endswith(f"/pods/{pod}/eviction"))


def test_lend_and_return_on_real_slurm_and_kubernetes(
        cluster: SlurmCluster, k8s: Any, settings: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    lending_settings(settings)
    slurm = SlurmCli(env=cluster.env, timeout=10, retries=1, backoff=0.2)
    # One eviction request per call (no retries inside it): the loan's own polls retry, so
    # each POST the server sees is one audited call.
    api = KubernetesApi(str(k8s.kubeconfig_path), timeout=5.0, evict_max_wait=0.0)
    fleet = SimFleet(tmp_path / "gpu-telemetry.json", speed=1.0)
    fleet.seed(nodes=len(NODES), spares=0)
    clients = Clients(slurm, api, SimTelemetry(fleet), SlurmRebootProvider(slurm),
                      RecordingNotifier())
    monkeypatch.setattr(services, "get_clients", lambda name: clients)
    for source in ("slurm", "kubernetes", "telemetry"):
        assert collectors.collect_source(source, clients=clients).healthy

    # An administrator's drain and cordon are theirs: never lent.
    cluster.run("scontrol", "update", "nodename=gpu-001", "state=DRAIN", "reason=admin: fan",
                check=True)
    kubectl(k8s, "cordon", "gpu-002")
    collectors.collect_source("slurm", clients=clients)
    collectors.collect_source("kubernetes", clients=clients)
    with pytest.raises(LendRefused, match="drained by an administrator"):
        services.loan_lend(None, "gpu-001", actor="user:olivia")
    with pytest.raises(LendRefused, match="cordoned in Kubernetes by someone else"):
        services.loan_lend(None, "gpu-002", actor="user:olivia")
    assert "DRAIN" in scontrol_fields(cluster.run("scontrol", "show", "node", "gpu-001").stdout)[
        "State"]

    # --- lend ---
    loan = drive(services.loan_lend(None, LENT, actor="user:olivia", reason="night inference"))
    assert loan.status == Loan.Status.LENT, loan.detail
    shown = scontrol_fields(cluster.run("scontrol", "show", "node", LENT, check=True).stdout)
    assert "DRAIN" in shown["State"]
    assert shown["Reason"].startswith(f"fleetwatch: lent to inference (loan {loan.pk})")
    node = node_json(k8s, LENT)
    assert not node["spec"].get("unschedulable")  # FleetWatch's own cordon lifted
    assert node["metadata"]["labels"]["fleetwatch.io/lent-to"] == "inference"
    assert {"key": TAINT[0], "value": TAINT[1], "effect": TAINT[2]} in node["spec"]["taints"]
    assert node["metadata"]["annotations"][K8S_LENT] == f"loan {loan.pk}"
    assert K8S_CORDONED_BY not in node["metadata"]["annotations"]
    table = kubectl(k8s, "get", "node", LENT, "--no-headers").stdout
    assert "SchedulingDisabled" not in table

    # Training wants four whole nodes: two are free (gpu-001 is the administrator's, gpu-004
    # lent), so it waits; its GPUs are Slurm's pending demand, as the capacity page reads it.
    waiting = cluster.run("sbatch", "--parsable", "-N", "4", "--gres=gpu:8", "-o", "/dev/null",
                          "--wrap", "sleep 60", check=True).stdout.strip()
    wait_for(lambda: scontrol_fields(cluster.run("scontrol", "show", "job", waiting).stdout)
             .get("JobState") == "PENDING", 30, "the job to wait")
    collectors.collect_source("slurm", clients=clients)
    demand = selectors.pending_demand(collectors.cluster_default())
    assert (demand.known, demand.jobs, demand.gpus) == (True, 1, 32)
    cluster.run("scancel", waiting, check=True)

    # Inference schedules there (its pod tolerates the taint); a second replica elsewhere.
    k8s.add_pod(_pod("llm-0", LENT))
    k8s.add_pod(_pod("llm-1", "gpu-003"))

    # --- return: the PDB says no first ---
    services.loan_return(loan.pk, actor="user:olivia", reason="the morning's training")
    loan = drive(Loan.objects.get(pk=loan.pk), timeout=20,
                 until=(Loan.Status.RETURNED, Loan.Status.FAILED))
    # Still returning: it waits on the budget, and says so.
    loan.refresh_from_db()
    assert loan.status == Loan.Status.RETURNING and loan.step == "return_evict"
    assert "eviction of inference/llm-0 blocked by its PodDisruptionBudget" in loan.detail
    assert "The disruption budget llm needs 2 healthy pods" in loan.detail
    assert k8s.get("pods", "inference", "llm-0") is not None
    assert "SchedulingDisabled" in kubectl(k8s, "get", "node", LENT, "--no-headers").stdout
    # A third replica comes up elsewhere: the budget allows one out.
    k8s.add_pod(_pod("llm-2", "gpu-003", ready=False))
    k8s.set_pod_ready("inference", "llm-2", True)
    loan = drive(loan)
    assert loan.status == Loan.Status.RETURNED, loan.detail
    assert k8s.get("pods", "inference", "llm-0") is None
    assert k8s.get("pods", "kube-system", f"dcgm-exporter-{LENT}") is not None  # DaemonSet
    shown = scontrol_fields(cluster.run("scontrol", "show", "node", LENT, check=True).stdout)
    assert "DRAIN" not in shown["State"] and shown["State"].startswith("IDLE")
    node = node_json(k8s, LENT)
    assert "fleetwatch.io/lent-to" not in node["metadata"]["labels"]
    assert not node["spec"].get("taints")
    assert K8S_LENT not in node["metadata"]["annotations"]
    # Cordoned by FleetWatch again, as before the loan.
    assert node["spec"].get("unschedulable") is True
    assert node["metadata"]["annotations"][K8S_CORDONED_BY] == "fleetwatch"

    # Every outside call audited once; each eviction request the server saw is one entry.
    for verb in ("slurm.drain", "k8s.relabel", "k8s.uncordon", "k8s.cordon", "k8s.unlabel",
                 "slurm.resume"):
        assert len(calls(loan, verb)) == 1, verb
    blocked, done = calls(loan, "k8s.evict", ok=False), calls(loan, "k8s.evict", ok=True)
    assert len(done) == 1 and len(blocked) >= 1
    assert all("PodDisruptionBudget" in e.result for e in blocked)
    assert evictions(k8s, "llm-0") == len(blocked) + len(done)
    assert done[0].call.startswith("POST /api/v1/namespaces/inference/pods/llm-0/eviction")
    assert calls(loan, "slurm.drain")[0].call.startswith(f"scontrol update nodename={LENT}")
    assert audit_verify().ok


@pytest.fixture
def slinky(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """Slurm 25.11 whose nodes are slurmd pods of a NodeSet, which selects its nodes by the
    label ``slinky.slurm.net/nodeset``."""
    root = tmp_path_factory.mktemp("slinky-lend")
    seed = {"nodes": [{"name": n, "labels": {"fleetwatch.io/pool": "gpu",
                                             "slinky.slurm.net/nodeset": "gpu"}}
                      for n in sorted(MACHINE.values())],
            "pods": [slurmd_pod(s, m) for s, m in MACHINE.items()]}
    server = _server_module().K8sTestServer(seed, kubeconfig_path=tmp_path / "kubeconfig.yaml",
                                            bookmark_interval=0.3)
    server.start()
    try:
        with SlurmCluster(root, SLURM, {"leaf-a": SLURM}, kill_wait=2,
                          release="25.11") as running:
            yield running, server
    finally:
        server.stop()


def test_lend_and_return_under_slinky(slinky: tuple[Any, Any], settings: Any, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cluster, k8s = slinky
    lending_settings(settings)
    # The NodeSet's label comes off while the node is lent (slurm-operator then keeps its
    # slurmd pod away), and back on return.
    settings.FLEETWATCH_LEND_REMOVE_LABELS = ["slinky.slurm.net/nodeset"]
    api = KubernetesApi(str(k8s.kubeconfig_path), timeout=5.0, evict_max_wait=0.0)
    slurm = SlurmNames(rest_client(cluster), slurm_node_names)
    fleet = SimFleet(tmp_path / "telemetry.json", 1.0)
    fleet.seed(nodes=4, spares=0)
    clients = Clients(slurm, api, SimTelemetry(fleet), SlurmRebootProvider(slurm),
                      RecordingNotifier())
    monkeypatch.setattr(services, "get_clients", lambda name: clients)
    collectors.collect_source("kubernetes", clients=clients)
    collectors.collect_source("slurm", clients=clients)
    machine = MACHINE["slinky-2"]  # gpu-node-d

    loan = drive(services.loan_lend(None, machine, actor="user:olivia"))
    assert loan.status == Loan.Status.LENT, loan.detail
    assert loan.state["slurmd_pod"] == "slurm/slinky-2"
    # Slurm's name for it drained with FleetWatch's reason; its slurmd pod scaled away.
    shown = scontrol_fields(cluster.run("scontrol", "show", "node", "slinky-2").stdout)
    assert "DRAIN" in shown["State"] and shown["Reason"].startswith("fleetwatch: lent to")
    pods = json.loads(kubectl(k8s, "get", "pods", "-A", "-l", SLINKY_POD_NAME_LABEL, "-o",
                              "json").stdout)["items"]
    assert machine not in {p["spec"]["nodeName"] for p in pods}
    labels = node_json(k8s, machine)["metadata"]["labels"]
    assert "slinky.slurm.net/nodeset" not in labels
    assert labels["fleetwatch.io/lent-to"] == "inference"

    services.loan_return(loan.pk, actor="user:olivia")
    loan = drive(Loan.objects.get(pk=loan.pk), timeout=10,
                 until=(Loan.Status.RETURNED, Loan.Status.FAILED))
    loan.refresh_from_db()
    # The label is back; the return waits for the operator to place the slurmd pod again.
    assert loan.step == "return_slurmd_back" and "slurm-operator" in loan.detail
    assert node_json(k8s, machine)["metadata"]["labels"]["slinky.slurm.net/nodeset"] == "gpu"
    k8s.add_pod(slurmd_pod("slinky-2", machine))  # the NodeSet controller, played here
    loan = drive(loan)
    assert loan.status == Loan.Status.RETURNED, loan.detail
    shown = scontrol_fields(cluster.run("scontrol", "show", "node", "slinky-2").stdout)
    assert "DRAIN" not in shown["State"]
    assert len(calls(loan, "k8s.evict")) == 1  # the slurmd pod, once (its NodeSet had no PDB)
    assert len(calls(loan, "slurm.resume")) == 1
