"""Acceptance checks: what FleetWatch runs on a node before it goes back to Slurm service.

The return-to-service gate (``incidents.remediation.gate``) runs these as ordinary Slurm jobs
in a reservation holding only the node. Which checks run is configuration, per node pool and
per kind of repair (FLEETWATCH_GATE_CHECKS); the catalogue below is what ships, and a site adds
or overrides entries with a file (FLEETWATCH_GATE_FILE, same shape as ``catalogue_load``
reads). Figures are compared per GPU model (``THRESHOLDS``): the gate hands the matching
thresholds to the check program in its environment (``threshold_env``).

A check program's contract (deploy/checks/README.md): it prints what it found, ending with one
JSON line (``{"check": ..., "ok": bool, ...}``), and exits

* 0: passed;
* 77 (``EXIT_CANNOT_RUN``, automake's "skipped"): it could not check (its vendor tool is not
  installed, no GPU runtime): the gate holds the node and says why, never resumes it;
* 126/127 (the shell's "not executable"/"not found"): the program itself is missing: likewise;
* anything else: failed.

Standard library only: imported by settings, the gate, the sim and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

# Exit statuses a check may end with that mean "could not check" rather than "failed".
EXIT_CANNOT_RUN: Final = 77
EXITS_CANNOT_RUN: Final = frozenset({EXIT_CANNOT_RUN, 126, 127})

# The reservation and job names the gate gives (and only these does it adopt or remove).
RESERVATION_PREFIX: Final = "fleetwatch-gate-"
CHECK_JOB_PREFIX: Final = "fleetwatch-check-"


class Repair(StrEnum):
    """What happened to a node before its acceptance checks: the key of FLEETWATCH_GATE_CHECKS
    (which checks follow which repair)."""

    REPLACE = "replace"  # a new machine from spare capacity
    REBOOT = "reboot"
    RESET = "reset"  # a GPU reset
    RECOVER = "recover"  # an unreachable node that came back
    LINK = "link"  # a flapping link that has stayed up
    COOL = "cool"  # back to normal temperatures
    LEND = "lend"  # back from being lent (to Kubernetes)
    MANUAL = "manual"  # a person or a program asked (node_gate_start)


REPAIRS: Final[tuple[Repair, ...]] = tuple(Repair)
ANY: Final = "*"  # FLEETWATCH_GATE_CHECKS: any pool / any repair
NONE: Final = "none"  # FLEETWATCH_GATE_CHECKS: no check (the node is resumed unchecked, said so)


@dataclass(frozen=True)
class Check:
    """One acceptance check: a shell command line run on the node by ``/bin/sh``.

    ``{check_dir}`` in the command is where the site installed FleetWatch's check programs on
    its nodes (FLEETWATCH_GATE_CHECK_DIR). ``minutes``: the job's time limit (Slurm kills it
    after that, and the gate counts it failed: a GPU that hangs under load is bad).
    ``figures``: the threshold names (``THRESHOLDS``) it compares against."""

    name: str
    command: str
    minutes: int
    description: str
    figures: tuple[str, ...] = ()
    vendor: str = ""  # the vendor tool it needs on the node ("" = none)


# Threshold names, as the check programs read them (FLEETWATCH_MIN_<NAME> in their environment).
NCCL_BUSBW_GBPS: Final = "nccl_busbw_gbps"  # nccl-tests all_reduce_perf "Avg bus bandwidth"
GEMM_TFLOPS: Final = "gemm_tflops"  # dense BF16 matmul, per GPU
MEMBW_GBPS: Final = "membw_gbps"  # device-to-device copy, per GPU

CHECKS: Final[Mapping[str, Check]] = {c.name: c for c in (
    Check("fleetwatch-check", "{check_dir}/fleetwatch-check", 15,
          "FleetWatch's own check, no vendor tool needed: every GPU Slurm expects is there "
          "and answers (nvidia-smi or /proc/driver/nvidia), a GEMM and memory burn-in on each "
          "GPU where PyTorch is installed, else a CPU and memory burn-in; compares the figures "
          "with the GPU model's thresholds",
          (GEMM_TFLOPS, MEMBW_GBPS)),
    Check("dcgm-diag-1", "{check_dir}/dcgm-diag 1", 5,
          "NVIDIA DCGM quick diagnostic (dcgmi diag -r 1: deployment and software checks)",
          vendor="dcgmi"),
    Check("dcgm-diag-2", "{check_dir}/dcgm-diag 2", 20,
          "NVIDIA DCGM medium diagnostic (dcgmi diag -r 2: adds PCIe, memory and a short "
          "stress test)", vendor="dcgmi"),
    Check("dcgm-diag-3", "{check_dir}/dcgm-diag 3", 60,
          "NVIDIA DCGM long diagnostic (dcgmi diag -r 3: adds targeted stress and power, "
          "memory bandwidth, NVLink)", vendor="dcgmi"),
    Check("nccl-allreduce", "{check_dir}/nccl-allreduce", 15,
          "NCCL all-reduce over every GPU of the node (nccl-tests all_reduce_perf, 8 B to "
          "8 GiB): its average bus bandwidth against the GPU model's figure",
          (NCCL_BUSBW_GBPS,), vendor="all_reduce_perf"),
    Check("gemm-burnin", "python3 {check_dir}/gemm-burnin.py --seconds 120", 10,
          "A GEMM and memory burn-in on every GPU (PyTorch): sustained BF16 TFLOPS and "
          "device memory bandwidth against the GPU model's figures, and no errors",
          (GEMM_TFLOPS, MEMBW_GBPS), vendor="torch"),
)}

# Figures a healthy node reaches, per GPU model: a node below them is not put back into
# service. Starting points at roughly 80% of what these parts sustain in the public nccl-tests
# and matmul results (H100 SXM: ~480 GB/s all-reduce bus bandwidth on 8 GPUs, ~700 dense BF16
# TFLOPS through PyTorch, ~3 TB/s of HBM3 copy bandwidth); calibrate them on the site's own
# known-good nodes and override them in FLEETWATCH_GATE_FILE. Keys are matched as a substring
# of the GPU's model name (DCGM's modelName, "NVIDIA H100 80GB HBM3"), the longest first.
THRESHOLDS: Final[Mapping[str, Mapping[str, float]]] = {
    "H100": {NCCL_BUSBW_GBPS: 360.0, GEMM_TFLOPS: 550.0, MEMBW_GBPS: 2400.0},
    "H200": {NCCL_BUSBW_GBPS: 360.0, GEMM_TFLOPS: 550.0, MEMBW_GBPS: 3600.0},
    "H20": {NCCL_BUSBW_GBPS: 360.0, GEMM_TFLOPS: 110.0, MEMBW_GBPS: 3000.0},
    "B200": {NCCL_BUSBW_GBPS: 650.0, GEMM_TFLOPS: 1100.0, MEMBW_GBPS: 5500.0},
    "A100": {NCCL_BUSBW_GBPS: 180.0, GEMM_TFLOPS: 200.0, MEMBW_GBPS: 1400.0},
    "L40S": {NCCL_BUSBW_GBPS: 15.0, GEMM_TFLOPS: 180.0, MEMBW_GBPS: 650.0},
}

# What runs when FLEETWATCH_GATE_CHECKS does not say: FleetWatch's own check after every
# repair, on every pool (it needs nothing from the vendor, so it runs everywhere it is
# installed). Sites with DCGM and nccl-tests add them per pool.
DEFAULT_SELECTION: Final = f"{ANY}=fleetwatch-check"


@dataclass(frozen=True)
class Catalogue:
    checks: Mapping[str, Check] = field(default_factory=lambda: dict(CHECKS))
    thresholds: Mapping[str, Mapping[str, float]] = field(default_factory=lambda: dict(THRESHOLDS))

    def thresholds_for(self, model: str) -> tuple[str, Mapping[str, float]]:
        """(the key matched, its figures) for a GPU model name; ("", {}) when none matches."""
        upper = model.upper()
        for key in sorted(self.thresholds, key=len, reverse=True):
            if key.upper() in upper:
                return key, self.thresholds[key]
        return "", {}


def threshold_env(figures: Mapping[str, float]) -> dict[str, str]:
    """The environment a check program reads its thresholds from."""
    return {f"FLEETWATCH_MIN_{name.upper()}": f"{value:g}" for name, value in sorted(figures.items())}


class CatalogueError(ValueError):
    pass


def catalogue_from(data: Any, where: str = "FLEETWATCH_GATE_FILE") -> Catalogue:
    """The shipped catalogue with a site's own laid over it (``data``: what its file holds,
    JSON or YAML, read by the settings)::

        {"checks": {"my-burnin": {"command": "/opt/site/burnin.sh", "minutes": 30,
                                  "description": "...", "figures": ["gemm_tflops"]}},
         "thresholds": {"H100": {"nccl_busbw_gbps": 420, "gemm_tflops": 620}}}

    A check or a model named again replaces the shipped one (a model's figures are merged);
    anything malformed is refused naming the entry."""
    if data is None:
        return Catalogue()
    if not isinstance(data, Mapping):
        raise CatalogueError(f"{where}: not an object with checks and thresholds")
    unknown = set(data) - {"checks", "thresholds"}
    if unknown:
        raise CatalogueError(f"{where}: unknown keys {sorted(unknown)} (checks, thresholds)")
    checks = dict(CHECKS)
    for name, raw in (data.get("checks") or {}).items():
        if not isinstance(raw, Mapping) or not isinstance(raw.get("command"), str) \
                or not raw["command"].strip():
            raise CatalogueError(f"{where}: check {name!r} needs a command (a shell command "
                                 "line)")
        minutes = raw.get("minutes", 15)
        if not isinstance(minutes, int) or isinstance(minutes, bool) or minutes < 1:
            raise CatalogueError(f"{where}: check {name!r}: minutes must be a whole number of "
                                 "minutes, at least 1")
        figures = raw.get("figures", [])
        if not isinstance(figures, list) or not all(isinstance(f, str) for f in figures):
            raise CatalogueError(f"{where}: check {name!r}: figures must be a list of "
                                 "threshold names")
        checks[str(name)] = Check(str(name), raw["command"].strip(), minutes,
                                  str(raw.get("description", "")), tuple(figures),
                                  str(raw.get("vendor", "")))
    thresholds = {k: dict(v) for k, v in THRESHOLDS.items()}
    for model, figures in (data.get("thresholds") or {}).items():
        if not isinstance(figures, Mapping) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
                for v in figures.values()):
            raise CatalogueError(f"{where}: thresholds of {model!r} must map figure names to "
                                 "numbers")
        thresholds.setdefault(str(model), {}).update(
            {str(k): float(v) for k, v in figures.items()})
    return Catalogue(checks, thresholds)


# pool -> repair -> check names ("" pool / repair key: ANY)
Selection = dict[str, dict[str, tuple[str, ...]]]


def selection_parse(text: str, known: Mapping[str, Check], setting: str = "FLEETWATCH_GATE_CHECKS",
                    ) -> Selection:
    """``[POOL:]REPAIR=CHECK+CHECK,...`` -> {pool: {repair: checks}}. ``*`` stands for any
    pool or any repair; ``none`` for no check. The most specific entry wins (pool and repair,
    then pool, then repair, then ``*``)."""
    out: Selection = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        pool, _, repair = key.strip().rpartition(":")
        pool, repair, value = pool.strip() or ANY, repair.strip(), value.strip()
        if not sep or not repair or not value:
            raise CatalogueError(f"{setting}: {item!r} is not [POOL:]REPAIR=CHECK+CHECK "
                                 f"(REPAIR one of *, {', '.join(REPAIRS)})")
        if repair != ANY and repair not in REPAIRS:
            raise CatalogueError(f"{setting}: {item!r}: no repair {repair!r} (one of *, "
                                 f"{', '.join(REPAIRS)})")
        names = () if value == NONE else tuple(n.strip() for n in value.split("+") if n.strip())
        missing = [n for n in names if n not in known]
        if missing:
            raise CatalogueError(f"{setting}: {item!r}: no check {', '.join(missing)} (known: "
                                 f"{', '.join(sorted(known))}; add one in FLEETWATCH_GATE_FILE)")
        out.setdefault(pool, {})[repair] = names
    return out


def selection_for(selection: Selection, pool: str, repair: str) -> tuple[tuple[str, ...], str]:
    """(the checks to run, the entry that chose them) for a node of ``pool`` after ``repair``;
    ((), "") when nothing is configured for it."""
    for p, r in ((pool, repair), (pool, ANY), (ANY, repair), (ANY, ANY)):
        if p in selection and r in selection[p]:
            entry = f"{'' if p == ANY else p + ':'}{r}"
            return selection[p][r], entry
    return (), ""
