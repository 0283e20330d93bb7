"""Chaos: the XID 79 playbook survives a worker killed with SIGKILL inside an outside call, and
a Redis broker restarted (losing every queued message) while a step waits.

A real ``celery worker -B`` on real PostgreSQL and Redis runs the playbook against the
simulated fleet. The sim's test hook (FLEETWATCH_SIM_ACTION_DELAY) makes ``k8s.evict`` and
``provider.replace`` sleep before they change anything, so a kill lands inside the call while
the change has not happened yet. Recovery can only come from the database: the killed
worker's unacked message comes back from Redis only after the visibility timeout (an hour),
and a restarted Redis has no messages at all, so the watchdog (``steps_rescue``, a beat task
in the new worker) must re-queue the step once its lease has expired.

What each test proves: the remediation succeeds, the fleet ends healed, and every outside
action was made, and audited as made, exactly once; the hash chain is intact.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.db import connection

from collectors.models import Job, Node
from collectors.sim.fleet import SimFleet
from incidents.audit import audit_verify
from incidents.models import AuditEntry, Incident, Remediation, Step
from tests.conftest import ROOT, Worker, stop_process_group, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

SPEED = 40.0  # 120 simulated seconds of provisioning pass in 3 real seconds
ACTION_DELAY = 4.0  # real seconds k8s.evict and provider.replace sleep before acting
LEASE = 8.0  # longer than ACTION_DELAY: a live run is never taken for a dead one
BAD_NODE, SPARE = "gpu-003", "gpu-017"
# Every outside action the gpu_hardware playbook makes for an XID 79 on gpu-003, by
# (verb, target): each must be audited as a change exactly once, however often the worker dies.
ACTIONS = {
    ("notify", "on-call"), ("slurm.drain", BAD_NODE), ("slurm.cancel", "job 3001"),
    ("slurm.comment", "job 3001 stopped"), ("slurm.requeue", "job 3001"),
    ("slurm.comment", "job 3001 requeued"), ("k8s.cordon", BAD_NODE),
    ("k8s.evict", f"slurm/slurmd-{BAD_NODE}"), ("provider.replace", BAD_NODE),
}


def gate_actions(remediation_id: int) -> set[tuple[str, str]]:
    """The return-to-service gate's actions on the spare (its first run): held, resumed in its
    reservation, checked, released; the resume step after it then finds it in service."""
    held = f"{SPARE} (fleetwatch-gate-r{remediation_id}-1)"
    return {("slurm.reserve", held), ("slurm.resume", held), ("slurm.unreserve", held),
            ("slurm.submit_check",
             f"{SPARE} fleetwatch-check-r{remediation_id}-1-fleetwatch-check")}
RESCUED = re.compile(r"watchdog: re-queued step\(s\) \[([\d, ]+)\]")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PrivateRedis:
    """A redis-server of our own (no persistence), so killing it disturbs no one else."""

    tmp: Path
    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # --save '' --appendonly no: a restart comes back empty, every queued message lost.
        with open(self.tmp / "redis.log", "ab") as out:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.tmp)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        client = redis.Redis(port=self.port)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False
        wait_for(answers, 10, f"redis-server on port {self.port}", interval=0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@dataclass
class Chaos:
    """Start, SIGKILL and restart real Celery workers (with beat) sharing one environment."""

    tmp: Path
    env: dict[str, str]
    workers: list[Worker] = field(default_factory=list)

    def start_worker(self) -> Worker:
        n = len(self.workers) + 1
        log = self.tmp / f"worker-{n}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "fleetwatch", "worker", "-B",
                 "-Q", "collect,diagnose,remediate,default", "--concurrency", "3",
                 "--loglevel", "INFO", "-n", f"chaos{n}@%h",
                 # Its own beat schedule file: the killed beat may leave its shelve half written.
                 "-s", str(self.tmp / f"beat-schedule-{n}")],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(proc, log)
        self.workers.append(worker)
        return worker

    def kill_worker(self, worker: Worker) -> None:
        """SIGKILL the whole process group: the main process, its pool children and beat.
        Nothing gets to clean up, acknowledge or restore a message."""
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()

    def stop_all(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                stop_process_group(w.proc)

    def logs(self) -> str:
        return "\n".join(f"--- {w.log.name}\n{w.output()}" for w in self.workers)


def _chaos(settings: Any, tmp_path: Path, broker: str, **extra: str) -> Chaos:
    if connection.vendor != "postgresql" or not broker.startswith("redis://"):
        pytest.fail("chaos tests need PostgreSQL and Redis: run them with `make test`")
    redis.Redis.from_url(broker).flushdb()  # no stale tasks from an earlier run
    settings.FLEETWATCH_SIM_SPEED = SPEED
    settings.FLEETWATCH_SIM_STATE = tmp_path / "sim-fleet.json"
    SimFleet(settings.FLEETWATCH_SIM_STATE, SPEED).seed()
    db = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "CELERY_BROKER_URL": broker,
        "FLEETWATCH_DATA_DIR": str(tmp_path / "data"),
        "FLEETWATCH_SIM_STATE": str(settings.FLEETWATCH_SIM_STATE),
        "FLEETWATCH_SIM_SPEED": str(SPEED),
        "FLEETWATCH_SIM_ACTION_DELAY": f"k8s.evict={ACTION_DELAY},provider.replace={ACTION_DELAY}",
        "FLEETWATCH_COLLECT_INTERVAL": "1",
        "FLEETWATCH_STEP_POLL_SECONDS": "0.3",
        "FLEETWATCH_WATCHDOG_SECONDS": "2",
        "FLEETWATCH_STEP_LEASE_SECONDS": str(LEASE),
        "FLEETWATCH_POLICY_MODE": "auto",
        **extra,
    }
    return Chaos(tmp_path, env)


@pytest.fixture
def chaos(transactional_db: None, settings: Any, tmp_path: Path) -> Iterator[Chaos]:
    """Workers on the suite's Redis (CELERY_BROKER_URL)."""
    c = _chaos(settings, tmp_path, os.environ.get("CELERY_BROKER_URL", ""))
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def chaos_private_redis(
    transactional_db: None, settings: Any, tmp_path: Path, private_redis: PrivateRedis
) -> Iterator[Chaos]:
    """Workers on a Redis of the test's own, which the test may kill and restart. The SIGTERM
    grace is long (400 simulated s, 10 real s) so a restart surely lands while the step waits."""
    c = _chaos(settings, tmp_path, private_redis.url, FLEETWATCH_SLURM_GRACE_SECONDS="400")
    try:
        yield c
    finally:
        c.stop_all()


