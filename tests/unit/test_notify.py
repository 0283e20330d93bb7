"""Notifiers against a real HTTP server on loopback and Django's mail backends.

Each notification is recorded as an ``incidents.models.Delivery`` (the one delivery model).

The receiver runs in another thread: the tests that look at the database from inside it use
``transactional_db``, so the row the notifier wrote is committed and visible there."""

from __future__ import annotations

import json
import logging
import smtplib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest
from django.core import mail
from django.core.mail.backends.base import BaseEmailBackend
from django.db import connections

from collectors.clients.base import ClientError
from collectors.clients.notify import (
    EmailNotifier,
    MultiNotifier,
    SlackNotifier,
    WebhookNotifier,
    notifier_from_settings,
    verify_signature,
)
from collectors.redaction import redact_url
from incidents.deliveries import incident_rows as deliveries_for_incident
from incidents.models import Delivery

SECRET = "s3cret-shared-with-the-receiver"
SLACK_PATH = "/services/T000/B000/XXXXSLACKTOKENXXXX"
DEAD = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused at once
PAYLOAD: dict[str, object] = {"incident": 7, "root_cause": "gpu_hardware",
                              "nodes": ["gpu-003"]}


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    raw: bytes
    row_status: str | None = None  # the Delivery row's status when the request arrived

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


@dataclass
class Receiver:
    url: str
    hits: list[Hit] = field(default_factory=list)
    # Per path, the statuses to answer in turn; the last one repeats. Default: 200 "ok".
    plan: dict[str, list[int]] = field(default_factory=dict)
    check_db: bool = False

    def to(self, path: str) -> list[Hit]:
        return [h for h in self.hits if h.path == path]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            hit = Hit(self.path.split("?")[0], dict(self.headers.items()),
                      self.rfile.read(int(self.headers["Content-Length"])))
            if rx.check_db:
                hit.row_status = self._row_status(hit)
            rx.hits.append(hit)
            statuses = rx.plan.get(hit.path, [200])
            status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            answer = {200: b"ok", 400: b"invalid_payload"}.get(status, b"oops")
            self.send_response(status)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def _row_status(self, hit: Hit) -> str | None:
            try:
                rows = Delivery.objects.order_by("-id")
                if "X-FleetWatch-Delivery" in hit.headers:
                    rows = rows.filter(pk=int(hit.headers["X-FleetWatch-Delivery"]))
                return rows.values_list("status", flat=True).first()
            finally:
                connections.close_all()  # this thread's connection, or the test DB can't drop

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rx.url = f"http://127.0.0.1:{server.server_port}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield rx
    server.shutdown()
    server.server_close()


def webhook(url: str, **kw: Any) -> WebhookNotifier:
    return WebhookNotifier(url, **{"backoff": 0.0, "timeout": 2.0, **kw})


def slack(url: str, **kw: Any) -> SlackNotifier:
    return SlackNotifier(url, **{"backoff": 0.0, "timeout": 2.0, **kw})


def rows(channel: str) -> list[Delivery]:
    return list(Delivery.objects.filter(channel=channel).order_by("id"))


# --- the signed webhook -----------------------------------------------------------------------


