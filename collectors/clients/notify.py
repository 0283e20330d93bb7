"""Notifications to the on-call: a signed JSON webhook, a Slack-compatible webhook and e-mail.

This module is the *transport* and the helpers every outgoing message shares; it records
nothing itself. Every delivery, a step's notification as much as a webhook subscription's
event, is one row of ``incidents.models.Delivery`` driven by one retry mechanism
(``incidents.deliveries``). Collectors never import incidents, so the notifier reaches that
record through the ``DeliveryLog`` port, which the incidents app registers when it starts
(``delivery_log_set``). For each channel the log:

1. skips it if the caller gave a ``delivery_key`` that this channel already delivered (a
   retried step must not page anyone twice);
2. writes the row, status ``pending``, committed *before* the outside call, so a worker killed
   mid-send still leaves a trace;
3. makes attempts through ``Channel.send`` (one attempt each, never raising), waiting between
   transient failures with the shared back-off (Retry-After honoured, capped), never retrying
   a permanent one;
4. leaves the row delivered or failed, with attempts, the answer's status and an excerpt.

``MultiNotifier`` fans out to every configured channel; one channel down never stops the others.
Only when *every* channel failed does it raise ``ClientError``, so the remediation step retries
(and, thanks to the key, re-sends only to the channels that did not get it).

Shared by every outgoing message (webhook subscriptions too): ``sign``/``verify_signature``,
``redact_url``/``scrub`` (secrets such as hook tokens, query strings and user:password never
reach a row, the audit trail or the log), ``excerpt``, ``absolute_url``/``incident_url`` and
``Answer``/``retry_after``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import smtplib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter

from collectors.clients.base import ActionResult, ClientError
from collectors.redaction import redact_url

log = logging.getLogger(__name__)

DEFAULT_EVENT = "incident.notify"
SIGNATURE_TOLERANCE_S = 300
# HTTP answers worth another try: request timeout, rate limit, any server error.
RETRY_STATUSES = frozenset({408, 429, *range(500, 600)})
# Answers whose Retry-After (seconds) says when to come back (RFC 9110 15.5.20, 15.6.4).
RETRY_AFTER_STATUSES = frozenset({429, 503})
EXCERPT_CHARS = 200
SUBJECT_PREFIX = "[FleetWatch]"


class Notifier(Protocol):
    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult: ...


# --- signing ----------------------------------------------------------------------------------


def sign(secret: str, timestamp: int | str, body: bytes) -> str:
    """``sha256=<hex>`` of HMAC-SHA256(secret, "<timestamp>.<raw body>").

    The timestamp is inside the MAC so a captured request cannot be replayed later with a fresh
    timestamp header (the Stripe/GitHub scheme)."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def verify_signature(secret: str, timestamp: str | int, body: bytes | str, signature: str,
                     tolerance: int = SIGNATURE_TOLERANCE_S, *, now: float | None = None) -> bool:
    """What a receiver runs on ``X-FleetWatch-Timestamp``, the raw body and
    ``X-FleetWatch-Signature``: True only for a fresh request signed with ``secret``.

    Self-contained (hashlib, hmac, time) so receivers can copy it as it is. Verify the raw bytes
    as received, before any JSON parsing: re-serializing changes them."""
    try:
        sent_at = int(timestamp)
    except (TypeError, ValueError):
        return False
    if abs((time.time() if now is None else now) - sent_at) > tolerance:
        return False  # too old (a replay) or from a badly skewed clock
    raw = body.encode() if isinstance(body, str) else body
    # The MAC covers the header exactly as received, not a re-formatted number.
    mac = hmac.new(secret.encode(), f"{timestamp}".strip().encode() + b"." + raw, hashlib.sha256)
    expected = f"sha256={mac.hexdigest()}"
    # Constant-time: a plain == leaks how many leading characters matched.
    return hmac.compare_digest(expected.encode(), (signature or "").strip().encode())


# --- what is recorded -------------------------------------------------------------------------


