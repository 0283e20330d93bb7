"""SlurmCli against a real Slurm cluster: slurmctld, four slurmd and munged from Debian's
slurm-wlm, started privately by tests/harness/slurm_cluster.py. Every check is made twice:
through the client and through Slurm's own ``scontrol``/``squeue``/``sinfo``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors.clients.base import ClientError, NotFound, SlurmJob, node_or_none
from collectors.clients.slurm import SlurmCli
from tests.conftest import wait_for
from tests.harness.slurm_cluster import SlurmCluster, SlurmInstall, missing_binaries

pytestmark = pytest.mark.integration

NODES = ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]
LEAVES = {"leaf-a": ["gpu-001", "gpu-002"], "leaf-b": ["gpu-003", "gpu-004"]}

# A training job in miniature: it loops until SIGTERM, then writes a marker (named after the
# job and the how-many-th run it is) and exits, as a loop that checkpoints on SIGTERM would.
JOB_SCRIPT = """#!/bin/bash
trap 'echo SIGTERM > "{marks}/$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"; exit 0' TERM
while true; do sleep 0.1; done
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            slurm_install: SlurmInstall) -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed here (missing {', '.join(missing)}): "
                    "`apt-get install -y slurm-wlm munge`, as `make test`'s bootstrap does")
    root = tmp_path_factory.mktemp("slurm")
    with SlurmCluster(root, NODES, LEAVES, kill_wait=2, install=slurm_install) as running:
        marks = root / "marks"
        marks.mkdir()
        (root / "train.sh").write_text(JOB_SCRIPT.format(marks=marks))
        yield running


@pytest.fixture
def client(cluster: SlurmCluster) -> SlurmCli:
    return SlurmCli(env=cluster.env, timeout=10, retries=1, backoff=0.2)


def submit(cluster: SlurmCluster, name: str, nodes: str = "gpu-001") -> str:
    count = len(cluster.run("scontrol", "show", "hostnames", nodes).stdout.split())
    out = cluster.run("sbatch", "--parsable", "-J", name, "-N", str(count), "-w", nodes,
                      "--gres=gpu:8", "-o", "/dev/null", str(cluster.root / "train.sh"), check=True)
    return out.stdout.strip().split(";")[0]


def job(client: SlurmCli, job_id: str) -> SlurmJob:
    return next(j for j in client.jobs() if j.job_id == job_id)


def squeue(cluster: SlurmCluster, job_id: str, fmt: str = "%T") -> str:
    return cluster.run("squeue", "-h", "-j", job_id, "-o", fmt).stdout.strip()


def scontrol_node(cluster: SlurmCluster, node: str) -> str:
    return cluster.run("scontrol", "show", "node", node, check=True).stdout


def marker(cluster: SlurmCluster, job_id: str, run: int) -> Path:
    return cluster.root / "marks" / f"{job_id}.{run}"


def test_reads_match_what_slurm_shows(cluster: SlurmCluster, client: SlurmCli) -> None:
    job_id = submit(cluster, "llama-pretrain", "gpu-[001-002]")
    wait_for(lambda: squeue(cluster, job_id) == "RUNNING", 90, f"job {job_id} to run")

    nodes = {n.name: n for n in client.nodes()}
    assert sorted(nodes) == NODES
    sinfo = dict(line.split() for line in
                 cluster.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.splitlines())
    for name, node in nodes.items():
        assert node.state.lower() == sinfo[name].removesuffix("*")
        assert node.partition == "gpu"
        assert node.flags == ()
    assert nodes["gpu-001"].state in {"ALLOCATED", "MIXED"}
    assert nodes["gpu-003"].state == "IDLE"

    seen = job(client, job_id)
    assert seen.state == "RUNNING"
    assert seen.name == "llama-pretrain"
    assert seen.user == squeue(cluster, job_id, "%u") == "root"
    # squeue prints the compressed hostlist; the client expands it.
    assert squeue(cluster, job_id, "%N") == "gpu-[001-002]"
    assert seen.nodes == ("gpu-001", "gpu-002")
    assert seen.restart_count == 0
    assert seen.started_at is not None
    assert seen.exit_code is None
    assert client.last_warnings == []

    assert client.topology() == LEAVES

    # One node read alone (scontrol show node NAME --json from 23.02; the list on 22.05) is
    # the list's entry for it, busy or idle.
    for name in ("gpu-001", "gpu-003"):
        assert client.node(name) == nodes[name]
    cluster.run("scancel", job_id, check=True)


