"""Thin Celery tasks: take ids, call one service.

Remediation steps are ``acks_late``: a worker that dies mid-step leaves the message on the
queue, and the step (idempotent, leased) runs again on another worker.
"""

from __future__ import annotations

from celery import Task, shared_task
from django.db import DatabaseError

from incidents import services, webhooks


# A diagnosis lost to a database hiccup or a killed worker would leave the fault
# undiagnosed for good (signals are stored once, on change): acknowledged late, retried.
@shared_task(name="incidents.tasks.diagnose_signals", ignore_result=True, acks_late=True,
             reject_on_worker_lost=True, autoretry_for=(DatabaseError,), retry_backoff=True,
             max_retries=5)
def diagnose_signals(signal_ids: list[int]) -> None:
    services.diagnose_signals(signal_ids)


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
    webhooks.deliveries_rescue()
