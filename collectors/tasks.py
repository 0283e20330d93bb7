"""Thin Celery tasks: each takes plain ids/names and calls one service."""

from __future__ import annotations

from celery import shared_task

from collectors import services


@shared_task(name="collectors.tasks.collect_source", ignore_result=True)
def collect_source(source: str) -> None:
    services.collect_source(source)


@shared_task(name="collectors.tasks.prune_telemetry", ignore_result=True)
def prune_telemetry() -> None:
    services.telemetry_prune()
