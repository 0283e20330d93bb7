"""What other health tools' verdicts claim: NVIDIA NVSentinel, leptonai gpud, and Kubernetes
Node Problem Detector (upstream and the GPU/InfiniBand conditions cloud providers add).

Their verdicts reach FleetWatch as Kubernetes node conditions and events (NVSentinel's
platform connector and NPD write those) or from gpud's local events API (the node agent reads
it). Each tool names its checks its own way; this table says, once, what a name claims, so the
diagnosis can weigh a verdict like any other evidence. An XID code in a verdict's message is
read by the diagnosis as that XID; what a verdict without one claims is below.

Sources (the strings are copied from them):
- NVSentinel platform connector, ``platform-connectors/pkg/connectors/kubernetes/
  process_node_events.go``: condition type = the health event's checkName; reason =
  checkName + "IsNotHealthy" / "IsHealthy"; message = "ErrorCode:<code> <entityType>:<value>
  ... <message> Recommended Action=<action>;" joined for each fault, "No Health Failures" once
  healthy. Fatal events set the condition True, healthy ones False; non-fatal ones become a
  node Event whose reason is checkName + "IsNotHealthy". Check names from docs/INTEGRATIONS.md.
- gpud ``components/accelerator/nvidia/*/component.go`` (component names, event names) and
  ``api/v1/types.go`` (event types, health states).
- node-problem-detector ``config/*.json`` (upstream conditions),
  https://learn.microsoft.com/en-us/azure/aks/node-problem-detector (AKS's, the GPU-only ones
  among them) and https://cloud.google.com/anthos/clusters/docs/bare-metal/1.10/how-to/
  node-problem-detector (GKE's; it lists no GPU or InfiniBand conditions).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

# The tools, as FleetWatch names them in what it shows.
NVSENTINEL: Final = "NVSentinel"
GPUD: Final = "gpud"
NPD: Final = "node-problem-detector"
TOOLS: Final = frozenset({NVSENTINEL, GPUD, NPD})

# What a verdict claims. GPU, GPU_MEMORY, NVLINK, NETWORK, THERMAL name a fault of the node's
# hardware; NOT_GPU is a real node problem that is none of those (a hung kernel, a read-only
# disk, a restarting kubelet): shown to people, never an incident of a GPU or network cause.
GPU: Final = "gpu"
GPU_MEMORY: Final = "gpu_memory"
NVLINK: Final = "nvlink"
NETWORK: Final = "network"
THERMAL: Final = "thermal"
NOT_GPU: Final = "not_gpu"

# Node condition types (and NVSentinel's event types, which are its check names) -> claim.
CONDITION_CLAIMS: Final = MappingProxyType({
    # NVSentinel GPU health monitor (DCGM health watches)
    "GpuXidError": GPU,
    "GpuMemWatch": GPU_MEMORY,
    "GpuThermalWatch": THERMAL,
    "GpuPcieWatch": GPU,
    "GpuPowerWatch": GPU,
    "GpuInforomWatch": GPU,
    "GpuSmWatch": GPU,
    "GpuNvlinkWatch": NVLINK,
    "GpuMcuWatch": GPU,
    "GpuPmuWatch": GPU,
    "GpuDriverWatch": GPU,
    # NVSentinel syslog health monitor
    "SysLogsXIDError": GPU,
    "SysLogsSXIDError": NVLINK,
    "SysLogsGPUFallenOff": GPU,
    # NVSentinel NVSwitch conditions
    "NVSwitchFatalError": NVLINK,
    "NVSwitchDown": NVLINK,
    # AKS node problem detector, GPU-only conditions
    "GPUMissing": GPU,
    "NVLinkStatusInactive": NVLINK,
    "XIDErrors": GPU,
    "IBLinkFlapping": NETWORK,
    "GPUClockThrottling": THERMAL,
    # Upstream NPD and AKS general-purpose conditions: the node has a problem, not its GPUs.
    "KernelDeadlock": NOT_GPU,
    "ReadonlyFilesystem": NOT_GPU,
    "XfsShutdown": NOT_GPU,
    "CperHardwareErrorFatal": NOT_GPU,
    "FrequentKubeletRestart": NOT_GPU,
    "FrequentDockerRestart": NOT_GPU,
    "FrequentContainerdRestart": NOT_GPU,
    "FrequentUnregisterNetDevice": NOT_GPU,
    "FilesystemCorruptionProblem": NOT_GPU,
    "KubeletProblem": NOT_GPU,
    "ContainerRuntimeProblem": NOT_GPU,
    "VMEventScheduled": NOT_GPU,
    "UnhealthyNvidiaDevicePlugin": NOT_GPU,
    "NTPProblem": NOT_GPU,
    "CSPMaintenance": NOT_GPU,
    # GKE (Google Distributed Cloud) node problem detector
    "KubeletUnhealthy": NOT_GPU,
    "ContainerRuntimeUnhealthy": NOT_GPU,
    "CorruptDockerOverlay2": NOT_GPU,
    "DCGMError": NOT_GPU,
})

# The conditions Kubernetes itself manages: read elsewhere (Ready) or not verdicts of a tool.
KUBELET_CONDITIONS: Final = frozenset({"Ready", "MemoryPressure", "DiskPressure", "PIDPressure",
                                       "NetworkUnavailable"})

# NVSentinel's reason suffixes (updateHealthEventReason) and its healthy message.
NVSENTINEL_UNHEALTHY_SUFFIX: Final = "IsNotHealthy"
NVSENTINEL_HEALTHY_SUFFIX: Final = "IsHealthy"
NVSENTINEL_HEALTHY_MESSAGE: Final = "No Health Failures"

# gpud component names -> claim.
GPUD_COMPONENT_CLAIMS: Final = MappingProxyType({
    "accelerator-nvidia-error-xid": GPU,
    "accelerator-nvidia-error-sxid": NVLINK,
    "accelerator-nvidia-nvlink": NVLINK,
    "accelerator-nvidia-ecc": GPU_MEMORY,
    "accelerator-nvidia-remapped-rows": GPU_MEMORY,
    "accelerator-nvidia-temperature": THERMAL,
    "accelerator-nvidia-hw-slowdown": THERMAL,
    "accelerator-nvidia-infiniband": NETWORK,
    "accelerator-nvidia-gpu-counts": GPU,
})
# gpud event types (api/v1 EventType) that say something is wrong, not that it was seen.
GPUD_FAULT_TYPES: Final = frozenset({"Critical", "Fatal"})
# gpud health states (api/v1 HealthStateType).
GPUD_UNHEALTHY_STATES: Final = frozenset({"Unhealthy", "Degraded"})


def condition_claim(condition: str) -> str | None:
    """What a node condition (or an NVSentinel event type) claims; None: not a tool's."""
    return CONDITION_CLAIMS.get(condition.strip())


def nvsentinel_check(reason: str) -> tuple[str, bool] | None:
    """(check name, healthy) from an NVSentinel reason such as "SysLogsXIDErrorIsNotHealthy";
    None for any other reason."""
    for suffix, healthy in ((NVSENTINEL_UNHEALTHY_SUFFIX, False),
                            (NVSENTINEL_HEALTHY_SUFFIX, True)):
        if reason.endswith(suffix) and len(reason) > len(suffix):
            return reason[: -len(suffix)], healthy
    return None
