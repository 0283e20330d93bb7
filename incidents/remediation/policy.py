"""The remediation policy: which playbook, in which mode, and whether the safety rails let it
run on its own.

Read by ``transitions.remediation_open`` and on approval. The rails, in the order they are checked:
- one remediation per node at a time (a second one for a busy node waits);
- a node remediated FLEETWATCH_RMA_AFTER times in a week is escalated for RMA, not repaired again;
- a node repaired less than FLEETWATCH_COOLDOWN_MINUTES ago waits for a person;
- the storm brake: more than FLEETWATCH_STORM_INCIDENTS new incidents of one root cause in
  FLEETWATCH_STORM_MINUTES pause automation of that cause (a storm is one event with one
  signature: a driver rollout's XIDs on 500 nodes hold each other, not a memory fault on
  another node meanwhile, which the fleet budget below still bounds);
- the fleet budget: at most FLEETWATCH_BUDGET_MAX_NODES nodes, and FLEETWATCH_BUDGET_MAX_PERCENT
  of a node pool or a leaf switch, in remediation at once.
A rail never refuses outright: it holds the remediation for a person's approval and says why.
Fire drills' incidents (incidents.drills) are rehearsals: they run their root cause's first
playbook whatever the history, pass no rail but "one remediation per node", and no rail, budget
or brake counts them.
Every rail counts within the incident's cluster (node names repeat across clusters; a storm
in one cluster must not stop repairs in another); the limits are FleetWatch's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.db.models import Avg, Count, DurationField, Exists, F, OuterRef, Q, QuerySet
from django.utils import timezone

from collectors.knowledge.causes import RISK_DEFAULT_MODES, RISKS, Risk, RootCause
from collectors.models import Node
from collectors.selectors import json_list_has
from incidents.audit import audit_lock
from incidents.models import Evidence, GateRun, Incident, Remediation
from incidents.remediation.playbooks import (
    FOR_ROOT_CAUSE,
    REPLACE_AND_RMA,
    REPLACE_NODE,
    Playbook,
    playbook_get,
)

WEEK = timedelta(days=7)
# Remediations that hold their nodes: running, waiting for a person, or waiting for approval
# of a step after others already ran.
HOLDING = (Remediation.Status.RUNNING, Remediation.Status.BLOCKED,
           Remediation.Status.AWAITING_APPROVAL)


@dataclass(frozen=True)
class Decision:
    playbook: Playbook
    mode: str  # auto, approve, observe (the playbook's)
    hold_reason: str = ""  # set: wait for a person although the mode is auto
    rma: bool = False  # the node is escalated for RMA instead of repaired again
    step_modes: dict[str, str] = field(default_factory=dict)  # risk class -> mode
    escalation: str = ""  # why the playbook differs from the root cause's first choice


# pg_advisory_xact_lock key for "deciding what may run": b"fwpolicy" as an integer.
POLICY_LOCK_KEY = int.from_bytes(b"fwpolicy", "big", signed=True)


def decisions_serialized() -> None:
    """Take, for the rest of the transaction, the lock every policy decision takes: two
    diagnosis workers opening remediations for the same node (or one each that together
    pass the budget) decide one after the other, each seeing the other's commit.

    The audit lock comes first: every decision is audited, and a transaction takes the audit
    lock before any other (see incidents/audit.py), or two of them deadlock."""
    audit_lock()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [POLICY_LOCK_KEY])


# Remediations of real incidents: what every rail counts (fire drills' are left out).
REAL = Q(incident__drill__isnull=True)


def playbook_mode(root_cause: str) -> str:
    return settings.FLEETWATCH_PLAYBOOK_MODES.get(root_cause, settings.FLEETWATCH_POLICY_MODE)


def step_mode(risk: str, playbook_mode: str) -> str:
    """A risky step's mode: observe everywhere when the playbook only observes; else the risk
    class's own setting, which can be stricter (or, explicitly, looser) than the playbook's."""
    if playbook_mode == Remediation.Mode.OBSERVE:
        return Remediation.Mode.OBSERVE
    return settings.FLEETWATCH_STEP_MODES.get(risk, RISK_DEFAULT_MODES.get(
        Risk(risk), Remediation.Mode.AUTO))


def _node_history(cluster_id: int, nodes: Iterable[str], since: timedelta,
                  exclude: int | None = None) -> list[Remediation]:
    """Remediations that acted on any of the cluster's ``nodes`` (not observe-only ones)
    since then."""
    wanted = set(nodes)
    rows = (Remediation.objects.select_related("incident")
            .filter(_acting_on(wanted), REAL, created_at__gte=timezone.now() - since,
                    incident__cluster_id=cluster_id)
            .exclude(status__in=[Remediation.Status.OBSERVED, Remediation.Status.CANCELLED]))
    if exclude is not None:
        rows = rows.exclude(incident_id=exclude)
    return [r for r in rows if wanted & set(r.nodes or r.incident.nodes)]


@dataclass
class NodeHistory:
    """The remediations that acted on a decision's nodes, read once (the longest window any
    rail looks back) however many windows and root causes the decision asks about: the
    playbook's escalation and the RMA and cooldown rails were three queries of one table (and
    the escalation ran twice), over a quarter of opening an incident's time under cProfile."""

    cluster_id: int
    nodes: tuple[str, ...]
    exclude: int | None = None
    _rows: list[Remediation] | None = field(default=None, repr=False)

    def since(self, window: timedelta, root_cause: str | None = None) -> list[Remediation]:
        if self._rows is None:
            cooldown = timedelta(minutes=settings.FLEETWATCH_COOLDOWN_MINUTES)
            self._rows = _node_history(self.cluster_id, self.nodes, max(WEEK, cooldown),
                                       exclude=self.exclude)
        cutoff = timezone.now() - window
        return [r for r in self._rows if r.created_at >= cutoff
                and (root_cause is None or r.incident.root_cause == root_cause)]


