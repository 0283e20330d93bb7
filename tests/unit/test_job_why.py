"""Why did my job die? End to end on the simulated fleet: an XID 79 under a running job, the
repair stops and requeues it and writes why into the job's Slurm admin comment (audited), the
owner gets one e-mail with the link, and the job's page, ``GET /api/v1/jobs/ID/why/`` and
``manage.py fleetwatch why`` give the same answer. An application error says it was the job's
own. Real Slurm reads the comment back in tests/integration/test_slurm.py and
test_slurmrestd.py; a browser reads the page in tests/browser/test_researcher_ui.py."""

from __future__ import annotations

import io
import json
from datetime import datetime
from typing import Any

import pytest
from django.core import mail
from django.core.management import call_command
from django.test import Client
from rest_framework.test import APIClient

from collectors import services as collectors
from collectors.clients.base import job_comment
from collectors.models import Job
from collectors.sim.fleet import SimFleet, inject_xid
from incidents import diagnosing
from incidents.models import AuditEntry, Delivery, Incident
from tests.conftest import token_for
from tests.unit.test_notify import (
    SLACK_PATH,
    Receiver,
    receiver,  # noqa: F401  (the fixture: a Slack hook here)
)
from tests.unit.test_remediation import drive

pytestmark = pytest.mark.django_db


def test_a_comment_keeps_what_the_user_wrote_and_replaces_fleetwatchs_own() -> None:
    assert job_comment("", "requeued after XID 79") == "fleetwatch: requeued after XID 79"
    mine = job_comment("my run 7", "stopped after XID 79")
    assert mine == "fleetwatch: stopped after XID 79 | my run 7"
    assert job_comment(mine, "fleetwatch: requeued after XID 79") == (
        "fleetwatch: requeued after XID 79 | my run 7")
    # FleetWatch's text never carries the separator (it would eat the user's words later).
    assert job_comment("", "a | b\nc") == "fleetwatch: a; b c"


@pytest.fixture
def requeued(sim_fleet: SimFleet, settings: Any,
             django_capture_on_commit_callbacks: Any) -> dict[str, Any]:
    """XID 79 on gpu-003 GPU 5 under job 4001's first run, repaired automatically."""
    settings.FLEETWATCH_SIM_SPEED = 400.0
    settings.FLEETWATCH_POLICY_MODE = "auto"
    settings.FLEETWATCH_BASE_URL = "https://fleetwatch.example"
    settings.FLEETWATCH_OWNER_EMAIL_DOMAIN = "lab.example"
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    sim_fleet.speed = 400.0
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    job = Job.objects.get(nodes__icontains='"gpu-003"', state="RUNNING")
    first_start, first_submit = job.first_started_at, job.submitted_at
    with sim_fleet.transaction() as state:
        inject_xid(state, "gpu-003", 5, 79, sim_fleet.clock.now())
    collectors.collect_source("telemetry")
    with django_capture_on_commit_callbacks():
        found = diagnosing.diagnosis_run(collectors.cluster_default().pk)
    [incident] = [i for i in found if i.root_cause == "gpu_hardware"]
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks,
                between=lambda: collectors.collect_source("slurm"))
    for _ in range(40):  # until the requeued job runs again
        collectors.collect_source("slurm")
        job.refresh_from_db()
        if job.state == "RUNNING" and job.restart_count == 1:
            break
    return {"job": job, "incident": incident, "rem": rem, "first_start": first_start,
            "first_submit": first_submit}