def test_signed_webhook_verifies_and_a_tampered_one_does_not(
        receiver: Receiver, transactional_db: None, settings: Any) -> None:
    settings.FLEETWATCH_BASE_URL = "https://fleetwatch.example/"
    receiver.check_db = True
    result = webhook(f"{receiver.url}/hook", secret=SECRET).notify(
        "gpu-003 down", "XID 79: fell off the bus", dict(PAYLOAD))

    [hit] = receiver.hits
    [row] = rows("webhook")
    assert hit.row_status == "pending"  # recorded before the call, committed, visible outside
    h = hit.headers
    assert h["X-FleetWatch-Event"] == "incident.notify"
    assert h["X-FleetWatch-Delivery"] == str(row.pk)
    assert abs(int(h["X-FleetWatch-Timestamp"]) - time.time()) < 60
    assert h["X-FleetWatch-Signature"].startswith("sha256=")
    assert verify_signature(SECRET, h["X-FleetWatch-Timestamp"], hit.raw,
                            h["X-FleetWatch-Signature"])

    tampered = hit.raw.replace(b"gpu-003", b"gpu-004")
    assert tampered != hit.raw
    assert not verify_signature(SECRET, h["X-FleetWatch-Timestamp"], tampered,
                                h["X-FleetWatch-Signature"])
    assert not verify_signature("another-secret", h["X-FleetWatch-Timestamp"], hit.raw,
                                h["X-FleetWatch-Signature"])
    # The same signature with a newer timestamp (a replay) or past the tolerance fails.
    later = str(int(h["X-FleetWatch-Timestamp"]) + 1)
    assert not verify_signature(SECRET, later, hit.raw, h["X-FleetWatch-Signature"])
    assert not verify_signature(SECRET, h["X-FleetWatch-Timestamp"], hit.raw,
                                h["X-FleetWatch-Signature"], now=time.time() + 301)

    assert hit.json == {"event": "incident.notify", "delivery": row.pk, "subject": "gpu-003 down",
                        "text": "XID 79: fell off the bus",
                        "url": "https://fleetwatch.example/incidents/7/", **PAYLOAD}
    assert result.call == f"POST {receiver.url}/hook" and "answered 200" in result.detail
    assert (row.status, row.attempts, row.incident_id) == ("delivered", 1, 7)
    assert row.response.startswith("answered 200") and row.delivered_at is not None
    assert row.payload["text"] == "XID 79: fell off the bus"


def test_without_a_secret_no_signature_header_is_sent(receiver: Receiver, db: None) -> None:
    webhook(f"{receiver.url}/hook").notify("s", "b", {})
    assert "X-FleetWatch-Signature" not in receiver.hits[0].headers


def test_a_503_then_200_is_retried_and_recorded_delivered(receiver: Receiver, db: None) -> None:
    receiver.plan["/hook"] = [503, 200]
    result = webhook(f"{receiver.url}/hook", secret=SECRET).notify("s", "b", dict(PAYLOAD))

    hits = receiver.to("/hook")
    assert len(hits) == 2
    # One delivery: the retry carries the same id, so the receiver can dedupe on it.
    assert hits[0].headers["X-FleetWatch-Delivery"] == hits[1].headers["X-FleetWatch-Delivery"]
    [row] = rows("webhook")
    assert (row.status, row.attempts) == ("delivered", 2)
    assert "answered 200" in row.response and "503" in row.response
    assert result.changed


def test_a_503_that_persists_is_a_retryable_failure(receiver: Receiver, db: None) -> None:
    receiver.plan["/hook"] = [503]
    with pytest.raises(ClientError, match="answered 503") as err:
        webhook(f"{receiver.url}/hook", retries=2).notify("s", "b", {})
    assert not err.value.permanent
    assert len(receiver.to("/hook")) == 3
    [row] = rows("webhook")
    assert (row.status, row.attempts) == ("failed", 3)


def test_a_400_is_not_retried_and_is_recorded_failed(receiver: Receiver, db: None) -> None:
    receiver.plan["/hook"] = [400]
    with pytest.raises(ClientError, match="answered 400") as err:
        webhook(f"{receiver.url}/hook").notify("s", "b", {"incident": 3})
    assert err.value.permanent
    assert len(receiver.to("/hook")) == 1
    [row] = rows("webhook")
    assert (row.status, row.attempts, row.incident_id) == ("failed", 1, 3)
    assert "400" in row.response and "invalid_payload" in row.response
    assert row.delivered_at is None


def test_a_rejecting_webhook_is_a_permanent_error(receiver: Receiver, db: None) -> None:
    receiver.plan["/missing"] = [404]
    with pytest.raises(ClientError, match="answered 404") as err:
        webhook(f"{receiver.url}/missing").notify("s", "b", {})
    assert err.value.permanent


def test_an_unreachable_webhook_is_a_retryable_error(db: None) -> None:
    with pytest.raises(ClientError, match="unreachable") as err:
        webhook(f"{DEAD}/hook", timeout=0.5, retries=1).notify("s", "b", {})
    assert not err.value.permanent
    [row] = rows("webhook")
    assert (row.status, row.attempts) == ("failed", 2)


def test_without_a_channel_the_notification_is_recorded_only() -> None:
    # No database needed: nothing is sent, the audit entry is the record.
    assert "recorded only" in WebhookNotifier(None).notify("subject", "body", {}).call
    assert MultiNotifier([]).notify("s", "b", {}).call == \
        "notify (no channel configured: recorded only)"


