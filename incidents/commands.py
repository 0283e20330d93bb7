"""What incidents adds to ``manage.py fleetwatch``: resuming remediation steps at start-up
(``steps-resume``), API and agent tokens (``api-token``, ``agent-token``), replay diagnosis
(``diagnose``), the audit trail (``audit verify``, ``audit checkpoint``), fire drills
(``drill run``, ``drill show``) and a fail-slow scan now (``fail-slow``).

The project's command (fleetwatch/management/commands/fleetwatch.py) finds ``subcommands`` here
through the app registry, as it does in every installed app; it imports no app by name.
"""

from __future__ import annotations

import json
import sys
from argparse import ArgumentParser, _SubParsersAction
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from collectors.commands import Handler, clients_fail_as_command


def subcommands(sub: _SubParsersAction[ArgumentParser]) -> dict[str, Handler]:
    """Add this app's subcommands to ``sub``; their handlers by name."""
    sub.add_parser("steps-resume", help="at start-up, before the only worker starts: release "
                   "every step lease and queue the running remediations' steps again "
                   "(embedded default only: SQLite and the filesystem broker)")

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
    why = sub.add_parser("why", help="why did job JOBID die: the answer its page and "
                         "GET /api/v1/jobs/JOBID/why/ give")
    why.add_argument("job", metavar="JOBID", help="the Slurm job id")
    why.add_argument("--cluster", help="the job's cluster (default: the first holding the id)")
    why.add_argument("--json", action="store_true", help="the API's JSON instead of words")
    drill = sub.add_parser("drill", help="fire drills: FleetWatch proving its own repair loop "
                           "on a canary node (README, \"Fire drills\")")
    drill_actions = drill.add_subparsers(dest="drill_action", required=True)
    run = drill_actions.add_parser("run", help="start a drill now (a worker runs it); one at a "
                                   "time: while one runs, says which and starts none (exit 3)")
    run.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                     help="wait up to this long for its result and print its report; exit 1 "
                          "if it failed, 2 if it did not finish in time")
    show = drill_actions.add_parser("show", help="a drill's report (the latest without an id)")
    show.add_argument("id", nargs="?", type=int)
    show.add_argument("--json", action="store_true", help="the API's JSON instead of words")
    slow = sub.add_parser("fail-slow", help="look for nodes slower than their jobs' peers now "
                          "(what the beat does every FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS); "
                          "prints the incidents recorded or found")
    slow.add_argument("--cluster", help="one cluster (default: every cluster)")
    handlers: dict[str, Handler] = {
        "steps-resume": _steps_resume, "agent-token": _agent_token, "api-token": _api_token,
        "diagnose": _diagnose, "audit": _audit, "why": _why, "drill": _drill,
        "fail-slow": _fail_slow}
    return {name: clients_fail_as_command(handler) for name, handler in handlers.items()}


def _steps_resume(command: BaseCommand, opts: dict[str, Any]) -> None:
    from django.conf import settings
    from django.db import connection

    from incidents.remediation.engine import steps_resume_all

    # One machine, one worker: the database and the broker are files in the data folder
    # that run-local.sh holds locked. With a shared database another worker may be running
    # a step right now; there leases expire and the watchdog re-queues (steps_rescue).
    if connection.vendor != "sqlite" or not settings.CELERY_BROKER_URL.startswith("filesystem://"):
        raise CommandError("steps-resume is for the embedded default (SQLite and the filesystem "
                           "broker) only: with a shared database other workers may hold live "
                           "leases")
    resumed = steps_resume_all()
    if resumed:
        command.stdout.write(f"remediation steps queued again after the last stop: {resumed}")


def _fail_slow(command: BaseCommand, opts: dict[str, Any]) -> None:
    from collectors.services import cluster_get
    from collectors.sources import cluster_names
    from incidents.slowness import fail_slow_scan

    names = [opts["cluster"]] if opts.get("cluster") else cluster_names()
    for name in names:
        incidents = fail_slow_scan(cluster_get(name).pk)
        which = f"{name}: " if len(names) > 1 else ""
        if not incidents:
            command.stdout.write(f"{which}no node slower than its job's peers")
        for incident in incidents:
            command.stdout.write(f"{which}incident {incident.pk} ({incident.confidence:.2f}): "
                                 f"{incident.explanation}")


def _why(command: BaseCommand, opts: dict[str, Any]) -> None:
    """The headline first (what a chat bot posts), then the facts, one per line."""
    from collectors.selectors import job_get
    from incidents.api.serializers import JobWhySerializer
    from incidents.why import job_why

    job = job_get(opts["job"], opts.get("cluster"))
    if job is None:
        raise CommandError(f"no job {opts['job']}" + (f" in cluster {opts['cluster']}"
                                                      if opts.get("cluster") else "")
                           + " (FleetWatch knows the jobs its Slurm collector has seen)")
    data = JobWhySerializer(job_why(job)).data
    if opts.get("json"):
        command.stdout.write(json.dumps(data, indent=1))
        return
    lines = [data["headline"]]
    labels = (("fault", "what stopped it"), ("at", "when"), ("node", "node"), ("gpu", "GPU"),
              ("action", "FleetWatch did"), ("resumed_from_step", "resumed from step"),
              ("steps_lost", "steps lost"), ("downtime_seconds", "down (s)"),
              ("incident_url", "incident"), ("slurm_comment", "in Slurm"),
              ("submitted_at", "first submitted"), ("first_started_at", "first started"),
              ("link", "page"))
    lines += [f"  {label}: {data[key]}" for key, label in labels
              if data.get(key) not in (None, "", [])]
    if data["job_at_fault"]:
        lines.append("  the job's own error; evidence:")
    lines += [f"    {line}" for line in data["evidence"]]
    command.stdout.write("\n".join(lines))


