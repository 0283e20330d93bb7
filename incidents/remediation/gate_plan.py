"""What the return-to-service gate runs on a node: its plan, from the settings.

Apart from incidents.gates (which records gate runs and starts them outside playbooks) so that
the steps can build a plan without importing the lifecycle modules that import the steps.
"""

from __future__ import annotations

import logging

from django.conf import settings

from collectors.clients import Clients
from collectors.clients.base import ClientError
from collectors.knowledge.acceptance import selection_for
from incidents.remediation import gate

log = logging.getLogger(__name__)


def gate_plan(node: str, repair: str, key: str, pool: str, clients: Clients) -> gate.GatePlan:
    """What the gate runs on ``node`` after ``repair``: the checks FLEETWATCH_GATE_CHECKS
    chooses for its pool, with the thresholds of its GPU model (as the telemetry names it)."""
    catalogue = settings.FLEETWATCH_GATE_CATALOGUE
    names, entry = selection_for(settings.FLEETWATCH_GATE_CHECKS, pool, repair)
    check_dir = settings.FLEETWATCH_GATE_CHECK_DIR.rstrip("/")
    checks = tuple(gate.PlannedCheck(c.name, c.command.replace("{check_dir}", check_dir),
                                     c.minutes, c.description)
                   for c in (catalogue.checks[n] for n in names))
    model = ""
    if checks:
        try:
            model = next((m.model for m in clients.telemetry.gpu_metrics()
                          if m.node == node and m.model), "")
        except ClientError as exc:
            # The figures are then not compared (the checks still run): said in the plan.
            log.warning("gate %s: GPU model of %s unknown (telemetry: %s)", key, node, exc)
    _, figures = catalogue.thresholds_for(model) if model else ("", {})
    return gate.GatePlan(
        key=key, node=node, repair=str(repair), checks=checks, chosen_by=entry, pool=pool,
        output_dir=settings.FLEETWATCH_GATE_OUTPUT_DIR,
        start_seconds=float(settings.FLEETWATCH_GATE_START_MINUTES) * 60.0, gpu_model=model,
        thresholds=dict(figures), environment=dict(settings.FLEETWATCH_GATE_ENV))
