"""The Kubernetes test server checked by the real ``kubectl``, and FleetWatch's Kubernetes
client against the same server.

No API server can be installed here, so ``tests/harness/k8s_server.py`` stands in for one;
kubectl (get, cordon, uncordon, drain, get events) is the proof that it behaves like one.
"""

from __future__ import annotations

import importlib
import json
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from collectors.clients.base import (
    K8S_CORDON_REASON,
    K8S_CORDONED_BY,
    ClientError,
    NotFound,
    node_or_none,
)
from collectors.clients.kubernetes import KubernetesApi
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"

pytestmark = pytest.mark.integration


def _server_module() -> ModuleType:
    """The test server's module (tests.harness.k8s_server: one module, one ApiError class)."""
    return importlib.import_module("tests.harness.k8s_server")


SEED: dict[str, Any] = {
    "nodes": [
        {"name": "gpu-001", "labels": {"fleetwatch.io/pool": "gpu"}},
        {"name": "gpu-002", "labels": {"fleetwatch.io/pool": "gpu"}},
        {"name": "gpu-003", "labels": {"fleetwatch.io/pool": "gpu"}, "ready": "False"},
        {"name": "gpu-004", "labels": {"fleetwatch.io/pool": "gpu"}, "ready": "Unknown"},
    ],
    "pods": [
        # A training job spread over gpu-001 and gpu-002, guarded by a PDB that allows one out.
        {"namespace": "train", "name": "trainer-0", "node": "gpu-001",
         "labels": {"app": "trainer"}, "owner": {"kind": "ReplicaSet", "name": "trainer-7d9"},
         "emptyDir": True},
        {"namespace": "train", "name": "trainer-1", "node": "gpu-002",
         "labels": {"app": "trainer"}, "owner": {"kind": "ReplicaSet", "name": "trainer-7d9"}},
        # A single-replica service on gpu-002 whose PDB forbids any eviction.
        {"namespace": "serve", "name": "api-0", "node": "gpu-002", "labels": {"app": "api"},
         "owner": {"kind": "ReplicaSet", "name": "api-5c4"}},
        {"namespace": "kube-system", "name": "dcgm-exporter-a1", "node": "gpu-001",
         "labels": {"app": "dcgm-exporter"}, "owner": {"kind": "DaemonSet",
                                                       "name": "dcgm-exporter"}},
        {"namespace": "kube-system", "name": "dcgm-exporter-b2", "node": "gpu-002",
         "labels": {"app": "dcgm-exporter"}, "owner": {"kind": "DaemonSet",
                                                       "name": "dcgm-exporter"}},
        {"namespace": "kube-system", "name": "kube-proxy-gpu-001", "node": "gpu-001",
         "mirror": True},
    ],
    "poddisruptionbudgets": [
        {"namespace": "train", "name": "trainer", "selector": {"app": "trainer"},
         "maxUnavailable": 1},
        {"namespace": "serve", "name": "api", "selector": {"app": "api"}, "minAvailable": 1},
    ],
}


@pytest.fixture
def k8s(tmp_path: Path) -> Iterator[Any]:
    """A fresh test API server (TLS, bearer token) and its kubeconfig."""
    server = _server_module().K8sTestServer(
        SEED, bookmark_interval=0.3, kubeconfig_path=tmp_path / "kubeconfig.yaml")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def api(k8s: Any) -> Iterator[KubernetesApi]:
    client = KubernetesApi(str(k8s.kubeconfig_path), timeout=5.0, evict_max_wait=2.0,
                           evict_backoff=(0.2, 0.5))
    yield client
    client.close()


def kubectl(k8s: Any, *args: str, check: bool = True, kubeconfig: Path | None = None,
            ) -> subprocess.CompletedProcess[str]:
    cache = Path(k8s.kubeconfig_path).parent / "kube-cache"
    result = subprocess.run(
        [KUBECTL, "--kubeconfig", str(kubeconfig or k8s.kubeconfig_path), "--cache-dir",
         str(cache), *args],
        capture_output=True, text=True, timeout=90, check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cache)})
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result


def pods_on(k8s: Any, node: str) -> set[str]:
    return {f"{ns}/{name}" for (ns, name), p in k8s.objects["pods"].items()
            if p["spec"]["nodeName"] == node}


def evictions(k8s: Any, pod: str) -> int:
    return sum(1 for method, path, _ in list(k8s.requests)
               if method == "POST" and path.endswith(f"/pods/{pod}/eviction"))


# --- kubectl against the test server ---------------------------------------------------------


