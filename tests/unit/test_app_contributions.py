"""The apps contribute what the project exposes: ``manage.py fleetwatch`` subcommands
(``<app>/commands.py``) and ``/metrics`` families (``<app>/metrics.py``), found through the app
registry. The project's wiring imports no app module for them: from the apps it takes only the
shared low modules (who is who, the request id, URL redaction, task names)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from fleetwatch.apps import app_modules
from fleetwatch.management.commands.fleetwatch import Command
from fleetwatch.metrics import app_collectors

ROOT = Path(__file__).resolve().parents[2]
# What fleetwatch/ may import from the apps: shared, low, and no app's contribution.
# (collectors.env and collectors.sources: how settings and each cluster's sources are read.)
SHARED = {"collectors.roles", "collectors.request_id", "collectors.redaction",
          "collectors.queueing", "collectors.knowledge", "collectors.knowledge.causes",
          "collectors.env", "collectors.sources"}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("collectors", "incidents"):  # from collectors import queueing
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "fleetwatch").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_project_takes_only_shared_modules_from_the_apps(path: Path) -> None:
    from_apps = {m for m in _imports(path) if m.split(".")[0] in ("collectors", "incidents")}
    assert from_apps <= SHARED, f"{path.relative_to(ROOT)} imports {sorted(from_apps - SHARED)}"


def test_each_app_contributes_its_commands_and_metrics() -> None:
    assert [m.__name__ for m in app_modules("commands")] == ["collectors.commands",
                                                             "incidents.commands"]
    assert [m.__name__ for m in app_modules("metrics")] == ["collectors.metrics",
                                                            "incidents.metrics"]
    assert [type(c).__name__ for c in app_collectors()] == ["SourceHealthCollector",
                                                            "FleetCollector",
                                                            "IncidentsCollector"]


def test_every_subcommand_is_there() -> None:
    parser = Command().create_parser("manage.py", "fleetwatch")
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub.choices) == sorted(["seed", "inject", "sim", "agent", "steps-resume",
                                          "agent-token", "api-token", "diagnose", "audit", "why",
                                          "drill", "fail-slow"])
