"""The Celery app: configured from Django settings (CELERY_* names), JSON only.

Three queues so each kind of work scales on its own: ``collect`` (beat-driven pulls from the
sources), ``diagnose`` (pure correlation, cheap) and ``remediate`` (slow outside calls, acks_late).
"""

from __future__ import annotations

import os
import signal
import threading
from contextvars import Token
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_shutting_down
from kombu import Queue

from collectors.request_id import request_id_reset, request_id_set
from fleetwatch.datadir import data_dir_prepare

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")


def _redis_restore_after_collect_tolerated() -> None:
    """Keep a worker alive when its Redis broker goes away while it holds unacked messages.

    Celery 5.7.0's consumer (kombu 5.7.0), on a lost broker connection, ``collect()``s the
    connection (which clears the transport's ``client``, then the channel's ``connection``)
    and reconnects. Two things then touch the old channel and crash the worker with
    "Unrecoverable error" (an AttributeError, not a connection error) instead of letting it
    carry on: closing it restores its unacked messages (``QoS.restore_unacked``), and a task
    that was running when the connection dropped acknowledges its message when it finishes
    (``QoS.ack``/``reject``). Nothing can be done over a dead connection anyway: the messages
    stay in Redis's unacked set (redelivered after the visibility timeout; a redelivered step
    finds itself done and does nothing) or were lost with Redis, and the step watchdog
    re-queues remediation steps from the database. tests/integration/test_chaos.py (the Redis
    restart) fails without this. Re-check on a Celery/kombu upgrade.
    """
    from kombu.transport import redis as kombu_redis

    if getattr(kombu_redis.QoS, "_fleetwatch", False):
        return

    def dead(qos: kombu_redis.QoS) -> bool:
        connection = getattr(qos.channel, "connection", None)
        return connection is None or getattr(connection, "client", None) is None

    original_restore = kombu_redis.QoS.restore_unacked
    original_ack = kombu_redis.QoS.ack
    original_reject = kombu_redis.QoS.reject

    # The stubs' signatures; ``self`` as Any because the stubs type the private _delivered as
    # Optional, and a QoS with a channel always has it.
    def restore_unacked(self: Any, client: Any | None = None) -> None:
        if client is None and dead(self):
            self._delivered.clear()  # forget them: see above
            return None
        return original_restore(self, client)

    def ack(self: Any, delivery_tag: str) -> None:
        if dead(self):
            self._delivered.pop(delivery_tag, None)
            return
        original_ack(self, delivery_tag)

    def reject(self: Any, delivery_tag: str, requeue: bool = False) -> None:
        if dead(self):
            self._delivered.pop(delivery_tag, None)
            return
        original_reject(self, delivery_tag, requeue=requeue)

    kombu_redis.QoS.restore_unacked = restore_unacked  # type: ignore[method-assign]
    kombu_redis.QoS.ack = ack  # type: ignore[method-assign]
    kombu_redis.QoS.reject = reject  # type: ignore[method-assign]
    kombu_redis.QoS._fleetwatch = True  # type: ignore[attr-defined]


_redis_restore_after_collect_tolerated()
app = Celery("fleetwatch")


@app.on_configure.connect
def _data_dir_ready(sender: Celery, **_: object) -> None:
    """Before the configuration (Django's settings) loads, in a worker, beat or any process
    that first sends a task: the embedded default's data folder, its broker folder and key."""
    data_dir_prepare()


