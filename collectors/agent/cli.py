"""``fleetwatch-agent``: the node agent's command. Every option has an environment variable
(for a DaemonSet or a systemd EnvironmentFile); the command line wins."""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import IO

from collectors.agent import __version__
from collectors.agent.gpud import GpudSource
from collectors.agent.infiniband import InfinibandSource
from collectors.agent.kernel import open_kernel_log
from collectors.agent.nvml import NvmlEvents, NvmlSource
from collectors.agent.push import Pusher, VersionMismatch
from collectors.agent.runner import Agent, KernelLog, Poller, StateFile, env_number, pci_key
from collectors.agent.spool import Spool
from collectors.knowledge import agent as proto

log = logging.getLogger("fleetwatch-agent")

EXIT_USAGE = 2  # a setting is wrong or missing: restarting will not help
EXIT_VERSION = 3  # FleetWatch does not take this agent
KERNEL_LOG_CHOICES = ("auto", "kmsg", "journal", "file", "off")
EXIT_RESTART = 4  # NVML needs a fresh process (a driver upgraded in place)


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="fleetwatch-agent",
        description="FleetWatch's node agent: pushes this GPU node's kernel log lines, NVML "
                    "events and changes, and InfiniBand port changes to FleetWatch.")
    p.add_argument("--version", action="version",
                   version=f"fleetwatch-agent {__version__} (protocol {proto.PROTOCOL})")
    p.add_argument("--url", default=env("FLEETWATCH_URL", ""),
                   help="FleetWatch's base URL ($FLEETWATCH_URL)")
    p.add_argument("--node", default=env("FLEETWATCH_AGENT_NODE") or os.uname().nodename,
                   help="this node's name in FleetWatch ($FLEETWATCH_AGENT_NODE; default: the "
                        "host name)")
    p.add_argument("--cluster", default=env("FLEETWATCH_AGENT_CLUSTER", ""),
                   help="this node's cluster, where one FleetWatch watches several "
                        "($FLEETWATCH_AGENT_CLUSTER; default: FleetWatch's FLEETWATCH_CLUSTER)")
    p.add_argument("--token-file", default=env("FLEETWATCH_AGENT_TOKEN_FILE", ""),
                   help="file holding the node's token; '{node}' in it is replaced by the node "
                        "name ($FLEETWATCH_AGENT_TOKEN_FILE; else $FLEETWATCH_AGENT_TOKEN)")
    p.add_argument("--state-dir", default=env("FLEETWATCH_AGENT_STATE_DIR",
                                              "/var/lib/fleetwatch-agent"),
                   help="the spool and the state file ($FLEETWATCH_AGENT_STATE_DIR)")
    p.add_argument("--spool", default="", help="the spool file (default: STATE_DIR/spool.jsonl)")
    p.add_argument("--spool-max-mb", type=float,
                   default=env_number("FLEETWATCH_AGENT_SPOOL_MAX_MB", 256),
                   help="cap on the spool's size; at the cap newer records are dropped and "
                        "counted ($FLEETWATCH_AGENT_SPOOL_MAX_MB, default 256)")
    p.add_argument("--interval", type=float,
                   default=env_number("FLEETWATCH_AGENT_INTERVAL", 5.0),
                   help="seconds between NVML and InfiniBand readings; kernel lines and NVML "
                        "events are sent as they come ($FLEETWATCH_AGENT_INTERVAL, default 5)")
    p.add_argument("--passes", type=int, default=None, help="stop after N passes (tests)")
    p.add_argument("--kmsg", default=env("FLEETWATCH_AGENT_KMSG", "/dev/kmsg"),
                   help="the kernel log: /dev/kmsg, or a file to follow ($FLEETWATCH_AGENT_KMSG)")
    p.add_argument("--kernel-log", choices=KERNEL_LOG_CHOICES,
                   default=env("FLEETWATCH_AGENT_KERNEL_LOG", "auto"),
                   help="auto: /dev/kmsg, else journald ($FLEETWATCH_AGENT_KERNEL_LOG)")
    p.add_argument("--journal-command", default=env("FLEETWATCH_AGENT_JOURNALCTL", "journalctl"),
                   help="journalctl, for the journald fallback ($FLEETWATCH_AGENT_JOURNALCTL)")
    p.add_argument("--sysfs-root", default=env("FLEETWATCH_AGENT_SYSFS_IB",
                                               "/sys/class/infiniband"))
    p.add_argument("--no-nvml", action="store_true",
                   default=env("FLEETWATCH_AGENT_NO_NVML", "").strip().lower()
                   in ("1", "true", "yes", "on"),
                   help="no GPUs to read here ($FLEETWATCH_AGENT_NO_NVML=1)")
    p.add_argument("--gpud-url", default=env("FLEETWATCH_AGENT_GPUD_URL", ""),
                   help="the local gpud's API, e.g. https://localhost:15132: forward its events "
                        "($FLEETWATCH_AGENT_GPUD_URL; default: off)")
    p.add_argument("--ca-bundle", default=env("FLEETWATCH_AGENT_CA_BUNDLE", ""),
                   help="CA certificates for FleetWatch's HTTPS ($FLEETWATCH_AGENT_CA_BUNDLE)")
    p.add_argument("--log-level", default=env("FLEETWATCH_AGENT_LOG_LEVEL", "INFO"))
    return p


