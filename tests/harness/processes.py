"""Stopping the processes the test harnesses, the tests and the drill start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Stop a process started with ``start_new_session=True`` and all its children: SIGTERM to
    the group, SIGKILL if it is still there after ``timeout`` seconds. A group already gone is
    fine."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
