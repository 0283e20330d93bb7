"""The end-to-end failure drill (``tests/drill``), shortened: a GPU dies under a real Slurm
training job and FleetWatch, on real sources (real Slurm, the Kubernetes test server, a real
Prometheus scraping the simulated dcgm-exporter) with its real web server, worker and beat,
repairs the fleet alone; the job resumes from its checkpoint on the spare.

Shortened means a 3 s SIGTERM grace, 1 s scrapes and collections and a 10 s cred_expire
instead of 120 s, 15 s and 120 s; the figures of a production-like run are ``make drill``'s
report, never asserted here. What is asserted is what an operator would check: the training
job's own log, ``scontrol``/``squeue``, the Kubernetes Node as it was last seen, the audit
trail, the incident and its page's chart.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from incidents.audit import audit_verify
from incidents.models import AuditEntry, Incident, Remediation, Step
from tests.drill import report
from tests.drill.run import FAILED, SPARE, Drill, DrillConfig, DrillResult
from tests.harness.slurm_cluster import missing_binaries

pytestmark = pytest.mark.integration


def shortened(**overrides: object) -> DrillConfig:
    base: dict[str, object] = dict(
        grace=3, scrape=1.0, collect=1.0, step_poll=0.3, cred_expire=10, provider_delay=1.0,
        provider_ready_delay=0.5, step_seconds=0.3, checkpoint_every=5, progress_steps=12,
        after_steps=3, timeout=180.0)
    base.update(overrides)
    return DrillConfig(**base)  # type: ignore[arg-type]


def drill(config: DrillConfig, tmp_path: Path) -> Iterator[DrillResult]:
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if connection.vendor != "postgresql" or not broker.startswith("redis://"):
        pytest.fail("the drill needs PostgreSQL and Redis: run it with `make test`")
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed (missing {', '.join(missing)}): run `make test`")
    import redis

    redis.Redis.from_url(broker).flushdb()
    db = connection.settings_dict
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    with Drill(config, url, broker) as running:
        result = running.run()
        # The report beside the test's files, as `make drill` writes it (for a person
        # reading a failed run).
        report.write(result, tmp_path / "report")
        yield result


@pytest.fixture
def automatic(transactional_db: None, tmp_path: Path) -> Iterator[DrillResult]:
    yield from drill(shortened(), tmp_path)


@pytest.fixture
def opted_out(transactional_db: None, tmp_path: Path) -> Iterator[DrillResult]:
    # The node agent's kernel log carries the XID this time, and the node's pod opts out.
    yield from drill(shortened(fault_path="agent", no_auto_replace=True), tmp_path)


def _common(result: DrillResult) -> tuple[Incident, Remediation]:
    r = result.report
    ck = r["checkpoint"]
    # The job resumed from its last checkpoint, on the spare, losing no step beyond it.
    assert ck["last_checkpoint_before_fault"] is not None
    assert ck["resumed_from_step"] == ck["last_checkpoint_before_fault"], ck
    assert ck["first_step_after_resume"] == ck["resumed_from_step"] + 1, ck
    # The healthy rank saved the last step all ranks finished when SIGTERM came (or found it
    # saved already by the periodic checkpoint); the rank on the dead GPU hung and could not.
    assert ck["sigterm_handled_on"] == ["gpu-002"] and ck["steps_lost"] == 0, ck
    assert ck["rank_hung_on_fault"] == [FAILED]
    assert ck["nodes_after_resume"] == ["gpu-002", SPARE]
    assert result.job_nodes_after == "gpu-[002,005]"

    incident = Incident.objects.get(pk=result.incident_id)
    rem = Remediation.objects.get(pk=result.remediation_id)
    assert (incident.root_cause, incident.nodes) == ("gpu_hardware", [FAILED])
    assert incident.status == Incident.Status.RESOLVED and rem.status == "succeeded"
    assert {"detect", "drain", "requeue", "replace", "resume"} <= set(incident.phases)
    assert all(isinstance(v, float) for v in incident.phases.values())

    # Slurm: the failed node drained with FleetWatch's reason.
    node = result.slurm_failed_node
    assert "DRAIN" in node["State"], node
    assert node["Reason"].startswith(f"fleetwatch: incident {incident.pk} gpu_hardware"), node
    # Kubernetes: cordoned by FleetWatch before the node pool's provider deleted it.
    last = result.k8s_failed_node_last
    assert last is not None and last["spec"]["unschedulable"] is True
    assert last["metadata"]["annotations"]["fleetwatch.io/cordoned-by"] == "fleetwatch"

    # The audit trail: every outside action exactly once, in the playbook's order, all ok.
    calls = list(AuditEntry.objects.filter(remediation=rem).exclude(call="").order_by("id"))
    assert [(e.verb, e.target) for e in calls] == [
        ("notify", "on-call"), ("slurm.drain", FAILED), ("slurm.comment", f"job {result.job_id} stopped"),
        ("slurm.cancel", f"job {result.job_id}"),
        ("slurm.requeue", f"job {result.job_id}"),
        ("slurm.comment", f"job {result.job_id} requeued"), ("k8s.cordon", FAILED),
        ("k8s.evict", f"slurm/slurmd-{FAILED}"), ("provider.replace", FAILED),
        # The spare's acceptance checks, then the resume step that finds it in service.
        ("slurm.reserve", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)"),
        ("slurm.resume", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)"),
        ("slurm.submit_check", f"{SPARE} fleetwatch-check-r{rem.pk}-1-fleetwatch-check"),
        ("slurm.unreserve", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)"),
        ("slurm.resume", SPARE)], [(e.verb, e.target, e.result) for e in calls]
    assert all(e.ok for e in calls)
    assert audit_verify().ok

    # The running FleetWatch's incident page, and its chart from Prometheus: the job's
    # surviving node busy before the fault and idle after it, the spare busy after the resume.
    assert result.page_status == 200
    assert f"Incident #{incident.pk}: GPU hardware" in result.page_html
    assert "Timeline" in result.page_html  # with the drain's exact outside call in it
    assert f"scontrol update nodename={FAILED} state=DRAIN" in result.page_html
    assert r["checks"]["chart_drops_and_recovers"], result.chart
    # Every timing is there and in order of the story.
    t = {e["event"]: e["t"] for e in r["timeline"]}
    assert 0 < t["incident opened"] < t["node drained in Slurm"] < t["job requeued"] \
        < t["spare's acceptance checks started"] < t["spare resumed in Slurm"]
    # The waiting job starts on the spare within a second of its reservation's deletion, and
    # Slurm's StartTime has whole seconds.
    assert t["spare resumed in Slurm"] < t["job running again"] + 1.0
    assert t["job running again"] < t["first step after the resume"]
    assert r["timings"]["fleetwatch_share_s"] is not None
    assert 0 < r["timings"]["fleetwatch_share_s"] < r["timings"]["downtime_s"]
    return incident, rem


def test_gpu_dies_and_training_resumes_on_the_spare_with_no_person(
        automatic: DrillResult) -> None:
    incident, rem = _common(automatic)
    r = automatic.report
    assert incident.repaired_by == "automation" and rem.approved_by == ""
    # The fault went the production way: exporter, scrape, PromQL.
    assert automatic.xid_scraped_at is not None
    assert automatic.injected_at <= automatic.xid_scraped_at
    assert r["timings"]["waits_on_others_s"]["scrape"] is not None
    assert r["checks"]["all_passed"], r["checks"]


def test_no_auto_replace_stops_before_the_cordon_until_an_operator_approves(
        opted_out: DrillResult) -> None:
    incident, rem = _common(opted_out)
    r = opted_out.report
    # It reached FleetWatch through the node agent (kernel log, POST /api/v1/signals/).
    cause = incident.evidence.filter(role="cause").select_related("signal").first()
    assert cause is not None and cause.signal.source == "kernel"
    # It stopped before the cordon, said why, and went on when an operator approved through
    # the API (token auth, as a program would).
    approval = opted_out.approval
    assert approval["status_seen"] == "blocked" and approval["answer"] == 200
    assert "fleetwatch.io/no-auto-replace=true" in approval["blocked_reason"]
    check = Step.objects.get(remediation=rem, kind="check_no_auto_replace")
    cordon = AuditEntry.objects.get(remediation=rem, verb="k8s.cordon")
    continued = AuditEntry.objects.get(remediation=rem, verb="remediation.continued")
    assert continued.actor.startswith("token:drill-operator")
    assert check.result["overridden_by"] == continued.actor
    assert continued.at < cordon.at
    assert incident.repaired_by == "person"
    assert r["timings"]["waits_on_others_s"]["operator"] is not None
    assert r["checks"]["all_passed"], r["checks"]
