"""A real, private Slurm cluster on this machine, for tests and for people.

It runs Debian's ``slurm-wlm`` (22.05) and ``munge`` from a private directory: its own munged
(socket, key, pid and log under the directory), one ``slurmctld -D`` and one ``slurmd -D -N <name>``
per node, each on its own free loopback port. Nothing under /etc is read or written: every daemon
and every CLI call gets ``-f``/``SLURM_CONF`` pointing into the directory, and munge is reached
through ``AuthInfo=socket=...``.

Each node declares ``Gres=gpu:8`` backed by eight plain files the harness creates (GRES
``AutoDetect=off``), so jobs can ask for ``--gres=gpu:N`` as on a real GPU node.
``topology.conf`` puts the nodes under the given leaf switches and a spine above them.

Importable without Django::

    with SlurmCluster(Path("/tmp/c"), ["gpu-001", "gpu-002"], {"leaf-a": [...]}) as cluster:
        cluster.run("sbatch", "--wrap", "sleep 60")

or from a shell, in the foreground until Ctrl-C::

    python -m tests.harness.slurm_cluster --nodes 'gpu-[001-005]' --dir /tmp/x
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tests.harness.parallel import machine_lock
from tests.harness.processes import stop_process_group

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "scontrol", "sinfo", "squeue", "sbatch",
                  "scancel")
GPUS_PER_NODE = 8
# Requeued jobs wait cred_expire seconds before they may start again (slurm.conf(5),
# AuthInfo); Slurm's default of 120 s would make every requeue test slow.
CRED_EXPIRE = 5


class SlurmClusterError(RuntimeError):
    pass


def scontrol_fields(text: str) -> dict[str, str]:
    """``scontrol show node X`` / ``show job N`` as {field: value} (Reason keeps its spaces)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Reason="):
            fields["Reason"] = line.removeprefix("Reason=")
            continue
        for part in line.split():
            key, _, value = part.partition("=")
            fields.setdefault(key, value)
    return fields


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_binaries() -> list[str]:
    """The Slurm/munge programs this harness needs that are not installed here."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [b for b in SLURM_BINARIES if shutil.which(b, path=search) is None]


def _fake_gpu(path: Path) -> None:
    """A GRES device file: a character device like /dev/null's where this machine lets root
    create one (slurmd wants a device there), else a plain file (slurmd logs it and goes on)."""
    if path.exists():
        return
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        path.touch()


def _which(name: str, dirs: tuple[str, ...] = ()) -> str:
    search = os.pathsep.join([*dirs, os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = shutil.which(name, path=search)
    if found is None:
        raise SlurmClusterError(
            f"{name} is not installed: `apt-get install -y slurm-wlm munge` (make test does it)")
    return found


@dataclass(frozen=True)
class SlurmInstall:
    """Which Slurm the cluster runs: Debian's ``slurm-wlm`` (22.05, on PATH) or a build in a
    prefix (25.11, tests/harness/slurm_build.py)."""

    release: str  # "22.05", "25.11"
    prefix: Path | None = None  # None: the Debian packages on PATH

    @property
    def dirs(self) -> tuple[str, ...]:
        return (str(self.prefix / "bin"), str(self.prefix / "sbin")) if self.prefix else ()

    def which(self, name: str) -> str:
        if name == "munged":  # munge is Debian's in both cases
            return _which(name)
        return _which(name, self.dirs)

    @property
    def has_rest(self) -> bool:
        """slurmrestd with JWT: built into the 25.11 prefix (Debian's 22.05 has no JWT)."""
        return self.prefix is not None

    def version(self) -> str:
        """What the daemon itself says ("slurm-wlm 22.05.8", "slurm 25.11.7")."""
        out = subprocess.run([self.which("slurmctld"), "-V"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or out.stderr.strip()


DEBIAN = SlurmInstall("22.05")
RELEASES = ("22.05", "25.11")


def install_for(release: str) -> SlurmInstall:
    """The install of ``release``: Debian's 22.05, or 25.11 built once into the cache."""
    if release == "22.05":
        return DEBIAN
    if release == "25.11":
        from tests.harness.slurm_build import ensure_built

        return SlurmInstall("25.11", ensure_built())
    raise ValueError(f"no Slurm {release} here (known: {', '.join(RELEASES)})")


class SlurmCluster:
    """One slurmctld, N slurmd and a munged, all private to ``root``.

    ``start()`` returns once every node is IDLE; ``stop()`` kills every daemon it started,
    and runs on any failure inside ``start()`` too, so nothing is left behind.
    """

    def __init__(self, root: Path, nodes: list[str], leaves: dict[str, list[str]],
                 kill_wait: int = 2, partition: str = "gpu",
                 cred_expire: int = CRED_EXPIRE, install: SlurmInstall = DEBIAN,
                 rest: bool | None = None, release: str | None = None) -> None:
        # release: a shorthand for install=install_for(release).
        if release is not None:
            install = install_for(release)
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        self.root = Path(root).resolve()
        self.nodes = list(nodes)
        self.leaves = {leaf: list(members) for leaf, members in leaves.items()}
        unknown = {n for members in self.leaves.values() for n in members} - set(self.nodes)
        if unknown:
            raise ValueError(f"leaves name nodes not in the cluster: {sorted(unknown)}")
        self.kill_wait = kill_wait
        # Slurm's default is 120 s; the failure drill runs with it to time what sites see.
        self.cred_expire = cred_expire
        self.partition = partition
        self.install = install
        # slurmrestd (JWT) runs wherever the install has it, unless asked not to.
        self.rest = install.has_rest if rest is None else rest
        if self.rest and not install.has_rest:
            raise ValueError(f"Slurm {install.release} here has no slurmrestd with JWT")
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        if len(str(self.munge_socket)) > 100:  # a UNIX socket path has 108 bytes at most
            raise ValueError(f"{self.root} is too long a path for munged's socket; use a shorter one")
        self.ctld_port = 0
        self.rest_port = 0
        self.node_ports: dict[str, int] = {}
        self._munged: subprocess.Popen[bytes] | None = None
        self._rest: subprocess.Popen[bytes] | None = None
        self._ctld: subprocess.Popen[bytes] | None = None
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}

    # --- the environment a client needs -------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """What to export to run Slurm's CLI against this cluster (nothing else changes):
        its slurm.conf, and this install's commands first on PATH."""
        env = {"SLURM_CONF": str(self.conf)}
        if self.install.dirs:
            env["PATH"] = os.pathsep.join([*self.install.dirs, os.environ.get("PATH", "")])
        return env

    @property
    def bin_dir(self) -> str | None:
        """Where this install's client commands are (None: Debian's, on PATH)."""
        return self.install.dirs[0] if self.install.dirs else None

    @property
    def rest_url(self) -> str:
        """slurmrestd's base URL (``rest`` clusters only)."""
        if not self.rest:
            raise SlurmClusterError("this cluster runs no slurmrestd")
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def slurmctld_url(self) -> str:
        """slurmctld's own HTTP endpoints (25.11: /readyz, /livez, /metrics/...)."""
        return f"http://127.0.0.1:{self.ctld_port}"

    @property
    def jwt_key(self) -> Path:
        return self.root / "state" / "jwt_hs256.key"

    def token(self, user: str = "root", lifespan: int = 3600) -> str:
        """A JWT for ``user`` from ``scontrol token`` (rest clusters only)."""
        out = self.run("scontrol", "token", f"username={user}", f"lifespan={lifespan}",
                       check=True).stdout.strip()
        return out.removeprefix("SLURM_JWT=")

    def run(self, *args: str, check: bool = False, timeout: float = 30.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run one Slurm command (``scontrol``, ``squeue``, ``sbatch``...) against this cluster."""
        return subprocess.run(
            list(args), env={**os.environ, **self.env}, capture_output=True, text=True,
            timeout=timeout, check=check, input=input, cwd=self.root,
        )

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        try:
            self._write_config()
            self._start_munged()
            self.start_controller()
            for node in self.nodes:
                self._start_slurmd(node)
            self.wait_for_nodes("IDLE", timeout=timeout)
            if self.rest:
                self.start_rest()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill every daemon this harness started (slurmrestd and slurmd first, then
        slurmctld, then munged)."""
        self.stop_rest()
        for node in list(self._slurmd):
            self._kill(self._slurmd.pop(node))
        # slurmstepd daemonizes out of slurmd's session, and the job's processes with it.
        self._kill_job_processes()
        self.stop_controller()
        if self._munged is not None:
            self._kill(self._munged)
            self._munged = None

    def stop_controller(self) -> None:
        """Kill slurmctld, as an outage would (state stays in StateSaveLocation)."""
        if self._ctld is not None:
            self._kill(self._ctld)
            self._ctld = None

    def start_controller(self, timeout: float = 30.0) -> None:
        """Start slurmctld (again) and wait until it answers."""
        if self._ctld is not None and self._ctld.poll() is None:
            return
        # -i: ignore errors in saved state; a restart keeps nodes and jobs (no -c).
        self._ctld = self._spawn("slurmctld", [self.install.which("slurmctld"), "-D", "-i", "-f",
                                               str(self.conf)],
                                 self.root / "log" / "slurmctld.out")
        self._wait(lambda: self.run("scontrol", "ping", timeout=10).stdout.find("is UP") >= 0,
                   timeout, "slurmctld to answer `scontrol ping`", self._ctld,
                   self.root / "log" / "slurmctld.log")

    def start_rest(self, timeout: float = 30.0) -> None:
        """Start slurmrestd on a free loopback port and wait until it serves its OpenAPI.

        It refuses to run as root (SlurmUser here): it starts as root to read the config and
        drops to the unprivileged ``slurmrestd`` user (``-u``/``-g``), created if missing.
        ``SLURM_JWT=daemon``: it forwards each client's token to slurmctld over auth/jwt and
        needs neither munge nor the JWT key.
        """
        if self._rest is not None and self._rest.poll() is None:
            return
        # Under a lock: two clusters starting at once (xdist workers) would both find no user
        # and the second useradd would fail.
        with machine_lock("useradd-slurmrestd"):
            if subprocess.run(["id", "slurmrestd"], capture_output=True).returncode != 0:
                subprocess.run(["useradd", "-r", "-M", "-U", "-s", "/usr/sbin/nologin",
                                "slurmrestd"], check=True, capture_output=True)
        self.rest_port = self.rest_port or free_port()
        # Once it has dropped to its user it reads slurm.conf (and gres.conf, topology.conf
        # beside it): the folders above them must let it through (pytest's are 0700).
        for folder in [self.conf.parent, *self.conf.parent.parents]:
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH:
                folder.chmod(mode | stat.S_IXOTH)
        for conf in self.conf.parent.glob("*.conf"):
            conf.chmod(conf.stat().st_mode | stat.S_IROTH)
        log = self.root / "log" / "slurmrestd.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as handle:
            self._rest = subprocess.Popen(
                [self.install.which("slurmrestd"), "-f", str(self.conf), "-a", "rest_auth/jwt",
                 "-s", "slurmctld,util", "-u", "slurmrestd", "-g", "slurmrestd",
                 f"127.0.0.1:{self.rest_port}"],
                stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                env={**os.environ, **self.env, "SLURM_JWT": "daemon",
                     "SLURMRESTD_DEBUG_STDERR": "info"},
                start_new_session=True)

        request = urllib.request.Request(f"{self.rest_url}/openapi/v3", headers={
            "X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": self.token(lifespan=120)})

        def serving() -> bool:
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    return bool(answer.status == 200)
            except OSError:
                return False

        self._wait(serving, timeout, "slurmrestd to serve /openapi/v3", self._rest, log)

    def stop_rest(self) -> None:
        """Kill slurmrestd, as an outage would."""
        if self._rest is not None:
            self._kill(self._rest)
            self._rest = None

    def restart_node(self, node: str) -> None:
        """Stop and start one slurmd (``-b``: report a reboot, as after RebootProgram); it
        registers again within a second or two (wait_for_nodes() to see it)."""
        proc = self._slurmd.pop(node, None)
        if proc is not None:
            self._kill(proc)
        self._start_slurmd(node, reboot=True)

    def reboot_requests(self) -> list[str]:
        """Nodes whose RebootProgram ran and that wait for complete_reboot()."""
        return sorted(p.name.removeprefix("reboot-") for p in (self.root / "run").glob("reboot-*"))

    # slurmctld takes a node for rebooted when the boot time it registers with (whole seconds:
    # the registration's time less the uptime slurmd reports) is not before the second the
    # reboot was asked in (waiting_for_node_boot() in node_mgr.c); a slurmd started again within
    # that second, or reporting an uptime of 1 s, is "still waiting for boot" until
    # ResumeTimeout marks the node DOWN. Two seconds after the RebootProgram ran (after the
    # request) it cannot be.
    BOOT_AFTER_REQUEST = 2.0

    def complete_reboot(self, node: str) -> None:
        """Finish a node's reboot: its slurmd comes back reporting a fresh boot."""
        marker = self.root / "run" / f"reboot-{node}"
        with contextlib.suppress(FileNotFoundError):
            asked = marker.stat().st_mtime
            time.sleep(max(0.0, int(asked) + self.BOOT_AFTER_REQUEST - time.time()))
        marker.unlink(missing_ok=True)
        self.restart_node(node)

    # --- waiting --------------------------------------------------------------------------------

    def node_states(self) -> dict[str, str]:
        """``{node: "IDLE+DRAIN"...}`` as ``sinfo`` prints it (long state names)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", timeout=10)
        if out.returncode != 0:
            return {}
        states: dict[str, str] = {}
        for line in out.stdout.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip().upper()
        return states

    def wait_for_nodes(self, state: str, timeout: float = 60.0,
                       nodes: list[str] | None = None) -> None:
        wanted = nodes or self.nodes

        def ready() -> bool:
            states = self.node_states()
            return all(states.get(n) == state.upper() for n in wanted)

        self._wait(ready, timeout, f"nodes {wanted} to be {state}", None,
                   self.root / "log" / "slurmctld.log")

    # --- internals ------------------------------------------------------------------------------

    def _wait(self, predicate: object, timeout: float, what: str,
              proc: subprocess.Popen[bytes] | None, log: Path) -> None:
        assert callable(predicate)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SlurmClusterError(f"{proc.args[0]} exited ({proc.returncode}) waiting for "
                                        f"{what}:\n{self._tail(log)}{self._tail(Path(str(log) + '.out'))}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                if predicate():
                    return
            time.sleep(0.2)
        raise SlurmClusterError(f"timed out after {timeout}s waiting for {what}:\n{self._tail(log)}\n"
                                f"sinfo: {self.node_states()}")

    @staticmethod
    def _tail(path: Path, lines: int = 30) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        except OSError:
            return ""

    def _spawn(self, name: str, argv: list[str], out: Path) -> subprocess.Popen[bytes]:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "ab") as handle:
            # Its own session, so stop() can kill the daemon and anything it forked
            # (slurmstepd and the job's processes for a slurmd) in one go.
            return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.root,
                                    env={**os.environ, **self.env}, start_new_session=True)

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        stop_process_group(proc, timeout=10)

    def _kill_job_processes(self) -> None:
        """Kill the slurmstepd processes of this cluster (they carry its SLURM_CONF in their
        environment) and every process in their sessions: the jobs' scripts and children."""
        marker = f"SLURM_CONF={self.conf}".encode() + b"\0"
        spool = f"{self.root}/spool/".encode()
        sessions: set[int] = set()
        stat: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                stat[pid] = int(fields[3])  # the session id
                if (entry / "comm").read_text().strip() == "slurmstepd" and \
                        marker in (entry / "environ").read_bytes():
                    sessions.add(stat[pid])
                elif spool in (entry / "cmdline").read_bytes():
                    # A batch script of this cluster's (25.11's slurmstepd may be gone
                    # already, leaving its job's session behind).
                    sessions.add(stat[pid])
            except (OSError, IndexError, ValueError):
                continue
        own = {os.getpid(), os.getsid(0)}
        for pid, sid in stat.items():
            if sid in sessions and pid not in own:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def _start_munged(self) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(parents=True, exist_ok=True)
        # munged refuses a key or socket directory that others can write to or read.
        os.chmod(munge_dir, 0o700)
        key = munge_dir / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o600)
        self._munged = self._spawn("munged", [
            self.install.which("munged"), "--foreground", "--force",
            f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}", "--num-threads=4",
        ], self.root / "log" / "munged.out")
        self._wait(self.munge_socket.exists, 15, "munged's socket", self._munged,
                   munge_dir / "munged.log")

    def _start_slurmd(self, node: str, reboot: bool = False) -> None:
        argv = [self.install.which("slurmd"), "-D", "-N", node, "-f", str(self.conf)]
        if reboot:
            argv.append("-b")
        self._slurmd[node] = self._spawn("slurmd", argv, self.root / "log" / f"slurmd-{node}.out")

    def _write_config(self) -> None:
        for sub in ("etc", "state", "spool", "log", "run", "gpus", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.ctld_port = self.ctld_port or free_port()
        for node in self.nodes:
            self.node_ports.setdefault(node, free_port())
        etc = self.conf.parent
        reboot = etc / "reboot.sh"
        # RebootProgram runs under the node's slurmd (as root). Rebooting this machine is not an
        # option: it notes which node asked (the -N of the slurmd above it) for
        # complete_reboot(), which restarts that slurmd with -b, as a rebooted node's would be.
        reboot.write_text(
            "#!/bin/sh\n"
            "pid=$PPID\n"
            "while [ \"$pid\" -gt 1 ]; do\n"
            "  node=$(tr '\\0' '\\n' < /proc/$pid/cmdline | grep -A1 -x -- -N | tail -n 1)\n"
            f"  if [ -n \"$node\" ]; then touch \"{self.root}/run/reboot-$node\"; exit 0; fi\n"
            "  pid=$(awk '{print $4}' /proc/$pid/stat)\n"
            "done\n"
            "exit 1\n")
        reboot.chmod(0o755)
        (etc / "plugstack.conf").write_text("")  # not /etc/slurm/plugstack.conf
        cpus = 4
        node_lines = []
        gres_lines = ["AutoDetect=off"]
        for node in self.nodes:
            devices = self.root / "gpus" / node
            devices.mkdir(parents=True, exist_ok=True)
            for i in range(GPUS_PER_NODE):
                _fake_gpu(devices / f"nvidia{i}")
            node_lines.append(
                f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} "
                f"Port={self.node_ports[node]} CPUs={cpus} RealMemory=4000 "
                f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN")
            gres_lines.append(f"NodeName={node} Name=gpu File={devices}/nvidia[0-{GPUS_PER_NODE - 1}]")
        root = self.root
        modern = ""
        if self.install.prefix is not None:
            # 25.11: JWT beside munge (slurmrestd and `scontrol token`), slurmctld's own
            # /metrics, and no cgroups (the harness must not touch this machine's).
            if not self.jwt_key.exists():
                self.jwt_key.write_bytes(os.urandom(32))
                self.jwt_key.chmod(0o600)
            modern = (f"AuthAltTypes=auth/jwt\nAuthAltParameters=jwt_key={self.jwt_key}\n"
                      "MetricsType=metrics/openmetrics\n")
            (etc / "cgroup.conf").write_text("CgroupPlugin=disabled\n")
        conf = f"""# Written by tests/harness/slurm_cluster.py: a private test cluster.
ClusterName=fleetwatch-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}
{modern}StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={etc}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
{"TopologyPlugin=topology/tree" if self.leaves else "# no leaf switches: no topology plugin"}
# Nodes that were DOWN come back on their own when slurmd registers again.
ReturnToService=2
RebootProgram={reboot}
MailProg=/bin/true
ResumeTimeout=60
# The grace between SIGTERM and SIGKILL when a job is cancelled or requeued.
KillWait={self.kill_wait}
MinJobAge=30
JobRequeue=1
# Schedule at once: a short main loop, no batching of submissions, backfill every second.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,batch_sched_delay=0,sched_min_interval=0
SlurmdTimeout=30
SlurmctldTimeout=30
MessageTimeout=5
InactiveLimit=0
Waittime=0
# This machine is smaller than the fleet it pretends to be.
SlurmdParameters=config_overrides
{chr(10).join(node_lines)}
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        self.conf.write_text(conf)
        (etc / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        topo = []
        for leaf, members in self.leaves.items():
            topo.append(f"SwitchName={leaf} Nodes={','.join(members)}")
        if self.leaves:
            topo.append(f"SwitchName=spine Switches={','.join(self.leaves)}")
        (etc / "topology.conf").write_text("\n".join(topo) + "\n")


def _main(argv: list[str] | None = None) -> int:
    import hostlist

    parser = argparse.ArgumentParser(description="Run a private Slurm cluster in the foreground.")
    parser.add_argument("--nodes", default="gpu-[001-004]", help="a hostlist, e.g. gpu-[001-005]")
    parser.add_argument("--dir", required=True, type=Path, help="where config, state and logs go")
    parser.add_argument("--leaves", type=int, default=2, help="leaf switches to spread nodes over")
    parser.add_argument("--kill-wait", type=int, default=2)
    parser.add_argument("--release", choices=RELEASES, default="22.05",
                        help="Debian's 22.05, or 25.11 built from source (with slurmrestd)")
    args = parser.parse_args(argv)
    nodes = hostlist.expand_hostlist(args.nodes)
    per_leaf = -(-len(nodes) // max(1, args.leaves))
    leaves = {f"leaf-{chr(ord('a') + i)}": nodes[i * per_leaf:(i + 1) * per_leaf]
              for i in range(args.leaves) if nodes[i * per_leaf:(i + 1) * per_leaf]}
    cluster = SlurmCluster(args.dir, nodes, leaves, kill_wait=args.kill_wait,
                           install=install_for(args.release))
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with cluster:
        for key, value in cluster.env.items():
            print(f"export {key}={value}", flush=True)
        if cluster.rest:
            print(f"# slurmrestd: {cluster.rest_url} (token: scontrol token username=root)",
                  flush=True)
        print(f"# {len(nodes)} nodes up; logs in {cluster.root / 'log'}; Ctrl-C stops it",
              flush=True)
        while not stop:
            for node in cluster.reboot_requests():
                print(f"# {node}: RebootProgram ran; restarting its slurmd", flush=True)
                cluster.complete_reboot(node)
            time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
