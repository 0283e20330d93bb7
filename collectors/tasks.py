"""Thin Celery tasks: each takes plain ids/names and calls one service.

Their names come from collectors.queueing (the beat's schedule names them there too).
"""

from __future__ import annotations

from celery import shared_task

from collectors import queueing, services


@shared_task(name=queueing.COLLECT_SOURCE, ignore_result=True)
def collect_source(source: str, cluster: str | None = None, urgent: bool = False) -> None:
    # cluster None: a message from before several clusters, for the default one. urgent:
    # the doorbell's (wait for a run in progress instead of skipping).
    services.collect_source(source, cluster, urgent=urgent)


@shared_task(name=queueing.PRUNE_TELEMETRY, ignore_result=True)
def prune_telemetry() -> None:
    services.telemetry_prune()
