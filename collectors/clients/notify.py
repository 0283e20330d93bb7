"""Notifications: a signed JSON webhook, a Slack-compatible webhook and e-mail, each recorded.

Every channel follows the same path (healthchecks' transports are the model):

1. if the caller gave a ``delivery_key`` and this channel already delivered it, skip it (a
   retried step must not page anyone twice);
2. write a ``Delivery`` row, status ``pending``, in its own transaction, *before* the outside
   call, so a worker killed mid-send still leaves a trace;
3. make the call, retrying transient failures (urllib3 ``Retry`` for HTTP, a short loop for
   SMTP) and never permanent ones;
4. update the row: delivered or failed, attempts, the answer's status and an excerpt or error.

``MultiNotifier`` fans out to every configured channel; one channel down never stops the others.
Only when *every* channel failed does it raise ``ClientError``, so the remediation step retries
(and, thanks to the key, re-sends only to the channels that did not get it).

Secrets (Slack/Mattermost hook tokens, query strings, user:password in URLs) never reach a
``Delivery`` row, the audit trail or the log: everything recorded goes through ``redact_url``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import smtplib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from collectors.clients.base import ActionResult, ClientError
from collectors.redaction import redact_url

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from collectors.models import Delivery

log = logging.getLogger(__name__)

DEFAULT_EVENT = "incident.notify"
SIGNATURE_TOLERANCE_S = 300
# HTTP answers worth another try: request timeout, rate limit, any server error.
RETRY_STATUSES = frozenset({408, 429, *range(500, 600)})
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


def _excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
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


def incident_url(incident_id: object) -> str | None:
    """The incident page, when FLEETWATCH_BASE_URL says where FleetWatch is served.

    A literal path, not reverse(): collectors do not depend on the incidents app's URLconf."""
    base, pk = _base_url(), _as_int(incident_id)
    return f"{base}/incidents/{pk}/" if base and pk is not None else None


def deliveries_for_incident(incident_id: int) -> QuerySet[Delivery]:
    """Every notification tried for an incident, oldest first (the order the story is read)."""
    from collectors.models import Delivery

    return Delivery.objects.filter(incident_id=incident_id).order_by("created_at", "id")


# --- one channel's delivery -------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """What a channel's transport reports after a successful send."""

    attempts: int
    response: str


class SendError(Exception):
    """A transport's failure: the (secret-free) message, whether it is worth retrying, and how
    many attempts went out before giving up."""

    def __init__(self, message: str, *, permanent: bool, attempts: int) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.attempts = attempts


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


class Channel:
    """One destination. Subclasses say how to send; this class records and dedupes."""

    channel = ""

    @property
    def target(self) -> str:  # recorded, shown, logged: never a secret
        raise NotImplementedError

    def call_text(self) -> str:
        raise NotImplementedError

    def send(self, message: Message, delivery_id: int) -> Sent:
        raise NotImplementedError

    def redact(self, text: str) -> str:
        """``text`` with this channel's secrets taken out (HTTP channels: their URL's)."""
        return text

    def deliver(self, message: Message) -> Outcome:
        from django.db import transaction
        from django.utils import timezone

        from collectors.models import Delivery

        call, target = self.call_text(), self.target[:300]
        if message.key:
            done = (Delivery.objects.filter(channel=self.channel, target=target,
                                            status=Delivery.Status.DELIVERED,
                                            payload__delivery_key=message.key)
                    .order_by("id").first())
            if done is not None:
                return Outcome(self.channel, call, "skipped",
                               f"already delivered ({message.key}, delivery {done.pk})", done.pk)
        # Its own transaction, committed before the call: the row must exist (and be seen by
        # anyone looking, the receiver included) even if this worker dies during the send.
        with transaction.atomic():
            row = Delivery.objects.create(
                channel=self.channel, target=target, event=message.event[:64],
                subject=message.subject[:300], payload=message.recorded_payload(),
                incident_id=message.incident_id, status=Delivery.Status.PENDING)
        try:
            sent = self.send(message, row.pk)
        except SendError as exc:
            with transaction.atomic():
                Delivery.objects.filter(pk=row.pk).update(
                    status=Delivery.Status.FAILED, attempts=exc.attempts, response=str(exc)[:2000])
            log.warning("notify %s to %s failed after %d attempt(s): %s",
                        self.channel, self.target, exc.attempts, exc)
            return Outcome(self.channel, call, "failed", str(exc), row.pk, exc.permanent)
        except Exception as exc:  # a bug in one channel must not silence the others
            error = self.redact(f"{type(exc).__name__}: {exc}")
            with transaction.atomic():
                Delivery.objects.filter(pk=row.pk).update(
                    status=Delivery.Status.FAILED, attempts=1, response=error[:2000])
            # No traceback: its frames' text could hold the hook URL this module hides.
            log.error("notify %s to %s raised %s", self.channel, self.target, error)
            return Outcome(self.channel, call, "failed", error, row.pk)
        with transaction.atomic():
            Delivery.objects.filter(pk=row.pk).update(
                status=Delivery.Status.DELIVERED, attempts=sent.attempts,
                response=sent.response[:2000], delivered_at=timezone.now())
        log.info("notify %s to %s delivered (%s)", self.channel, self.target, sent.response)
        return Outcome(self.channel, call, "delivered", sent.response, row.pk)

    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult:
        """This channel alone, with the same contract as ``MultiNotifier``."""
        return MultiNotifier([self]).notify(subject, body, payload)


# --- HTTP channels ----------------------------------------------------------------------------


@dataclass
class _Tally:
    failures: list[str] = field(default_factory=list)
    last_failed_response: object | None = None


