"""Node conditions other than Ready (the kubelet's pressures and health tools' verdicts): read
from the node object, and announced as ``k8s_condition`` signals only when they change."""

from __future__ import annotations

from collectors import normalize
from collectors.clients.base import K8sNode
from collectors.clients.kubernetes import node_from

NVS = ("ErrorCode:79 PCI:0000:ef:00 GPU_UUID:GPU-b5f21324-f1f9-f1a4-1a37-1166234f6e4f "
       "MESSAGE=NVRM: Xid (PCI:0000:ef:00): 79, pid=0, name=<unknown>, GPU has fallen off the "
       "bus. Recommended Action=RESTART_BM;")


def _node(**conditions: tuple[str, str, str]) -> K8sNode:
    return K8sNode(name="gpu-001", ready=True, unschedulable=False, conditions=dict(conditions))


def test_node_from_reads_every_condition() -> None:
    node = node_from({"metadata": {"name": "gpu-001"}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady"},
        {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
         "message": "kubelet has sufficient memory available"},
        {"type": "SysLogsXIDError", "status": "True", "reason": "SysLogsXIDErrorIsNotHealthy",
         "message": NVS},
        {"type": "KernelDeadlock", "status": "False", "reason": "KernelHasNoDeadlock"}]}})
    assert node.ready is True and node.ready_reason == "KubeletReady"
    assert node.conditions == {
        "MemoryPressure": ("False", "KubeletHasSufficientMemory",
                           "kubelet has sufficient memory available"),
        "SysLogsXIDError": ("True", "SysLogsXIDErrorIsNotHealthy", NVS),
        "KernelDeadlock": ("False", "KernelHasNoDeadlock", "")}


def test_node_from_reads_taints_and_labels() -> None:
    node = node_from({"metadata": {"name": "gpu-001", "labels": {"nvidia.com/gpu.product": "H100"}},
                      "spec": {"taints": [
                          {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                          {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]}})
    assert node.taints == (("nvidia.com/gpu", "present", "NoSchedule"),
                           ("node.kubernetes.io/unreachable", "", "NoExecute"))
    assert node.labels == {"nvidia.com/gpu.product": "H100"}


def test_first_look_is_not_news() -> None:
    now = _node(SysLogsXIDError=("True", "SysLogsXIDErrorIsNotHealthy", NVS))
    assert normalize.k8s_condition_changes("", {}, now) == []


def test_a_condition_that_turns_true_is_a_signal_once() -> None:
    before = {"KernelDeadlock": ["False", "KernelHasNoDeadlock", "kernel has no deadlock"]}
    now = _node(KernelDeadlock=("True", "DockerHung",
                                "task docker:7 blocked for more than 300 seconds."))
    [draft] = normalize.k8s_condition_changes("True", before, now)
    assert (draft.source, draft.kind, draft.node, draft.value) == (
        "kubernetes", "k8s_condition", "gpu-001", "True")
    assert draft.data == {"condition": "KernelDeadlock", "status": "True",
                          "reason": "DockerHung"}
    assert draft.message == "task docker:7 blocked for more than 300 seconds."
    # Read again unchanged: nothing.
    stored = normalize.k8s_conditions_stored(now)
    assert normalize.k8s_condition_changes("True", stored, now) == []


def test_a_new_fault_in_a_true_condition_is_a_change_and_a_healthy_new_one_is_not() -> None:
    first = "ErrorCode:79 PCI:0000:ef:00 Recommended Action=RESTART_BM"
    before = {"SysLogsXIDError": ["True", "SysLogsXIDErrorIsNotHealthy", first + ";"]}
    now = _node(SysLogsXIDError=("True", "SysLogsXIDErrorIsNotHealthy",
                                 first + ";ErrorCode:79 PCI:0000:9b:00 Recommended "
                                 "Action=RESTART_BM;"),
                GpuMemWatch=("False", "GpuMemWatchIsHealthy", "No Health Failures"))
    drafts = normalize.k8s_condition_changes("True", before, now)
    assert [d.data["condition"] for d in drafts] == ["SysLogsXIDError"]


def test_a_condition_that_clears_is_a_signal() -> None:
    before = {"SysLogsXIDError": ["True", "SysLogsXIDErrorIsNotHealthy", NVS]}
    now = _node(SysLogsXIDError=("False", "SysLogsXIDErrorIsHealthy", "No Health Failures"))
    [draft] = normalize.k8s_condition_changes("True", before, now)
    assert draft.data["status"] == "False" and draft.message == "No Health Failures"
