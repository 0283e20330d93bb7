"""Reads for lending: every node's use (training, inference, in repair, RMA) and its GPUs,
Slurm's pending demand, capacity by pool now and over time, what could be lent now.

A handful of queries per cluster whatever its size (nodes, GPU counts grouped by node, the
running jobs, the live loans, the nodes in repair), so the beat's tick and the snapshot stay
cheap at 12,500 nodes (tests/bench/lending.py measures both).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Max, Q
from django.db.models.fields.json import KeyTextTransform
from django.utils import timezone

from collectors.clients.base import K8S_CORDONED_BY
from collectors.knowledge.slurm import drained_by
from collectors.models import Cluster, CollectorRun, Gpu, Job, Node, SourceHealth
from incidents.lending import decide
from incidents.lending.steps import CORDONED_BY_FLEETWATCH, JOB_ON_NODE, TITLES
from incidents.models import CapacitySnapshot, LendingState, Loan
from incidents.remediation import policy

# GPUs by use: what the capacity page counts and the chart draws, in this order.
CATEGORIES = ("training_allocated", "training_idle", "training_drained", "moving",
              "inference_allocated", "inference_idle", "repairing", "rma")
CATEGORY_LABELS = {
    "training_allocated": "Slurm training: allocated",
    "training_idle": "Slurm training: idle",
    "training_drained": "Slurm training: drained",
    "moving": "moving between them",
    "inference_allocated": "Kubernetes inference: allocated",
    "inference_idle": "Kubernetes inference: idle",
    "repairing": "out of service: repairing",
    "rma": "out of service: RMA",
}
# Pending jobs that are not demand yet: held, or waiting for another job or a start time.
NOT_DEMAND_REASONS = ("held", "dependency", "begintime", "reservation")
# A Slurm read older than this is not read as today's demand (several missed polls).
STALE_AFTER = timedelta(minutes=3)


@dataclass(frozen=True)
class NodeUse:
    name: str
    pool: str
    use: str  # decide.USES
    category: str  # CATEGORIES: where most of its GPUs count
    gpus: int
    allocated: int  # GPUs busy (Slurm jobs, or inference by telemetry)
    blocked: str = ""  # why FleetWatch may not lend it now
    slurm_name: str = ""
    loan: int | None = None
    loan_status: str = ""
    lent_at: float | None = None
    returned_at: float | None = None

    def counts(self) -> dict[str, int]:
        """The node's GPUs by category."""
        if self.category == "training_allocated":
            return {"training_allocated": self.allocated,
                    "training_idle": self.gpus - self.allocated}
        if self.category in ("inference_allocated", "inference_idle"):
            return {"inference_allocated": self.allocated,
                    "inference_idle": self.gpus - self.allocated}
        return {self.category: self.gpus}


@dataclass(frozen=True)
class Demand:
    known: bool  # False: Slurm's figures are missing or stale, never read as "no demand"
    jobs: int = 0
    gpus: int = 0
    oldest_wait_seconds: float | None = None
    gpu_weighted_wait_seconds: float | None = None
    read_at: datetime | None = None
    why_unknown: str = ""
    waiting: list[dict[str, Any]] = field(default_factory=list)  # the longest-waiting jobs


def _fresh_slurm_run(cluster: Cluster) -> tuple[datetime | None, str]:
    """When the latest successful Slurm read began (rows it wrote are newer), or why none
    can be trusted."""
    health = SourceHealth.objects.filter(cluster=cluster, name="slurm").first()
    if health is None or health.last_success_at is None:
        return None, "Slurm has not been read yet"
    if health.healthy is False:
        return None, f"Slurm's last read failed: {health.last_error[:200]}"
    if timezone.now() - health.last_success_at > max(
            STALE_AFTER, timedelta(seconds=settings.FLEETWATCH_COLLECT_INTERVAL * 5)):
        return None, f"Slurm was last read at {health.last_success_at:%H:%M:%S}"
    started = (CollectorRun.objects.filter(cluster=cluster, source="slurm", ok=True)
               .order_by("-started_at").values_list("started_at", flat=True).first())
    return started or health.last_success_at - timedelta(minutes=1), ""


