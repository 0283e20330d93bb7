"""One client per outside system, chosen by ``FLEETWATCH_FLEET``.

Callers ask for ``get_clients()`` and use only the interfaces in ``base``; which
implementation stands behind them (the simulated fleet, or the real Slurm CLI, Kubernetes API
and Prometheus) is configuration.
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


def sim_fleet() -> SimFleet:
    # Imported here: only the simulated fleet needs the simulator loaded.
    from collectors.sim import fleet

    return fleet.SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED)


def get_clients() -> Clients:
    notifier = notifier_from_settings()
    if settings.FLEETWATCH_FLEET == "sim":
        from collectors.sim.fleet import SimKubernetes, SimProvider, SimSlurm, SimTelemetry

        fleet = sim_fleet()
        # A simulated fleet can still be repaired through another provider (a site's program
        # under test, say): FLEETWATCH_PROVIDER decides, "sim" being the default.
        provider = (SimProvider(fleet) if settings.FLEETWATCH_PROVIDER == "sim"
                    else provider_from_settings())
        return Clients(SimSlurm(fleet), SimKubernetes(fleet), SimTelemetry(fleet), provider,
                       notifier)
    return Clients(real_slurm(), real_kubernetes(), real_telemetry(), provider_from_settings(),
                   notifier)


def provider_from_settings() -> NodeProvider:
    """The node provider FLEETWATCH_PROVIDER names.

    sim: the simulated fleet's spare pool; none: refuses every action; slurm: Slurm's own
    reboot (no replacement, no GPU reset); kubernetes: replacement from the node's pool,
    reboots through Slurm; command: FLEETWATCH_PROVIDER_COMMAND for everything.
    """
    from collectors.clients import providers

    choice = settings.FLEETWATCH_PROVIDER
    if choice == "none":
        return NoProvider()
    if choice == "sim":
        from collectors.sim.fleet import SimProvider

        return SimProvider(sim_fleet())
    if choice == "slurm":
        return providers.SlurmRebootProvider(real_slurm())
    if choice == "kubernetes":
        # The pool provider needs the real API's node and pool calls, beyond the interface.
        return providers.CompositeProvider(
            replace=providers.KubernetesPoolProvider(cast("KubernetesApi", real_kubernetes())),
            reboot=providers.SlurmRebootProvider(real_slurm()))
    if choice == "command":
        command = settings.FLEETWATCH_PROVIDER_COMMAND
        if not command.strip():
            raise ImproperlyConfigured(
                "FLEETWATCH_PROVIDER=command needs FLEETWATCH_PROVIDER_COMMAND: the program to "
                "run, e.g. /opt/site/fleetwatch-provider.sh (see deploy/providers/)")
        return providers.CommandProvider(command, settings.FLEETWATCH_PROVIDER_TIMEOUT)
    raise ImproperlyConfigured(f"FLEETWATCH_PROVIDER={choice!r}: expected one of sim, none, "
                               "slurm, kubernetes, command")


def get_telemetry() -> TelemetryClient:
    """The telemetry client alone (charts need no Slurm or Kubernetes connection)."""
    if settings.FLEETWATCH_FLEET == "sim":
        from collectors.sim.fleet import SimTelemetry

        return SimTelemetry(sim_fleet())
    return real_telemetry()


# The real clients, imported on first use: the embedded demo needs none of their libraries.


def real_slurm() -> SlurmClient:
    """The configured Slurm transport, speaking machine names (collectors/clients/naming.py):
    Slurm's own node names are translated on the way in and out."""
    from collectors.clients.naming import SlurmNames

    return SlurmNames(slurm_transport(), slurm_node_names)


def slurm_node_names() -> dict[str, str]:
    """{Slurm node name: machine}: FLEETWATCH_SLURM_NODE_MAP, then what the slurmd pods said
    (Node.slurm_name, kept by the Kubernetes collector), which wins where both name a node."""
    from collectors.clients.naming import parse_node_map
    from collectors.models import Node

    raw: str = settings.FLEETWATCH_SLURM_NODE_MAP or ""
    try:
        if raw.startswith("/"):
            with open(raw) as handle:
                raw = handle.read()
        names = parse_node_map(raw)
    except (OSError, ValueError) as exc:
        raise ImproperlyConfigured(f"FLEETWATCH_SLURM_NODE_MAP: {exc}") from exc
    names.update(Node.objects.exclude(slurm_name="").values_list("slurm_name", "name"))
    return names


def slurm_transport() -> SlurmClient:
    """The CLI transport, or slurmrestd with FLEETWATCH_SLURM_TRANSPORT=rest."""
    if settings.FLEETWATCH_SLURM_TRANSPORT == "rest":
        from collectors.clients.slurmrest import SlurmRest, TokenSource

        # The settings refuse transport=rest without a URL or a token source.
        tokens = TokenSource(token=settings.FLEETWATCH_SLURM_JWT or "",
                             token_file=settings.FLEETWATCH_SLURM_JWT_FILE or "",
                             key_file=settings.FLEETWATCH_SLURM_JWT_KEY_FILE or "",
                             user=settings.FLEETWATCH_SLURM_USER or "",
                             lifespan=settings.FLEETWATCH_SLURM_JWT_LIFESPAN)
        return SlurmRest(cast(str, settings.FLEETWATCH_SLURMRESTD_URL), tokens,
                         user=settings.FLEETWATCH_SLURM_USER or "",
                         timeout=settings.FLEETWATCH_SLURM_TIMEOUT,
                         ctld_url=settings.FLEETWATCH_SLURMCTLD_URL or "",
                         topology_file=settings.FLEETWATCH_SLURM_TOPOLOGY_FILE or "",
                         bin_dir=settings.FLEETWATCH_SLURM_BIN_DIR or "",
                         slurm_conf=settings.FLEETWATCH_SLURM_CONF or "")
    from collectors.clients.slurm import SlurmCli

    conf = settings.FLEETWATCH_SLURM_CONF
    return SlurmCli(bin_dir=settings.FLEETWATCH_SLURM_BIN_DIR or None,
                    timeout=settings.FLEETWATCH_SLURM_TIMEOUT,
                    env={"SLURM_CONF": conf} if conf else None)


def real_kubernetes() -> KubernetesClient:
    from collectors.clients.kubernetes import KubernetesApi

    # An eviction a PodDisruptionBudget holds back is retried inside one step run for at most
    # a third of the Celery soft time limit; after that the step fails transiently and the
    # engine retries it later, instead of the time limit killing it mid-call.
    return KubernetesApi(kubeconfig=settings.FLEETWATCH_KUBECONFIG or None,
                         context=settings.FLEETWATCH_KUBE_CONTEXT or None,
                         timeout=settings.FLEETWATCH_HTTP_TIMEOUT * 2,
                         evict_max_wait=settings.CELERY_TASK_SOFT_TIME_LIMIT / 3)


def real_telemetry() -> TelemetryClient:
    from collectors.clients.prometheus import PrometheusTelemetry

    token = settings.FLEETWATCH_PROMETHEUS_TOKEN
    # The settings refuse a real fleet that collects telemetry without this URL.
    return PrometheusTelemetry(cast(str, settings.FLEETWATCH_PROMETHEUS_URL),
                               timeout=settings.FLEETWATCH_HTTP_TIMEOUT,
                               headers={"Authorization": f"Bearer {token}"} if token else None,
                               verify_tls=settings.FLEETWATCH_PROMETHEUS_VERIFY_TLS,
                               matchers=settings.FLEETWATCH_PROMETHEUS_MATCHERS)
