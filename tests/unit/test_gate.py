"""The return-to-service gate on the simulated fleet (the real Slurm side:
tests/integration/test_gate.py, test_playbook_real.py): checks as configuration, the playbook
step and its verdicts (a replacement that fails its check is not resumed; a person's retry
checks again; repeated failures mark it for RMA), the hold through a reboot, a worker dying
mid-gate, the gate outside a playbook and its modes, Slurm down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.test import Client

from collectors import normalize
from collectors import services as collectors
from collectors.clients import get_clients
from collectors.clients.base import ActionResult, ClientError, SlurmJob
from collectors.clients.slurm import gres_gpus, parse_reservations, parse_reservations_text
from collectors.knowledge.acceptance import (
    CHECKS,
    Catalogue,
    CatalogueError,
    Repair,
    catalogue_from,
    selection_for,
    selection_parse,
    threshold_env,
)
from collectors.models import Node
from collectors.selectors import node_detail
from collectors.sim.faults import source_outage_set
from collectors.sim.fleet import SimFleet, SimSlurm, set_check_verdict
from incidents import gates
from incidents.models import AuditEntry, GateRun
from incidents.remediation import gate, transitions
from incidents.selectors import gate_status
from tests.unit.test_remediation import calls, cluster, diag, drive, open_incident

__all__ = ["cluster"]  # the fixture, shared with test_remediation
pytestmark = pytest.mark.django_db

# --- checks as configuration -----------------------------------------------------------------


def test_the_most_specific_entry_chooses_the_checks() -> None:
    selection = selection_parse(
        "*=fleetwatch-check,h100:replace=dcgm-diag-3+nccl-allreduce,*:cool=none,"
        "h100:*=gemm-burnin", CHECKS)
    assert selection_for(selection, "h100", "replace") == (
        ("dcgm-diag-3", "nccl-allreduce"), "h100:replace")
    assert selection_for(selection, "h100", "reboot") == (("gemm-burnin",), "h100:*")
    assert selection_for(selection, "gpu", "cool") == ((), "cool")  # none: resumed unchecked
    assert selection_for(selection, "gpu", "lend") == (("fleetwatch-check",), "*")
    assert selection_for(selection_parse("replace=dcgm-diag-1", CHECKS), "gpu", "reboot") == (
        (), "")


@pytest.mark.parametrize(("text", "says"), [
    ("replace=nvbandwidth", "no check nvbandwidth"),
    ("rebuild=fleetwatch-check", "no repair 'rebuild'"),
    ("replace", "is not [POOL:]REPAIR=CHECK+CHECK"),
    ("replace=", "is not [POOL:]REPAIR=CHECK+CHECK"),
])
def test_a_bad_selection_is_refused_naming_it(text: str, says: str) -> None:
    with pytest.raises(CatalogueError, match=says.replace("[", r"\[").replace("+", r"\+")):
        selection_parse(text, CHECKS)


def test_a_site_file_adds_checks_and_overrides_thresholds(tmp_path: Path) -> None:
    site = ("checks:\n  site-burnin: {command: /opt/site/burnin.sh, minutes: 45}\n"
            "thresholds:\n  H100: {nccl_busbw_gbps: 420}\n  GB200: {gemm_tflops: 2000}\n")
    catalogue = catalogue_from(yaml.safe_load(site))
    assert catalogue.checks["site-burnin"].minutes == 45 and "fleetwatch-check" in catalogue.checks
    assert catalogue.thresholds_for("NVIDIA H100 80GB HBM3") == (
        "H100", {"nccl_busbw_gbps": 420.0, "gemm_tflops": 550.0, "membw_gbps": 2400.0})
    # The longest key first: an H200 is not an H20.
    assert catalogue.thresholds_for("NVIDIA H200")[0] == "H200"
    assert catalogue.thresholds_for("Tesla T4") == ("", {})
    assert threshold_env({"gemm_tflops": 550.0}) == {"FLEETWATCH_MIN_GEMM_TFLOPS": "550"}
    with pytest.raises(CatalogueError, match="check 'x' needs a command"):
        catalogue_from({"checks": {"x": {"minutes": 3}}})
    assert Catalogue().checks == CHECKS == catalogue_from(None).checks


def test_settings_refuse_a_bad_gate_file_or_selection(tmp_path: Path) -> None:
    """As FleetWatch starts: a gate configuration that does not parse stops it, naming why."""
    (tmp_path / "gate.json").write_text(json.dumps({"checks": {"x": {"command": "true"}}}))
    probe = ("import django; django.setup(); from django.conf import settings as s; "
             "print(sorted(s.FLEETWATCH_GATE_CATALOGUE.checks)[-1], s.FLEETWATCH_GATE_CHECKS)")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "fleetwatch.settings",
           "FLEETWATCH_FLEET": "sim", "FLEETWATCH_GATE_FILE": str(tmp_path / "gate.json"),
           "FLEETWATCH_GATE_CHECKS": "*=fleetwatch-check,h100:lend=x"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "x" and "'h100': {'lend': ('x',)}" in done.stdout
    env["FLEETWATCH_GATE_CHECKS"] = "lend=nvbandwidth"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode != 0 and "no check nvbandwidth" in done.stderr


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


@pytest.mark.parametrize("answer", ["22.05-show-reservation.txt",
                                    "25.11/scontrol-show-reservation.json",
                                    "25.11/rest-v0.0.44-reservations.json"])
def test_real_reservation_answers_read_alike(answer: str) -> None:
    text = (FIXTURES / answer).read_text()
    found = (parse_reservations_text(text) if answer.endswith(".txt")
             else parse_reservations(json.loads(text))[0])
    mine, theirs = found
    assert (mine.name, mine.nodes, mine.users) == ("fleetwatch-gate-r7-1", ("gpu-002",), ("root",))
    assert {"MAINT", "IGNORE_JOBS"} <= set(mine.flags)
    assert (theirs.name, theirs.nodes) == ("site-maintenance", ("gpu-001",))
    assert len(theirs.users) == 2 and "MAINT" not in theirs.flags


@pytest.mark.parametrize(("gres", "count"), [
    ("gpu:8", 8), ("gpu:h100:8(S:0-1)", 8), ("gpu:a100:4,gpu:t4:2", 6),
    ("gpu:h100:4(S:0,1),nic:2", 4), ("nic:2", None), ("", None), (None, None)])
def test_a_nodes_gpus_come_from_its_gres(gres: str | None, count: int | None) -> None:
    assert gres_gpus(gres) == count


def test_fleetwatch_check_jobs_are_never_diagnosed() -> None:
    check = SlurmJob("42", "fleetwatch-check-r7-1-fleetwatch-check", "root", "FAILED")
    assert normalize.slurm_job_changes("RUNNING", check) == []
    theirs = SlurmJob("43", "train", "alice", "FAILED")
    assert normalize.slurm_job_changes("RUNNING", theirs)


# --- the playbook step ----------------------------------------------------------------------


def free_nodes(fleet: SimFleet) -> None:
    """Job 3003 ends: gpu-013 to gpu-016 run nothing (the seeded jobs fill every node)."""
    with fleet.transaction() as state:
        state["jobs"]["3003"].update(state="COMPLETED", nodes=[], gpus={})


def memory_fault(cluster: Any, capture: Any) -> Any:
    """A GPU memory fault on gpu-003: reset_gpu's playbook, quick on the simulated fleet."""
    from collectors.sim.faults import fault_inject

    fault_inject("xid", node="gpu-003", gpu=2, code=48)
    collectors.collect_source("telemetry")
    return open_incident(cluster, diag("gpu_memory"), capture)


