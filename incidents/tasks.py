"""Thin Celery tasks: take ids, call one service.

Remediation steps are ``acks_late``: a worker that dies mid-step leaves the message on the
queue, and the step (idempotent, leased) runs again on another worker.
"""

from __future__ import annotations

from celery import Task, shared_task
from django.db import DatabaseError

from incidents import deliveries, services, webhooks


# Diagnosis is coalesced per cluster (services.diagnosis_run): at most one run queued and one
# running, whatever the push rate. The row in the database is the truth, not the message: a
# run lost with its worker or its broker is re-sent by diagnosis_rescue (beat) or by the next
# push, so the message is acknowledged early and not retried (a retry would be a second one
# queued).
@shared_task(name="incidents.tasks.diagnose_cluster", ignore_result=True)
def diagnose_cluster(cluster_id: int) -> None:
    services.diagnosis_run(cluster_id)


@shared_task(name="incidents.tasks.diagnosis_rescue", ignore_result=True)
def diagnosis_rescue() -> None:
    services.diagnosis_rescue()


# Messages queued by a version that sent one diagnosis per batch: their signals are marked
# due like new ones, so an upgrade with a full queue loses none of them.
@shared_task(name="incidents.tasks.diagnose_signals", ignore_result=True,
             autoretry_for=(DatabaseError,), retry_backoff=True, max_retries=5)
def diagnose_signals(signal_ids: list[int]) -> None:
    services.diagnosis_request(signal_ids)


@shared_task(name="incidents.tasks.run_step", ignore_result=True, acks_late=True,
             reject_on_worker_lost=True)
def run_step(step_id: int, reason: str = "start") -> None:
    services.step_run(step_id, reason)


@shared_task(name="incidents.tasks.steps_rescue", ignore_result=True)
def steps_rescue() -> None:
    services.steps_rescue()


# The row is the truth (attempts, next attempt, outcome); Celery only carries the wake-up.
# max_retries=None: FLEETWATCH_WEBHOOK_MAX_ATTEMPTS, counted on the row, is the limit.
@shared_task(name="incidents.tasks.webhook_deliver", bind=True, ignore_result=True,
             acks_late=True, reject_on_worker_lost=True, max_retries=None)
def webhook_deliver(self: Task, delivery_id: int) -> None:
    countdown = webhooks.delivery_attempt(delivery_id)
    if countdown is not None:
        raise self.retry(countdown=countdown)


@shared_task(name="incidents.tasks.webhooks_rescue", ignore_result=True)
def webhooks_rescue() -> None:
    deliveries.rescue()
