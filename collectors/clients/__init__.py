"""One client per outside system and cluster, chosen by the cluster's settings.

Callers ask for ``get_clients(cluster)`` and use only the interfaces in ``base``; which
implementation stands behind them (the simulated fleet, or the real Slurm CLI or slurmrestd,
Kubernetes API and Prometheus) is configuration: ``FLEETWATCH_FLEET`` and the rest, or a
cluster's own entry in ``FLEETWATCH_CLUSTERS`` (collectors/sources.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from collectors.clients.base import (
    KubernetesClient,
    NodeProvider,
    NoProvider,
    SlurmClient,
    TelemetryClient,
)
from collectors.clients.notify import Notifier, notifier_from_settings
from collectors.sources import SourceSettings, sources_of

if TYPE_CHECKING:
    from collectors.clients.kubernetes import KubernetesApi
    from collectors.sim.fleet import SimFleet


@dataclass(frozen=True)
class Clients:
    slurm: SlurmClient
    kubernetes: KubernetesClient
    telemetry: TelemetryClient
    provider: NodeProvider
    notifier: Notifier


def sim_fleet(cluster: str | None = None) -> SimFleet:
    # Imported here: only the simulated fleet needs the simulator loaded.
    from collectors.sim import fleet

    config = sources_of(cluster)
    return fleet.SimFleet(config.sim_state, config.sim_speed)


def get_clients(cluster: str | None = None) -> Clients:
    """The clients of one cluster (None: the default cluster)."""
    notifier = notifier_from_settings()
    config = sources_of(cluster)
    if config.fleet == "sim":
        from collectors.sim.fleet import SimKubernetes, SimProvider, SimSlurm, SimTelemetry

        fleet = sim_fleet(cluster)
        # A simulated fleet can still be repaired through another provider (a site's program
        # under test, say): FLEETWATCH_PROVIDER decides, "sim" being the default.
        provider = (SimProvider(fleet) if config.provider == "sim"
                    else provider_from_settings(cluster))
        return Clients(SimSlurm(fleet), SimKubernetes(fleet), SimTelemetry(fleet), provider,
                       notifier)
    return Clients(real_slurm(cluster), real_kubernetes(config), real_telemetry(config),
                   provider_from_settings(cluster), notifier)


def provider_from_settings(cluster: str | None = None) -> NodeProvider:
    """The node provider the cluster's FLEETWATCH_PROVIDER names.

    sim: the simulated fleet's spare pool; none: refuses every action; slurm: Slurm's own
    reboot (no replacement, no GPU reset); kubernetes: replacement from the node's pool,
    reboots through Slurm; command: FLEETWATCH_PROVIDER_COMMAND for everything.
    """
    from collectors.clients import providers

    config = sources_of(cluster)
    choice = config.provider
    if choice == "none":
        return NoProvider()
    if choice == "sim":
        from collectors.sim.fleet import SimProvider

        return SimProvider(sim_fleet(cluster))
    if choice == "slurm":
        return providers.SlurmRebootProvider(real_slurm(cluster))
    if choice == "kubernetes":
        # The pool provider needs the real API's node and pool calls, beyond the interface.
        return providers.CompositeProvider(
            replace=providers.KubernetesPoolProvider(cast("KubernetesApi",
                                                          real_kubernetes(config))),
            reboot=providers.SlurmRebootProvider(real_slurm(cluster)))
    if choice == "command":
        command = config.provider_command
        if not command.strip():
            raise ImproperlyConfigured(
                "FLEETWATCH_PROVIDER=command needs FLEETWATCH_PROVIDER_COMMAND: the program to "
                "run, e.g. /opt/site/fleetwatch-provider.sh (see deploy/providers/)")
        return providers.CommandProvider(command, config.provider_timeout)
    raise ImproperlyConfigured(f"FLEETWATCH_PROVIDER={choice!r}: expected one of sim, none, "
                               "slurm, kubernetes, command")


def get_telemetry(cluster: str | None = None) -> TelemetryClient:
    """The telemetry client alone (charts need no Slurm or Kubernetes connection)."""
    config = sources_of(cluster)
    if config.fleet == "sim":
        from collectors.sim.fleet import SimTelemetry

        return SimTelemetry(sim_fleet(cluster))
    return real_telemetry(config)


# The real clients, imported on first use: the embedded demo needs none of their libraries.


def real_slurm(cluster: str | None = None) -> SlurmClient:
    """The cluster's Slurm transport, speaking machine names (collectors/clients/naming.py):
    Slurm's own node names are translated on the way in and out."""
    from collectors.clients.naming import SlurmNames

    config = sources_of(cluster)
    return SlurmNames(slurm_transport(config), lambda: slurm_node_names(cluster))