def test_a_node_slurm_does_not_know_is_not_found_not_a_failed_read(
        cluster: SlurmCluster, client: SlurmCli) -> None:
    # Slurm answers a name it does not know with no node (25.11: an empty list, exit 0);
    # a host list names several, never the one asked after.
    for name in ("gpu-999", "gpu-[001-002]", "gpu-001,gpu-002", "gpu-[", "-h", ""):
        with pytest.raises(NotFound) as err:
            client.node(name)
        assert err.value.permanent
    assert node_or_none(client, "gpu-999") is None
    assert node_or_none(client, "gpu-002") == client.node("gpu-002")


def test_drain_is_idempotent_and_resume_only_undoes_fleetwatch(
        cluster: SlurmCluster, client: SlurmCli) -> None:
    first = client.drain("gpu-003", "incident 7 gpu_hardware")
    assert first.changed
    assert first.call == "scontrol update nodename=gpu-003 state=DRAIN " \
                         "'reason=fleetwatch: incident 7 gpu_hardware'"
    assert "Reason=fleetwatch: incident 7 gpu_hardware" in scontrol_node(cluster, "gpu-003")
    assert cluster.node_states()["gpu-003"] == "DRAINED"
    node = next(n for n in client.nodes() if n.name == "gpu-003")
    assert "DRAIN" in node.flags
    assert node.reason.startswith("fleetwatch: incident 7")

    again = client.drain("gpu-003", "fleetwatch: incident 8 nvlink")
    assert not again.changed
    assert "Reason=fleetwatch: incident 7 gpu_hardware" in scontrol_node(cluster, "gpu-003")

    assert client.resume("gpu-003").changed
    # slurmctld pings a resumed node before it counts as responding again ("IDLE*" meanwhile).
    cluster.wait_for_nodes("IDLE", nodes=["gpu-003"], timeout=90)
    assert not client.resume("gpu-003").changed

    # An administrator's drain is theirs: not resumed, and its reason not overwritten.
    cluster.run("scontrol", "update", "nodename=gpu-004", "state=DRAIN", "reason=admin: bad fan",
                check=True)
    try:
        with pytest.raises(ClientError) as refused:
            client.resume("gpu-004")
        assert refused.value.permanent
        assert "admin: bad fan" in str(refused.value)
        assert not client.drain("gpu-004", "incident 9 thermal").changed
        assert "Reason=admin: bad fan" in scontrol_node(cluster, "gpu-004")
        assert cluster.node_states()["gpu-004"] == "DRAINED"
    finally:
        cluster.run("scontrol", "update", "nodename=gpu-004", "state=RESUME", check=True)


def test_cancel_sends_sigterm_and_requeue_runs_the_job_again(
        cluster: SlurmCluster, client: SlurmCli) -> None:
    job_id = submit(cluster, "moe-finetune", "gpu-002")
    wait_for(lambda: squeue(cluster, job_id) == "RUNNING", 90, f"job {job_id} to run")
    # Not stopped yet: requeue() leaves a running job alone (it may be one already requeued).
    assert not client.requeue(job_id).changed

    cancelled = client.cancel(job_id, "TERM", 2)
    assert cancelled.changed
    assert cancelled.call == f"scancel {job_id}"
    assert cancelled.data["kill_wait_seconds"] == 2
    wait_for(marker(cluster, job_id, 0).exists, 90, "the job's SIGTERM handler to run")
    assert not client.cancel(job_id, "TERM", 2).changed  # a retried step signals nothing
    wait_for(lambda: job(client, job_id).state not in {"RUNNING", "COMPLETING"}, 30,
             f"job {job_id} to end")
    assert job(client, job_id).state == "CANCELLED"

    requeued = client.requeue(job_id)
    assert requeued.changed
    assert requeued.call == f"scontrol requeue {job_id}"
    assert squeue(cluster, job_id) in {"PENDING", "RUNNING"}
    assert job(client, job_id).restart_count == 1
    assert "Restarts=1" in cluster.run("scontrol", "show", "job", job_id).stdout
    assert not client.requeue(job_id).changed  # a retry does not requeue it twice

    # It runs again (after AuthInfo's cred_expire), and is a job like any other.
    wait_for(lambda: squeue(cluster, job_id) == "RUNNING", 90, f"job {job_id} to run again")
    again = job(client, job_id)
    assert again.state == "RUNNING"
    assert again.restart_count == 1
    assert not client.requeue(job_id).changed
    assert client.cancel(job_id, "SIGTERM", 2).changed
    wait_for(marker(cluster, job_id, 1).exists, 90, "the second run's SIGTERM handler to run")


