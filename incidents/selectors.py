"""Reads: turn rows into the plain data diagnosis and the incidents app's pages use. The fleet's
own reads (counts, the GPU grid, nodes, jobs, sources, telemetry) are collectors.selectors,
which the dashboard here composes with the incidents."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.db.models import Case, Exists, F, Max, Min, OuterRef, Q, QuerySet, Value, When
from django.utils import timezone

from collectors import selectors as fleet
from collectors.clients.base import ClientError
from collectors.knowledge import dcgm
from collectors.models import Cluster, Job, Node, Signal
from collectors.redaction import redact_url
from collectors.roles import actor_shown
from collectors.selectors import TelemetryPoint, json_list_has
from collectors.sources import cluster_names, sources_of
from incidents.audit import audit_verify
from incidents.diagnosis import JobInfo, Observation, facts
from incidents.diagnosis.parsers import KERNEL_WORDS
from incidents.drills import DRILL_PHASES, drill_phases
from incidents.models import AuditEntry, Drill, GateRun, Incident, Remediation, RootCause, Step
from incidents.remediation import policy
from incidents.remediation.playbooks import FOR_ROOT_CAUSE, PLAYBOOKS, RISKS
from incidents.why import job_why


def observation_from_signal(s: Signal) -> Observation:
    """A stored signal in the replay format's terms: the engine reads both the same way."""
    return _observation(s.pk, s.source, s.kind, s.node_name, s.gpu_index, s.job_id, s.code,
                        s.message, s.data, s.observed_at)


# Signal.data keys that are bookkeeping, not what the source said.
_EXPORT_SKIP = {"previous", "uuid", "annotations", "restart_count"}


