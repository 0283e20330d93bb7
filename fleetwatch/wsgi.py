from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

from fleetwatch.datadir import data_dir_prepare

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
data_dir_prepare()  # the embedded default's folder and key, before the settings read them
application = get_wsgi_application()
