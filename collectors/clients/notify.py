"""Notifications: recorded always, POSTed to a webhook when one is configured."""

from __future__ import annotations

from typing import Protocol

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from collectors.clients.base import ActionResult, ClientError


class Notifier(Protocol):
    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult: ...


class WebhookNotifier:
    def __init__(self, url: str | None, *, timeout: float = 5.0) -> None:
        self.url = url
        self.timeout = timeout
        self.session = requests.Session()
        # urllib3 does the backoff; POST is retried too since receivers dedupe on the id.
        retry = Retry(total=3, backoff_factor=0.5, status_forcelist=(429, 500, 502, 503, 504),
                      allowed_methods=None, raise_on_status=False)
        self.session.mount("http://", HTTPAdapter(max_retries=retry))
        self.session.mount("https://", HTTPAdapter(max_retries=retry))

    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult:
        if not self.url:
            return ActionResult("notify (no webhook configured: recorded only)", True, subject)
        call = f"POST {self.url}"
        try:
            response = self.session.post(
                self.url, json={"subject": subject, "text": body, **payload}, timeout=self.timeout
            )
        except requests.RequestException as exc:
            raise ClientError(f"webhook unreachable: {exc}") from exc
        if response.status_code >= 400:
            raise ClientError(f"webhook answered {response.status_code}",
                              permanent=400 <= response.status_code < 500
                              and response.status_code != 429)
        return ActionResult(call, True, f"webhook answered {response.status_code}")


def notifier_from_settings() -> Notifier:
    """The notifier the configuration asks for."""
    from django.conf import settings

    return WebhookNotifier(settings.FLEETWATCH_NOTIFY_WEBHOOK_URL,
                           timeout=settings.FLEETWATCH_HTTP_TIMEOUT)
