"""What a recorded URL may show. Django-free and dependency-free: the notifier and the webhook
records use it, and so do the project's log filters, which run in gunicorn's master before any
Django setting is loaded."""

from __future__ import annotations

from urllib.parse import urlsplit


def redact_url(url: str, *, keep_path: bool = True) -> str:
    """A URL fit for the audit trail: no user:password, no query string, and, where the path
    itself is the secret (Slack, Mattermost, Rocket.Chat hooks), only its first segment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    base = f"{parts.scheme}://{host}" if parts.scheme else host
    if keep_path:
        return base + parts.path + ("?…" if parts.query else "")
    first = next((seg for seg in parts.path.split("/") if seg), "")
    return f"{base}/{first}/…" if first else f"{base}/…"