def test_kubectl_get_nodes_table_and_json(k8s: Any, tmp_path: Path) -> None:
    table = kubectl(k8s, "get", "nodes").stdout.splitlines()
    assert table[0].split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    rows = {line.split()[0]: line.split()[1] for line in table[1:]}
    assert rows == {"gpu-001": "Ready", "gpu-002": "Ready", "gpu-003": "NotReady",
                    "gpu-004": "NotReady"}

    listed = json.loads(kubectl(k8s, "get", "nodes", "-o", "json").stdout)
    assert [n["metadata"]["name"] for n in listed["items"]] == [
        "gpu-001", "gpu-002", "gpu-003", "gpu-004"]
    ready = {n["metadata"]["name"]: next(c["status"] for c in n["status"]["conditions"]
                                         if c["type"] == "Ready") for n in listed["items"]}
    assert ready["gpu-004"] == "Unknown"
    one = json.loads(kubectl(k8s, "get", "node", "gpu-001", "-o", "json").stdout)
    assert one["kind"] == "Node" and one["metadata"]["labels"]["fleetwatch.io/pool"] == "gpu"

    pods = kubectl(k8s, "get", "pods", "-A", "--field-selector", "spec.nodeName=gpu-001",
                   "-o", "name").stdout.split()
    assert sorted(pods) == ["pod/dcgm-exporter-a1", "pod/kube-proxy-gpu-001", "pod/trainer-0"]

    # The token is checked: kubectl with a wrong one is refused.
    wrong = k8s.write_kubeconfig(tmp_path / "wrong.yaml", token="not-the-token")
    refused = kubectl(k8s, "get", "nodes", check=False, kubeconfig=wrong)
    assert refused.returncode != 0
    assert "credentials" in refused.stderr or "Unauthorized" in refused.stderr


def test_kubectl_cordon_and_uncordon(k8s: Any) -> None:
    assert kubectl(k8s, "cordon", "gpu-003").stdout.strip() == "node/gpu-003 cordoned"
    assert k8s.get("nodes", "", "gpu-003")["spec"]["unschedulable"] is True
    # kubectl cordon sends a strategic merge patch of spec.unschedulable, as to a real server.
    assert ("PATCH", "/api/v1/nodes/gpu-003", "application/strategic-merge-patch+json") in \
        list(k8s.requests)
    assert "NotReady,SchedulingDisabled" in kubectl(k8s, "get", "node", "gpu-003").stdout
    assert "already cordoned" in kubectl(k8s, "cordon", "gpu-003").stdout

    assert kubectl(k8s, "uncordon", "gpu-003").stdout.strip() == "node/gpu-003 uncordoned"
    assert not k8s.get("nodes", "", "gpu-003")["spec"].get("unschedulable")


def test_kubectl_label_and_taint(k8s: Any) -> None:
    """kubectl label (a JSON merge patch) and kubectl taint (a strategic merge patch carrying
    the whole taint list: taints are an atomic list, merged by no key), as lending relies on."""
    assert kubectl(k8s, "label", "node", "gpu-001", "team=llm").stdout.strip() == \
        "node/gpu-001 labeled"
    assert kubectl(k8s, "taint", "node", "gpu-001", "gpu=true:NoSchedule").stdout.strip() == \
        "node/gpu-001 tainted"
    kubectl(k8s, "taint", "node", "gpu-001", "spot:NoExecute")
    node = k8s.get("nodes", "", "gpu-001")
    assert node["metadata"]["labels"]["team"] == "llm"
    # kubectl puts the newest first.
    assert node["spec"]["taints"] == [{"key": "spot", "effect": "NoExecute"},
                                      {"key": "gpu", "value": "true", "effect": "NoSchedule"}]
    assert ("PATCH", "/api/v1/nodes/gpu-001?fieldManager=kubectl-taint&fieldValidation=Strict",
            "application/strategic-merge-patch+json") in list(k8s.requests)
    # Removing one taint keeps the other: kubectl sent the list without it.
    kubectl(k8s, "taint", "node", "gpu-001", "gpu:NoSchedule-")
    kubectl(k8s, "label", "node", "gpu-001", "team-")
    node = k8s.get("nodes", "", "gpu-001")
    assert node["spec"]["taints"] == [{"key": "spot", "effect": "NoExecute"}]
    assert "team" not in node["metadata"]["labels"]
    already = kubectl(k8s, "taint", "node", "gpu-001", "spot:NoExecute", check=False)
    assert already.returncode != 0 and "already has spot taint(s)" in already.stderr


