"""The diagnosis engine: pure functions from observations, topology and jobs to diagnoses.

No Django, no database, no network: the live pipeline, ``manage.py fleetwatch diagnose``,
the scenario suite and the benchmark all call the same two functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import incidents.diagnosis.facts as facts
import incidents.diagnosis.rules as rules
from incidents.diagnosis.types import Diagnosis, JobInfo, Note, Observation, Result

__all__ = ["Diagnosis", "JobInfo", "Note", "Observation", "Result", "diagnose", "diagnose_window"]


def diagnose_window(
    observations: Sequence[Observation],
    topology: Mapping[str, Sequence[str]] | None = None,
    jobs: Sequence[JobInfo] = (),
) -> Result:
    """Diagnose a window of observations (any order): diagnoses, and notes on what was seen
    but deliberately not called a fault (source outages, symptoms with no cause)."""
    # extract sorts the window only if it is not in time order already (as sources send it).
    found, notes = rules.run(facts.extract(observations), topology or {}, jobs)
    unique: dict[str, Diagnosis] = {}
    for diagnosis in found:
        unique.setdefault(diagnosis.fingerprint, diagnosis)
    return Result(sorted(unique.values(), key=lambda d: (d.detected_at, d.fingerprint)),
                  sorted(notes, key=lambda n: n.at))


def diagnose(
    observations: Sequence[Observation],
    topology: Mapping[str, Sequence[str]] | None = None,
    jobs: Sequence[JobInfo] = (),
) -> list[Diagnosis]:
    """One diagnosis per blamed target (node, switch or job)."""
    return diagnose_window(observations, topology, jobs).diagnoses

