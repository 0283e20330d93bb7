"""Runs of one collector never overlap: a scheduled run that finds the previous one still
reading is skipped at once (it does not sit on the row lock holding a worker process), and
the doorbell's urgent run waits for it and then reads. On PostgreSQL, where another
connection can hold the row as a running collection does."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from django.db import connection

from collectors import services as collectors
from collectors.models import CollectorRun, SourceHealth

pytestmark = pytest.mark.django_db(transaction=True)


def _hold_row(pk: int, release: threading.Event, held: threading.Event) -> None:
    """Another process's collection: the row locked until ``release``."""
    db = connection.settings_dict
    with psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"],
                         dbname=db["NAME"]) as conn, conn.transaction():
        conn.execute("SELECT 1 FROM collectors_sourcehealth WHERE id = %s FOR UPDATE", (pk,))
        held.set()
        release.wait(30)


def test_a_scheduled_run_skips_while_the_previous_reads_and_an_urgent_one_waits(
        sim_fleet: Any) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks: PostgreSQL (make test runs this file there)")
    assert collectors.collect_source("telemetry").healthy
    row = SourceHealth.objects.get(name="telemetry")
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_row, args=(row.pk, release, held))
    holder.start()
    try:
        assert held.wait(10)
        runs = CollectorRun.objects.filter(source="telemetry").count()
        started = time.monotonic()
        skipped = collectors.collect_source("telemetry")
        assert skipped.skipped and skipped.healthy and skipped.signal_ids == []
        assert time.monotonic() - started < 5  # not the 30 s the holder could keep it
        assert CollectorRun.objects.filter(source="telemetry").count() == runs  # no run

        done: list[collectors.CollectResult] = []
        urgent = threading.Thread(target=lambda: done.append(
            collectors.collect_source("telemetry", urgent=True)))
        urgent.start()
        time.sleep(1)
        assert not done  # waiting for the running one
        release.set()
        urgent.join(20)
        assert done and not done[0].skipped and done[0].healthy
        assert CollectorRun.objects.filter(source="telemetry").count() == runs + 1
    finally:
        release.set()
        holder.join(10)
        connection.close()
