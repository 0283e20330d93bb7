"""Reads of the fleet's own objects (clusters, nodes, GPUs, jobs, signals, sources) for their
pages and API endpoints, and for the dashboard that ``incidents`` composes from them.

Nothing here knows about incidents: a node's or a job's page asks whoever listens to
``node_page`` / ``job_page`` for what else to show (``incidents`` adds the incidents that
blamed it and its repairs), as collectors announce stored signals rather than call diagnosis
(DESIGN: data goes one way)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import django.dispatch
from django.conf import settings
from django.db.models import Count, F, Q, QuerySet, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from collectors.clients import get_telemetry, page_kubernetes, page_telemetry
from collectors.clients.base import NO_AUTO_REPLACE_LABEL, ClientError, K8sPod
from collectors.knowledge import dcgm
from collectors.knowledge.dcgm import clock_event_reasons
from collectors.knowledge.slurm import index_ranges
from collectors.models import Cluster, CollectorRun, Gpu, GpuSample, Job, Node, Signal, SourceHealth
from collectors.sources import sources_of

log = logging.getLogger(__name__)

# Sent with ``node=`` (``job=``) while a node's (job's) page is read; each receiver returns a
# dict of more context for the page's template.
node_page = django.dispatch.Signal()
job_page = django.dispatch.Signal()


def json_list_has(value: str) -> str:
    """A lookup value matching one element of a JSON list of strings ('"gpu-003"' in
    '["gpu-003", "gpu-004"]'): JSON containment is not available on SQLite."""
    return f'"{value}"'


# --- telemetry ------------------------------------------------------------------------------

# A telemetry point: (node, gpu, at, utilisation, temperature).
TelemetryPoint = tuple[str, int, datetime, float | None, float | None]


def telemetry_points(cluster: Cluster, names: list[str], start: datetime,
                     end: datetime) -> list[TelemetryPoint]:
    """(node, gpu, at, utilisation, temperature) for the nodes' GPUs between the two times:
    from the stored samples (the simulated fleet), or from Prometheus range queries when
    FleetWatch reads a real one. Raises ClientError when the telemetry source fails."""
    if sources_of(cluster.name).store_gpu_samples:
        rows = (GpuSample.objects.filter(node__name__in=names, node__cluster=cluster,
                                         at__range=(start, end))
                .values_list("node__name", "gpu_index", "at", "utilization", "temperature"))
        return list(rows)
    return _history_points(cluster, names, start, min(end, timezone.now()))


def _history_points(cluster: Cluster, names: list[str], start: datetime,
                    end: datetime) -> list[TelemetryPoint]:
    if end <= start or not names:
        return []
    out = []
    for node, gpus in get_telemetry(cluster.name).gpu_history(names, start, end, 15.0).items():
        for index, points in gpus.items():
            out += [(node, int(index), datetime.fromtimestamp(p.at, tz=UTC), p.utilization,
                     p.temperature) for p in points]
    return out


def node_telemetry(node: Node, minutes: int = 60) -> dict[str, Any]:
    """One node's GPUs over the last ``minutes``: utilisation and temperature per GPU."""
    end = timezone.now()
    start = end - timedelta(minutes=minutes)
    out: dict[str, Any] = {"node": node.name, "start": start.isoformat(), "end": end.isoformat()}
    try:
        points = telemetry_points(node.cluster, [node.name], start, end)
    except ClientError as exc:
        return {**out, "utilization": {}, "temperature": {},
                "error": f"telemetry unavailable: {exc}"}
    util: dict[str, dict[str, list[Any]]] = {}
    temp: dict[str, dict[str, list[Any]]] = {}
    for _, gpu, at, u, t in sorted(points, key=lambda p: (p[1], p[2])):
        for series, value in ((util, u), (temp, t)):
            if value is not None:
                s = series.setdefault(f"GPU {gpu}", {"x": [], "y": []})
                s["x"].append(at.isoformat())
                s["y"].append(round(value, 1))
    return {**out, "utilization": util, "temperature": temp}


