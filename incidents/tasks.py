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
from incidents import audit, deliveries, diagnosing, drills, gates, slowness, webhooks
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


# The beat's, every FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS: stragglers among the running jobs,
# from their nodes' telemetry history (incidents.slowness). A scan that waited past the next
# one is dropped by its expiry; nothing is lost (each scan reads the whole window again).
@shared_task(name=queueing.FAIL_SLOW_SCAN, ignore_result=True)
def fail_slow_scan() -> None:
    slowness.fail_slow_scan_all()


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
    gates.gates_rescue()  # the gates started outside a playbook, polled as steps are


# A gate outside a playbook (incidents.gates.node_gate_start): leased and idempotent like a
# step, so a worker that dies mid-poll leaves the message for another.
@shared_task(name=queueing.GATE_ADVANCE, ignore_result=True, acks_late=True,
             reject_on_worker_lost=True)
def gate_advance(gate_id: int) -> None:
    gates.gate_advance(gate_id)


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


# Fire drills (incidents.drills). The drill's row is the truth: a message lost with a worker is
# made up for by the watchdog (drills_rescue), which also finishes a drill whose budget ran out
# while nothing followed it. Beginning twice injects one fault; finishing twice finishes once.
@shared_task(name=queueing.DRILL_SCHEDULED, ignore_result=True)
def drill_scheduled() -> None:
    drills.drill_scheduled()


@shared_task(name=queueing.DRILL_BEGIN, ignore_result=True, acks_late=True,
             reject_on_worker_lost=True)
def drill_begin(drill_id: int) -> None:
    drills.drill_begin(drill_id)


@shared_task(name=queueing.DRILL_FOLLOW, ignore_result=True)
def drill_follow(drill_id: int) -> None:
    drills.drill_follow(drill_id)


@shared_task(name=queueing.DRILLS_RESCUE, ignore_result=True)
def drills_rescue() -> None:
    drills.drills_rescue()


# Sent once, as a person's page is (engine.person_page): recorded as deliveries and audited.
@shared_task(name=queueing.DRILL_ALERT, ignore_result=True, acks_late=True,
             reject_on_worker_lost=True)
def drill_alert(drill_id: int) -> None:
    drills.drill_alert(drill_id)
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