def pending_demand(cluster: Cluster, *, waiting: int = 10) -> Demand:
    """Slurm's pending GPU demand now: the jobs its latest read listed PENDING (held ones and
    those waiting on a dependency or a start time are not demand yet)."""
    since, why = _fresh_slurm_run(cluster)
    if since is None:
        return Demand(False, why_unknown=why)
    rows = list(Job.objects.filter(cluster=cluster, state="PENDING", updated_at__gte=since)
                .values_list("slurm_id", "name", "user", "gpus_requested", "submitted_at",
                             "state_reason"))
    now = timezone.now()
    jobs = [r for r in rows if not any(k in r[5].lower() for k in NOT_DEMAND_REASONS)]
    gpus = sum(r[3] or 0 for r in jobs)
    waits = [((now - r[4]).total_seconds(), r[3] or 0) for r in jobs if r[4] is not None]
    weighted = (sum(w * g for w, g in waits) / sum(g for _, g in waits)
                if waits and sum(g for _, g in waits) else None)
    longest = sorted(jobs, key=lambda r: r[4] or now)[:waiting]
    return Demand(True, len(jobs), gpus, max((w for w, _ in waits), default=None), weighted,
                  read_at=since,
                  waiting=[{"job": r[0], "name": r[1], "user": r[2], "gpus": r[3],
                            "reason": r[5], "waiting_seconds":
                            (now - r[4]).total_seconds() if r[4] else None} for r in longest])


def _held_gpus(cluster: Cluster, since: datetime | None) -> dict[str, set[int] | None]:
    """Per node, the GPU indices its running jobs hold (None: a job that did not say which:
    count the whole node)."""
    rows = Job.objects.filter(cluster=cluster, state__in=JOB_ON_NODE)
    if since is not None:
        rows = rows.filter(updated_at__gte=since)
    held: dict[str, set[int] | None] = {}
    for nodes, gpus in rows.values_list("nodes", "gpus"):
        for node in nodes or []:
            indices = (gpus or {}).get(node)
            if indices is None or held.get(node, set()) is None:
                held[node] = None
            else:
                held.setdefault(node, set()).update(indices)  # type: ignore[union-attr]
    return held


def node_uses(cluster: Cluster) -> list[NodeUse]:
    """Every node of the cluster in service (and those sent for RMA): its use and GPUs."""
    busy_util = settings.FLEETWATCH_LEND_BUSY_UTILIZATION
    per_node = settings.FLEETWATCH_LEND_GPUS_PER_NODE
    gpu_rows = {row["node_id"]: (row["n"], row["busy"]) for row in Gpu.objects.filter(
        node__cluster=cluster).values("node_id").annotate(
        n=Count("id"), busy=Count("id", filter=Q(utilization__gte=busy_util))).order_by()}
    since, _ = _fresh_slurm_run(cluster)
    held = _held_gpus(cluster, since)
    live = {row["node"]: row for row in Loan.objects.filter(
        cluster=cluster, status__in=Loan.LIVE).values("node", "id", "status", "step",
                                                      "lent_at")}
    cooldown = timedelta(minutes=settings.FLEETWATCH_LEND_COOLDOWN_MINUTES)
    returned = dict(Loan.objects.filter(
        cluster=cluster, status=Loan.Status.RETURNED,
        returned_at__gte=timezone.now() - max(cooldown, timedelta(hours=1)))
        .values_list("node").annotate(at=Max("returned_at")).order_by())
    repairing = policy.nodes_in_remediation(cluster.pk)
    out = []
    # The cordon's owner alone, not every node's annotations: decoding 12,500 JSON maps was
    # most of this read's time.
    for row in (Node.objects.filter(cluster=cluster).filter(Q(in_service=True) | Q(pool="rma"))
                .annotate(cordoned_by=KeyTextTransform(K8S_CORDONED_BY, "k8s_annotations"))
                .values("id", "name", "pool", "slurm_name", "slurm_state", "slurm_flags",
                        "slurm_reason", "k8s_ready", "k8s_unschedulable", "cordoned_by",
                        "health").order_by("name")):
        gpus, busy = gpu_rows.get(row["id"], (0, 0))
        gpus = gpus or per_node
        name = row["name"]
        loan = live.get(name)
        at = returned.get(name)
        common: dict[str, Any] = {
            "name": name, "pool": row["pool"], "gpus": gpus, "slurm_name": row["slurm_name"],
            "loan": loan["id"] if loan else None, "loan_status": loan["status"] if loan else "",
            "lent_at": loan["lent_at"].timestamp() if loan and loan["lent_at"] else None,
            "returned_at": at.timestamp() if at else None}
        out.append(_classify(row, loan, name in repairing, held, busy, common))
    return out


