"""The Prometheus text exposition format, as NVIDIA dcgm-exporter and node_exporter print it.

Pure functions, no I/O: the simulated exporter (``collectors.sim.exporter``) serves what they render, a
real Prometheus scrapes it, and ``PrometheusTelemetry`` reads it back through PromQL. Being
faithful here is what makes that round trip a test of the real client, so the details follow
the exporters' own output:

- dcgm-exporter prints one ``# HELP``/``# TYPE`` block per field, in its counters-file order,
  with the labels ``gpu, UUID, pci_bus_id, device, modelName, Hostname,
  DCGM_FI_DRIVER_VERSION`` (and ``container, namespace, pod`` with Kubernetes pod mapping).
  Help texts and types are those of ``etc/default-counters.csv``. A field DCGM reports as
  blank (a GPU that fell off the bus has no utilisation) is left out, not printed as 0; a GPU
  with neither utilisation nor temperature (off the bus) prints its last XID alone.
- node_exporter's InfiniBand collector prints ``node_infiniband_*`` with ``device`` and
  ``port`` labels only; Prometheus adds ``instance`` from the scrape target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from collectors.clients.base import GpuMetric, NicPort
from collectors.knowledge import dcgm
from collectors.knowledge.dcgm import CLOCK_THROTTLE_REASONS, CLOCKS_EVENT_REASONS, NVLINK_ERROR_COUNTERS

DEFAULT_MODEL = "NVIDIA H100 80GB HBM3"
DEFAULT_DRIVER = "550.90.07"
# PCI bus ids of the eight GPUs of an HGX H100 board, by index: real values, so the label
# looks like the exporter's (``00000000:1B:00.0``).
HGX_BUS_IDS = ("1B", "43", "52", "61", "9D", "C3", "D1", "DF")

# The clock-event field was renamed in DCGM 3.2 (throttle -> event); older exporters print the
# old name. Both carry the same bitmask.
# (collectors.knowledge.dcgm: CLOCKS_EVENT_REASONS, CLOCK_THROTTLE_REASONS.)


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # gauge / counter, as in the counters file
    help: str
    value: Callable[[GpuMetric], float | int | None]


def _fields(clock_field: str) -> list[Field]:
    """The fields FleetWatch reads, in dcgm-exporter's default-counters.csv order."""
    return [
        Field(dcgm.MEMORY_TEMP, "gauge", "Memory temperature (in C).",
              lambda m: m.memory_temperature),
        Field(dcgm.GPU_TEMP, "gauge", "GPU temperature (in C).", lambda m: m.temperature),
        Field(dcgm.POWER_USAGE, "gauge", "Power draw (in W).", lambda m: m.power_w),
        Field(dcgm.PCIE_REPLAY_COUNTER, "counter", "Total number of PCIe retries.",
              lambda m: m.pcie_replays),
        Field(dcgm.GPU_UTIL, "gauge", "GPU utilization (in %).", lambda m: m.utilization),
        Field(dcgm.XID_ERRORS, "gauge", "Value of the last XID error encountered.",
              lambda m: m.last_xid),
        Field(clock_field, "gauge",
              "Current clock throttle reasons." if clock_field == CLOCK_THROTTLE_REASONS
              else "Current clock event reasons.",
              lambda m: m.clock_event_reasons),
        Field(dcgm.ECC_DBE_VOL_TOTAL, "counter",
              "Total number of double-bit volatile ECC errors.", lambda m: m.dbe_total),
        # GpuMetric keeps the NVLink error counters summed; the exporter prints them apart,
        # so the total is shown as the flow-control CRC counter (the one that moves first on
        # a bad link) and the others as 0.
        Field(NVLINK_ERROR_COUNTERS[0], "counter", "Total number of NVLink flow-control CRC errors.",
              lambda m: m.nvlink_errors),
        Field(NVLINK_ERROR_COUNTERS[1], "counter", "Total number of NVLink data CRC errors.",
              lambda m: None if m.nvlink_errors is None else 0),
        Field(NVLINK_ERROR_COUNTERS[2], "counter", "Total number of NVLink retries.",
              lambda m: None if m.nvlink_errors is None else 0),
        Field(NVLINK_ERROR_COUNTERS[3], "counter", "Total number of NVLink recovery errors.",
              lambda m: None if m.nvlink_errors is None else 0),
        Field(dcgm.ROW_REMAP_FAILURE, "gauge", "Whether remapping of rows has failed",
              lambda m: m.row_remap_failure),
        Field(dcgm.UNCORRECTABLE_REMAPPED_ROWS, "counter",
              "Number of remapped rows for uncorrectable errors",
              lambda m: m.uncorrectable_remapped_rows),
    ]


