"""What collectors add to ``manage.py fleetwatch``: the simulated fleet (``seed``, ``inject``,
``sim``) and the node agent (``agent``).

The project's command (fleetwatch/management/commands/fleetwatch.py) finds ``subcommands`` here
through the app registry, as it does in every installed app, and runs the handler it returns
for the subcommand given; it imports no app by name. A handler writes to the command's
stdout/stderr and raises ``CommandError`` to fail.
"""

from __future__ import annotations

import argparse
import json
from argparse import ArgumentParser, _SubParsersAction
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from collectors.clients.base import ClientError
from collectors.sim import faults
from collectors.sim.fleet import SLOW_KINDS

Handler = Callable[[BaseCommand, dict[str, Any]], None]


def subcommands(sub: _SubParsersAction[ArgumentParser]) -> dict[str, Handler]:
    """Add this app's subcommands to ``sub``; their handlers by name."""
    seed = sub.add_parser("seed", help="create the simulated fleet, the roles and a login")
    seed.add_argument("--reset", action="store_true", help="start the fleet over")
    seed.add_argument("--demo-user", default="",
                      help="create this operator login if it is not there")
    seed.add_argument("--password", default="",
                      help="set this password for --demo-user (new or not); without it a new "
                           "login gets a generated one and an existing login keeps its own")
    seed.add_argument("--rotate-password", action="store_true",
                      help="give --demo-user a new generated password (make run: "
                           "FLEETWATCH_DEMO_ROTATE=1)")

    inject = sub.add_parser("inject", help="inject a fault into the simulated fleet")
    inject.add_argument("--cluster", default=None,
                        help="the simulated cluster (default: FLEETWATCH_CLUSTER)")
    kinds = inject.add_subparsers(dest="fault", required=True)
    xid = kinds.add_parser("xid", help="an XID error on one GPU")
    xid.add_argument("--node", required=True)
    xid.add_argument("--gpu", type=int, default=0)
    xid.add_argument("--code", type=int, default=79)
    flap = kinds.add_parser("link-flap", help="a NIC link going down and up")
    flap.add_argument("--node", required=True)
    flap.add_argument("--count", type=int, default=1)
    switch = kinds.add_parser("switch-down", help="a leaf switch losing all its links")
    switch.add_argument("--switch", required=True)
    slow = kinds.add_parser("slow", help="a GPU alive but slower than its job's peers "
                            "(fail-slow): its SM clock, a power cap, its PCIe link, NVLink")
    slow.add_argument("--node", required=True)
    slow.add_argument("--gpu", type=int, default=-1, help="one GPU (default: every GPU of the "
                      "node)")
    slow.add_argument("--how", choices=SLOW_KINDS, default="clock",
                      help="clock: SM clock lower; power-cap: power capped lower (clocks "
                           "follow); pcie-gen: link at Gen3; pcie-width: link at x8; "
                           "nvlink-bandwidth: NVLink traffic lower")
    slow.add_argument("--percent", type=float, default=30.0,
                      help="how much lower, for clock, power-cap and nvlink-bandwidth "
                           "(default 30)")
    slow.add_argument("--minutes-ago", type=float, default=0.0,
                      help="it began this long ago (a demo need not wait for it to count "
                           "as sustained)")

    sim = sub.add_parser("sim", help="change the simulated fleet's surroundings")
    sim.add_argument("--cluster", default=None,
                     help="the simulated cluster (default: FLEETWATCH_CLUSTER)")
    sim.add_argument("--node", default="")
    sim.add_argument("--no-auto-replace", choices=["on", "off"],
                     help="label the node's pods fleetwatch.io/no-auto-replace=true")
    sim.add_argument("--source-down", default="", help="make a source unreachable")
    sim.add_argument("--source-up", default="", help="bring a source back")
    sim.add_argument("--finish-job", default="", metavar="JOBID",
                     help="a running job ends on its own and its nodes fall idle (a free "
                          "canary for the fire drills, say)")
    sim.add_argument("--show", action="store_true",
                     help="print a summary: nodes by state, GPUs by health, faults, jobs")
    sim.add_argument("--json", action="store_true",
                     help="with --show: the whole state file as JSON instead (for scripts)")

    # The node agent is a package of its own (collectors/agent, `fleetwatch-agent`); this is
    # the same command for a node that has the server installed.
    from collectors.agent.cli import parser as agent_parser

    sub.add_parser("agent", parents=[agent_parser()], add_help=False,
                   help="run the node agent on this GPU node (the fleetwatch-agent command)")
    return {"seed": clients_fail_as_command(_seed),
            "inject": clients_fail_as_command(_inject),
            "sim": clients_fail_as_command(_sim),
            "agent": clients_fail_as_command(_agent)}


