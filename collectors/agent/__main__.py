"""``python -m collectors.agent``: the same as the ``fleetwatch-agent`` command."""

from collectors.agent.cli import main

raise SystemExit(main())
