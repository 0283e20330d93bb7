"""What `make run` does at each start (deploy/run-local.sh): seed without taking an existing
login's password, and resume the steps the last stop cut off (PostgreSQL under make test; the
whole start on SQLite is tests/integration/test_run_lifecycle.py)."""

from __future__ import annotations

from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import authenticate
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.utils import timezone

from collectors import services as collectors
from collectors.roles import DEMO_LOGIN_FILE
from collectors.sim.fleet import SimFleet
from incidents import lifecycle
from incidents.models import AuditEntry, Step
from incidents.remediation import engine
from tests.unit.test_services import DIAG

pytestmark = pytest.mark.django_db


def _seed(*args: str) -> str:
    out = StringIO()
    call_command("fleetwatch", "seed", "--demo-user", "demo", *args, stdout=out)
    return out.getvalue()


def test_seeding_again_keeps_an_existing_logins_password(sim_fleet: SimFleet, settings: Any,
                                                         tmp_path: Path) -> None:
    settings.DATA_DIR = tmp_path  # where the login is saved, not the checkout's data/
    made = _seed()
    generated = made.split("login: demo / ")[1].split()[0]
    assert authenticate(username="demo", password=generated)

    # Every `make run` seeds: without a password asked for, the login stays as it was, and
    # is printed whole again (saved in the data folder, the owner's alone).
    assert f"login: demo / {generated}  (kept from the last start)" in _seed()
    assert authenticate(username="demo", password=generated)
    assert (settings.DATA_DIR / DEMO_LOGIN_FILE).stat().st_mode & 0o077 == 0

    # Asked for, a new one; a password changed by hand is kept and not shown.
    rotated = _seed("--rotate-password").split("login: demo / ")[1].split()[0]
    assert rotated != generated and authenticate(username="demo", password=rotated)
    user = User.objects.get(username="demo")
    user.set_password("changed-by-hand")
    user.save()
    assert "password unchanged, changed since FleetWatch set it" in _seed()
    assert authenticate(username="demo", password="changed-by-hand")

    # FLEETWATCH_DEMO_PASSWORD (make run passes it as --password) sets it, new login or not.
    assert "login: demo / chosen-pass-1" in _seed("--password", "chosen-pass-1")
    assert authenticate(username="demo", password="chosen-pass-1")
    assert not authenticate(username="demo", password=generated)


def test_start_up_releases_every_lease_and_resumes_without_repeating_calls(
        sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    collectors.collect_source("slurm")
    with django_capture_on_commit_callbacks():
        incident, _ = lifecycle.incident_record(collectors.cluster_default().pk, DIAG)
    rem = incident.remediations.get()
    notify = rem.steps.get(order=1)
    # The last stop cut the first step off after its call had returned and been recorded;
    # its lease would keep the watchdog away for minutes.
    Step.objects.filter(pk=notify.pk).update(
        status=Step.Status.RUNNING, started_at=timezone.now(), attempts=1,
        lease_until=timezone.now() + timezone.timedelta(minutes=2),
        done_calls=["notify on-call"])
    assert engine.steps_rescue() == []

    with django_capture_on_commit_callbacks() as queued:
        assert engine.steps_resume_all() == [notify.pk]
    assert len(queued) == 1
    notify.refresh_from_db()
    assert notify.lease_until is None
    released = AuditEntry.objects.get(verb="step.lease_released")
    assert released.step_id == notify.pk and "resumes" in released.result

    # The resumed run does not notify a second time: the call is in done_calls.
    with django_capture_on_commit_callbacks():
        assert engine.step_run(notify.pk, "restart") == "succeeded"
    assert not AuditEntry.objects.filter(verb="notify").exists()


def test_start_up_resume_refuses_a_shared_database() -> None:
    # PostgreSQL here: other workers may be running steps; their leases are not dead ones.
    with pytest.raises(CommandError, match="embedded default"):
        call_command("fleetwatch", "steps-resume")
