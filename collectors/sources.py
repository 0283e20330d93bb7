"""Each cluster's sources: its fleet, Slurm, Kubernetes, Prometheus, node provider and (for
the simulated fleet) state file.

One FleetWatch can watch several clusters (``FLEETWATCH_CLUSTERS``, see README "Several
clusters"): each entry names a cluster and the settings it sets for itself, with the same
names and rules as the environment's; what an entry leaves out it takes from the
environment. Without ``FLEETWATCH_CLUSTERS`` there is one cluster, ``FLEETWATCH_CLUSTER``,
configured by the environment alone.

Read at start-up by the settings, so a mistake in any cluster stops every process with a
message naming the cluster and the setting, before anything runs; ``cluster_names`` and
``sources_of`` answer from the loaded settings.
"""

from __future__ import annotations

import re
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from collectors.env import (
    Env,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_str,
    env_subset,
)

FLEETS = ["sim", "real"]
SOURCES = ["slurm", "kubernetes", "telemetry"]
PROVIDERS = ["sim", "none", "slurm", "kubernetes", "command"]
# A cluster's name: the Cluster row's (a slug, at most 64 characters).
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def setting_name(attribute: str) -> str:
    """The environment variable (and Django setting) an attribute is read from."""
    return f"FLEETWATCH_{attribute.upper()}"