# --- helpers ------------------------------------------------------------------------------


def _fleet_collected() -> bool:
    return Node.objects.filter(in_service=True, gpus__isnull=False).distinct().count() >= 16 \
        and Job.objects.filter(state="RUNNING").count() == 3


def _inject_xid79(chaos: Chaos) -> None:
    try:
        wait_for(_fleet_collected, 60, "the first collection of the simulated fleet")
    except AssertionError:
        print(chaos.logs())
        raise
    assert Job.objects.get(nodes__contains=[BAD_NODE], state="RUNNING").slurm_id == "3001"
    call_command("fleetwatch", "inject", "xid", "--node", BAD_NODE, "--gpu", "5", "--code", "79")


def _wait_step(chaos: Chaos, kind: str, status: str, done_call: str = "") -> Step:
    """The step of this kind once it has ``status`` (and, if given, recorded ``done_call``).
    Polled fast: the window to act in is the sim's few seconds of delay."""
    def find() -> Step | None:
        step = Step.objects.filter(kind=kind, status=status).first()
        if step is None or (done_call and done_call not in step.done_calls):
            return None
        return step
    try:
        return wait_for(find, 90, f"step {kind} {status} {done_call}".strip(), interval=0.05)
    except AssertionError:
        print(chaos.logs())
        raise


def _wait_resolved(chaos: Chaos) -> Incident:
    try:
        return wait_for(lambda: Incident.objects.filter(status=Incident.Status.RESOLVED).first(),
                        120, "the incident resolved")
    except AssertionError:
        print(chaos.logs())
        print(list(Step.objects.order_by("order").values_list(
            "kind", "status", "lease_until", "next_check_at", "done_calls")))
        raise


def _calls(verb: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(verb=verb).exclude(call=""))


