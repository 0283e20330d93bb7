"""The diagnosis engine: pure functions from observations, topology and jobs to diagnoses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from incidents.diagnosis.rules import rule_hardware_xid
from incidents.diagnosis.types import Diagnosis, JobInfo, Observation

__all__ = ["Diagnosis", "JobInfo", "Observation", "diagnose"]

RULES = (rule_hardware_xid,)


def diagnose(
    observations: Sequence[Observation],
    topology: Mapping[str, Sequence[str]] | None = None,
    jobs: Sequence[JobInfo] = (),
) -> list[Diagnosis]:
    """Diagnose a window of observations (any order). One diagnosis per blamed target."""
    ordered = sorted(observations, key=lambda o: o.at)
    found: dict[str, Diagnosis] = {}
    for rule in RULES:
        for diagnosis in rule(ordered, jobs):
            found.setdefault(diagnosis.fingerprint, diagnosis)
    return sorted(found.values(), key=lambda d: (d.detected_at, d.fingerprint))
