"""Slurm 25.11 for the tests: built once from SchedMD's source into a cached prefix.

No machine here can download Slurm, so the source tarball comes from the environment
(``FLEETWATCH_SLURM_TARBALL``), by default the shared copy beside the checkout
(``../shared/vendor/slurm-25.11.7.tar.gz``, or ``/work/shared/vendor/...`` for a clone
elsewhere). The build goes to ``/var/cache/fleetwatch/slurm-<version>-<sha256[:12]>``
(``FLEETWATCH_SLURM_CACHE`` is the folder above it), keyed by the tarball's contents: another
tarball gets another prefix, the same one is never built twice. A marker file written last says
the prefix is complete, so an interrupted build is redone, and an flock keeps two test runs from
building at once.

The configure flags are those of ``../shared/slurm/RECIPE.md`` (slurmrestd, multiple slurmd,
JWT, JSON, YAML, munge, hwloc, lz4) plus ``--disable-static``: the static plugin archives were
341 MB of the 428 MB, and nothing here links against them (87 MB installed).

    python -m tests.harness.slurm_build          # builds if needed, prints the prefix
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARBALL_NAME = "slurm-25.11.7.tar.gz"
DEFAULT_TARBALLS = (REPO.parent / "shared" / "vendor" / TARBALL_NAME,
                    Path("/work/shared/vendor") / TARBALL_NAME)
DEFAULT_CACHE = Path("/var/cache/fleetwatch")
MARKER = ".fleetwatch-build-complete"
# Debian packages the build needs (headers for slurmrestd, JWT, JSON, YAML, munge, hwloc).
BUILD_PACKAGES = ("build-essential", "pkg-config", "munge", "libmunge-dev", "libjwt-dev",
                  "libjson-c-dev", "libhttp-parser-dev", "libyaml-dev", "libpam0g-dev",
                  "liblz4-dev", "libhwloc-dev", "zlib1g-dev")
CONFIGURE_FLAGS = ("--enable-slurmrestd", "--enable-multiple-slurmd", "--with-jwt", "--with-json",
                   "--with-http-parser", "--with-yaml", "--with-munge", "--with-hwloc",
                   "--with-lz4", "--disable-sview", "--disable-x11", "--disable-static")


class SlurmBuildError(RuntimeError):
    pass


def tarball() -> Path:
    """The Slurm source tarball: FLEETWATCH_SLURM_TARBALL, else the shared copy."""
    configured = os.environ.get("FLEETWATCH_SLURM_TARBALL")
    if configured:
        path = Path(configured)
        if not path.is_file():
            raise SlurmBuildError(f"FLEETWATCH_SLURM_TARBALL={configured}: no such file")
        return path
    for path in DEFAULT_TARBALLS:
        if path.is_file():
            return path
    raise SlurmBuildError(
        f"no Slurm source: set FLEETWATCH_SLURM_TARBALL to {TARBALL_NAME} (looked in "
        f"{', '.join(str(p) for p in DEFAULT_TARBALLS)})")


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()[:12]


def _version(path: Path) -> str:
    match = re.search(r"slurm-(\d+\.\d+\.\d+)", path.name)
    if match:
        return match.group(1)
    with tarfile.open(path) as tar:  # a renamed tarball: its top folder says
        first = tar.next()
    match = re.search(r"(\d+[.-]\d+[.-]\d+)", first.name if first else "")
    if not match:
        raise SlurmBuildError(f"cannot tell the Slurm version of {path}")
    return match.group(1).replace("-", ".")


def prefix_for(path: Path) -> Path:
    cache = Path(os.environ.get("FLEETWATCH_SLURM_CACHE") or DEFAULT_CACHE)
    return cache / f"slurm-{_version(path)}-{_digest(path)}"


def is_built(prefix: Path) -> bool:
    return (prefix / MARKER).is_file() and (prefix / "sbin" / "slurmrestd").is_file()


@contextlib.contextmanager
def _lock(prefix: Path) -> Iterator[None]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(prefix.parent / f".{prefix.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _missing_packages() -> list[str]:
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n",
                          *BUILD_PACKAGES], capture_output=True, text=True)
    installed = {line.split()[0] for line in out.stdout.splitlines()
                 if line.endswith(" installed")}
    return [p for p in BUILD_PACKAGES if p not in installed]


def _run(argv: list[str], cwd: Path, log: Path) -> None:
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.run(["nice", "-n", "10", *argv], cwd=cwd, stdout=out,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise SlurmBuildError(f"`{' '.join(argv)}` failed ({proc.returncode}); log {log}:\n{tail}")


def ensure_built(say: bool = True) -> Path:
    """The prefix of a complete Slurm build of the configured tarball, building it first if
    there is none (about 5 minutes on 2 cores)."""
    source = tarball()
    prefix = prefix_for(source)
    if is_built(prefix):
        return prefix
    with _lock(prefix):
        if is_built(prefix):  # another run built it while this one waited
            return prefix
        missing = _missing_packages()
        if missing:
            if os.geteuid() != 0:
                raise SlurmBuildError(f"missing Debian packages: {' '.join(missing)}")
            subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                            *missing], check=True, env={**os.environ,
                                                         "DEBIAN_FRONTEND": "noninteractive"})
        started = time.monotonic()
        if say:
            print(f"building Slurm from {source} into {prefix} (once; about 5 minutes)",
                  file=sys.stderr, flush=True)
        shutil.rmtree(prefix, ignore_errors=True)  # an interrupted build's leftovers
        with tempfile.TemporaryDirectory(prefix="fleetwatch-slurm-build-") as tmp:
            work = Path(tmp)
            log = prefix.parent / f"{prefix.name}.build.log"
            log.write_text("")
            with tarfile.open(source) as tar:
                tar.extractall(work, filter="tar")
            (src,) = [p for p in work.iterdir() if p.is_dir()]
            _run(["./configure", f"--prefix={prefix}", f"--sysconfdir={prefix}/etc",
                  *CONFIGURE_FLAGS], src, log)
            jobs = str(max(1, os.cpu_count() or 1))
            _run(["make", f"-j{jobs}"], src, log)
            _run(["make", f"-j{jobs}", "install"], src, log)
        (prefix / MARKER).write_text(_digest(source) + "\n")
        if say:
            print(f"built Slurm in {time.monotonic() - started:.0f} s: {prefix}",
                  file=sys.stderr, flush=True)
    return prefix


if __name__ == "__main__":
    try:
        print(ensure_built())
    except SlurmBuildError as exc:
        print(f"slurm_build: {exc}", file=sys.stderr)
        sys.exit(1)