def _acting_on(nodes: Iterable[str]) -> Q:
    """Remediations whose nodes (or, where they name none, their incident's) include one of
    ``nodes``: in SQL, so a decision reads the few rows about its nodes and not every
    remediation of the week (in a storm of 500 incidents that was most of each decision's
    time). JSON containment is matched as text, which SQLite also does; callers check the
    rows they get exactly."""
    match = Q(pk__in=[])
    for node in set(nodes):
        has = json_list_has(node)
        match |= Q(nodes__icontains=has) | Q(nodes=[], incident__nodes__icontains=has)
    return match


# A remediation held before it acted (approve mode, a rail) holds no node yet.
_NOT_STARTED = Q(status=Remediation.Status.AWAITING_APPROVAL, started_at__isnull=True)


def playbook_base(incident: Incident) -> Playbook | None:
    """The root cause's playbook (or the one the diagnosis named) before any escalation;
    None when none runs: a storm incident, a root cause without one. ``playbook_choose``
    escalates only to another playbook, so it names one exactly when this does."""
    if incident.storm:
        return None
    if incident.drill_id is not None:
        # A drill rehearses the root cause's first playbook: its synthetic fault has no history.
        return playbook_get(FOR_ROOT_CAUSE.get(incident.root_cause, ""))
    return playbook_get(incident.playbook if playbook_get(incident.playbook)
                        else FOR_ROOT_CAUSE.get(incident.root_cause, ""))


