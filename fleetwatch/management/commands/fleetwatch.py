"""``manage.py fleetwatch``: seed the demo, inject faults, run the node agent, tokens, diagnose
replay files, check the audit trail.

The subcommands are the apps': each installed app with a ``commands`` module contributes its
own (collectors/commands.py, incidents/commands.py) through ``subcommands(sub)``, which adds
its parsers and returns their handlers. This command only gathers and dispatches them, so it
imports no app by name.
"""

from __future__ import annotations

from argparse import ArgumentParser
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand

from fleetwatch.apps import app_modules

Handler = Callable[[BaseCommand, dict[str, Any]], None]


class Command(BaseCommand):
    help = "FleetWatch operations: seed, inject, sim, diagnose, audit verify"

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        self.handlers: dict[str, Handler] = {}
        for module in app_modules("commands"):
            # Two apps naming the same subcommand fail here: argparse refuses the second.
            self.handlers.update(module.subcommands(sub))

    def handle(self, *args: Any, **opts: Any) -> None:
        self.handlers[opts["action"]](self, opts)