def _classify(row: Mapping[str, Any], loan: Mapping[str, Any] | None, repairing: bool,
              held: dict[str, set[int] | None], busy: int, common: dict[str, Any]) -> NodeUse:
    gpus = common["gpus"]
    inference = min(busy, gpus)
    status = loan["status"] if loan else ""
    if row["pool"] == "rma":
        return NodeUse(**common, use=decide.OUT, category="rma", allocated=0,
                       blocked="sent for RMA")
    if status in (Loan.Status.LENT, Loan.Status.RETURN_PROPOSED):
        use = decide.RETURNING if status == Loan.Status.RETURN_PROPOSED else decide.LENT
        if repairing:
            use = decide.LENT  # handed to its repair by the tick
        return NodeUse(**common, use=use, allocated=inference,
                       category="inference_allocated" if inference else "inference_idle")
    if status == Loan.Status.LENDING:
        return NodeUse(**common, use=decide.LENDING, category="moving", allocated=0)
    if status == Loan.Status.RETURNING:
        return NodeUse(**common, use=decide.RETURNING, category="moving", allocated=0)
    if status == Loan.Status.FAILED:
        return NodeUse(**common, use=decide.OUT, category="moving", allocated=0,
                       blocked=f"loan {loan['id'] if loan else ''} stopped: needs a person")
    if repairing or row["health"] == Node.Health.FAILED:
        return NodeUse(**common, use=decide.OUT, category="repairing", allocated=0,
                       blocked="in repair" if repairing else "failed")
    if not row["slurm_state"]:
        # Not a Slurm node (a Kubernetes-only inference node): inference capacity, never lent.
        return NodeUse(**common, use=decide.OUT, allocated=inference,
                       category="inference_allocated" if inference else "inference_idle",
                       blocked="not a Slurm node")
    flags = row["slurm_flags"] or []
    if row["slurm_state"] == "DOWN" or "DRAIN" in flags or "DRAINED" in flags:
        return NodeUse(**common, use=decide.OUT, category="training_drained", allocated=0,
                       blocked=f"{row['slurm_state']} in Slurm, drained by "
                       f"{drained_by(row['slurm_reason'])}: {row['slurm_reason'] or 'no reason'}")
    use = _training(row, held, common)
    if status == Loan.Status.PROPOSED:
        # A lend waiting for approval counts as on its way out: the floor and the ceiling
        # count it, and no second proposal piles up behind it.
        return NodeUse(**{**use.__dict__, "use": decide.LENDING})
    return use