def playbook_choose(incident: Incident,
                    history: NodeHistory | None = None) -> tuple[Playbook | None, str]:
    """The root cause's playbook, escalated where its history says the first choice did not
    hold: a GPU memory fault or an NVLink fault back on the same node within a week, or a
    link that keeps flapping, is a replacement (and, for memory, an RMA); so is a node that
    failed its acceptance checks (the return-to-service gate) after a repair this week.

    A storm incident has none: one playbook over hundreds of nodes is not a repair anybody
    meant (the first of them have their own incidents and remediations; the rest wait for a
    person who knows what the event was)."""
    playbook = playbook_base(incident)
    if playbook is None or incident.drill_id is not None or not incident.nodes:
        return playbook, ""
    if playbook not in (REPLACE_NODE, REPLACE_AND_RMA) and GateRun.objects.filter(
            cluster_id=incident.cluster_id, node__in=incident.nodes,
            status=GateRun.Status.FAILED, created_at__gte=timezone.now() - WEEK).exists():
        # Back to repair: a node that failed its acceptance checks after a reboot, a reset or
        # a wait is not fixed by doing that again.
        return REPLACE_NODE, (f"{', '.join(incident.nodes)} failed its acceptance checks "
                              "after a repair this week: replace")
    history = history or NodeHistory(incident.cluster_id, tuple(incident.nodes), incident.pk)
    before = history.since(WEEK, root_cause=incident.root_cause)
    if incident.root_cause == RootCause.GPU_MEMORY and before:
        return REPLACE_AND_RMA, (f"GPU memory fault again on {', '.join(incident.nodes)} "
                                 f"({len(before)} earlier this week): replace and RMA")
    if incident.root_cause == RootCause.NVLINK and before:
        return REPLACE_NODE, (f"NVLink fault back after a reboot on {', '.join(incident.nodes)}: "
                              "replace")
    if (incident.root_cause == RootCause.NETWORK_FLAP
            and len(before) + 1 >= settings.FLEETWATCH_FLAPS_BEFORE_REPLACE):
        return REPLACE_NODE, (f"link flapped {len(before) + 1} times this week on "
                              f"{', '.join(incident.nodes)}: replace")
    return playbook, ""


def decide(incident: Incident, *, automatic: bool) -> Decision:
    """What to run for ``incident``, and whether it may run without a person. ``automatic``:
    FleetWatch started it (a person starting or approving it has made the decision)."""
    history = NodeHistory(incident.cluster_id, tuple(incident.nodes), incident.pk)
    playbook, escalation = playbook_choose(incident, history)
    if playbook is None and incident.storm:
        raise LookupError(f"incident {incident.pk} groups a storm of {incident.root_cause} on "
                          f"{len(incident.nodes)} nodes: no playbook runs over a storm; repair "
                          "its nodes one by one once its cause is known")
    if playbook is None:
        raise LookupError(f"no playbook for {incident.root_cause}")
    if incident.drill_id is not None:
        return _drill_decision(incident, playbook)
    mode = playbook_mode(incident.root_cause) if automatic else Remediation.Mode.AUTO
    step_modes: dict[str, str] = {risk: step_mode(risk, mode) for risk in RISKS}
    decision = Decision(playbook, mode, step_modes=step_modes, escalation=escalation)
    if not playbook.touches_nodes or mode == Remediation.Mode.OBSERVE:
        return decision
    hold = hold_reason(incident, incident.nodes, automatic=automatic,
                       budgeted=playbook.budgeted, history=history)
    rma = bool(hold) and hold.startswith("escalated for RMA")
    return Decision(playbook, mode, hold, rma, step_modes, escalation)


def _drill_decision(incident: Incident, playbook: Playbook) -> Decision:
    """A fire drill runs its playbook in auto mode, every step too (its outside calls are
    only recorded: see steps.Rehearsal), and passes no rail but one: a node a real repair
    holds is that repair's, and the drill waits (the drill then fails, saying why)."""
    auto = Remediation.Mode.AUTO
    hold = node_busy(incident.cluster_id, incident.nodes, exclude_incident=incident.pk) \
        if playbook.touches_nodes else ""
    return Decision(playbook, auto, hold, step_modes={risk: auto for risk in RISKS})


