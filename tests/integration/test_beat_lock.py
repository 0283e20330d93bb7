"""Two Celery beats started against one Redis broker: only the one holding the beat lock sends
anything; the other stands by and takes over when the first stops or dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetwatch.beat import FileBeatLock
from tests.conftest import wait_for
from tests.harness.processes import stop_process_group

ROOT = Path(__file__).resolve().parents[2]
SENT = "Sending due task"


class Beat:
    def __init__(self, name: str, tmp_path: Path, env: dict[str, str]) -> None:
        self.log = tmp_path / f"beat-{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "fleetwatch", "beat", "--loglevel", "INFO",
                 "-s", str(tmp_path / f"schedule-{name}")],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def sent(self) -> int:
        return self.text().count(SENT)


@pytest.fixture
def beat_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if not broker.startswith("redis://"):
        pytest.fail("this test needs Redis: run it with `make test`")
    import redis

    client = redis.Redis.from_url(broker)
    client.flushdb()
    yield {**os.environ, "CELERY_BROKER_URL": broker, "FLEETWATCH_FLEET": "sim",
           "FLEETWATCH_DATA_DIR": str(tmp_path / "data"), "FLEETWATCH_COLLECT_INTERVAL": "1",
           "FLEETWATCH_BEAT_LOCK_SECONDS": "3"}
    client.flushdb()  # the collections nobody consumed


@pytest.mark.integration
def test_a_second_beat_schedules_nothing_until_the_first_is_gone(
        beat_env: dict[str, str], tmp_path: Path) -> None:
    first = Beat("first", tmp_path, beat_env)
    second = None
    try:
        wait_for(lambda: first.sent() >= 3, 60, "the first beat sending its collections")
        second = Beat("second", tmp_path, beat_env)
        wait_for(lambda: "another beat holds the lock" in second.text(), 60,
                 "the second beat standing by")
        before = first.sent()
        wait_for(lambda: first.sent() >= before + 4, 30, "more collections from the first")
        assert second.sent() == 0, second.text()[-3000:]
        # The first dies without letting go (SIGKILL): the second takes over, once the lock's
        # time to live has passed or at once when it sees the holder's process is gone.
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        wait_for(lambda: second.sent() >= 3, 30, "the second beat taking over")
        assert "beat lock held: this beat schedules" in second.text()
    finally:
        stop_process_group(first.proc)
        if second is not None:
            stop_process_group(second.proc)


def test_the_embedded_beat_lock_is_held_by_one_process_at_a_time(tmp_path: Path) -> None:
    one, two = FileBeatLock(tmp_path / "beat.lock"), FileBeatLock(tmp_path / "beat.lock")
    assert one.acquire() and one.acquire()  # kept
    assert not two.acquire()
    assert one.holder().endswith(f":{os.getpid()}")
    one.release()
    assert two.acquire()
    two.release()
