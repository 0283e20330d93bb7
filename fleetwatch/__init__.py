from __future__ import annotations

# Load the Celery app with Django so @shared_task binds to it and send_task works everywhere.
from fleetwatch.celery import app as celery_app

__all__ = ("celery_app",)