# The fields GpuMetric does not carry: the node page's readings (dcgm.NODE_PAGE_FIELDS) and
# what the fail-slow analysis reads as history (dcgm.FAIL_SLOW_FIELDS). Type and help as in
# dcgm-exporter's counters files. ``render_dcgm(readings=...)`` prints them.
READING_FAMILIES: dict[str, tuple[str, str]] = {
    dcgm.POWER_MGMT_LIMIT: ("gauge", "Power management limit (in W)."),
    dcgm.SM_CLOCK: ("gauge", "SM clock frequency (in MHz)."),
    dcgm.MEM_CLOCK: ("gauge", "Memory clock frequency (in MHz)."),
    dcgm.FB_FREE: ("gauge", "Framebuffer memory free (in MiB)."),
    dcgm.FB_USED: ("gauge", "Framebuffer memory used (in MiB)."),
    dcgm.ECC_SBE_VOL_TOTAL: ("counter", "Total number of single-bit volatile ECC errors."),
    dcgm.CORRECTABLE_REMAPPED_ROWS: ("counter", "Number of remapped rows for correctable errors"),
    dcgm.ROW_REMAP_PENDING: ("gauge", "Whether remapping of rows is pending"),
    dcgm.PROF_NVLINK_TX_BYTES: ("gauge", "The rate of data transmitted over NVLink, not "
                                "including protocol headers, in bytes per second."),
    dcgm.PROF_NVLINK_RX_BYTES: ("gauge", "The rate of data received over NVLink, not "
                                "including protocol headers, in bytes per second."),
    dcgm.NVLINK_BANDWIDTH_TOTAL: ("counter",
                                  "Total number of NVLink bandwidth counters for all lanes."),
    dcgm.PCIE_LINK_GEN: ("gauge", "PCIe link generation."),
    dcgm.PCIE_MAX_LINK_GEN: ("gauge", "Maximum PCIe link generation."),
    dcgm.PCIE_LINK_WIDTH: ("gauge", "PCIe link width (lanes)."),
    dcgm.PCIE_MAX_LINK_WIDTH: ("gauge", "Maximum PCIe link width (lanes)."),
    dcgm.PROF_DRAM_ACTIVE: ("gauge", "Ratio of cycles the device memory interface is active "
                            "sending or receiving data."),
    dcgm.PROF_PCIE_TX_BYTES: ("counter", "The rate of data transmitted over the PCIe bus - "
                              "including both protocol headers and data payloads - in bytes "
                              "per second."),
    dcgm.PROF_PCIE_RX_BYTES: ("counter", "The rate of data received over the PCIe bus - "
                              "including both protocol headers and data payloads - in bytes "
                              "per second."),
}


def format_value(value: float | int) -> str:
    """A sample value as Go's client library prints it: integers without a decimal point,
    ``NaN``/``+Inf``/``-Inf`` spelled the Prometheus way, other floats in shortest form."""
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def escape_label_value(value: str) -> str:
    """Label values escape backslash, double quote and newline (and nothing else)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """HELP text escapes backslash and newline (quotes stay as they are)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_labels(labels: Iterable[tuple[str, str]]) -> str:
    return ",".join(f'{name}="{escape_label_value(value)}"' for name, value in labels)


def _family(name: str, type_: str, help_: str, lines: list[str]) -> list[str]:
    return [f"# HELP {name} {escape_help(help_)}", f"# TYPE {name} {type_}", *lines]


def gpu_labels(
    metric: GpuMetric,
    hostname_label: str | None = "Hostname",
    *,
    driver_version: str = DEFAULT_DRIVER,
    instance: str | None = None,
    pod: Mapping[str, str] | None = None,
) -> list[tuple[str, str]]:
    """One GPU's labels in the order dcgm-exporter prints them."""
    bus = HGX_BUS_IDS[metric.gpu % len(HGX_BUS_IDS)]
    labels = [
        ("gpu", str(metric.gpu)),
        ("UUID", metric.uuid),
        ("pci_bus_id", f"00000000:{bus}:00.0"),
        ("device", f"nvidia{metric.gpu}"),
        ("modelName", metric.model or DEFAULT_MODEL),
    ]
    if hostname_label:
        labels.append((hostname_label, metric.node))
    labels.append((dcgm.DRIVER_VERSION, driver_version))
    if pod is not None:
        labels += [("container", pod.get("container", "")),
                   ("namespace", pod.get("namespace", "")),
                   ("pod", pod.get("pod", ""))]
    if instance is not None:
        # Not something dcgm-exporter prints: a combined exporter standing in for one per node
        # names each node's scrape target itself, for a scrape job with honor_labels.
        labels.append(("instance", instance))
    return labels