def read_token(opts: argparse.Namespace) -> str:
    """The node's token; "" when none is given or the file cannot be read (said on stderr)."""
    if opts.token_file:
        path = Path(opts.token_file.replace("{node}", opts.node))
        try:
            return path.read_text().strip()
        except OSError as exc:
            print(f"fleetwatch-agent: cannot read the token file {path}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return ""
    return os.environ.get("FLEETWATCH_AGENT_TOKEN", "").strip()


def settings_problem(opts: argparse.Namespace) -> str:
    """What is wrong with settings that came from the environment (argparse checks only the
    command line's)."""
    if opts.kernel_log not in KERNEL_LOG_CHOICES:
        return (f"FLEETWATCH_AGENT_KERNEL_LOG={opts.kernel_log!r}: one of "
                f"{', '.join(KERNEL_LOG_CHOICES)}")
    if not isinstance(logging.getLevelName(opts.log_level.upper()), int):
        return f"log level {opts.log_level!r}: DEBUG, INFO, WARNING or ERROR"
    if opts.interval < 0:
        return f"interval {opts.interval}: seconds, 0 or more (at least 0.1 is used)"
    if not opts.url:
        return "no FleetWatch URL (--url or FLEETWATCH_URL)"
    return ""


def lock_state_dir(state_dir: Path) -> IO[str] | None:
    """Hold the state directory for this process (two agents on one spool would undo each
    other's writes); None when another agent holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    handle = (state_dir / "agent.lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def nvml_source(node: str) -> NvmlSource | None:
    """NVML when this node has it; a node without the driver runs on (kernel log, NICs)."""
    try:
        import pynvml  # nvidia-ml-py: loads libnvidia-ml.so.1 only at nvmlInit
    except ImportError as exc:
        log.warning("NVML not read: %s", exc)
        return None
    try:
        source = NvmlSource(node, pynvml)
    except Exception as exc:  # no driver, no library, no device node
        log.warning("NVML not read: %s", exc)
        return None
    log.info("NVML: %s", source.describe())
    return source


def build(opts: argparse.Namespace, token: str) -> Agent:
    state_dir = Path(opts.state_dir)
    spool_path = Path(opts.spool) if opts.spool else state_dir / "spool.jsonl"
    pusher = Pusher(opts.url, token, verify=opts.ca_bundle or True, cluster=opts.cluster)
    agent = Agent(opts.node, Spool(spool_path, node=opts.node,
                                   max_bytes=int(opts.spool_max_mb * 1024 * 1024)), pusher)
    agent.spool.clock = agent.clock
    nvml = None if opts.no_nvml else nvml_source(opts.node)
    sources: list[Poller] = []
    if nvml is not None:
        sources.append(nvml)
        agent.events = NvmlEvents(nvml, agent.urgent)
    sources.append(InfinibandSource(opts.node, opts.sysfs_root))
    if opts.gpud_url:
        sources.append(GpudSource(opts.node, opts.gpud_url))
        log.info("gpud events: %s", opts.gpud_url)
    agent.sources = sources

    state = StateFile(state_dir / "state.json")
    reader = None
    if opts.kernel_log != "off":
        reader, how = open_kernel_log(opts.kmsg, state.data, journal_command=opts.journal_command,
                                      mode=opts.kernel_log)
        if reader is None:
            log.error("kernel log not read: %s", how)
            agent.spool.add([{"at": agent.clock(), "source": "kernel", "node": opts.node,
                              "event": proto.KERNEL_LOG_UNREADABLE,
                              "message": f"fleetwatch-agent: kernel log not read: {how}"}])
        else:
            log.info("kernel log: %s", how)

    def gpu_for_pci(key: tuple[int, int, int]) -> int | None:
        if nvml is None:
            return None
        return next((g.index for g in nvml.gpus if g.pci and pci_key(g.pci) == key), None)

    if reader is not None:
        agent.kernel = KernelLog(opts.node, reader, state, agent.urgent, gpu_for_pci)
    return agent


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


def run(opts: argparse.Namespace) -> int:
    """Run the agent until SIGTERM (or ``--passes``); the exit status."""
    problem = settings_problem(opts)
    if problem:
        print(f"fleetwatch-agent: {problem}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=opts.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lock = lock_state_dir(Path(opts.state_dir))
    if lock is None:
        print(f"fleetwatch-agent: another agent is running with {opts.state_dir} (its pid is "
              f"in {Path(opts.state_dir) / 'agent.lock'})", file=sys.stderr)
        return EXIT_USAGE
    token = read_token(opts)
    if not token:
        print("fleetwatch-agent: no token (--token-file, FLEETWATCH_AGENT_TOKEN_FILE or "
              "FLEETWATCH_AGENT_TOKEN; FleetWatch makes one with: manage.py fleetwatch "
              "agent-token --node NAME)", file=sys.stderr)
        return EXIT_USAGE
    agent = build(opts, token)

    def stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping after a last send", signum)
        agent.stopping.set()
        agent.wake.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("fleetwatch-agent %s for %s: pushing to %s, readings every %.1f s", __version__,
             opts.node, opts.url, opts.interval)
    try:
        agent.check_version()
        agent.run(opts.interval, opts.passes)
    except VersionMismatch as exc:
        print(f"fleetwatch-agent: {exc}", file=sys.stderr)
        return EXIT_VERSION
    return EXIT_RESTART if agent.restart_needed else 0

