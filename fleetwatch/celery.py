"""The Celery app: configured from Django settings (CELERY_* names), JSON only.

Three queues so each kind of work scales on its own: ``collect`` (beat-driven pulls from the
sources), ``diagnose`` (pure correlation, cheap) and ``remediate`` (slow outside calls, acks_late).
"""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")

app = Celery("fleetwatch")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = [Queue("collect"), Queue("diagnose"), Queue("remediate"), Queue("default")]
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _beat_schedule(sender: Celery, **_: object) -> None:
    from django.conf import settings

    interval = settings.FLEETWATCH_COLLECT_INTERVAL
    # One entry per source, so a slow source never delays the others.
    schedule = {
        f"collect-{source}": {
            "task": "collectors.tasks.collect_source",
            "schedule": interval,
            "args": [source],
            "options": {"expires": interval * 2},
        }
        for source in settings.FLEETWATCH_SOURCES
    }
    schedule["prune-telemetry"] = {"task": "collectors.tasks.prune_telemetry", "schedule": 600.0}
    sender.conf.beat_schedule = schedule
