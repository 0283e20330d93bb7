"""Replay files (``shared/REPLAY.md``, format ``fleetwatch-replay/1``) in and out of diagnosis.

Pure: reads a file, returns plain data. Each signal becomes the same ``Observation`` the live
pipeline builds from a Signal row, so a replay and the live fleet reach the same verdicts.
A bad file raises ``ReplayError`` with a message that names the problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from collectors.knowledge.causes import RootCause
from incidents.diagnosis import diagnose_window
from incidents.diagnosis.types import JobInfo, Observation

FORMAT = "fleetwatch-replay/1"
# The sources REPLAY.md defines. A signal from any other source is a file written for another
# format (or a typo), and diagnosing the rest of it as if that signal were absent would be wrong
# silently: the file is refused instead.
SOURCES = ("kernel", "dcgm", "nic", "slurm", "kubernetes", "job_log", "collector", "gpud")


class ReplayError(ValueError):
    pass


def _at(value: Any, index: int) -> datetime:
    if not isinstance(value, str):
        raise ReplayError(f"signal {index}: 'at' must be an RFC 3339 string")
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ReplayError(f"signal {index}: bad time {value!r}") from exc
    if at.tzinfo is None:
        raise ReplayError(f"signal {index}: time {value!r} has no UTC offset")
    return at


def observations_from_replay(signals: list[Any]) -> list[Observation]:
    out = []
    for i, raw in enumerate(signals):
        if not isinstance(raw, dict) or not isinstance(raw.get("source"), str):
            raise ReplayError(f"signal {i}: not an object with a 'source'")
        if raw["source"] not in SOURCES:
            raise ReplayError(f"signal {i}: unknown source {raw['source']!r} (expected one of "
                              f"{', '.join(SOURCES)})")
        out.append(Observation.from_record(raw, _at(raw.get("at"), i), id=i))
    return out


def _jobs(raw: Any) -> list[JobInfo]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ReplayError("'jobs' must be a list")
    jobs = []
    for i, j in enumerate(raw):
        if not isinstance(j, dict) or "id" not in j:
            raise ReplayError(f"job {i}: not an object with an 'id'")
        nodes = j.get("nodes") or []
        if not isinstance(nodes, list):
            raise ReplayError(f"job {i}: 'nodes' must be a list")
        gpus = j.get("gpus") or {}
        if not isinstance(gpus, dict) or not all(
                isinstance(v, list) and all(isinstance(g, int) and not isinstance(g, bool)
                                            for g in v) for v in gpus.values()):
            raise ReplayError(f"job {i}: 'gpus' must map each node to a list of GPU indices")
        jobs.append(JobInfo(str(j["id"]), str(j.get("user", "")), tuple(str(n) for n in nodes),
                            {str(n): tuple(v) for n, v in gpus.items()}))
    return jobs


def _topology(raw: Any) -> dict[str, list[str]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, list) for v in raw.values()):
        raise ReplayError("'topology' must map each switch to a list of nodes")
    return {str(k): [str(n) for n in v] for k, v in raw.items()}


def diagnose_document(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ReplayError(f"not a {FORMAT} document")
    signals = doc.get("signals")
    if not isinstance(signals, list):
        raise ReplayError("'signals' must be a list")
    result = diagnose_window(observations_from_replay(signals), _topology(doc.get("topology")),
                             _jobs(doc.get("jobs")))
    return {
        "scenario": doc.get("name", ""),
        "incidents": [
            {"root_cause": d.root_cause, "nodes": list(d.nodes), "switch": d.switch,
             "job": d.job, "confidence": d.confidence, "playbook": d.playbook,
             "explanation": d.explanation}
            for d in result.diagnoses
        ],
        "notes": [{"kind": n.kind, "at": n.at.isoformat().replace("+00:00", "Z"),
                   "text": n.text} for n in result.notes],
    }


def blame(incidents: Iterable[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """What a list of incidents holds responsible, as REPLAY.md scores it: (cause, node)
    pairs, plus (switch_failure, switch) and (application_error, job)."""
    out: set[tuple[str, str]] = set()
    for item in incidents:
        cause = str(item.get("root_cause", ""))
        if cause == RootCause.SWITCH_FAILURE:
            out.add((cause, str(item.get("switch"))))
        elif cause == RootCause.APPLICATION_ERROR:
            out.add((cause, str(item.get("job"))))
        else:
            out.update((cause, str(node)) for node in item.get("nodes") or [])
    return out


def check(doc: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """Compare a diagnosis with the file's ``expect``: what is missing, what is extra."""
    expected = doc.get("expect")
    if not isinstance(expected, list):
        raise ReplayError("'expect' must be a list to check against")
    want, got = blame(expected), blame(result["incidents"])
    return {"ok": want == got, "missing": sorted(map(list, want - got)),
            "unexpected": sorted(map(list, got - want))}


def load(path: str | Path) -> Any:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ReplayError(f"cannot read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ReplayError(f"not valid JSON: {exc}") from exc
    return doc


def diagnose_file(path: str | Path, *, with_check: bool = False) -> dict[str, Any]:
    doc = load(path)
    try:
        result = diagnose_document(doc)
    except ReplayError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # A field of the wrong type deep in a signal: name the file, do not dump a traceback.
        raise ReplayError(f"cannot diagnose: {type(exc).__name__}: {exc}") from exc
    if with_check:
        result["check"] = check(doc, result)
    return result