def test_kubectl_drain_evicts_all_but_daemonset_and_mirror_pods(k8s: Any) -> None:
    result = kubectl(k8s, "drain", "gpu-001", "--ignore-daemonsets", "--delete-emptydir-data",
                     "--timeout=30s")
    assert "ignoring DaemonSet-managed Pods: kube-system/dcgm-exporter-a1" in result.stderr
    assert "pod/trainer-0 evicted" in result.stdout
    assert "node/gpu-001 drained" in result.stdout
    assert pods_on(k8s, "gpu-001") == {"kube-system/dcgm-exporter-a1",
                                       "kube-system/kube-proxy-gpu-001"}
    assert k8s.get("nodes", "", "gpu-001")["spec"]["unschedulable"] is True
    assert evictions(k8s, "trainer-0") == 1


def test_kubectl_drain_waits_on_a_disruption_budget(k8s: Any) -> None:
    # api-0's PDB allows no disruption: kubectl retries the eviction and gives up at its timeout.
    blocked = kubectl(k8s, "drain", "gpu-002", "--ignore-daemonsets", "--timeout=2s",
                      check=False)
    assert blocked.returncode != 0
    assert "Cannot evict pod as it would violate the pod's disruption budget" in blocked.stderr
    assert "global timeout reached" in blocked.stderr
    assert "serve/api-0" in pods_on(k8s, "gpu-002")
    # The other pod on the node (its own PDB allows one out) went.
    assert "train/trainer-1" not in pods_on(k8s, "gpu-002")

    # A replacement becomes ready elsewhere: the budget allows one out and the retry succeeds.
    before = evictions(k8s, "api-0")

    def replacement_ready() -> None:
        wait_for(lambda: evictions(k8s, "api-0") > before, 30, "kubectl's blocked eviction")
        k8s.add_pod({"namespace": "serve", "name": "api-1", "node": "gpu-003",
                     "labels": {"app": "api"}, "owner": {"kind": "ReplicaSet", "name": "api-5c4"}})

    helper = threading.Thread(target=replacement_ready)
    helper.start()
    drained = kubectl(k8s, "drain", "gpu-002", "--ignore-daemonsets", "--timeout=30s")
    helper.join()
    assert "pod/api-0 evicted" in drained.stdout
    assert pods_on(k8s, "gpu-002") == {"kube-system/dcgm-exporter-b2"}


def test_kubectl_get_events_from_both_event_apis(k8s: Any) -> None:
    core = k8s.add_node_event("gpu-003", "NodeNotReady", "Node gpu-003 status is now: "
                              "NodeNotReady", "Warning")
    k8s.add_node_event("gpu-001", "Rebooted", "Node gpu-001 has been rebooted", "Warning",
                       api="events.k8s.io")
    table = kubectl(k8s, "get", "events").stdout
    assert "NodeNotReady" in table and "node/gpu-003" in table
    assert "Rebooted" in table and "node/gpu-001" in table
    # The same event through events.k8s.io/v1: same uid, the newer field names.
    v1 = json.loads(kubectl(k8s, "get", "events.v1.events.k8s.io", "-A", "-o", "json").stdout)
    same = next(e for e in v1["items"] if e["metadata"]["uid"] == core["metadata"]["uid"])
    assert same["regarding"]["name"] == "gpu-003" and same["note"].endswith("NodeNotReady")


# --- FleetWatch's client against the same server ------------------------------------------------


def test_client_reads_nodes_and_pods(k8s: Any, api: KubernetesApi) -> None:
    nodes = {n.name: n for n in api.nodes()}
    assert {name: n.ready for name, n in nodes.items()} == {
        "gpu-001": True, "gpu-002": True, "gpu-003": False, "gpu-004": None}
    assert nodes["gpu-004"].ready_reason == "NodeStatusUnknown"
    assert nodes["gpu-001"].labels["fleetwatch.io/pool"] == "gpu"
    assert api.last_warnings == []

    pods = {p.name: p for p in api.pods_on_node("gpu-001")}
    assert set(pods) == {"trainer-0", "dcgm-exporter-a1", "kube-proxy-gpu-001"}
    assert pods["dcgm-exporter-a1"].owner_kind == "DaemonSet"
    assert pods["trainer-0"].owner_kind == "ReplicaSet"
    mirror = pods["kube-proxy-gpu-001"]
    assert mirror.mirror

    with pytest.raises(ClientError) as unknown:
        api.pods_on_node("gpu-999")
    assert unknown.value.permanent and "not found" in str(unknown.value)
    # One node read alone, as a step asks after its node: a node the API server does not
    # have is none, told apart from a server that cannot be read or refuses.
    assert node_or_none(api, "gpu-003") == nodes["gpu-003"]
    assert node_or_none(api, "gpu-999") is None
    with pytest.raises(NotFound):
        api.node("gpu-999")


