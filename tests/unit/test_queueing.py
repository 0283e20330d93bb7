"""collectors.queueing: every task is queued by its name, through the registered task."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from celery import current_app

from collectors import queueing


@pytest.fixture
def eager() -> Iterator[None]:
    """CELERY_TASK_ALWAYS_EAGER, as a debugging deployment sets it: tasks run in the caller."""
    before = current_app.conf.task_always_eager
    current_app.conf.task_always_eager = True
    try:
        yield
    finally:
        current_app.conf.task_always_eager = before


def test_every_task_name_is_a_registered_task() -> None:
    current_app.loader.import_default_modules()  # what a worker does at start
    names = {v for k, v in vars(queueing).items() if k.isupper() and isinstance(v, str)}
    assert names and names <= set(current_app.tasks)


def test_eager_mode_runs_the_task_in_the_caller(eager: None) -> None:
    # send_task would ignore eager mode and need a broker; the registered task does not.
    with mock.patch("incidents.remediation.engine.steps_rescue") as rescue:
        queueing.enqueue(queueing.STEPS_RESCUE, on_commit=False)
    rescue.assert_called_once_with()


@pytest.mark.django_db
def test_queued_on_commit_and_named_on_the_callback(
        django_capture_on_commit_callbacks: Any) -> None:
    from incidents import tasks

    with mock.patch.object(tasks.run_step, "apply_async") as sent:
        with django_capture_on_commit_callbacks() as callbacks:
            queueing.enqueue(queueing.RUN_STEP, 7, "poll", countdown=3)
            sent.assert_not_called()  # nothing before the commit
        [callback] = callbacks
        assert (callback.task, callback.args) == (queueing.RUN_STEP, (7, "poll"))
        callback()
    sent.assert_called_once_with(args=[7, "poll"], countdown=3)
