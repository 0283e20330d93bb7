"""Slurm on Kubernetes as SchedMD's slurm-operator (Slinky) lays it out: every Slurm node is a
slurmd pod whose Slurm name ("slinky-0") is not the machine's ("gpu-node-c"). Real Slurm 25.11
behind slurmrestd, named like the operator's pods; the Kubernetes test server holds those pods
(labels, spec.hostname, spec.nodeName) and the real kubectl reads them as the API server would
serve them. FleetWatch must speak machine names everywhere and Slurm's towards Slurm, and leave
the operator's own drains alone."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse

from collectors import services as collectors
from collectors.clients import Clients, slurm_node_names
from collectors.clients.base import ClientError
from collectors.clients.kubernetes import KubernetesApi
from collectors.clients.naming import SlurmNames, parse_node_map
from collectors.clients.providers import SlurmRebootProvider
from collectors.knowledge.slurm import SLINKY_POD_HOSTNAME_LABEL, SLINKY_POD_NAME_LABEL
from collectors.models import Job, Node
from collectors.sim.fleet import SimFleet, SimTelemetry
from incidents import diagnosing
from incidents.models import Incident
from tests.conftest import wait_for
from tests.harness.slurm_cluster import SlurmCluster, scontrol_fields
from tests.integration.test_kubernetes import _server_module
from tests.integration.test_playbook_real import RecordingNotifier
from tests.integration.test_slurmrestd import rest_client

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

SLURM = ["slinky-0", "slinky-1", "slinky-2", "slinky-3"]
# Where the operator's pods landed: not in name order, so a mix-up shows.
MACHINE = {"slinky-0": "gpu-node-c", "slinky-1": "gpu-node-a", "slinky-2": "gpu-node-d",
           "slinky-3": "gpu-node-b"}


def slurmd_pod(slurm: str, node: str) -> dict[str, Any]:
    """A NodeSet pod as slurm-operator makes it (api/v1beta1 well-known labels)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": "slurm", "name": slurm, "labels": {
            "app.kubernetes.io/name": "slurmd", "app.kubernetes.io/instance": "slinky",
            SLINKY_POD_NAME_LABEL: slurm, "nodeset.slinky.slurm.net/pod-index": slurm[-1],
            SLINKY_POD_HOSTNAME_LABEL: slurm},
            "ownerReferences": [{"apiVersion": "slinky.slurm.net/v1beta1", "kind": "NodeSet",
                                 "name": "slinky", "uid": "nodeset-uid", "controller": True}]},
        "spec": {"nodeName": node, "hostname": slurm, "subdomain": "slurm-workers",
                 "containers": [{"name": "slurmd", "image": "ghcr.io/slinkyproject/slurmd:25.11"}]},
        "status": {"phase": "Running"},
    }