# --- the fleet at a glance (the dashboard's fleet half) ---------------------------------------

_UNHEALTHY_GPU = (Node.Health.UNKNOWN, Node.Health.DEGRADED)


# The pool a node is moved to when it is sent back to the vendor (engine.node_mark_rma). Slurm
# may still list it (so ``in_service`` stays true until it is gone): it is out of service all
# the same, and its failed GPUs are the reason it left, not a fault to count.
RMA_POOL = "rma"


def _in_service(cluster: str | None) -> QuerySet[Node]:
    """The nodes in service, of one cluster (by name) or of all of them: not the replaced
    ones (gone from Slurm: ``in_service`` false) nor those sent to RMA."""
    nodes = Node.objects.filter(in_service=True).exclude(pool=RMA_POOL)
    return nodes.filter(cluster__name=cluster) if cluster else nodes


def _gpus_in_service(cluster: str | None) -> QuerySet[Gpu]:
    """Their GPUs, through a join (as the counts always were), not a subquery."""
    gpus = Gpu.objects.filter(node__in_service=True).exclude(node__pool=RMA_POOL)
    return gpus.filter(node__cluster__name=cluster) if cluster else gpus


def fleet_counts(cluster: str | None = None) -> dict[str, Any]:
    """Counts by node health, Slurm state and GPU health (of one cluster, or all): three
    aggregate queries, whatever the fleet's size."""
    H = Node.Health
    nodes = _in_service(cluster)
    # A flag is matched as its JSON string ('"DRAIN"' in '["IDLE", "DRAIN"]'): JSON
    # containment is not available on SQLite (the embedded demo).
    drained = Q(slurm_flags__icontains='"DRAIN"') | Q(slurm_flags__icontains='"DRAINED"')
    counts: dict[str, Any] = nodes.aggregate(
        nodes=Count("id"),
        healthy=Count("id", filter=Q(health=H.HEALTHY)),
        degraded=Count("id", filter=Q(health=H.DEGRADED)),
        failed=Count("id", filter=Q(health=H.FAILED)),
        unknown=Count("id", filter=Q(health=H.UNKNOWN)),
        drained=Count("id", filter=drained),
        cordoned=Count("id", filter=Q(k8s_unschedulable=True)),
        k8s_not_ready=Count("id", filter=Q(k8s_ready=False)),
    )
    counts["slurm_states"] = [
        (row["slurm_state"] or "unknown", row["n"])
        for row in nodes.values("slurm_state").annotate(n=Count("id")).order_by("-n", "slurm_state")
    ]
    gpus = _gpus_in_service(cluster).aggregate(
        gpus=Count("id"),
        gpus_healthy=Count("id", filter=Q(health=H.HEALTHY)),
        gpus_failed=Count("id", filter=Q(health=H.FAILED)),
        gpus_unknown=Count("id", filter=Q(health__in=_UNHEALTHY_GPU)),
    )
    counts.update(gpus)
    return counts


GROUP_FIELDS = {"leaf": "leaf_switch", "pool": "pool"}
# Up to this many nodes the dashboard draws every node's row; above it, one group at a time.
GRID_ALL_MAX = 64
# The most rows one grid draws (a big pool): the rest is on the Nodes page.
GRID_MAX_NODES = 512


