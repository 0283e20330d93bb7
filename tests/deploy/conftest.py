from __future__ import annotations

# The server image's fixtures (the image, a database and a /data of each module's own, the
# containers, migrations), for every module here that runs it.
from tests.deploy.test_server_image import (  # noqa: F401
    data_dir,
    database_url,
    fleet,
    image,
    migrated,
)