def test_the_requeued_job_carries_why_in_slurm_and_its_owner_is_told_once(
        requeued: dict[str, Any], sim_fleet: SimFleet) -> None:
    job, incident, rem = requeued["job"], requeued["incident"], requeued["rem"]
    assert rem.status == "succeeded"
    comment = sim_fleet.snapshot()["jobs"][job.slurm_id]["admin_comment"]
    assert comment == (f"fleetwatch: requeued after XID 79 (GPU has fallen off the bus) on "
                       f"gpu-003 GPU 5, incident {incident.pk}, "
                       f"https://fleetwatch.example/jobs/{job.slurm_id}/?cluster=sim")
    # Read back by the collector, as Slurm reports it.
    assert Job.objects.get(pk=job.pk).admin_comment == comment
    # Audited like every outside call: stopped, then requeued.
    written = list(AuditEntry.objects.filter(remediation=rem, verb="slurm.comment")
                   .order_by("id").values_list("target", "ok", "call"))
    assert [(t, ok) for t, ok, _ in written] == [(f"job {job.slurm_id} stopped", True),
                                                  (f"job {job.slurm_id} requeued", True)]
    assert written[1][2].startswith(f"scontrol update jobid={job.slurm_id} admincomment=")
    # The owner: one e-mail, to USER@FLEETWATCH_OWNER_EMAIL_DOMAIN, with the link.
    [message] = [m for m in mail.outbox if m.to == [f"{job.user}@lab.example"]]
    assert f"Your Slurm job {job.slurm_id} was requeued after XID 79" in message.subject
    assert f"https://fleetwatch.example/jobs/{job.slurm_id}/?cluster=sim" in message.body
    assert Delivery.objects.filter(channel="email", status="delivered").count() >= 1


def test_page_api_and_command_give_the_same_answer(
        requeued: dict[str, Any], client: Client, viewer: Any) -> None:
    job, incident = requeued["job"], requeued["incident"]
    job.refresh_from_db()
    # Slurm moved the start to the requeue; the first ones FleetWatch saw are kept.
    assert job.first_started_at == requeued["first_start"] < job.started_at
    assert job.submitted_at == requeued["first_submit"]

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(viewer, ('read',))}")
    answer = api.get(f"/api/v1/jobs/{job.slurm_id}/why/")
    assert answer.status_code == 200, answer.content
    why = answer.json()
    assert why["stopped_by"] == "fault" and why["job_at_fault"] is False
    assert why["fault"] == "XID 79 (GPU has fallen off the bus) on gpu-003 GPU 5"
    assert (why["node"], why["gpu"], why["incident"]) == ("gpu-003", 5, incident.pk)
    assert why["action"] == "FleetWatch stopped it and requeued it"
    assert why["resumed_from_step"] == job.resumed_from_step is not None
    assert why["steps_lost"] is not None and why["steps_lost"] >= 0
    assert why["downtime_seconds"] is not None and why["downtime_seconds"] > 0
    assert why["headline"].startswith(
        f"XID 79 (GPU has fallen off the bus) on gpu-003 GPU 5 stopped job {job.slurm_id} at ")
    assert f"it resumed from step {job.resumed_from_step}" in why["headline"]
    assert why["slurm_comment"].startswith("fleetwatch: requeued after XID 79")

    client.force_login(viewer)
    page = client.get(f"/jobs/{job.slurm_id}/").content.decode()
    assert f'data-testid="job-why">{why["headline"]}</p>' in page.replace("&#x27;", "'")
    assert 'data-testid="why-not-job">not the job\'s fault' in page
    assert 'id="job-util-chart"' in page
    chart = client.get(f"/jobs/{job.slurm_id}/chart.json").json()
    assert datetime.fromisoformat(chart["fault_at"]) == datetime.fromisoformat(why["at"])
    assert "gpu-003 GPU 5" in chart["utilization"] or "gpu-003 GPU 5" in chart["temperature"]

    out = io.StringIO()
    call_command("fleetwatch", "why", job.slurm_id, stdout=out)
    assert out.getvalue().splitlines()[0] == why["headline"]
    out = io.StringIO()
    call_command("fleetwatch", "why", job.slurm_id, "--json", stdout=out)
    assert json.loads(out.getvalue()) == why


def test_an_unknown_job_is_a_clear_404_and_a_command_error(client: Client, viewer: Any) -> None:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(viewer, ('read',))}")
    answer = api.get("/api/v1/jobs/999999/why/")
    assert answer.status_code == 404 and answer.json()["detail"] == "no job 999999"
    from django.core.management.base import CommandError
    with pytest.raises(CommandError, match="no job 999999"):
        call_command("fleetwatch", "why", "999999", stdout=io.StringIO())


