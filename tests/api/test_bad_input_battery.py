"""The bad-input battery (tests/bench/bad_input.py) as a test: a few thousand hostile requests
(NUL bytes, lone surrogates, 1e999, deep JSON, 20-digit ids, wrong content types, chunked and
oversized bodies, garbage cursors, poisoned pushes and then every reader of them, concurrent
duplicate creates) at every API operation and page family, as an admin, an operator, a
viewer, a user with no role, a node agent and nobody, against gunicorn on PostgreSQL and on
SQLite (the embedded default). Not one answer may be a server error; the failure lists each
one (method, path, caller, what was hostile, the answer's start), and the server's log with
the tracebacks is kept in the test's tmp_path. Identical creates, actions and pushes (one
Idempotency-Key) sent at once must take effect once.

``make test`` runs the quick profile (fewer poisons per parameter, every class still fired);
``python -m tests.bench.bad_input`` runs the full one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.bench.bad_input import ROOT, battery_on_own_server, report_text


def _battery(database: str, tmp_path: Path) -> None:
    log = tmp_path / f"server-{database}.log"
    result = battery_on_own_server(ROOT, database, sys.executable, log, quick=True)
    print(report_text(result))
    assert result["requests"] > 1000, report_text(result)
    assert not result["server_errors"], (
        f"{len(result['server_errors'])} server errors on {database} (tracebacks in {log}):\n"
        + "\n".join(result["server_errors"]))
    # Identical creates, actions and pushes sent at once take effect once.
    assert not result["done_twice"], "\n".join(result["done_twice"])


# A few minutes on a loaded machine: more than the suite's 300 s default.
@pytest.mark.timeout(900)
def test_no_server_error_on_postgresql(tmp_path: Path) -> None:
    if not os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://")):
        pytest.fail("needs PostgreSQL: run it with `make test` (tests/harness/with-services.sh)")
    _battery("postgres", tmp_path)


@pytest.mark.timeout(900)
def test_no_server_error_on_sqlite(tmp_path: Path) -> None:
    _battery("sqlite", tmp_path)