def _training(row: Mapping[str, Any], held: dict[str, set[int] | None],
              common: dict[str, Any]) -> NodeUse:
    name, gpus = row["name"], common["gpus"]
    indices = held.get(name, set())
    allocated = gpus if indices is None else min(gpus, len(indices))
    if row["slurm_state"] == "ALLOCATED" and not allocated:
        allocated = gpus  # Slurm says whole node busy though no job row says which GPUs
    blocked = ""
    if row["k8s_unschedulable"] and row["cordoned_by"] != CORDONED_BY_FLEETWATCH:
        blocked = "cordoned in Kubernetes by someone else"
    elif row["k8s_ready"] is not True:
        blocked = ("not Ready in Kubernetes" if row["k8s_ready"] is False
                   else "Kubernetes has not reported it Ready")
    elif row["health"] == Node.Health.DEGRADED:
        blocked = "its health is degraded"
    busy = allocated > 0 or row["slurm_state"] in ("ALLOCATED", "MIXED", "COMPLETING")
    return NodeUse(**common, use=decide.TRAINING_BUSY if busy else decide.TRAINING_IDLE,
                   category="training_allocated", allocated=allocated, blocked=blocked)


def _tally(uses: Iterable[NodeUse]) -> dict[str, int]:
    counts = dict.fromkeys(CATEGORIES, 0)
    for use in uses:
        for category, n in use.counts().items():
            counts[category] += n
    return counts


def capacity_counts(uses: list[NodeUse], demand: Demand) -> dict[str, dict[str, Any]]:
    """Per pool: GPUs by category, nodes lent and moving, and the cluster's demand."""
    pools: dict[str, list[NodeUse]] = {}
    for use in uses:
        pools.setdefault(use.pool, []).append(use)
    out = {}
    for pool, members in sorted(pools.items()):
        out[pool] = {**_tally(members),
                     "nodes": len(members),
                     "nodes_lent": sum(u.loan_status in (Loan.Status.LENT,
                                                         Loan.Status.RETURN_PROPOSED)
                                       for u in members),
                     "nodes_moving": sum(u.category == "moving" for u in members),
                     "nodes_training": sum(u.use in (decide.TRAINING_IDLE, decide.TRAINING_BUSY)
                                           for u in members),
                     "pending_jobs": demand.jobs if demand.known else None,
                     "pending_gpus": demand.gpus if demand.known else None,
                     "pending_wait_seconds": demand.oldest_wait_seconds}
    return out


def decision_views(uses: list[NodeUse]) -> list[decide.NodeView]:
    """What the decision is given: the Slurm nodes of the pools (RMA and Kubernetes-only
    nodes are no training capacity to keep or lend)."""
    return [decide.NodeView(u.name, u.pool, u.use, u.gpus, u.blocked, u.returned_at, u.lent_at)
            for u in uses if u.category != "rma" and u.blocked != "not a Slurm node"]


def policy_from_settings() -> decide.Policy:
    return decide.Policy(
        floor={pool: decide.Share.parse(v) for pool, v in settings.FLEETWATCH_LEND_FLOOR.items()},
        ceiling={pool: decide.Share.parse(v)
                 for pool, v in settings.FLEETWATCH_LEND_CEILING.items()},
        lend_below_gpus=settings.FLEETWATCH_LEND_BELOW_GPUS,
        return_above_gpus=settings.FLEETWATCH_LEND_RETURN_ABOVE_GPUS,
        idle_seconds=settings.FLEETWATCH_LEND_IDLE_MINUTES * 60,
        quiet_seconds=settings.FLEETWATCH_LEND_QUIET_MINUTES * 60,
        demand_seconds=settings.FLEETWATCH_LEND_RETURN_AFTER_MINUTES * 60,
        cooldown_seconds=settings.FLEETWATCH_LEND_COOLDOWN_MINUTES * 60,
        max_moves=settings.FLEETWATCH_LEND_MAX_MOVES)


def pool_mode(pool: str) -> str:
    modes = settings.FLEETWATCH_LEND_MODES
    return str(modes.get(pool) or modes.get(decide.EVERY_POOL) or settings.FLEETWATCH_LEND_MODE)


