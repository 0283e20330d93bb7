"""Services over the simulated fleet: seeding it and injecting faults (demo and tests)."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from collectors.clients import sim_fleet
from collectors.sim import fleet as simulator
from collectors.sources import sources_of


def _fleet(cluster: str | None) -> simulator.SimFleet:
    """The cluster's simulated fleet (None: the default cluster's)."""
    if sources_of(cluster).fleet != "sim":
        raise ImproperlyConfigured("fault injection only works on the simulated fleet"
                                   + (f" (cluster {cluster} reads real sources)" if cluster
                                      else ""))
    return sim_fleet(cluster)


def fleet_seed(*, reset: bool = False, nodes: int = 16, spares: int = 3,
               cluster: str | None = None) -> bool:
    return _fleet(cluster).seed(nodes=nodes, spares=spares, reset=reset)


def fault_inject(kind: str, *, node: str = "", gpu: int = 0, code: int = 79, count: int = 1,
                 switch: str = "", how: str = "clock", percent: float = 30.0,
                 minutes_ago: float = 0.0, cluster: str | None = None) -> str:
    """Inject a fault; returns a one-line description. Raises ClientError on a bad target."""
    fleet = _fleet(cluster)
    with fleet.transaction() as state:
        now = fleet.clock.now()
        if kind == "xid":
            return simulator.inject_xid(state, node, gpu, code, now)
        if kind == "link-flap":
            return simulator.inject_link_flap(state, node, count, now, fleet.speed)
        if kind == "switch-down":
            return simulator.inject_switch_down(state, switch, now, fleet.speed)
        if kind == "slow":
            return simulator.inject_slow(state, node, gpu, how, percent, now, minutes_ago)
        raise ValueError(f"unknown fault {kind!r}")


def job_finish(job_id: str, *, cluster: str | None = None) -> str:
    """A running job of the simulated fleet ends on its own: its nodes fall idle."""
    fleet = _fleet(cluster)
    with fleet.transaction() as state:
        return simulator.finish_job(state, job_id, fleet.clock.now())


def pod_label_set(node: str, *, no_auto_replace: bool, cluster: str | None = None) -> str:
    with _fleet(cluster).transaction() as state:
        return simulator.set_no_auto_replace(state, node, no_auto_replace)


def source_outage_set(source: str, *, down: bool, cluster: str | None = None) -> str:
    with _fleet(cluster).transaction() as state:
        return simulator.set_source_down(state, source, down)


def fleet_snapshot(cluster: str | None = None) -> simulator.State:
    return _fleet(cluster).snapshot()


def fleet_summary(cluster: str | None = None) -> simulator.State:
    """What ``sim --show`` prints: nodes by state, GPUs by health, faults, jobs."""
    fleet = _fleet(cluster)
    with fleet.transaction() as state:
        return simulator.fleet_summary(state, fleet.clock.now(), fleet.speed)