def gpu_groups(by: str = "leaf", cluster: str | None = None) -> list[dict[str, Any]]:
    """Per leaf switch (or pool): nodes, and GPUs healthy / failed / unknown. Two grouped
    queries, so the dashboard stays fast at thousands of nodes."""
    field = GROUP_FIELDS.get(by, "leaf_switch")
    H = Node.Health
    groups: dict[str, dict[str, Any]] = {}
    nodes = _in_service(cluster)
    for row in (nodes.values(field)
                .annotate(nodes=Count("id"), nodes_failed=Count("id", filter=Q(health=H.FAILED)))
                .order_by(field)):
        groups[row[field]] = {"name": row[field], "nodes": row["nodes"],
                              "nodes_failed": row["nodes_failed"], "gpus": 0, "healthy": 0,
                              "failed": 0, "unknown": 0}
    for row in (_gpus_in_service(cluster).values(f"node__{field}")
                .annotate(gpus=Count("id"), healthy=Count("id", filter=Q(health=H.HEALTHY)),
                          failed=Count("id", filter=Q(health=H.FAILED)))
                .order_by(f"node__{field}")):
        group = groups.get(row[f"node__{field}"])
        if group is not None:
            group.update(gpus=row["gpus"], healthy=row["healthy"], failed=row["failed"],
                         unknown=row["gpus"] - row["healthy"] - row["failed"])
    for group in groups.values():
        total = group["gpus"] or 1
        # Widths of the group's bar, in percent.
        group["pct"] = {k: round(100 * group[k] / total, 1) for k in ("healthy", "failed",
                                                                      "unknown")}
    return list(groups.values())


# Up to this many group tiles on the dashboard; with more (hundreds of leaf switches), the
# tiles show the groups with failed or unknown GPUs first and a search box reaches the rest.
GROUP_TILES_MAX = 48


def gpu_group_tiles(groups: list[dict[str, Any]], selected: str | None) -> list[dict[str, Any]]:
    if len(groups) <= GROUP_TILES_MAX:
        return groups
    worst = sorted(groups, key=lambda g: (-g["failed"], -g["unknown"], g["name"]))
    tiles = worst[:GROUP_TILES_MAX]
    if selected is not None and all(g["name"] != selected for g in tiles):
        tiles += [g for g in groups if g["name"] == selected]
    return tiles


def gpu_group_default(groups: list[dict[str, Any]], total_nodes: int) -> str | None:
    """The group the dashboard opens on: none (the whole grid) for a small fleet, else the
    group with the most failed GPUs."""
    if total_nodes <= GRID_ALL_MAX or not groups:
        return None
    return max(groups, key=lambda g: (g["failed"], g["unknown"], -len(g["name"])))["name"]


def nodes_failed(cluster: str | None = None, limit: int = 20) -> list[tuple[str, str]]:
    """(name, cluster) of failed nodes in service: the grid's cells as links a keyboard
    reaches."""
    return list(_in_service(cluster).filter(health=Node.Health.FAILED).order_by("name")
                .values_list("name", "cluster__name")[:limit])


def gpu_grid(by: str = "leaf", group: str | None = None,
             cluster: str | None = None) -> dict[str, Any]:
    """Node-by-GPU health for the dashboard heatmap (z: 0 healthy, 1 unknown, 2 failed), for
    one group's nodes or, without one, for the first GRID_MAX_NODES nodes."""
    code = {Node.Health.HEALTHY: 0, Node.Health.UNKNOWN: 1, Node.Health.DEGRADED: 1,
            Node.Health.FAILED: 2}
    field = GROUP_FIELDS.get(by, "leaf_switch")
    nodes = _in_service(cluster)
    if group is not None:
        nodes = nodes.filter(**{field: group})
    total = nodes.count()
    rows = list(nodes.order_by(field, "name").values_list("id", "name", "leaf_switch", "pool", "cluster__name")
                [:GRID_MAX_NODES])
    gpus: dict[int, dict[int, tuple[Any, ...]]] = {}
    for node_id, index, health, util, temp, xid in Gpu.objects.filter(
            node_id__in=[r[0] for r in rows]).values_list(
            "node_id", "index", "health", "utilization", "temperature", "last_xid"):
        gpus.setdefault(node_id, {})[index] = (health, util, temp, xid)
    width = max((max(g) + 1 for g in gpus.values() if g), default=8)
    z, text, labels, names = [], [], [], []
    for node_id, name, leaf, pool, cluster_name in rows:
        names.append([name, cluster_name])
        mine = gpus.get(node_id, {})
        row, hover = [], []
        for i in range(width):
            g = mine.get(i)
            if g is None:
                row.append(1)
                hover.append(f"{name} GPU {i}: no data")
                continue
            health, util, temp, xid = g
            row.append(code.get(health, 1))
            hover.append(f"{name} GPU {i} · {health}<br>util {_num(util, '%')}"
                         f"<br>temp {_num(temp, ' °C')}<br>last XID {xid or 'none'}")
        z.append(row)
        text.append(hover)
        labels.append(f"{name} ({(leaf if field == 'leaf_switch' else pool) or '?'})")
    return {"z": z, "text": text, "y": labels, "x": [f"GPU {i}" for i in range(width)],
            # Each row's node and cluster: a click on a cell opens the node's page.
            "nodes": names,
            "by": by, "group": group, "total": total, "truncated": total > len(rows)}


