"""A remediation that waits for a person from the start (approve mode, or held by a safety
rail) pages the on-call channels at once: its own notify step runs only after the approval,
so without the page the person who must approve would not hear of it (issue 18: in a storm
the fleet budget holds every new repair, and a fault elsewhere must still be acted on).

Against the database, through the real diagnosis lifecycle and the e-mail channel (Django's
in-memory mail backend); the page task is run here from the captured on-commit callbacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.core import mail

from collectors import queueing
from collectors import services as collectors
from collectors.sim.fleet import SimFleet
from incidents import lifecycle
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Delivery, Incident, Remediation
from incidents.remediation import engine
from incidents.remediation.playbooks import FOR_ROOT_CAUSE
from incidents.remediation.transitions import remediation_open

pytestmark = pytest.mark.django_db


@pytest.fixture
def cluster(sim_fleet: SimFleet, settings: Any) -> Any:
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.FLEETWATCH_NOTIFY_EMAIL = ["oncall@example.com"]
    settings.FLEETWATCH_BUDGET_MAX_NODES = 1
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    return collectors.cluster_default()


def diag(root_cause: str, node: str) -> Diagnosis:
    from django.utils import timezone

    return Diagnosis(root_cause=root_cause, nodes=(node,), confidence=0.95,
                     playbook=FOR_ROOT_CAUSE[root_cause], explanation=f"{root_cause} on {node}",
                     detected_at=timezone.now(), jobs=())


def record(cluster: Any, d: Diagnosis, capture: Any) -> tuple[Incident, list[Callable[[], Any]]]:
    with capture() as callbacks:
        incident, _ = lifecycle.incident_record(cluster.pk, d)
    return incident, callbacks


def pages(callbacks: list[Callable[[], Any]]) -> list[Any]:
    return [c for c in callbacks if getattr(c, "task", None) == queueing.PAGE_PERSON]


def test_a_repair_held_by_a_rail_pages_on_call_at_once(
        cluster: Any, django_capture_on_commit_callbacks: Any) -> None:
    first, callbacks = record(cluster, diag("gpu_hardware", "gpu-003"),
                              django_capture_on_commit_callbacks)
    assert first.remediations.get().status == Remediation.Status.RUNNING
    assert pages(callbacks) == []  # running: its notify step tells on-call

    held, callbacks = record(cluster, diag("gpu_memory", "gpu-007"),
                             django_capture_on_commit_callbacks)
    rem = held.remediations.get()
    assert rem.status == Remediation.Status.AWAITING_APPROVAL
    assert rem.hold_reason.startswith("fleet budget")
    [page] = pages(callbacks)
    assert page.args == (rem.pk,)
    engine.person_page(rem.pk)

    [sent] = mail.outbox
    assert sent.to == ["oncall@example.com"]
    assert f"incident {held.pk}: gpu_memory on gpu-007 waits for a person's approval" in \
        sent.subject
    assert "fleet budget" in sent.body and "gpu_memory on gpu-007" in sent.body
    entry = AuditEntry.objects.get(remediation=rem, verb="notify")
    assert entry.ok and entry.call == "email to oncall@example.com"
    assert entry.data["page"] == "approval"
    assert Delivery.objects.filter(incident_id=held.pk, channel="email").count() == 1


def test_approve_mode_pages_and_a_person_pressing_start_does_not(
        cluster: Any, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_BUDGET_MAX_NODES = 8
    settings.FLEETWATCH_PLAYBOOK_MODES = {"thermal": "approve"}
    incident, callbacks = record(cluster, diag("thermal", "gpu-004"),
                                 django_capture_on_commit_callbacks)
    rem = incident.remediations.get()
    assert rem.status == Remediation.Status.AWAITING_APPROVAL and rem.hold_reason == ""
    assert len(pages(callbacks)) == 1
    engine.person_page(rem.pk)
    assert f"the {rem.playbook} playbook runs in approve mode" in mail.outbox[0].body

    # Approved meanwhile: a page that comes late says nothing to anybody.
    mail.outbox.clear()
    Remediation.objects.filter(pk=rem.pk).update(status=Remediation.Status.RUNNING)
    assert "nobody to page" in engine.person_page(rem.pk)
    assert mail.outbox == []

    # A person pressing "start" has decided (the rails that hold automation do not apply):
    # no page about it.
    low = Diagnosis(root_cause="gpu_memory", nodes=("gpu-006",), confidence=0.5,
                    playbook=FOR_ROOT_CAUSE["gpu_memory"], explanation="low confidence",
                    detected_at=incident.detected_at, jobs=())
    unstarted, _ = record(cluster, low, django_capture_on_commit_callbacks)
    assert not unstarted.remediations.exists()  # below the confidence for automation
    with django_capture_on_commit_callbacks() as callbacks:
        opened = remediation_open(unstarted, actor="user:olivia")
    assert opened.remediation.status == Remediation.Status.RUNNING
    assert pages(callbacks) == [] and mail.outbox == []
