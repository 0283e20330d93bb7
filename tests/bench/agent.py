"""Benchmark: from a kernel XID line written to /dev/kmsg to the incident and the first
remediation action, through the real node agent.

Run by ``make bench`` under tests/harness/with-services.sh, as root (it writes to the kernel
log). The stack as deployed: gunicorn with the production config, a Celery worker with beat on
Redis, PostgreSQL (a database of its own, created and dropped here) and the simulated fleet
(``--nodes`` nodes) standing in for Slurm and Kubernetes. Each run starts the agent
(``python -m collectors.agent``, reading the real /dev/kmsg) for another node, waits until it
reads the kernel log, writes an ``NVRM: Xid ... 79`` line for that node to /dev/kmsg and
measures, from the write:

- stored: the agent read the line, spooled it and FleetWatch stored it (the signal's
  ``ingested_at``);
- incident: the incident opened (its ``opened_at``);
- first action: the first outside call of its remediation in the audit trail (the on-call
  notification), what a person would have done first.

Replacements and reboots wait for approval (``FLEETWATCH_STEP_MODES``) so the runs do not
use up the simulated spares; the budget and the storm brake are raised so twenty
remediations may start within minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.bench.burst import _free_port, _get, _wait, on_own_database

ROOT = Path(__file__).resolve().parent.parent.parent
KMSG = Path("/dev/kmsg")


def xid_line(run: int) -> str:
    return (f"NVRM: Xid (PCI:0000:{0x18 + run % 8 * 0x10:02x}:00): 79, pid='<unknown>', "
            f"name=<unknown>, GPU has fallen off the bus. (fleetwatch bench run {run})")


def one_run(run: int, node: str, base: str, tmp: Path, env: dict[str, str]) -> dict[str, float]:
    from incidents.models import AuditEntry, Incident
    from incidents.tokens import agent_token_create

    token = tmp / f"token-{node}"
    token.write_text(agent_token_create(node, actor="system:bench")[1])
    log = tmp / "logs" / f"agent-{node}.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "collectors.agent", "--url", base, "--node", node,
             "--token-file", str(token), "--state-dir", str(tmp / "agent" / node), "--no-nvml",
             "--sysfs-root", str(tmp / "no-infiniband")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: "kernel log: reading /dev/kmsg" in log.read_text()
              and "takes agent protocols" in log.read_text(), 30, f"the agent for {node}")
        line = xid_line(run)
        written = time.time()
        with KMSG.open("w") as kmsg:
            kmsg.write(f"<3>{line}\n")

        def acted() -> Any:
            incident = Incident.objects.filter(nodes__contains=[node]).first()
            if incident is None:
                return None
            call = (AuditEntry.objects.filter(remediation__incident=incident).exclude(call="")
                    .order_by("at").first())
            return (incident, call) if call is not None else None

        try:
            incident, call = _wait(acted, 60, f"the first action for {node}")
        except SystemExit:
            for i in Incident.objects.order_by("pk"):
                rem = i.remediations.first()
                print(i.pk, i.nodes, i.status, i.root_cause, rem and rem.status,
                      rem and rem.status_detail if hasattr(rem, "status_detail") else "",
                      i.explanation[:200])
            raise
        from collectors.models import Signal

        stored = Signal.objects.filter(source="kernel", node_name=node, message=line).get()
    finally:
        agent.terminate()
        agent.wait(15)
    return {"stored": stored.ingested_at.timestamp() - written,
            "incident": incident.opened_at.timestamp() - written,
            "first_action": call.at.timestamp() - written}


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median": round(statistics.median(ordered), 3), "p95": round(p95, 3),
            "min": round(ordered[0], 3), "max": round(ordered[-1], 3)}


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import redis
    from django.core.management import call_command
    from django.db import connection

    from collectors.sim.fleet import SimFleet
    from tests.harness.processes import stop_process_group

    call_command("migrate", verbosity=0)
    redis.Redis.from_url(os.environ["CELERY_BROKER_URL"]).flushdb()
    sim_state = tmp / "sim-fleet.json"
    SimFleet(sim_state, 20.0).seed(nodes=args.nodes)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FLEETWATCH_DATA_DIR": str(tmp / "data"),
           "FLEETWATCH_SIM_STATE": str(sim_state), "LOG_LEVEL": "WARNING",
           "FLEETWATCH_STEP_MODES": "replace=approve,reboot=approve,reset_gpu=approve",
           "FLEETWATCH_BUDGET_MAX_NODES": "1000", "FLEETWATCH_BUDGET_MAX_PERCENT": "100",
           # Twenty incidents in a few minutes are a storm; here they are the experiment.
           "FLEETWATCH_STORM_INCIDENTS": "1000"}
    python = sys.executable
    gunicorn = Path(python).parent / "gunicorn"
    web = [str(gunicorn)] if gunicorn.exists() else [python, "-m", "gunicorn"]
    (tmp / "logs").mkdir()
    procs = []
    for name, cmd in [
        ("worker", [python, "-m", "celery", "-A", "fleetwatch", "worker", "-B",
                    "-Q", "collect,diagnose,remediate,default", "--loglevel", "WARNING",
                    "-s", str(tmp / "beat-schedule")]),
        ("web", [*web, "-c", str(ROOT / "deploy" / "gunicorn.conf.py"), "fleetwatch.wsgi",
                 "--bind", f"127.0.0.1:{port}", "--workers", "2"]),
    ]:
        with open(tmp / "logs" / f"{name}.log", "wb") as out:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    results = []
    try:
        from collectors.models import Node

        _wait(lambda: _get(f"{base}/healthz") == 200, 90, "the web server")
        _wait(lambda: Node.objects.filter(in_service=True).count() >= args.nodes, 90,
              "the first collection of the simulated fleet")
        nodes = sorted(Node.objects.filter(in_service=True).values_list("name", flat=True))
        for run_no in range(args.runs):
            node = nodes[run_no % len(nodes)]
            results.append(one_run(run_no, node, base, tmp, env))
            print(f"run {run_no + 1}/{args.runs} {node}: " + ", ".join(
                f"{k} {v:.3f} s" for k, v in results[-1].items()), flush=True)
    finally:
        for proc in procs:
            stop_process_group(proc)
        connection.close()
    return {"runs": len(results), "nodes": args.nodes,
            **{key: summary([r[key] for r in results]) for key in results[0]},
            "samples": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=24,
                        help="simulated nodes; a run per node while they last (each XID opens "
                             "an incident of its own)")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    if args.runs > args.nodes:
        parser.error("--runs may not exceed --nodes (one incident per node)")
    if not os.access(KMSG, os.W_OK):
        sys.exit("agent bench: writes to /dev/kmsg, which needs root")
    r = on_own_database("agent", run, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent.json").write_text(json.dumps(r, indent=1))
    lines = [
        "# Node agent benchmark", "",
        f"{r['runs']} runs: an `NVRM: Xid ... 79` line written to the real /dev/kmsg, read by "
        "the node agent (`python -m collectors.agent`), pushed to FleetWatch (gunicorn, 2 "
        "workers) and diagnosed and acted on by a Celery worker with beat (PostgreSQL, Redis, "
        f"the simulated fleet of {r['nodes']} nodes). Seconds from the write.", "",
        "| from the kernel line to | median | p95 | min | max |", "|---|---:|---:|---:|---:|",
    ]
    for key, label in (("stored", "signal stored"), ("incident", "incident opened"),
                       ("first_action", "first remediation action (on-call notified)")):
        s = r[key]
        lines.append(f"| {label} | {s['median']:.3f} | {s['p95']:.3f} | {s['min']:.3f} | "
                     f"{s['max']:.3f} |")
    (args.out / "agent.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