def test_client_skips_a_malformed_node_and_keeps_the_rest(k8s: Any, api: KubernetesApi) -> None:
    k8s.create("nodes", {"metadata": {"name": "gpu-bad", "labels": {"rack": 7}},
                         "status": {"conditions": [{"type": "Ready", "status": "Maybe"}]}})
    assert len(api.nodes()) == 4
    assert len(api.last_warnings) == 1 and "gpu-bad" in api.last_warnings[0]


def test_client_cordons_and_uncordons_only_its_own(k8s: Any, api: KubernetesApi) -> None:
    result = api.cordon("gpu-001", "incident 12 gpu_hardware")
    assert result.changed and result.call.startswith("kubectl cordon gpu-001")
    node = k8s.get("nodes", "", "gpu-001")
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"][K8S_CORDONED_BY] == "fleetwatch"
    assert node["metadata"]["annotations"][K8S_CORDON_REASON] == "incident 12 gpu_hardware"
    assert "SchedulingDisabled" in kubectl(k8s, "get", "node", "gpu-001").stdout
    assert not api.cordon("gpu-001", "again").changed  # a retried step does nothing twice

    assert api.uncordon("gpu-001").changed
    node = k8s.get("nodes", "", "gpu-001")
    assert not node["spec"].get("unschedulable")
    assert K8S_CORDONED_BY not in node["metadata"]["annotations"]
    assert not api.uncordon("gpu-001").changed

    # An operator's cordon is theirs: FleetWatch neither claims nor undoes it.
    kubectl(k8s, "cordon", "gpu-002")
    assert not api.cordon("gpu-002", "incident 13").changed
    assert K8S_CORDONED_BY not in (k8s.get("nodes", "", "gpu-002")["metadata"]
                                   .get("annotations") or {})
    with pytest.raises(ClientError) as refused:
        api.uncordon("gpu-002")
    assert refused.value.permanent
    assert k8s.get("nodes", "", "gpu-002")["spec"]["unschedulable"] is True

    with pytest.raises(ClientError) as unknown:
        api.cordon("gpu-999", "x")
    assert unknown.value.permanent


def test_client_relabels_and_kubectl_reads_it_back(k8s: Any, api: KubernetesApi) -> None:
    """What lending does to a node: labels set and removed, a taint added and one removed,
    FleetWatch's annotation, in one patch; what someone else set is kept."""
    kubectl(k8s, "taint", "node", "gpu-001", "team=infra:PreferNoSchedule")
    kubectl(k8s, "taint", "node", "gpu-001", "training=true:NoSchedule")
    result = api.relabel("gpu-001", {"fleetwatch.io/lent-to": "inference",
                                     "fleetwatch.io/pool": None},
                         [("fleetwatch.io/inference", "true", "NoSchedule")], ["training"],
                         {"fleetwatch.io/lent": "loan 7"})
    assert result.changed
    assert result.call.startswith("kubectl label node gpu-001 --overwrite fleetwatch.io/lent-to")
    node = json.loads(kubectl(k8s, "get", "node", "gpu-001", "-o", "json").stdout)
    labels = node["metadata"]["labels"]
    assert labels["fleetwatch.io/lent-to"] == "inference" and "fleetwatch.io/pool" not in labels
    assert node["spec"]["taints"] == [
        {"key": "team", "value": "infra", "effect": "PreferNoSchedule"},
        {"key": "fleetwatch.io/inference", "value": "true", "effect": "NoSchedule"}]
    assert node["metadata"]["annotations"]["fleetwatch.io/lent"] == "loan 7"
    described = kubectl(k8s, "describe", "node", "gpu-001").stdout
    assert "fleetwatch.io/inference=true:NoSchedule" in described
    # Asked again: nothing to change, no request made.
    before = len(k8s.requests)
    assert not api.relabel("gpu-001", {"fleetwatch.io/lent-to": "inference"},
                           [("fleetwatch.io/inference", "true", "NoSchedule")], ["training"],
                           {"fleetwatch.io/lent": "loan 7"}).changed
    assert not [r for r in list(k8s.requests)[before:] if r[0] == "PATCH"]
    # Undone: every taint of FleetWatch's gone (the last one: no taints field left).
    kubectl(k8s, "taint", "node", "gpu-001", "team-")
    assert api.relabel("gpu-001", {"fleetwatch.io/lent-to": None, "fleetwatch.io/pool": "gpu"},
                       [], ["fleetwatch.io/inference:NoSchedule"],
                       {"fleetwatch.io/lent": None}).changed
    node = k8s.get("nodes", "", "gpu-001")
    assert not node["spec"].get("taints") and node["metadata"]["labels"]["fleetwatch.io/pool"] \
        == "gpu"
    assert "fleetwatch.io/lent" not in node["metadata"]["annotations"]
    # A taint the server refuses is a permanent error, in its words.
    with pytest.raises(ClientError) as refused:
        api.relabel("gpu-001", {}, [("bad key!", "", "NoSchedule")], [], {})
    assert refused.value.permanent and "spec.taints[0].key" in str(refused.value)


