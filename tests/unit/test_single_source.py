"""One source of truth for GPU and fault knowledge: ``collectors/knowledge/``.

The XID catalogue, DCGM field names and clock-event bits, root-cause labels, risk classes and
the playbook of each cause are written there once. This test reads every module of the apps
and the project (``collectors``, ``incidents``, ``fleetwatch``, ``deploy``; migrations aside,
they are history) with ``ast`` and fails when one of them writes such a fact again, so the next
root cause or DCGM field is one edit. It also checks that the knowledge package needs nothing
but the standard library (the node agent and the diagnosis engine import it).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors.knowledge import RISKS, XID_TABLE, PlaybookName, RootCause, dcgm

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("collectors", "incidents", "fleetwatch", "deploy")
KNOWLEDGE = ROOT / "collectors" / "knowledge"

DCGM_FIELD = re.compile(r"DCGM_FI_[A-Z0-9_]+")
CAUSES = frozenset(c.value for c in RootCause)
CAUSE_NAMES = frozenset(c.name for c in RootCause)
RISK_VALUES = frozenset(r.value for r in RISKS)
PLAYBOOK_NAMES = frozenset(p.value for p in PlaybookName)
CLOCK_BITS = frozenset(dcgm.CLOCK_EVENT_BITS)
# The slowdown bits and above: small numbers (1, 2, 4) alone are too common to mean a mask.
SLOWDOWN_BITS = frozenset(b for b in CLOCK_BITS if b >= dcgm.HW_SLOWDOWN)
XID_CODES = frozenset(XID_TABLE)
STEPS = ROOT / "incidents" / "remediation" / "steps.py"


def _step_kinds() -> frozenset[str]:
    """The keys of ``STEP_KINDS``, read from the source (no Django needed to know them)."""
    for node in ast.walk(ast.parse(STEPS.read_text())):
        if (isinstance(node, ast.AnnAssign | ast.Assign) and "STEP_KINDS" in _targets(node)
                and isinstance(node.value, ast.Dict)):
            return frozenset(_strs(list(node.value.keys)))
    raise AssertionError("STEP_KINDS not found in steps.py")


# Names that hold a clock-event mask or bit when they are given a number.
CLOCK_NAME = re.compile(r"THERMAL|CLOCK|THROTTLE|SLOWDOWN|POWER_BRAKE|_BITS$", re.I)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are docstrings (words about the facts are fine)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _targets(node: ast.Assign | ast.AnnAssign | ast.AugAssign) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = []
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                names.append(sub.id)
            elif isinstance(sub, ast.Attribute):
                names.append(sub.attr)
    return names


def _ints(node: ast.AST) -> list[int]:
    """The integer constants directly inside a collection literal (or frozenset({...}))."""
    if isinstance(node, ast.Call) and node.args:
        return _ints(node.args[0])
    if isinstance(node, ast.Set | ast.Tuple | ast.List):
        elts = node.elts
    elif isinstance(node, ast.Dict):
        elts = [k for k in node.keys if k is not None]
    else:
        return []
    return [e.value for e in elts if isinstance(e, ast.Constant) and type(e.value) is int]


def _strs(nodes: list[ast.expr | None]) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _is_cause_ref(node: ast.expr | None) -> bool:
    """``RootCause.THERMAL``, ``THERMAL`` (a short name for it) or the label itself."""
    if isinstance(node, ast.Attribute):
        return node.attr in CAUSE_NAMES
    if isinstance(node, ast.Name):
        return node.id in CAUSE_NAMES
    return isinstance(node, ast.Constant) and node.value in CAUSES


STEP_KIND_NAMES = _step_kinds()


def find_redefinitions(source: str, where: str = "<source>") -> list[str]:
    """What ``source`` writes that only ``collectors.knowledge`` (or, for step kinds,
    ``incidents.remediation.steps.STEP_KINDS``) may write."""
    tree = ast.parse(source)
    kinds = STEP_KIND_NAMES
    docs = _docstrings(tree)
    found: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if DCGM_FIELD.fullmatch(node.value):
                hit(node, f"DCGM field name {node.value!r} (use collectors.knowledge.dcgm)")
            elif node.value in CAUSES:
                hit(node, f"root-cause label {node.value!r} (use collectors.knowledge.RootCause)")
        elif isinstance(node, ast.Set | ast.Tuple | ast.List):
            risks = set(_strs(list(node.elts))) & RISK_VALUES
            if len(risks) >= 2:
                hit(node, f"risk classes {sorted(risks)} (use collectors.knowledge.RISKS)")
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None]
            if sum(1 for k in keys if isinstance(k, ast.Constant) and k.value in SLOWDOWN_BITS) >= 2:
                hit(node, "clock-event bits (use collectors.knowledge.dcgm.CLOCK_EVENT_BITS)")
            pairs = [(k, v) for k, v in zip(node.keys, node.values, strict=True)
                     if _is_cause_ref(k) and isinstance(v, ast.Constant) and v.value in PLAYBOOK_NAMES]
            if len(pairs) >= 2:
                hit(node, "root cause -> playbook map (use collectors.knowledge.PLAYBOOK_FOR)")
            if len(set(_strs(keys)) & kinds) >= 2:
                hit(node, "a table keyed by step kind (declare it in steps.STEP_KINDS)")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            sides = (node.left, node.right)
            if (all(isinstance(s, ast.Constant) and s.value in CLOCK_BITS for s in sides)
                    and any(s.value in SLOWDOWN_BITS for s in sides if isinstance(s, ast.Constant))):
                hit(node, "clock-event bit mask (use collectors.knowledge.dcgm)")
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and node.value is not None:
            names = _targets(node)
            if any("XID" in n.upper() for n in names):
                codes = set(_ints(node.value)) & XID_CODES
                if len(codes) >= 2:
                    hit(node, f"XID set {sorted(codes)} assigned to {names} "
                              "(use collectors.knowledge.xid)")
            if (any(CLOCK_NAME.search(n) for n in names) and isinstance(node.value, ast.Constant)
                    and type(node.value.value) is int and node.value.value in CLOCK_BITS):
                hit(node, f"clock-event bit assigned to {names} (use collectors.knowledge.dcgm)")
            if any("RISK" in n.upper() for n in names):
                values = [s.value for s in ast.walk(node.value)
                          if isinstance(s, ast.Constant) and s.value in RISK_VALUES]
                if values:
                    hit(node, f"risk class {values} assigned to {names} (use collectors.knowledge.Risk)")
    return found


def _modules() -> Iterator[Path]:
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "migrations" in path.parts or KNOWLEDGE in path.parents or path == STEPS:
                continue
            yield path


def test_no_module_outside_knowledge_redefines_a_fact() -> None:
    found = []
    for path in _modules():
        found += find_redefinitions(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "facts written outside collectors/knowledge/:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    'FATAL_XIDS = frozenset({48, 79, 94})',
    'FAULT_XIDS: frozenset[int] = frozenset([62, 63])',
    'XID_CLASSES = {79: "gpu_hardware"}',  # both an XID map and a label
    'METRIC = "DCGM_FI_DEV_XID_ERRORS"',
    'def f(d):\n    return d.get("metric") == "DCGM_FI_DEV_GPU_TEMP"',
    'THERMAL_BITS = 0x20 | 0x40',
    'HW_SLOWDOWN = 0x8',
    'mask = reasons & (0x20 | 0x40)',
    'NAMES = {0x20: "sw thermal", 0x40: "hw thermal"}',
    'label = "thermal"',
    'if cause == "switch_failure":\n    pass',
    'RISKS = ("replace", "reboot", "reset_gpu")',
    'modes = {r: 1 for r in ["reboot", "replace"]}',
    'RISK_REPLACE = "replace"',
    'FOR = {RootCause.THERMAL: "cool_down", RootCause.NVLINK: "reboot_node"}',
    'PHASE_OF_STEP = {"drain_and_cancel": "drain", "requeue": "requeue"}',
    'LONG_WAITS = {"wait_cool": 86400.0, "wait_link_stable": 86400.0}',
])
def test_the_check_catches_a_planted_redefinition(planted: str) -> None:
    assert find_redefinitions(textwrap.dedent(planted)), planted


@pytest.mark.parametrize("fine", [
    '"""Diagnoses thermal and nvlink faults; reads DCGM_FI_DEV_XID_ERRORS."""',
    'from collectors.knowledge import dcgm\nMETRIC = dcgm.XID_ERRORS',
    'from collectors.knowledge import RootCause\nlabel = RootCause.THERMAL',
    'text.decode("utf-8", "replace")',  # one risk-looking word alone is just a word
    'last_xid = 79',
    'codes = (1, 2, 3)',
    'IB_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 4: "ACTIVE"}',
    'flags = 1 | 2',
    'help = "the pre-DCGM-3.2 name DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"',
])
def test_the_check_leaves_ordinary_code_alone(fine: str) -> None:
    assert find_redefinitions(fine) == []


def test_knowledge_imports_only_the_standard_library() -> None:
    """Read statically (every import in the package, lazy ones too) and for real (a fresh
    interpreter imports the package and nothing outside the standard library is loaded)."""
    stdlib = sys.stdlib_module_names
    for path in sorted(KNOWLEDGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.relative_to(ROOT)}: relative import"
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in stdlib or name.startswith("collectors.knowledge"), (
                    f"{path.relative_to(ROOT)} imports {name}")
    # -S: no site-packages on the path at all, so a third-party import could not even succeed.
    script = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nimport collectors.knowledge\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)"
              " - {'collectors', '__main__'}))")
    out = subprocess.run([sys.executable, "-S", "-c", script], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