@dataclass(frozen=True)
class SourceSettings:
    """One cluster's source settings, typed and checked; each attribute is read from the
    variable ``setting_name`` gives it (slurm_conf: FLEETWATCH_SLURM_CONF)."""

    fleet: str
    sources: list[str]
    # Slurm: its CLI from this directory ("" = PATH) reading this slurm.conf, or slurmrestd.
    slurm_bin_dir: str | None
    slurm_conf: str | None
    slurm_timeout: float
    slurm_transport: str
    slurm_node_map: str | None
    slurmrestd_url: str | None
    slurm_user: str | None
    slurm_jwt: str | None
    slurm_jwt_file: str | None
    slurm_jwt_key_file: str | None
    slurm_jwt_lifespan: int
    slurmctld_url: str | None
    slurm_topology_file: str | None
    kubeconfig: str | None
    kube_context: str | None
    prometheus_url: str | None
    prometheus_matchers: str
    prometheus_token: str
    prometheus_verify_tls: bool | str
    store_gpu_samples: bool
    provider: str
    provider_command: str
    provider_timeout: float
    sim_state: Path
    sim_speed: float

    @classmethod
    def from_env(cls, env: Env, *, sim_state: Path, where: str = "",
                 check: bool = True) -> SourceSettings:
        """Read and check the settings from ``env``; ``where`` ("cluster east: ") starts
        every error message; ``sim_state`` is the simulated fleet's default state file.
        ``check=False``: each value is still checked, but not whether they are complete
        together (the environment's, when FLEETWATCH_CLUSTERS holds the clusters and the
        environment only gives their defaults)."""
        try:
            return cls._from_env(env, sim_state, check)
        except ImproperlyConfigured as exc:
            raise ImproperlyConfigured(f"{where}{exc}") from None

    @classmethod
    def _from_env(cls, env: Env, sim_state: Path, check: bool) -> SourceSettings:
        fleet = env_choice("FLEETWATCH_FLEET", "sim", FLEETS, env)
        sources = env_subset("FLEETWATCH_SOURCES", SOURCES, SOURCES, env)
        # How FleetWatch talks to Slurm: "cli" (the commands, with munge) or "rest"
        # (slurmrestd with JWT, as under Slinky, where the FleetWatch pod has no Slurm
        # binaries or munge).
        transport = env_str("FLEETWATCH_SLURM_TRANSPORT", "cli", env).lower()
        if transport not in ("cli", "rest"):
            raise ImproperlyConfigured(f"FLEETWATCH_SLURM_TRANSPORT={transport!r}: expected cli "
                                       "or rest")
        verify = env_str("FLEETWATCH_PROMETHEUS_VERIFY_TLS", "true", env)
        out = cls(
            fleet=fleet, sources=sources,
            slurm_bin_dir=env_str("FLEETWATCH_SLURM_BIN_DIR", None, env),
            # else SLURM_CONF, else Slurm's default
            slurm_conf=env_str("FLEETWATCH_SLURM_CONF", None, env),
            slurm_timeout=env_float("FLEETWATCH_SLURM_TIMEOUT", 20.0, minimum=0.5, env=env),
            slurm_transport=transport,
            slurm_node_map=env_str("FLEETWATCH_SLURM_NODE_MAP", None, env),
            slurmrestd_url=env_str("FLEETWATCH_SLURMRESTD_URL", None, env),
            slurm_user=env_str("FLEETWATCH_SLURM_USER", None, env),
            slurm_jwt=env_str("FLEETWATCH_SLURM_JWT", None, env),
            slurm_jwt_file=env_str("FLEETWATCH_SLURM_JWT_FILE", None, env),
            slurm_jwt_key_file=env_str("FLEETWATCH_SLURM_JWT_KEY_FILE", None, env),
            slurm_jwt_lifespan=env_int("FLEETWATCH_SLURM_JWT_LIFESPAN", 1800, minimum=120,
                                       env=env),
            slurmctld_url=env_str("FLEETWATCH_SLURMCTLD_URL", None, env),
            slurm_topology_file=env_str("FLEETWATCH_SLURM_TOPOLOGY_FILE", None, env),
            kubeconfig=env_str("FLEETWATCH_KUBECONFIG", None, env),
            kube_context=env_str("FLEETWATCH_KUBE_CONTEXT", None, env),
            prometheus_url=env_str("FLEETWATCH_PROMETHEUS_URL", None, env),
            prometheus_matchers=env_str("FLEETWATCH_PROMETHEUS_MATCHERS", "", env),
            prometheus_token=env_str("FLEETWATCH_PROMETHEUS_TOKEN", "", env),
            # true/false, or a CA bundle's path.
            prometheus_verify_tls=(
                verify.lower() not in ("0", "false", "no", "off") if verify.lower() in (
                    "0", "1", "true", "false", "yes", "no", "on", "off") else verify),
            # Per-scrape GPU samples in the database, for the charts. With Prometheus the
            # charts use its range queries instead, so a 100,000-GPU fleet does not write
            # 100,000 rows every scrape.
            store_gpu_samples=env_bool("FLEETWATCH_STORE_GPU_SAMPLES", fleet == "sim", env),
            provider=env_choice("FLEETWATCH_PROVIDER", "sim" if fleet == "sim" else "none",
                                PROVIDERS, env),
            provider_command=env_str("FLEETWATCH_PROVIDER_COMMAND", "", env),
            provider_timeout=env_float("FLEETWATCH_PROVIDER_TIMEOUT", 600.0, minimum=1,
                                       env=env),
            sim_state=Path(env_str("FLEETWATCH_SIM_STATE", str(sim_state), env)),
            sim_speed=env_float("FLEETWATCH_SIM_SPEED", 20.0, minimum=0.01, env=env),
        )
        if check:
            out.check()
        return out

    def check(self) -> None:
        """Settings that only make sense together."""
        if self.slurm_transport == "rest":
            if not self.slurmrestd_url:
                raise ImproperlyConfigured(
                    "FLEETWATCH_SLURM_TRANSPORT=rest needs FLEETWATCH_SLURMRESTD_URL, "
                    "slurmrestd's address (e.g. http://slurm-restapi.slurm:6820)")
            if not (self.slurm_jwt or self.slurm_jwt_file or self.slurm_jwt_key_file):
                raise ImproperlyConfigured(
                    "FLEETWATCH_SLURM_TRANSPORT=rest needs a token: FLEETWATCH_SLURM_JWT, "
                    "FLEETWATCH_SLURM_JWT_FILE (e.g. a mounted Secret) or "
                    "FLEETWATCH_SLURM_JWT_KEY_FILE (slurmctld's jwt_hs256.key, to mint tokens)")
            if self.slurm_jwt_key_file and not self.slurm_user:
                raise ImproperlyConfigured(
                    "FLEETWATCH_SLURM_JWT_KEY_FILE mints tokens for FLEETWATCH_SLURM_USER: set "
                    "it (a Slurm operator or admin, e.g. slurm)")
        if self.fleet == "real" and "telemetry" in self.sources and not self.prometheus_url:
            raise ImproperlyConfigured(
                "FLEETWATCH_FLEET=real collects telemetry from Prometheus: set "
                "FLEETWATCH_PROMETHEUS_URL (or leave telemetry out of FLEETWATCH_SOURCES)")

    @classmethod
    def from_settings(cls, settings: Any) -> SourceSettings:
        """The environment's values as Django's settings hold them now (a test may have
        changed them)."""
        return cls(**{f.name: getattr(settings, setting_name(f.name)) for f in fields(cls)})


# The environment variables a cluster's entry may set.
PER_CLUSTER = tuple(setting_name(f.name) for f in fields(SourceSettings))