def remediation_holding(cluster_id: int, nodes: Iterable[str],
                        exclude_incident: int | None = None) -> Remediation | None:
    """The live remediation acting on any of the cluster's ``nodes``, if one is."""
    wanted = set(nodes)
    live = (Remediation.objects.filter(_acting_on(wanted), REAL, status__in=HOLDING,
                                       incident__cluster_id=cluster_id)
            .exclude(_NOT_STARTED).select_related("incident")
            .exclude(incident_id=exclude_incident))  # type: ignore[misc]  # None: IS NULL, excludes none
    for rem in live:
        if wanted & set(rem.nodes or rem.incident.nodes):
            return rem
    return None


def node_busy(cluster_id: int, nodes: Iterable[str], exclude_incident: int | None = None) -> str:
    rem = remediation_holding(cluster_id, nodes, exclude_incident)
    if rem is None:
        return ""
    busy = set(nodes) & set(rem.nodes or rem.incident.nodes)
    return (f"{', '.join(sorted(busy))} already in remediation {rem.pk} "
            f"(incident {rem.incident_id}); one remediation per node at a time")


def hold_reason(incident: Incident, nodes: list[str], *, automatic: bool,
                budgeted: bool = True, history: NodeHistory | None = None) -> str:
    """Why this remediation must wait for a person; empty when it may run now.
    ``history``: the remediations on ``nodes`` (read here when not given)."""
    busy = node_busy(incident.cluster_id, nodes, exclude_incident=incident.pk)
    if busy:
        return busy  # even a person's click waits for the other remediation to finish
    if not automatic:
        return ""
    if history is None or set(history.nodes) != set(nodes):
        history = NodeHistory(incident.cluster_id, tuple(nodes), incident.pk)
    week = history.since(WEEK)
    if len(week) >= settings.FLEETWATCH_RMA_AFTER:
        return (f"escalated for RMA: {', '.join(nodes)} remediated {len(week)} times in the "
                f"last 7 days (FLEETWATCH_RMA_AFTER={settings.FLEETWATCH_RMA_AFTER}); "
                "approve to repair it once more")
    cooldown = timedelta(minutes=settings.FLEETWATCH_COOLDOWN_MINUTES)
    recent = [r for r in history.since(cooldown) if r.finished_at is not None]
    if cooldown and recent:
        return (f"cooldown: {', '.join(nodes)} was remediated {len(recent)} time(s) in the "
                f"last {settings.FLEETWATCH_COOLDOWN_MINUTES} min "
                "(FLEETWATCH_COOLDOWN_MINUTES); a person decides on a repeat")
    storm = storm_count(incident.cluster_id, exclude=incident.pk,
                        root_cause=incident.root_cause)
    if storm_brake_on(storm):
        return (f"storm brake: {storm + 1} incidents opened in the last "
                f"{settings.FLEETWATCH_STORM_MINUTES} min in this cluster (more than "
                f"{settings.FLEETWATCH_STORM_INCIDENTS} {incident.root_cause} incidents); "
                "automation of them paused until a person looks")
    return budget_exceeded(incident.cluster_id, nodes) if budgeted else ""


def storm_brake_on(storm: int) -> bool:
    """Whether ``storm`` incidents already in the window hold the next one's automation: the
    brake as ``hold_reason`` applies it, and as /metrics reports it (with ``storm_count()``:
    what a new incident would find)."""
    return storm >= settings.FLEETWATCH_STORM_INCIDENTS


def _storm_window(cluster_id: int) -> QuerySet[Incident]:
    since = timezone.now() - timedelta(minutes=settings.FLEETWATCH_STORM_MINUTES)
    return Incident.objects.real().filter(opened_at__gte=since, cluster_id=cluster_id).exclude(
        root_cause=RootCause.APPLICATION_ERROR)


def storm_count(cluster_id: int, exclude: int | None = None,
                root_cause: str | None = None) -> int:
    """Incidents opened in the cluster in the storm window (application errors aside), of
    one root cause or of all."""
    rows = _storm_window(cluster_id)
    if root_cause is not None:
        rows = rows.filter(root_cause=root_cause)
    # exclude=None: pk IS NULL, which excludes nothing (the stubs want an id).
    return rows.exclude(pk=exclude).count()  # type: ignore[misc]