def render_dcgm(
    metrics: list[GpuMetric],
    hostname_label: str | None = "Hostname",
    *,
    clock_field: str = CLOCKS_EVENT_REASONS,
    driver_version: str = DEFAULT_DRIVER,
    instance_port: int | None = None,
    pods: Mapping[tuple[str, int], Mapping[str, str]] | None = None,
    timestamps: Mapping[str, float] | None = None,
    fields: Collection[str] | None = None,
    readings: Mapping[tuple[str, int], Mapping[str, float]] | None = None,
) -> str:
    """dcgm-exporter's ``/metrics`` page for these GPUs.

    ``hostname_label``: ``Hostname`` (dcgm-exporter 2.x-4.x), ``hostname`` (some builds and
    relabelled setups) or ``None`` (no host label: Prometheus's ``instance`` is all there is).
    ``clock_field``: ``CLOCK_THROTTLE_REASONS`` renders an exporter older than DCGM 3.2.
    ``instance_port``: also label each GPU ``instance="<node>:<port>"`` (see ``gpu_labels``).
    ``pods``: Kubernetes pod mapping, ``(node, gpu) -> {container, namespace, pod}``; when
    given, every GPU carries the three labels (empty for a GPU no pod holds), as the exporter
    does with ``--kubernetes``.
    ``timestamps``: node -> epoch seconds printed on that node's samples. dcgm-exporter prints
    none (Prometheus stamps each sample with its scrape); a test uses it to say when a node
    was last scraped: Prometheus stores one sample per timestamp, so a node whose time does
    not move has no new sample, as between two scrapes 15 s apart.
    ``fields``: print only these fields, as an exporter whose counters file lists them does
    (None: every field FleetWatch reads).
    ``readings``: ``(node, gpu) -> {field: value}``, the node page's fields that GpuMetric
    does not carry (``READING_FAMILIES``: clocks, framebuffer, PCIe link, ...), printed after
    the others; a field a GPU's readings leave out is not printed for it.
    """
    labels = {
        (m.node, m.gpu): format_labels(gpu_labels(
            m, hostname_label, driver_version=driver_version,
            instance=None if instance_port is None else f"{m.node}:{instance_port}",
            pod=None if pods is None else pods.get((m.node, m.gpu), {})))
        for m in metrics
    }
    out: list[str] = []
    known = readings or {}

    def reading(name: str) -> Callable[[GpuMetric], float | None]:
        return lambda m: known.get((m.node, m.gpu), {}).get(name)

    more = [Field(name, type_, help_, reading(name))
            for name, (type_, help_) in READING_FAMILIES.items()] if known else []
    for field in [*_fields(clock_field), *more]:
        if fields is not None and field.name not in fields:
            continue
        lines = []
        for m in metrics:
            value = field.value(m)
            if value is None:
                continue  # DCGM blank: the exporter skips the sample
            if m.utilization is None and m.temperature is None and field.name != dcgm.XID_ERRORS:
                continue  # off the bus: every field blank but the last XID
            stamp = timestamps.get(m.node) if timestamps else None
            lines.append(f"{field.name}{{{labels[(m.node, m.gpu)]}}} {format_value(value)}"
                         + ("" if stamp is None else f" {int(stamp * 1000)}"))
        if lines:
            out += _family(field.name, field.type, field.help, lines)
    return "\n".join(out) + "\n" if out else ""


# InfiniBand port states as sysfs spells them (``4: ACTIVE``); node_exporter exports the number.
IB_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
IB_STATE_IDS = {name: number for number, name in IB_STATES.items()}
# Physical states: 5 is LinkUp; a port whose link went down trains again (2: Polling).
IB_PHYS_LINK_UP = 5
IB_PHYS_POLLING = 2

_IB_FAMILIES: list[tuple[str, str, str, Callable[[NicPort], int]]] = [
    ("node_infiniband_link_downed_total", "counter",
     "Number of times the link failed to recover from an error state and went down",
     lambda p: p.link_downed),
    ("node_infiniband_link_error_recovery_total", "counter",
     "Number of times the link successfully recovered from an error state",
     lambda p: p.link_error_recovery),
    ("node_infiniband_physical_state_id", "gauge",
     "Physical state of the InfiniBand port (0: no change, 1: sleep, 2: polling, 3: disable, "
     "4: shift, 5: link up, 6: link error recover, 7: phytest)",
     lambda p: IB_PHYS_LINK_UP if p.state == "ACTIVE" else IB_PHYS_POLLING),
    ("node_infiniband_state_id", "gauge",
     "State of the InfiniBand port (0: no change, 1: down, 2: init, 3: armed, 4: active, "
     "5: act defer)",
     lambda p: IB_STATE_IDS.get(p.state.upper(), 1)),
    ("node_infiniband_symbol_error_total", "counter",
     "Number of minor link errors detected on one or more physical lanes.",
     lambda p: p.symbol_error),
]


def render_node_infiniband(ports: list[NicPort], *, instance_port: int | None = None) -> str:
    """node_exporter's InfiniBand families for these ports (sorted by name, as the Go client
    library sorts them).

    node_exporter labels ports with ``device`` and ``port`` only. For one node's page leave
    ``instance_port`` unset; for a page that stands in for several nodes, pass it and each
    port is labelled ``instance="<node>:<port>"`` (scraped with honor_labels, this is what
    Prometheus would have stored had each node been its own target).
    """
    out: list[str] = []
    for name, type_, help_, value in _IB_FAMILIES:
        lines = []
        for p in ports:
            labels = [("device", p.device), ("port", str(p.port))]
            if instance_port is not None:
                labels.append(("instance", f"{p.node}:{instance_port}"))
            lines.append(f"{name}{{{format_labels(labels)}}} {format_value(value(p))}")
        if lines:
            out += _family(name, type_, help_, lines)
    return "\n".join(out) + "\n" if out else ""
