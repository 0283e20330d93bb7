"""One Celery beat schedules at a time, however many are started.

Kubernetes runs beat as one replica with the Recreate strategy, but a second beat still
happens: a rollout by hand, a `celery beat` started on a laptop against the production broker,
a node that comes back from a partition with its old pod still running. Two beats send every
collection, watchdog and checkpoint twice. ``SingleBeatScheduler`` (``CELERY_BEAT_SCHEDULER``)
sends nothing unless it holds a lock: a Redis key with a time to live that the holder renews on
every tick (with a Redis broker), or an exclusive file lock in the data folder (the embedded
default, one machine). The others stand by, try again every few seconds, and take over within
``FLEETWATCH_BEAT_LOCK_SECONDS`` (30) of the holder's death (at once when the holder was a
process on the same machine that is gone).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import IO, Any, Protocol

from celery.beat import PersistentScheduler

log = logging.getLogger(__name__)

LOCK_KEY = "fleetwatch:beat-lock"
LOCK_TTL = 30.0  # seconds: how long a dead holder keeps the others waiting (the default)
STANDBY_RETRY = 5.0  # seconds between a standby beat's tries


class BeatLock(Protocol):
    def acquire(self) -> bool:
        """Take the lock, or keep it (renewing it); False when another beat holds it."""
        ...

    def release(self) -> None: ...


class RedisBeatLock:
    """SET NX with a time to live; renewed only by its holder (a compare-and-expire script),
    so a beat that lost it (paused past the TTL) never extends another's."""

    RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
             "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
    RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
               "return redis.call('del', KEYS[1]) else return 0 end")
    HOST = socket.gethostname()

    def __init__(self, url: str, ttl: float = LOCK_TTL) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.ttl_ms = int(ttl * 1000)
        self.token = f"{self.HOST}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.held = False

    def acquire(self) -> bool:
        if self.held and self.client.eval(self.RENEW, 1, LOCK_KEY, self.token, self.ttl_ms):
            return True
        if self.held:
            log.error("beat lock lost (this beat paused longer than %.0f s?): standing by",
                      self.ttl_ms / 1000)
        self.held = bool(self.client.set(LOCK_KEY, self.token, nx=True, px=self.ttl_ms))
        if not self.held and self._holder_died_here():
            self.held = bool(self.client.set(LOCK_KEY, self.token, nx=True, px=self.ttl_ms))
        return self.held

    def _holder_died_here(self) -> bool:
        """A holder on this machine whose process is gone (killed, not stopped) frees the
        lock at once rather than after its time to live (a restarted `make run`, a test)."""
        holder = self.holder()
        host, _, rest = holder.partition(":")
        pid = rest.partition(":")[0]
        if host != self.HOST or not pid.isdigit() or int(pid) == os.getpid():
            return False
        try:
            os.kill(int(pid), 0)
            return False
        except ProcessLookupError:
            pass
        except PermissionError:
            return False  # alive, someone else's
        self.client.eval(self.RELEASE, 1, LOCK_KEY, holder)
        log.warning("beat lock: its holder %s is no longer running; taking it over", holder)
        return True

    def holder(self) -> str:
        value = self.client.get(LOCK_KEY)
        return value.decode() if isinstance(value, bytes) else str(value or "")

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(Exception):
                self.client.eval(self.RELEASE, 1, LOCK_KEY, self.token)
            self.held = False


class FileBeatLock:
    """An exclusive flock on a file in the data folder: the embedded default's beats share
    one machine. The kernel drops it when the process dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle: IO[str] | None = None

    def acquire(self) -> bool:
        if self.handle is not None:
            return True
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        handle.seek(0)
        handle.truncate()
        handle.write(f"{socket.gethostname()}:{os.getpid()}\n")
        handle.flush()
        self.handle = handle
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError):
            return self.path.read_text().strip()
        return ""

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def beat_lock(broker_url: str, data_dir: Path, ttl: float = LOCK_TTL) -> RedisBeatLock | FileBeatLock:
    if broker_url.startswith(("redis://", "rediss://", "unix://")):
        return RedisBeatLock(broker_url, ttl)
    return FileBeatLock(data_dir / "beat.lock")


class SingleBeatScheduler(PersistentScheduler):
    """Celery's persistent scheduler, sending only while it holds the beat lock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from django.conf import settings

        self.ttl = settings.FLEETWATCH_BEAT_LOCK_SECONDS
        self.lock = beat_lock(settings.CELERY_BROKER_URL, Path(settings.DATA_DIR), self.ttl)
        self.standing_by = False
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        try:
            held = self.lock.acquire()
        except Exception as exc:  # the broker is down: nothing could be sent anyway
            log.warning("beat lock: %s; trying again in %.0f s", exc, STANDBY_RETRY)
            return STANDBY_RETRY
        if not held:
            if not self.standing_by:
                log.warning("another beat holds the lock (%s): this one sends nothing and "
                            "stands by", self.lock.holder())
                self.standing_by = True
            return STANDBY_RETRY
        if self.standing_by or not getattr(self, "_announced", False):
            log.info("beat lock held: this beat schedules")
            self.standing_by, self._announced = False, True
        # Wake up often enough to renew the lock before it lapses.
        return min(float(super().tick(*args, **kwargs)), self.ttl / 3)

    def close(self) -> None:
        super().close()
        self.lock.release()
