"""The import graph of the production code: no circle, and arrows that point one way.

Layers, bottom to top: `collectors` (the outside world and the fleet's own objects, with the
Django-free `collectors.knowledge` facts and the Django-free node agent), `incidents` (judgement
and repair; its `diagnosis` package is pure), `fleetwatch` (the project's wiring). A module may
import from its own layer or below, never above, and no set of modules may import each other in
a circle, not even through an import inside a function: such an import only hides a circle
until the day someone calls that function first.

Read with the standard library's `ast`, so the check needs neither Django nor a database.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("collectors", "incidents", "fleetwatch")

# (importer prefix, forbidden target prefix, why)
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("collectors", "incidents", "collectors never import incidents: they announce, incidents listen"),
    ("collectors", "fleetwatch", "apps never import the project's wiring"),
    ("incidents", "fleetwatch", "apps never import the project's wiring"),
    ("incidents.diagnosis", "incidents.", "diagnosis is pure: plain data in, plain data out"),
    ("incidents.diagnosis", "django", "diagnosis is pure: no database, no settings"),
    ("collectors.knowledge", "django", "the shared facts are importable without Django"),
    ("incidents.lending.decide", "django", "the lending decision is pure: plain data in and out"),
    ("incidents.lending.decide", "incidents.", "the lending decision is pure: plain data in and out"),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def production_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            modules[_module_name(path)] = path
    return modules


def _type_checking_only(node: ast.AST, parents: Mapping[ast.AST, ast.AST]) -> bool:
    """An import under `if TYPE_CHECKING:` never runs, so it cannot close a circle."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
            if name == "TYPE_CHECKING":
                return True
    return False


def imports_of(module: str, source: str, *, is_package: bool) -> list[tuple[str, bool]]:
    """Every module `source` imports, anywhere in it (functions too): (name, runs_at_runtime)."""
    tree = ast.parse(source)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            # `from a import b` may import the module a.b: keep both, the caller filters.
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        if names:
            runtime = not _type_checking_only(node, parents)
            found.extend((name, runtime) for name in names)
    return found


def build_graph(modules: Mapping[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(runtime edges between our modules, every imported name per module)."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    raw: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, runtime in imports_of(name, path.read_text(), is_package=path.name == "__init__.py"):
            raw[name].add(target)
            if runtime and target in modules and target != name:
                edges[name].add(target)
    return edges, raw


def circles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _within(name: str, prefix: str) -> bool:
    if prefix.endswith("."):
        return name.startswith(prefix)
    return name == prefix or name.startswith(prefix + ".")


def wrong_way(raw: Mapping[str, Iterable[str]]) -> list[str]:
    problems = []
    for importer, targets in sorted(raw.items()):
        for source_prefix, target_prefix, why in FORBIDDEN:
            if not _within(importer, source_prefix):
                continue
            for target in sorted(set(targets)):
                if _within(target, target_prefix) and not _within(target, source_prefix):
                    problems.append(f"{importer} imports {target}: {why}")
    return sorted(set(problems))


def test_production_code_has_no_import_circle() -> None:
    edges, _ = build_graph(production_modules())
    assert circles(edges) == [], "import circles (lazy imports count):\n" + "\n".join(
        " <-> ".join(c) for c in circles(edges))


def test_arrows_point_one_way() -> None:
    _, raw = build_graph(production_modules())
    problems = wrong_way(raw)
    assert problems == [], "\n".join(problems)


def test_the_checks_catch_what_they_are_for() -> None:
    # A circle through an import inside a function, and an upward arrow from collectors.
    a = imports_of("incidents.a", "def f():\n    from incidents import b\n", is_package=False)
    b = imports_of("incidents.b", "from .a import thing\n", is_package=False)
    names = {"incidents.a", "incidents.b"}
    edges = {
        "incidents.a": {t for t, runtime in a if runtime and t in names},
        "incidents.b": {t for t, runtime in b if runtime and t in names},
    }
    assert circles(edges) == [["incidents.a", "incidents.b"]]
    guarded = imports_of("incidents.c", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from incidents import a\n", is_package=False)
    assert ("incidents", False) in guarded
    upward = {"collectors.x": {"incidents.models", "collectors.y"},
              "incidents.diagnosis.rules": {"incidents.diagnosis.types", "incidents.models"}}
    assert wrong_way(upward) == [
        "collectors.x imports incidents.models: collectors never import incidents: they announce,"
        " incidents listen",
        "incidents.diagnosis.rules imports incidents.models: diagnosis is pure: plain data in,"
        " plain data out",
    ]