class _CountingRetry(Retry):
    """urllib3's Retry, telling the caller how many attempts went out and what each answered.

    urllib3 keeps its history on a copy it discards when it gives up, so the tally is shared
    by every copy instead. Retry-After is honoured but capped: a rate-limited hook must not
    hold a worker for minutes; the step's own retry comes later anyway."""

    def __init__(self, *args: Any, tally: _Tally | None = None, retry_after_max: float = 10.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tally = tally if tally is not None else _Tally()
        self.retry_after_max = retry_after_max

    def new(self, **kw: Any) -> _CountingRetry:
        copy = super().new(**kw)
        copy.tally, copy.retry_after_max = self.tally, self.retry_after_max
        return copy

    def increment(self, method: str | None = None, url: str | None = None, response: Any = None,
                  error: Exception | None = None, _pool: Any = None,
                  _stacktrace: Any = None) -> _CountingRetry:
        if response is not None:
            self.tally.failures.append(f"HTTP {response.status}")
            self.tally.last_failed_response = response
        else:
            self.tally.failures.append(type(error).__name__ if error else "error")
        return super().increment(method, url, response, error, _pool, _stacktrace)

    def get_retry_after(self, response: Any) -> float | None:
        after = super().get_retry_after(response)
        return None if after is None else min(after, self.retry_after_max)


class HttpChannel(Channel):
    """A JSON POST with retries. Subclasses build the body and headers."""

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

    def _session(self, tally: _Tally) -> requests.Session:
        # A session per send: the retry tally belongs to this one delivery. POST is retried
        # too (allowed_methods=None): receivers dedupe on X-FleetWatch-Delivery.
        retry = _CountingRetry(total=self.retries, backoff_factor=self.backoff,
                               status_forcelist=RETRY_STATUSES, allowed_methods=None,
                               raise_on_status=False, tally=tally)
        session = requests.Session()
        adapter = HTTPAdapter(max_retries=retry)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        return session

    def send(self, message: Message, delivery_id: int) -> Sent:
        # Serialized once: the signature covers exactly these bytes, and retries resend them.
        raw = json.dumps(self.body_for(message, delivery_id), separators=(",", ":"),
                         default=str).encode()
        headers = {"Content-Type": "application/json",
                   "User-Agent": "FleetWatch-Notifier/1",
                   **self.headers_for(message, delivery_id, raw)}
        tally = _Tally()
        try:
            with self._session(tally) as session:
                # Redirects are not followed: requests would turn the POST into a GET and
                # could carry the signature to another host.
                response = session.post(self.url, data=raw, headers=headers,
                                        timeout=self.timeout, allow_redirects=False)
        except requests.RequestException as exc:
            attempts = max(1, len(tally.failures))
            raise SendError(f"unreachable after {attempts} attempt(s): "
                            f"{self.redact(str(exc))}",
                            permanent=False, attempts=attempts) from exc
        retried = len(tally.failures)
        # When urllib3 gave up on a retryable status it hands back that last answer, which
        # it had already counted as a failure; otherwise the answer is one more attempt.
        attempts = retried if tally.last_failed_response is response.raw else retried + 1
        earlier = tally.failures[: attempts - 1]
        # Only the start is decoded: a receiver's HTML error page can be megabytes.
        excerpt = _excerpt(response.content[:1000].decode("utf-8", "replace"))
        answer = f"answered {response.status_code}" + (f": {excerpt}" if excerpt else "")
        if earlier:
            answer += f" (after {', '.join(earlier)})"
        attempts = max(1, attempts)
        if response.status_code >= 300:  # 3xx too: redirects are not followed (see above)
            raise SendError(answer, permanent=response.status_code not in RETRY_STATUSES,
                            attempts=attempts)
        return Sent(attempts, answer)


class WebhookNotifier(HttpChannel):
    """A JSON POST to any receiver, signed when a secret is set.

    Headers: ``X-FleetWatch-Event``, ``X-FleetWatch-Delivery`` (the Delivery id: the same on
    every HTTP retry of one delivery, so receivers can dedupe), ``X-FleetWatch-Timestamp`` (unix
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
                       "text": {"type": "mrkdwn", "text": _slack_escape(message.body)[:3000]}})
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

    def send(self, message: Message, delivery_id: int) -> Sent:
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
        attempt = 0
        while True:
            attempt += 1
            try:
                # A fresh connection each try: a dropped SMTP session is not reused.
                sent = get_connection(fail_silently=False).send_messages([email])
            except (smtplib.SMTPException, OSError) as exc:
                permanent = _smtp_permanent(exc)
                if permanent or attempt > self.retries:
                    raise SendError(f"{type(exc).__name__}: {_excerpt(str(exc))}",
                                    permanent=permanent, attempts=attempt) from exc
                time.sleep(self.backoff * 2 ** (attempt - 1))
                continue
            if not sent:
                raise SendError("email backend sent nothing", permanent=False, attempts=attempt)
            return Sent(attempt, f"handed to the mail server for {len(self.addresses)} address(es)")


# --- fan-out ----------------------------------------------------------------------------------


class MultiNotifier:
    """Every configured channel, each on its own: one down never stops the others."""

    def __init__(self, channels: Sequence[Channel]) -> None:
        self.channels = list(channels)

    def notify(self, subject: str, body: str, payload: dict[str, object]) -> ActionResult:
        if not self.channels:
            return ActionResult("notify (no channel configured: recorded only)", True, subject)
        message = Message.build(subject, body, payload)
        outcomes = [channel.deliver(message) for channel in self.channels]
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
