"""Benchmark: how right the diagnosis is on the replay scenarios (``make bench``, issue 19).

Every replay file (``shared/REPLAY.md``) is diagnosed with ``diagnose_document`` and scored
on REPLAY.md's blame units: (cause, node) pairs, plus (switch_failure, switch) and
(application_error, job). Per root cause: expected count, true and false positives, false
negatives, precision and recall. A confusion matrix counted per blamed or expected entity
(a node, a switch or a job): rows are the cause a scenario expects for the entity ("none":
healthy), columns the cause the diagnosis blames it for ("none": missed). Then the scenarios
diagnosed right out of all, the wrong ones with what was expected and what came out, and the
healthy nodes blamed: nodes the diagnosis holds responsible that no expectation names, for
any cause. Writes ``bench-quality.md`` and ``.json`` under ``--out``; exits 1 when a healthy
node is blamed or a scenario is wrong (``--no-fail``: report only).

By default it scores ``tests/scenarios/*.json`` and ``../shared/scenarios/*.json`` (from the
repository root; the shared folder is skipped, with a note, where it is absent, as in CI).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from collectors.knowledge.causes import RootCause
from incidents.diagnosis.replay import ReplayError, blame, check, diagnose_document, load

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIRS = (ROOT / "tests" / "scenarios", ROOT.parent / "shared" / "scenarios")
NONE = "none"
CAUSES: tuple[str, ...] = tuple(str(c) for c in RootCause)
AXIS: tuple[str, ...] = (*CAUSES, NONE)


def _kind(cause: str) -> str:
    """What a blame unit of this cause names: a switch, a job or a node."""
    if cause == RootCause.SWITCH_FAILURE:
        return "switch"
    if cause == RootCause.APPLICATION_ERROR:
        return "job"
    return "node"


def _named_nodes(expect: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """Every node an expectation names, for any cause (a switch failure's symptomatic nodes
    included), with the causes that name it."""
    out: dict[str, set[str]] = {}
    for item in expect:
        for node in item.get("nodes") or []:
            out.setdefault(str(node), set()).add(str(item.get("root_cause", "")))
    return out


def _confusion(want: set[tuple[str, str]], got: set[tuple[str, str]],
               named: Mapping[str, set[str]]) -> list[tuple[str, str]]:
    """(expected cause, diagnosed cause) cells, one per cause an entity is expected or blamed
    for. A right cause is on the diagonal; an expected cause that nothing blamed pairs with a
    wrong one blamed on the same entity, or with "none" (missed); a wrong cause left over
    counts against the entity's expected cause, or "none" where it is healthy. A node that
    no blame unit expects but a switch failure names as symptomatic has that row, not "none"."""
    entities: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for units, side in ((want, 0), (got, 1)):
        for cause, name in units:
            entities.setdefault((_kind(cause), name), (set(), set()))[side].add(cause)
    cells: list[tuple[str, str]] = []
    for (kind, name), (expected, blamed) in sorted(entities.items()):
        right = expected & blamed
        cells.extend((c, c) for c in sorted(right))
        missed, wrong = sorted(expected - blamed), sorted(blamed - expected)
        for i in range(max(len(missed), len(wrong))):
            if i < len(missed):
                cells.append((missed[i], wrong[i] if i < len(wrong) else NONE))
                continue
            rows = sorted(expected)
            if not rows and kind == "node":
                rows = sorted(named.get(name, ()))
            cells.append((rows[0] if rows else NONE, wrong[i]))
    return cells


def score(scenarios: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Diagnose and score each (name, parsed replay document). A document that cannot be
    diagnosed or has no ``expect`` (or a ``ReplayError`` in its place: a file that could not
    be read) counts as a wrong scenario, with its error."""
    per_cause = {c: {"expected": 0, "tp": 0, "fp": 0, "fn": 0} for c in CAUSES}
    matrix = {row: dict.fromkeys(AXIS, 0) for row in AXIS}
    total = right = 0
    wrong: list[dict[str, Any]] = []
    healthy: list[dict[str, str]] = []
    for name, doc in scenarios:
        total += 1
        try:
            if isinstance(doc, ReplayError):
                raise doc
            result = diagnose_document(doc)
            verdict = check(doc, result)
        except (ReplayError, TypeError, ValueError, AttributeError, KeyError) as exc:
            wrong.append({"scenario": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        want, got = blame(doc["expect"]), blame(result["incidents"])
        named = _named_nodes(doc["expect"])
        for cause in {c for c, _ in want | got}:
            counts = per_cause.setdefault(cause, {"expected": 0, "tp": 0, "fp": 0, "fn": 0})
            counts["expected"] += sum(1 for c, _ in want if c == cause)
            counts["tp"] += sum(1 for u in want & got if u[0] == cause)
            counts["fp"] += sum(1 for u in got - want if u[0] == cause)
            counts["fn"] += sum(1 for u in want - got if u[0] == cause)
        for row, col in _confusion(want, got, named):
            matrix.setdefault(row, dict.fromkeys(AXIS, 0)).setdefault(col, 0)
            matrix[row][col] += 1
        healthy.extend({"scenario": name, "node": node, "cause": cause}
                       for cause, node in sorted(got)
                       if _kind(cause) == "node" and node not in named)
        if verdict["ok"]:
            right += 1
        else:
            wrong.append({"scenario": name, "expected": sorted(map(list, want)),
                          "got": sorted(map(list, got)), "missing": verdict["missing"],
                          "unexpected": verdict["unexpected"]})
    causes = {}
    for cause, c in per_cause.items():
        found, real = c["tp"] + c["fp"], c["tp"] + c["fn"]
        causes[cause] = {**c, "precision": c["tp"] / found if found else None,
                         "recall": c["tp"] / real if real else None}
    healthy_nodes = {(h["scenario"], h["node"]) for h in healthy}
    return {"scenarios": total, "right": right, "wrong": wrong, "causes": causes,
            "matrix": matrix, "healthy_nodes_blamed": len(healthy_nodes),
            "healthy_blamed": healthy}


def collect(targets: list[Path]) -> tuple[list[Path], list[str]]:
    """The replay files to score, and notes on what was skipped."""
    notes: list[str] = []
    files: list[Path] = []
    defaults = not targets
    for target in targets or list(DEFAULT_DIRS):
        if target.is_dir():
            files.extend(sorted(target.glob("*.json")))
        elif target.is_file():
            files.append(target)
        elif defaults and target == DEFAULT_DIRS[1]:
            notes.append(f"{target} is absent: its scenarios are not scored")
        else:
            raise SystemExit(f"no such file or folder: {target}")
    return files, notes


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT.parent))
    except ValueError:
        return str(path)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(report: Mapping[str, Any]) -> str:
    lines = [
        "# Diagnosis quality on the replay scenarios", "",
        f"{report['when']} UTC, Python {report['python']}. Scored on REPLAY.md's blame units: "
        "(cause, node), (switch_failure, switch), (application_error, job).", "",
        f"Scenarios right: **{report['right']}/{report['scenarios']}**. "
        f"Healthy nodes blamed: **{report['healthy_nodes_blamed']}**.", "",
    ]
    if report["notes"]:
        lines += [*(f"Note: {n}" for n in report["notes"]), ""]
    lines += ["## Per root cause", "",
              "| cause | expected | TP | FP | FN | precision | recall |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for cause, c in report["causes"].items():
        lines.append(f"| {cause} | {c['expected']} | {c['tp']} | {c['fp']} | {c['fn']} | "
                     f"{_ratio(c['precision'])} | {_ratio(c['recall'])} |")
    axis = list(report["matrix"])
    lines += ["", "## Confusion matrix", "",
              "Per entity (node, switch or job). Rows: the cause the scenario expects (none: "
              "healthy); columns: the cause diagnosed (none: missed).", "",
              "| expected \\ diagnosed | " + " | ".join(axis) + " |",
              "|---|" + "---:|" * len(axis)]
    for row in axis:
        lines.append(f"| {row} | " + " | ".join(str(report["matrix"][row].get(col, 0))
                                                   for col in axis) + " |")
    lines += ["", "## Wrong scenarios", ""]
    if not report["wrong"]:
        lines.append("None.")
    for w in report["wrong"]:
        if "error" in w:
            lines.append(f"- `{w['scenario']}`: cannot be scored: {w['error']}")
        else:
            lines.append(f"- `{w['scenario']}`: expected {w['expected']}, got {w['got']} "
                         f"(missing {w['missing']}, unexpected {w['unexpected']})")
    lines += ["", "## Healthy nodes blamed", ""]
    if not report["healthy_blamed"]:
        lines.append("None.")
    lines += [f"- `{h['scenario']}`: {h['node']} blamed for {h['cause']}"
              for h in report["healthy_blamed"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("targets", nargs="*", type=Path, metavar="DIR_OR_FILE",
                        help="replay files, or folders of them (default: tests/scenarios and "
                             "../shared/scenarios)")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--no-fail", action="store_true",
                        help="exit 0 even when a scenario is wrong or a healthy node blamed")
    args = parser.parse_args(argv)

    files, notes = collect(args.targets)
    scenarios: list[tuple[str, Any]] = []
    for path in files:
        try:
            scenarios.append((_label(path), load(path)))
        except ReplayError as exc:
            scenarios.append((_label(path), exc))  # scored as a wrong scenario, with the error
    report = {"when": f"{datetime.now(UTC):%Y-%m-%d %H:%M}", "python": platform.python_version(),
              "files": [_label(p) for p in files], "notes": notes, **score(scenarios)}
    text = markdown(report)
    print(text)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-quality.md").write_text(text)
    (args.out / "bench-quality.json").write_text(json.dumps(report, indent=1))
    failed = bool(report["wrong"]) or report["healthy_nodes_blamed"] > 0
    if failed:
        print(f"diagnosis quality: {len(report['wrong'])} wrong scenario(s), "
              f"{report['healthy_nodes_blamed']} healthy node(s) blamed", file=sys.stderr)
    return 1 if failed and not args.no_fail else 0


if __name__ == "__main__":
    sys.exit(main())