def clients_fail_as_command(handler: Handler) -> Handler:
    """A client's refusal (no such node, a source down) ends the command with its message,
    not a traceback."""

    @wraps(handler)
    def run(command: BaseCommand, opts: dict[str, Any]) -> None:
        try:
            handler(command, opts)
        except ClientError as exc:
            raise CommandError(str(exc)) from exc

    return run


def _seed(command: BaseCommand, opts: dict[str, Any]) -> None:
    from collectors.roles import roles_ensure
    from collectors.sources import cluster_names, sources_of

    clusters = cluster_names()
    for cluster in clusters:
        which = f" {cluster}" if len(clusters) > 1 else ""
        if sources_of(cluster).fleet == "sim":
            created = faults.fleet_seed(reset=opts["reset"], cluster=cluster)
            command.stdout.write(f"simulated fleet{which} "
                                 + ("created" if created else "already there"))
        else:
            command.stdout.write(f"real sources{which}: the fleet is whatever Slurm, "
                                 "Kubernetes and Prometheus report")
    roles_ensure()
    if opts["demo_user"]:
        from django.conf import settings

        from collectors.roles import demo_login_ensure

        user = opts["demo_user"]
        password, how = demo_login_ensure(user, settings.DATA_DIR, password=opts["password"],
                                          rotate=opts["rotate_password"])
        if password is None:
            command.stdout.write(f"login: {user} (password unchanged, changed since FleetWatch "
                                 "set it; --rotate-password or FLEETWATCH_DEMO_PASSWORD sets one)")
        else:
            command.stdout.write(f"login: {user} / {password}"
                                 + ("  (kept from the last start)" if how == "kept" else ""))


def _inject(command: BaseCommand, opts: dict[str, Any]) -> None:
    fault = opts["fault"]
    what = faults.fault_inject(
        fault, node=opts.get("node", ""), gpu=opts.get("gpu", 0),
        code=opts.get("code", 79), count=opts.get("count", 1),
        switch=opts.get("switch", ""), how=opts.get("how", "clock"),
        percent=opts.get("percent", 30.0), minutes_ago=opts.get("minutes_ago", 0.0),
        cluster=opts.get("cluster"),
    )
    command.stdout.write(f"injected: {what}")


def _agent(command: BaseCommand, opts: dict[str, Any]) -> None:
    from collectors.agent.cli import parser, run

    names = vars(parser().parse_args([])).keys()
    code = run(argparse.Namespace(**{k: v for k, v in opts.items() if k in names}))
    if code:
        raise CommandError(f"the agent stopped with status {code}")


def _sim(command: BaseCommand, opts: dict[str, Any]) -> None:
    if opts["no_auto_replace"]:
        if not opts["node"]:
            raise CommandError("--no-auto-replace needs --node")
        command.stdout.write(faults.pod_label_set(
            opts["node"], no_auto_replace=opts["no_auto_replace"] == "on",
            cluster=opts["cluster"]))
    if opts["source_down"]:
        command.stdout.write(faults.source_outage_set(opts["source_down"], down=True,
                                                      cluster=opts["cluster"]))
    if opts["source_up"]:
        command.stdout.write(faults.source_outage_set(opts["source_up"], down=False,
                                                      cluster=opts["cluster"]))
    if opts["finish_job"]:
        command.stdout.write(faults.job_finish(opts["finish_job"], cluster=opts["cluster"]))
    if opts["show"] and opts["json"]:
        command.stdout.write(json.dumps(faults.fleet_snapshot(opts["cluster"]), indent=1,
                                        sort_keys=True))
    elif opts["show"]:
        command.stdout.write(summary_text(faults.fleet_summary(opts["cluster"])))
    elif opts["json"]:
        raise CommandError("--json goes with --show")


def summary_text(summary: dict[str, Any]) -> str:
    """``sim --show`` for a person: a few short tables, no JSON."""
    lines = ["nodes"]
    for state, names in summary["nodes"].items():
        lines.append(f"  {state:<13}{len(names):>3}  {_names(names)}")
    lines.append("gpus (in service)")
    lines += [f"  {health:<13}{count:>3}" for health, count in summary["gpus"].items()]
    lines.append("faults injected (still standing)")
    lines += [f"  {fault}" for fault in summary["faults"]] or ["  none"]
    lines.append("jobs")
    lines.append(f"  {'id':<6}{'name':<20}{'user':<8}{'state':<11}{'nodes':>5}{'step':>7}"
                 f"{'restarts':>10}")
    lines += [f"  {j['id']:<6}{j['name'][:19]:<20}{j['user'][:7]:<8}{j['state']:<11}"
              f"{j['nodes']:>5}{j['step']:>7}{j['restarts']:>10}" for j in summary["jobs"]]
    if summary["down_sources"]:
        lines.append("sources down: " + ", ".join(summary["down_sources"]))
    return "\n".join(lines)


def _names(names: list[str], shown: int = 4) -> str:
    """gpu-001..gpu-004 +12 more: enough to find a node without a line per node."""
    more = f" +{len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
