"""Schemathesis against the served OpenAPI schema, every phase (examples, coverage, fuzzing
and stateful), on a live server as production runs it (gunicorn, PostgreSQL), within a time
budget that fits ``make test``.

The server is the bad-input battery's (tests/bench/bad_input.py): its own database with a
small world (a node with GPUs, an incident whose remediation awaits approval, a failed
remediation and step, a webhook with a delivery, a spare token) and an admin's token with
every scope, which gets past every permission check. Generated path parameters are drawn half
of the time from that world's ids and names (schemathesis "dictionaries"), so actions really
act (approve, cancel, retry, resolve, redeliver) and what follows meets the state they left;
the stateful phase chains operations through the links schemathesis infers (Location headers
and parameter names; the schema declares none).

Checks: no server error, status codes and content types as documented, bodies that match
their schema. A failure prints schemathesis's own report (each failure with a curl command
that reproduces it); the JUnit and NDJSON reports are kept under the test's tmp_path.

Budget: ``SCHEMATHESIS_MAX_TIME`` seconds (default 150) for the run, about 30 s more to start
the server. Deterministic generation with a fixed seed; how far fuzzing and stateful testing
get within the budget depends on the machine's speed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.bad_input import ROOT, own_server

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance")
PHASES = ("examples", "coverage", "fuzzing", "stateful")
SEED = 23
# Revoking a token is left out: the run would revoke its own token (it learns the names from
# GET /api/v1/tokens/) and every later answer would be a 401. The battery and
# test_endpoints.py call revoke.
EXCLUDE_PATH_REGEX = r"/api/v1/tokens/\{name\}/revoke/$"


def _config(world: dict, path: Path) -> Path:
    """schemathesis.toml: the world's ids and names as dictionaries for the path parameters;
    no requests with methods an operation does not have (DRF's 405 is tested elsewhere and
    would cost a request per method per operation)."""
    ids, names, jobs = set(), set(), set()
    for params in world["path_parameters"].values():
        for key, value in params.items():
            if key == "id" and str(value).isdigit() and int(value) > 0:
                ids.add(int(value))
            elif key == "name":
                names.add(str(value))
            elif key == "slurm_id":
                jobs.add(str(value))
    names.discard("")
    lines = [
        "[dictionaries.ids]", f"values = {json.dumps(sorted(ids) or [1])}",
        "[dictionaries.names]", f"values = {json.dumps(sorted(names) or ['x'])}",
        "[dictionaries.jobs]", f"values = {json.dumps(sorted(jobs) or ['1'])}",
        "[parameters]",
        '"path.id" = { dictionary = "ids", probability = 0.5 }',
        '"path.name" = { dictionary = "names", probability = 0.5 }',
        '"path.slurm_id" = { dictionary = "jobs", probability = 0.5 }',
        "[phases.coverage]", "unexpected-methods = []",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _failures(output: str) -> str:
    """The errors and failures sections of schemathesis's report (all of it when there are
    none)."""
    match = re.search(r"(=+ (?:ERRORS|FAILURES) =+\n.*?)(?:\n=+ (?:WARNINGS|SUMMARY) =+)", output, re.S)
    return (match.group(1) if match else output)[-30000:]


@pytest.mark.timeout(int(os.environ.get("SCHEMATHESIS_MAX_TIME", "150")) + 420)
def test_api_answers_as_its_schema_says(tmp_path: Path) -> None:
    if not os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://")):
        pytest.fail("needs PostgreSQL: run it with `make test` (tests/harness/with-services.sh)")
    budget = os.environ.get("SCHEMATHESIS_MAX_TIME", "150")
    schemathesis = Path(sys.executable).parent / "schemathesis"
    with own_server(ROOT, "postgres", sys.executable, tmp_path / "server.log") as target:
        config = _config(target.world, tmp_path / "schemathesis.toml")
        command = [
            str(schemathesis), "--config-file", str(config), "--no-color", "run",
            f"{target.base_url}/api/schema/?format=json", "--url", target.base_url,
            "-H", f"Authorization: Token {target.tokens['admin']}",
            "--phases", ",".join(PHASES), "--checks", ",".join(CHECKS),
            "--max-time", budget, "--seed", str(SEED), "--generation-deterministic",
            # One worker: the same order of requests each run, and schemathesis 4.32's
            # coverage phase once failed inside itself (SystemError from CPython's AST
            # compiler) with two threads generating at once.
            "--workers", "1", "--request-timeout", "30", "--suppress-health-check", "all",
            "--exclude-path-regex", EXCLUDE_PATH_REGEX,
            "--report", "junit,ndjson", "--report-dir", str(tmp_path / "report"),
        ]
        # The hooks teach it the remote write's binary body (tests/api/schemathesis_hooks.py).
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.api.schemathesis_hooks",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=int(budget) + 300)
    print(run.stdout[-20000:])  # pytest shows it with -s or on failure
    assert "Stateful" in run.stdout, f"the stateful phase did not run:\n{run.stdout[-5000:]}"
    assert run.returncode == 0, (
        f"schemathesis found answers the schema does not describe (reports in "
        f"{tmp_path / 'report'}, server log in {tmp_path / 'server.log'}):\n"
        f"{_failures(run.stdout)}\n{run.stderr[-3000:]}")