def _drill(command: BaseCommand, opts: dict[str, Any]) -> None:
    import time

    from collectors.roles import SYSTEM
    from incidents.drills import DrillError, drill_start
    from incidents.models import Drill

    if opts["drill_action"] == "show":
        drill = (Drill.objects.filter(pk=opts["id"]).first() if opts.get("id")
                 else Drill.objects.order_by("-started_at", "-pk").first())
        if drill is None:
            raise CommandError(f"no drill {opts['id']}" if opts.get("id") else "no drill yet")
        _drill_print(command, drill, as_json=opts.get("json", False))
        return
    try:
        started = drill_start(trigger=Drill.Trigger.MANUAL, actor=f"{SYSTEM}:cli")
    except DrillError as exc:
        raise CommandError(str(exc)) from None
    drill = started.drill
    if not started.created:
        command.stderr.write(f"fire drill {drill.pk} is already running (started "
                             f"{drill.started_at.isoformat()} by {drill.requested_by}); no "
                             "second drill was started")
        sys.exit(3)
    command.stdout.write(f"fire drill {drill.pk} started ({drill.mode} mode, budget "
                         f"{drill.budget_seconds:g} s)")
    if not opts["wait"]:
        return
    deadline = time.monotonic() + opts["wait"]
    while time.monotonic() < deadline:
        drill.refresh_from_db()
        if drill.status != Drill.Status.RUNNING:
            break
        time.sleep(0.5)
    _drill_print(command, drill, as_json=False)
    if drill.status == Drill.Status.RUNNING:
        sys.exit(2)
    if drill.status == Drill.Status.FAILED:
        sys.exit(1)


def _drill_print(command: BaseCommand, drill: Any, *, as_json: bool) -> None:
    from incidents.api.serializers import DrillReportSerializer
    from incidents.selectors import drill_report

    report = drill_report(drill)
    data = DrillReportSerializer(drill, context={
        "phases": report["phase_map"], "remediation": report["remediation"],
        "timeline": report["timeline"]}).data
    if as_json:
        command.stdout.write(json.dumps(data, indent=1, default=str))
        return
    lines = [f"fire drill {drill.pk}: {drill.status}" + (f" ({drill.reason})" if drill.reason
                                                          else ""),
             f"  canary: {drill.node or '-'} ({drill.mode} mode), budget "
             f"{drill.budget_seconds:g} s, incident {data['incident'] or '-'}"]
    lines += [f"  {label}: {seconds:.3f} s" for _, label, seconds in report["phases"]]
    command.stdout.write("\n".join(lines))


def _agent_token(command: BaseCommand, opts: dict[str, Any]) -> None:
    from incidents.tokens import agent_token_create

    _, key = agent_token_create(opts["node"], actor="system:cli")
    command.stdout.write(key)


def _api_token(command: BaseCommand, opts: dict[str, Any]) -> None:
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
            command.stdout.write(key)
        elif action == "list":
            for t in ApiToken.objects.select_related("user").order_by("name"):
                expiry = t.expiry.isoformat() if t.expiry else "never"
                command.stdout.write(f"{t.name}\t{t.user.get_username()}\t"
                                     f"{','.join(t.scopes)}\t{t.state}\texpires {expiry}")
        else:
            token = ApiToken.objects.filter(name=opts["name"]).first()
            if token is None:
                raise CommandError(f"no token named {opts['name']!r}")
            changed = token_revoke(token, actor="system:cli")
            command.stdout.write(f"revoked {token.name}" if changed
                                 else f"{token.name} was already revoked")
    except TokenError as exc:
        raise CommandError(str(exc)) from exc


def _audit(command: BaseCommand, opts: dict[str, Any]) -> None:
    from incidents.audit import (
        CheckpointError,
        audit_verify,
        audit_verify_checkpoint,
        checkpoint_log,
        checkpoint_parse,
    )

    if opts["audit_action"] == "checkpoint":
        from incidents.webhooks import checkpoint_emit

        # As the beat's checkpoint does: into the log, then to the subscriptions that list it.
        checkpoint = checkpoint_log()
        checkpoint_emit(checkpoint)
        command.stdout.write(json.dumps(checkpoint, sort_keys=True, separators=(",", ":")))
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
            command.stderr.write(str(result))
            sys.exit(1)
        command.stdout.write(str(result))


def _diagnose(command: BaseCommand, opts: dict[str, Any]) -> None:
    from incidents.diagnosis.replay import ReplayError, diagnose_file

    results, failed, differs = [], False, False
    for path in opts["files"]:
        try:
            result = diagnose_file(path, with_check=opts["check"])
        except ReplayError as exc:
            failed = True
            command.stderr.write(f"{path}: {exc}")
            continue
        results.append(result)
        if opts["check"] and not result["check"]["ok"]:
            differs = True
            command.stderr.write(f"{path}: diagnosis differs from 'expect': missing "
                                 f"{result['check']['missing']}, unexpected "
                                 f"{result['check']['unexpected']}")
    if opts["pretty"]:
        command.stdout.write(json.dumps(results, indent=2))
    else:
        for result in results:
            command.stdout.write(json.dumps(result))
    if failed:
        sys.exit(2)
    if differs:
        sys.exit(1)