def storm_by_cause(cluster_id: int) -> dict[str, int]:
    """The storm window's incidents per root cause: the brake is on for a cause at
    ``storm_brake_on`` of its count."""
    return dict(_storm_window(cluster_id).values_list("root_cause").annotate(n=Count("pk"))
                .order_by())


def storm_room(cluster_id: int, root_cause: str) -> int | None:
    """How many more incidents of ``root_cause`` may open on their own before the storm
    brake holds them; past that, the faults are one event and join the cluster's storm
    incident of that cause (lifecycle.storm_record). ``None``: never grouped (a job's own
    error is that job's, however many jobs fail). 0 while the cause's storm incident is open
    and still growing: the storm's stragglers join it."""
    if root_cause == RootCause.APPLICATION_ERROR:
        return None
    since = timezone.now() - timedelta(minutes=settings.FLEETWATCH_STORM_MINUTES)
    grew = Evidence.objects.filter(incident=OuterRef("pk"), added_at__gte=since)
    if Incident.objects.real().filter(cluster_id=cluster_id, root_cause=root_cause,
                                      storm=True).exclude(
            status=Incident.Status.RESOLVED).filter(Exists(grew)).exists():
        return 0
    return max(0, settings.FLEETWATCH_STORM_INCIDENTS
               - storm_count(cluster_id, root_cause=root_cause))


def nodes_in_remediation(cluster_id: int) -> set[str]:
    busy: set[str] = set()
    for rem in (Remediation.objects.filter(REAL, status__in=HOLDING,
                                           incident__cluster_id=cluster_id)
                .exclude(_NOT_STARTED).select_related("incident")):
        busy.update(rem.nodes or rem.incident.nodes)
    return busy


def budget_exceeded(cluster_id: int, nodes: list[str]) -> str:
    busy = nodes_in_remediation(cluster_id)
    after = busy | set(nodes)
    limit = settings.FLEETWATCH_BUDGET_MAX_NODES
    if len(after) > limit:
        return (f"fleet budget: {len(after)} nodes would be in remediation at once, more "
                f"than {limit} (FLEETWATCH_BUDGET_MAX_NODES; counted per cluster)")
    percent = settings.FLEETWATCH_BUDGET_MAX_PERCENT
    in_cluster = Node.objects.filter(cluster_id=cluster_id)
    rows = in_cluster.filter(name__in=after).values_list("name", "pool", "leaf_switch")
    groups: dict[tuple[str, str], set[str]] = {}
    for name, pool, leaf in rows:
        for kind, value in (("pool", pool), ("leaf switch", leaf)):
            if value:
                groups.setdefault((kind, value), set()).add(name)
    for (kind, value), members in sorted(groups.items()):
        size = in_cluster.filter(
            Q(pool=value) if kind == "pool" else Q(leaf_switch=value), in_service=True).count()
        # A group of fewer nodes than it takes to reach the share still allows one.
        allowed = max(1, int(size * percent / 100))
        if size and len(members) > allowed:
            return (f"fleet budget: {len(members)} of the {size} nodes of {kind} {value} "
                    f"would be in remediation, more than {percent:g}% "
                    "(FLEETWATCH_BUDGET_MAX_PERCENT)")
    return ""


def mean_time_to_repair(days: int = 7) -> dict[str, float | None]:
    """Mean seconds from detection to resolution over the last ``days``, automated and
    manual repairs apart."""
    since = timezone.now() - timedelta(days=days)
    # One aggregate in the database: a week of a big fleet's incidents never comes to Python.
    rows = (Incident.objects.real().filter(resolved_at__gte=since,
                                           repaired_by__in=["automation", "person"])
            .values("repaired_by")
            .annotate(mean=Avg(F("resolved_at") - F("detected_at"), output_field=DurationField())))
    means = {r["repaired_by"]: r["mean"] for r in rows}
    return {who: means[who].total_seconds() if means.get(who) is not None else None
            for who in ("automation", "person")}
