"""SlurmRest against a real Slurm 25.11 slurmrestd (JWT), from tests/harness/slurm_cluster.py,
checked with the real CLI (``scontrol``, ``squeue``, ``sinfo``) of the same cluster; and the
gpu_hardware playbook end to end through slurmrestd.

What a real slurmrestd answers is what is asserted: an expired or foreign token is refused by
slurmctld (511, "Protocol authentication error"), an unreachable address, a version the server
does not serve (25.11 dropped v0.0.40), slurmctld down behind a running slurmrestd."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from collectors import services as collectors
from collectors.clients import Clients
from collectors.clients.base import ClientError, NotFound, node_or_none
from collectors.clients.kubernetes import KubernetesApi
from collectors.clients.providers import (
    CompositeProvider,
    KubernetesPoolProvider,
    SlurmRebootProvider,
)
from collectors.clients.slurmrest import SlurmRest, TokenSource, jwt_hs256
from collectors.models import Node, SourceHealth
from collectors.sim.fleet import SimFleet, SimKubernetes, SimTelemetry
from incidents import lifecycle
from incidents.audit import audit_verify
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Incident, Step
from incidents.remediation import engine
from incidents.remediation.playbooks import FOR_ROOT_CAUSE
from tests.conftest import wait_for
from tests.harness import slurm_cluster as harness
from tests.harness.slurm_cluster import free_port, scontrol_fields
from tests.integration.test_kubernetes import _server_module
from tests.integration.test_playbook_real import (
    FAILED,
    GPU_STATE,
    LEAVES,
    NODES,
    SPARE,
    SPARE_REASON,
    TRAIN_SCRIPT,
    RecordingNotifier,
    drive,
    gate_settings,
    k8s_seed,
)

pytestmark = [pytest.mark.integration]

RELEASE = "25.11"


def start_cluster(root: Path) -> Any:
    """The harness's Slurm 25.11 cluster with slurmrestd (JWT) on a free loopback port: it
    exposes ``rest_url``, ``token(user, lifespan)`` and ``slurmctld_url``."""
    return harness.SlurmCluster(root, NODES, LEAVES, kill_wait=2, release=RELEASE)


def rest_client(cluster: Any, *, token: str | None = None, **kw: Any) -> SlurmRest:
    """SlurmRest as FleetWatch configures it: JWT, slurmctld's URL, topology.conf, and the
    scontrol (with the same JWT) for what slurmrestd has no endpoint for."""
    scontrol = cluster.run("sh", "-c", "command -v scontrol").stdout.strip()
    return SlurmRest(cluster.rest_url,
                     TokenSource(token=token or cluster.token("root", 3600)), user="root",
                     timeout=10.0, ctld_url=cluster.slurmctld_url,
                     topology_file=str(cluster.conf.parent / "topology.conf"),
                     bin_dir=str(Path(scontrol).parent), slurm_conf=str(cluster.conf), **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("rest")
    with start_cluster(root) as running:
        (root / "marks").mkdir(exist_ok=True)
        (root / "train.sh").write_text(TRAIN_SCRIPT.format(marks=root / "marks"))
        yield running


@pytest.fixture
def rest(cluster: Any) -> Iterator[SlurmRest]:
    yield rest_client(cluster)
    # Leave the cluster as found: no jobs, every node in service.
    cluster.run("scancel", "--full", "-u", "root")
    for node in NODES:
        cluster.run("scontrol", "update", f"nodename={node}", "state=RESUME")
    cluster.wait_for_nodes("IDLE", timeout=60)


def sbatch(cluster: Any, *args: str) -> str:
    out = cluster.run("sbatch", "--parsable", "-o", "/dev/null", *args, check=True)
    return out.stdout.strip().split(";")[0]


def job_fields(cluster: Any, job: str) -> dict[str, str]:
    return scontrol_fields(cluster.run("scontrol", "show", "job", job, check=True).stdout)


def node_fields(cluster: Any, node: str) -> dict[str, str]:
    return scontrol_fields(cluster.run("scontrol", "show", "node", node, check=True).stdout)


def running(cluster: Any, job: str) -> bool:
    return job_fields(cluster, job)["JobState"] == "RUNNING"


# --- reads ---------------------------------------------------------------------------------------


def test_nodes_jobs_and_topology_match_the_cli(cluster: Any, rest: SlurmRest) -> None:
    job = sbatch(cluster, "--requeue", "-J", "reader", "-w", "gpu-002", "--gres=gpu:2",
                 str(cluster.root / "train.sh"))
    wait_for(lambda: running(cluster, job), 30, f"job {job} to run")
    done = sbatch(cluster, "-J", "quick", "-w", "gpu-004", "--wrap", "true")
    wait_for(lambda: job_fields(cluster, done)["JobState"] == "COMPLETED", 30, "a job to end")

    assert rest.version() == 44  # the highest 25.11 serves
    nodes = {n.name: n for n in rest.nodes()}
    assert rest.last_warnings == []  # /readyz ready, /metrics lists the same nodes
    sinfo = cluster.run("sinfo", "-h", "-N", "-o", "%N", check=True).stdout.split()
    assert sorted(nodes) == sorted(sinfo) == NODES
    for name, node in nodes.items():
        shown = node_fields(cluster, name)  # State=MIXED, IDLE+DRAIN, ...
        assert "+".join((node.state, *node.flags)) == shown["State"], (node, shown)
        assert node.reason == shown.get("Reason", "").split(" [")[0], (node, shown)
        assert node.partition == shown["Partitions"] == "gpu"
        assert rest.node(name) == node  # GET node/NAME: the one node, as the list has it
    # A name slurmctld does not know (200 "Failure to query node"): NotFound, not a failure.
    with pytest.raises(NotFound) as unknown:
        rest.node("gpu-999")
    assert unknown.value.permanent
    assert node_or_none(rest, "gpu-999") is None

    jobs = {j.job_id: j for j in rest.jobs()}
    shown = job_fields(cluster, job)
    assert (jobs[job].state, jobs[job].nodes, jobs[job].name) == ("RUNNING", ("gpu-002",),
                                                                  "reader")
    assert jobs[job].user == shown["UserId"].split("(")[0]
    assert jobs[job].gpus == {"gpu-002": (0, 1)}  # gres_detail gpu:2(IDX:0-1)
    assert jobs[done].state == "COMPLETED" and jobs[done].exit_code == 0  # finished ones too
    assert rest.topology() == {"leaf-a": LEAVES["leaf-a"], "leaf-b": LEAVES["leaf-b"]}


# --- node actions ----------------------------------------------------------------------------------


def test_drain_resume_down_and_reboot_seen_by_scontrol(cluster: Any, rest: SlurmRest) -> None:
    first = rest.drain("gpu-003", "incident 7 gpu_hardware")
    assert first.changed and first.call.startswith("POST /slurm/v0.0.44/node/gpu-003")
    shown = node_fields(cluster, "gpu-003")
    assert "DRAIN" in shown["State"] and shown["Reason"].startswith(
        "fleetwatch: incident 7 gpu_hardware"), shown
    assert not rest.drain("gpu-003", "again").changed  # read first: nothing twice
    assert node_fields(cluster, "gpu-003")["Reason"].startswith("fleetwatch: incident 7")

    assert rest.resume("gpu-003").changed
    wait_for(lambda: node_fields(cluster, "gpu-003")["State"] == "IDLE", 30, "gpu-003 IDLE")
    # 25.11 keeps the reason after RESUME; the node is in service and a retry changes nothing.
    again = rest.resume("gpu-003")
    assert not again.changed and again.detail == "gpu-003 is not drained or down"

    job = sbatch(cluster, "--requeue", "-J", "on-down", "-w", "gpu-001",
                 str(cluster.root / "train.sh"))
    wait_for(lambda: running(cluster, job), 30, f"job {job} to run")
    assert rest.down("gpu-001", "unreachable").changed
    # Slurm requeues a requeueable job whose node goes DOWN (NODE_FAIL, restart count + 1).
    wait_for(lambda: job_fields(cluster, job)["Restarts"] == "1", 30, "the job to be requeued")
    assert "fleetwatch: unreachable" in node_fields(cluster, "gpu-001")["Reason"]

    reboot = rest.reboot("gpu-005", "nvlink reset")
    assert reboot.changed and reboot.call.startswith("scontrol reboot ASAP nextstate=RESUME")
    state = node_fields(cluster, "gpu-005")["State"]
    assert "REBOOT" in state, state
    assert not rest.reboot("gpu-005", "nvlink reset").changed
    wait_for(lambda: "gpu-005" in cluster.reboot_requests(), 30, "RebootProgram to run")
    cluster.complete_reboot("gpu-005")
    wait_for(lambda: node_fields(cluster, "gpu-005")["State"] == "IDLE", 60, "gpu-005 back")


def test_others_drains_are_theirs(cluster: Any, rest: SlurmRest) -> None:
    cluster.run("scontrol", "update", "nodename=gpu-004", "state=DRAIN",
                "reason=admin: bad DIMM", check=True)
    with pytest.raises(ClientError, match="drained by someone else") as exc:
        rest.resume("gpu-004")
    assert exc.value.permanent
    assert not rest.drain("gpu-004", "incident 9").changed
    shown = node_fields(cluster, "gpu-004")
    assert "DRAIN" in shown["State"] and shown["Reason"].startswith("admin: bad DIMM")


# --- job actions ----------------------------------------------------------------------------------


def test_cancel_with_sigterm_then_requeue_and_hold(cluster: Any, rest: SlurmRest) -> None:
    job = sbatch(cluster, "--requeue", "-J", "train", "-w", "gpu-002",
                 str(cluster.root / "train.sh"))
    wait_for(lambda: running(cluster, job), 30, f"job {job} to run")
    cancelled = rest.cancel(job, "TERM", 2)
    assert cancelled.changed and cancelled.call == f"DELETE /slurm/v0.0.44/job/{job}"
    wait_for(lambda: (cluster.root / "marks" / f"{job}.0").exists(), 30,
             "the job's SIGTERM handler to run")
    wait_for(lambda: job_fields(cluster, job)["JobState"] == "CANCELLED", 30, "CANCELLED")
    assert not rest.cancel(job, "TERM", 2).changed

    requeued = rest.requeue(job)
    assert requeued.changed and requeued.call == f"scontrol requeue {job}"
    shown = job_fields(cluster, job)
    assert (shown["JobState"], shown["Restarts"]) == ("PENDING", "1")
    assert not rest.requeue(job).changed  # pending: nothing twice
    wait_for(lambda: running(cluster, job), 60, f"job {job} to run again")
    assert not rest.requeue(job).changed  # running again: never restarted twice

    rest.cancel(job, "TERM", 2)
    wait_for(lambda: job_fields(cluster, job)["JobState"] == "CANCELLED", 30, "CANCELLED")
    assert rest.requeue_hold(job).changed
    shown = job_fields(cluster, job)
    # Held: priority 0 until someone releases it ("job requeued in held state").
    assert (shown["JobState"], shown["Priority"]) == ("PENDING", "0"), shown
    assert "held" in shown["Reason"].lower(), shown
    assert not rest.requeue_hold(job).changed

    with pytest.raises(ClientError, match="Invalid job id") as exc:
        rest.requeue("999999")
    assert exc.value.permanent

    # Why, written into the job over slurmrestd's job update, read back by scontrol; the
    # user's own comment is kept after FleetWatch's.
    why = "requeued after XID 79 (GPU has fallen off the bus) on gpu-002 GPU 0, incident 3"
    written = rest.set_comment(job, why, "admin_comment")
    assert written.changed and written.call.startswith(f"POST /slurm/v0.0.44/job/{job} ")
    assert f"AdminComment=fleetwatch: {why}" in cluster.run(
        "scontrol", "show", "job", job, check=True).stdout
    assert not rest.set_comment(job, why, "admin_comment").changed
    cluster.run("scontrol", "update", f"jobid={job}", "comment=sweep 7", check=True)
    assert rest.set_comment(job, why, "comment").changed
    assert f"Comment=fleetwatch: {why} | sweep 7" in cluster.run(
        "scontrol", "show", "job", job, check=True).stdout


# --- bad input --------------------------------------------------------------------------------------


def test_a_token_signed_with_another_key_is_refused(cluster: Any) -> None:
    foreign = jwt_hs256({"iat": int(time.time()), "exp": int(time.time()) + 600, "sun": "root"},
                        os.urandom(32))
    with pytest.raises(ClientError, match="slurmctld refused the JWT") as exc:
        rest_client(cluster, token=foreign).nodes()
    assert exc.value.permanent


def test_unreachable_slurmrestd(cluster: Any) -> None:
    rest = SlurmRest(f"http://127.0.0.1:{free_port()}", TokenSource(token="x"), timeout=3.0)
    with pytest.raises(ClientError, match="is unreachable"):
        rest.nodes()


def test_a_dropped_version_moves_to_one_the_server_serves(cluster: Any, rest: SlurmRest) -> None:
    rest._version = 40  # what a 24.05-era choice would be: 25.11 dropped it
    assert len(rest.nodes()) == len(NODES)
    assert rest.version() == 44


@pytest.mark.django_db
def test_bad_token_and_controller_down_turn_the_source_red(cluster: Any, settings: Any,
                                                             tmp_path: Path) -> None:
    fleet = SimFleet(tmp_path / "sim.json", speed=1.0)
    fleet.seed(nodes=len(NODES), spares=0)

    def clients(slurm: SlurmRest) -> Clients:
        return Clients(slurm, SimKubernetes(fleet), SimTelemetry(fleet), SlurmRebootProvider(slurm),
                       RecordingNotifier())

    assert collectors.collect_source("slurm", clients=clients(rest_client(cluster))).healthy
    stored = sorted(Node.objects.values_list("name", "slurm_state", "in_service"))
    assert [n for n, _, _ in stored] == NODES

    foreign = jwt_hs256({"exp": int(time.time()) + 600, "sun": "root"}, b"not the key")
    result = collectors.collect_source("slurm", clients=clients(rest_client(cluster, token=foreign)))
    assert not result.healthy and "slurmctld refused the JWT" in result.error
    health = SourceHealth.objects.get(name="slurm")
    assert health.healthy is False and "refused the JWT" in health.last_error
    assert sorted(Node.objects.values_list("name", "slurm_state", "in_service")) == stored

    good = rest_client(cluster)  # its token made while slurmctld answers
    cluster.stop_controller()
    try:
        result = collectors.collect_source("slurm", clients=clients(good))
    finally:
        cluster.start_controller()
    assert not result.healthy and "slurmctld" in result.error, result.error
    assert sorted(Node.objects.values_list("name", "slurm_state", "in_service")) == stored


# --- the gpu_hardware playbook through slurmrestd -------------------------------------------------


@pytest.mark.django_db
def test_gpu_hardware_playbook_through_slurmrestd(
        tmp_path_factory: pytest.TempPathFactory, settings: Any, tmp_path: Path,
        monkeypatch: Any, django_capture_on_commit_callbacks: Any) -> None:
    """tests/integration/test_playbook_real.py's scenario with SlurmRest for Slurm: drain with
    FleetWatch's reason, cancel with SIGTERM, requeue, the spare's acceptance checks through
    slurmrestd (reservation, job submit, reservation delete), the job running again on it."""
    # The budget lets one trainer pod out: the eviction does not wait here (the 429 path is
    # test_playbook_real's subject).
    seed = k8s_seed()
    seed["poddisruptionbudgets"][0]["minAvailable"] = 1
    root = tmp_path_factory.mktemp("rest-pb")
    with start_cluster(root) as cluster:
        (root / "marks").mkdir()
        (root / "gpu-state").mkdir()
        (root / "checks").mkdir()
        (root / "gpu-state" / f"{SPARE}.json").write_text(json.dumps(GPU_STATE["passes"]))
        (root / "train.sh").write_text(TRAIN_SCRIPT.format(marks=root / "marks"))
        cluster.run("scontrol", "update", f"nodename={SPARE}", "state=DRAIN",
                    f"reason={SPARE_REASON}", check=True)
        server = _server_module().K8sTestServer(
            seed, bookmark_interval=0.3, kubeconfig_path=tmp_path / "kubeconfig.yaml",
            pools={"gpu": {"spares": [SPARE], "delay": 0.5, "ready_delay": 0.5}})
        server.start()
        try:
            _playbook(cluster, server, settings, tmp_path, monkeypatch,
                      django_capture_on_commit_callbacks)
        finally:
            server.stop()


def _playbook(cluster: Any, k8s: Any, settings: Any, tmp_path: Path, monkeypatch: Any,
              capture: Any) -> None:
    settings.FLEETWATCH_POLICY_MODE = "auto"
    settings.FLEETWATCH_PLAYBOOK_MODES = {}
    settings.FLEETWATCH_STEP_MODES = {}
    settings.FLEETWATCH_SLURM_GRACE_SECONDS = 2
    settings.FLEETWATCH_BASE_URL = "https://fleetwatch.example"
    gate_settings(settings, cluster)
    blocker = sbatch(cluster, "-J", "other-team", "-N", "2", "-w", "gpu-001,gpu-004",
                     "--gres=gpu:8", "--wrap", "sleep 600")
    wait_for(lambda: running(cluster, blocker), 30, "the blocker job to run")
    job = sbatch(cluster, "--requeue", "-J", "llama-pretrain", "-N", "2", "--gres=gpu:8",
                 str(cluster.root / "train.sh"))
    wait_for(lambda: running(cluster, job), 30, f"job {job} to run")
    assert job_fields(cluster, job)["NodeList"] == "gpu-[002-003]"

    slurm = rest_client(cluster)
    api = KubernetesApi(str(k8s.kubeconfig_path), timeout=5.0, evict_max_wait=60.0,
                        evict_backoff=(0.2, 0.5))
    fleet = SimFleet(tmp_path / "gpu-telemetry.json", speed=1.0)
    fleet.seed(nodes=len(NODES), spares=0)
    notifier = RecordingNotifier()
    clients = Clients(slurm=slurm, kubernetes=api, telemetry=SimTelemetry(fleet),
                      provider=CompositeProvider(replace=KubernetesPoolProvider(api),
                                                 reboot=SlurmRebootProvider(slurm)),
                      notifier=notifier)
    monkeypatch.setattr(engine, "get_clients", lambda cluster: clients)
    diagnosis = Diagnosis(root_cause="gpu_hardware", nodes=(FAILED,), confidence=0.95,
                          playbook=FOR_ROOT_CAUSE["gpu_hardware"], jobs=(job,),
                          explanation=f"XID 79 on {FAILED} GPU 3: fallen off the bus",
                          detected_at=timezone.now())
    with capture():
        incident, _ = lifecycle.incident_record(collectors.cluster_default().pk, diagnosis)
    rem = incident.remediations.get()
    seen: dict[str, Any] = {}

    def between() -> None:
        done = {s.kind for s in Step.objects.filter(remediation=rem, status="succeeded")}
        if "requeue" in done and "requeued" not in seen:
            seen["requeued"] = job_fields(cluster, job)

    try:
        rem = drive(rem, capture, between)
    finally:
        api.close()
    steps = list(rem.steps.order_by("order").values_list("kind", "status", "detail"))
    assert rem.status == "succeeded", steps
    incident.refresh_from_db()
    reason = f"fleetwatch: incident {incident.pk} gpu_hardware"

    node = node_fields(cluster, FAILED)
    assert "DRAIN" in node["State"] and node["Reason"].startswith(reason), node
    assert (cluster.root / "marks" / f"{job}.0").exists(), "the job never got its SIGTERM"
    assert (seen["requeued"]["JobState"], seen["requeued"]["Restarts"]) == ("PENDING", "1")
    shown = job_fields(cluster, job)
    assert (shown["JobState"], shown["Restarts"], shown["NodeList"]) == (
        "RUNNING", "1", "gpu-[002,005]")  # the spare took gpu-003's place
    # Why, in the job itself (its admin comment, written over slurmrestd), read back with
    # scontrol: what `scontrol show job`, squeue and sacct show the researcher.
    text = cluster.run("scontrol", "show", "job", job, check=True).stdout
    assert (f"AdminComment=fleetwatch: requeued after GPU hardware on {FAILED}, incident "
            f"{incident.pk}, https://fleetwatch.example/jobs/{job}/?cluster=") in text, text
    assert running(cluster, blocker)

    calls = list(AuditEntry.objects.filter(remediation=rem).exclude(call="").order_by("id"))
    acted = [(e.verb, e.target, e.call.split(" ")[0]) for e in calls if e.data.get("changed")]
    assert acted == [
        ("notify", "on-call", "notify"), ("slurm.drain", FAILED, "POST"),
        ("slurm.comment", f"job {job} stopped", "POST"), ("slurm.cancel", f"job {job}", "DELETE"),
        ("slurm.requeue", f"job {job}", "scontrol"),
        ("slurm.comment", f"job {job} requeued", "POST"),
        ("k8s.cordon", FAILED, acted[6][2]), ("k8s.evict", "train/trainer-1", acted[7][2]),
        ("provider.replace", FAILED, acted[8][2]),
        # The spare's acceptance checks, every call over slurmrestd (v0.0.44 creates
        # reservations), then in service: the resume step after them changes nothing.
        ("slurm.reserve", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)", "POST"),
        ("slurm.resume", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)", "POST"),
        ("slurm.submit_check", f"{SPARE} fleetwatch-check-r{rem.pk}-1-fleetwatch-check", "POST"),
        ("slurm.unreserve", f"{SPARE} (fleetwatch-gate-r{rem.pk}-1)", "DELETE"),
    ]
    assert all(e.ok for e in calls)
    assert audit_verify().ok
    assert incident.status == Incident.Status.RESOLVED
