"""The Kubernetes test server's own semantics, without HTTP: patches, selectors, paging,
PodDisruptionBudget arithmetic (kubectl checks the rest in tests/integration)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def _server() -> ModuleType:
    name = "fleetwatch_k8s_test_server"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests/harness/k8s_server.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_strategic_merge_patch_merges_conditions_by_type_and_null_deletes() -> None:
    ks = _server()
    node = {"metadata": {"annotations": {"a": "1", "b": "2"}},
            "spec": {"unschedulable": True},
            "status": {"conditions": [{"type": "Ready", "status": "True"},
                                      {"type": "DiskPressure", "status": "False"}]}}
    patched = ks.strategic_merge_patch(node, {
        "metadata": {"annotations": {"a": None}}, "spec": {"unschedulable": None},
        "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}})
    assert patched["metadata"]["annotations"] == {"b": "2"}
    assert patched["spec"] == {}
    assert patched["status"]["conditions"] == [{"type": "Ready", "status": "Unknown"},
                                               {"type": "DiskPressure", "status": "False"}]
    # A merge patch replaces lists whole.
    merged = ks.merge_patch(node, {"status": {"conditions": [{"type": "Ready"}]}})
    assert merged["status"]["conditions"] == [{"type": "Ready"}]
    assert ks.json_patch(node, [{"op": "replace", "path": "/spec/unschedulable",
                                 "value": False}])["spec"]["unschedulable"] is False


def test_label_selectors() -> None:
    ks = _server()
    match = ks.label_selector("app in (trainer,api),tier!=db,!legacy")
    assert match({"app": "api", "tier": "web"})
    assert not match({"app": "api", "tier": "db"})
    assert not match({"app": "api", "legacy": "y"})
    assert not match({"app": "web"})
    assert ks.selector_object_matches({}, {"x": "y"})
    assert not ks.selector_object_matches(None, {"x": "y"})


def test_pdb_arithmetic_and_eviction_verdicts() -> None:
    ks = _server()
    server = ks.K8sTestServer({
        "nodes": [{"name": "n1"}],
        "pods": [{"namespace": "t", "name": f"p{i}", "node": "n1", "labels": {"app": "x"},
                  "ready": i < 3, "owner": {"kind": "ReplicaSet", "name": "x-1"}} for i in range(4)],
        "poddisruptionbudgets": [{"namespace": "t", "name": "x", "selector": {"app": "x"},
                                  "maxUnavailable": "50%"}]})
    pdb = server.get("poddisruptionbudgets", "t", "x")
    status = server.pdb_status(pdb)
    assert (status["expectedPods"], status["currentHealthy"], status["desiredHealthy"],
            status["disruptionsAllowed"]) == (4, 3, 2, 1)
    server.evict("t", "p0", {}, dry_run=False)
    with pytest.raises(ks.ApiError) as blocked:
        server.evict("t", "p1", {}, dry_run=False)
    assert blocked.value.code == 429 and blocked.value.reason == "TooManyRequests"
    # An unready pod may go while the budget is met by the others.
    server.evict("t", "p3", {}, dry_run=False)


def test_paging_and_an_expired_continue_token() -> None:
    ks = _server()
    server = ks.K8sTestServer({"nodes": [{"name": f"n{i}"} for i in range(5)]})
    nodes = next(r for r in ks.RESOURCES if r.plural == "nodes")
    first = server.list(nodes, None, {"limit": "2"})
    assert [n["metadata"]["name"] for n in first["items"]] == ["n0", "n1"]
    assert first["metadata"]["remainingItemCount"] == 3
    second = server.list(nodes, None, {"limit": "2", "continue": first["metadata"]["continue"]})
    assert [n["metadata"]["name"] for n in second["items"]] == ["n2", "n3"]
    server.set_node_ready("n0", False)
    server.compact()
    with pytest.raises(ks.ApiError) as gone:
        server.list(nodes, None, {"limit": "2", "continue": second["metadata"]["continue"]})
    assert gone.value.code == 410
    with pytest.raises(ks.ApiError) as unsupported:
        server.list(nodes, None, {"fieldSelector": "status.phase=Running"})
    assert unsupported.value.code == 400
