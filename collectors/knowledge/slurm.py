"""Slurm conventions FleetWatch reads and writes (stdlib only: importable everywhere)."""

from __future__ import annotations

from collections.abc import Iterable


def index_ranges(indices: Iterable[int]) -> str:
    """GPU indices as Slurm writes them in gres_detail: (4, 5) -> "4-5", (0, 3, 4) -> "0,3-4"."""
    out: list[str] = []
    run: list[int] = []
    for g in sorted(set(indices)):
        if run and g == run[-1] + 1:
            run.append(g)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [g]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
