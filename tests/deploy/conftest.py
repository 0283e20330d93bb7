from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "image: builds an OCI image (the agent's, the server's) and runs it with "
        "podman (root; a minute or two cold, seconds warm); skips where podman cannot run")
