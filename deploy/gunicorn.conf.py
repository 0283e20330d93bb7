"""gunicorn's settings for FleetWatch: ``gunicorn -c deploy/gunicorn.conf.py fleetwatch.wsgi``.

What it sets up, besides the usual knobs (each overridable on the command line):

- Prometheus multiprocess mode. Every worker keeps its HTTP counts in files in
  PROMETHEUS_MULTIPROC_DIR and /metrics sums them, so the numbers are right whichever worker
  answers a scrape. The folder must be empty at each start (old files would add a previous
  run's counts): a fresh temporary one is made unless the variable names one, which is then
  emptied of prometheus_client's files. A dead worker's files are kept, its counts still count;
  ``child_exit`` tells prometheus_client so its live gauges (none yet) drop it.
- Chunked request bodies: gunicorn passes them on without a Content-Length (it sets
  ``wsgi.input_terminated``), which Django does not read: it would see an empty body. FleetWatch
  answers such a request 411 (fleetwatch/middleware.py), so a client sends the length instead.
- Logs as FleetWatch writes them (fleetwatch/logs.py): JSON by default, request ids, secrets
  scrubbed. gunicorn's own access log is off: FleetWatch's middleware writes one line per
  request with the caller and request id and without query-string secrets.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # fleetwatch.logs, for the logging config below
    sys.path.insert(0, str(ROOT))

from fleetwatch.logs import logging_config  # noqa: E402

_MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
_MADE = "FLEETWATCH_PROMETHEUS_DIR_MADE"  # this file made it (it is read again on SIGHUP)
_made_dir = os.environ.get(_MADE, "") if os.environ.get(_MADE) == os.environ.get(_MULTIPROC) else ""
if os.environ.get(_MULTIPROC):
    _dir = Path(os.environ[_MULTIPROC])
    _dir.mkdir(parents=True, exist_ok=True)
    for _stale in _dir.glob("*.db"):  # only prometheus_client's files, whatever else is there
        _stale.unlink()
else:
    # Set before any worker imports prometheus_client: it picks its storage at import.
    _made_dir = tempfile.mkdtemp(prefix="fleetwatch-prometheus-")
    os.environ[_MULTIPROC] = os.environ[_MADE] = _made_dir

wsgi_app = "fleetwatch.wsgi"
chdir = str(ROOT)
bind = os.environ.get("GUNICORN_BIND", f"{os.environ.get('HOST', '127.0.0.1')}:"
                                       f"{os.environ.get('PORT', '8000')}")
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
threads = int(os.environ.get("GUNICORN_THREADS", "1"))
timeout = int(os.environ.get("GUNICORN_TIMEOUT", "60"))
graceful_timeout = 20
# Behind a proxy or load balancer, set FORWARDED_ALLOW_IPS to its address.
forwarded_allow_ips = os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1")

accesslog = None
errorlog = "-"
loglevel = (os.environ.get("LOG_LEVEL") or "INFO").lower()
logconfig_dict = logging_config(os.environ.get("FLEETWATCH_LOG_FORMAT") or "json",
                                loglevel.upper(), gunicorn=True)


def on_starting(server: Any) -> None:
    """The settings, read once in the master before any worker starts: a missing or wrong
    setting (SECRET_KEY in a deployment, an unknown FLEETWATCH_FLEET...) then stops gunicorn
    with its one-line message, instead of each worker failing to boot with a traceback.
    Importing the settings writes nothing and opens no connection (fleetwatch/settings.py)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleetwatch.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    try:
        settings.SECRET_KEY  # noqa: B018 (the first read imports the settings module)
    except ImproperlyConfigured as exc:
        server.log.error("FleetWatch cannot start: %s", exc)
        sys.exit(2)


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server: Any) -> None:
    if _made_dir:
        shutil.rmtree(_made_dir, ignore_errors=True)
