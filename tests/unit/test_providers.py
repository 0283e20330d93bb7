"""Node providers without a cluster: the command provider against small real programs, the
composite's routing, the simulated provider's reboot/reset/status, and provider_from_settings.

Slurm's reboot and the Kubernetes node pool are tested against the real Slurm test cluster and
the Kubernetes test server in tests/integration/test_providers.py."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from collectors.clients import get_clients, provider_from_settings
from collectors.clients.base import (
    ActionResult,
    ClientError,
    NoProvider,
    NotFound,
    ProviderStatus,
    Replacement,
)
from collectors.clients.providers import (
    CommandError,
    CommandProvider,
    CompositeProvider,
    ProviderReplacement,
    SlurmRebootProvider,
)
from collectors.clock import ManualClock
from collectors.sim.fleet import (
    REBOOT_SECONDS,
    SimFleet,
    SimKubernetes,
    SimProvider,
    SimSlurm,
    SimTelemetry,
    inject_xid,
)
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "deploy" / "providers" / "example-provider.sh"


def script(tmp_path: Path, body: str, name: str = "provider") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


# --- CommandProvider ---------------------------------------------------------------------------


def test_replace_parses_json_and_records_the_exact_argv(tmp_path: Path) -> None:
    program = script(tmp_path, 'echo "starting $1 of $2" >&2\n'
                               'echo \'{"new_node": "gpu-017", "ready": false, '
                               '"detail": "provisioning"}\'\n', "site provider")
    provider = CommandProvider(f"{shlex.quote(program)} --zone 'us east'", timeout=10)
    result = provider.replace("gpu-003")
    assert isinstance(result, ProviderReplacement)
    assert (result.old_node, result.new_node, result.ready, result.detail) == (
        "gpu-003", "gpu-017", False, "provisioning")
    assert result.call == shlex.join([program, "--zone", "us east", "replace", "gpu-003"])
    assert result.data["exit_status"] == 0
    assert result.data["stderr"] == "starting --zone of us east\n"  # the arguments, unsplit
    assert json.loads(str(result.data["stdout"]))["new_node"] == "gpu-017"
    assert result.data["argv"] == [program, "--zone", "us east", "replace", "gpu-003"]


def test_actions_and_their_arguments(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    program = script(tmp_path, f'printf "%s|" "$@" >> {log}; echo >> {log}\n'
                               'case $1 in\n'
                               '  status) echo \'{"state": "rebooting", "detail": "BMC cycle"}\' ;;\n'
                               '  replacement-status) echo null ;;\n'
                               '  reboot) echo "power cycle requested" ;;\n'
                               '  reset-gpu) echo \'{"changed": false, "detail": "no fault"}\' ;;\n'
                               'esac\n')
    provider = CommandProvider(program, timeout=10)
    reboot = provider.reboot("gpu-001", "incident 4 nvlink")
    assert reboot.changed and reboot.detail == "power cycle requested"
    assert reboot.call == shlex.join([program, "reboot", "gpu-001", "fleetwatch: incident 4 nvlink"])
    reset = provider.reset_gpu("gpu-001", 3)
    assert not reset.changed and reset.detail == "no fault"
    assert provider.reset_gpu("gpu-001", None).call.endswith("reset-gpu gpu-001 all")
    assert provider.status("gpu-001") == ProviderStatus("gpu-001", "rebooting", "BMC cycle")
    assert provider.replacement_status("gpu-001") is None
    assert log.read_text().splitlines() == [
        "reboot|gpu-001|fleetwatch: incident 4 nvlink|", "reset-gpu|gpu-001|3|",
        "reset-gpu|gpu-001|all|", "status|gpu-001|", "replacement-status|gpu-001|"]


def test_exit_status_2_is_permanent_and_others_transient(tmp_path: Path) -> None:
    permanent = CommandProvider(script(tmp_path, 'echo "no such node: $2" >&2\nexit 2\n', "p2"))
    with pytest.raises(CommandError) as err:
        permanent.reboot("gpu-999", "fleetwatch: x")
    assert err.value.permanent
    assert "exit status 2: no such node: gpu-999" in str(err.value)
    assert err.value.data["exit_status"] == 2
    assert err.value.call.endswith("reboot gpu-999 'fleetwatch: x'")

    transient = CommandProvider(script(tmp_path, 'echo "API rate limited" >&2\nexit 1\n', "p1"))
    with pytest.raises(ClientError) as err:
        transient.replace("gpu-003")
    assert not err.value.permanent
    assert "rate limited" in str(err.value)


def test_a_run_past_the_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "survived"
    # The child sleeps holding the output pipes: killing only the shell would hang the read.
    pid_file = tmp_path / "child.pid"
    program = script(tmp_path, f'(sh -c \'echo $PPID\' > {pid_file}; sleep 3; touch {marker}) &\n'
                     'sleep 3\necho never\n')
    provider = CommandProvider(program, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(CommandError) as err:
        provider.status("gpu-001")
    assert time.monotonic() - started < 2.5
    assert not err.value.permanent
    assert "timed out after 0.5s" in str(err.value)
    assert err.value.data["exit_status"] is None
    # The child would touch the marker 3 s in: wait until it is gone (killed), then look.
    wait_for(lambda: _gone(int(pid_file.read_text())), 5, "the provider's child to be killed",
             interval=0.05)
    assert not marker.exists()


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (killed, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_bad_output_and_missing_program_are_permanent(tmp_path: Path) -> None:
    chatty = CommandProvider(script(tmp_path, "echo 'all good!'\n"))
    with pytest.raises(CommandError, match="printed no JSON") as err:
        chatty.status("gpu-001")
    assert err.value.permanent
    odd = CommandProvider(script(tmp_path, "echo '{\"state\": \"melting\"}'\n", "odd"))
    assert odd.status("gpu-001").state == "unknown"
    with pytest.raises(ClientError, match="could not be started") as err:
        CommandProvider(str(tmp_path / "nowhere")).status("gpu-001")
    assert err.value.permanent
    with pytest.raises(ValueError, match="needs a command"):
        CommandProvider("   ")


def test_the_example_site_script_speaks_the_protocol(tmp_path: Path) -> None:
    provider = CommandProvider(f"{EXAMPLE} --zone test-zone", timeout=10,
                               env={"EXAMPLE_PROVIDER_STATE": str(tmp_path),
                                    "EXAMPLE_PROVIDER_SECONDS": "0"})
    assert provider.replacement_status("gpu-003") is None
    first = provider.replace("gpu-003")
    assert first.new_node == "gpu-003-r" and first.ready
    assert provider.replace("gpu-003").new_node == "gpu-003-r"  # idempotent
    assert provider.status("gpu-003").state == "replaced"
    assert provider.reboot("gpu-001", "fleetwatch: t").changed
    assert not provider.reboot("gpu-001", "fleetwatch: t").changed
    assert provider.status("gpu-001").state == "rebooting"
    with pytest.raises(ClientError) as err:
        provider.run("explode", "gpu-001")
    assert err.value.permanent


# --- CompositeProvider -------------------------------------------------------------------------


class Recorder:
    """A provider that records what it was asked (the composite's routing is all we test)."""

    def __init__(self, name: str, state: str = "ready") -> None:
        self.name, self.state = name, state
        self.calls: list[tuple[Any, ...]] = []

    def replace(self, node: str) -> Replacement:
        self.calls.append(("replace", node))
        return Replacement(node, f"{self.name}-new", False)

    def replacement_status(self, node: str, data: Any = None) -> Replacement | None:
        self.calls.append(("replacement_status", node, data))
        return None

    def reboot(self, node: str, reason: str) -> ActionResult:
        self.calls.append(("reboot", node))
        return ActionResult(f"{self.name} reboot {node}", True)

    def reset_gpu(self, node: str, gpu: int | None) -> ActionResult:
        self.calls.append(("reset_gpu", node, gpu))
        return ActionResult(f"{self.name} reset {node}", True)

    def status(self, node: str) -> ProviderStatus:
        if self.state == "error":
            raise ClientError(f"{self.name} does not know {node}", permanent=True)
        return ProviderStatus(node, self.state, self.name)


def test_composite_routes_each_action_to_its_provider() -> None:
    pool, slurm = Recorder("pool"), Recorder("slurm", "rebooting")
    composite = CompositeProvider(replace=pool, reboot=slurm)
    assert composite.replace("gpu-003").new_node == "pool-new"
    assert composite.reboot("gpu-001", "fleetwatch: x").call == "slurm reboot gpu-001"
    composite.replacement_status("gpu-003", {"pool": "gpu"})
    assert pool.calls == [("replace", "gpu-003"), ("replacement_status", "gpu-003", {"pool": "gpu"})]
    assert slurm.calls == [("reboot", "gpu-001")]
    with pytest.raises(ClientError, match="no node provider is configured to reset") as err:
        composite.reset_gpu("gpu-001", 2)
    assert err.value.permanent
    # What is under way wins: Slurm's reboot over the pool's "ready".
    assert composite.status("gpu-001") == ProviderStatus("gpu-001", "rebooting", "slurm")
    # A provider that does not know the node (a deleted one, to Slurm) is skipped.
    gone = CompositeProvider(replace=Recorder("pool", "replaced"), reboot=Recorder("s", "error"))
    assert gone.status("gpu-003").state == "replaced"
    with pytest.raises(ClientError, match="does not know"):
        CompositeProvider(reboot=Recorder("s", "error")).status("gpu-003")
    # Providers whose replacement_status takes no data (the simulation, NoProvider) still work.
    assert CompositeProvider(replace=NoProvider()).replacement_status("gpu-3", {"x": 1}) is None


def test_slurm_reboot_provider_refuses_what_slurm_cannot_do() -> None:
    provider = SlurmRebootProvider(UnusedSlurm())
    with pytest.raises(ClientError, match="nvidia-smi --gpu-reset") as err:
        provider.reset_gpu("gpu-001", 0)
    assert err.value.permanent
    with pytest.raises(ClientError, match="cannot bring new hardware") as err:
        provider.replace("gpu-001")
    assert err.value.permanent
    assert provider.replacement_status("gpu-001") is None


class UnusedSlurm:
    """Refusals never ask Slurm; a node lookup finds nothing."""

    def node(self, name: str) -> Any:
        raise NotFound(f"Invalid node name specified: {name}", permanent=True)

    def reboot(self, node: str, reason: str) -> ActionResult:
        raise AssertionError("not called")


# --- the simulated provider --------------------------------------------------------------------


SPEED = 200.0  # a reboot takes REBOOT_SECONDS / SPEED = 0.45 s


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()  # the fleet's time moves only when a test advances it


@pytest.fixture
def fleet(tmp_path: Path, clock: ManualClock) -> SimFleet:
    f = SimFleet(tmp_path / "fleet.json", speed=SPEED, clock=clock)
    f.seed()
    return f


def gpu(fleet: SimFleet, node: str, index: int) -> dict[str, Any]:
    return fleet.snapshot()["nodes"][node]["gpus"][index]


def test_sim_reboot_clears_transient_faults_but_not_a_fallen_off_gpu(fleet: SimFleet,
                                                                     clock: ManualClock) -> None:
    provider, slurm = SimProvider(fleet), SimSlurm(fleet)
    now = clock.now()
    with fleet.transaction() as state:
        inject_xid(state, "gpu-002", 1, 48, now)  # double-bit ECC: a reboot clears it
        inject_xid(state, "gpu-002", 4, 74, now)  # NVLink
        inject_xid(state, "gpu-003", 5, 79, now)  # fallen off the bus: dead hardware
    slurm.cancel("3001", "TERM", 1)  # both nodes run job 3001; it must end first (ASAP)
    clock.advance(0.05)

    first = provider.reboot("gpu-002", "incident 9 gpu_memory")
    assert first.changed
    assert first.call == ("scontrol reboot ASAP nextstate=RESUME "
                          "'reason=fleetwatch: incident 9 gpu_memory' gpu-002")
    again = provider.reboot("gpu-002", "incident 9 gpu_memory")
    assert not again.changed and "already" in again.detail
    assert provider.status("gpu-002").state == "rebooting"
    node = next(n for n in slurm.nodes() if n.name == "gpu-002")
    assert "DRAIN" in node.flags and "REBOOT_ISSUED" in node.flags
    assert node.reason == "fleetwatch: incident 9 gpu_memory"
    assert not next(n for n in SimKubernetes(fleet).nodes() if n.name == "gpu-002").ready
    assert provider.reboot("gpu-003", "incident 10 gpu_hardware").changed

    clock.advance(REBOOT_SECONDS / SPEED + 0.1)
    assert gpu(fleet, "gpu-002", 1)["last_xid"] == 0 and gpu(fleet, "gpu-002", 4)["last_xid"] == 0
    assert provider.status("gpu-002").state == "ready"
    node = next(n for n in slurm.nodes() if n.name == "gpu-002")
    assert node.flags == () and node.reason == ""  # nextstate=RESUME
    assert next(n for n in SimKubernetes(fleet).nodes() if n.name == "gpu-002").ready
    # The fallen-off GPU is still gone, and the node stays out of service.
    metrics = {(m.node, m.gpu): m for m in SimTelemetry(fleet).gpu_metrics()}
    assert metrics[("gpu-003", 5)].last_xid == 79 and metrics[("gpu-003", 5)].utilization is None
    status = provider.status("gpu-003")
    assert status.state == "failed" and "GPU 5" in status.detail
    node = next(n for n in slurm.nodes() if n.name == "gpu-003")
    assert node.flags == ("DRAIN",) and "still off the bus" in node.reason


def test_sim_reboot_asap_waits_for_the_jobs_on_the_node(fleet: SimFleet, clock: ManualClock) -> None:
    provider = SimProvider(fleet)
    result = provider.reboot("gpu-010", "incident 3 nvlink")
    assert result.changed and "waiting for its jobs" in result.detail
    node = next(n for n in SimSlurm(fleet).nodes() if n.name == "gpu-010")
    assert "REBOOT_REQUESTED" in node.flags and "DRAIN" in node.flags
    assert "waiting for jobs" in provider.status("gpu-010").detail
    clock.advance(REBOOT_SECONDS / SPEED + 0.1)
    assert provider.status("gpu-010").state == "rebooting"  # the job still runs there


def test_sim_reboot_respects_an_administrators_drain(fleet: SimFleet) -> None:
    SimSlurm(fleet).drain("gpu-004", "admin: firmware update")
    with pytest.raises(ClientError, match="drained by someone else") as err:
        SimProvider(fleet).reboot("gpu-004", "incident 5 nvlink")
    assert err.value.permanent


def test_sim_gpu_reset(fleet: SimFleet, clock: ManualClock) -> None:
    provider = SimProvider(fleet)
    now = clock.now()
    with fleet.transaction() as state:
        inject_xid(state, "gpu-006", 2, 119, now)  # GSP timeout: a reset recovers it
        inject_xid(state, "gpu-006", 3, 79, now)
    with pytest.raises(ClientError, match="job") as err:
        provider.reset_gpu("gpu-006", 2)  # job 3001 still holds the GPUs
    assert not err.value.permanent
    SimSlurm(fleet).cancel("3001", "TERM", 1)
    clock.advance(0.05)
    reset = provider.reset_gpu("gpu-006", 2)
    assert reset.changed and reset.call == "nvidia-smi --gpu-reset -i 2  # on gpu-006"
    assert reset.data == {"cleared_xids": {"2": 119}}
    assert gpu(fleet, "gpu-006", 2)["last_xid"] == 0
    assert not provider.reset_gpu("gpu-006", 2).changed
    with pytest.raises(ClientError, match="GPU has fallen off the bus: reset cannot reach it") as err:
        provider.reset_gpu("gpu-006", 3)
    assert err.value.permanent
    with pytest.raises(ClientError, match="fallen off"):
        provider.reset_gpu("gpu-006", None)  # every GPU, the dead one included
    with pytest.raises(ClientError, match="has no GPU 8"):
        provider.reset_gpu("gpu-006", 8)


def test_sim_status_through_a_replacement(fleet: SimFleet) -> None:
    provider = SimProvider(fleet)
    assert provider.status("gpu-001") == ProviderStatus("gpu-001", "ready", "up")
    assert provider.status("gpu-018").detail == "spare capacity, not in service"
    provider.replace("gpu-001")
    assert provider.status("gpu-017").state == "provisioning"
    assert provider.status("gpu-001") == ProviderStatus("gpu-001", "replaced", "replaced by gpu-017")
    with pytest.raises(ClientError, match="unknown node"):
        provider.status("gpu-999")


def test_a_fleet_seeded_before_reboots_existed_still_loads(fleet: SimFleet) -> None:
    with fleet.transaction() as state:
        for node in state["nodes"].values():
            node.pop("reboot", None)
    assert SimProvider(fleet).status("gpu-001").state == "ready"
    assert len(SimSlurm(fleet).nodes()) == 16


# --- provider_from_settings --------------------------------------------------------------------


def test_provider_from_settings(settings: Any, tmp_path: Path) -> None:
    settings.FLEETWATCH_PROVIDER = "none"
    assert isinstance(provider_from_settings(), NoProvider)
    settings.FLEETWATCH_PROVIDER = "command"
    settings.FLEETWATCH_PROVIDER_COMMAND = ""
    with pytest.raises(ImproperlyConfigured, match="FLEETWATCH_PROVIDER_COMMAND"):
        provider_from_settings()
    settings.FLEETWATCH_PROVIDER_COMMAND = f"{EXAMPLE} --zone z"
    settings.FLEETWATCH_PROVIDER_TIMEOUT = 7.0
    provider = provider_from_settings()
    assert isinstance(provider, CommandProvider)
    assert provider.argv == [str(EXAMPLE), "--zone", "z"] and provider.timeout == 7.0


def test_a_simulated_fleet_can_use_the_command_provider(settings: Any, sim_fleet: SimFleet,
                                                        tmp_path: Path) -> None:
    settings.FLEETWATCH_FLEET = "sim"
    settings.FLEETWATCH_PROVIDER = "sim"
    assert isinstance(get_clients().provider, SimProvider)
    settings.FLEETWATCH_PROVIDER = "command"
    settings.FLEETWATCH_PROVIDER_COMMAND = str(EXAMPLE)
    clients = get_clients()
    assert isinstance(clients.provider, CommandProvider)
    assert isinstance(clients.slurm, SimSlurm)