def slurm_node_names(cluster: str | None = None) -> dict[str, str]:
    """{Slurm node name: machine}: FLEETWATCH_SLURM_NODE_MAP, then what the slurmd pods said
    (Node.slurm_name, kept by the Kubernetes collector), which wins where both name a node."""
    from collectors.clients.naming import parse_node_map
    from collectors.models import Node

    raw: str = sources_of(cluster).slurm_node_map or ""
    try:
        if raw.startswith("/"):
            with open(raw) as handle:
                raw = handle.read()
        names = parse_node_map(raw)
    except (OSError, ValueError) as exc:
        raise ImproperlyConfigured(f"FLEETWATCH_SLURM_NODE_MAP: {exc}") from exc
    nodes = Node.objects.exclude(slurm_name="")
    if settings.FLEETWATCH_CLUSTERS:
        # Each cluster's own slurmd pods (one cluster: whatever its row is called).
        nodes = nodes.filter(cluster__name=cluster or settings.FLEETWATCH_CLUSTER)
    names.update(nodes.values_list("slurm_name", "name"))
    return names


def slurm_transport(config: SourceSettings) -> SlurmClient:
    """The CLI transport, or slurmrestd with FLEETWATCH_SLURM_TRANSPORT=rest."""
    if config.slurm_transport == "rest":
        from collectors.clients.slurmrest import SlurmRest, TokenSource

        # The settings refuse transport=rest without a URL or a token source.
        tokens = TokenSource(token=config.slurm_jwt or "",
                             token_file=config.slurm_jwt_file or "",
                             key_file=config.slurm_jwt_key_file or "",
                             user=config.slurm_user or "",
                             lifespan=config.slurm_jwt_lifespan)
        return SlurmRest(cast(str, config.slurmrestd_url), tokens,
                         user=config.slurm_user or "",
                         timeout=config.slurm_timeout,
                         ctld_url=config.slurmctld_url or "",
                         topology_file=config.slurm_topology_file or "",
                         bin_dir=config.slurm_bin_dir or "",
                         slurm_conf=config.slurm_conf or "")
    from collectors.clients.slurm import SlurmCli

    conf = config.slurm_conf
    return SlurmCli(bin_dir=config.slurm_bin_dir or None,
                    timeout=config.slurm_timeout,
                    env={"SLURM_CONF": conf} if conf else None)


def real_kubernetes(config: SourceSettings, timeout: float | None = None) -> KubernetesClient:
    """``timeout``: seconds per request (default: twice FLEETWATCH_HTTP_TIMEOUT)."""
    from collectors.clients.kubernetes import KubernetesApi

    # An eviction a PodDisruptionBudget holds back is retried inside one step run for at most
    # a third of the Celery soft time limit; after that the step fails transiently and the
    # engine retries it later, instead of the time limit killing it mid-call.
    return KubernetesApi(kubeconfig=config.kubeconfig or None,
                         context=config.kube_context or None,
                         timeout=timeout or settings.FLEETWATCH_HTTP_TIMEOUT * 2,
                         evict_max_wait=settings.CELERY_TASK_SOFT_TIME_LIMIT / 3)


def real_telemetry(config: SourceSettings, timeout: float | None = None,
                   retries: int = 2) -> TelemetryClient:
    """``timeout``: seconds per query (default: FLEETWATCH_HTTP_TIMEOUT); ``retries`` of a
    refused connection or a gateway error."""
    from collectors.clients.prometheus import PrometheusTelemetry

    token = config.prometheus_token
    # The settings refuse a real fleet that collects telemetry without this URL.
    return PrometheusTelemetry(cast(str, config.prometheus_url),
                               timeout=timeout or settings.FLEETWATCH_HTTP_TIMEOUT,
                               headers={"Authorization": f"Bearer {token}"} if token else None,
                               verify_tls=config.prometheus_verify_tls,
                               matchers=config.prometheus_matchers, retries=retries)


# A page's reads, while a person waits: each request is given up after ``timeout`` seconds and
# a refused connection is not retried (the page says the source is unavailable instead).


def page_telemetry(cluster: str | None, timeout: float) -> TelemetryClient:
    config = sources_of(cluster)
    if config.fleet == "sim":
        from collectors.sim.fleet import SimTelemetry

        return SimTelemetry(sim_fleet(cluster))
    return real_telemetry(config, timeout, retries=0)


def page_kubernetes(cluster: str | None, timeout: float) -> KubernetesClient:
    config = sources_of(cluster)
    if config.fleet == "sim":
        from collectors.sim.fleet import SimKubernetes

        return SimKubernetes(sim_fleet(cluster))
    return real_kubernetes(config, timeout)
