"""Node providers against real systems: Slurm's reboot on the real Slurm test cluster
(tests/harness/slurm_cluster.py), and node-pool replacement on the Kubernetes test server with
its node-pool stand-in, checked with the real ``scontrol`` and ``kubectl`` too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors.clients.base import ClientError
from collectors.clients.kubernetes import KubernetesApi
from collectors.clients.providers import (
    RECORD_REASON,
    REPLACES_ANNOTATION,
    CompositeProvider,
    KubernetesPoolProvider,
    ProviderReplacement,
    SlurmRebootProvider,
)
from collectors.clients.slurm import SlurmCli
from tests.conftest import wait_for
from tests.harness.slurm_cluster import SlurmCluster, SlurmInstall, missing_binaries
from tests.integration.test_kubernetes import _server_module, kubectl

pytestmark = pytest.mark.integration

NODES = ["gpu-001", "gpu-002"]


# --- Slurm ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            slurm_install: SlurmInstall) -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed here (missing {', '.join(missing)}): "
                    "`apt-get install -y slurm-wlm munge`, as `make test`'s bootstrap does")
    with SlurmCluster(tmp_path_factory.mktemp("slurm-prov"), NODES, {"leaf-a": NODES},
                      install=slurm_install) as running:
        yield running


@pytest.fixture
def slurm_provider(cluster: SlurmCluster) -> SlurmRebootProvider:
    return SlurmRebootProvider(SlurmCli(env=cluster.env, timeout=10, retries=1, backoff=0.2))


def scontrol_node(cluster: SlurmCluster, node: str) -> str:
    return cluster.run("scontrol", "show", "node", node, check=True).stdout


def test_slurm_reboot_asap_then_ready(cluster: SlurmCluster,
                                      slurm_provider: SlurmRebootProvider) -> None:
    assert slurm_provider.status("gpu-002").state == "ready"
    result = slurm_provider.reboot("gpu-002", "incident 21 nvlink: reboot first")
    assert result.changed
    assert result.call == ("scontrol reboot ASAP nextstate=RESUME "
                           "'reason=fleetwatch: incident 21 nvlink: reboot first' gpu-002")
    assert result.data["state_before"] == "IDLE"
    shown = scontrol_node(cluster, "gpu-002")
    assert "Reason=fleetwatch: incident 21 nvlink: reboot first" in shown
    assert "REBOOT_REQUESTED" in shown or "REBOOT_ISSUED" in shown
    assert slurm_provider.status("gpu-002").state == "rebooting"
    # Asked again (a retried step): no second reboot.
    assert not slurm_provider.reboot("gpu-002", "incident 21 nvlink: reboot first").changed

    wait_for(lambda: "gpu-002" in cluster.reboot_requests(), 90, "RebootProgram on gpu-002")
    assert cluster.reboot_requests() == ["gpu-002"]  # only the node asked for
    cluster.complete_reboot("gpu-002")
    cluster.wait_for_nodes("IDLE", nodes=["gpu-002"], timeout=90)  # generous: a loaded CI host
    status = wait_for(lambda: (s := slurm_provider.status("gpu-002")).state == "ready" and s,
                      90, "the provider to call gpu-002 ready")
    assert status.detail == "IDLE"
    if cluster.install.release == "22.05":
        assert "Reason=" not in scontrol_node(cluster, "gpu-002")
    else:
        # 25.11 keeps the reason after the reboot's RESUME; FleetWatch reads it as history
        # (the detail above has none), not as why the node is out.
        assert "Reason=fleetwatch: incident 21" in scontrol_node(cluster, "gpu-002")


def test_slurm_reboot_leaves_an_administrators_drain_alone(
        cluster: SlurmCluster, slurm_provider: SlurmRebootProvider) -> None:
    cluster.run("scontrol", "update", "nodename=gpu-001", "state=DRAIN",
                "reason=admin: DIMM swap", check=True)
    try:
        with pytest.raises(ClientError, match="drained or marked down by someone else") as err:
            slurm_provider.reboot("gpu-001", "incident 22 gpu_memory")
        assert err.value.permanent
        assert "REBOOT" not in scontrol_node(cluster, "gpu-001")
        assert slurm_provider.status("gpu-001").detail == "IDLE+DRAIN: admin: DIMM swap"
    finally:
        cluster.run("scontrol", "update", "nodename=gpu-001", "state=RESUME", check=True)


def test_slurm_cannot_replace_or_reset(slurm_provider: SlurmRebootProvider) -> None:
    for action in (lambda: slurm_provider.replace("gpu-001"),
                   lambda: slurm_provider.reset_gpu("gpu-001", 3),
                   lambda: slurm_provider.status("gpu-999")):
        with pytest.raises(ClientError) as err:
            action()
        assert err.value.permanent


# --- Kubernetes node pools ----------------------------------------------------------------------

POOL_SEED: dict[str, Any] = {
    "nodes": [
        *({"name": f"gpu-00{i}", "labels": {"fleetwatch.io/pool": "gpu"}} for i in range(1, 5)),
        {"name": "cpu-001", "labels": {"fleetwatch.io/pool": "cpu"}},
        {"name": "login-001"},
    ],
}


@pytest.fixture
def pool_k8s(tmp_path: Path) -> Iterator[Any]:
    server = _server_module().K8sTestServer(
        POOL_SEED, bookmark_interval=0.3, kubeconfig_path=tmp_path / "kubeconfig.yaml",
        pools={"gpu": {"spares": ["gpu-017", "gpu-018"], "delay": 1.0, "ready_delay": 1.0}})
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pool_api(pool_k8s: Any) -> Iterator[KubernetesApi]:
    client = KubernetesApi(str(pool_k8s.kubeconfig_path), timeout=5.0)
    yield client
    client.close()


def node_deletes(k8s: Any, node: str) -> int:
    return sum(1 for method, path, _ in list(k8s.requests)
               if method == "DELETE" and path.split("?")[0] == f"/api/v1/nodes/{node}")


def test_node_pool_replaces_a_deleted_node(pool_k8s: Any, pool_api: KubernetesApi) -> None:
    provider = KubernetesPoolProvider(pool_api)
    assert provider.replacement_status("gpu-003") is None
    first = provider.replace("gpu-003")
    assert isinstance(first, ProviderReplacement)
    assert (first.new_node, first.ready, first.call) == ("", False, "kubectl delete node gpu-003")
    assert first.data["pool_label"] == "fleetwatch.io/pool" and first.data["pool"] == "gpu"
    assert first.data["members"] == ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]
    assert "gpu-003" not in kubectl(pool_k8s, "get", "nodes", "-o", "name").stdout

    again = provider.replace("gpu-003")  # a retried step: reports progress, deletes nothing
    assert again.data["members"] == first.data["members"] and not again.ready
    assert node_deletes(pool_k8s, "gpu-003") == 1

    # What a worker that never saw replace() knows: only the data the step persisted.
    other = KubernetesPoolProvider(pool_api)
    data = dict(first.data)
    status = other.replacement_status("gpu-003", data)
    assert status is not None and not status.ready
    wait_for(lambda: pool_k8s.get("nodes", "", "gpu-017"), 10, "gpu-017 to join the pool")
    joined = other.replacement_status("gpu-003", data)
    assert joined is not None and not joined.ready and "gpu-017" in joined.detail  # NotReady
    done = wait_for(lambda: (s := other.replacement_status("gpu-003", data)) and s.ready and s,
                    15, "gpu-017 to be Ready")
    assert (done.old_node, done.new_node) == ("gpu-003", "gpu-017")

    # Seen with the real kubectl: a new Ready node in the same pool, claimed for gpu-003.
    listed = kubectl(pool_k8s, "get", "nodes", "-l", "fleetwatch.io/pool=gpu",
                     "--no-headers").stdout
    rows = {line.split()[0]: line.split()[1] for line in listed.splitlines()}
    assert rows == {"gpu-001": "Ready", "gpu-002": "Ready", "gpu-004": "Ready",
                    "gpu-017": "Ready"}
    node = json.loads(kubectl(pool_k8s, "get", "node", "gpu-017", "-o", "json").stdout)
    assert node["metadata"]["annotations"][REPLACES_ANNOTATION] == "gpu-003"
    # The record, for operators and for a worker with no data at all.
    events = kubectl(pool_k8s, "get", "events", "--field-selector",
                     f"reason={RECORD_REASON}", "--no-headers").stdout
    assert "FleetWatch deleted node gpu-003" in events
    fresh = KubernetesPoolProvider(pool_api).replacement_status("gpu-003")
    assert fresh is not None and (fresh.new_node, fresh.ready) == ("gpu-017", True)
    assert provider.status("gpu-003").state == "replaced"
    assert provider.status("gpu-017").state == "ready"
    assert pool_k8s.provisioned == [("gpu-003", "gpu-017", "gpu")]


def test_two_replacements_in_one_pool_take_different_newcomers(
        pool_k8s: Any, pool_api: KubernetesApi) -> None:
    provider = KubernetesPoolProvider(pool_api)
    a = provider.replace("gpu-001")
    b = provider.replace("gpu-002")
    assert isinstance(a, ProviderReplacement) and isinstance(b, ProviderReplacement)
    assert "gpu-001" not in b.data["members"]  # gone already when gpu-002 was recorded

    def both() -> tuple[str, str] | None:
        ra = provider.replacement_status("gpu-001", a.data)
        rb = provider.replacement_status("gpu-002", b.data)
        return (ra.new_node, rb.new_node) if ra and rb and ra.ready and rb.ready else None

    assert sorted(wait_for(both, 15, "both replacements Ready")) == ["gpu-017", "gpu-018"]
    assert both() == both()  # claims are stable across polls


def test_pool_provider_refusals(pool_k8s: Any, pool_api: KubernetesApi) -> None:
    provider = KubernetesPoolProvider(pool_api)
    for action in (lambda: provider.replace("login-001"),  # no pool label
                   lambda: provider.replace("gpu-404"),  # no such node, no record
                   lambda: provider.reboot("gpu-001", "fleetwatch: x"),
                   lambda: provider.reset_gpu("gpu-001", 0)):
        with pytest.raises(ClientError) as err:
            action()
        assert err.value.permanent
    assert node_deletes(pool_k8s, "login-001") == 0
    pool_k8s.set_node_ready("gpu-004", False, "KubeletNotReady")
    assert provider.status("gpu-004").state == "failed"
    assert provider.status("gpu-404").state == "unknown"


def test_an_old_node_registering_again_is_not_its_replacement(
        tmp_path: Path) -> None:
    # A pool with no spares: what a managed instance group looks like when only the Node
    # object was deleted and the VM's kubelet registers it again.
    server = _server_module().K8sTestServer(
        POOL_SEED, kubeconfig_path=tmp_path / "kubeconfig.yaml", pools={"gpu": {"spares": []}})
    server.start()
    api = KubernetesApi(str(server.kubeconfig_path), timeout=5.0)
    try:
        provider = KubernetesPoolProvider(api)
        first = provider.replace("gpu-004")
        server.create("nodes", _server_module().expand_node(
            {"name": "gpu-004", "labels": {"fleetwatch.io/pool": "gpu"}}))
        status = provider.replacement_status("gpu-004", first.data)  # type: ignore[attr-defined]
        assert status is not None and not status.ready
        assert "registered again under its old name" in status.detail
        again = provider.replace("gpu-004")  # the newcomer has another uid: not deleted again
        assert not again.ready and node_deletes(server, "gpu-004") == 1
    finally:
        api.close()
        server.stop()


def test_composite_reboots_with_slurm_and_replaces_from_the_pool(
        cluster: SlurmCluster, slurm_provider: SlurmRebootProvider, pool_k8s: Any,
        pool_api: KubernetesApi) -> None:
    composite = CompositeProvider(replace=KubernetesPoolProvider(pool_api), reboot=slurm_provider)
    assert composite.replace("gpu-002").call == "kubectl delete node gpu-002"  # type: ignore[attr-defined]
    # Slurm still knows gpu-002 (ready); the pool says it was replaced: the pool wins over ready.
    assert composite.status("gpu-002").state == "replaced"
    with pytest.raises(ClientError, match="no node provider is configured to reset"):
        composite.reset_gpu("gpu-001", 1)