app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = [Queue("collect"), Queue("diagnose"), Queue("remediate"), Queue("default")]
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _beat_schedule(sender: Celery, **_: object) -> None:
    from django.conf import settings

    from collectors import queueing  # the task names: the wire contract, written once
    from collectors.sources import cluster_names, sources_of

    interval = settings.FLEETWATCH_COLLECT_INTERVAL
    clusters = cluster_names()
    # One entry per cluster and source, so a slow source (or a cluster far away) never
    # delays the others.
    schedule = {
        f"collect-{source}" if len(clusters) == 1 else f"collect-{cluster}-{source}": {
            "task": queueing.COLLECT_SOURCE,
            "schedule": interval,
            "args": [source, cluster],
            # A collection that waited longer than this is dropped (the next one reads the
            # same source anyway), so an outage leaves no backlog. Not less than 10 s: with
            # short intervals a busy worker would otherwise drop every run of its slowest
            # source and stop seeing it at all.
            "options": {"expires": max(interval * 2, 10.0)},
        }
        for cluster in clusters for source in sources_of(cluster).sources
    }
    schedule["prune-telemetry"] = {"task": queueing.PRUNE_TELEMETRY, "schedule": 600.0}
    # Steps whose message a killed worker or a restarted broker lost.
    schedule["steps-rescue"] = {"task": queueing.STEPS_RESCUE,
                                "schedule": settings.FLEETWATCH_WATCHDOG_SECONDS,
                                "options": {"expires": settings.FLEETWATCH_WATCHDOG_SECONDS}}
    # Webhook deliveries whose message was lost the same way.
    schedule["webhooks-rescue"] = {"task": queueing.WEBHOOKS_RESCUE,
                                   "schedule": settings.FLEETWATCH_WATCHDOG_SECONDS,
                                   "options": {"expires": settings.FLEETWATCH_WATCHDOG_SECONDS}}
    # Diagnosis due with no run queued or alive (a lost message, a killed worker): coalesced
    # runs are sent only when none is queued, so a lost one would otherwise wait for a push.
    schedule["diagnosis-rescue"] = {"task": queueing.DIAGNOSIS_RESCUE,
                                    "schedule": settings.FLEETWATCH_WATCHDOG_SECONDS,
                                    "options": {"expires": settings.FLEETWATCH_WATCHDOG_SECONDS}}
    # Fire drills: the watchdog that finishes a drill nothing follows any more (a killed
    # worker), and the schedule (FLEETWATCH_DRILL_SCHEDULE: seconds or a cron expression, UTC).
    schedule["drills-rescue"] = {"task": queueing.DRILLS_RESCUE,
                                 "schedule": settings.FLEETWATCH_WATCHDOG_SECONDS,
                                 "options": {"expires": settings.FLEETWATCH_WATCHDOG_SECONDS}}
    drills: float | str | None = settings.FLEETWATCH_DRILL_SCHEDULE
    if drills is not None:
        from celery.schedules import crontab

        when: float | crontab = drills if not isinstance(drills, str) else crontab(
            **dict(zip(("minute", "hour", "day_of_month", "month_of_year", "day_of_week"),
                       drills.split(), strict=True)))
        schedule["drill"] = {
            "task": queueing.DRILL_SCHEDULED,
            "schedule": when,
            # A drill the beat could not send on time is not worth sending late in a burst.
            "options": {"expires": settings.FLEETWATCH_DRILL_BUDGET_SECONDS}}
    if settings.FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS > 0:
        # Stragglers among the running jobs (fail-slow), from their nodes' history.
        schedule["fail-slow-scan"] = {
            "task": queueing.FAIL_SLOW_SCAN,
            "schedule": settings.FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS,
            "options": {"expires": settings.FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS}}
    # Lending (incidents/lending): the automatic decision, and the capacity chart's points.
    schedule["lending-tick"] = {"task": queueing.LENDING_TICK,
                                "schedule": settings.FLEETWATCH_LEND_TICK_SECONDS,
                                "options": {"expires": settings.FLEETWATCH_LEND_TICK_SECONDS}}
    schedule["loans-rescue"] = {"task": queueing.LOANS_RESCUE,
                                "schedule": settings.FLEETWATCH_WATCHDOG_SECONDS,
                                "options": {"expires": settings.FLEETWATCH_WATCHDOG_SECONDS}}
    schedule["capacity-snapshot"] = {
        "task": queueing.CAPACITY_SNAPSHOT,
        "schedule": settings.FLEETWATCH_CAPACITY_SNAPSHOT_SECONDS,
        "options": {"expires": settings.FLEETWATCH_CAPACITY_SNAPSHOT_SECONDS}}
    if settings.FLEETWATCH_AUDIT_CHECKPOINT_MINUTES > 0:
        # The audit trail's signed head, into the log (see incidents/audit.py).
        schedule["audit-checkpoint"] = {
            "task": queueing.AUDIT_CHECKPOINT,
            "schedule": settings.FLEETWATCH_AUDIT_CHECKPOINT_MINUTES * 60,
            "options": {"expires": settings.FLEETWATCH_AUDIT_CHECKPOINT_MINUTES * 60}}
    sender.conf.beat_schedule = schedule


# Every task runs with its own request id, ``task:<celery task id>``, so the audit entries a
# step or a collector writes name the task that acted (and a worker log line can be matched to
# them). Signals rather than a base Task class: every task gets it, the tasks stay as written.
# The tokens are kept per task id because prerun and postrun are separate calls; both run in
# the worker's thread for that task, so resetting restores whatever was there before (the web
# request's id when a task runs eagerly inside a request).
_request_id_tokens: dict[str, Token[str]] = {}


@task_prerun.connect
def _request_id_enter(task_id: str | None = None, **_: object) -> None:
    if task_id:
        _request_id_tokens[task_id] = request_id_set(f"task:{task_id}")


@task_postrun.connect
def _request_id_leave(task_id: str | None = None, **_: object) -> None:
    token = _request_id_tokens.pop(task_id or "", None)
    if token is not None:
        request_id_reset(token)


# A stopping worker (SIGTERM or Ctrl-C: Celery's warm shutdown) waits for its running tasks, as
# long as they take: a step inside a slow outside call kept `make run`'s worker alive for a
# minute after everything else had stopped. After FLEETWATCH_WORKER_SHUTDOWN_SECONDS it sends
# itself SIGQUIT, Celery's cold shutdown: running tasks are cancelled (late-acked messages go
# back to the broker) and the worker exits. A step cut off that way has recorded the calls it
# completed (Step.done_calls); it resumes after its lease, or at once when `make run` starts
# again (steps_resume_all). A timer rather than worker_soft_shutdown_timeout with
# REMAP_SIGTERM: the soft timeout sleeps its whole length whenever any task runs, this ends
# as soon as the running tasks do.
_cold_shutdown_timer: list[threading.Timer] = []


@worker_shutting_down.connect
def _warm_shutdown_bounded(how: str = "", **_: object) -> None:
    from django.conf import settings

    seconds = settings.FLEETWATCH_WORKER_SHUTDOWN_SECONDS
    if how != "Warm" or seconds <= 0 or _cold_shutdown_timer:
        return
    timer = threading.Timer(seconds, os.kill, args=(os.getpid(), signal.SIGQUIT))
    timer.daemon = True  # a worker whose tasks end first exits without waiting for it
    _cold_shutdown_timer.append(timer)
    timer.start()