def test_client_evicts_through_the_eviction_api(k8s: Any, api: KubernetesApi) -> None:
    assert not api.evict("kube-system", "dcgm-exporter-a1").changed
    assert not api.evict("kube-system", "kube-proxy-gpu-001").changed
    assert evictions(k8s, "dcgm-exporter-a1") == evictions(k8s, "kube-proxy-gpu-001") == 0

    result = api.evict("train", "trainer-0")
    assert result.changed and k8s.get("pods", "train", "trainer-0") is None
    assert not api.evict("train", "trainer-0").changed  # already gone

    # The PDB says not yet: retried with backoff, then a transient error naming the budget.
    with pytest.raises(ClientError) as blocked:
        api.evict("serve", "api-0")
    assert not blocked.value.permanent
    assert "PodDisruptionBudget" in str(blocked.value)
    assert evictions(k8s, "api-0") >= 2
    assert k8s.get("pods", "serve", "api-0") is not None

    # Once a replacement is ready the next retry goes through.
    patient = KubernetesApi(str(k8s.kubeconfig_path), timeout=5.0, evict_max_wait=30.0,
                            evict_backoff=(0.2, 0.5))
    before = evictions(k8s, "api-0")

    def replacement_ready() -> None:
        wait_for(lambda: evictions(k8s, "api-0") > before, 30, "a blocked eviction")
        k8s.add_pod({"namespace": "serve", "name": "api-1", "node": "gpu-003",
                     "labels": {"app": "api"}, "ready": False})
        k8s.set_pod_ready("serve", "api-1", True)

    helper = threading.Thread(target=replacement_ready)
    helper.start()
    result = patient.evict("serve", "api-0")
    helper.join()
    patient.close()
    assert result.changed and int(result.data["attempts"]) >= 2  # type: ignore[call-overload]
    assert k8s.get("pods", "serve", "api-0") is None


def test_node_changes_list_watch_bookmarks_and_410(k8s: Any, api: KubernetesApi) -> None:
    nodes, cursor, relisted = api.node_changes(None, 1)
    assert relisted and len(nodes) == 4 and int(cursor) == k8s.rv

    k8s.set_node_ready("gpu-001", "Unknown")
    kubectl(k8s, "cordon", "gpu-002")
    changed, cursor2, relisted = api.node_changes(cursor, 1)
    assert not relisted
    assert {n.name: (n.ready, n.unschedulable) for n in changed} == {
        "gpu-001": (None, False), "gpu-002": (True, True)}
    assert int(cursor2) >= int(cursor) + 2

    # Nothing about nodes, but the cluster moved on: a bookmark carries the cursor forward.
    k8s.add_pod({"namespace": "train", "name": "trainer-9", "node": "gpu-003"})
    changed, cursor3, relisted = api.node_changes(cursor2, 1)
    assert changed == [] and not relisted and int(cursor3) == k8s.rv > int(cursor2)
    assert any("allowWatchBookmarks=True" in path for _, path, _ in list(k8s.requests))

    # History compacted past the cursor: 410 Gone, and the client relists.
    k8s.set_node_ready("gpu-003", "True")
    k8s.compact()
    nodes, cursor4, relisted = api.node_changes(cursor3, 1)
    assert relisted and len(nodes) == 4 and int(cursor4) == k8s.rv
    assert {n.name: n.ready for n in nodes}["gpu-003"] is True
    assert any("410" in w for w in api.last_warnings)