def test_a_requeued_jobs_comment_carries_the_reason_read_back_by_scontrol(
        cluster: SlurmCluster, client: SlurmCli) -> None:
    """What the remediation does after a requeue (incidents/remediation/steps.py): the reason
    goes into the job itself, where `scontrol show job`, squeue and sacct show it."""
    job_id = submit(cluster, "llm-pretrain", "gpu-003")
    cluster.run("scontrol", "update", f"jobid={job_id}", "comment=my sweep 7", check=True)
    wait_for(lambda: squeue(cluster, job_id) == "RUNNING", 90, f"job {job_id} to run")
    assert client.cancel(job_id, "TERM", 2).changed
    wait_for(lambda: job(client, job_id).state not in {"RUNNING", "COMPLETING"}, 60,
             f"job {job_id} to end")
    assert client.requeue(job_id).changed

    why = (f"requeued after XID 79 (GPU has fallen off the bus) on gpu-003 GPU 5, incident 12, "
           f"https://fleetwatch.example/jobs/{job_id}/?cluster=lab")
    written = client.set_comment(job_id, why, "admin_comment")
    assert written.changed
    assert written.call == (f"scontrol update jobid={job_id} "
                            f"'admincomment=fleetwatch: {why}'")
    shown = cluster.run("scontrol", "show", "job", job_id, check=True).stdout
    assert f"AdminComment=fleetwatch: {why}" in shown
    assert "Comment=my sweep 7" in shown  # the user's own comment is untouched
    assert job(client, job_id).admin_comment == f"fleetwatch: {why}"
    assert cluster.run("squeue", "-h", "-j", job_id, "-O", "admin_comment:300").stdout.strip() \
        == f"fleetwatch: {why}"
    assert not client.set_comment(job_id, why, "admin_comment").changed  # a retried step

    # A site that has researchers read the plain comment: theirs is kept after FleetWatch's.
    assert client.set_comment(job_id, why, "comment").changed
    assert job(client, job_id).comment == f"fleetwatch: {why} | my sweep 7"
    assert squeue(cluster, job_id, "%k") == f"fleetwatch: {why} | my sweep 7"
    with pytest.raises(ClientError, match="no job comment field"):
        client.set_comment(job_id, why, "system_comment")
    cluster.run("scancel", job_id)


def test_requeue_hold_keeps_the_job_pending(cluster: SlurmCluster, client: SlurmCli) -> None:
    job_id = submit(cluster, "vit-sweep", "gpu-001")
    wait_for(lambda: squeue(cluster, job_id) == "RUNNING", 90, f"job {job_id} to run")
    try:
        held = client.requeue_hold(job_id)
        assert held.changed
        assert held.call == f"scontrol requeuehold {job_id}"
        wait_for(marker(cluster, job_id, 0).exists, 90, "the job's SIGTERM handler to run")
        # Its handler has run; the job is COMPLETING until its processes are gone (seconds on
        # a busy machine), then held.
        wait_for(lambda: squeue(cluster, job_id) not in {"RUNNING", "COMPLETING"}, 60,
                 f"job {job_id} to end its run")
        assert squeue(cluster, job_id) == "PENDING"
        assert "held" in squeue(cluster, job_id, "%r").lower()
        seen = job(client, job_id)
        assert seen.state == "PENDING"
        assert seen.restart_count == 1
        assert not client.requeue_hold(job_id).changed
        assert not client.requeue(job_id).changed
    finally:
        cluster.run("scancel", job_id)


