"""The notify step's webhook, against a real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from collectors.clients.base import ClientError
from collectors.clients.notify import WebhookNotifier


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict]]]:
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body)
            self.send_response(404 if self.path == "/missing" else 204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", received
    server.shutdown()


def test_webhook_receives_the_incident(receiver: tuple[str, list[dict]]) -> None:
    url, received = receiver
    result = WebhookNotifier(f"{url}/hook").notify("gpu-003 down", "XID 79", {"incident": 7})
    assert result.call == f"POST {url}/hook" and "204" in result.detail
    assert received == [{"subject": "gpu-003 down", "text": "XID 79", "incident": 7}]


def test_a_rejecting_webhook_is_a_permanent_error(receiver: tuple[str, list[dict]]) -> None:
    url, _ = receiver
    with pytest.raises(ClientError, match="answered 404") as err:
        WebhookNotifier(f"{url}/missing").notify("s", "b", {})
    assert err.value.permanent


def test_an_unreachable_webhook_is_a_retryable_error() -> None:
    with pytest.raises(ClientError, match="unreachable") as err:
        WebhookNotifier("http://127.0.0.1:9/hook", timeout=0.5).notify("s", "b", {})
    assert not err.value.permanent


def test_without_a_webhook_the_notification_is_recorded_only() -> None:
    result = WebhookNotifier(None).notify("subject", "body", {})
    assert "recorded only" in result.call
