"""Plain data in and out of diagnosis: no Django, no database, no network."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class Observation:
    """A normalized signal as diagnosis sees it (a Signal row, or a replay file entry)."""

    at: datetime
    source: str
    kind: str
    node: str = ""
    gpu: int | None = None
    job: str = ""
    code: int | None = None
    value: str = ""
    message: str = ""
    id: int | None = None
    data: dict[str, object] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class JobInfo:
    id: str
    user: str = ""
    nodes: tuple[str, ...] = ()


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

    @property
    def fingerprint(self) -> str:
        """What is blamed, for dedupe: the same fault seen twice is one incident."""
        target = self.switch or self.job or ",".join(sorted(self.nodes))
        return f"{self.root_cause}:{target}"