# --- Slack ------------------------------------------------------------------------------------


def test_slack_payload_shape_and_no_token_recorded(
        receiver: Receiver, db: None, settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    settings.FLEETWATCH_BASE_URL = "https://fleetwatch.example"
    caplog.set_level(logging.DEBUG)
    result = slack(f"{receiver.url}{SLACK_PATH}?token=abc").notify(
        "FleetWatch incident 7: gpu_hardware on gpu-003", "XID 79 <fell off> the bus & more",
        {**PAYLOAD, "nodes": ["gpu-003", "gpu-004"]})

    body = receiver.to(SLACK_PATH)[0].json
    assert set(body) == {"text", "blocks"}
    # text alone must carry the whole message: Mattermost and Rocket.Chat show only it.
    assert "FleetWatch incident 7" in body["text"]
    assert "XID 79 &lt;fell off&gt; the bus &amp; more" in body["text"]
    assert "`gpu-003`, `gpu-004`" in body["text"]
    assert "<https://fleetwatch.example/incidents/7/|Open incident 7" in body["text"]
    header, explanation, fields, actions = body["blocks"]
    assert header == {"type": "header", "text": {
        "type": "plain_text", "text": "FleetWatch incident 7: gpu_hardware on gpu-003"}}
    assert explanation["text"] == {"type": "mrkdwn",
                                   "text": "XID 79 &lt;fell off&gt; the bus &amp; more"}
    assert fields["fields"][0]["text"] == "*Nodes*\ngpu-003, gpu-004"
    assert "gpu_hardware" in fields["fields"][1]["text"]
    assert actions["elements"][0]["url"] == "https://fleetwatch.example/incidents/7/"

    [row] = rows("slack")
    assert row.target == f"{receiver.url}/services/…"
    assert row.status == "delivered"
    for recorded in (row.target, row.response, json.dumps(row.payload), result.call,
                     result.detail, caplog.text):
        assert "XXXXSLACKTOKENXXXX" not in recorded and "token=abc" not in recorded


def test_slack_without_base_url_has_no_link(receiver: Receiver, db: None) -> None:
    slack(f"{receiver.url}{SLACK_PATH}").notify("subject", "explanation", dict(PAYLOAD))
    body = receiver.hits[0].json
    assert [b["type"] for b in body["blocks"]] == ["header", "section", "section"]
    assert "incidents/7" not in body["text"]


def test_an_unreachable_slack_hook_leaks_no_token(db: None,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ClientError) as err:
        slack(f"{DEAD}{SLACK_PATH}", timeout=0.5, retries=0).notify("s", "b", {})
    [row] = rows("slack")
    for recorded in (str(err.value), row.target, row.response, caplog.text):
        assert "XXXXSLACKTOKENXXXX" not in recorded
    assert "unreachable" in row.response


def test_redact_url() -> None:
    assert redact_url("https://hooks.slack.com/services/T0/B0/abc", keep_path=False) == \
        "https://hooks.slack.com/services/…"
    assert redact_url("https://chat.example.com:8065/hooks/xyz?x=1", keep_path=False) == \
        "https://chat.example.com:8065/hooks/…"
    assert redact_url("https://user:pw@hooks.example/x?token=t") == "https://hooks.example/x?…"
    assert redact_url("https://hooks.example/x") == "https://hooks.example/x"


# --- e-mail -----------------------------------------------------------------------------------


class RefusingBackend(BaseEmailBackend):
    """A mail server that refuses every recipient for good (550)."""

    def send_messages(self, email_messages: Any) -> int:
        raise smtplib.SMTPRecipientsRefused(
            {a: (550, b"no such user") for m in email_messages for a in m.to})


class FlakyBackend(BaseEmailBackend):
    """Drops the connection once, then delivers to mail.outbox."""

    calls = 0

    def send_messages(self, email_messages: Any) -> int:
        FlakyBackend.calls += 1
        if FlakyBackend.calls == 1:
            raise smtplib.SMTPServerDisconnected("Connection unexpectedly closed")
        mail.outbox.extend(email_messages)
        return len(email_messages)


def test_email_goes_through_djangos_mail_backend(db: None, settings: Any) -> None:
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.DEFAULT_FROM_EMAIL = "fleetwatch@example.com"
    settings.FLEETWATCH_BASE_URL = "https://fleetwatch.example"
    result = EmailNotifier(["oncall@example.com", "gpu-team@example.com"]).notify(
        "FleetWatch incident 7: gpu_hardware on gpu-003", "XID 79: fell off the bus",
        dict(PAYLOAD))

    [sent] = mail.outbox
    assert sent.subject == "[FleetWatch] FleetWatch incident 7: gpu_hardware on gpu-003"
    assert sent.to == ["oncall@example.com", "gpu-team@example.com"]
    assert sent.from_email == "fleetwatch@example.com"
    assert "XID 79: fell off the bus" in sent.body and "gpu-003" in sent.body
    assert "https://fleetwatch.example/incidents/7/" in sent.body
    [row] = rows("email")
    assert sent.extra_headers["X-FleetWatch-Delivery"] == str(row.pk)
    assert (row.status, row.attempts, row.target) == \
        ("delivered", 1, "oncall@example.com, gpu-team@example.com")
    assert result.call == "email to oncall@example.com, gpu-team@example.com"


def test_a_dropped_smtp_connection_is_retried(db: None, settings: Any) -> None:
    settings.EMAIL_BACKEND = f"{__name__}.FlakyBackend"
    FlakyBackend.calls = 0
    EmailNotifier(["oncall@example.com"], backoff=0).notify("s", "b", {})
    assert len(mail.outbox) == 1
    [row] = rows("email")
    assert (row.status, row.attempts) == ("delivered", 2)


def test_a_refused_recipient_is_permanent_and_not_retried(db: None, settings: Any) -> None:
    settings.EMAIL_BACKEND = f"{__name__}.RefusingBackend"
    with pytest.raises(ClientError, match="SMTPRecipientsRefused") as err:
        EmailNotifier(["nobody@example.com"], backoff=0).notify("s", "b", {})
    assert err.value.permanent
    [row] = rows("email")
    assert (row.status, row.attempts) == ("failed", 1)


# --- fan-out ----------------------------------------------------------------------------------


def step_context(notifier: Any, **overrides: Any) -> Any:
    from incidents.remediation.steps import StepContext

    audit: list[tuple[Any, ...]] = []
    ctx = StepContext(
        incident_id=7, root_cause="gpu_hardware", explanation="XID 79 on gpu-003",
        nodes=["gpu-003"], clients=SimpleNamespace(notifier=notifier), grace_seconds=30,
        state={}, previous={}, audit=lambda *entry: audit.append(entry), **overrides)
    return ctx, audit


def test_one_channel_down_the_step_still_succeeds_and_both_are_recorded(
        receiver: Receiver, transactional_db: None, settings: Any) -> None:
    from incidents.remediation.steps import Done, notify

    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    receiver.check_db = True
    notifier = MultiNotifier([webhook(f"{DEAD}/hook", timeout=0.5, retries=1),
                              slack(f"{receiver.url}{SLACK_PATH}"),
                              EmailNotifier(["oncall@example.com"])])
    ctx, audit = step_context(notifier)
    outcome = notify(ctx)

    assert isinstance(outcome, Done)
    assert outcome.result["call"] == (f"POST {DEAD}/hook; POST {receiver.url}/services/…; "
                                      "email to oncall@example.com")
    assert "webhook failed: unreachable" in outcome.detail
    assert "slack delivered: answered 200" in outcome.detail
    assert "email delivered" in outcome.detail
    assert receiver.hits[0].row_status == "pending"
    assert {r.channel: r.status for r in deliveries_for_incident(7)} == \
        {"webhook": "failed", "slack": "delivered", "email": "delivered"}
    assert len(mail.outbox) == 1
    [entry] = audit  # (verb, target, result, error, ...): the engine may add fields
    assert entry[0] == "notify" and entry[3] is None and entry[2].changed


def test_all_channels_down_raises_a_retryable_client_error(
        receiver: Receiver, db: None, settings: Any) -> None:
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", 9, 1
    receiver.plan[SLACK_PATH] = [500]
    notifier = MultiNotifier([webhook(f"{DEAD}/hook", timeout=0.5, retries=0),
                              slack(f"{receiver.url}{SLACK_PATH}", retries=1),
                              EmailNotifier(["oncall@example.com"], retries=1, backoff=0)])
    with pytest.raises(ClientError) as err:
        notifier.notify("s", "b", dict(PAYLOAD))
    assert not err.value.permanent
    message = str(err.value)
    assert f"POST {DEAD}/hook" in message and "email to oncall@example.com" in message
    assert "answered 500" in message
    assert [(r.channel, r.status, r.attempts) for r in deliveries_for_incident(7)] == \
        [("webhook", "failed", 1), ("slack", "failed", 2), ("email", "failed", 2)]


def test_all_channels_refusing_for_good_is_permanent(
        receiver: Receiver, db: None, settings: Any) -> None:
    settings.EMAIL_BACKEND = f"{__name__}.RefusingBackend"
    receiver.plan["/hook"] = [400]
    notifier = MultiNotifier([webhook(f"{receiver.url}/hook"),
                              EmailNotifier(["nobody@example.com"])])
    with pytest.raises(ClientError) as err:
        notifier.notify("s", "b", {})
    assert err.value.permanent


def test_a_retried_notify_with_the_same_key_does_not_send_twice(
        receiver: Receiver, db: None) -> None:
    receiver.plan[SLACK_PATH] = [503, 200]  # Slack is down on the first try only
    notifier = MultiNotifier([webhook(f"{receiver.url}/hook"),
                              slack(f"{receiver.url}{SLACK_PATH}", retries=0)])
    payload = {**PAYLOAD, "delivery_key": "incident-7-remediation-3"}

    first = notifier.notify("s", "b", dict(payload))
    assert "slack failed" in first.detail
    second = notifier.notify("s", "b", dict(payload))
    assert "webhook skipped: already delivered" in second.detail
    assert "slack delivered" in second.detail
    third = notifier.notify("s", "b", dict(payload))
    assert not third.changed

    assert len(receiver.to("/hook")) == 1
    assert len(receiver.to(SLACK_PATH)) == 2  # the failed try and the one that got through
    assert [(r.channel, r.status) for r in deliveries_for_incident(7)] == \
        [("webhook", "delivered"), ("slack", "failed"), ("slack", "delivered")]
    # The key travels in the body too, for receivers that dedupe across step retries.
    assert receiver.to("/hook")[0].json["delivery_key"] == "incident-7-remediation-3"

    # Another key is another notification.
    notifier.notify("s", "b", {**PAYLOAD, "delivery_key": "incident-7-remediation-4"})
    assert len(receiver.to("/hook")) == 2


def test_deliveries_for_incident_are_that_incidents_oldest_first(
        receiver: Receiver, db: None) -> None:
    hook = webhook(f"{receiver.url}/hook")
    hook.notify("first", "b", {"incident": 7})
    hook.notify("other", "b", {"incident": 8})
    hook.notify("second", "b", {"incident": 7})
    assert [d.subject for d in deliveries_for_incident(7)] == ["first", "second"]


def test_notifier_from_settings_uses_every_configured_channel(settings: Any) -> None:
    settings.FLEETWATCH_NOTIFY_WEBHOOK_URL = "https://hooks.example/x"
    settings.FLEETWATCH_NOTIFY_WEBHOOK_SECRET = SECRET
    settings.FLEETWATCH_NOTIFY_SLACK_URL = "https://hooks.slack.com/services/T/B/tok"
    settings.FLEETWATCH_NOTIFY_EMAIL = ["oncall@example.com"]
    notifier = notifier_from_settings()
    assert isinstance(notifier, MultiNotifier)
    assert [(c.channel, c.call_text()) for c in notifier.channels] == [
        ("webhook", "POST https://hooks.example/x"),
        ("slack", "POST https://hooks.slack.com/services/…"),
        ("email", "email to oncall@example.com")]
    assert notifier.channels[0].secret == SECRET  # type: ignore[attr-defined]

    settings.FLEETWATCH_NOTIFY_WEBHOOK_URL = None
    settings.FLEETWATCH_NOTIFY_SLACK_URL = ""
    settings.FLEETWATCH_NOTIFY_EMAIL = []
    assert "no channel configured" in notifier_from_settings().notify("s", "b", {}).call
