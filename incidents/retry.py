"""Run a transaction again when the database aborted it for a reason that is not ours.

PostgreSQL aborts one of two transactions that wait on each other (``deadlock detected``,
SQLSTATE 40P01) and, at stricter isolation levels, one that read what another changed
(``could not serialize access``, 40001). SQLite gives up on a writer that waited for the
database's lock past its busy timeout (``database is locked``). In each case nothing of the
transaction was kept and running it again is correct, so a person's click or a worker's
step is not answered with a 500 or marked failed for a collision. Lock order (see
``incidents.audit``) makes deadlocks rare; this makes the rare one harmless.

Only the outermost transaction can be run again: inside another ``atomic`` block the whole
outer transaction is already lost, so the error goes up to whoever owns it.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.db import DEFAULT_DB_ALIAS, DatabaseError, OperationalError, connections

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# deadlock_detected, serialization_failure
RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})
ATTEMPTS = 5


def is_transient(exc: BaseException) -> bool:
    """A database error after which the same transaction, run again, may well succeed."""
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) in RETRYABLE_SQLSTATES:
        return True
    return isinstance(exc, OperationalError) and "database is locked" in str(exc)


def retry_transient(fn: Callable[P, R]) -> Callable[P, R]:
    """Call ``fn`` (which opens its own transaction) again, a few times with a short random
    pause, when the database aborted it as transient. Anything else goes up unchanged."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(1, ATTEMPTS + 1):
            nested = connections[DEFAULT_DB_ALIAS].in_atomic_block
            try:
                return fn(*args, **kwargs)
            except DatabaseError as exc:
                if nested or attempt == ATTEMPTS or not is_transient(exc):
                    raise
                log.warning("%s: %s; running it again (attempt %d of %d)", fn.__qualname__,
                            str(exc).splitlines()[0], attempt + 1, ATTEMPTS)
                # Apart, so the two that collided do not collide again at once.
                time.sleep(random.uniform(0.01, 0.05 * 2 ** attempt))
        raise AssertionError("unreachable")

    return wrapper
