"""What the return-to-service gate runs on a node: its plan, from the settings.

Apart from incidents.gates (which records gate runs and starts them outside playbooks) so that
the steps can build a plan without importing the lifecycle modules that import the steps.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings

from collectors.clients import Clients
from collectors.clients.base import ClientError
from collectors.knowledge.acceptance import selection_for
from incidents.remediation import gate
from incidents.remediation.gate_k8s import gate_poll_kubernetes

log = logging.getLogger(__name__)


def gate_plan(node: str, repair: str, key: str, pool: str, clients: Clients, *,
              known_model: str = "") -> gate.GatePlan:
    """What the gate runs on ``node`` after ``repair``: the checks FLEETWATCH_GATE_CHECKS
    chooses for its pool, with the thresholds of its GPU model (as the telemetry names it).

    ``known_model``: the model an earlier poll of this gate found. The plan is made anew at
    every poll, and finding the model reads every GPU's metrics (100,000 at the largest
    fleets): once known, it is not read again."""
    catalogue = settings.FLEETWATCH_GATE_CATALOGUE
    names, entry = selection_for(settings.FLEETWATCH_GATE_CHECKS, pool, repair)
    check_dir = settings.FLEETWATCH_GATE_CHECK_DIR.rstrip("/")
    checks = tuple(gate.PlannedCheck(c.name, c.command.replace("{check_dir}", check_dir),
                                     c.minutes, c.description)
                   for c in (catalogue.checks[n] for n in names))
    model = known_model
    if checks and not model:
        try:
            model = next((m.model for m in clients.telemetry.gpu_metrics([node]) if m.model),
                         "")
        except ClientError as exc:
            # The figures are then not compared (the checks still run): said in the plan.
            log.warning("gate %s: GPU model of %s unknown (telemetry: %s)", key, node, exc)
    _, figures = catalogue.thresholds_for(model) if model else ("", {})
    return gate.GatePlan(
        key=key, node=node, repair=str(repair), checks=checks, chosen_by=entry, pool=pool,
        output_dir=settings.FLEETWATCH_GATE_OUTPUT_DIR,
        start_seconds=float(settings.FLEETWATCH_GATE_START_MINUTES) * 60.0, gpu_model=model,
        thresholds=dict(figures), environment=dict(settings.FLEETWATCH_GATE_ENV),
        scheduler=gate.KUBERNETES if kubernetes_pool(pool) else gate.SLURM,
        namespace=settings.FLEETWATCH_GATE_NAMESPACE, image=settings.FLEETWATCH_GATE_IMAGE)


def kubernetes_pool(pool: str) -> bool:
    """Whether Kubernetes, not Slurm, schedules the pool's nodes (FLEETWATCH_KUBERNETES_POOLS):
    the gate then holds the node with a cordon and runs its checks as Kubernetes Jobs."""
    return bool(pool) and pool in settings.FLEETWATCH_KUBERNETES_POOLS


def gate_poll(clients: Clients, plan: gate.GatePlan, state: dict[str, Any], call: gate.Call,
              now: float) -> gate.Progress:
    """Advance the gate where its node's pool runs work: Slurm, or Kubernetes."""
    if plan.scheduler == gate.KUBERNETES:
        if plan.checks and not plan.image:
            # Said as the gate's verdict (the node held), not raised: a setting to fix.
            state.setdefault("started_at", now)
            state.update(key=plan.key, verdict=gate.CANNOT_RUN, done=True, why=(
                f"{plan.node} is in pool {plan.pool}, which Kubernetes schedules "
                "(FLEETWATCH_KUBERNETES_POOLS), and FLEETWATCH_GATE_IMAGE names no image to "
                f"run the acceptance checks in; {plan.node} is left as it is, not resumed"))
            return gate.Progress(gate.CANNOT_RUN, state["why"])
        return gate_poll_kubernetes(clients.kubernetes, plan, state, call, now)
    return gate.gate_poll(clients.slurm, plan, state, call, now)
