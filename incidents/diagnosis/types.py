"""Plain data in and out of diagnosis: no Django, no database, no network."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from types import MappingProxyType
from typing import Any

_NO_FIELDS: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Observation:
    """One raw signal as a source reported it, in the replay format's terms.

    The live pipeline builds these from Signal rows, replay files from their ``signals``:
    both carry the same fields, so both reach the same verdicts. ``metric`` is the dcgm-exporter
    field or the NIC counter name and ``value`` its reading; everything else a source says
    (``node_state``, ``condition``, ``job_state``, ``state``, ...) is in ``fields``.
    """

    at: datetime
    source: str
    node: str = ""
    gpu: int | None = None
    job: str = ""
    metric: str = ""
    value: float | None = None
    message: str = ""
    fields: Mapping[str, Any] = field(default_factory=lambda: _NO_FIELDS, compare=False,
                                      hash=False)
    id: int | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any], at: datetime,
                    id: int | None = None) -> Observation:
        source = str(record.get("source", ""))
        metric = record.get("metric") or record.get("counter") or ""
        value = _number(record.get("value"))
        # dcgm-exporter's labels are strings ("gpu": "3"); a GPU read as "unknown" would merge
        # every GPU of the node into one gauge, and one XID would look like many.
        gpu = _number(record.get("gpu"))
        return cls(at=at, source=source, node=str(record.get("node") or ""),
                   gpu=int(gpu) if gpu is not None and gpu == int(gpu) else None,
                   job=str(record.get("job") or ""), metric=str(metric), value=value,
                   message=str(record.get("message") or ""), fields=record, id=id)


def _number(raw: Any) -> float | None:
    """A reading as a number: Prometheus samples and exporter labels arrive as strings too."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int | float):
        return float(raw)
    if isinstance(raw, str):
        try:
            number = float(raw.strip())
        except ValueError:
            try:  # a bitmask written in hex: "0x40"
                return float(int(raw.strip(), 0))
            except ValueError:
                return None
        return number if number == number and abs(number) != float("inf") else None
    return None


@dataclass(frozen=True)
class JobInfo:
    id: str
    user: str = ""
    nodes: tuple[str, ...] = ()
    # The GPU indices it holds per node (Slurm's gres_detail); a node missing: not said.
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Diagnosis:
    root_cause: str
    nodes: tuple[str, ...]
    confidence: float
    playbook: str
    explanation: str
    detected_at: datetime
    switch: str | None = None
    job: str | None = None
    jobs: tuple[str, ...] = ()
    evidence: tuple[int, ...] = ()  # ids of the observations behind it, where they have ids

    @cached_property  # asked for many times a run, of thousands of diagnoses in a storm
    def fingerprint(self) -> str:
        """What is blamed, for dedupe: the same fault seen twice is one incident."""
        target = self.switch or self.job or ",".join(sorted(self.nodes))
        return f"{self.root_cause}:{target}"


@dataclass(frozen=True)
class Note:
    """Something diagnosis saw and deliberately did not turn into an incident.

    ``kind`` is ``source_outage`` (a collector down, or one source alone claiming the whole
    fleet changed), ``symptom`` (errors with no fault behind them in the window),
    ``suppressed`` (evidence that could not be trusted) or ``clock`` (a node's clock found off,
    and its lines read on the cluster's clock). Shown, never acted on.
    """

    kind: str
    text: str
    at: datetime
    source: str = ""
    nodes: tuple[str, ...] = ()
    job: str | None = None


@dataclass(frozen=True)
class Result:
    diagnoses: list[Diagnosis]
    notes: list[Note]