def _num(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


# --- sources --------------------------------------------------------------------------------


# Which dashboard figures each source feeds: while a source is down, what it fed is as old as
# its last success, and the dashboard marks those figures stale rather than show them as now.
# Node health is judged from the GPUs' telemetry (services._gpus); which nodes exist and are
# in service, from Slurm's list.
SOURCE_FEEDS: dict[str, frozenset[str]] = {
    "slurm": frozenset({"nodes", "drained", "slurm_states"}),
    "kubernetes": frozenset({"cordoned", "k8s_not_ready"}),
    "telemetry": frozenset({"healthy", "failed", "unknown", "gpus", "gpus_failed", "grid"}),
}


def stale_figures(sources: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each figure fed by a source that is down, with the names of those sources."""
    stale: dict[str, list[str]] = {}
    for item in sources:
        s = item["source"]
        if s.healthy is False:
            for figure in SOURCE_FEEDS.get(s.name, ()):
                stale.setdefault(figure, []).append(s.name)
    return stale


def sources_health(cluster: str | None = None) -> list[dict[str, Any]]:
    """Each collector's health with its lag (now - last success), per cluster."""
    now = timezone.now()
    rows = SourceHealth.objects.select_related("cluster").order_by("cluster__name", "name")
    if cluster:
        rows = rows.filter(cluster__name=cluster)
    return [{"source": s, "lag": (now - s.last_success_at).total_seconds()
             if s.last_success_at else None} for s in rows]


def sources_overview(runs_per_source: int = 10) -> list[dict[str, Any]]:
    """Each collector's health, lag and last runs: two queries (the runs ranked per source
    by a window function)."""
    ranked = (CollectorRun.objects.annotate(rank=Window(
        RowNumber(), partition_by=[F("cluster_id"), F("source")],
        order_by=[F("started_at").desc(), F("id").desc()])).filter(rank__lte=runs_per_source)
        .order_by("source", "-started_at"))
    runs: dict[tuple[int, str], list[CollectorRun]] = {}
    for run in ranked:
        runs.setdefault((run.cluster_id, run.source), []).append(run)
    out = []
    for item in sources_health():
        s = item["source"]
        mine = runs.pop((s.cluster_id, s.name), [])
        out.append({**item, "runs": mine, "failed_runs": sum(not r.ok for r in mine)})
    return out


# --- nodes and jobs -------------------------------------------------------------------------


def nodes_for_list() -> QuerySet[Node]:
    """Nodes with their GPUs counted (total, healthy, failed), so the list sorts by them."""
    H = Node.Health
    return Node.objects.select_related("cluster").annotate(
        gpus_total=Count("gpus"), gpus_healthy=Count("gpus", filter=Q(gpus__health=H.HEALTHY)),
        gpus_failed=Count("gpus", filter=Q(gpus__health=H.FAILED))).order_by("name")


def node_facets() -> dict[str, list[str]]:
    """The values the node filters offer (distinct states, pools, leaves)."""
    nodes = Node.objects.order_by()
    return {
        "slurm_states": sorted(s for s in nodes.values_list("slurm_state", flat=True).distinct()
                               if s),
        "pools": sorted(p for p in nodes.values_list("pool", flat=True).distinct() if p),
        "leaves": sorted(x for x in nodes.values_list("leaf_switch", flat=True).distinct() if x),
    }


def node_get(name: str, cluster: str | None = None) -> Node | None:
    nodes = Node.objects.select_related("cluster").filter(name=name)
    if cluster:
        nodes = nodes.filter(cluster__name=cluster)
    return nodes.order_by("cluster_id").first()


def node_detail(node: Node) -> dict[str, Any]:
    """A node's page: its GPUs, jobs and recent signals, and what other apps add to it
    (``node_page``: incidents and repair history)."""
    has = json_list_has(node.name)
    out: dict[str, Any] = {
        "node": node,
        "gpus": list(node.gpus.order_by("index")),
        # Each job with the GPUs it holds here ("0-3"; "" where Slurm did not say).
        "jobs": [(job, index_ranges(job.gpus[node.name]) if node.name in (job.gpus or {})
                  else "")
                 for job in Job.objects.filter(cluster=node.cluster, nodes__icontains=has)
                 .order_by("-updated_at")[:50]],
        "signals": list(Signal.objects.filter(cluster=node.cluster, node_name=node.name)
                        .order_by("-observed_at", "-id")[:50]),
        # The NIC ports' last readings (state, link_downed, link_error_recovery per port).
        "nic_ports": sorted((node.nic_ports or {}).items()),
        # fleetwatch.io/ annotations and the like, as the Kubernetes collector stored them.
        "k8s_annotations": sorted((node.k8s_annotations or {}).items()),
        "k8s_labels": sorted((node.k8s_labels or {}).items()),
        "k8s_taints": [tuple(t) for t in node.k8s_taints or []],
        # type -> (status, reason, message), the kubelet's and health tools' alike.
        "k8s_conditions": sorted((kind, *value) for kind, value in
                                 (node.k8s_conditions or {}).items()),
    }
    gpus: list[Gpu] = out["gpus"]
    dcgm_last = gpu_dcgm_last(node)
    out["gpu_rows"] = [{"gpu": g, "clock_events": clock_event_reasons(g.clock_event_reasons),
                        "dcgm": dcgm_last.get(g.index, [])} for g in gpus]
    for _, more in node_page.send(sender=Node, node=node):
        out.update(cast("dict[str, Any]", more))  # a dict each (the stubs say str | None)
    return out


# How many of a node's newest DCGM field signals the node page reads for its GPUs' last
# readings (a change is a signal, so a quiet GPU has few).
DCGM_SIGNALS_READ = 500


def gpu_dcgm_last(node: Node) -> dict[int, list[tuple[str, Any, datetime]]]:
    """Per GPU, the last value of each DCGM field a signal recorded (remapped rows, ECC double
    bit errors, ...): (metric, value, when), as the collector stored them on a change."""
    last: dict[int, dict[str, tuple[str, Any, datetime]]] = {}
    for gpu, data, at in (Signal.objects.filter(cluster=node.cluster, node_name=node.name,
                                                kind="dcgm_field", gpu_index__isnull=False)
                          .order_by("-observed_at", "-id")
                          .values_list("gpu_index", "data", "observed_at")[:DCGM_SIGNALS_READ]):
        metric = str((data or {}).get("metric", ""))
        if metric and gpu is not None:  # gpu_index__isnull=False: never None
            last.setdefault(gpu, {}).setdefault(metric, (metric, (data or {}).get("value"), at))
    return {gpu: sorted(fields.values()) for gpu, fields in last.items()}


# --- what a node's page reads from its sources as it renders ---------------------------------

# Seconds the node page waits for telemetry and for Kubernetes (both asked at once; less when
# FLEETWATCH_HTTP_TIMEOUT is shorter). A source that is slow or down costs the page this much
# at most, and the page says it could not read it instead of failing.
PAGE_READ_TIMEOUT = 3.0

NVLINK_ERROR_NAMES = {dcgm.NVLINK_CRC_FLIT_ERRORS: "CRC flit", dcgm.NVLINK_CRC_DATA_ERRORS: "CRC data",
                      dcgm.NVLINK_REPLAY_ERRORS: "replay", dcgm.NVLINK_RECOVERY_ERRORS: "recovery"}


@dataclass(frozen=True)
class GpuReadings:
    """One GPU's dcgm-exporter readings, as the node page shows them. Each is None where
    the exporter reported nothing (a field it does not export, a GPU off the bus): shown as
    not reported, never as 0."""

    index: int
    values: Mapping[str, float]

    def _get(self, name: str) -> float | None:
        return self.values.get(name)

    def _flag(self, name: str) -> bool | None:
        value = self.values.get(name)
        return None if value is None else value != 0

    @property
    def reported(self) -> bool:
        return bool(self.values)

    @property
    def power(self) -> float | None:
        return self._get(dcgm.POWER_USAGE)

    @property
    def power_limit(self) -> float | None:
        return self._get(dcgm.POWER_MGMT_LIMIT)

    @property
    def sm_clock(self) -> float | None:
        return self._get(dcgm.SM_CLOCK)

    @property
    def mem_clock(self) -> float | None:
        return self._get(dcgm.MEM_CLOCK)

    @property
    def fb_used(self) -> float | None:
        return self._get(dcgm.FB_USED)

    @property
    def fb_free(self) -> float | None:
        return self._get(dcgm.FB_FREE)

    @property
    def ecc_sbe(self) -> float | None:
        return self._get(dcgm.ECC_SBE_VOL_TOTAL)

    @property
    def ecc_dbe(self) -> float | None:
        return self._get(dcgm.ECC_DBE_VOL_TOTAL)

    @property
    def rows_correctable(self) -> float | None:
        return self._get(dcgm.CORRECTABLE_REMAPPED_ROWS)

    @property
    def rows_uncorrectable(self) -> float | None:
        return self._get(dcgm.UNCORRECTABLE_REMAPPED_ROWS)

    @property
    def remap_pending(self) -> bool | None:
        return self._flag(dcgm.ROW_REMAP_PENDING)

    @property
    def remap_failure(self) -> bool | None:
        return self._flag(dcgm.ROW_REMAP_FAILURE)

    @property
    def nvlink_errors(self) -> list[tuple[str, float]]:
        """(counter, total) of each NVLink error counter reported."""
        return [(label, self.values[name]) for name, label in NVLINK_ERROR_NAMES.items()
                if name in self.values]

    @property
    def nvlink_errors_seen(self) -> list[tuple[str, float]]:
        """The reported NVLink error counters that are not 0."""
        return [(label, n) for label, n in self.nvlink_errors if n]

    @property
    def nvlink_tx(self) -> float | None:
        return self._get(dcgm.PROF_NVLINK_TX_BYTES)

    @property
    def nvlink_rx(self) -> float | None:
        return self._get(dcgm.PROF_NVLINK_RX_BYTES)

    @property
    def nvlink_gbs(self) -> tuple[float | None, float | None]:
        """(transmit, receive) in GB/s."""
        return (None if self.nvlink_tx is None else self.nvlink_tx / 1e9,
                None if self.nvlink_rx is None else self.nvlink_rx / 1e9)

    @property
    def nvlink_counter(self) -> float | None:
        """The raw bandwidth counter, shown only where the byte rates are not exported."""
        if self.nvlink_tx is not None or self.nvlink_rx is not None:
            return None
        return self._get(dcgm.NVLINK_BANDWIDTH_TOTAL)

    @property
    def pcie_gen(self) -> float | None:
        return self._get(dcgm.PCIE_LINK_GEN)

    @property
    def pcie_gen_max(self) -> float | None:
        return self._get(dcgm.PCIE_MAX_LINK_GEN)

    @property
    def pcie_width(self) -> float | None:
        return self._get(dcgm.PCIE_LINK_WIDTH)

    @property
    def pcie_width_max(self) -> float | None:
        return self._get(dcgm.PCIE_MAX_LINK_WIDTH)

    @property
    def idle(self) -> bool:
        """The GPU says its clocks are down because it has nothing to do."""
        for name in dcgm.CLOCK_REASONS:
            if name in self.values:
                return bool(int(self.values[name]) & dcgm.GPU_IDLE)
        return False

    @property
    def pcie_idle_gen(self) -> bool:
        """A generation below the maximum on an idle GPU: the link steps down to save power
        and back up under load, as NVIDIA's GPUs do; not a fault."""
        gen, top = self.pcie_gen, self.pcie_gen_max
        return self.idle and gen is not None and top is not None and gen < top

    @property
    def pcie_below_max(self) -> bool:
        """The link trained below what the GPU and slot support (lanes short, or a
        generation short while the GPU works): its transfers are slower, and nothing else
        says so."""
        gen, top = self.pcie_gen, self.pcie_gen_max
        width, widest = self.pcie_width, self.pcie_width_max
        return (width is not None and widest is not None and width < widest) or (
            gen is not None and top is not None and gen < top and not self.idle)

    @property
    def pcie_replays(self) -> float | None:
        return self._get(dcgm.PCIE_REPLAY_COUNTER)

    @property
    def clock_events(self) -> list[str] | None:
        """The clock-event reasons in words (either field name), None if not reported."""
        for name in dcgm.CLOCK_REASONS:
            if name in self.values:
                return clock_event_reasons(int(self.values[name]))
        return None


def _not_exported(readings: list[GpuReadings]) -> list[str]:
    """The page's fields no GPU of the node reported (none if no GPU reported anything:
    then the exporter is silent, not short of fields). The clock-event reasons count under
    either name, and the raw NVLink counter is not missed where the byte rates are there."""
    seen = {name for r in readings for name in r.values}
    if not seen:
        return []
    if seen & set(dcgm.CLOCK_REASONS):
        seen |= set(dcgm.CLOCK_REASONS)
    if seen & {dcgm.PROF_NVLINK_TX_BYTES, dcgm.PROF_NVLINK_RX_BYTES}:
        seen.add(dcgm.NVLINK_BANDWIDTH_TOTAL)
    seen.add(dcgm.CLOCK_THROTTLE_REASONS)  # the old name: never asked of a newer exporter
    return [name for name in dcgm.NODE_PAGE_FIELDS if name not in seen]


def node_gpu_readings(cluster: str, node: str, gpus: list[int],
                      timeout: float) -> dict[str, Any]:
    """The node's GPUs' dcgm-exporter readings now (``dcgm.NODE_PAGE_FIELDS``): ``gpus``
    (one row per GPU the node has or reports), the fields not exported, and ``error``, why
    they could not be read. Raises nothing."""
    config = sources_of(cluster)
    if "telemetry" not in config.sources:
        return {"gpus": [], "missing": [], "error": "telemetry is not collected for this "
                "cluster (FLEETWATCH_SOURCES)"}
    values = page_telemetry(cluster, timeout).gpu_readings([node], dcgm.NODE_PAGE_FIELDS)
    indexes = sorted(set(gpus) | {g for n, g in values if n == node})
    rows = [GpuReadings(g, values.get((node, g), {})) for g in indexes]
    return {"gpus": rows, "missing": _not_exported(rows), "error": ""}


def node_pods(cluster: str, node: str, timeout: float) -> dict[str, Any]:
    """The pods on the Kubernetes node ``node`` (the machine's name: under Slinky not
    Slurm's), each with whether it carries the no-auto-replace label, and ``error``."""
    if "kubernetes" not in sources_of(cluster).sources:
        return {"pods": [], "error": "Kubernetes is not watched for this cluster "
                "(FLEETWATCH_SOURCES)"}
    pods: list[K8sPod] = page_kubernetes(cluster, timeout).pods_on_node(node)
    return {"pods": [(p, p.labels.get(NO_AUTO_REPLACE_LABEL) == "true")
                     for p in sorted(pods, key=lambda p: (p.namespace, p.name))], "error": ""}


def _answer(future: Future[dict[str, Any]], what: str, deadline: float,
            empty: dict[str, Any]) -> dict[str, Any]:
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        return {**empty, "error": f"{what} did not answer within {PAGE_READ_TIMEOUT:g} s"}
    except ClientError as exc:
        return {**empty, "error": f"{what} unavailable: {exc}"}
    except Exception:
        # A bug, not an outage: logged with its traceback, and the rest of the page shown.
        log.exception("node page: reading %s failed", what)
        return {**empty, "error": f"{what} could not be read: an internal error (see the "
                "web server's log)"}


def node_live(node: Node) -> dict[str, Any]:
    """What the node's page reads from its sources as it renders, asked at once and each
    given up after PAGE_READ_TIMEOUT: ``readings`` (``node_gpu_readings``) and ``pods``
    (``node_pods``). A source that is down, slow or not configured leaves its part empty
    with the reason in its ``error``, never an error page."""
    timeout = min(PAGE_READ_TIMEOUT, settings.FLEETWATCH_HTTP_TIMEOUT)
    cluster = node.cluster.name
    gpus = list(node.gpus.values_list("index", flat=True))
    calls: dict[str, tuple[str, Callable[[], dict[str, Any]], dict[str, Any]]] = {
        "readings": ("Telemetry", lambda: node_gpu_readings(cluster, node.name, gpus, timeout),
                     {"gpus": [GpuReadings(g, {}) for g in sorted(gpus)], "missing": []}),
        "pods": ("Kubernetes", lambda: node_pods(cluster, node.name, timeout), {"pods": []}),
    }
    # A thread each: the page waits for the slower source, not for both in turn.
    pool = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="node-page")
    try:
        futures = {key: pool.submit(fn) for key, (_, fn, _) in calls.items()}
        deadline = time.monotonic() + timeout + 1.0
        return {key: _answer(futures[key], what, deadline, empty)
                for key, (what, _, empty) in calls.items()}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)



