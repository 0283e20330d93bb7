"""Services over the simulated fleet: seeding it and injecting faults (demo and tests)."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from collectors.clients import sim_fleet
from collectors.sim import fleet as simulator


def _fleet() -> simulator.SimFleet:
    if settings.FLEETWATCH_FLEET != "sim":
        raise ImproperlyConfigured("fault injection only works on the simulated fleet")
    return sim_fleet()


def fleet_seed(*, reset: bool = False, nodes: int = 16, spares: int = 3) -> bool:
    return _fleet().seed(nodes=nodes, spares=spares, reset=reset)


def fault_inject(kind: str, *, node: str = "", gpu: int = 0, code: int = 79, count: int = 1,
                 switch: str = "") -> str:
    """Inject a fault; returns a one-line description. Raises ClientError on a bad target."""
    fleet = _fleet()
    with fleet.transaction() as state:
        now = fleet.clock.now()
        if kind == "xid":
            return simulator.inject_xid(state, node, gpu, code, now)
        if kind == "link-flap":
            return simulator.inject_link_flap(state, node, count, now, fleet.speed)
        if kind == "switch-down":
            return simulator.inject_switch_down(state, switch, now, fleet.speed)
        raise ValueError(f"unknown fault {kind!r}")


def pod_label_set(node: str, *, no_auto_replace: bool) -> str:
    with _fleet().transaction() as state:
        return simulator.set_no_auto_replace(state, node, no_auto_replace)


def source_outage_set(source: str, *, down: bool) -> str:
    with _fleet().transaction() as state:
        return simulator.set_source_down(state, source, down)


def fleet_snapshot() -> simulator.State:
    return _fleet().snapshot()
