from __future__ import annotations

from functools import cache
from importlib import import_module
from types import ModuleType

from django.apps import AppConfig, apps
from django.utils.module_loading import module_has_submodule


class FleetwatchConfig(AppConfig):
    """The project package is an app too: it holds the ``fleetwatch`` management command. The
    apps contribute its subcommands and the ``/metrics`` families (``app_modules``)."""

    name = "fleetwatch"
    verbose_name = "FleetWatch"


@cache
def app_modules(name: str) -> tuple[ModuleType, ...]:
    """The ``<app>.<name>`` module of every installed app that has one, in INSTALLED_APPS order
    (the project's own package left out).

    This is how the project takes what the apps contribute (``commands``: subcommands of
    ``manage.py fleetwatch``; ``metrics``: Prometheus collectors) without importing any app
    module by name, so the arrows point one way: fleetwatch above the apps, which never import
    it. As Django's admin autodiscovery does, it imports each module found; a module that
    fails to import fails loudly."""
    found = []
    for config in apps.get_app_configs():
        if config.name == FleetwatchConfig.name:
            continue
        if module_has_submodule(config.module, name):
            found.append(import_module(f"{config.name}.{name}"))
    return tuple(found)
