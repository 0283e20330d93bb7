"""The id of the web request or Celery task being served, for the audit trail and logs.

A contextvar rather than a thread-local: it follows the code into ``sync_to_async`` threads and
async views, and each Celery task sets its own (see ``fleetwatch.celery``). Code that records
something (``incidents.audit.audit_record``) reads it with ``current_request_id()`` instead of
having the id passed down through every service call.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token

HEADER = "X-Request-ID"
MAX_LENGTH = 64  # AuditEntry.request_id's column

# Ids from outside (a load balancer, a client retrying) are kept only when they are short and
# plain: they end up in the audit trail, log lines and response headers, so nothing that could
# split a header or a log line gets through.
_SANE = re.compile(r"[A-Za-z0-9._-]{1,64}")

_current: ContextVar[str] = ContextVar("fleetwatch_request_id", default="")


def current_request_id() -> str:
    """The id of what is running now; "" outside any request or task (a shell, a command)."""
    return _current.get()


def request_id_new() -> str:
    return uuid.uuid4().hex


def request_id_clean(value: str | None) -> str | None:
    """``value`` if it is usable as an id as is, else None (the caller makes a new one)."""
    if value and _SANE.fullmatch(value):
        return value
    return None


def request_id_set(value: str) -> Token[str]:
    """Set the current id until ``request_id_reset(token)``; for code that cannot use a
    ``with`` block (Celery's separate prerun and postrun signals)."""
    return _current.set(value[:MAX_LENGTH])


def request_id_reset(token: Token[str]) -> None:
    try:
        _current.reset(token)
    except ValueError:  # the token was made in another context (a pool that hops threads)
        _current.set("")


@contextmanager
def request_id_scope(value: str) -> Iterator[str]:
    """Run the block with ``value`` as the current id; the previous one comes back after."""
    token = _current.set(value[:MAX_LENGTH])
    try:
        yield value[:MAX_LENGTH]
    finally:
        _current.reset(token)