def _secret_parts(url: str, redacted: str) -> dict[str, str]:
    """The pieces of ``url`` that may show up in a message, each with what to show instead."""
    parts = urlsplit(url)
    redacted_parts = urlsplit(redacted)
    shown = redacted_parts.path + ("?" + redacted_parts.query if redacted_parts.query else "")
    found = {url: redacted}
    if parts.query:
        found[f"{parts.path}?{parts.query}"] = shown or "/…"
    if parts.path != redacted_parts.path and len(parts.path) > 1:
        found[parts.path] = redacted_parts.path or "/…"
    if parts.password:
        found[parts.password] = "…"
    return found


def _replace_all(text: str, secrets: dict[str, str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):  # longest first: a URL before its path
        text = text.replace(secret, secrets[secret])
    return text


def scrub(text: str, url: str, redacted: str) -> str:
    """Remove the URL's secret parts from an error message (urllib3 names the path it tried)."""
    return _replace_all(text, _secret_parts(url, redacted))


class _RedactingFilter(logging.Filter):
    """urllib3 logs the path of every request (DEBUG) and of every retry (WARNING); for Slack-
    style hooks that path is the credential. Rewrites those records before any handler sees
    them."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: dict[str, str] = {}

    def add(self, url: str, redacted: str) -> None:
        # Swapped, never mutated: another thread may be filtering a record right now.
        self.secrets = {**self.secrets, **_secret_parts(url, redacted)}

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = self.secrets
        if secrets:
            message = record.getMessage()
            scrubbed = _replace_all(message, secrets)
            if scrubbed != message:
                record.msg, record.args = scrubbed, ()
        return True


log_redactor = _RedactingFilter()
# A logger's filters see only its own records, not its children's: name each one that logs URLs.
for _name in ("urllib3.connectionpool", "urllib3.util.retry"):
    logging.getLogger(_name).addFilter(log_redactor)


# --- what every outgoing message shares -------------------------------------------------------


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters: what a row keeps of an answer."""
    text = re.sub(r"\s+", " ", text or "").strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _as_int(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def _base_url() -> str:
    from django.conf import settings

    return (getattr(settings, "FLEETWATCH_BASE_URL", "") or "").rstrip("/")


def absolute_url(path: str) -> str:
    """``path`` under FLEETWATCH_BASE_URL (where people reach FleetWatch); the bare path when
    that is not set."""
    return f"{_base_url()}{path}"


def incident_url(incident_id: object) -> str | None:
    """The incident page, when FLEETWATCH_BASE_URL says where FleetWatch is served.

    A literal path, not reverse(): collectors do not depend on the incidents app's URLconf."""
    base, pk = _base_url(), _as_int(incident_id)
    return f"{base}/incidents/{pk}/" if base and pk is not None else None


def retry_after(status: int, headers: Mapping[str, str]) -> float | None:
    """The seconds a 429 or 503 asks to wait. Only the seconds form: an HTTP date from a
    receiver's clock is not worth trusting."""
    if status not in RETRY_AFTER_STATUSES:
        return None
    value = (headers.get("Retry-After") or "").strip()
    return float(value) if value.isdigit() else None


@dataclass(frozen=True)
class Answer:
    """What one attempt at one delivery came to, whatever the transport.

    ``label`` names it in a list of earlier attempts ("HTTP 503", "ConnectionError")."""

    ok: bool
    text: str
    retryable: bool
    code: int | None = None  # an HTTP answer's status; None: no HTTP answer
    retry_after: float | None = None
    label: str = ""


def post(session: requests.Session, url: str, raw: bytes, headers: Mapping[str, str], *,
         timeout: float, limit: int, redact: Callable[[str], str]) -> Answer:
    """One JSON POST, one attempt: what every HTTP delivery (a channel's, a subscription's)
    does. ``text`` is the start of the answer's body, or the error (through ``redact``: urllib3
    names the URL it tried)."""
    try:
        # Redirects are not followed: requests would turn the POST into a GET and could carry
        # the signature to another host (or an internal one); a 3xx fails. Streamed: only the
        # start is read, a receiver's HTML error page can be megabytes.
        with session, session.post(url, data=raw, headers=dict(headers), timeout=timeout,
                                   allow_redirects=False, stream=True) as response:
            start = response.raw.read(4 * limit, decode_content=True) or b""
    # urllib3's errors while reading the streamed answer are not RequestExceptions.
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        return Answer(False, excerpt(redact(f"{type(exc).__name__}: {exc}"), limit),
                      retryable=True, label=type(exc).__name__)
    code = response.status_code
    return Answer(200 <= code < 300, excerpt(start.decode("utf-8", "replace"), limit),
                  retryable=code in RETRY_STATUSES, code=code,
                  retry_after=retry_after(code, response.headers), label=f"HTTP {code}")


# --- one message, and who records it ----------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    channel: str
    call: str
    status: str  # delivered, failed, skipped
    detail: str
    delivery_id: int | None
    permanent: bool = False


@dataclass(frozen=True)
class Message:
    subject: str
    body: str
    payload: dict[str, object]
    event: str = DEFAULT_EVENT
    key: str | None = None
    incident_id: int | None = None

    @classmethod
    def build(cls, subject: str, body: str, payload: dict[str, object]) -> Message:
        key = payload.get("delivery_key")
        event = payload.get("event")
        return cls(subject, body, dict(payload),
                   event=str(event) if event else DEFAULT_EVENT,
                   key=str(key) if key else None,
                   incident_id=_as_int(payload.get("incident")))

    def recorded_payload(self) -> dict[str, object]:
        # What every channel's row keeps: the explanation plus the caller's payload, which
        # carries the delivery_key the next try looks for.
        return {"text": self.body, **_jsonable(self.payload)}


def _jsonable(payload: dict[str, object]) -> dict[str, Any]:
    # Round-trip so a row never fails to save over a datetime or a tuple in the payload.
    return json.loads(json.dumps(payload, default=str))


class DeliveryLog(Protocol):
    """Records one channel's delivery of one message and drives its attempts (incidents'
    ``deliveries.StepDeliveries``: the one delivery model and retry mechanism)."""

    def deliver(self, channel: Channel, message: Message) -> Outcome: ...


_delivery_log: DeliveryLog | None = None


def delivery_log_set(delivery_log: DeliveryLog | None) -> None:
    """Register who records deliveries (the incidents app does, when it starts)."""
    global _delivery_log
    _delivery_log = delivery_log


def _log() -> DeliveryLog:
    if _delivery_log is None:
        raise ClientError("notify: no delivery log registered (the incidents app registers "
                          "one when Django starts)", permanent=True)
    return _delivery_log


# --- channels ---------------------------------------------------------------------------------


class Channel:
    """One destination: how to send one attempt, and how its attempts are paced."""

    channel = ""
    retries = 0  # attempts after the first, within one notify
    backoff = 0.0  # seconds before the first retry; doubles with each one
    # A Retry-After is honoured up to this: a rate-limited hook must not hold a worker for
    # minutes; the step's own retry comes later anyway.
    retry_after_max = 10.0
    timeout = 30.0  # the longest one attempt may take

    @property
    def target(self) -> str:  # recorded, shown, logged: never a secret
        raise NotImplementedError

    def call_text(self) -> str:
        raise NotImplementedError

    def send(self, message: Message, delivery_id: int) -> Answer:
        """One attempt. Never raises for what the other side did: that is the Answer."""
        raise NotImplementedError

    def final_text(self, answer: Answer, attempts: int, earlier: Sequence[str]) -> str:
        """What the row and the step show once the attempts are over."""
        return answer.text

    def redact(self, text: str) -> str:
        """``text`` with this channel's secrets taken out (HTTP channels: their URL's)."""
        return text

    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult:
        """This channel alone, with the same contract as ``MultiNotifier``."""
        return MultiNotifier([self]).notify(subject, body, payload)


class HttpChannel(Channel):
    """A JSON POST. Subclasses build the body and headers."""

    def __init__(self, url: str, *, timeout: float = 5.0, retries: int = 3,
                 backoff: float = 0.5) -> None:
        self.url = url
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        if url:
            log_redactor.add(url, self.target)

    def call_text(self) -> str:
        return f"POST {self.target}"

    def redact(self, text: str) -> str:
        return scrub(text, self.url, self.target)

    def body_for(self, message: Message, delivery_id: int) -> dict[str, object]:
        raise NotImplementedError

    def headers_for(self, message: Message, delivery_id: int, raw: bytes) -> dict[str, str]:
        return {}

    def send(self, message: Message, delivery_id: int) -> Answer:
        # The body is the same bytes on every attempt of one delivery (the row's id is in it),
        # and the signature covers exactly them.
        raw = json.dumps(self.body_for(message, delivery_id), separators=(",", ":"),
                         default=str).encode()
        headers = {"Content-Type": "application/json",
                   "User-Agent": "FleetWatch-Notifier/1",
                   **self.headers_for(message, delivery_id, raw)}
        session = requests.Session()
        adapter = HTTPAdapter(max_retries=0)  # retries are the delivery's, counted on its row
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        answer = post(session, self.url, raw, headers, timeout=self.timeout,
                      limit=EXCERPT_CHARS, redact=self.redact)
        if answer.code is None:
            return answer
        return replace(answer, text=f"answered {answer.code}"
                                    + (f": {answer.text}" if answer.text else ""))

    def final_text(self, answer: Answer, attempts: int, earlier: Sequence[str]) -> str:
        if answer.code is None:
            return f"unreachable after {attempts} attempt(s): {answer.text}"
        return answer.text + (f" (after {', '.join(earlier)})" if earlier else "")


class WebhookNotifier(HttpChannel):
    """A JSON POST to any receiver, signed when a secret is set.

    Headers: ``X-FleetWatch-Event``, ``X-FleetWatch-Delivery`` (the delivery's id: the same on
    every retry of one delivery, so receivers can dedupe), ``X-FleetWatch-Timestamp`` (unix
    seconds) and ``X-FleetWatch-Signature: sha256=<hex>`` (see ``sign``/``verify_signature``).
    The body is ``{"event", "delivery", "subject", "text", "url"?, **payload}``."""

    channel = "webhook"

    def __init__(self, url: str | None, *, secret: str = "", timeout: float = 5.0,
                 retries: int = 3, backoff: float = 0.5) -> None:
        super().__init__(url or "", timeout=timeout, retries=retries, backoff=backoff)
        self.secret = secret

    @property
    def target(self) -> str:
        return redact_url(self.url)

    def body_for(self, message: Message, delivery_id: int) -> dict[str, object]:
        body: dict[str, object] = {"event": message.event, "delivery": delivery_id,
                                   "subject": message.subject, "text": message.body}
        link = incident_url(message.incident_id)
        if link:
            body["url"] = link
        # The envelope wins over a payload key of the same name: the body's event and
        # delivery must agree with the signed headers.
        return {**message.payload, **body}

    def headers_for(self, message: Message, delivery_id: int, raw: bytes) -> dict[str, str]:
        timestamp = int(time.time())
        headers = {"X-FleetWatch-Event": message.event,
                   "X-FleetWatch-Delivery": str(delivery_id),
                   "X-FleetWatch-Timestamp": str(timestamp)}
        if self.secret:
            headers["X-FleetWatch-Signature"] = sign(self.secret, timestamp, raw)
        return headers

    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult:
        if not self.url:  # kept for callers that build one from an optional setting
            return MultiNotifier([]).notify(subject, body, payload)
        return super().notify(subject, body, payload)


def _slack_mention(member: object) -> str:
    """``<@U0123ABC>`` for a Slack member id; anything else mentions nobody (never markup)."""
    text = str(member or "")
    return f"<@{text}>" if re.fullmatch(r"[A-Z0-9]{2,32}", text) else ""


def _slack_escape(text: str) -> str:
    # Slack's mrkdwn treats these three as control characters.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_message(message: Message) -> dict[str, object]:
    """An incoming-webhook message: ``text`` carries everything (Mattermost and Rocket.Chat
    show only it; Slack uses it for notifications), ``blocks`` lays it out in Slack."""
    nodes = [str(n) for n in message.payload.get("nodes") or []]  # type: ignore[attr-defined]
    root_cause = message.payload.get("root_cause")
    link = incident_url(message.incident_id)
    lines = [_slack_escape(message.subject), _slack_escape(message.body)]
    mention = _slack_mention(message.payload.get("mention"))
    if mention:  # a job owner's message: the channel tells them by name
        lines.insert(0, mention)
    if nodes:
        lines.append("Nodes: " + ", ".join(f"`{_slack_escape(n)}`" for n in nodes))
    if link:
        lines.append(f"<{link}|Open incident {message.incident_id} in FleetWatch>")
    blocks: list[dict[str, object]] = [
        # Slack refuses a header over 150 characters or an empty one (invalid_blocks).
        {"type": "header", "text": {"type": "plain_text",
                                    "text": message.subject[:150] or "FleetWatch"}},
    ]
    if message.body:
        blocks.append({"type": "section",
                       "text": {"type": "mrkdwn", "text": (f"{mention} " if mention else "")
                                + _slack_escape(message.body)[:2900]}})
    fields = []
    if nodes:
        fields.append({"type": "mrkdwn", "text": "*Nodes*\n" + _slack_escape(", ".join(nodes))[:1900]})
    if root_cause:
        fields.append({"type": "mrkdwn", "text": f"*Root cause*\n`{_slack_escape(str(root_cause))}`"})
    if fields:
        blocks.append({"type": "section", "fields": fields})
    if link:
        blocks.append({"type": "actions", "elements": [
            {"type": "button", "text": {"type": "plain_text", "text": "Open incident"},
             "url": link}]})
    return {"text": "\n".join(line for line in lines if line), "blocks": blocks}


class SlackNotifier(HttpChannel):
    """A Slack incoming webhook (or Mattermost's or Rocket.Chat's, which accept the same).

    The hook URL is the credential: only ``https://host/<first segment>/…`` is ever recorded."""

    channel = "slack"

    @property
    def target(self) -> str:
        return redact_url(self.url, keep_path=False)

    def body_for(self, message: Message, delivery_id: int) -> dict[str, object]:
        return slack_message(message)


# --- e-mail -----------------------------------------------------------------------------------


def _smtp_permanent(exc: BaseException) -> bool:
    """5xx SMTP replies and bad credentials will not get better by retrying; 4xx replies,
    dropped connections and timeouts might."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        codes = [code for code, _ in exc.recipients.values()]
        return bool(codes) and all(code >= 500 for code in codes)
    if isinstance(exc, smtplib.SMTPResponseException):
        return exc.smtp_code >= 500
    return False


class EmailNotifier(Channel):
    """Plain-text e-mail through Django's mail backend (EMAIL_* settings)."""

    channel = "email"

    def __init__(self, addresses: Sequence[str], *, from_email: str | None = None,
                 retries: int = 2, backoff: float = 1.0) -> None:
        self.addresses = [a for a in addresses if a]
        self.from_email = from_email
        self.retries = retries
        self.backoff = backoff

    @property
    def target(self) -> str:
        return ", ".join(self.addresses)

    def call_text(self) -> str:
        return f"email to {self.target}"

    def _message_text(self, message: Message) -> str:
        lines = [message.body, ""]
        if message.payload.get("root_cause"):
            lines.append(f"Root cause: {message.payload['root_cause']}")
        nodes = message.payload.get("nodes")
        if nodes:
            lines.append("Nodes: " + ", ".join(str(n) for n in nodes))  # type: ignore[attr-defined]
        link = incident_url(message.incident_id)
        if link:
            lines.append(f"Incident: {link}")
        return "\n".join(lines).strip() + "\n"

    def send(self, message: Message, delivery_id: int) -> Answer:
        from django.conf import settings
        from django.core.mail import EmailMessage, get_connection

        email = EmailMessage(
            # One line: Django refuses a header with a newline in it (header injection).
            subject=f"{SUBJECT_PREFIX} {' '.join(message.subject.split())}",
            body=self._message_text(message),
            from_email=self.from_email or settings.DEFAULT_FROM_EMAIL,
            to=self.addresses,
            headers={"X-FleetWatch-Event": message.event,
                     "X-FleetWatch-Delivery": str(delivery_id)},
        )
        try:
            # A fresh connection each attempt: a dropped SMTP session is not reused.
            sent = get_connection(fail_silently=False).send_messages([email])
        except (smtplib.SMTPException, OSError) as exc:
            return Answer(False, f"{type(exc).__name__}: {excerpt(str(exc))}",
                          retryable=not _smtp_permanent(exc), label=type(exc).__name__)
        if not sent:
            return Answer(False, "email backend sent nothing", retryable=True,
                          label="nothing sent")
        return Answer(True, f"handed to the mail server for {len(self.addresses)} address(es)",
                      retryable=False)


# --- fan-out ----------------------------------------------------------------------------------


class MultiNotifier:
    """Every configured channel, each on its own: one down never stops the others."""

    def __init__(self, channels: Sequence[Channel]) -> None:
        self.channels = list(channels)

    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult:
        if not self.channels:
            return ActionResult("notify (no channel configured: recorded only)", True, subject)
        message = Message.build(subject, body, payload)
        deliveries = _log()
        outcomes = [deliveries.deliver(channel, message) for channel in self.channels]
        call = "; ".join(o.call for o in outcomes)
        detail = "; ".join(f"{o.channel} {o.status}: {o.detail}" for o in outcomes)
        failed = [o for o in outcomes if o.status == "failed"]
        if len(failed) == len(outcomes):
            # Only now is it the step's problem: retry unless nothing could ever succeed.
            raise ClientError(f"{call}: {detail}",
                              permanent=all(o.permanent for o in failed))
        return ActionResult(
            call, any(o.status == "delivered" for o in outcomes), detail,
            {"deliveries": {o.channel: {"id": o.delivery_id, "status": o.status}
                            for o in outcomes}})


def notifier_from_settings() -> Notifier:
    """Every channel the configuration names; none: notifications are recorded only."""
    from django.conf import settings

    timeout = settings.FLEETWATCH_HTTP_TIMEOUT
    channels: list[Channel] = []
    if settings.FLEETWATCH_NOTIFY_WEBHOOK_URL:
        channels.append(WebhookNotifier(
            settings.FLEETWATCH_NOTIFY_WEBHOOK_URL,
            secret=getattr(settings, "FLEETWATCH_NOTIFY_WEBHOOK_SECRET", ""), timeout=timeout))
    if getattr(settings, "FLEETWATCH_NOTIFY_SLACK_URL", ""):
        channels.append(SlackNotifier(settings.FLEETWATCH_NOTIFY_SLACK_URL, timeout=timeout))
    if getattr(settings, "FLEETWATCH_NOTIFY_EMAIL", None):
        channels.append(EmailNotifier(settings.FLEETWATCH_NOTIFY_EMAIL))
    return MultiNotifier(channels)


# --- a job's owner ----------------------------------------------------------------------------


def owner_address(user: str) -> str:
    """Where a Slurm user is told about their job: FLEETWATCH_OWNER_CONTACTS names it
    (an e-mail address, ``slack:MEMBERID``, or ``none``), else USER@FLEETWATCH_OWNER_EMAIL_DOMAIN,
    else "" (no one to tell: the job's page and its Slurm comment still say it)."""
    from django.conf import settings

    contacts: Mapping[str, str] = getattr(settings, "FLEETWATCH_OWNER_CONTACTS", {})
    address = contacts.get(user)
    if address is not None:
        return "" if address == "none" else address
    domain = getattr(settings, "FLEETWATCH_OWNER_EMAIL_DOMAIN", "")
    return f"{user}@{domain}" if user and domain else ""


def owner_channel(address: str) -> Channel | None:
    """The channel that reaches ``address``: e-mail, or the Slack hook with a mention."""
    from django.conf import settings

    if address.startswith("slack:"):
        url = getattr(settings, "FLEETWATCH_NOTIFY_SLACK_URL", "")
        return SlackNotifier(url, timeout=settings.FLEETWATCH_HTTP_TIMEOUT) if url else None
    return EmailNotifier([address]) if "@" in address else None


def owner_notify(user: str, subject: str, body: str, payload: dict[str, object]) -> ActionResult:
    """Tell a job's owner, on their own channel, with the same delivery rules as every
    message (one row per channel, ``delivery_key`` so a retried step does not tell twice).
    No address, or a Slack member with no Slack hook: nothing sent, said plainly."""
    address = owner_address(user)
    channel = owner_channel(address) if address else None
    if channel is None:
        why = (f"no address for Slurm user {user!r} (FLEETWATCH_OWNER_CONTACTS, "
               "FLEETWATCH_OWNER_EMAIL_DOMAIN)" if not address
               else f"{address} needs FLEETWATCH_NOTIFY_SLACK_URL")
        # No call made: audited as a note (no outside call), not as a message sent.
        return ActionResult("", False, f"owner {user} not told: {why}")
    if address.startswith("slack:"):
        payload = {**payload, "mention": address.removeprefix("slack:")}
    return MultiNotifier([channel]).notify(subject, body, {**payload, "owner": user})
