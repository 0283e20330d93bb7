"""How long each phase of an incident took: detection, approval, each step, the repair's
phases (drain, requeue, replace, resume) and the whole. Kept on the incident when it resolves.
"""

from __future__ import annotations

from typing import Any

from incidents.models import Incident, Remediation
from incidents.remediation.steps import phase_of


def phase_durations(
    incident: Incident, remediation: Remediation | None, now: Any
) -> dict[str, float]:
    """Seconds per phase: detection, waiting for approval, each step, and the whole repair."""
    def secs(a: Any, b: Any) -> float:
        return round((b - a).total_seconds(), 3)

    phases = {"detect": secs(incident.detected_at, incident.opened_at)}
    if remediation is not None:
        if remediation.approved_at:
            phases["approval"] = secs(remediation.created_at, remediation.approved_at)
        steps = list(remediation.steps.order_by("order"))
        first = next((st.started_at for st in steps if st.started_at), None)
        if first is not None:
            # Decide: from the incident opening to the first step running (approval included).
            phases["decide"] = secs(incident.opened_at, first)
        grouped: dict[str, float] = {}
        for step in steps:
            if step.started_at and step.finished_at:
                phases[step.kind] = secs(step.started_at, step.finished_at)
                phase = phase_of(step.kind)  # declared with the step kind (steps.STEP_KINDS)
                if phase:
                    grouped[phase] = round(grouped.get(phase, 0.0) + phases[step.kind], 3)
        # The repair's phases (drain, requeue, replace, resume) sum their steps; a step
        # named like its phase ("requeue") is that phase's total.
        phases.update(grouped)
        first_call = remediation.audit.exclude(call="").order_by("at").first()
        if first_call is not None:
            phases["first_action"] = secs(incident.detected_at, first_call.at)
    phases["total"] = secs(incident.detected_at, now)
    return phases