def test_an_application_error_says_plainly_it_was_the_job_with_the_evidence(
        sim_fleet: SimFleet, client: Client, viewer: Any) -> None:
    for source in ("slurm",):
        collectors.collect_source(source)
    job = Job.objects.filter(state="RUNNING").first()
    assert job is not None
    Job.objects.filter(pk=job.pk).update(state="FAILED")
    cluster = collectors.cluster_default()
    from django.utils import timezone

    from collectors.models import Signal
    from incidents.models import Evidence
    signal = Signal.objects.create(
        cluster=cluster, source="job_log", kind="traceback", node_name=job.nodes[0],
        job_id=job.slurm_id, message="torch.OutOfMemoryError: CUDA out of memory",
        observed_at=timezone.now())
    incident = Incident.objects.create(
        cluster=cluster, root_cause="application_error", confidence=0.9, explanation="OOM",
        fingerprint=f"application_error:{job.slurm_id}", nodes=[job.nodes[0]],
        jobs=[job.slurm_id], detected_at=signal.observed_at)
    Evidence.objects.create(incident=incident, signal=signal, role="cause")
    client.force_login(viewer)
    page = client.get(f"/jobs/{job.slurm_id}/").content.decode()
    assert f"Job {job.slurm_id} died of its own error" in page
    assert "an application error, not the fleet&#x27;s fault" in page
    assert 'data-testid="why-job-at-fault">the job\'s own error' in page
    assert "torch.OutOfMemoryError: CUDA out of memory" in page  # the evidence, shown open


# --- the owner's channel --------------------------------------------------------------------


def test_the_owner_is_reached_by_their_mapping_or_the_domain_or_not_at_all(
        receiver: Receiver, db: None, settings: Any) -> None:  # noqa: F811
    from collectors.clients.notify import owner_notify

    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.FLEETWATCH_NOTIFY_SLACK_URL = f"{receiver.url}{SLACK_PATH}"
    settings.FLEETWATCH_OWNER_CONTACTS = {"bob": "slack:U0123ABCD", "carol": "none",
                                          "dave": "d.smith@lab.example"}
    settings.FLEETWATCH_OWNER_EMAIL_DOMAIN = ""
    payload: dict[str, object] = {"incident": 3, "job": "4001", "delivery_key": "k-bob"}

    sent = owner_notify("bob", "Your Slurm job 4001 was requeued", "the story <here>", payload)
    assert sent.changed
    body = receiver.to(SLACK_PATH)[0].json
    assert body["text"].startswith("<@U0123ABCD>\n")  # mentioned by name in the channel
    assert "the story &lt;here&gt;" in body["text"]
    # Once: the same delivery key sends nothing again.
    owner_notify("bob", "Your Slurm job 4001 was requeued", "the story", payload)
    assert len(receiver.to(SLACK_PATH)) == 1

    assert owner_notify("dave", "s", "b", {"delivery_key": "k-dave"}).changed
    assert mail.outbox[-1].to == ["d.smith@lab.example"]
    # Nobody to tell: said plainly, no outside call (an empty call is audited as a note).
    for user in ("carol", "erin"):
        told = owner_notify(user, "s", "b", {"delivery_key": f"k-{user}"})
        assert (told.changed, told.call) == (False, "")
        assert f"owner {user} not told" in told.detail
    settings.FLEETWATCH_OWNER_EMAIL_DOMAIN = "lab.example"
    assert owner_notify("erin", "s", "b", {"delivery_key": "k-erin2"}).changed
    assert mail.outbox[-1].to == ["erin@lab.example"]


def test_a_bad_owner_mapping_stops_at_start_naming_it() -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, capture_output=True,
        text=True, env={**__import__("os").environ, "DJANGO_SETTINGS_MODULE": "fleetwatch.settings",
                        "FLEETWATCH_FLEET": "sim", "FLEETWATCH_OWNER_CONTACTS": "alice=slack:me"})
    assert done.returncode != 0
    assert "FLEETWATCH_OWNER_CONTACTS: 'alice=slack:me' is not USER=ADDRESS" in done.stderr