def clusters_load(raw: str | None, env: Env, *, data_dir: Path) -> dict[str, SourceSettings]:
    """FLEETWATCH_CLUSTERS: a YAML or JSON file's path, or the JSON itself, mapping each
    cluster's name to the settings it sets for itself::

        east:
          FLEETWATCH_SLURM_TRANSPORT: rest
          FLEETWATCH_SLURMRESTD_URL: http://slurm-restapi.east:6820
          FLEETWATCH_KUBECONFIG: /etc/fleetwatch/east/kubeconfig
        west:
          FLEETWATCH_PROMETHEUS_MATCHERS: cluster="west"

    Empty when unset (one cluster, from the environment). The clusters keep the file's order.
    """
    if not raw:
        return {}
    where = "FLEETWATCH_CLUSTERS"
    text = raw
    if not raw.lstrip().startswith(("{", "[")):
        try:
            text = Path(raw).read_text()
        except OSError as exc:
            raise ImproperlyConfigured(
                f"{where}={raw!r}: cannot read it ({exc.strerror or exc}); give a YAML or JSON "
                "file's path, or the JSON itself") from None
        where = f"{where} ({raw})"
    try:
        # YAML is a superset of JSON: one parser reads both.
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ImproperlyConfigured(f"{where}: not YAML or JSON: {exc}") from None
    if not isinstance(loaded, dict) or not loaded:
        raise ImproperlyConfigured(
            f"{where}: expected a mapping of cluster names to their settings, e.g. "
            '{"east": {"FLEETWATCH_KUBECONFIG": "/etc/fleetwatch/east.kubeconfig"}}')
    out: dict[str, SourceSettings] = {}
    for name, entry in loaded.items():
        out[str(name)] = _cluster_read(where, name, entry, env, data_dir, several=len(loaded) > 1)
    return out


def _cluster_read(where: str, name: object, entry: object, env: Env, data_dir: Path, *,
                  several: bool) -> SourceSettings:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ImproperlyConfigured(
            f"{where}: cluster name {name!r} must be 1-64 letters, digits, '-' or '_'")
    if entry is None:
        entry = {}
    if not isinstance(entry, Mapping):
        raise ImproperlyConfigured(
            f"{where}: cluster {name}: expected a mapping of settings, got {type(entry).__name__}")
    values: dict[str, str] = {}
    for key, value in entry.items():
        if key not in PER_CLUSTER:
            raise ImproperlyConfigured(
                f"{where}: cluster {name}: {key!r} is not a per-cluster setting; a cluster may "
                f"set {', '.join(PER_CLUSTER)}")
        if isinstance(value, (list, dict)) or value is None:
            raise ImproperlyConfigured(
                f"{where}: cluster {name}: {key} must be a string, number or boolean")
        # Written as the environment would hold it, then read by the same rules.
        values[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    # Two simulated clusters must not share one state file: each gets its own by default, and
    # the environment's FLEETWATCH_SIM_STATE is not handed down to several.
    state = data_dir / (f"sim-fleet-{name}.json" if several else "sim-fleet.json")
    below = {k: v for k, v in env.items() if not (several and k == "FLEETWATCH_SIM_STATE")}
    return SourceSettings.from_env(
        ChainMap(values, below), sim_state=state, where=f"{where}: cluster {name}: ")


def cluster_default_name(configured: dict[str, SourceSettings], named: str | None) -> str:
    """The cluster that pushes and commands naming none go to: FLEETWATCH_CLUSTER (which must
    then be one of FLEETWATCH_CLUSTERS), else the first one listed, else "sim"."""
    if not configured:
        return named or "sim"
    if named is None:
        return next(iter(configured))
    if named not in configured:
        raise ImproperlyConfigured(
            f"FLEETWATCH_CLUSTER={named!r} is not one of FLEETWATCH_CLUSTERS' clusters "
            f"({', '.join(configured)})")
    return named


def cluster_names() -> list[str]:
    """The clusters this FleetWatch watches, in the configuration's order."""
    return list(settings.FLEETWATCH_CLUSTERS) or [settings.FLEETWATCH_CLUSTER]


def sources_of(cluster: str | None = None) -> SourceSettings:
    """The cluster's source settings (None: the default cluster's). With one cluster, the
    environment's, whatever the cluster is called; with FLEETWATCH_CLUSTERS, its entry, and
    a cluster no longer listed there is an error (its incidents keep their history, but
    FleetWatch no longer knows how to reach it)."""
    # Imported here: the settings import this module, and the clients package needs them.
    from collectors.clients.base import ClientError

    configured = settings.FLEETWATCH_CLUSTERS
    if not configured:
        return SourceSettings.from_settings(settings)
    name = cluster or settings.FLEETWATCH_CLUSTER
    try:
        return configured[name]
    except KeyError:
        raise ClientError(f"cluster {name!r} is not in FLEETWATCH_CLUSTERS "
                          f"({', '.join(configured)}): FleetWatch cannot reach it",
                          permanent=True) from None