def _assert_healed(chaos: Chaos, sim_state: Any) -> None:
    """The playbook finished, the fleet is right, every outside action happened once."""
    incident = _wait_resolved(chaos)
    remediation = incident.remediations.get()
    assert remediation.status == Remediation.Status.SUCCEEDED
    steps = list(remediation.steps.order_by("order"))
    assert all(s.status == Step.Status.SUCCEEDED for s in steps), [(s.kind, s.status)
                                                                  for s in steps]
    assert Remediation.objects.count() == 1
    new_node = next(s for s in steps if s.kind == "replace_node").result["new_node"]
    assert new_node == SPARE

    # The outside world, as the simulated Slurm, Kubernetes and provider report it.
    state = sim_state()
    bad = state["nodes"][BAD_NODE]
    assert bad["drained"] and bad["reason"].startswith("fleetwatch:")
    assert bad["unschedulable"]
    assert [p["name"] for p in state["pods"] if p["node"] == BAD_NODE] == [
        f"dcgm-exporter-{BAD_NODE}"]
    spare = state["nodes"][SPARE]
    assert spare["in_service"] and spare["ready"] and not spare["drained"]
    assert list(state["replacements"]) == [BAD_NODE]
    job = state["jobs"]["3001"]
    assert job["state"] == "RUNNING"
    assert job["restart_count"] == 1
    assert SPARE in job["nodes"] and BAD_NODE not in job["nodes"]

    # The audit trail: each outside action audited as a change exactly once, none missing,
    # none failed twice. (A re-run may re-check an action that reports "already done": that
    # is audited with changed False and is not a second action.)
    entries = list(AuditEntry.objects.filter(remediation=remediation).exclude(call=""))
    changed = Counter((e.verb, e.target) for e in entries if e.ok and e.data.get("changed"))
    assert set(changed) == ACTIONS | gate_actions(remediation.pk), changed
    assert all(n == 1 for n in changed.values()), changed
    failed = Counter((e.verb, e.target) for e in entries if not e.ok)
    assert all(n <= 1 for n in failed.values()), failed
    assert len(_calls("provider.replace")) == 1
    verified = audit_verify()
    assert verified.ok, str(verified)


def _rescued(worker: Worker, step: Step) -> bool:
    """The watchdog re-queued this step (steps_rescue logs the ids it re-queued)."""
    text = worker.log.read_text(errors="replace")
    return any(str(step.pk) in ids.split(", ") for ids in RESCUED.findall(text))


# --- the tests ----------------------------------------------------------------------------


def test_worker_killed_during_eviction(chaos: Chaos, sim_state: Any) -> None:
    first = chaos.start_worker()
    _inject_xid79(chaos)
    # Cordoned (and recorded as done), now inside the eviction's delay: kill everything.
    step = _wait_step(chaos, "cordon_and_drain", Step.Status.RUNNING, f"k8s.cordon {BAD_NODE}")
    time.sleep(ACTION_DELAY / 4)  # well inside the eviction's delay
    chaos.kill_worker(first)

    # The kill landed before the eviction changed anything, and nothing was audited for it.
    pods = [p["name"] for p in sim_state()["pods"] if p["node"] == BAD_NODE]
    assert f"slurmd-{BAD_NODE}" in pods
    assert _calls("k8s.evict") == []
    step.refresh_from_db()
    assert step.status == Step.Status.RUNNING and step.lease_until is not None

    second = chaos.start_worker()
    _assert_healed(chaos, sim_state)
    # Only the watchdog could bring the step back: the lost message is Redis's for an hour.
    assert _rescued(second, step), second.output()
    # The re-run skipped the cordon it had recorded as done: one k8s.cordon call in all.
    assert len(_calls("k8s.cordon")) == 1
    assert len(_calls("k8s.evict")) == 1


def test_worker_killed_during_replace(chaos: Chaos, sim_state: Any) -> None:
    first = chaos.start_worker()
    _inject_xid79(chaos)
    step = _wait_step(chaos, "replace_node", Step.Status.RUNNING)
    time.sleep(ACTION_DELAY / 4)  # the executor is inside provider.replace's delay
    chaos.kill_worker(first)

    assert sim_state()["replacements"] == {}  # the provider was never reached
    assert _calls("provider.replace") == []

    second = chaos.start_worker()
    _assert_healed(chaos, sim_state)
    assert _rescued(second, step), second.output()


def test_redis_restart_while_a_step_waits(
    chaos_private_redis: Chaos, private_redis: PrivateRedis, sim_state: Any
) -> None:
    chaos = chaos_private_redis
    worker = chaos.start_worker()
    _inject_xid79(chaos)
    # The hung job 3001 is inside its SIGTERM grace: the step polls through Redis.
    step = _wait_step(chaos, "drain_and_cancel", Step.Status.WAITING)
    private_redis.kill()  # every queued and unacked message is gone
    # Down longer than a publish keeps retrying (about half a second), so the next poll
    # is lost for certain, and long enough for the worker and beat to notice.
    time.sleep(2)
    private_redis.start()  # same port, empty

    _assert_healed(chaos, sim_state)
    assert worker.proc.poll() is None, "the worker must survive the broker restart"
    # The step's poll chain was lost with Redis: the watchdog re-queued it from the database.
    assert _rescued(worker, step), worker.output()
