"""FleetWatch scaled out as the manifests lay it out, in podman containers of the one image:
web, one worker per queue (two for remediate), beat, against the suite's PostgreSQL and Redis
and the simulated fleet (its state file on the shared /data). An XID 79 is injected; the
remediate worker running the drain is killed (SIGKILL) inside an outside call while the other
one runs on: the playbook still finishes, and each outside action is audited as a change
exactly once.

Here the sources are the simulated fleet's. The same containers on real Slurm (slurmrestd),
a real Prometheus and the Kubernetes test server: test_scale_out_real.py; with Redis and
PostgreSQL restarted under them: test_scale_out_restarts.py."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.deploy.test_server_image import (
    PODMAN,
    Fleet,
    free_port,
    podman_logs,
    wait_for_health,
    wait_for_log,
)

# The playbook's outside actions for an XID 79 on gpu-003 (verb, target), as the
# process-level chaos test counts them.
from tests.integration.test_chaos import ACTIONS, BAD_NODE, SPARE, gate_actions

# The image's fixtures come from conftest.py: this module gets a database and a /data of its
# own.
pytestmark = [pytest.mark.image, pytest.mark.timeout(1200)]


def query(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return list(conn.execute(sql, args).fetchall())  # type: ignore[call-overload]


def wait(predicate: Any, timeout: float, what: str, explain: Any = None) -> Any:
    """tests.conftest.wait_for, saying what the containers logged when it times out."""
    try:
        return wait_for(predicate, timeout, what, interval=0.2)
    except AssertionError:
        if explain:
            print(explain())
        raise


@pytest.fixture
def scaled(migrated: Fleet) -> Fleet:
    migrated.env.update({
        "FLEETWATCH_SIM_STATE": "/data/sim-fleet.json", "FLEETWATCH_SIM_SPEED": "40",
        "FLEETWATCH_SIM_ACTION_DELAY": "k8s.evict=4,provider.replace=4",
        "FLEETWATCH_COLLECT_INTERVAL": "1", "FLEETWATCH_STEP_POLL_SECONDS": "0.3",
        "FLEETWATCH_WATCHDOG_SECONDS": "2", "FLEETWATCH_STEP_LEASE_SECONDS": "8",
        "FLEETWATCH_POLICY_MODE": "auto", "FLEETWATCH_LOG_LEVEL": "INFO"})
    done = migrated.run("manage", "fleetwatch", "seed", "--reset")
    assert done.returncode == 0, done.stdout + done.stderr
    return migrated


def test_scaled_out_containers_heal_an_xid_79_and_a_killed_worker_repeats_no_action(
        scaled: Fleet, database_url: str) -> None:
    f = scaled
    port = free_port()
    web = f.start("web", PORT=str(port))
    for queue in ("collect", "diagnose", "default"):
        wait_for_log(f.start("worker", queue, "--concurrency", "1"), "ready.")
    first = f.start("worker", "remediate", "--concurrency", "1")
    wait_for_log(first, "ready.")
    f.start("beat")
    wait_for_health(web, port)

    def logs() -> str:
        return "\n".join(f"--- {name}\n{podman_logs(name)[-2500:]}" for name in f.names)

    wait(lambda: query(database_url, "SELECT count(*) FROM collectors_node WHERE in_service")[0][0]
         >= 16, 90, "the first collection of the simulated fleet", logs)
    wait(lambda: query(database_url, "SELECT count(*) FROM collectors_job WHERE state = 'RUNNING'")
         [0][0] == 3, 60, "the fleet's three jobs", logs)
    done = f.run("manage", "fleetwatch", "inject", "xid", "--node", BAD_NODE, "--gpu", "5",
                     "--code", "79")
    assert done.returncode == 0, done.stdout + done.stderr

    # The only remediate worker takes the drain; a second one starts; the first is killed
    # inside the eviction call (the simulated API sleeps 4 s before it acts).
    wait(lambda: query(database_url, "SELECT 1 FROM incidents_step WHERE kind = "
                       "'cordon_and_drain' AND status = 'running' AND "
                       "done_calls::text LIKE %s", "%k8s.cordon%"), 120,
         "the drain step in its eviction call", logs)
    second = f.start("worker", "remediate", "--concurrency", "1")
    wait_for_log(second, "ready.")
    subprocess_run([*PODMAN, "kill", "--signal", "KILL", first])

    def resolved() -> bool:
        rows = query(database_url, "SELECT status FROM incidents_incident")
        return bool(rows) and rows[0][0] == "resolved"

    wait(resolved, 180, "the incident resolved",
         lambda: logs() + "\n" + json.dumps(query(
             database_url, "SELECT kind, status, done_calls::text FROM incidents_step "
                           "ORDER BY \"order\""), default=str))
    steps = query(database_url, "SELECT kind, status FROM incidents_step ORDER BY \"order\"")
    assert all(status == "succeeded" for _, status in steps), steps
    entries = query(database_url, "SELECT verb, target, ok, data::text FROM incidents_auditentry "
                                  "WHERE call <> ''")
    changed = Counter((verb, target) for verb, target, ok, data in entries
                      if ok and json.loads(data).get("changed"))
    # The spare's return-to-service gate (one remediation: id 1) is among them.
    [(remediation_id,)] = query(database_url, "SELECT id FROM incidents_remediation")
    assert set(changed) == ACTIONS | gate_actions(remediation_id), changed
    assert all(count == 1 for count in changed.values()), changed
    state = json.loads((f.data / "sim-fleet.json").read_text())
    assert state["jobs"]["3001"]["state"] == "RUNNING"
    assert SPARE in state["jobs"]["3001"]["nodes"] and BAD_NODE not in state["jobs"]["3001"]["nodes"]


def subprocess_run(argv: list[str]) -> None:
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