def test_down_then_resume(cluster: SlurmCluster, client: SlurmCli) -> None:
    down = client.down("gpu-004", "incident 11 node_unreachable")
    assert down.changed
    assert cluster.node_states()["gpu-004"] == "DOWN"
    assert "Reason=fleetwatch: incident 11 node_unreachable" in scontrol_node(cluster, "gpu-004")
    assert next(n for n in client.nodes() if n.name == "gpu-004").state == "DOWN"
    assert not client.down("gpu-004", "incident 11 node_unreachable").changed
    assert client.resume("gpu-004").changed
    cluster.wait_for_nodes("IDLE", nodes=["gpu-004"], timeout=90)


def test_reboot_asap_then_resume(cluster: SlurmCluster, client: SlurmCli) -> None:
    result = client.reboot("gpu-003", "incident 12 gpu_memory row remap")
    assert result.changed
    assert result.call == ("scontrol reboot ASAP nextstate=RESUME "
                           "'reason=fleetwatch: incident 12 gpu_memory row remap' gpu-003")
    node = next(n for n in client.nodes() if n.name == "gpu-003")
    assert {"REBOOT_REQUESTED", "REBOOT_ISSUED"} & set(node.flags)
    assert node.reason.startswith("fleetwatch: incident 12")
    assert not client.reboot("gpu-003", "incident 12 gpu_memory row remap").changed
    # slurmd ran the RebootProgram on that node; the "machine" comes back up...
    wait_for(lambda: "gpu-003" in cluster.reboot_requests(), 30, "RebootProgram to run on gpu-003")
    cluster.complete_reboot("gpu-003")
    # ...and nextstate=RESUME puts it back in service with its reason cleared.
    cluster.wait_for_nodes("IDLE", nodes=["gpu-003"], timeout=90)
    node = next(n for n in client.nodes() if n.name == "gpu-003")
    assert (node.state, node.flags, node.reason) == ("IDLE", (), "")


def test_unknown_targets_are_permanent_errors(cluster: SlurmCluster, client: SlurmCli) -> None:
    for call in (lambda: client.cancel("999999", "TERM", 2), lambda: client.requeue("999999"),
                 lambda: client.drain("gpu-999", "x"), lambda: client.resume("gpu-999")):
        with pytest.raises(ClientError) as err:
            call()
        assert err.value.permanent
    with pytest.raises(ClientError) as missing:
        SlurmCli(bin_dir=str(cluster.root / "no-bin"), env=cluster.env).jobs()
    assert missing.value.permanent


def test_controller_down_is_a_transient_error_not_failed_nodes(
        cluster: SlurmCluster, client: SlurmCli) -> None:
    # No retries: each CLI call spends ~4 s trying to reach a dead slurmctld.
    client = SlurmCli(env=cluster.env, timeout=10, retries=0)
    client.release()  # known before the outage, as it would be in a long-running worker
    cluster.stop_controller()
    try:
        for read in (client.nodes, client.jobs):
            with pytest.raises(ClientError) as err:
                read()
            assert not err.value.permanent
            # What tells the operator the controller is down: scontrol ping's verdict where the
            # read "succeeded" empty (22.05), the CLI's own error where it fails (25.11).
            assert ("is DOWN" in str(err.value)
                    or "Unable to contact slurm controller" in str(err.value))
        with pytest.raises(ClientError) as err:
            client.topology()
        assert not err.value.permanent
        assert "Unable to contact slurm controller" in str(err.value)
        # One node's read: a controller away is a failed read, never "no such node".
        with pytest.raises(ClientError) as err:
            node_or_none(client, "gpu-001")
        assert not isinstance(err.value, NotFound) and not err.value.permanent
    finally:
        cluster.start_controller()
    cluster.wait_for_nodes("IDLE", timeout=30)
    assert sorted(n.name for n in client.nodes()) == NODES
