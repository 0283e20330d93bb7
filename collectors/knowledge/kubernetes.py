"""Kubernetes conventions FleetWatch reads and writes (stdlib only: importable everywhere)."""

from __future__ import annotations

# A taint's effects, as the API server accepts them (core/v1 TaintEffect).
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
