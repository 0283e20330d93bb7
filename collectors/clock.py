"""Time as an argument: the wall clock, a monotonic clock and sleeping, behind one small
interface, so the code tests wait on (the simulated fleet above all) can be driven by a clock
the test moves instead of by real seconds.

Production code takes ``SYSTEM_CLOCK`` by default; a test hands in a ``ManualClock`` and calls
``advance()``. Django-free, imports nothing of the project.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock time, epoch seconds (``time.time``)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (``time.monotonic``), for durations."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        ...


class SystemClock:
    """The machine's clocks; ``sleep`` really sleeps."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when told: ``advance(seconds)`` (or ``sleep``, which advances
    instead of blocking). Starts at ``start`` epoch seconds (default: the real time now, so
    timestamps stay plausible next to the database's)."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else float(start)
        self._monotonic = 0.0

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        self._now += seconds
        self._monotonic += seconds