def signal_as_replay(s: Signal) -> dict[str, Any]:
    """A stored signal as a replay file's ``signals`` entry (shared/REPLAY.md)."""
    out: dict[str, Any] = {"at": s.observed_at.astimezone(UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z"), "source": s.source}
    if s.node_name:
        out["node"] = s.node_name
    if s.gpu_index is not None:
        out["gpu"] = s.gpu_index
    if s.job_id:
        out["job"] = s.job_id
    data = s.data if isinstance(s.data, dict) else {}
    out.update({k: v for k, v in data.items() if k not in _EXPORT_SKIP})
    if s.kind == "xid":
        out.setdefault("metric", dcgm.XID_ERRORS)
        out.setdefault("value", s.code)
    if s.source in ("kernel", "job_log", "kubernetes", "gpud") and s.message:
        out["message"] = s.message
    return out


def incident_replay(incident: Incident) -> dict[str, Any]:
    """The incident's window as a replay file, so a postmortem can rerun it after a rule
    changes: ``manage.py fleetwatch diagnose --check`` compares with today's verdict."""
    window = timedelta(minutes=settings.FLEETWATCH_DIAGNOSIS_WINDOW_MINUTES)
    start = incident.detected_at - window
    end = (incident.resolved_at or timezone.now()) + timedelta(minutes=1)
    rows = Signal.objects.filter(cluster=incident.cluster,
                                 observed_at__range=(start, end)).exclude(kind=PUSHED_COLLECTOR)
    expect: dict[str, Any] = {"root_cause": incident.root_cause, "nodes": list(incident.nodes)}
    if incident.switch:
        expect["switch"] = incident.switch
    if incident.root_cause == RootCause.APPLICATION_ERROR:
        expect.update(nodes=[], job=(incident.jobs or [""])[0])
    return {
        "format": "fleetwatch-replay/1",
        "name": f"incident-{incident.pk}-{incident.root_cause}",
        "description": f"Exported from FleetWatch incident #{incident.pk} "
                       f"({incident.get_root_cause_display()}, detected "
                       f"{incident.detected_at:%Y-%m-%d %H:%M:%S} UTC): {incident.explanation}",
        "topology": topology(incident.cluster),
        "jobs": [{"id": j.id, "user": j.user, "nodes": list(j.nodes)}
                 for j in jobs_info(incident.cluster)],
        "signals": [signal_as_replay(s) for s in rows.order_by("observed_at", "id")],
        "expect": [expect],
    }


# A pushed ``collector`` record: the door refuses them (collectors/roles.py), but rows stored
# before stay. Whether a source is up is only what FleetWatch's own collectors saw: diagnosis,
# replay exports and timelines leave pushed claims about it out.
PUSHED_COLLECTOR = "pushed_collector"


def observations_between(cluster: Cluster, start: datetime, end: datetime) -> list[Observation]:
    rows = Signal.objects.filter(cluster=cluster, observed_at__gte=start,
                                 observed_at__lte=end).exclude(kind=PUSHED_COLLECTOR)
    if connection.vendor != "postgresql":
        return _window_observations(rows)
    # Each diagnosis run reads its whole window again, and during a storm runs follow each
    # other with a few new rows each: the observations read last time are kept (per cluster,
    # per process) and only the rows not kept are read in full. A signal row never changes,
    # and PostgreSQL never hands an id out twice (SQLite may, after a rollback: not there;
    # a database restored from a dump under running workers could, so restart them then).
    kept = _kept_windows.setdefault(cluster.pk, {})
    window = _window_observations(rows, kept)
    kept.clear()
    if len(window) * OBSERVATION_BYTES + sum(len(o.message) for o in window) <= KEPT_BYTES:
        kept.update((o.id, o) for o in window if o.id is not None)
    return window


# Observations of the last window read, per cluster id, by signal id (see above).
_kept_windows: dict[int, dict[int, Observation]] = {}
# Past about this many bytes (an observation is about 0.5 KB and its message) a window is
# read whole each time rather than kept, in each worker process: a storm's kernel lines from
# 12,500 nodes are kept, a flood of 200,000 lines of training output is not.
KEPT_BYTES, OBSERVATION_BYTES = 32 * 1024 * 1024, 600


# Telemetry samples that facts.extract skips at once (it only notes that their node exists and
# that the window reaches their time): utilisation, clocks, power, memory use and temperatures
# below facts.HOT_C, and kernel lines that are no XID or link change. A busy exporter or a
# flood of pushes is mostly these, and reading each one (a row, its JSON, its timestamps) was
# nearly all of a diagnosis run's time: 200,000 of them took 5.5 s. The database leaves them
# out and sums them up per node instead (their first and last time), and each node stands in
# as two empty observations at those times, so the engine sees the same nodes and the same
# window ends, and reaches the same verdicts.
IDLE_METRICS = dcgm.IDLE_FIELDS
# Only exact JSON strings match ``__in`` (PostgreSQL compares jsonb, SQLite json_extract's
# text), and the two bounds match only JSON numbers on PostgreSQL (jsonb orders strings below
# numbers and booleans above them); SQLite reads true/false as 1/0, which the engine reads as
# no value and skips as well. Anything else is read in full, as before.
# Kernel lines are read only when they hold one of the words parsers.parse_kernel looks for
# (XIDs, SXids, link and port states, the driver's GPU-lost messages, AER): the rest is left
# out too. SQLite's LIKE ignores case, so there a few more lines are read in full: fewer left
# out, never one too many.
_KERNEL_READ = Q()
for _word in KERNEL_WORDS:
    _KERNEL_READ |= Q(message__contains=_word)
_IDLE = (Q(source=Signal.Source.DCGM) & (
    Q(data__metric__in=IDLE_METRICS)
    | Q(data__metric__in=dcgm.TEMPERATURES, data__value__gt=-1e300, data__value__lt=facts.HOT_C))
) | (Q(source=Signal.Source.KERNEL) & ~_KERNEL_READ)


# Only the columns the engine reads: building model instances (and parsing ingested_at)
# cost as much again as the rows themselves.
_COLUMNS = ("pk", "source", "kind", "node_name", "gpu_index", "job_id", "code", "message",
            "data", "observed_at")


def _window_observations(rows: QuerySet[Signal], kept: dict[int, Observation] | None = None
                         ) -> list[Observation]:
    """The window's observations in time order; ``kept``: observations already read, by
    signal id, which are not read again when most of the window is among them."""
    read = rows.exclude(_IDLE).order_by("observed_at", "id")
    ids: list[int] = list(read.values_list("pk", flat=True)) if kept else []
    missing = [i for i in ids if i not in kept] if kept else []
    if kept and len(missing) <= len(ids) // 2:
        fresh = {row[0]: _observation(*row) for row in Signal.objects.filter(
            pk__in=missing).values_list(*_COLUMNS)} if missing else {}
        # (A row pruned between the two reads is left out.)
        out = [o for i in ids if (o := kept.get(i) or fresh.get(i)) is not None]
    else:
        out = [_observation(*row) for row in read.values_list(*_COLUMNS).iterator(
            chunk_size=5000)]
    for node, first, last in rows.filter(_IDLE).values_list("node_name").annotate(
            first=Min("observed_at"), last=Max("observed_at")).order_by():
        out += [Observation(first, "", node), Observation(last, "", node)]
    return out


def _observation(pk: int, source: str, kind: str, node: str, gpu: int | None, job: str,
                 code: int | None, message: str, data: Any, at: datetime) -> Observation:
    """observation_from_signal for the columns of a row."""
    record: dict[str, Any] = {**(data if isinstance(data, dict) else {}), "source": source,
                              "node": node, "gpu": gpu, "job": job, "message": message}
    if kind == "xid":
        record.setdefault("metric", dcgm.XID_ERRORS)
        record.setdefault("value", code)
    return Observation.from_record(record, at, id=pk)


def topology(cluster: Cluster) -> dict[str, list[str]]:
    leaves: dict[str, list[str]] = {}
    for name, leaf in Node.objects.filter(cluster=cluster).exclude(leaf_switch="").values_list(
        "name", "leaf_switch"
    ):
        leaves.setdefault(leaf, []).append(name)
    return leaves


def jobs_info(cluster: Cluster) -> list[JobInfo]:
    return [JobInfo(j.slurm_id, j.user, tuple(j.nodes),
                    {n: tuple(g) for n, g in (j.gpus or {}).items()})
            for j in Job.objects.filter(cluster=cluster).exclude(nodes=[])]


def incidents_open() -> QuerySet[Incident]:
    """Open incidents of real faults (a fire drill's is on the drills page, not the on-call's)."""
    return Incident.objects.real().exclude(status=Incident.Status.RESOLVED).order_by("-opened_at")


def remediation_current(incident: Incident) -> Remediation | None:
    return incident.remediations.prefetch_related("steps").order_by("-created_at").first()


def replacement_nodes(incident: Incident) -> set[str]:
    """The spares brought in for an incident (recorded by the replace_node step)."""
    return {
        step.result["new_node"]
        for rem in incident.remediations.prefetch_related("steps")
        for step in rem.steps.all()
        if isinstance(step.result, dict) and step.result.get("new_node")
    }


# What an incident's timeline can show besides the diagnosis (always there): the filter's
# choices, in the page's order.
TIMELINE_KINDS = {"signal": "signals", "step": "steps", "note": "notes", "audit": "audit"}


def timeline_kinds(asked: list[str]) -> set[str]:
    """The kinds a timeline filter asked for (all when it asked for none); unknown ones are
    ignored, as a list page ignores what it does not filter on."""
    kinds = {k for k in asked if k in TIMELINE_KINDS}
    return kinds if asked else set(TIMELINE_KINDS)


def incident_timeline(incident: Incident,
                      kinds: set[str] | None = None) -> list[dict[str, Any]]:
    """Everything that happened around an incident, in one time-ordered list: of ``kinds``
    (TIMELINE_KINDS; all when None), always with the diagnosis. Notes are the audit trail's
    (incidents.oncall), shown as notes rather than as audit entries."""
    from incidents.oncall import NOTE_VERB  # oncall imports the models only; no cycle

    kinds = set(TIMELINE_KINDS) if kinds is None else kinds
    start = incident.detected_at - timedelta(minutes=2)
    end = (incident.resolved_at or timezone.now()) + timedelta(minutes=1)
    items: list[dict[str, Any]] = []
    if "step" in kinds:
        items += [{"at": step.started_at, "type": "step", "step": step,
                   "title": f"Step {step.order}: {step.title}"}
                  for step in Step.objects.filter(remediation__incident=incident,
                                                  started_at__isnull=False)]
    if "signal" in kinds:
        watched = set(incident.nodes) | replacement_nodes(incident)
        # The database picks the incident's signals: at 100,000 GPUs the cluster's window
        # holds far more rows than the page shows.
        wanted = Q(node_name__in=watched) | (Q(source=Signal.Source.COLLECTOR)
                                             & ~Q(kind=PUSHED_COLLECTOR))
        if incident.jobs:
            wanted |= Q(job_id__in=incident.jobs)
        signals = Signal.objects.filter(wanted, cluster=incident.cluster,
                                        observed_at__range=(start, end))
        for s in signals.order_by("observed_at", "id")[:TIMELINE_MAX_SIGNALS]:
            items.append({"at": s.observed_at, "type": "signal", "signal": s,
                          "title": f"{s.get_source_display()}: {s.message}"})
    # The explanation itself is the page's (and the API's incident): said once, not here.
    items.append({"at": incident.opened_at, "type": "diagnosis",
                  "title": f"Diagnosis: {incident.get_root_cause_display()} "
                           f"({incident.confidence:.0%})"})
    if kinds & {"audit", "note"}:
        entries = AuditEntry.objects.filter(incident=incident).select_related("step")
        if "audit" not in kinds:
            entries = entries.filter(verb=NOTE_VERB)
        elif "note" not in kinds:
            entries = entries.exclude(verb=NOTE_VERB)
        for entry in entries:
            who = actor_shown(entry.actor)
            if entry.verb == NOTE_VERB:
                items.append({"at": entry.at, "type": "note", "entry": entry, "who": who,
                              "title": f"Note by {who}", "text": entry.result})
            else:
                items.append({"at": entry.at, "type": "audit", "entry": entry, "who": who,
                              "verb": entry.verb, "target": entry.target,
                              "title": f"{who} {entry.verb} {entry.target}",
                              # What a person decided is read without unfolding the entry.
                              "said": entry.result if entry.verb in _SAID_VERBS else "",
                              # The opening entry's result is the explanation: said above.
                              "repeats_explanation": entry.verb == "incident.opened"})
    items.sort(key=lambda i: (i["at"], {"signal": 0, "diagnosis": 1, "step": 2, "note": 3,
                                        "audit": 3}[i["type"]]))
    return items


# Audit verbs whose result a person wrote or chose (incidents.oncall, incidents.lifecycle): the
# timeline shows it beside the entry even while the entry is folded.
_SAID_VERBS = frozenset({"incident.assigned", "incident.unassigned", "incident.severity",
                         "incident.resolved_by_hand"})


def incident_title(incident: Incident) -> dict[str, Any]:
    """An incident's title in parts (its number, the cause, the nodes, the switch), for a
    template to lay out; ``text`` joins them for a page title or a subject line."""
    nodes = list(incident.nodes)
    where: list[str] = []
    if incident.storm:
        where.append(f"{len(nodes)} nodes")
    elif nodes:
        where.append(", ".join(nodes))
    if incident.switch:
        where.append(f"leaf switch {incident.switch}")
    cause = incident.get_root_cause_display()
    text = f"Incident #{incident.pk}: {'storm of ' if incident.storm else ''}{cause}"
    if where:
        text += " on " + " · ".join(where)
    return {"pk": incident.pk, "cause": cause, "storm": incident.storm,
            "nodes": [] if incident.storm else nodes, "node_count": len(nodes),
            "switch": incident.switch, "text": text}


def oncall_people() -> QuerySet[Any]:
    """Who can own an incident: the people who may act on it (operators and admins)."""
    from django.contrib.auth import get_user_model

    from collectors.roles import ADMIN, OPERATOR

    return get_user_model().objects.filter(
        Q(groups__name__in=[OPERATOR, ADMIN]) | Q(is_superuser=True), is_active=True
    ).distinct().order_by("username")


# A flapping source can log thousands of signals in an incident's window; the page shows the
# first ones (the replay export has them all).
TIMELINE_MAX_SIGNALS = 500


def incident_nodes_charted(incident: Incident) -> list[str]:
    """The nodes an incident's chart draws: those involved when it opened (kept with it:
    the blamed nodes and the other nodes of its jobs), and the replacements brought in."""
    names = list(incident.nodes_charted or incident.nodes)
    return names + sorted(replacement_nodes(incident) - set(names))


# The chart's time ranges: "incident" is the incident itself (from just before the fault to
# just after the end); the others reach that far back before the fault, to show what led up.
CHART_RANGES = {"incident": timedelta(minutes=3), "1h": timedelta(hours=1),
                "6h": timedelta(hours=6), "24h": timedelta(hours=24)}
CHART_RANGE_LABELS = {"incident": "the incident", "1h": "from 1 h before the fault",
                      "6h": "from 6 h before the fault", "24h": "from 24 h before the fault"}


def incident_chart(incident: Incident, span: str = "incident") -> dict[str, Any]:
    """Mean GPU utilisation (``series``) and temperature (``temperature``) per node around the
    incident, for the nodes involved when it opened and the replacements (``roles`` says
    which line is the failed node and which its replacement): from the stored samples (the
    simulated fleet), or from Prometheus range queries when FleetWatch reads a real one.
    ``span`` is one of CHART_RANGES (KeyError otherwise: the view answers 400)."""
    start = incident.detected_at - CHART_RANGES[span]
    end = (incident.resolved_at or timezone.now()) + timedelta(minutes=2)
    names = incident_nodes_charted(incident)
    roles = {n: "involved" for n in names}
    roles.update({n: "failed" for n in incident.nodes if n in roles})
    roles.update({n: "replacement" for n in replacement_nodes(incident)})
    chart: dict[str, Any] = {"fault_at": incident.detected_at.isoformat(), "resolved_at":
                             incident.resolved_at.isoformat() if incident.resolved_at else None,
                             "range": span, "roles": roles}
    try:
        points = fleet.telemetry_points(incident.cluster, names, start, end)
    except ClientError as exc:
        # The page still shows everything else; the chart says why it is empty.
        return {**chart, "series": {}, "temperature": {}, "error": f"telemetry unavailable: {exc}"}
    # At most CHART_POINTS per line, however long the incident stays open.
    width = max(1.0, (end - start).total_seconds() / CHART_POINTS)
    return {**chart, "series": _mean_series(points, _UTIL, start, width),
            "temperature": _mean_series(points, _TEMP, start, width)}


CHART_POINTS = 400


# Fields of a telemetry point: (node, gpu, at, utilisation, temperature).
_UTIL, _TEMP = 3, 4


def _mean_series(points: list[TelemetryPoint], field: int, start: datetime | None = None,
                 width: float = 0.0) -> dict[str, dict[str, list[Any]]]:
    """Per node, the mean over its GPUs of one field at each instant (or, with ``width``, in
    each ``width``-second bucket from ``start``, stamped with the bucket's start). A missing
    utilisation reads as 0 (a GPU off the bus does no work); a missing temperature is left
    out."""
    buckets: dict[tuple[str, datetime], list[float]] = {}
    for point in points:
        value = cast("float | None", point[field])  # field is a reading's index (3 or 4)
        if value is None and field == _TEMP:
            continue
        at = point[2]
        if start is not None and width > 1.0:
            at = start + timedelta(seconds=((at - start).total_seconds() // width) * width)
        buckets.setdefault((point[0], at), []).append(value if value is not None else 0.0)
    series: dict[str, dict[str, list[Any]]] = {}
    for (name, at), values in sorted(buckets.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s = series.setdefault(name, {"x": [], "y": []})
        s["x"].append(at.isoformat())
        s["y"].append(round(sum(values) / len(values), 1))
    return series


# --- the dashboard: the fleet's counts and grid (collectors.selectors), and the incidents ----

def repairs_in_flight(limit: int = 50, cluster: str | None = None) -> list[dict[str, Any]]:
    """Live remediations (of one cluster, or all) with the step they are at: two queries."""
    live = Remediation.objects.filter(policy.REAL, status__in=Remediation.ACTIVE)
    if cluster:
        live = live.filter(incident__cluster__name=cluster)
    rems = (live.select_related("incident").prefetch_related("steps")
            .order_by("-created_at")[:limit])
    out = []
    for rem in rems:
        steps = list(rem.steps.all())
        current = next((s for s in steps if s.status not in Step.DONE), None)
        out.append({"remediation": rem, "incident": rem.incident, "current": current,
                    "done": sum(s.status in Step.DONE for s in steps), "total": len(steps)})
    return out


# A remediation that cannot go on without a person: one to approve, one a step stopped to wait
# for a person (blocked), and one that failed while its incident is still open and nothing
# newer has been started for it.
NEEDS_PERSON = (Remediation.Status.AWAITING_APPROVAL, Remediation.Status.BLOCKED,
                Remediation.Status.FAILED)
ATTENTION_MAX = 50


def attention(cluster: str | None = None,
              sources: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What needs the person on call, first: remediations waiting for them or stopped,
    sources down and open incidents; ``count`` is how many things that is (an incident whose
    remediation is listed counts once), for the tab title. ``sources``: the sources' health
    when the caller has read it already."""
    newer = Remediation.objects.filter(incident=OuterRef("incident"),
                                       created_at__gt=OuterRef("created_at"))
    waiting = (Remediation.objects.filter(policy.REAL, status__in=NEEDS_PERSON)
               .exclude(incident__status=Incident.Status.RESOLVED)
               .exclude(Exists(newer)).select_related("incident", "incident__cluster"))
    opened = incidents_open().select_related("cluster")
    if cluster:
        waiting = waiting.filter(incident__cluster__name=cluster)
        opened = opened.filter(cluster__name=cluster)
    # Approvals first (the fleet waits on a click), then the stopped ones; oldest first, as
    # the longest wait is the most urgent.
    order: dict[str, int] = {s: i for i, s in enumerate(NEEDS_PERSON)}
    remediations = sorted(waiting.order_by("created_at")[:ATTENTION_MAX],
                          key=lambda r: order[r.status])
    down = [item for item in (fleet.sources_health(cluster) if sources is None else sources)
            if item["source"].healthy is False]
    open_total = opened.count()
    covered = {r.incident_id for r in remediations}
    return {
        "remediations": remediations,
        "sources_down": down,
        "open_incidents": list(opened[:ATTENTION_MAX]),
        "open_total": open_total,
        "count": len(remediations) + len(down) + open_total - len(covered),
    }


def dashboard(by: str = "leaf", group: str | None = None, *, group_given: bool = False,
              cluster: str | None = None) -> dict[str, Any]:
    """Everything the dashboard shows, of one cluster or all of them, in a fixed number of
    queries."""
    counts = fleet.fleet_counts(cluster)
    groups = fleet.gpu_groups(by, cluster)
    if not group_given:
        group = fleet.gpu_group_default(groups, counts["nodes"])
    recent = Incident.objects.real().filter(status=Incident.Status.RESOLVED)
    if cluster:
        recent = recent.filter(cluster__name=cluster)
    clusters = cluster_names()
    sources = fleet.sources_health(cluster)
    needs = attention(cluster, sources)
    return {
        # The cluster chooser, where there is more than one.
        "clusters": clusters if len(clusters) > 1 else [],
        "cluster": cluster or "",
        "counts": counts,
        "groups": fleet.gpu_group_tiles(groups, group),
        "group_names": [g["name"] for g in groups] if len(groups) > fleet.GROUP_TILES_MAX else [],
        "group_by": by if by in fleet.GROUP_FIELDS else "leaf",
        "group": group,
        "attention": needs,
        "open_incidents": needs["open_incidents"],
        "open_total": needs["open_total"],
        "recent": list(recent.order_by("-resolved_at")[:10]),
        "repairs": repairs_in_flight(cluster=cluster),
        "mttr": policy.mean_time_to_repair(7),
        "sources": sources,
        "failed_nodes": fleet.nodes_failed(cluster),
        # Figures fed by a source that is down: {figure: [source, ...]}.
        "stale": fleet.stale_figures(sources),
    }


# --- lists and pages ------------------------------------------------------------------------

def node_page_incidents(sender: object, node: Node, **kwargs: object) -> dict[str, Any]:
    """What a node's page (collectors) shows of incidents: those that blamed the node or its
    leaf switch, and its repair history. Connected to ``collectors.selectors.node_page``."""
    has = json_list_has(node.name)
    incidents = Incident.objects.filter(cluster=node.cluster).filter(
        Q(nodes__icontains=has) | (Q(switch=node.leaf_switch) & ~Q(switch="")))
    return {
        "incidents": list(incidents.order_by("-opened_at")[:50]),
        "repairs": list(Remediation.objects.filter(incident__cluster=node.cluster)
                        .filter(Q(nodes__icontains=has) | Q(incident__nodes__icontains=has))
                        .select_related("incident").order_by("-created_at")[:50]),
        # Its return-to-service gates: each check's verdict and the end of its output.
        "gates": list(GateRun.objects.filter(cluster=node.cluster, node=node.name)
                      .select_related("remediation").order_by("-created_at", "-id")[:10]),
    }


def gate_status(gate_id: int) -> dict[str, Any]:
    """A return-to-service gate as other code reads it (incidents.gates.node_gate_start's
    id): where it is, and, once final, whether the node is back in service."""
    run = GateRun.objects.select_related("cluster").get(pk=gate_id)
    state = run.state or {}
    return {
        "id": run.pk, "key": run.key, "cluster": run.cluster.name, "node": run.node,
        "repair": run.repair, "mode": run.mode, "status": run.status, "detail": run.detail,
        "reservation": state.get("reservation", ""), "checks": list(run.checks),
        "results": [{k: r.get(k) for k in ("check", "job_id", "verdict", "exit_code",
                                            "summary", "output_path")} for r in run.results],
        "final": run.status in GateRun.FINAL,
        "in_service": run.status in (GateRun.Status.PASSED, GateRun.Status.UNCHECKED),
        "created_at": run.created_at.isoformat(),
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
    }


def job_page_incidents(sender: object, job: Job, **kwargs: object) -> dict[str, Any]:
    """What a job's page (collectors) shows of incidents: those that hit the job. Connected
    to ``collectors.selectors.job_page``. ``why``: what stopped it (incidents.why)."""
    return {"incidents": list(Incident.objects.filter(
        cluster=job.cluster, jobs__icontains=json_list_has(job.slurm_id)).order_by(
        "-opened_at")[:50]), "why": job_why(job)}


def incidents_for_list() -> QuerySet[Incident]:
    # repair_time: what the list sorts "time to repair" by (open ones have none).
    # unowned: the owner column sorts the unowned after the owned on PostgreSQL and SQLite
    # alike (they put NULLs at opposite ends).
    return Incident.objects.select_related("cluster", "owner").annotate(
        repair_time=F("resolved_at") - F("opened_at"),
        unowned=Case(When(owner__isnull=True, then=Value(1)), default=Value(0)),
    ).order_by("-opened_at", "-id")


def audit_for_list() -> QuerySet[AuditEntry]:
    # Newest first; "at" is indexed and never goes backwards along the chain.
    return AuditEntry.objects.order_by("-at", "-id")


AUDIT_VERIFY_CACHE_KEY = "fleetwatch:audit-verify"
AUDIT_VERIFY_CACHE_SECONDS = 300


def audit_verify_status(*, run: bool = False) -> dict[str, Any] | None:
    """The audit chain's verification. It walks the whole table, so it runs only when a
    person asks (``run``) and the page shows the last result for a few minutes after."""
    if not run:
        return cache.get(AUDIT_VERIFY_CACHE_KEY)
    started = timezone.now()
    result = audit_verify()
    status = {"ok": result.ok, "checked": result.checked, "bad_id": result.bad_id,
              "reason": result.reason, "unchained": result.unchained, "head": result.head,
              "text": str(result), "at": started,
              "took": (timezone.now() - started).total_seconds()}
    cache.set(AUDIT_VERIFY_CACHE_KEY, status, AUDIT_VERIFY_CACHE_SECONDS)
    return status


def incident_postmortem(incident: Incident) -> dict[str, Any]:
    """What the Markdown postmortem tells: the diagnosis, every remediation with its steps,
    the outside calls, the timeline and the phases."""
    remediations = list(incident.remediations.prefetch_related("steps").order_by("created_at"))
    audit = list(AuditEntry.objects.filter(Q(incident=incident) | Q(
        remediation__incident=incident)).order_by("at", "id"))
    return {
        "incident": incident,
        "remediations": remediations,
        "calls": [e for e in audit if e.call],
        "audit": audit,
        "timeline": incident_timeline(incident),
        "phases": incident.phases or {},
        "generated_at": timezone.now(),
    }


def policy_overview() -> dict[str, Any]:
    """The policy page: playbooks, their modes per root cause, the risky steps' modes, the
    rails, the provider and notifiers (URLs redacted, secrets only said to be set)."""
    root_causes = []
    for value, label in RootCause.choices:
        mode = policy.playbook_mode(value)
        root_causes.append({"value": value, "label": label, "playbook": FOR_ROOT_CAUSE.get(value),
                            "mode": mode,
                            "step_modes": {r: policy.step_mode(r, mode) for r in RISKS}})
    used_by: dict[str, list[str]] = {}
    for rc, name in FOR_ROOT_CAUSE.items():
        used_by.setdefault(name, []).append(rc)
    return {
        "default_mode": settings.FLEETWATCH_POLICY_MODE,
        "root_causes": root_causes,
        "risks": RISKS,
        "playbooks": [{"playbook": p, "root_causes": used_by.get(p.name, []),
                       "escalation": not used_by.get(p.name)} for p in PLAYBOOKS.values()],
        "rails": [
            ("Fleet budget: nodes in remediation at once", settings.FLEETWATCH_BUDGET_MAX_NODES,
             "FLEETWATCH_BUDGET_MAX_NODES"),
            ("Fleet budget: share of a pool or leaf switch",
             f"{settings.FLEETWATCH_BUDGET_MAX_PERCENT:g}%", "FLEETWATCH_BUDGET_MAX_PERCENT"),
            ("Storm brake: incidents", f"more than {settings.FLEETWATCH_STORM_INCIDENTS} of one "
             f"root cause in {settings.FLEETWATCH_STORM_MINUTES} min pause that cause's "
             "automation",
             "FLEETWATCH_STORM_INCIDENTS, FLEETWATCH_STORM_MINUTES"),
            ("Cooldown after a repair", f"{settings.FLEETWATCH_COOLDOWN_MINUTES} min",
             "FLEETWATCH_COOLDOWN_MINUTES"),
            ("RMA after repairs of one node in 7 days", settings.FLEETWATCH_RMA_AFTER,
             "FLEETWATCH_RMA_AFTER"),
            ("Link flaps in 7 days before a replacement", settings.FLEETWATCH_FLAPS_BEFORE_REPLACE,
             "FLEETWATCH_FLAPS_BEFORE_REPLACE"),
            ("Links stable before release", f"{settings.FLEETWATCH_RECOVERY_STABLE_MINUTES:g} min",
             "FLEETWATCH_RECOVERY_STABLE_MINUTES"),
            ("A rebooted node must be back within", f"{settings.FLEETWATCH_NODE_BACK_MINUTES:g} min",
             "FLEETWATCH_NODE_BACK_MINUTES"),
            ("Step timeout", f"{settings.FLEETWATCH_STEP_TIMEOUT_SECONDS} s",
             "FLEETWATCH_STEP_TIMEOUT_SECONDS"),
            ("Step attempts", settings.FLEETWATCH_STEP_MAX_ATTEMPTS,
             "FLEETWATCH_STEP_MAX_ATTEMPTS"),
        ],
        # Each cluster's sources and where its rails stand now (they count per cluster).
        "clusters": [_cluster_now(name) for name in cluster_names()],
        "notifiers": [
            ("Webhook", redact_url(settings.FLEETWATCH_NOTIFY_WEBHOOK_URL)
             if settings.FLEETWATCH_NOTIFY_WEBHOOK_URL else "",
             "signed (HMAC-SHA256)" if settings.FLEETWATCH_NOTIFY_WEBHOOK_SECRET else "unsigned"),
            ("Slack-compatible", redact_url(settings.FLEETWATCH_NOTIFY_SLACK_URL, keep_path=False)
             if settings.FLEETWATCH_NOTIFY_SLACK_URL else "", ""),
            ("E-mail", ", ".join(settings.FLEETWATCH_NOTIFY_EMAIL),
             f"through {settings.EMAIL_HOST}:{settings.EMAIL_PORT}"
             if settings.FLEETWATCH_NOTIFY_EMAIL else ""),
        ],
    }


def _cluster_now(name: str) -> dict[str, Any]:
    sources = sources_of(name)
    row = Cluster.objects.filter(name=name).values_list("pk", flat=True).first()
    command = sources.provider_command.split()
    return {"name": name, "fleet": sources.fleet, "provider": sources.provider,
            # The program only: its arguments may carry credentials.
            "provider_command": command[0] if command else "",
            "storm": policy.storm_count(row) if row is not None else 0,
            "busy_nodes": sorted(policy.nodes_in_remediation(row)) if row is not None else []}


def policy_budgets() -> dict[str, Any]:
    """The safety rails as numbers, for programs (the policy page words them for people)."""
    return {
        "max_nodes": settings.FLEETWATCH_BUDGET_MAX_NODES,
        "max_percent": settings.FLEETWATCH_BUDGET_MAX_PERCENT,
        "storm_incidents": settings.FLEETWATCH_STORM_INCIDENTS,
        "storm_minutes": settings.FLEETWATCH_STORM_MINUTES,
        "cooldown_minutes": settings.FLEETWATCH_COOLDOWN_MINUTES,
        "rma_after": settings.FLEETWATCH_RMA_AFTER,
        "flaps_before_replace": settings.FLEETWATCH_FLAPS_BEFORE_REPLACE,
        "recovery_stable_minutes": settings.FLEETWATCH_RECOVERY_STABLE_MINUTES,
        "node_back_minutes": settings.FLEETWATCH_NODE_BACK_MINUTES,
        "step_timeout_seconds": settings.FLEETWATCH_STEP_TIMEOUT_SECONDS,
        "step_max_attempts": settings.FLEETWATCH_STEP_MAX_ATTEMPTS,
    }


def remediation_live(incident: Incident) -> Remediation | None:
    """The incident's remediation that is running or waiting for a person, if one is."""
    return incident.remediations.filter(status__in=Remediation.ACTIVE).order_by(
        "-created_at").first()


# --- fire drills (incidents.drills) -------------------------------------------------------------

def drills_for_list() -> QuerySet[Drill]:
    return (Drill.objects.select_related("cluster").prefetch_related("incidents")
            .order_by("-started_at", "-id"))


def drill_settings() -> dict[str, Any]:
    """How drills are configured, for the drills page and the API."""
    schedule = settings.FLEETWATCH_DRILL_SCHEDULE
    return {
        "schedule": "" if schedule is None else (
            f"cron {schedule} (UTC)" if isinstance(schedule, str) else f"every {schedule:g} s"),
        "nodes": list(settings.FLEETWATCH_DRILL_NODES),
        "mode": settings.FLEETWATCH_DRILL_MODE,
        "budget_seconds": settings.FLEETWATCH_DRILL_BUDGET_SECONDS,
    }


def drill_report(drill: Drill) -> dict[str, Any]:
    """A drill's whole report: its incident and remediation, the phases (as far as it got,
    while it runs), the steps and the timeline."""
    incident = drill.incidents.order_by("pk").first()
    rem = (incident.remediations.order_by("-created_at", "-pk").first()
           if incident is not None else None)
    steps = list(rem.steps.order_by("order")) if rem is not None else []
    phases = drill.phases if drill.status != Drill.Status.RUNNING else drill_phases(
        drill, incident, rem, timezone.now())
    return {"drill": drill, "incident": incident, "remediation": rem, "steps": steps,
            "phases": [(name, name.replace("_", " "), phases[name]) for name in DRILL_PHASES
                       if name in phases],
            "phase_map": phases, "timeline": drill_timeline(drill, incident, rem)}


def drill_timeline(drill: Drill, incident: Incident | None,
                   rem: Remediation | None) -> list[dict[str, Any]]:
    """What the drill did and what the loop did with its fault, in time order: the drill's own
    events (canary chosen, fault injected, clean-up, result), the incident opening, each step
    and each outside call, would-be or real."""
    items: list[dict[str, Any]] = [
        {"at": datetime.fromisoformat(e["at"]), "type": "drill", "title": e["what"],
         "detail": e.get("detail", "")} for e in drill.events]
    if incident is not None:
        items.append({"at": incident.opened_at, "type": "incident",
                      "title": f"Incident {incident.pk} opened",
                      "detail": f"{incident.get_root_cause_display()} "
                                f"({incident.confidence:.0%}), playbook {incident.playbook}"})
    if rem is not None:
        items.append({"at": rem.created_at, "type": "incident",
                      "title": f"Remediation {rem.pk} planned",
                      "detail": f"{rem.playbook} in {rem.get_mode_display()} mode"})
        for step in rem.steps.order_by("order"):
            if step.started_at is not None:
                items.append({"at": step.started_at, "type": "step",
                              "title": f"Step {step.order} {step.kind}: "
                                       f"{step.get_status_display()}",
                              "detail": step.detail or step.title,
                              "seconds": step.duration_seconds if step.finished_at else None})
        for entry in (AuditEntry.objects.filter(remediation=rem)
                      .filter(~Q(call="") | Q(data__would_call=True)).order_by("at", "pk")):
            would = bool((entry.data or {}).get("would_call"))
            items.append({"at": entry.at, "type": "would" if would else "call",
                          "title": f"{'would call' if would else 'called'} {entry.verb} "
                                   f"{entry.target}",
                          "detail": entry.call or entry.result, "ok": entry.ok})
    items.sort(key=lambda i: i["at"])
    return items
