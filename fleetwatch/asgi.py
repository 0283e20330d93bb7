from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

from fleetwatch.datadir import data_dir_prepare

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
data_dir_prepare()  # the embedded default's folder and key, before the settings read them
application = get_asgi_application()
