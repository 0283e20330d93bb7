"""The embedded default's data folder: where SQLite, the filesystem broker, the throttle cache,
the beat schedule, collected static files and the random secret key live.

Importing settings writes nothing (a check, a type checker or a test may import them anywhere):
settings only name these paths and read the key if it is there. ``data_dir_prepare()`` makes
them, on first use, by the programs that need them: ``manage.py``, the WSGI/ASGI application,
the Celery app when it loads its configuration, and ``deploy/run-local.sh`` (``make run``)
before anything else starts. Django-free, so it can run before the settings load.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
KEY_FILE = "secret_key"


def _env(name: str) -> str:
    return (os.environ.get(name) or "").strip()


def data_dir() -> Path:
    """``FLEETWATCH_DATA_DIR``, by default ``data/`` in the checkout."""
    return Path(_env("FLEETWATCH_DATA_DIR") or BASE_DIR / "data").resolve()


def filesystem_broker() -> bool:
    """Whether Celery's broker is the folder in the data directory (no broker URL set), as the
    settings decide it."""
    return not (_env("CELERY_BROKER_URL") or _env("REDIS_URL"))


def broker_dir(base: Path) -> Path:
    return base / "broker"


def secret_key_saved(base: Path) -> str | None:
    """The key a first start saved in the data folder, if one did."""
    path = base / KEY_FILE
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def data_dir_prepare() -> Path:
    """Make the data folder and what the embedded default keeps in it; idempotent.

    - the folder itself (SQLite's file, the beat schedule and the throttle cache go there);
    - ``staticfiles/`` (STATIC_ROOT: WhiteNoise warns at every start when it is missing);
    - ``broker/processed/`` when Celery's broker is the filesystem one;
    - ``secret_key`` unless SECRET_KEY is set: a random key, kept so sessions and signed audit
      checkpoints survive restarts without anyone inventing a secret for a demo.
    """
    base = data_dir()
    base.mkdir(parents=True, exist_ok=True)
    (base / "staticfiles").mkdir(exist_ok=True)
    if filesystem_broker():
        (broker_dir(base) / "processed").mkdir(parents=True, exist_ok=True)
    if not _env("SECRET_KEY") and secret_key_saved(base) is None:
        # Written whole to a private file first, then linked into place only if no key is
        # there yet: two processes starting at once end up with the first one's key, and none
        # ever reads a half-written one.
        temporary = base / f".{KEY_FILE}.{os.getpid()}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(50))
        try:
            os.link(temporary, base / KEY_FILE)
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
    return base
