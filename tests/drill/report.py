"""The drill's report: its timeline, timings and checks, as JSON and Markdown.

Every time comes from an observation, never from a configured value:

- ``fault injected``: the drill's clock when it killed the GPU;
- ``XID scraped``: Prometheus's timestamp of the first sample carrying the XID;
- ``signal observed``/``ingested``: the incident's first cause signal (FleetWatch's rows);
- ``incident detected``/``opened``: ``Incident.detected_at``/``opened_at``;
- ``node drained``, ``SIGTERM sent``, ``job requeued``, ``cordoned``, ``pod evicted``,
  ``replacement requested``, ``spare resumed``: the audit entries' ``at`` of those outside calls;
- ``old run gone``: the poller first saw the failed node DRAINED (no job's processes left on it:
  Slurm's SIGKILL after KillWait ended the hung rank);
- ``replacement ready``: the poller first saw the new Kubernetes Node Ready;
- ``job running again``: the new run's ``StartTime`` in ``scontrol show job`` (Slurm's record,
  whole seconds);
- ``first step after the resume`` and the checkpoint figures: the training job's own log.

Downtime is from the fault to the first training step after the resume. FleetWatch's own
share is the downtime minus the time inside any of these waits on others (their union, so an
overlap is not subtracted twice):

- scrape: from the fault to Prometheus's first sample with the XID (the exporter and the scrape
  interval; Prometheus path only: the node agent is FleetWatch's own);
- SIGTERM grace: from SIGTERM sent to the old run gone (KillWait: the hung rank ignores SIGTERM);
- provider: from the replacement requested to the new node Ready in Kubernetes;
- Slurm start: from the moment the job could run (requeued, old run gone and spare resumed, the
  latest of the three) to Slurm running it (cred_expire's BeginTime and the scheduler);
- job start: from the job running to its first step (the training program's own start);
- operator: from the playbook stopping for a person to the person's answer (the
  no-auto-replace variant only).

What remains is FleetWatch's: its collection interval, diagnosis, the steps' work and the time
between their polls.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.drill.run import DrillResult

# The outside actions the gpu_hardware playbook makes, each exactly once (with the spare's
# acceptance checks: reserved, checked, released); slurm.resume and slurm.comment twice each
# (the gate resumes the spare inside its reservation, the resume step finds it in service; the
# job's comment when stopped and when requeued).
EXPECTED_ACTIONS = ("notify", "slurm.drain", "slurm.cancel", "slurm.requeue", "k8s.cordon",
                    "k8s.evict", "provider.replace", "slurm.reserve", "slurm.submit_check",
                    "slurm.unreserve")
TWICE = ("slurm.comment", "slurm.resume")


def _ts(value: Any) -> float | None:
    return None if value is None else float(value.timestamp())


def _iso(at: float | None) -> str:
    return "" if at is None else datetime.fromtimestamp(at).astimezone().isoformat(
        timespec="milliseconds")


def _union_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of the intervals."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in clipped:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def build(result: DrillResult) -> dict[str, Any]:
    """Read FleetWatch's rows and the drill's observations into the report's dict."""
    from incidents.audit import audit_verify
    from incidents.models import AuditEntry, Evidence, Incident, Remediation, Step
    from tests.drill.run import FAILED, SPARE

    c = result.config
    incident = Incident.objects.get(pk=result.incident_id)
    rem = Remediation.objects.get(pk=result.remediation_id)
    calls = list(AuditEntry.objects.filter(remediation=rem).exclude(call="").order_by("id"))
    acted = [(e.verb, e.target) for e in calls if e.ok]

    def audit_at(verb: str) -> float | None:
        return next((_ts(e.at) for e in calls if e.verb == verb and e.ok), None)

    def call_started(verb: str) -> float | None:
        entry = next((e for e in calls if e.verb == verb and e.ok), None)
        at = _ts(entry.at) if entry is not None else None
        return None if at is None or entry is None else at - (entry.duration_ms or 0.0) / 1000

    cause = (Evidence.objects.filter(incident=incident, role="cause")
             .select_related("signal").order_by("signal__observed_at").first())
    signal = cause.signal if cause is not None else None
    steps = {s.kind: s for s in Step.objects.filter(remediation=rem)}

    def seen(what: str, match: Any, after: float = 0.0) -> float | None:
        return next((o.at for o in result.observations
                     if o.what == what and o.at >= after and match(o.value)), None)

    sigterm = audit_at("slurm.cancel")
    requeued = audit_at("slurm.requeue")
    # The spare is in service once its acceptance checks passed and their reservation is gone:
    # from the start of that call (its audit entry is written after it returns, and the job
    # waiting for the spare starts within a second of the deletion).
    checks_from, resumed_spare = audit_at("slurm.reserve"), call_started("slurm.unreserve")
    old_gone = seen(f"slurm.{FAILED}", lambda v: v in ("DRAINED", "DOWN+DRAIN"),
                    after=sigterm or 0.0)
    # Slurm's own StartTime of the new run (whole seconds); else when the poller saw it.
    running_again = result.restarted_at or seen("job.state", lambda v: v == "RUNNING",
                                                after=requeued or 0.0)
    spare_ready = seen(f"k8s.{SPARE}", lambda v: v.startswith("Ready=True"))

    log = result.train_log
    before = [r for r in log if r["restart"] == 0]
    after = [r for r in log if r["restart"] >= 1]
    last_step_before = max((r["step"] for r in before if r["event"] == "step"), default=None)
    last_checkpoint = max((r["step"] for r in before if r["event"] == "checkpoint"),
                          default=None)
    checkpoint_why = next((r.get("why") for r in reversed(before)
                           if r["event"] == "checkpoint" and r["step"] == last_checkpoint), None)
    resumed_from = sorted({r["step"] for r in after if r["event"] == "resumed from step"})
    after_steps = [r for r in after if r["event"] == "step"]
    first_after = min(after_steps, key=lambda r: r["at"]) if after_steps else None
    nodes_after = sorted({r["node"] for r in after})
    sigterm_saved = [r for r in before if r["event"] == "checkpoint" and r.get("why") == "sigterm"]
    hung = [r for r in before if r["event"].startswith("gpu fault")]
    handled = [r for r in before if r["event"] == "SIGTERM"]

    t0 = result.injected_at
    first_step_at = first_after["at"] if first_after else None
    timeline: list[dict[str, Any]] = []

    def event(name: str, at: float | None, source: str) -> None:
        if at is not None:
            timeline.append({"event": name, "at": _iso(at), "t": round(at - t0, 3),
                             "source": source})

    event("fault injected", t0, "drill clock")
    event("XID in a Prometheus scrape", result.xid_scraped_at, "Prometheus sample timestamp")
    if signal is not None:
        event(f"signal observed ({signal.source} {signal.kind})", _ts(signal.observed_at),
              "Signal.observed_at")
        event("signal ingested", _ts(signal.ingested_at), "Signal.ingested_at")
    event("incident detected", _ts(incident.detected_at), "Incident.detected_at")
    event("incident opened", _ts(incident.opened_at), "Incident.opened_at")
    event("node drained in Slurm", audit_at("slurm.drain"), "audit slurm.drain")
    event("SIGTERM sent (scancel)", sigterm, "audit slurm.cancel")
    if result.approval:
        event("playbook stopped: no-auto-replace", result.approval.get("blocked_at"),
              "drill saw the remediation blocked")
        event("operator approved through the API", result.approval.get("answered_at"),
              f"POST approve/ answered {result.approval.get('answer')}")
    event("job requeued", requeued, "audit slurm.requeue")
    event("node cordoned in Kubernetes", audit_at("k8s.cordon"), "audit k8s.cordon")
    event("job's pod evicted", audit_at("k8s.evict"), "audit k8s.evict")
    event("replacement requested", audit_at("provider.replace"), "audit provider.replace")
    event("old run gone (hung rank killed)", old_gone, "sinfo: failed node DRAINED")
    event("replacement Ready in Kubernetes", spare_ready, "Kubernetes Node condition")
    event("replacement step done", _ts(steps["replace_node"].finished_at)
          if "replace_node" in steps else None, "Step.finished_at")
    event("spare's acceptance checks started", checks_from, "audit slurm.reserve")
    event("spare resumed in Slurm", resumed_spare, "audit slurm.unreserve (checks passed)")
    event("job running again", running_again,
          "scontrol StartTime" if result.restarted_at else "squeue")
    event("first step after the resume", first_step_at, "training log")
    event("incident resolved", _ts(incident.resolved_at), "Incident.resolved_at")
    timeline.sort(key=lambda e: e["t"])

    downtime = (first_step_at - t0) if first_step_at else None
    waits: dict[str, tuple[float, float] | None] = {
        "scrape": (t0, result.xid_scraped_at)
        if result.xid_scraped_at and c.fault_path != "agent" else None,
        "sigterm_grace": (sigterm, old_gone) if sigterm and old_gone else None,
        "provider": (audit_at("provider.replace"), spare_ready)
        if audit_at("provider.replace") and spare_ready else None,
        "operator": (result.approval["blocked_at"], result.approval["answered_at"])
        if result.approval else None,
        "job_start": (running_again, first_step_at) if running_again and first_step_at
        else None,
        # The return-to-service gate: the check job queued and running in its reservation.
        "acceptance_checks": (checks_from, resumed_spare) if checks_from and resumed_spare
        else None,
    }
    could_run = [t for t in (requeued, old_gone, resumed_spare) if t is not None]
    if could_run and running_again:
        waits["slurm_start"] = (max(could_run), running_again)
    intervals = [w for w in waits.values() if w is not None and w[1] > w[0]]
    outside = _union_within(intervals, t0, first_step_at) if first_step_at else None
    share = (downtime - outside) if downtime is not None and outside is not None else None

    k8s_last = result.k8s_failed_node_last or {}
    annotations = (k8s_last.get("metadata") or {}).get("annotations") or {}
    reason = result.slurm_failed_node.get("Reason", "")
    counts: dict[str, int] = {}
    for verb, _ in acted:
        counts[verb] = counts.get(verb, 0) + 1
    chart_ok = _chart_story(result.chart, t0, first_step_at)
    expected_reason = f"fleetwatch: incident {incident.pk} gpu_hardware"
    checks = {
        "resumed_from_checkpoint": bool(resumed_from) and resumed_from == [last_checkpoint],
        "no_step_lost_beyond_checkpoint": first_after is not None
        and last_checkpoint is not None and first_after["step"] == last_checkpoint + 1,
        "on_replacement_node": SPARE in nodes_after and FAILED not in nodes_after
        and result.job_nodes_after == "gpu-[002,005]",
        "failed_node_drained_by_fleetwatch": "DRAIN" in result.slurm_failed_node.get("State", "")
        and reason.startswith(expected_reason),
        "failed_node_cordoned": bool((k8s_last.get("spec") or {}).get("unschedulable"))
        and annotations.get("fleetwatch.io/cordoned-by") == "fleetwatch",
        # The job's Slurm comment is written twice: when it is stopped, when it is requeued.
        "every_action_audited_once": all(counts.get(v) == 1 for v in EXPECTED_ACTIONS)
        and all(counts.get(v) == 2 for v in TWICE)
        and len(acted) == len(EXPECTED_ACTIONS) + 2 * len(TWICE) and all(e.ok for e in calls),
        "audit_chain_verifies": audit_verify().ok,
        "incident_resolved_with_phases": incident.status == Incident.Status.RESOLVED
        and {"detect", "drain", "requeue", "replace", "resume"} <= set(incident.phases),
        "incident_page_renders": result.page_status == 200,
        "chart_drops_and_recovers": chart_ok,
    }
    if c.no_auto_replace:
        checks["stopped_for_a_person_then_approved"] = bool(result.approval) and \
            result.approval.get("answer") == 200 and incident.repaired_by == "person"
    else:
        checks["no_person_involved"] = incident.repaired_by == "automation"
    checks["all_passed"] = all(checks.values())

    def rnd(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {
        "variant": c.label(),
        "settings": {"sigterm_grace_s": c.grace, "scrape_interval_s": c.scrape,
                     "collect_interval_s": c.collect, "step_poll_s": c.step_poll,
                     "slurm_cred_expire_s": c.cred_expire,
                     "provider_delay_s": c.provider_delay,
                     "provider_ready_delay_s": c.provider_ready_delay,
                     "training_step_s": c.step_seconds,
                     "checkpoint_every_steps": c.checkpoint_every, "fault_path": c.fault_path,
                     "no_auto_replace": c.no_auto_replace},
        "job": {"id": result.job_id, "blocker": result.blocker_id,
                "nodes_after": result.job_nodes_after},
        "incident": {"id": incident.pk, "root_cause": incident.root_cause,
                     "status": incident.status, "repaired_by": incident.repaired_by,
                     "phases": incident.phases, "url": f"{result.web_url}/incidents/{incident.pk}/"},
        "timeline": timeline,
        "timings": {
            "downtime_s": rnd(downtime),
            "fleetwatch_share_s": rnd(share),
            "waits_on_others_s": {k: rnd(v[1] - v[0]) if v else None for k, v in waits.items()},
            "waits_union_s": rnd(outside),
            "detect_s": rnd(_ts(incident.opened_at) - t0),
            "detect_after_scrape_s": rnd(_ts(incident.opened_at) - result.xid_scraped_at)
            if result.xid_scraped_at else None,
            "opened_to_drained_s": rnd(audit_at("slurm.drain") - _ts(incident.opened_at))
            if audit_at("slurm.drain") else None,
            "detected_to_replacement_ready_s": rnd(spare_ready - _ts(incident.detected_at))
            if spare_ready else None,
            "fault_to_resolved_s": rnd(_ts(incident.resolved_at) - t0)
            if incident.resolved_at else None,
        },
        "checkpoint": {"last_step_before_fault": last_step_before,
                       "last_checkpoint_before_fault": last_checkpoint,
                       "last_checkpoint_written_on": checkpoint_why,
                       "sigterm_checkpoints": len(sigterm_saved),
                       "sigterm_handled_on": [r["node"] for r in handled],
                       "rank_hung_on_fault": [r["node"] for r in hung],
                       "resumed_from_step": resumed_from[0] if resumed_from else None,
                       "first_step_after_resume": first_after["step"] if first_after else None,
                       "steps_lost": (last_step_before - last_checkpoint)
                       if last_step_before is not None and last_checkpoint is not None
                       else None,
                       "nodes_after_resume": nodes_after},
        "audit": [{"at": _iso(_ts(e.at)), "verb": e.verb, "target": e.target, "call": e.call,
                   "ok": e.ok, "duration_ms": e.duration_ms} for e in calls],
        "approval": result.approval,
        "checks": checks,
    }


def _chart_story(chart: dict[str, Any], fault_at: float, resumed_at: float | None) -> bool:
    """The incident chart (Prometheus range queries, 15 s points): the job's surviving node
    busy before the fault and idle after it, the replacement busy after the resume."""
    from tests.drill.run import HEALTHY_RANK, SPARE

    series = chart.get("series") or {}

    def points(node: str) -> list[tuple[float, float]]:
        s = series.get(node) or {}
        return [(datetime.fromisoformat(x).timestamp(), float(y))
                for x, y in zip(s.get("x", []), s.get("y", []), strict=False)]

    if resumed_at is None:
        return False
    healthy = points(HEALTHY_RANK)
    busy_before = any(y > 50 for t, y in healthy if t < fault_at)
    idle_between = any(y < 10 for t, y in healthy if fault_at + 1 < t < resumed_at)
    busy_after = any(y > 50 for t, y in points(SPARE) if t > resumed_at)
    return busy_before and idle_between and busy_after


def markdown(report: dict[str, Any]) -> str:
    t = report["timings"]
    ck = report["checkpoint"]
    s = report["settings"]
    lines = [
        f"# Failure drill: {report['variant']}",
        "",
        f"SIGTERM grace (KillWait) {s['sigterm_grace_s']} s, scrape interval "
        f"{s['scrape_interval_s']:g} s, FleetWatch collection {s['collect_interval_s']:g} s, "
        f"Slurm cred_expire {s['slurm_cred_expire_s']} s, node pool {s['provider_delay_s']:g} s "
        f"+ {s['provider_ready_delay_s']:g} s to Ready; a training step every "
        f"{s['training_step_s']:g} s, a checkpoint every {s['checkpoint_every_steps']} steps "
        "and on SIGTERM. Fault: XID 79 through "
        + ("the node agent's kernel log." if s["fault_path"] == "agent"
           else "the exporter, a Prometheus scrape and a PromQL query."),
        "",
        f"Incident {report['incident']['id']} ({report['incident']['root_cause']}, "
        f"{report['incident']['status']}, repaired by {report['incident']['repaired_by']}); "
        f"job {report['job']['id']} now on {report['job']['nodes_after']}.",
        "",
        "## Timeline",
        "",
        "| t (s) | event | from |",
        "|---:|---|---|",
    ]
    lines += [f"| {e['t']:.1f} | {e['event']} | {e['source']} |" for e in report["timeline"]]
    lines += ["", "## Timings", "", "| figure | seconds |", "|---|---:|"]

    def row(name: str, value: float | None) -> None:
        lines.append(f"| {name} | {'' if value is None else f'{value:.1f}'} |")

    row("**downtime** (fault to the first step after the resume)", t["downtime_s"])
    row("**FleetWatch's own share**", t["fleetwatch_share_s"])
    row("waiting on others, together (union)", t["waits_union_s"])
    names = {"scrape": "- exporter and Prometheus scrape", "sigterm_grace":
             "- SIGTERM grace (hung rank until SIGKILL)", "provider":
             "- node provider (delete to new node Ready)", "operator":
             "- operator (stopped to approved)", "slurm_start":
             "- Slurm start (cred_expire, scheduler)", "job_start":
             "- training program start (to its first step)", "acceptance_checks":
             "- the spare's acceptance checks (reservation to release)"}
    for key, name in names.items():
        if key in t["waits_on_others_s"]:
            row(name, t["waits_on_others_s"][key])
    row("fault to incident opened", t["detect_s"])
    row("XID scraped to incident opened", t["detect_after_scrape_s"])
    row("incident opened to node drained", t["opened_to_drained_s"])
    row("detected to replacement Ready", t["detected_to_replacement_ready_s"])
    row("fault to incident resolved", t["fault_to_resolved_s"])
    lines += [
        "",
        "## Checkpoint continuity",
        "",
        f"Last step before the fault: {ck['last_step_before_fault']}; last checkpoint: "
        f"{ck['last_checkpoint_before_fault']} (written {ck['last_checkpoint_written_on']}); "
        f"resumed from step {ck['resumed_from_step']}; first step after the resume: "
        f"{ck['first_step_after_resume']}; steps lost: {ck['steps_lost']}. Ranks after the "
        f"resume on {', '.join(ck['nodes_after_resume'])}; the rank on "
        f"{', '.join(ck['rank_hung_on_fault']) or '?'} hung at the fault.",
        "",
        "## Checks",
        "",
    ]
    lines += [f"- {'PASS' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()
              if name != "all_passed"]
    lines += ["", "How each figure is observed and what counts as waiting on others: "
              "`tests/drill/report.py`.", ""]
    return "\n".join(lines)


def write(result: DrillResult, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = f"drill-{result.config.label()}"
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}-incident.html",
             out / f"{name}-chart.json"]
    paths[0].write_text(json.dumps(result.report, indent=2, default=str) + "\n")
    paths[1].write_text(markdown(result.report))
    paths[2].write_text(result.page_html)
    paths[3].write_text(json.dumps(result.chart, indent=2) + "\n")
    return paths
