from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "image: builds an OCI image (the agent's, the server's) and runs it with "
        "podman (root; a minute or two cold, seconds warm); skips where podman cannot run")


# The server image's fixtures (the image, a database and a /data of each module's own, the
# containers, migrations), for every module here that runs it.
from tests.deploy.test_server_image import (  # noqa: E402, F401
    data_dir,
    database_url,
    fleet,
    image,
    migrated,
)
