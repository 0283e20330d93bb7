"""Which GPUs a job holds on each node (Slurm's gres_detail), end to end: read, stored, used by
diagnosis to blame the job on the faulty GPU and by remediation to stop only that job, shown on
the node and job pages. The fleet is the simulated one, whose scheduler hands out GPU indices
as Slurm's GRES selection does; tests/integration/test_slurm.py reads them from real Slurm."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from collectors import services as collectors
from collectors.models import Job
from collectors.sim.fleet import SimFleet, inject_xid, submit_job
from incidents import diagnosing
from incidents.diagnosis import diagnose_window, replay
from incidents.models import AuditEntry, Incident
from tests.unit.test_remediation import drive

pytestmark = pytest.mark.django_db

SHARED = "gpu-013"


@pytest.fixture
def shared_node(sim_fleet: SimFleet, settings: Any) -> tuple[str, str]:
    """Two 4-GPU jobs on one node: job A on GPUs 0-3, job B on GPUs 4-7."""
    settings.FLEETWATCH_SIM_SPEED = 400.0
    sim_fleet.speed = 400.0
    with sim_fleet.transaction() as state:
        # Free four nodes (the sweep's) for the two small jobs.
        state["jobs"]["3003"].update(state="COMPLETED", nodes=[], gpus={})
        a = submit_job(state, "eval-a", "dave", gpus_per_node=4)
        b = submit_job(state, "eval-b", "erin", gpus_per_node=4)
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    return a, b


def test_the_gpus_of_each_job_are_stored_per_node(shared_node: tuple[str, str]) -> None:
    a, b = shared_node
    stored = {j.slurm_id: (j.nodes, j.gpus) for j in Job.objects.filter(slurm_id__in=shared_node)}
    assert stored == {a: ([SHARED], {SHARED: [0, 1, 2, 3]}),
                      b: ([SHARED], {SHARED: [4, 5, 6, 7]})}
    # A whole-node job holds all eight.
    assert Job.objects.get(slurm_id="3001").gpus["gpu-001"] == list(range(8))


def test_a_gpu_fault_on_a_shared_node_blames_and_requeues_only_the_job_on_that_gpu(
        shared_node: tuple[str, str], sim_fleet: SimFleet,
        django_capture_on_commit_callbacks: Any) -> None:
    a, b = shared_node
    with sim_fleet.transaction() as state:
        inject_xid(state, SHARED, 5, 79, sim_fleet.clock.now())  # GPU 5: job B's
    collectors.collect_source("telemetry")
    with django_capture_on_commit_callbacks():
        incidents = diagnosing.diagnosis_run(collectors.cluster_default().pk)
    [incident] = [i for i in incidents if i.root_cause == "gpu_hardware"]
    assert incident.nodes == [SHARED]
    assert incident.jobs == [b]  # not its neighbour on GPUs 0-3
    assert f"job {a} (GPU 0-3); not affected by this GPU, left running" in incident.explanation

    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks,
                between=lambda: collectors.collect_source("slurm"))
    cancelled = list(AuditEntry.objects.filter(remediation=rem, verb="slurm.cancel")
                     .values_list("target", flat=True))
    requeued = list(AuditEntry.objects.filter(remediation=rem, verb="slurm.requeue")
                    .values_list("target", flat=True))
    assert cancelled == [f"job {b}"] and requeued == [f"job {b}"]
    drain = rem.steps.get(kind="drain_and_cancel")
    assert drain.result["spared"] == [a]
    assert f"job(s) {a} on other GPUs left running" in drain.detail
    jobs = sim_fleet.snapshot()["jobs"]
    assert jobs[b]["restart_count"] == 1  # requeued, and running again elsewhere
    assert jobs[a]["restart_count"] == 0 and jobs[a]["history"][-1]["event"] == "RUNNING"


def scenario(jobs: list[dict[str, Any]], signal: dict[str, Any]) -> dict[str, Any]:
    return {"format": replay.FORMAT, "name": "shared-node", "topology": {}, "jobs": jobs,
            "signals": [{"at": "2026-12-04T10:00:00.000Z", "node": SHARED, **signal}]}


DCGM_XID = {"source": "dcgm", "gpu": 5, "metric": "DCGM_FI_DEV_XID_ERRORS", "value": 79}
KERNEL_XID = {"source": "kernel", "message": "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', "
              "name=<unknown>, GPU has fallen off the bus."}


@pytest.mark.parametrize(("jobs", "signal", "blamed"), [
    # Slurm said which GPUs: only the job on GPU 5.
    ([{"id": "1", "nodes": [SHARED], "gpus": {SHARED: [0, 1]}},
      {"id": "2", "nodes": [SHARED], "gpus": {SHARED: [4, 5]}}], DCGM_XID, "2"),
    # Slurm did not say for job 1: it may hold GPU 5, so both (today's reading).
    ([{"id": "1", "nodes": [SHARED]},
      {"id": "2", "nodes": [SHARED], "gpus": {SHARED: [4, 5]}}], DCGM_XID, "1, 2"),
    # A kernel line names a PCI address, not an index: both.
    ([{"id": "1", "nodes": [SHARED], "gpus": {SHARED: [0, 1]}},
      {"id": "2", "nodes": [SHARED], "gpus": {SHARED: [4, 5]}}], KERNEL_XID, "1, 2"),
])
def test_diagnosis_blames_the_job_on_the_faulty_gpu_where_slurm_says_which(
        jobs: list[dict[str, Any]], signal: dict[str, Any], blamed: str) -> None:
    [incident] = replay.diagnose_document(scenario(jobs, signal))["incidents"]
    assert incident["root_cause"] == "gpu_hardware" and incident["nodes"] == [SHARED]
    result = diagnose_window(replay.observations_from_replay(scenario(jobs, signal)["signals"]),
                             {}, replay._jobs(jobs))
    assert ", ".join(result.diagnoses[0].jobs) == blamed


def test_a_replay_jobs_gpus_must_be_lists_of_indices() -> None:
    with pytest.raises(replay.ReplayError, match="'gpus' must map each node"):
        replay.diagnose_document(scenario([{"id": "7", "gpus": {SHARED: "4-5"}}], DCGM_XID))


def test_node_and_job_pages_show_which_gpus_each_job_holds(
        shared_node: tuple[str, str], client: Any, operator: Any) -> None:
    a, b = shared_node
    client.force_login(operator)
    page = client.get(reverse("node-detail", args=[SHARED])).content.decode()
    assert f"{a}" in page and "GPUs 0-3" in page and "GPUs 4-7" in page
    page = client.get(reverse("job-detail", args=[b])).content.decode()
    assert f"{SHARED}</a>: GPUs 4-7" in page
    assert Incident.objects.count() == 0
    # And the API, for programs.
    api = APIClient()
    api.force_authenticate(operator)
    listed = {j["slurm_id"]: j["gpus"] for j in api.get("/api/v1/jobs/", {"page_size": 100})
              .json()["results"]}
    assert listed[a] == {SHARED: [0, 1, 2, 3]} and listed[b] == {SHARED: [4, 5, 6, 7]}
