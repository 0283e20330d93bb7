"""Every client implements the whole of its protocol, and no caller asks a client whether it
has a method: the protocols in ``collectors.clients.base`` (and ``Notifier``) declare every
capability, so a missing or misnamed method is a failure here, not an AttributeError (or a
silently skipped feature) in production."""

from __future__ import annotations

import ast
import inspect
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from collectors.clients import notify, providers
from collectors.clients.base import (
    KubernetesClient,
    NodeProvider,
    NoProvider,
    SlurmClient,
    TelemetryClient,
)
from collectors.clients.kubernetes import KubernetesApi
from collectors.clients.notify import Notifier
from collectors.clients.prometheus import PrometheusTelemetry
from collectors.clients.slurm import SlurmCli
from collectors.clients.slurmrest import SlurmRest
from collectors.clock import SYSTEM_CLOCK, Clock, ManualClock, SystemClock
from collectors.sim.fleet import SimFleet, SimKubernetes, SimProvider, SimSlurm, SimTelemetry

ROOT = Path(__file__).resolve().parents[2]


def _notifiers() -> list[type]:
    """Every notifier class the notify module defines (whatever channels it has today)."""
    return [c for _, c in inspect.getmembers(notify, inspect.isclass)
            if c.__module__ == notify.__name__ and callable(getattr(c, "notify", None))
            and not getattr(c, "_is_protocol", False)]


IMPLEMENTATIONS: list[tuple[type, list[type]]] = [
    (SlurmClient, [SlurmCli, SlurmRest, SimSlurm]),
    (KubernetesClient, [KubernetesApi, SimKubernetes]),
    (TelemetryClient, [PrometheusTelemetry, SimTelemetry]),
    (NodeProvider, [NoProvider, SimProvider, providers.SlurmRebootProvider,
                    providers.KubernetesPoolProvider, providers.CommandProvider,
                    providers.CompositeProvider]),
    (Notifier, _notifiers()),
    (Clock, [SystemClock, ManualClock]),
]


def _members(protocol: type) -> dict[str, Any]:
    """The protocol's declared members: its methods and properties (not Protocol plumbing)."""
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (inspect.isfunction(value)
                                             or isinstance(value, property))}


def _has_attribute(cls: type, name: str) -> bool:
    """A property, a class attribute, or an instance attribute the class annotates."""
    return any(name in vars(k) or name in getattr(k, "__annotations__", {})
               for k in cls.__mro__)


def _parameters(function: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())[1:]  # without self


CASES = [(protocol, cls) for protocol, classes in IMPLEMENTATIONS for cls in classes]


@pytest.mark.parametrize(("protocol", "cls"), CASES,
                         ids=[f"{p.__name__}-{c.__name__}" for p, c in CASES])
def test_an_implementation_has_every_member_of_its_protocol(protocol: type, cls: type) -> None:
    members = _members(protocol)
    assert members, f"{protocol.__name__} declares nothing"
    for name, declared in members.items():
        if isinstance(declared, property):
            assert _has_attribute(cls, name), f"{cls.__name__} lacks {protocol.__name__}.{name}"
            continue
        implemented = inspect.getattr_static(cls, name, None)
        assert implemented is not None, f"{cls.__name__} lacks {protocol.__name__}.{name}()"
        assert callable(getattr(cls, name)), f"{cls.__name__}.{name} is not callable"
        wanted, given = _parameters(declared), _parameters(getattr(cls, name))
        assert [p.name for p in given[:len(wanted)]] == [p.name for p in wanted], (
            f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} does not take "
            f"{protocol.__name__}.{name}{inspect.signature(declared)}'s parameters")
        for want, give in zip(wanted, given, strict=False):
            assert give.kind == want.kind, f"{cls.__name__}.{name}: {give.name} is {give.kind}"
            if want.default is not inspect.Parameter.empty:
                assert give.default is not inspect.Parameter.empty, (
                    f"{cls.__name__}.{name}: {give.name} needs a default, as declared")
        for extra in given[len(wanted):]:  # more than declared: only optional extras
            assert extra.default is not inspect.Parameter.empty or extra.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), (
                f"{cls.__name__}.{name} requires {extra.name}, which callers never pass")


def test_every_notifier_is_checked() -> None:
    # The discovery above must find the channels: an empty list would check nothing.
    assert len(_notifiers()) >= 3


def _protocol_member_names() -> set[str]:
    return {name for protocol, _ in IMPLEMENTATIONS if protocol is not Clock
            for name in _members(protocol)}


def test_no_caller_probes_a_client_for_a_capability() -> None:
    """``getattr(x, "<protocol member>", ...)`` / ``hasattr(x, "<protocol member>")`` in
    production code: a capability asked about instead of declared."""
    names = _protocol_member_names()
    probes = []
    for package in ("collectors", "incidents", "fleetwatch", "deploy"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant)
                        and node.args[1].value in names):
                    probes.append(f"{path.relative_to(ROOT)}:{node.lineno} "
                                  f"{node.func.id}(..., {node.args[1].value!r})")
    assert probes == [], "\n".join(probes)


def test_the_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(start=1000.0)
    assert (clock.now(), clock.monotonic()) == (1000.0, 0.0)
    clock.sleep(5)
    clock.advance(2.5)
    assert (clock.now(), clock.monotonic()) == (1007.5, 7.5)
    with pytest.raises(ValueError, match="does not go back"):
        clock.advance(-1)
    assert abs(SYSTEM_CLOCK.now() - ManualClock().now()) < 60


def test_the_simulation_offers_every_capability(tmp_path: Path) -> None:
    clock = ManualClock()
    fleet = SimFleet(tmp_path / "fleet.json", speed=200.0, clock=clock)
    fleet.seed()
    slurm, k8s, telemetry = SimSlurm(fleet), SimKubernetes(fleet), SimTelemetry(fleet)
    # DOWN: the simulated scheduler drains, and its result names the drain.
    down = slurm.down("gpu-001", "fleetwatch: test")
    assert down.changed and "state=DRAIN" in down.call and "drains for DOWN" in down.detail
    assert "DRAIN" in next(n for n in slurm.nodes() if n.name == "gpu-001").flags
    assert not slurm.down("gpu-001", "fleetwatch: test").changed
    # Requeue held: the ended job waits, pending, and the scheduler leaves it there (a plain
    # requeue would run it again at once on its freed nodes).
    slurm.cancel("3002", "TERM", 10)
    clock.advance(1)
    held = slurm.requeue_hold("3002")
    assert held.changed and held.call == "scontrol requeuehold 3002"
    clock.advance(5)
    job = next(j for j in slurm.jobs() if j.job_id == "3002")
    assert (job.state, job.state_reason, job.restart_count) == ("PENDING", "JobHeldUser", 1)
    assert not slurm.requeue_hold("3002").changed
    # Slurm's own reboot, as the provider asks for it.
    reboot = slurm.reboot("gpu-001", "incident 1 test")
    assert reboot.changed and reboot.call.startswith("scontrol reboot ASAP nextstate=RESUME")
    assert "already" in SimProvider(fleet).reboot("gpu-001", "incident 1 test").detail
    # No change feeds, no history, nothing unparsed.
    assert k8s.node_changes(None, 1) is None and k8s.event_changes(None, 1) is None
    assert telemetry.changes(None) is None
    now = datetime.now(UTC)
    assert telemetry.gpu_history(["gpu-001"], now - timedelta(minutes=5), now) == {}
    assert slurm.last_warnings == k8s.last_warnings == telemetry.last_warnings == []
