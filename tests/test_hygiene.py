"""The checks a reviewer would run: lint clean, migrations committed and linear."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.django_db
def test_migrations_are_committed_and_linear() -> None:
    from django.core.management import call_command
    from django.db.migrations.loader import MigrationLoader

    call_command("makemigrations", "--check", "--dry-run", verbosity=0)  # exits 1 on drift
    loader = MigrationLoader(None, ignore_no_migrations=True)
    for app in ("collectors", "incidents"):
        leaves = loader.graph.leaf_nodes(app)
        assert len(leaves) == 1, f"{app} has diverging migrations: {leaves}"
