"""Thin Celery tasks: take ids, call one service.

Remediation steps are ``acks_late``: a worker that dies mid-step leaves the message on the
queue, and the step (idempotent, leased) runs again on another worker.
"""

from __future__ import annotations

from celery import shared_task

from incidents import services


@shared_task(name="incidents.tasks.diagnose_signals", ignore_result=True)
def diagnose_signals(signal_ids: list[int]) -> None:
    services.diagnose_signals(signal_ids)


@shared_task(name="incidents.tasks.run_step", ignore_result=True, acks_late=True,
             reject_on_worker_lost=True)
def run_step(step_id: int, reason: str = "start") -> None:
    services.step_run(step_id, reason)


@shared_task(name="incidents.tasks.steps_rescue", ignore_result=True)
def steps_rescue() -> None:
    services.steps_rescue()