@pytest.fixture
def slinky(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    root = tmp_path_factory.mktemp("slinky")
    seed = {"nodes": [{"name": n, "labels": {"fleetwatch.io/pool": "gpu"}}
                      for n in sorted(MACHINE.values())],
            "pods": [slurmd_pod(s, m) for s, m in MACHINE.items()]}
    server = _server_module().K8sTestServer(seed, kubeconfig_path=tmp_path / "kubeconfig.yaml",
                                            bookmark_interval=0.3)
    server.start()
    try:
        with SlurmCluster(root, SLURM, {"leaf-a": SLURM[:2], "leaf-b": SLURM[2:]}, kill_wait=2,
                          release="25.11") as cluster:
            yield cluster, server
    finally:
        server.stop()


def test_kubectl_sees_the_slurmd_pods_as_the_operator_lays_them_out(
        slinky: tuple[Any, Any]) -> None:
    _, server = slinky
    out = subprocess.run(
        ["kubectl", "--kubeconfig", str(server.kubeconfig_path), "get", "pods", "-A", "-l",
         SLINKY_POD_NAME_LABEL, "-o", "json"], capture_output=True, text=True, timeout=30,
        env={**os.environ, "HOME": str(server.kubeconfig_path.parent)})
    assert out.returncode == 0, out.stderr
    pods = json.loads(out.stdout)["items"]
    assert {p["spec"]["hostname"]: p["spec"]["nodeName"] for p in pods} == MACHINE


def test_slurm_speaks_machine_names_and_acts_on_slurms(
        slinky: tuple[Any, Any], tmp_path: Path, settings: Any, client: Any,
        operator: Any) -> None:
    cluster, server = slinky
    api = KubernetesApi(str(server.kubeconfig_path), timeout=5.0)
    assert api.slurm_nodes() == MACHINE
    slurm = SlurmNames(rest_client(cluster), slurm_node_names)
    fleet = SimFleet(tmp_path / "telemetry.json", 1.0)
    fleet.seed(nodes=4, spares=0)
    clients = Clients(slurm, api, SimTelemetry(fleet), SlurmRebootProvider(slurm),
                      RecordingNotifier())

    # Kubernetes first: the pods say which machine each Slurm node is.
    collectors.collect_source("kubernetes", clients=clients)
    assert dict(Node.objects.exclude(slurm_name="").values_list("slurm_name", "name")) == MACHINE

    job = cluster.run("sbatch", "--parsable", "-w", "slinky-2", "--gres=gpu:2", "-o", "/dev/null",
                      "--wrap", "sleep 300", check=True).stdout.strip()
    wait_for(lambda: scontrol_fields(cluster.run("scontrol", "show", "job", job).stdout)
             ["JobState"] == "RUNNING", 30, "the job to run")
    collectors.collect_source("slurm", clients=clients)
    # One row per machine, under the machine's name: no "slinky-*" rows beside them.
    assert sorted(Node.objects.values_list("name", flat=True)) == sorted(MACHINE.values())
    assert Node.objects.get(name="gpu-node-d").slurm_state == "MIXED"
    stored = Job.objects.get(slurm_id=job)
    assert (stored.nodes, stored.gpus) == (["gpu-node-d"], {"gpu-node-d": [0, 1]})
    assert sorted(slurm.topology()["leaf-b"]) == ["gpu-node-b", "gpu-node-d"]
    # One node read by its machine's name: Slurm's slinky-2, named as the machine.
    one = slurm.node("gpu-node-d")
    assert one.name == "gpu-node-d" and one.state == "MIXED"
    assert one == next(n for n in slurm.nodes() if n.name == "gpu-node-d")

    # A repair of machine gpu-node-d drains Slurm's slinky-2, with FleetWatch's reason.
    assert slurm.drain("gpu-node-d", "incident 9 gpu_hardware").changed
    shown = scontrol_fields(cluster.run("scontrol", "show", "node", "slinky-2").stdout)
    assert "DRAIN" in shown["State"] and shown["Reason"].startswith("fleetwatch: incident 9")
    assert slurm.resume("gpu-node-d").changed

    # The operator drains slinky-1 (its Kubernetes node gpu-node-a was cordoned).
    cluster.run("scontrol", "update", "nodename=slinky-1", "state=DRAIN",
                "reason=slurm-operator: Node is cordoned", check=True)
    collectors.collect_source("slurm", clients=clients)
    node = Node.objects.get(name="gpu-node-a")
    assert node.drained and node.drained_by_operator
    # Not a fault: no incident; and not FleetWatch's to undo.
    assert diagnosing.diagnosis_run(collectors.cluster_default().pk) == []
    assert not Incident.objects.exists()
    with pytest.raises(ClientError, match="drained by someone else"):
        slurm.resume("gpu-node-a")
    # Both names on the pages.
    client.force_login(operator)
    page = client.get(reverse("node-detail", args=["gpu-node-a"])).content.decode()
    assert "slinky-1" in page and "slurm-operator's: it undoes it" in page
    listing = client.get(reverse("node-list")).content.decode()
    assert "Slurm: slinky-2" in listing


def test_a_static_map_names_machines_where_no_pods_say() -> None:
    assert parse_node_map("slinky-0=gpu-node-c, slinky-1=gpu-node-a\nslinky-2=gpu-node-d") == {
        "slinky-0": "gpu-node-c", "slinky-1": "gpu-node-a", "slinky-2": "gpu-node-d"}
    with pytest.raises(ValueError, match="'slinky-3' is not slurmname=machine"):
        parse_node_map("slinky-3")
