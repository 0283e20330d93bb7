from __future__ import annotations

from django.apps import AppConfig


class FleetwatchConfig(AppConfig):
    """The project package is an app too: it holds the ``fleetwatch`` management command,
    which spans collectors (fault injection) and incidents (replay diagnosis)."""

    name = "fleetwatch"
    verbose_name = "FleetWatch"
