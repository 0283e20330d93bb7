"""Queue a Celery task: the one way any code here hands work to a worker.

Code that queues work names the task (a constant below) and never imports the module that
defines it: a service that imported its own task module (which imports the service) was an
import circle hidden inside a function. Only Celery's autodiscovery and the tests import the
``tasks`` modules. Each ``@shared_task`` declares ``name=`` from these constants, so a renamed
function cannot silently change what the beat and the queued messages ask for.

The names are the wire contract with messages already queued in the broker and the beat's
schedule: never change one (a message queued under the old name would find no task).

Here, at the bottom of the import graph (``collectors`` imports nothing of ``incidents``), so
any app can queue any task by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import transaction

# collectors/tasks.py
COLLECT_SOURCE = "collectors.tasks.collect_source"
PRUNE_TELEMETRY = "collectors.tasks.prune_telemetry"
# incidents/tasks.py
DIAGNOSE_CLUSTER = "incidents.tasks.diagnose_cluster"
DIAGNOSIS_RESCUE = "incidents.tasks.diagnosis_rescue"
FAIL_SLOW_SCAN = "incidents.tasks.fail_slow_scan"
DIAGNOSE_SIGNALS = "incidents.tasks.diagnose_signals"  # messages of older versions only
RUN_STEP = "incidents.tasks.run_step"
PAGE_PERSON = "incidents.tasks.page_person"
STEPS_RESCUE = "incidents.tasks.steps_rescue"
GATE_ADVANCE = "incidents.tasks.gate_advance"
WEBHOOK_DELIVER = "incidents.tasks.webhook_deliver"
WEBHOOKS_RESCUE = "incidents.tasks.webhooks_rescue"
DRILL_BEGIN = "incidents.tasks.drill_begin"
DRILL_FOLLOW = "incidents.tasks.drill_follow"
DRILL_ALERT = "incidents.tasks.drill_alert"
DRILL_SCHEDULED = "incidents.tasks.drill_scheduled"
DRILLS_RESCUE = "incidents.tasks.drills_rescue"
LOAN_RUN = "incidents.tasks.loan_run"
LENDING_TICK = "incidents.tasks.lending_tick"
LOANS_RESCUE = "incidents.tasks.loans_rescue"
CAPACITY_SNAPSHOT = "incidents.tasks.capacity_snapshot"
# Defined in incidents/audit.py before it moved to incidents/tasks.py: the beat's schedule and
# queued messages still say this.
AUDIT_CHECKPOINT = "incidents.audit.checkpoint"


@dataclass(frozen=True)
class Send:
    """One task message, sent when called (an on-commit callback, or at once). Tests read
    ``task`` and ``args`` off the callbacks they capture."""

    task: str
    args: tuple[Any, ...]
    countdown: float | None = None

    def __call__(self) -> None:
        app = current_app
        if self.task not in app.tasks:
            # Nothing imported the task's module yet (a web process): import every app's
            # tasks as a worker does at start. Through the registered task, not send_task,
            # so CELERY_TASK_ALWAYS_EAGER runs it inline, and tests may patch its apply_async.
            app.loader.import_default_modules()
        # Celery takes a list and countdown=None (no delay); the stubs want a tuple and a float.
        app.tasks[self.task].apply_async(
            args=list(self.args), countdown=self.countdown)  # type: ignore[arg-type]


def enqueue(task: str, *args: Any, countdown: float | None = None,
            on_commit: bool = True) -> Send:
    """Queue ``task`` (a name above) with plain, JSON-able ``args``.

    ``on_commit`` (the default): sent once the caller's transaction commits, so a worker never
    sees work whose rows are not committed yet, and a rolled-back change queues nothing;
    outside a transaction it is sent at once. ``on_commit=False``: sent now, and a broker
    error goes to the caller (who may keep the row for a rescue to queue later).
    ``countdown``: seconds before a worker runs it (0 or None: at once)."""
    send = Send(task, tuple(args), countdown or None)
    if on_commit:
        transaction.on_commit(send)
    else:
        send()
    return send


def lost_before(now: datetime) -> datetime:
    """The watchdog's cut-off for work that polls itself (a step, a gate, a loan): one due
    before this whose lease nobody holds has lost its message and is queued again. Three poll
    intervals at least, so a poll that is merely late is not taken for lost."""
    return now - timedelta(seconds=max(settings.FLEETWATCH_WATCHDOG_SECONDS,
                                       settings.FLEETWATCH_STEP_POLL_SECONDS * 3))