def test_node_changes_carry_every_condition_a_health_tool_sets(k8s: Any,
                                                               api: KubernetesApi) -> None:
    """NVSentinel and Node Problem Detector write their verdicts as node conditions: the
    client reads them all, Ready apart, with status, reason and message."""
    _, cursor, _ = api.node_changes(None, 1)
    message = ("ErrorCode:79 PCI:0000:ef:00 GPU_UUID:GPU-b5f21324-f1f9-f1a4-1a37-1166234f6e4f "
               "MESSAGE=NVRM: Xid (PCI:0000:ef:00): 79, pid=0, name=<unknown>, GPU has fallen "
               "off the bus. Recommended Action=RESTART_BM;")
    k8s.set_node_condition("gpu-002", "SysLogsXIDError", "True", "SysLogsXIDErrorIsNotHealthy",
                           message)
    k8s.set_node_condition("gpu-002", "KernelDeadlock", "False", "KernelHasNoDeadlock",
                           "kernel has no deadlock")
    changed, _, _ = api.node_changes(cursor, 1)
    [node] = [n for n in changed if n.name == "gpu-002"]
    assert node.ready is True
    assert node.conditions == {
        "SysLogsXIDError": ("True", "SysLogsXIDErrorIsNotHealthy", message),
        "KernelDeadlock": ("False", "KernelHasNoDeadlock", "kernel has no deadlock")}
    assert {n.name: n.conditions for n in api.nodes()}["gpu-002"] == node.conditions


def test_event_changes_from_both_apis_resume_and_relist(k8s: Any, api: KubernetesApi) -> None:
    k8s.add_node_event("gpu-003", "NodeNotReady", "Node gpu-003 status is now: NodeNotReady",
                       "Warning")
    events, cursor = api.event_changes(None, 1)
    # Listed through both APIs, returned once.
    assert [(e.node, e.reason, e.type) for e in events] == [("gpu-003", "NodeNotReady",
                                                              "Warning")]
    assert set(cursor) == {"core", "events.k8s.io"}

    k8s.add_node_event("gpu-001", "Rebooted", "Node gpu-001 has been rebooted", "Warning")
    k8s.add_node_event("gpu-001", "NodeReady", "Node gpu-001 status is now: NodeReady",
                       api="events.k8s.io")
    k8s.create("events", {"metadata": {"name": "pod-event", "namespace": "train"},
                          "involvedObject": {"kind": "Pod", "name": "trainer-0"},
                          "reason": "Killing", "message": "Stopping container"})
    events, cursor2 = api.event_changes(cursor, 1)
    assert sorted((e.node, e.reason) for e in events) == [("gpu-001", "NodeReady"),
                                                          ("gpu-001", "Rebooted")]
    assert all(e.at is not None for e in events)
    assert all(int(cursor2[k]) > int(cursor[k]) for k in cursor)

    # Quiet: nothing new, the cursors still move with bookmarks.
    events, cursor3 = api.event_changes(cursor2, 1)
    assert events == []

    # After a compaction: relisted, and only what is newer than the cursor is returned.
    k8s.add_node_event("gpu-002", "NodeNotReady", "Node gpu-002 status is now: NodeNotReady")
    k8s.compact()
    events, _ = api.event_changes(cursor3, 1)
    assert [(e.node, e.reason) for e in events] == [("gpu-002", "NodeNotReady")]
    assert any("410" in w for w in api.last_warnings)


def test_server_down_is_transient_and_recovers(k8s: Any, api: KubernetesApi) -> None:
    assert len(api.nodes()) == 4
    k8s.stop()
    for call in (api.nodes, lambda: api.cordon("gpu-001", "x"),
                 lambda: api.node_changes("1", 1), lambda: api.event_changes(None, 1)):
        with pytest.raises(ClientError) as down:
            call()
        assert not down.value.permanent
    k8s.start()  # same port: the kubeconfig still points at it
    assert len(api.nodes()) == 4


def test_forbidden_and_invalid_requests_are_permanent(k8s: Any, tmp_path: Path) -> None:
    k8s.readonly_token = "read-only-token"
    readonly = KubernetesApi(str(k8s.write_kubeconfig(tmp_path / "ro.yaml",
                                                      token="read-only-token")), timeout=5.0)
    assert len(readonly.nodes()) == 4
    with pytest.raises(ClientError) as forbidden:
        readonly.cordon("gpu-001", "x")
    assert forbidden.value.permanent and "forbidden" in str(forbidden.value)
    assert not isinstance(forbidden.value, NotFound)
    readonly.close()

    wrong = KubernetesApi(str(k8s.write_kubeconfig(tmp_path / "bad.yaml", token="nope")),
                          timeout=5.0)
    with pytest.raises(ClientError) as unauthorized:
        wrong.nodes()
    assert unauthorized.value.permanent and "401" in str(unauthorized.value)
    wrong.close()

    # A missing configuration fails the first call (building the client does not: a
    # FleetWatch that reads only telemetry builds one it never uses).
    unconfigured = KubernetesApi(str(tmp_path / "no-such-kubeconfig"))
    with pytest.raises(ClientError) as missing:
        unconfigured.nodes()
    assert missing.value.permanent and "Kubernetes configuration" in str(missing.value)
    unconfigured.close()


