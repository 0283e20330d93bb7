"""``manage.py fleetwatch``: seed the demo, inject faults, diagnose replay files."""

from __future__ import annotations

import json
import os
import sys
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from collectors.clients.base import ClientError
from collectors.sim import faults


class Command(BaseCommand):
    help = "FleetWatch operations: seed, inject, sim, diagnose, audit verify"

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)

        seed = sub.add_parser("seed", help="create the simulated fleet, the roles and a login")
        seed.add_argument("--reset", action="store_true", help="start the fleet over")
        seed.add_argument("--demo-user", default="",
                          help="create this operator login if it is not there")
        seed.add_argument("--password", default="",
                          help="set this password for --demo-user (new or not); without it a new "
                               "login gets a generated one and an existing login keeps its own")

        sub.add_parser("steps-resume", help="at start-up, before the only worker starts: release "
                       "every step lease and queue the running remediations' steps again "
                       "(embedded default only: SQLite and the filesystem broker)")

        inject = sub.add_parser("inject", help="inject a fault into the simulated fleet")
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

        sim = sub.add_parser("sim", help="change the simulated fleet's surroundings")
        sim.add_argument("--node", default="")
        sim.add_argument("--no-auto-replace", choices=["on", "off"],
                         help="label the node's pods fleetwatch.io/no-auto-replace=true")
        sim.add_argument("--source-down", default="", help="make a source unreachable")
        sim.add_argument("--source-up", default="", help="bring a source back")
        sim.add_argument("--show", action="store_true", help="print the fleet state as JSON")

        agent = sub.add_parser("agent", help="run the node agent on this GPU node")
        agent.add_argument("--node", default=os.uname().nodename)
        agent.add_argument("--url", required=True, help="FleetWatch's base URL")
        agent.add_argument("--token-file", default="",
                           help="file holding the node's token (else $FLEETWATCH_AGENT_TOKEN)")
        agent.add_argument("--interval", type=float, default=5.0)
        agent.add_argument("--passes", type=int, default=None, help="stop after N passes")
        agent.add_argument("--spool", default="/var/lib/fleetwatch-agent/spool.jsonl")
        agent.add_argument("--kmsg", default="/dev/kmsg", help="kernel log: /dev/kmsg or a file")
        agent.add_argument("--sysfs-root", default="/sys/class/infiniband")
        agent.add_argument("--no-nvml", action="store_true", help="no GPUs to read here")
        token = sub.add_parser("agent-token", help="make a node agent's token (ingest scope, "
                               "this node only); prints the key, shown only this once")
        token.add_argument("--node", required=True)

        api = sub.add_parser("api-token", help="API tokens for programs (hashed, scoped)")
        api_actions = api.add_subparsers(dest="token_action", required=True)
        make = api_actions.add_parser("create", help="make a token; prints the key once")
        make.add_argument("--user", required=True, help="the token acts as this user's role")
        make.add_argument("--name", required=True, help="unique; audit entries say token:NAME")
        make.add_argument("--scopes", default="read", help="comma list of read,operate,ingest")
        make.add_argument("--days", type=float, default=None,
                          help="expires after this many days (0: never; default "
                               "FLEETWATCH_API_TOKEN_TTL_DAYS)")
        api_actions.add_parser("list", help="every token: name, user, scopes, state")
        revoke = api_actions.add_parser("revoke", help="revoke a token by name")
        revoke.add_argument("name")

        diag = sub.add_parser("diagnose", help="diagnose replay files, print JSON lines")
        diag.add_argument("files", nargs="+")
        diag.add_argument("--pretty", action="store_true")
        diag.add_argument("--check", action="store_true",
                          help="compare with each file's 'expect'; exit 1 if any differs")

        audit = sub.add_parser("audit", help="the audit trail")
        audit_actions = audit.add_subparsers(dest="audit_action", required=True)
        verify = audit_actions.add_parser(
            "verify", help="check the hash chain; exit 1 at the first entry changed, removed "
                           "or reordered (and, with --checkpoint, a cut-off tail)")
        verify.add_argument(
            "--checkpoint", metavar="JSON",
            help="a saved checkpoint (the `checkpoint` field of an \"audit checkpoint\" log "
                 "line, or the whole line): the trail must still hold its head")
        audit_actions.add_parser("checkpoint", help="print a signed checkpoint of the trail's "
                                 "head now (and write it to the log)")

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            getattr(self, f"_{opts['action'].replace('-', '_')}")(opts)
        except ClientError as exc:
            raise CommandError(str(exc)) from exc

    def _seed(self, opts: dict[str, Any]) -> None:
        from django.conf import settings

        from collectors.roles import OPERATOR, roles_ensure, user_with_role

        if settings.FLEETWATCH_FLEET == "sim":
            created = faults.fleet_seed(reset=opts["reset"])
            self.stdout.write("simulated fleet " + ("created" if created else "already there"))
        else:
            self.stdout.write("real sources: the fleet is whatever Slurm, Kubernetes and "
                              "Prometheus report")
        roles_ensure()
        if opts["demo_user"]:
            from django.contrib.auth import get_user_model

            # An existing login keeps its password (and role) unless one is asked for: every
            # `make run` seeds, and a second one, even one that cannot start, must not lock
            # out whoever uses the first.
            if not opts["password"] and get_user_model().objects.filter(
                    username=opts["demo_user"]).exists():
                self.stdout.write(f"login: {opts['demo_user']} (password unchanged; "
                                  "FLEETWATCH_DEMO_PASSWORD or --password sets one)")
                return
            _, password = user_with_role(opts["demo_user"], OPERATOR, opts["password"] or None)
            self.stdout.write(f"login: {opts['demo_user']} / {password}")

    def _steps_resume(self, opts: dict[str, Any]) -> None:
        from django.conf import settings
        from django.db import connection

        from incidents.services import steps_resume_all

        # One machine, one worker: the database and the broker are files in the data folder
        # that run-local.sh holds locked. With a shared database another worker may be running
        # a step right now; there leases expire and the watchdog re-queues (steps_rescue).
        if connection.vendor != "sqlite" or not settings.CELERY_BROKER_URL.startswith("filesystem://"):
            raise CommandError("steps-resume is for the embedded default (SQLite and the filesystem "
                               "broker) only: with a shared database other workers may hold live "
                               "leases")
        resumed = steps_resume_all()
        if resumed:
            self.stdout.write(f"remediation steps queued again after the last stop: {resumed}")

    def _inject(self, opts: dict[str, Any]) -> None:
        fault = opts["fault"]
        what = faults.fault_inject(
            fault, node=opts.get("node", ""), gpu=opts.get("gpu", 0),
            code=opts.get("code", 79), count=opts.get("count", 1),
            switch=opts.get("switch", ""),
        )
        self.stdout.write(f"injected: {what}")

    def _agent(self, opts: dict[str, Any]) -> None:
        from collectors import agent

        token = (Path(opts["token_file"]).read_text().strip() if opts["token_file"]
                 else os.environ.get("FLEETWATCH_AGENT_TOKEN", ""))
        if not token:
            raise CommandError("no token: --token-file or FLEETWATCH_AGENT_TOKEN "
                               "(create one with: manage.py fleetwatch agent-token --node NAME)")
        node = opts["node"]
        sources: list[Any] = [agent.KernelLogSource(node, opts["kmsg"]),
                              agent.InfinibandSource(node, opts["sysfs_root"])]
        if not opts["no_nvml"]:
            import pynvml  # nvidia-ml-py: only the GPU nodes need the driver's library

            sources.insert(0, agent.NvmlSource(node, pynvml))
        runner = agent.Agent(node, agent.Spool(opts["spool"]), agent.Pusher(opts["url"], token),
                             sources)
        self.stdout.write(f"agent for {node}: pushing to {opts['url']} every "
                          f"{opts['interval']} s")
        runner.run(opts["interval"], opts["passes"])

    def _agent_token(self, opts: dict[str, Any]) -> None:
        from incidents.tokens import agent_token_create

        _, key = agent_token_create(opts["node"], actor="system:cli")
        self.stdout.write(key)

    def _api_token(self, opts: dict[str, Any]) -> None:
        from django.contrib.auth import get_user_model

        from incidents.models import ApiToken
        from incidents.tokens import TokenError, token_create, token_revoke

        action = opts["token_action"]
        try:
            if action == "create":
                user = get_user_model().objects.filter(username=opts["user"]).first()
                if user is None:
                    raise CommandError(f"no user {opts['user']!r}")
                _, key = token_create(user, opts["name"], opts["scopes"].split(","),
                                      ttl_days=opts["days"], actor="system:cli")
                self.stdout.write(key)
            elif action == "list":
                for t in ApiToken.objects.select_related("user").order_by("name"):
                    expiry = t.expiry.isoformat() if t.expiry else "never"
                    self.stdout.write(f"{t.name}\t{t.user.get_username()}\t"
                                      f"{','.join(t.scopes)}\t{t.state}\texpires {expiry}")
            else:
                token = ApiToken.objects.filter(name=opts["name"]).first()
                if token is None:
                    raise CommandError(f"no token named {opts['name']!r}")
                changed = token_revoke(token, actor="system:cli")
                self.stdout.write(f"revoked {token.name}" if changed
                                  else f"{token.name} was already revoked")
        except TokenError as exc:
            raise CommandError(str(exc)) from exc

    def _sim(self, opts: dict[str, Any]) -> None:
        if opts["no_auto_replace"]:
            if not opts["node"]:
                raise CommandError("--no-auto-replace needs --node")
            self.stdout.write(faults.pod_label_set(
                opts["node"], no_auto_replace=opts["no_auto_replace"] == "on"))
        if opts["source_down"]:
            self.stdout.write(faults.source_outage_set(opts["source_down"], down=True))
        if opts["source_up"]:
            self.stdout.write(faults.source_outage_set(opts["source_up"], down=False))
        if opts["show"]:
            self.stdout.write(json.dumps(faults.fleet_snapshot(), indent=1, sort_keys=True))

    def _audit(self, opts: dict[str, Any]) -> None:
        from incidents.audit import (
            CheckpointError,
            audit_verify,
            audit_verify_checkpoint,
            checkpoint_log,
            checkpoint_parse,
        )

        if opts["audit_action"] == "checkpoint":
            self.stdout.write(json.dumps(checkpoint_log(), sort_keys=True, separators=(",", ":")))
            return
        if opts["audit_action"] == "verify":
            if opts.get("checkpoint"):
                try:
                    checkpoint = checkpoint_parse(opts["checkpoint"])
                except CheckpointError as exc:
                    raise CommandError(f"--checkpoint: {exc}") from None
                result = audit_verify_checkpoint(checkpoint)
            else:
                result = audit_verify()
            if not result.ok:
                self.stderr.write(str(result))
                sys.exit(1)
            self.stdout.write(str(result))

    def _diagnose(self, opts: dict[str, Any]) -> None:
        from incidents.diagnosis.replay import ReplayError, diagnose_file

        results, failed, differs = [], False, False
        for path in opts["files"]:
            try:
                result = diagnose_file(path, with_check=opts["check"])
            except ReplayError as exc:
                failed = True
                self.stderr.write(f"{path}: {exc}")
                continue
            results.append(result)
            if opts["check"] and not result["check"]["ok"]:
                differs = True
                self.stderr.write(f"{path}: diagnosis differs from 'expect': missing "
                                  f"{result['check']['missing']}, unexpected "
                                  f"{result['check']['unexpected']}")
        if opts["pretty"]:
            self.stdout.write(json.dumps(results, indent=2))
        else:
            for result in results:
                self.stdout.write(json.dumps(result))
        if failed:
            sys.exit(2)
        if differs:
            sys.exit(1)
