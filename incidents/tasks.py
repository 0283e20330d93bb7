"""Thin Celery tasks: take ids, call one service.

Nothing imports this module but Celery's autodiscovery and the tests: code that queues a task
names it (collectors.queueing) instead, so no service imports the tasks that import it.

Remediation steps are ``acks_late``: a worker that dies mid-step leaves the message on the
queue, and the step (idempotent, leased) runs again on another worker.
"""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task
from django.db import DatabaseError

from collectors import queueing
from incidents import audit, deliveries, diagnosing, webhooks
from incidents.lending import services as lending
from incidents.remediation import engine


# Diagnosis is coalesced per cluster (diagnosing.diagnosis_run): at most one run queued and one
# running, whatever the push rate. The row in the database is the truth, not the message: a
# run lost with its worker or its broker is re-sent by diagnosis_rescue (beat) or by the next
# push, so the message is acknowledged early and not retried (a retry would be a second one
# queued).
@shared_task(name=queueing.DIAGNOSE_CLUSTER, ignore_result=True)
def diagnose_cluster(cluster_id: int) -> None:
    diagnosing.diagnosis_run(cluster_id)


@shared_task(name=queueing.DIAGNOSIS_RESCUE, ignore_result=True)
def diagnosis_rescue() -> None:
    diagnosing.diagnosis_rescue()


# Messages queued by a version that sent one diagnosis per batch: their signals are marked
# due like new ones, so an upgrade with a full queue loses none of them.
@shared_task(name=queueing.DIAGNOSE_SIGNALS, ignore_result=True,
             autoretry_for=(DatabaseError,), retry_backoff=True, max_retries=5)
def diagnose_signals(signal_ids: list[int]) -> None:
    diagnosing.diagnosis_request(signal_ids)


@shared_task(name=queueing.RUN_STEP, ignore_result=True, acks_late=True,
             reject_on_worker_lost=True)
def run_step(step_id: int, reason: str = "start") -> None:
    engine.step_run(step_id, reason)


# Sent once: the page is recorded as a delivery and an audit entry, and the webhook event of
# the same wait (with its own retries and rescue) reaches the subscribers whatever happens here.
@shared_task(name=queueing.PAGE_PERSON, ignore_result=True, acks_late=True,
             reject_on_worker_lost=True)
def page_person(remediation_id: int) -> None:
    engine.person_page(remediation_id)


@shared_task(name=queueing.STEPS_RESCUE, ignore_result=True)
def steps_rescue() -> None:
    engine.steps_rescue()


# The row is the truth (attempts, next attempt, outcome); Celery only carries the wake-up.
# max_retries=None: FLEETWATCH_WEBHOOK_MAX_ATTEMPTS, counted on the row, is the limit.
@shared_task(name=queueing.WEBHOOK_DELIVER, bind=True, ignore_result=True,
             acks_late=True, reject_on_worker_lost=True, max_retries=None)
def webhook_deliver(self: Task, delivery_id: int) -> None:
    countdown = webhooks.delivery_attempt(delivery_id)
    if countdown is not None:
        raise self.retry(countdown=countdown)


@shared_task(name=queueing.WEBHOOKS_RESCUE, ignore_result=True)
def webhooks_rescue() -> None:
    deliveries.rescue()


# The beat's, every FLEETWATCH_AUDIT_CHECKPOINT_MINUTES: the audit trail's signed head into the
# log (for the log shipper to carry off the machine), then as an ``audit.checkpoint`` event to
# the webhook subscriptions that list it. Here rather than in incidents/audit.py, so the audit
# trail (which nearly everything imports) imports no webhooks. Returns the checkpoint to a
# direct caller (the tests); the worker keeps no result.
@shared_task(name=queueing.AUDIT_CHECKPOINT, ignore_result=True)
def audit_checkpoint() -> dict[str, Any]:
    checkpoint = audit.checkpoint_log()
    webhooks.checkpoint_emit(checkpoint)  # never raises: the log has it whatever happens here
    return checkpoint


# A loan's steps (incidents/lending): late-acked as remediation steps are, so a worker that dies
# mid-step leaves the message for another; the loan's lease and its recorded calls make the
# second run finish what the first began, once.
@shared_task(name=queueing.LOAN_RUN, ignore_result=True, acks_late=True,
             reject_on_worker_lost=True)
def loan_run(loan_id: int, reason: str = "start") -> None:
    lending.loan_run(loan_id, reason)


# The beat's, every FLEETWATCH_LEND_TICK_SECONDS: the automatic lending decision of each
# cluster.
@shared_task(name=queueing.LENDING_TICK, ignore_result=True)
def lending_tick() -> None:
    lending.lending_tick_all()


# The beat's, every FLEETWATCH_WATCHDOG_SECONDS: loans whose message a killed worker or a
# restarted broker lost, queued again once their lease has run out.
@shared_task(name=queueing.LOANS_RESCUE, ignore_result=True)
def loans_rescue() -> None:
    lending.loans_rescue()


# The beat's, every FLEETWATCH_CAPACITY_SNAPSHOT_SECONDS: the capacity chart's points.
@shared_task(name=queueing.CAPACITY_SNAPSHOT, ignore_result=True)
def capacity_snapshot() -> None:
    lending.capacity_snapshot_all()