def capacity(cluster: Cluster) -> dict[str, Any]:
    """The capacity page and API: now, by pool; the demand; the nodes that could be lent now
    (idle in Slurm, FleetWatch's to lend, room under the pool's floor and ceiling); the
    loans; the last automatic decision."""
    uses = node_uses(cluster)
    demand = pending_demand(cluster)
    counts = capacity_counts(uses, demand)
    rules = policy_from_settings()
    figures = {f.pool: f for f in decide.pool_figures(decision_views(uses), rules)}
    pools: list[dict[str, Any]] = []
    room: dict[str, int] = {}
    for pool, row in counts.items():
        fig = figures.get(pool)
        room[pool] = max(0, min(fig.training - fig.floor, fig.ceiling - fig.lent) if fig else 0)
        pools.append({"pool": pool, "counts": row, "mode": pool_mode(pool),
                      "floor": fig.floor if fig else 0, "ceiling": fig.ceiling if fig else 0,
                      "floor_setting": str(rules._share(rules.floor, pool)),
                      "ceiling_setting": str(rules._share(rules.ceiling, pool)),
                      "training": fig.training if fig else 0, "lent": fig.lent if fig else 0,
                      "room": room[pool]})
    lendable = [u for u in uses if u.use == decide.TRAINING_IDLE and not u.blocked
                and room.get(u.pool, 0) > 0]
    can = {u.name for u in lendable}
    not_lendable = [u for u in uses if u.use in (decide.TRAINING_IDLE, decide.TRAINING_BUSY)
                    and u.name not in can]
    state = LendingState.objects.filter(cluster=cluster).first()
    return {
        "cluster": cluster.name,
        "totals": _tally(uses),
        "pools": pools,
        "demand": demand,
        "lendable": lendable,
        "not_lendable": not_lendable[:50],
        "loans": list(Loan.objects.filter(cluster=cluster, status__in=Loan.LIVE)
                      .order_by("node")),
        "recent": list(Loan.objects.filter(cluster=cluster).exclude(status__in=Loan.LIVE)
                       .order_by("-finished_at", "-id")[:20]),
        "decision": state.last_decision if state else {},
        "decided_at": state.decided_at if state else None,
        "lend_steps": [TITLES[s] for s in TITLES if s.startswith("lend")],
        "return_steps": [TITLES[s] for s in TITLES if s.startswith("return")],
    }


CHART_RANGES = {"day": timedelta(days=1), "week": timedelta(days=7)}


def capacity_chart(cluster: Cluster, span: str = "day", pool: str | None = None
                   ) -> dict[str, Any]:
    """The capacity chart from the stored snapshots: GPUs by use (stacked), nodes lent and
    Slurm's pending GPUs over the last day or week. A week of snapshots every 5 min is 2,016
    points per pool; pools are summed per snapshot time."""
    since = timezone.now() - CHART_RANGES[span]
    rows = CapacitySnapshot.objects.filter(cluster=cluster, at__gte=since).order_by("at", "id")
    if pool is not None:
        rows = rows.filter(pool=pool)
    by_time: dict[datetime, dict[str, float]] = {}
    demand: dict[datetime, float | None] = {}
    for at, counts in rows.values_list("at", "counts"):
        into = by_time.setdefault(at, {})
        for key in (*CATEGORIES, "nodes_lent", "nodes_training"):
            into[key] = into.get(key, 0) + float(counts.get(key) or 0)
        demand[at] = counts.get("pending_gpus")
    times = sorted(by_time)
    stamps = [t.isoformat() for t in times]
    return {
        "range": span,
        "gpus": {CATEGORY_LABELS[c]: {"x": stamps, "y": [by_time[t].get(c, 0) for t in times]}
                 for c in CATEGORIES},
        "demand": {"pending GPUs in Slurm": {"x": stamps, "y": [demand[t] for t in times]},
                   "GPUs serving inference": {"x": stamps, "y": [
                       by_time[t].get("inference_allocated", 0)
                       + by_time[t].get("inference_idle", 0) for t in times]}},
        "nodes": {"lent": {"x": stamps, "y": [by_time[t].get("nodes_lent", 0) for t in times]},
                  "training": {"x": stamps, "y": [by_time[t].get("nodes_training", 0)
                                                  for t in times]}},
    }