def jobs_for_list() -> QuerySet[Job]:
    return Job.objects.select_related("cluster").order_by("-updated_at", "slurm_id")


def job_facets() -> dict[str, list[str]]:
    jobs = Job.objects.order_by()
    return {"states": sorted(s for s in jobs.values_list("state", flat=True).distinct() if s)}


def job_get(slurm_id: str, cluster: str | None = None) -> Job | None:
    jobs = Job.objects.select_related("cluster").filter(slurm_id=slurm_id)
    if cluster:
        jobs = jobs.filter(cluster__name=cluster)
    return jobs.order_by("cluster_id").first()


def job_detail(job: Job) -> dict[str, Any]:
    """A job's page: its nodes (with their health) and its signals, and what other apps add
    to it (``job_page``: the incidents that hit it)."""
    names = list(job.nodes or [])
    by_name = {n.name: n for n in Node.objects.filter(cluster=job.cluster, name__in=names)}
    out: dict[str, Any] = {
        "job": job,
        "nodes": [(name, by_name.get(name),
                   index_ranges(job.gpus[name]) if name in (job.gpus or {}) else "")
                  for name in names],
        "signals": list(Signal.objects.filter(cluster=job.cluster, job_id=job.slurm_id)
                        .order_by("-observed_at", "-id")[:50]),
    }
    for _, more in job_page.send(sender=Job, job=job):
        out.update(cast("dict[str, Any]", more))  # a dict each (the stubs say str | None)
    return out
