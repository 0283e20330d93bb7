"""The node agent as a GPU node runs it: installed alone in a fresh virtualenv (no Django, no
server), reading this machine's real /dev/kmsg, pushing over HTTP to a live FleetWatch whose
real Celery worker diagnoses and remediates. An `NVRM: Xid ... 79` line written to the kernel
log opens an incident and starts the playbook."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collectors.models import Job, Node, Signal
from incidents.models import Incident, Step
from incidents.tokens import agent_token_create
from tests.conftest import Worker, wait_for

# xdist_group: the real /dev/kmsg's tests run on one worker, one at a time (another's lines
# would reach this agent, and this one's theirs).
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True),
              pytest.mark.xdist_group("kmsg")]

ROOT = Path(__file__).resolve().parents[2]
KMSG = Path("/dev/kmsg")


@pytest.fixture(scope="module")
def agent_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv holding only the agent, installed from collectors/agent as a node would."""
    if not os.access(KMSG, os.R_OK | os.W_OK):
        pytest.fail("this test writes to /dev/kmsg: run it as root (make test does, in CI)")
    venv = tmp_path_factory.mktemp("agent") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                           "--disable-pip-version-check", str(ROOT / "collectors" / "agent")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv


def test_the_agent_installs_alone_without_the_server(agent_venv: Path) -> None:
    python = str(agent_venv / "bin" / "python")
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, timeout=60, check=True).stdout
    names = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert {"fleetwatch-agent", "requests", "nvidia-ml-py"} <= names
    assert not names & {"django", "celery", "djangorestframework", "kubernetes", "psycopg"}
    version = subprocess.run([str(agent_venv / "bin" / "fleetwatch-agent"), "--version"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert version.startswith("fleetwatch-agent 0.")
    # Run from outside the checkout: what it imports is the installed package.
    done = subprocess.run([python, "-c", "import collectors.agent.cli, sys; "
                           "print(collectors.agent.cli.__file__, 'django' in sys.modules)"],
                          capture_output=True, text=True, timeout=60, check=True, cwd="/")
    where, django = done.stdout.split()
    assert where.startswith(str(agent_venv)) and django == "False"


@pytest.fixture
def agent_process(agent_venv: Path, live_server: Any, tmp_path: Path,
                  celery_worker_process: Worker) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    wait_for(lambda: Node.objects.filter(name="gpu-003").exists()
             and Job.objects.filter(state="RUNNING").count() == 3, 60,
             "the first collection of the simulated fleet")
    token = tmp_path / "token"
    token.write_text(agent_token_create("gpu-003", actor="system:test")[1])
    token.chmod(0o600)
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(agent_venv / "bin" / "fleetwatch-agent"), "--url", live_server.url,
             "--node", "gpu-003", "--token-file", str(token), "--state-dir", str(tmp_path / "state"),
             "--no-nvml", "--sysfs-root", str(tmp_path / "no-infiniband"), "--interval", "5"],
            stdout=out, stderr=subprocess.STDOUT, cwd="/", start_new_session=True)
    try:
        wait_for(lambda: "kernel log: reading /dev/kmsg" in log.read_text()
                 and "takes agent protocols" in log.read_text(), 30,
                 "the agent to open /dev/kmsg and pass the version check")
        yield proc, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text()[-3000:]


def test_a_real_kernel_xid_line_opens_an_incident_and_starts_the_playbook(
        agent_process: tuple[subprocess.Popen[bytes], Path]) -> None:
    _, log = agent_process
    marker = uuid.uuid4().hex[:8]
    line = (f"NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen "
            f"off the bus. (fleetwatch test {marker})")
    with KMSG.open("w") as kmsg:
        kmsg.write(f"<3>{line}\n")
    try:
        signal_row = wait_for(lambda: Signal.objects.filter(source="kernel", message=line).first(),
                              20, "the pushed kernel line")
        incident = wait_for(lambda: Incident.objects.filter(nodes__contains=["gpu-003"]).first(),
                            30, "an incident for gpu-003")
        step = wait_for(lambda: Step.objects.filter(remediation__incident=incident,
                                                    started_at__isnull=False).first(),
                        30, "the playbook's first step")
    except AssertionError:
        print(log.read_text()[-5000:])
        raise
    assert signal_row.node_name == "gpu-003" and signal_row.data["seq"] > 0
    assert incident.root_cause == "gpu_hardware" and "XID 79" in incident.explanation
    assert step.kind == "notify"