def collect() -> None:
    collectors.collect_source("slurm")


def spare_of(rem: Any) -> str:
    return str(rem.steps.get(kind="replace_node").result["new_node"])


def test_a_replacement_that_fails_its_check_never_reaches_service_and_a_retry_checks_again(
        cluster: Any, sim_fleet: SimFleet, settings: Any, viewer: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    # Every spare fails its checks until a person has looked at it.
    with sim_fleet.transaction() as state:
        for name, node in state["nodes"].items():
            if node["pool"] == "spare":
                set_check_verdict(state, name, "fail")
    incident = open_incident(cluster, diag("gpu_hardware"), django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks,
                between=lambda: collectors.collect_source("slurm"))
    assert rem.status == "failed", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    spare = spare_of(rem)
    step = rem.steps.get(kind="prove_healthy")
    assert step.status == "failed" and rem.steps.get(kind="resume").status == "pending"
    assert f"acceptance check fleetwatch-check failed on {spare}" in step.error
    assert f"{spare} is drained (1 of 2 failed gates before RMA)" in step.error
    node = sim_fleet.snapshot()["nodes"][spare]
    assert node["drained"] and node["reason"].startswith(
        f"fleetwatch: acceptance check fleetwatch-check failed on {spare}")
    assert not node.get("reserved_by") and sim_fleet.snapshot()["reservations"] == {}
    job = sim_fleet.snapshot()["jobs"]["3001"]
    assert spare not in job["nodes"] and job["state"] == "PENDING"
    incident.refresh_from_db()
    assert incident.status == "needs_attention"
    # The record: the audit trail with the check's output, the node's page.
    entry = AuditEntry.objects.get(remediation=rem, verb="gate.failed")
    assert entry.target == spare and '"ok": false' in entry.data["results"][0]["output"]
    shown = node_detail(Node.objects.get(name=spare))["gates"]
    assert [(g.status, g.key) for g in shown] == [("failed", f"r{rem.pk}-1")]
    client = Client()
    client.force_login(viewer)
    page = client.get(f"/nodes/{spare}/").content.decode()
    section = page[page.index('data-testid="node-gates"'):]
    section = section[:section.index("</section>")]
    assert "failed: held" in section and "fleetwatch-check: failed" in section
    assert "simulated burn-in below the GPU model&#x27;s figures" in section  # its output

    # A person replaces the bad part and retries the step: the checks run again, afresh.
    with sim_fleet.transaction() as state:
        set_check_verdict(state, spare, "")
    transitions.remediation_retry(rem.pk, None, actor="olivia")
    rem = drive(rem, django_capture_on_commit_callbacks,
                between=lambda: collectors.collect_source("slurm"))
    assert rem.status == "succeeded", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    step = rem.steps.get(kind="prove_healthy")
    assert step.result["run"] == 2 and step.result["earlier"][0]["verdict"] == "failed"
    node = sim_fleet.snapshot()["nodes"][spare]
    assert not node["drained"] and not node.get("reserved_by")
    assert [g.status for g in GateRun.objects.filter(node=spare).order_by("pk")] == [
        "failed", "passed"]
    checks = [c for c in sim_fleet.snapshot()["check_jobs"].values()]
    assert [c["name"] for c in checks] == [f"fleetwatch-check-r{rem.pk}-1-fleetwatch-check",
                                           f"fleetwatch-check-r{rem.pk}-2-fleetwatch-check"]


def test_repeated_failed_gates_mark_the_node_for_rma(
        cluster: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_GATE_RMA_AFTER = 1
    with sim_fleet.transaction() as state:
        for name, node in state["nodes"].items():
            if node["pool"] == "spare":
                set_check_verdict(state, name, "fail")
    incident = open_incident(cluster, diag("gpu_hardware"), django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks, between=collect)
    spare = spare_of(rem)
    collect()
    assert "marked for RMA (1 failed gates this week)" in rem.steps.get(kind="prove_healthy").error
    assert Node.objects.get(name=spare).pool == "rma"
    assert AuditEntry.objects.filter(verb="node.rma", target=spare).exists()


def test_a_check_that_cannot_run_holds_the_node(
        cluster: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    with sim_fleet.transaction() as state:
        set_check_verdict(state, "gpu-003", "cannot_run")
    incident = memory_fault(cluster, django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks, between=collect)
    assert rem.status == "failed", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    error = rem.steps.get(kind="prove_healthy").error
    assert "acceptance check fleetwatch-check could not run on gpu-003" in error
    node = sim_fleet.snapshot()["nodes"]["gpu-003"]
    assert node["drained"] and "could not run" in node["reason"]
    assert GateRun.objects.get().repair == "reset"


def test_a_node_that_fails_its_checks_after_a_reset_goes_back_to_repair_as_a_replacement(
        cluster: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    with sim_fleet.transaction() as state:
        set_check_verdict(state, "gpu-003", "fail")
    incident = memory_fault(cluster, django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks, between=collect)
    assert rem.status == "failed" and rem.playbook == "reset_gpu"
    # A person starts the repair again: the reset did not hold, so this time it is replaced.
    with django_capture_on_commit_callbacks():
        again = transitions.remediation_open(incident, actor="user:olivia").remediation
    assert again.pk != rem.pk and again.playbook == "replace_node"
    created = AuditEntry.objects.get(remediation=again, verb="remediation.created")
    assert "gpu-003 failed its acceptance checks after a repair this week: replace" in (
        created.result)


def test_the_gate_step_follows_its_own_mode(
        cluster: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_STEP_MODES = {"return_to_service": "approve"}
    incident = memory_fault(cluster, django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks, between=collect)
    assert rem.status == "awaiting_approval"
    assert rem.steps.get(kind="prove_healthy").status == "awaiting_approval"
    assert sim_fleet.snapshot()["nodes"]["gpu-003"]["drained"]  # nothing resumed it


def test_no_check_configured_is_said_and_the_resume_step_puts_it_back(
        cluster: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_GATE_CHECKS = selection_parse("*=fleetwatch-check,gpu:reset=none",
                                                      CHECKS)
    incident = memory_fault(cluster, django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks, between=collect)
    assert rem.status == "succeeded", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    detail = rem.steps.get(kind="prove_healthy").detail
    assert "no acceptance check is configured for pool gpu after reset" in detail
    assert "(FLEETWATCH_GATE_CHECKS: gpu:reset)" in detail
    assert "slurm.reserve" not in [v for v, _ in calls(rem)]


def test_a_rebooted_node_is_held_until_its_checks_pass(
        cluster: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    """The sim's reboot, like Slurm's, puts the node back in service by itself: the reboot
    step holds it in a reservation first, and no job starts on it before the gate passes."""
    from collectors.sim.faults import fault_inject

    fault_inject("xid", node="gpu-005", gpu=1, code=74)
    incident = open_incident(cluster, diag("nvlink", ("gpu-005",), jobs=("3001",)),
                             django_capture_on_commit_callbacks)
    between_reboot_and_gate: list[tuple[Any, list[str]]] = []

    def watch() -> None:
        collectors.collect_source("slurm")
        done = set(incident.remediations.get().steps.filter(status="succeeded")
                   .values_list("kind", flat=True))
        if "reboot" in done and "prove_healthy" not in done:
            snap = sim_fleet.snapshot()
            users = [j["id"] for j in snap["jobs"].values()
                     if j["state"] == "RUNNING" and "gpu-005" in j["nodes"]]
            between_reboot_and_gate.append((snap["nodes"]["gpu-005"].get("reserved_by"), users))

    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks, between=watch)
    assert rem.status == "succeeded", [(s.kind, s.status, s.detail) for s in rem.steps.all()]
    assert between_reboot_and_gate and all(
        held == f"fleetwatch-gate-r{rem.pk}-hold" and not users
        for held, users in between_reboot_and_gate), between_reboot_and_gate
    made = [v for v, _ in calls(rem)]
    assert made.index("slurm.reserve") < made.index("provider.reboot")
    # The gate adopted the hold (no second reservation) and released it once passed.
    assert made.count("slurm.reserve") == 1 and made.count("slurm.unreserve") == 1
    assert sim_fleet.snapshot()["reservations"] == {}
    assert GateRun.objects.get().state["adopted"] is True


# --- a worker dying mid-gate ------------------------------------------------------------------


def test_a_gate_cut_off_after_its_submit_makes_no_second_reservation_nor_job(
        sim_fleet: SimFleet, settings: Any, monkeypatch: Any) -> None:
    free_nodes(sim_fleet)
    with sim_fleet.transaction() as state:
        state["nodes"]["gpu-013"].update(drained=True, reason="fleetwatch: repaired")
    slurm = SimSlurm(sim_fleet)
    plan = gate.GatePlan(key="crash", node="gpu-013", repair="reboot", start_seconds=60,
                         checks=(gate.PlannedCheck("fleetwatch-check", "true", 5),))
    done: set[str] = set()

    def call(verb: str, target: str, fn: Any, *args: Any) -> ActionResult:
        if f"{verb} {target}" in done:
            return ActionResult("(done before a restart)", False)
        result: ActionResult = fn(*args)
        done.add(f"{verb} {target}")
        return result

    real = SimSlurm.submit_check

    def submit_then_die(self: SimSlurm, spec: Any) -> ActionResult:
        real(self, spec)
        raise KeyboardInterrupt("the worker is killed before the call returns")

    monkeypatch.setattr(SimSlurm, "submit_check", submit_then_die)
    with pytest.raises(KeyboardInterrupt):
        gate.gate_poll(slurm, plan, {}, call, time.time())
    monkeypatch.setattr(SimSlurm, "submit_check", real)
    state: dict[str, Any] = {}  # its state was never saved: the next run starts from nothing
    for _ in range(200):
        progress = gate.gate_poll(slurm, plan, state, call, time.time())
        if progress.final:
            break
        time.sleep(0.05)
    assert progress.status == gate.PASSED, progress
    snap = sim_fleet.snapshot()
    assert [c["name"] for c in snap["check_jobs"].values()] == [
        "fleetwatch-check-crash-fleetwatch-check"]
    assert snap["reservations"] == {} and not snap["nodes"]["gpu-013"]["drained"]


def test_a_node_found_in_service_is_drained_then_held_then_checked(sim_fleet: SimFleet) -> None:
    free_nodes(sim_fleet)  # gpu-016 idle and in service: a lent node given back, say
    slurm = SimSlurm(sim_fleet)
    plan = gate.GatePlan(key="idle", node="gpu-016", repair="lend", start_seconds=60,
                         checks=(gate.PlannedCheck("fleetwatch-check", "true", 5),))
    made: list[str] = []

    def call(verb: str, target: str, fn: Any, *args: Any) -> ActionResult:
        made.append(verb)
        result: ActionResult = fn(*args)
        return result

    state: dict[str, Any] = {}
    for _ in range(200):
        progress = gate.gate_poll(slurm, plan, state, call, time.time())
        if progress.final:
            break
        time.sleep(0.05)
    assert progress.status == gate.PASSED, progress
    assert made == ["slurm.drain", "slurm.reserve", "slurm.resume", "slurm.submit_check",
                    "slurm.unreserve"]
    assert not sim_fleet.snapshot()["nodes"]["gpu-016"]["drained"]


# --- the gate outside a playbook --------------------------------------------------------------


def advance_until_final(gate_id: int, capture: Any) -> dict[str, Any]:
    for _ in range(300):
        with capture():
            gates.gate_advance(gate_id)
        found = gate_status(gate_id)
        if found["final"]:
            return found
        time.sleep(0.02)
    raise AssertionError(gate_status(gate_id))


def test_node_gate_start_gates_a_lent_node_back_into_service(
        cluster: Any, sim_fleet: SimFleet, django_capture_on_commit_callbacks: Any) -> None:
    free_nodes(sim_fleet)
    with sim_fleet.transaction() as state:
        state["nodes"]["gpu-014"].update(drained=True, reason="fleetwatch: lent to kubernetes")
    with django_capture_on_commit_callbacks() as queued:
        gate_id = gates.node_gate_start("gpu-014", "back from Kubernetes", repair=Repair.LEND,
                                        requested_by="lending")
    assert [getattr(c, "task", "") for c in queued] == ["incidents.tasks.gate_advance"]
    assert gates.node_gate_start("gpu-014", "asked twice", repair=Repair.LEND) == gate_id
    found = advance_until_final(gate_id, django_capture_on_commit_callbacks)
    assert (found["status"], found["in_service"], found["repair"]) == ("passed", True, "lend")
    assert found["results"][0]["verdict"] == "passed"
    node = sim_fleet.snapshot()["nodes"]["gpu-014"]
    assert not node["drained"] and not node.get("reserved_by")
    verbs = list(AuditEntry.objects.filter(data__gate=found["key"]).order_by("id")
                 .values_list("verb", flat=True))
    assert verbs == ["gate.requested", "slurm.reserve", "slurm.resume", "slurm.submit_check",
                     "slurm.unreserve", "gate.passed"]


def test_a_gate_outside_a_playbook_follows_the_modes(
        cluster: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_STEP_MODES = {"return_to_service": "observe"}
    observed = gate_status(gates.node_gate_start("gpu-014", "back", repair=Repair.LEND))
    assert observed["status"] == "observed" and "would run fleetwatch-check" in observed["detail"]
    settings.FLEETWATCH_STEP_MODES = {"return_to_service": "approve"}
    free_nodes(sim_fleet)
    with sim_fleet.transaction() as state:
        state["nodes"]["gpu-015"].update(drained=True, reason="fleetwatch: lent")
    gate_id = gates.node_gate_start("gpu-015", "back", repair=Repair.LEND)
    assert gate_status(gate_id)["status"] == "awaiting_approval"
    assert gates.gate_advance(gate_id) == "not running, or another worker has it"
    gates.gate_approve(gate_id, "olivia")
    assert advance_until_final(gate_id, django_capture_on_commit_callbacks)["status"] == "passed"


def test_slurm_down_holds_the_node_and_says_why(
        cluster: Any, sim_fleet: SimFleet, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_GATE_START_MINUTES = 0.005  # 0.3 s
    free_nodes(sim_fleet)
    with sim_fleet.transaction() as state:
        state["nodes"]["gpu-014"].update(drained=True, reason="fleetwatch: repaired")
    source_outage_set("slurm", down=True)
    gate_id = gates.node_gate_start("gpu-014", "after a repair")
    with django_capture_on_commit_callbacks():
        gates.gate_advance(gate_id)
    first = gate_status(gate_id)
    assert first["status"] == "running" and "Slurm did not answer" in first["detail"]
    time.sleep(0.4)
    found = advance_until_final(gate_id, django_capture_on_commit_callbacks)
    assert found["status"] == "cannot_run" and not found["in_service"]
    assert "Slurm did not answer for" in found["detail"] and "stays drained" in found["detail"]
    source_outage_set("slurm", down=False)
    assert sim_fleet.snapshot()["nodes"]["gpu-014"]["drained"]  # never resumed unchecked


def test_the_clients_refuse_reservations_that_are_not_fleetwatchs(sim_fleet: SimFleet) -> None:
    slurm = get_clients().slurm
    with pytest.raises(ClientError, match="not FleetWatch's"):
        slurm.unreserve("maintenance-2026")
    assert slurm.unreserve("fleetwatch-gate-gone").changed is False


def test_a_gate_reads_its_nodes_gpu_model_once_not_at_every_poll(
        cluster: Any, sim_fleet: SimFleet, monkeypatch: pytest.MonkeyPatch,
        django_capture_on_commit_callbacks: Any) -> None:
    """Finding the model reads every GPU's metrics (the whole fleet's, from Prometheus): the
    gate's plan is made at every poll, the model found once."""
    import dataclasses

    from collectors.sim.fleet import SimTelemetry

    reads: list[int] = []
    polls: list[int] = []
    original, advance = SimTelemetry.gpu_metrics, gates.gate_advance

    def counted(self: SimTelemetry, nodes: Any = None) -> Any:
        reads.append(nodes)
        return [dataclasses.replace(m, model="NVIDIA H100 80GB HBM3")
                for m in original(self, nodes)]

    def advance_counted(gate_id: int) -> str:
        polls.append(1)
        return advance(gate_id)

    free_nodes(sim_fleet)
    with sim_fleet.transaction() as state:
        state["nodes"]["gpu-014"].update(drained=True, reason="fleetwatch: repaired")
    monkeypatch.setattr(SimTelemetry, "gpu_metrics", counted)
    monkeypatch.setattr(gates, "gate_advance", advance_counted)
    gate_id = gates.node_gate_start("gpu-014", "after a repair")
    found = advance_until_final(gate_id, django_capture_on_commit_callbacks)
    assert found["status"] == "passed"
    assert GateRun.objects.get(pk=gate_id).state["gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert len(polls) > 2 and reads == [["gpu-014"]]  # once, and its node alone
