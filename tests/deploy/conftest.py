from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "image: builds the agent's OCI image and runs it with podman (root; about a "
        "minute cold, seconds warm); skips where podman cannot run")
