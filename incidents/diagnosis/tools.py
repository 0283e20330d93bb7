"""Other health tools' verdicts (NVSentinel, gpud, Node Problem Detector), weighed as evidence.

A verdict that names an XID was already read as that XID (facts.tool_verdict), so the GPU rules
judged it like the kernel's or DCGM's word: one cause, one incident, however many tools said
it. What is left here is a verdict with no code behind it. It is another program's opinion,
whose thresholds and checks FleetWatch cannot see, so it opens a diagnosis of its cause with a
confidence below automatic repair (a person confirms) and only where FleetWatch's own evidence
found nothing on that node. A condition that cleared is no fault; a problem that is not a GPU
or network fault (a hung kernel, a read-only disk) is shown as a note; a non-fatal event
(NVSentinel writes those for warnings, gpud types them Info/Warning) is shown, not acted on.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol

from collectors.knowledge import health_tools as ht
from collectors.knowledge.causes import PLAYBOOK_FOR, RootCause
from incidents.diagnosis.facts import Facts, ToolFact
from incidents.diagnosis.types import Diagnosis


class Engine(Protocol):
    """What these verdicts read from and write to the rule engine (``rules.Engine``). Named
    here, not imported: the engine calls this module, and this module would otherwise import
    the engine back."""

    facts: Facts
    gpu_nodes: dict[str, float]
    nic_nodes: dict[str, list[float]]

    @property
    def jobs_of(self) -> Mapping[str, Collection[str]]: ...

    def note(self, kind: str, text: str, at: datetime, **kw: object) -> None: ...
    def add(self, diagnosis: Diagnosis, t: float, source: str = "kernel",
            spared: Sequence[str] = ()) -> None: ...
    def job_alive(self, job: str, t: float) -> bool: ...
    def victims_text(self, jobs: Sequence[str], t: float,
                     blamed: set[str]) -> tuple[str, list[int]]: ...


# Below incidents.lifecycle.AUTO_REMEDIATION_MIN_CONFIDENCE (0.8): a tool's verdict alone waits
# for a person. The same as the rules' other "check before acting" diagnoses.
VERDICT_ALONE_CONFIDENCE = 0.6
# Two tools agreeing on one node's cause are surer, and still wait for a person.
VERDICTS_AGREE_CONFIDENCE = 0.7

CLAIM_CAUSE: dict[str, RootCause] = {
    ht.GPU: RootCause.GPU_HARDWARE,
    ht.GPU_MEMORY: RootCause.GPU_MEMORY,
    ht.NVLINK: RootCause.NVLINK,
    ht.NETWORK: RootCause.NETWORK_FLAP,
    ht.THERMAL: RootCause.THERMAL,
}


def _when(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%H:%M:%S")


def _said(f: ToolFact) -> str:
    text = f.text.strip()
    return f"{f.tool} {f.check}" + (f": '{text[:160]}'" if text else "")


def tool_verdicts(engine: Engine) -> None:
    by_node: dict[str, list[ToolFact]] = defaultdict(list)
    for f in engine.facts.tools:
        by_node[f.node].append(f)
    for node in sorted(by_node):
        _node_verdicts(engine, node, sorted(by_node[node], key=lambda f: f.t))


def _node_verdicts(engine: Engine, node: str, verdicts: list[ToolFact]) -> None:
    # A condition's last word in the window is its state: True then False is a fault that the
    # tool itself saw clear (a reboot, a passing check), not one to act on now.
    latest: dict[str, ToolFact] = {}
    for f in verdicts:
        if f.fatal:
            latest[f.check] = f
    cleared = {c for c, f in latest.items() if not f.active}
    faults: list[ToolFact] = []
    for f in verdicts:
        if not f.active:
            continue
        if f.has_xid:
            # Read as its XID by the GPU rules (or, seen by the kernel or DCGM too, as theirs).
            if node in engine.gpu_nodes:
                engine.note("symptom", f"{node}: {_said(f)} at {_when(f.at)} agrees with the "
                            "GPU fault found", f.at, nodes=(node,))
            continue
        if f.claim == ht.NOT_GPU:
            engine.note("symptom", f"{node}: {_said(f)} at {_when(f.at)}: a node problem that is "
                        "not a GPU or network fault; shown, not acted on", f.at, nodes=(node,))
        elif f.check in cleared and f.fatal:
            engine.note("symptom", f"{node}: {_said(f)} at {_when(f.at)}, then cleared by "
                        f"{f.tool}: not a fault now", f.at, nodes=(node,))
        elif not f.fatal:
            engine.note("symptom", f"{node}: {_said(f)} at {_when(f.at)}: a warning of "
                        f"{f.tool}, not a fault it acts on; shown", f.at, nodes=(node,))
        else:
            faults.append(f)
    if not faults:
        return
    first = faults[0]
    cause = CLAIM_CAUSE[first.claim]
    if cause == RootCause.NETWORK_FLAP and node in engine.facts.nic_read and not any(
            link.node == node for link in engine.facts.links):
        # FleetWatch reads this node's ports itself, and in the window they stayed up with no
        # link loss or recovery: the tool's verdict is about another time (NPD's IB check looks
        # back six hours) or another port, not a link failing now.
        engine.note("symptom", f"{node}: {_said(first)} at {_when(first.at)}, while its NIC "
                    "readings in the window show no link loss: not acted on", first.at,
                    nodes=(node,))
        return
    if node in engine.gpu_nodes or node in engine.nic_nodes:
        # FleetWatch's own evidence already found this node's fault; the tool agrees with it
        # (or names a consequence of it).
        engine.note("symptom", f"{node}: {_said(first)} at {_when(first.at)} agrees with the "
                    "fault found above", first.at, nodes=(node,))
        return
    tools = sorted({f.tool for f in faults if CLAIM_CAUSE[f.claim] == cause})
    confidence = VERDICTS_AGREE_CONFIDENCE if len(tools) > 1 else VERDICT_ALONE_CONFIDENCE
    said = "; ".join(dict.fromkeys(_said(f) for f in faults[:3]))
    t = first.t
    jobs = tuple(sorted(j for j in engine.jobs_of.get(node, ()) if engine.job_alive(j, t)))
    victims, victim_ids = engine.victims_text(jobs, t, {node})
    if cause in (RootCause.GPU_HARDWARE, RootCause.GPU_MEMORY, RootCause.NVLINK,
                 RootCause.THERMAL):
        engine.gpu_nodes.setdefault(node, t)
    else:
        engine.nic_nodes.setdefault(node, []).append(t)
    engine.add(Diagnosis(
        cause, (node,), confidence, PLAYBOOK_FOR[cause],
        f"{' and '.join(tools)} reported {node} unhealthy from {_when(first.at)} ({said}). "
        "No XID, kernel line or telemetry in the window says the same, so this is the tool's "
        "verdict alone: confirm before acting." + victims,
        first.at, jobs=jobs, evidence=tuple([i for i in (f.id for f in faults) if i is not None]
                                            + victim_ids)), t)