# --- what the API server refuses, and what typed clients need ---------------------------------


def _typed(k8s: Any) -> Any:
    """The official client's typed CoreV1Api on the test server's kubeconfig."""
    from kubernetes import client, config
    return client.CoreV1Api(config.new_client_from_config(str(k8s.kubeconfig_path)))


def _raw(k8s: Any, method: str, path: str, body: Any, content_type: str) -> tuple[int, Any]:
    """One request as it is sent, without a client's own checks in between."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(k8s.url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {k8s.token}", "Content-Type": content_type})
    context = ssl.create_default_context(cafile=str(k8s.ca_path))
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_official_client_typed_calls_deserialize(k8s: Any) -> None:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    k8s.add_node_event("gpu-001", "NodeHasSufficientMemory", "kubelet has sufficient memory")
    v1 = _typed(k8s)
    try:
        nodes = v1.list_node()
        assert [n.metadata.name for n in nodes.items] == ["gpu-001", "gpu-002", "gpu-003",
                                                          "gpu-004"]
        info = nodes.items[0].status.node_info
        assert info.boot_id and info.machine_id and info.system_uuid and info.kernel_version
        assert (info.kubelet_version, info.kube_proxy_version) == ("v1.32.0", "v1.32.0")
        node = v1.read_node("gpu-003")
        assert [(c.type, c.status) for c in node.status.conditions] == [("Ready", "False")]

        pods = v1.list_namespaced_pod("train", label_selector="app in (trainer)")
        assert sorted(p.metadata.name for p in pods.items) == ["trainer-0", "trainer-1"]
        status = pods.items[0].status.container_statuses[0]
        assert status.image_id.startswith("registry.local/train@sha256:")
        assert status.container_id.startswith("containerd://") and status.image
        everywhere = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=gpu-001")
        assert {p.metadata.name for p in everywhere.items} == {
            "trainer-0", "dcgm-exporter-a1", "kube-proxy-gpu-001"}

        patched = v1.patch_node("gpu-001", {"spec": {"unschedulable": True}})
        assert patched.spec.unschedulable is True and patched.status.node_info.boot_id
        v1.create_namespaced_pod_eviction("trainer-0", "train", client.V1Eviction(
            metadata=client.V1ObjectMeta(name="trainer-0", namespace="train")))
        assert k8s.get("pods", "train", "trainer-0") is None

        events = v1.list_event_for_all_namespaces(
            field_selector="involvedObject.kind=Node,involvedObject.name=gpu-001")
        assert [e.reason for e in events.items] == ["NodeHasSufficientMemory"]

        with pytest.raises(ApiException) as bad:
            v1.list_node(label_selector="a in (b")
        assert bad.value.status == 400
        refused = json.loads(bad.value.body)
        assert (refused["reason"], refused["message"]) == (
            "BadRequest", "unable to parse requirement: found '', expected: ',' or ')'")
        with pytest.raises(ApiException) as invalid:
            v1.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="GPU_9")))
        assert invalid.value.status == 422
        causes = json.loads(invalid.value.body)["details"]["causes"]
        assert [c["field"] for c in causes] == ["metadata.name"]
        assert k8s.get("nodes", "", "GPU_9") is None
    finally:
        v1.api_client.close()


def test_kubectl_gets_the_apiservers_400_for_bad_selectors(k8s: Any) -> None:
    bad = kubectl(k8s, "get", "nodes", "-l", "a in (b", check=False)
    assert bad.returncode != 0 and "Error from server (BadRequest)" in bad.stderr
    assert "unable to parse requirement: found '', expected: ',' or ')'" in bad.stderr
    key = kubectl(k8s, "get", "nodes", "-l", "app:monolith", check=False)
    assert 'unable to parse requirement: <nil>: Invalid value: "app:monolith"' in key.stderr
    field = kubectl(k8s, "get", "pods", "-A", "--field-selector", "spec.foo=x", check=False)
    assert field.returncode != 0 and "field label not supported: spec.foo" in field.stderr
    names = kubectl(k8s, "get", "nodes", "-l", "fleetwatch.io/pool in (gpu),!missing",
                    "-o", "name").stdout.split()
    assert len(names) == 4


def test_invalid_writes_are_refused_as_by_the_apiserver(k8s: Any) -> None:
    taint = kubectl(k8s, "patch", "node", "gpu-001", "-p",
                    '{"spec":{"taints":[{"key":"gpu","effect":"Bogus"}]}}', check=False)
    assert taint.returncode != 0
    assert ('The Node "gpu-001" is invalid: spec.taints[0].effect: Unsupported value: "Bogus": '
            'supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"') in taint.stderr
    label = kubectl(k8s, "patch", "node", "gpu-001", "--type", "merge", "-p",
                    '{"metadata":{"labels":{"bad key":"x"}}}', check=False)
    assert 'metadata.labels: Invalid value: "bad key"' in label.stderr
    typed = kubectl(k8s, "patch", "node", "gpu-001", "-p", '{"spec":{"unschedulable":"yes"}}',
                    check=False)
    assert ("The request is invalid: patch: Invalid value: \"map[spec:map[unschedulable:yes]]\": "
            "json: cannot unmarshal string into Go struct field NodeSpec.spec.unschedulable of "
            "type bool") in typed.stderr
    node = k8s.get("nodes", "", "gpu-001")
    assert "taints" not in node["spec"] and "bad key" not in node["metadata"]["labels"]
    assert not node["spec"].get("unschedulable")

    code, status = _raw(k8s, "PATCH", "/api/v1/nodes/gpu-001", {"spec": {}}, "text/plain")
    assert (code, status["reason"]) == (415, "UnsupportedMediaType")
    assert status["message"].startswith("the body of the request was in an unknown format")
    replaced = {**k8s.get("nodes", "", "gpu-001"), "spec": {"unschedulable": "yes"}}
    code, status = _raw(k8s, "PUT", "/api/v1/nodes/gpu-001", replaced, "application/json")
    assert (code, status["reason"], status["message"]) == (
        400, "BadRequest", 'Node in version "v1" cannot be handled as a Node: json: cannot '
        "unmarshal string into Go struct field NodeSpec.spec.unschedulable of type bool")
    code, status = _raw(k8s, "PATCH", "/api/v1/nodes/gpu-001",
                        [{"op": "add", "path": "/spec/unschedulable", "value": "yes"}],
                        "application/json-patch+json")
    assert (code, status["reason"]) == (422, "Invalid")
    assert [c["field"] for c in status["details"]["causes"]] == ["patch"]
    code, status = _raw(k8s, "POST", "/api/v1/namespaces/train/pods",
                        {"metadata": {"name": "p", "labels": {"a": "-"}}, "spec": {}},
                        "application/json")
    assert (code, [c["field"] for c in status["details"]["causes"]]) == (
        422, ["metadata.labels", "spec.containers"])


def test_collector_signals_a_health_tools_condition_once_and_diagnosis_reads_it(
        k8s: Any, api: KubernetesApi, db: None) -> None:
    """NVSentinel sets SysLogsXIDError with XID 79 on a node: the Kubernetes collector announces
    the change once (a second run with nothing new announces nothing), and the stored signal,
    read back as diagnosis reads it, blames that node."""
    from collectors.clients import Clients
    from collectors.models import Node, Signal
    from collectors.services import collect_source
    from incidents.diagnosis import diagnose
    from incidents.selectors import observation_from_signal

    clients = Clients(None, api, None, None, None)  # type: ignore[arg-type]  # only Kubernetes is read
    assert collect_source("kubernetes", clients=clients).healthy  # the first look: a baseline
    assert not Signal.objects.filter(kind="k8s_condition").exists()
    message = ("ErrorCode:79 PCI:0000:ef:00 GPU_UUID:GPU-b5f21324-f1f9-f1a4-1a37-1166234f6e4f "
               "MESSAGE=NVRM: Xid (PCI:0000:ef:00): 79, pid=0, name=<unknown>, GPU has fallen "
               "off the bus. Recommended Action=RESTART_BM;")
    k8s.set_node_condition("gpu-002", "SysLogsXIDError", "True", "SysLogsXIDErrorIsNotHealthy",
                           message)
    assert collect_source("kubernetes", clients=clients).healthy
    assert collect_source("kubernetes", clients=clients).healthy
    [signal] = Signal.objects.filter(kind="k8s_condition")
    assert (signal.node_name, signal.data["condition"], signal.data["status"]) == (
        "gpu-002", "SysLogsXIDError", "True")
    assert Node.objects.get(name="gpu-002").k8s_conditions["SysLogsXIDError"][0] == "True"
    found = diagnose([observation_from_signal(signal)])
    assert [(d.root_cause, d.nodes) for d in found] == [("gpu_hardware", ("gpu-002",))]
