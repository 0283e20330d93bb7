"""Chaos for lending: a lend and a return, each interrupted by a worker killed with SIGKILL
inside an outside call, finish exactly once.

Real ``celery worker -B`` processes on real PostgreSQL and Redis run the loan against the
simulated fleet, whose test hook (FLEETWATCH_SIM_ACTION_DELAY) makes ``k8s.relabel`` and
``k8s.evict`` sleep before they change anything, so each kill lands inside the call. Only the
database can bring the loan back: the killed worker's message returns from Redis after the
visibility timeout (an hour), so the next worker's watchdog (``loans_rescue``, in its beat)
must queue the loan again once its lease has run out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors.models import Node
from collectors.sim.fleet import SimFleet
from incidents.audit import audit_verify
from incidents.lending import services
from incidents.models import AuditEntry, Loan
from tests.conftest import wait_for
from tests.integration.test_chaos import Chaos, _chaos

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

NODE = "gpu-013"  # the sim's job 3003 held it; it is cancelled below, so the node is idle


@pytest.fixture
def chaos(transactional_db: None, settings: Any, tmp_path: Path) -> Iterator[Chaos]:
    c = _chaos(settings, tmp_path, os.environ.get("CELERY_BROKER_URL", ""),
               FLEETWATCH_SIM_ACTION_DELAY="k8s.relabel=4,k8s.evict=4")
    # Job 3003 ends: gpu-013..016 idle in Slurm.
    with SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED).transaction() \
            as state:
        state["jobs"]["3003"].update(state="COMPLETED", nodes=[], gpus={})
    try:
        yield c
    finally:
        c.stop_all()


def _wait(chaos: Chaos, what: str, predicate: Any, timeout: float = 90) -> Any:
    try:
        return wait_for(predicate, timeout, what, interval=0.05)
    except AssertionError:
        print(chaos.logs())
        print(list(Loan.objects.values_list("status", "step", "lease_until", "next_check_at",
                                            "done_calls", "detail")))
        raise


def _in_call(step: str) -> Loan | None:
    """The loan while a worker runs ``step`` and has not made its call yet."""
    loan = Loan.objects.filter(step=step, lease_until__isnull=False).first()
    verb = "k8s.relabel" if step == "lend_label" else "k8s.evict"
    if loan is None or AuditEntry.objects.filter(data__loan=loan.pk, verb=verb).exists():
        return None
    return loan


def _once(loan: Loan, verb: str) -> AuditEntry:
    (entry,) = AuditEntry.objects.filter(data__loan=loan.pk, verb=verb)
    assert entry.ok and entry.call
    return entry


def test_a_lend_and_a_return_cut_off_by_a_killed_worker_finish_once(
        chaos: Chaos, settings: Any) -> None:
    first = chaos.start_worker()
    _wait(chaos, "the first collection",
          lambda: Node.objects.filter(name=NODE, slurm_state="IDLE", k8s_ready=True).exists())

    loan = services.loan_lend(None, NODE, actor="user:olivia", reason="chaos")
    _wait(chaos, "the lend inside its relabel call", lambda: _in_call("lend_label"))
    chaos.kill_worker(first)
    second = chaos.start_worker()
    loan = _wait(chaos, "the loan lent", lambda: Loan.objects.filter(
        pk=loan.pk, status=Loan.Status.LENT).first())
    state = SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED).snapshot()
    node = state["nodes"][NODE]
    assert node["drained"] and node["labels"]["fleetwatch.io/lent-to"] == "inference"
    assert "watchdog: re-queued loan(s)" in second.log.read_text()

    with SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED).transaction() \
            as state:
        state["pods"].append({"namespace": "inference", "name": "llm-0", "node": NODE,
                              "labels": {"app": "llm"}, "owner_kind": "ReplicaSet"})
    services.loan_return(loan.pk, actor="user:olivia", reason="chaos")
    _wait(chaos, "the return inside its eviction", lambda: _in_call("return_evict"))
    chaos.kill_worker(second)
    chaos.start_worker()
    loan = _wait(chaos, "the loan returned", lambda: Loan.objects.filter(
        pk=loan.pk, status=Loan.Status.RETURNED).first())

    state = SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED).snapshot()
    node = state["nodes"][NODE]
    assert not node["drained"] and "fleetwatch.io/lent-to" not in node["labels"]
    assert not [p for p in state["pods"] if p["name"] == "llm-0"]
    for verb in ("slurm.drain", "k8s.relabel", "k8s.cordon", "k8s.evict", "k8s.unlabel",
                 "k8s.uncordon", "slurm.resume"):
        _once(loan, verb)
    assert audit_verify().ok
