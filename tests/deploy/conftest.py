from __future__ import annotations

import pytest

# The server image's fixtures (a database and a /data of each module's own, the containers,
# migrations), for every module here that runs it.
from tests.deploy.test_server_image import (  # noqa: F401
    build_image,
    data_dir,
    database_url,
    fleet,
    migrated,
)


@pytest.fixture(scope="session")
def image() -> str:
    """FleetWatch's server image, built once per run (per xdist worker) from this checkout: every
    module here runs the same one (test_agent_deploy.py has an ``image`` of its own, the
    agent's)."""
    return build_image()
