#!/usr/bin/env python
"""Django's command-line entry point for FleetWatch."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
    from django.core.management import execute_from_command_line

    from fleetwatch.datadir import data_dir_prepare

    # Importing the settings writes nothing; a command is a program that may use the embedded
    # default's data folder (SQLite, the broker folder, the saved key): made here, first.
    data_dir_prepare()

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
