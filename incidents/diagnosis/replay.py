"""Replay files (``shared/REPLAY.md``, format ``fleetwatch-replay/1``) in and out of diagnosis.

Pure: reads a file, returns plain data. Gauges are turned into change events the same way the
live collectors do, so a replay and the live fleet reach the same verdicts.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from incidents.diagnosis import diagnose
from incidents.diagnosis.types import JobInfo, Observation

FORMAT = "fleetwatch-replay/1"


class ReplayError(ValueError):
    pass


def _at(value: Any, index: int) -> datetime:
    if not isinstance(value, str):
        raise ReplayError(f"signal {index}: 'at' must be an RFC 3339 string")
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ReplayError(f"signal {index}: bad time {value!r}") from exc


def observations_from_replay(signals: list[dict[str, Any]]) -> list[Observation]:
    last_xid: dict[tuple[str, int], int] = {}
    out = []
    for i, raw in enumerate(signals):
        if not isinstance(raw, dict) or "source" not in raw:
            raise ReplayError(f"signal {i}: not an object with a 'source'")
        at, source, node = _at(raw.get("at"), i), str(raw["source"]), str(raw.get("node", ""))
        gpu = raw.get("gpu")
        if source == "dcgm" and raw.get("metric") == "DCGM_FI_DEV_XID_ERRORS":
            value = int(raw.get("value") or 0)
            key = (node, int(gpu or 0))
            previous = last_xid.get(key, 0)
            last_xid[key] = value
            if value and value != previous:  # a gauge: act on changes only
                out.append(Observation(at, "dcgm", "xid", node, gpu, code=value,
                                       value=str(value), id=i))
            continue
        kind = {"kernel": "kernel_log", "job_log": "job_log"}.get(source, source)
        out.append(Observation(at, source, kind, node, gpu, job=str(raw.get("job", "")),
                               message=str(raw.get("message", "")), id=i,
                               value=str(raw.get("value", raw.get("state", ""))), data=raw))
    return out


def diagnose_document(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ReplayError(f"not a {FORMAT} document")
    signals = doc.get("signals")
    if not isinstance(signals, list):
        raise ReplayError("'signals' must be a list")
    jobs = [JobInfo(str(j["id"]), str(j.get("user", "")), tuple(j.get("nodes", [])))
            for j in doc.get("jobs") or []]
    found = diagnose(observations_from_replay(signals), doc.get("topology") or {}, jobs)
    return {
        "scenario": doc.get("name", ""),
        "incidents": [
            {"root_cause": d.root_cause, "nodes": list(d.nodes), "switch": d.switch,
             "job": d.job, "confidence": d.confidence, "playbook": d.playbook,
             "explanation": d.explanation}
            for d in found
        ],
    }


def diagnose_file(path: str | Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ReplayError(f"cannot read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ReplayError(f"not valid JSON: {exc}") from exc
    return diagnose_document(doc)
