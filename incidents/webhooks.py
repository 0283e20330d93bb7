"""Webhooks out: subscribers hear about incidents (see WebhookSubscription).

The path of one event:

1. ``event_emit`` (called by services on commit) builds the payload once and writes one
   ``WebhookDelivery`` per active subscription that wants the event, then queues
   ``incidents.tasks.webhook_deliver`` for each. It never raises: the change that caused the
   event is already committed, and a broken webhook must not look like a failed approval.
2. ``delivery_attempt`` makes one HTTP attempt and records it on the row. The database row is
   the truth: the task only asks it "send now?" and "when next?". A transient failure (no
   connection, a timeout, 408, 429, 5xx) is tried again after a growing delay
   (FLEETWATCH_WEBHOOK_BACKOFF_SECONDS, times 5 per attempt, at most
   FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS) until FLEETWATCH_WEBHOOK_MAX_ATTEMPTS; any other
   answer that is not 2xx (a 410 from a receiver that is gone, a redirect) fails at once.
3. ``deliveries_rescue`` (beat) re-queues pending rows whose next attempt is long overdue: the
   message was lost with a killed worker or a restarted broker.

What the receiver gets (the scheme of collectors.clients.notify's webhook, so one
``verify_signature`` serves both): a JSON POST whose body is the stored payload, byte for byte
the same on every attempt, with headers ``X-FleetWatch-Event``, ``X-FleetWatch-Event-Id`` (the
event's id, shared by all subscriptions and every retry and redelivery: dedupe on it),
``X-FleetWatch-Delivery`` (this row's id), ``X-FleetWatch-Timestamp`` (unix seconds, fresh on
each attempt) and ``X-FleetWatch-Signature: sha256=<hex>``, the HMAC-SHA256 of
``"<timestamp>.<raw body>"`` with the subscription's secret.

Secrets stay out of rows, logs and answers: URLs are recorded through ``redact_url``, error
texts are scrubbed of the URL's path and query, and the signing secret is never logged.

Where a webhook may point (``target_check``): a subscription makes FleetWatch's own network
position send requests, and its answer's start is stored, so a URL aimed at loopback, the
cluster's private network or a cloud metadata address would let whoever subscribes probe
inside. Every address the host resolves to must be global (not loopback, private, link-local,
multicast, reserved, unspecified, shared or documentation space, also when written as an
IPv4-mapped, 6to4, Teredo or NAT64 IPv6 address, or in decimal or hex, which the resolver
turns into the address it means), unless FLEETWATCH_WEBHOOK_ALLOW_HOSTS lists the host name
or a range holding the address. Checked when a subscription is made or changed, and again
at each delivery, which then connects to the very address it checked (a name re-pointed at
an internal address after the check, "DNS rebinding", gains nothing). Through an HTTP(S)
proxy from the environment the proxy connects, so the check is made just before sending.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone
from requests.adapters import HTTPAdapter

from collectors.clients import notify
from incidents.models import Incident, Remediation, WebhookDelivery, WebhookSubscription

log = logging.getLogger(__name__)

PING = "ping"
USER_AGENT = "FleetWatch-Webhooks/1"
EXCERPT_CHARS = 500
BACKOFF_FACTOR = 5
# A message whose countdown ends now may be handled by a worker whose clock is a little behind
# the one that scheduled it: that early arrival is still the retry, not a duplicate.
DUE_SLACK_S = 2.0
# While an attempt is in flight the row's next_attempt_at is pushed this far past the HTTP
# timeout: a duplicate message (a rescue, a broker redelivery) finds it not due and leaves it.
LEASE_EXTRA_S = 30.0


# --- the payload ------------------------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _absolute(path: str) -> str:
    base = (getattr(settings, "FLEETWATCH_BASE_URL", "") or "").rstrip("/")
    return f"{base}{path}" if base else path


def _incident_body(incident: Incident) -> dict[str, Any]:
    return {
        "id": incident.pk,
        "status": incident.status,
        "root_cause": incident.root_cause,
        "confidence": incident.confidence,
        "explanation": incident.explanation,
        "playbook": incident.playbook,
        "nodes": list(incident.nodes or []),
        "jobs": list(incident.jobs or []),
        "switch": incident.switch,
        "detected_at": _iso(incident.detected_at),
        "opened_at": _iso(incident.opened_at),
        "resolved_at": _iso(incident.resolved_at),
        "acknowledged_by": incident.acknowledged_by,
        "acknowledged_at": _iso(incident.acknowledged_at),
        # The page exists only where FLEETWATCH_BASE_URL says where people reach FleetWatch.
        "url": notify.incident_url(incident.pk),
        "api_url": _absolute(reverse("api:incident-detail", kwargs={"pk": incident.pk})),
    }


def _remediation_body(rem: Remediation) -> dict[str, Any]:
    # Stopped for a person (blocked) takes the same approve as awaiting approval.
    waiting = rem.status in (Remediation.Status.AWAITING_APPROVAL, Remediation.Status.BLOCKED)
    return {
        "id": rem.pk,
        "playbook": rem.playbook,
        "status": rem.status,
        "mode": rem.mode,
        "nodes": list(rem.nodes or []),
        "hold_reason": rem.hold_reason,
        "requested_by": rem.requested_by,
        "approved_by": rem.approved_by,
        # A POST with an operator's token approves it; only offered while it waits.
        "approve_url": (_absolute(reverse("api:remediation-approve", kwargs={"pk": rem.pk}))
                        if waiting else None),
    }


def payload_build(event: str, incident_id: int, remediation_id: int | None = None) -> dict[str, Any]:
    """The JSON every subscriber gets for one event: the incident (and remediation) as they are
    now, just after the change was committed."""
    incident = Incident.objects.get(pk=incident_id)
    rem = (Remediation.objects.filter(pk=remediation_id, incident_id=incident_id).first()
           if remediation_id is not None else None)
    return {
        "event": event,
        "event_id": str(uuid.uuid4()),
        "occurred_at": timezone.now().isoformat(),
        "incident": _incident_body(incident),
        "remediation": _remediation_body(rem) if rem is not None else None,
    }


# Events a subscription gets only when it lists them ("no events listed: all of them" means
# all incident events): the audit trail's hourly checkpoint is news to an auditor's store, not
# to a pager.
OPT_IN = frozenset({WebhookSubscription.Event.AUDIT_CHECKPOINT.value})


def _wants(subscription: WebhookSubscription, event: str) -> bool:
    if event in OPT_IN:
        return event in (subscription.events or [])
    return not subscription.events or event in subscription.events


# --- recording and queueing -------------------------------------------------------------------


def delivery_queue(delivery_id: int, countdown: float | None = None) -> bool:
    """Hand one delivery to a worker. False (logged) when the broker would not take it: the
    row stays pending and ``deliveries_rescue`` queues it later."""
    from incidents import tasks  # tasks import this module

    try:
        tasks.webhook_deliver.apply_async(args=[delivery_id], countdown=countdown or None)
    except Exception as exc:  # the broker is down: the rescue picks the row up later
        log.warning("webhook delivery %s not queued (%s: %s); the rescue will retry it",
                    delivery_id, type(exc).__name__, exc)
        return False
    return True


def event_emit(event: str, incident_id: int, remediation_id: int | None = None) -> list[int]:
    """Record a delivery for each subscription that wants ``event`` and queue it.

    Runs after the change committed, inside whatever request or task made it: it logs and
    returns what it managed, and never raises into that caller."""
    try:
        # Filtered here rather than with a JSON lookup: SQLite (the embedded demo) has no
        # ``contains`` on JSON, and there are a handful of subscriptions, not thousands.
        subscriptions = [s for s in WebhookSubscription.objects.filter(active=True)
                         if _wants(s, event)]
        if not subscriptions:
            return []
        payload = payload_build(event, incident_id, remediation_id)
        now = timezone.now()
        with transaction.atomic():
            ids = [WebhookDelivery.objects.create(
                subscription=s, event=event, event_id=payload["event_id"],
                incident_id=incident_id, payload=payload, next_attempt_at=now).pk
                for s in subscriptions]
    except Exception:
        log.exception("webhooks: %s for incident %s not recorded", event, incident_id)
        return []
    for delivery_id in ids:
        delivery_queue(delivery_id)
    log.info("webhooks: %s for incident %s queued as deliveries %s", event, incident_id, ids)
    return ids


def checkpoint_emit(checkpoint: dict[str, Any]) -> list[int]:
    """Send a signed audit checkpoint (incidents.audit.checkpoint_make) to the subscriptions
    that list ``audit.checkpoint``: a copy of the trail's head kept outside the database.
    Never raises (the checkpoint is in the log whatever happens here)."""
    event = WebhookSubscription.Event.AUDIT_CHECKPOINT.value
    try:
        subscriptions = [s for s in WebhookSubscription.objects.filter(active=True)
                         if _wants(s, event)]
        if not subscriptions:
            return []
        payload = {"event": event, "event_id": str(uuid.uuid4()),
                   "occurred_at": timezone.now().isoformat(), "checkpoint": checkpoint,
                   "incident": None, "remediation": None}
        now = timezone.now()
        with transaction.atomic():
            ids = [WebhookDelivery.objects.create(
                subscription=s, event=event, event_id=payload["event_id"], payload=payload,
                next_attempt_at=now).pk for s in subscriptions]
    except Exception:
        log.exception("webhooks: audit checkpoint not recorded")
        return []
    for delivery_id in ids:
        delivery_queue(delivery_id)
    return ids


def ping_send(subscription: WebhookSubscription) -> WebhookDelivery:
    """A ``ping`` to one subscription, attempted now so the caller sees the answer; a
    transient failure goes on retrying in the background like any delivery."""
    payload = {
        "event": PING,
        "event_id": str(uuid.uuid4()),
        "occurred_at": timezone.now().isoformat(),
        "subscription": {"id": subscription.pk, "name": subscription.name,
                         "events": list(subscription.events or [])},
        "incident": None,
        "remediation": None,
    }
    # Committed before the call, so the row is there even if this request dies mid-send.
    with transaction.atomic():
        delivery = WebhookDelivery.objects.create(
            subscription=subscription, event=PING, event_id=payload["event_id"],
            payload=payload, next_attempt_at=timezone.now())
    countdown = delivery_attempt(delivery.pk)
    if countdown is not None:
        transaction.on_commit(lambda: delivery_queue(delivery.pk, countdown))
    delivery.refresh_from_db()
    return delivery


class RedeliverRefused(Exception):
    """A redelivery that would race one already under way."""


def redeliver(delivery_id: int) -> WebhookDelivery:
    """Send a finished delivery's event again, as a new delivery row (the old one stays as the
    record of what happened) with the same event id, so receivers can dedupe.

    Refused while the delivery, or an earlier redelivery of the same event to the same
    subscription, is still pending: pressing the button twice sends once."""
    with transaction.atomic():
        original = WebhookDelivery.objects.select_for_update().select_related(
            "subscription").get(pk=delivery_id)
        if original.status == WebhookDelivery.Status.PENDING:
            raise RedeliverRefused(f"delivery {original.pk} is still pending "
                                   f"(attempt {original.attempts + 1} is due)")
        busy = (WebhookDelivery.objects.filter(
            subscription_id=original.subscription_id, event_id=original.event_id,
            status=WebhookDelivery.Status.PENDING).values_list("pk", flat=True).first())
        if busy is not None:
            raise RedeliverRefused(f"delivery {busy} of the same event is already pending")
        if not original.subscription.active:
            raise RedeliverRefused(f"subscription {original.subscription.name!r} is inactive")
        copy = WebhookDelivery.objects.create(
            subscription=original.subscription, event=original.event,
            event_id=original.event_id, incident_id=original.incident_id,
            payload=original.payload, next_attempt_at=timezone.now())
        transaction.on_commit(lambda: delivery_queue(copy.pk))
    log.info("webhooks: delivery %s redelivered as %s", original.pk, copy.pk)
    return copy


# --- where a webhook may point ---------------------------------------------------------------

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# NAT64's well-known prefix carries an IPv4 address in its last 32 bits.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class TargetRefused(ValueError):
    """The URL's host is, or resolves to, an address a webhook may not be sent to."""


class TargetUnresolved(TargetRefused):
    """The URL's host name does not resolve (now): nothing to check, nothing to send to."""


def _embedded_ipv4(address: Address) -> list[Address]:
    """The IPv4 addresses an IPv6 address stands for (mapped, 6to4, Teredo, NAT64)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    found: list[Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    if address in _NAT64:
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def address_is_public(address: Address) -> bool:
    """Reachable on the public internet, and only there: what a webhook may be sent to."""
    for candidate in (address, *_embedded_ipv4(address)):
        if (not candidate.is_global or candidate.is_multicast or candidate.is_reserved
                or candidate.is_unspecified or candidate.is_loopback or candidate.is_link_local
                or candidate.is_private):
            return False
    return True


def _allowed(host: str, address: Address | None) -> bool:
    for entry in settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS:
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            if entry.lower().rstrip(".") == host.lower().rstrip("."):
                return True
            continue
        if address is not None and any(a in network for a in (address, *_embedded_ipv4(address))
                                       if a.version == network.version):
            return True
    return False


def _port(parts: Any) -> int:
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # a port that is not a number or out of range
        raise TargetRefused(f"the URL's port is not valid ({exc})") from None


def target_check(url: str, *, resolve_failure_ok: bool = False) -> list[Address]:
    """The addresses ``url``'s host resolves to, all of which a webhook may be sent to;
    TargetRefused if any may not (or, unless ``resolve_failure_ok``, if the name does not
    resolve). A host name listed in FLEETWATCH_WEBHOOK_ALLOW_HOSTS passes whatever it
    resolves to; a listed range lets its addresses pass."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if not host:
        raise TargetRefused("the URL has no host")
    port = _port(parts)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:  # ValueError: an IDNA label too long, a NUL
        if resolve_failure_ok:
            return []
        raise TargetUnresolved(f"{host} does not resolve ({exc})") from None
    addresses: list[Address] = []
    for info in infos:
        # An IPv6 address may come with its zone ("fe80::1%eth0"): the address is before it.
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if _allowed(host, None):
        return addresses
    for address in addresses:
        if not address_is_public(address) and not _allowed(host, address):
            shown = host if host == str(address) else f"{host} ({address})"
            raise TargetRefused(
                f"{shown} is not a public address (loopback, private, link-local or otherwise "
                "internal); an admin may allow it with FLEETWATCH_WEBHOOK_ALLOW_HOSTS")
    return addresses


class _PinnedAdapter(HTTPAdapter):
    """Connect to the address that was checked, not to whatever the name resolves to by the
    time the connection is made; TLS still checks the certificate against the host name
    (SNI and verification use it), and the Host header carries it."""

    def __init__(self, address: Address, hostname: str) -> None:
        super().__init__(max_retries=0)
        self._address, self._hostname = str(address), hostname

    def get_connection_with_tls_context(self, *args: Any, **kwargs: Any) -> Any:
        pool = super().get_connection_with_tls_context(*args, **kwargs)
        pool.host = self._address  # a fresh pool: one session per attempt
        if isinstance(pool, urllib3.HTTPSConnectionPool):
            pool.conn_kw["server_hostname"] = self._hostname
        return pool


def _session_for(url: str) -> requests.Session:
    """A session whose connections go to a checked address (TargetRefused if none may)."""
    session = requests.Session()
    if requests.utils.get_environ_proxies(url):
        target_check(url)  # the proxy connects: check just before sending
        return session
    parts = urlsplit(url)
    addresses = target_check(url)
    adapter = _PinnedAdapter(addresses[0], parts.hostname or "")
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _host_header(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    default = 443 if parts.scheme == "https" else 80
    return host if (parts.port or default) == default else f"{host}:{parts.port}"


# --- one attempt ------------------------------------------------------------------------------


def backoff_seconds(attempts: int) -> float:
    """The wait after the ``attempts``-th failed attempt: 5, 25, 125, 625 s... (defaults),
    never more than the configured maximum."""
    base = settings.FLEETWATCH_WEBHOOK_BACKOFF_SECONDS
    ceiling = settings.FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS
    return float(min(ceiling, base * BACKOFF_FACTOR ** max(0, attempts - 1)))


def _retry_after(response: requests.Response) -> float | None:
    # Only the seconds form: an HTTP date from a receiver's clock is not worth trusting.
    value = response.headers.get("Retry-After", "").strip()
    return float(value) if value.isdigit() else None


def _excerpt(text: str) -> str:
    text = re.sub(r"\s+", " ", text or "").strip()
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 1] + "…"


@dataclass(frozen=True)
class _Answer:
    code: int | None  # None: no HTTP answer at all
    text: str
    retryable: bool
    retry_after: float | None = None

    @property
    def ok(self) -> bool:
        return self.code is not None and 200 <= self.code < 300


def body_bytes(payload: dict[str, Any]) -> bytes:
    """The exact bytes sent (and signed). Compact and key-sorted, so every attempt of a
    delivery sends the same body."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True, default=str).encode()


def headers_for(delivery: WebhookDelivery, secret: str, raw: bytes,
                timestamp: int | None = None) -> dict[str, str]:
    timestamp = int(time.time()) if timestamp is None else timestamp
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-FleetWatch-Event": delivery.event,
        "X-FleetWatch-Event-Id": delivery.event_id,
        "X-FleetWatch-Delivery": str(delivery.pk),
        "X-FleetWatch-Timestamp": str(timestamp),
    }
    if secret:
        headers["X-FleetWatch-Signature"] = notify.sign(secret, timestamp, raw)
    return headers


def _post(delivery: WebhookDelivery, subscription: WebhookSubscription) -> _Answer:
    url, shown = subscription.url, notify.redact_url(subscription.url, keep_path=False)
    # urllib3 logs each request's path (DEBUG): keep a token in the URL out of the log.
    notify.log_redactor.add(url, shown)
    raw = body_bytes(delivery.payload)
    try:
        session = _session_for(url)
    except TargetRefused as exc:
        # A name that does not resolve may again (DNS trouble): tried again as any connection
        # failure. An address we do not send to fails at once: it will not become one
        # without an admin changing the subscription or the allow list.
        return _Answer(None, _excerpt(f"not sent: {exc}"),
                       retryable=isinstance(exc, TargetUnresolved))
    headers = {**headers_for(delivery, subscription.secret, raw), "Host": _host_header(url)}
    try:
        # Redirects are not followed: requests would turn the POST into a GET, and could carry
        # the signature to another host (or an internal one). A receiver that moved says so
        # with a 3xx: failed. Streamed, so only the start of the answer is read: an error
        # page can be megabytes.
        with session, session.post(url, data=raw, headers=headers,
                                   timeout=settings.FLEETWATCH_HTTP_TIMEOUT,
                                   allow_redirects=False, stream=True) as response:
            start = response.raw.read(4 * EXCERPT_CHARS, decode_content=True) or b""
    # urllib3's errors while reading the streamed answer are not RequestExceptions.
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        error = notify.scrub(f"{type(exc).__name__}: {exc}", url, shown)
        return _Answer(None, _excerpt(error), retryable=True)
    excerpt = _excerpt(start.decode("utf-8", "replace"))
    code = response.status_code
    return _Answer(code, excerpt, retryable=code in notify.RETRY_STATUSES,
                   retry_after=_retry_after(response) if code == 429 else None)


def _claim(delivery_id: int, now: datetime) -> bool:
    """Take the row for one attempt, if it is pending and due. One conditional UPDATE, so two
    workers with the same message cannot both send (and it works on SQLite too)."""
    lease = now + timedelta(seconds=settings.FLEETWATCH_HTTP_TIMEOUT + LEASE_EXTRA_S)
    due = Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now + timedelta(seconds=DUE_SLACK_S))
    return bool(WebhookDelivery.objects.filter(
        due, pk=delivery_id, status=WebhookDelivery.Status.PENDING).update(next_attempt_at=lease))


def delivery_attempt(delivery_id: int) -> float | None:
    """One attempt at one delivery, recorded on its row. Returns the seconds to wait before
    the next attempt, or None when there is nothing more to do (delivered, failed for good,
    or not this call's to send: already delivered, or another attempt is in flight or due
    later). Safe to call any number of times."""
    now = timezone.now()
    if not _claim(delivery_id, now):
        log.debug("webhook delivery %s: not pending or not due; nothing to do", delivery_id)
        return None
    delivery = WebhookDelivery.objects.select_related("subscription").get(pk=delivery_id)
    subscription = delivery.subscription
    shown = notify.redact_url(subscription.url, keep_path=False)
    if not subscription.active and delivery.event != PING:  # a ping tests it before activating
        WebhookDelivery.objects.filter(pk=delivery_id).update(
            status=WebhookDelivery.Status.FAILED, next_attempt_at=None,
            response="not sent: the subscription was deactivated")
        return None

    answer = _post(delivery, subscription)
    attempts = delivery.attempts + 1
    fields: dict[str, Any] = {"attempts": attempts, "response_code": answer.code,
                              "response": answer.text}
    done_at = timezone.now()
    wait: float | None = None
    if answer.ok:
        fields |= {"status": WebhookDelivery.Status.DELIVERED, "delivered_at": done_at,
                   "next_attempt_at": None}
        outcome = "delivered"
    elif answer.retryable and attempts < settings.FLEETWATCH_WEBHOOK_MAX_ATTEMPTS:
        wait = backoff_seconds(attempts)
        if answer.retry_after is not None:  # a 429 that says when: honour it, within reason
            wait = min(max(wait, answer.retry_after), settings.FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS)
        fields["next_attempt_at"] = done_at + timedelta(seconds=wait)
        outcome = f"will retry in {wait:g}s"
    else:
        fields |= {"status": WebhookDelivery.Status.FAILED, "next_attempt_at": None}
        outcome = "failed, out of attempts" if answer.retryable else "failed for good"
    # Conditional on still pending: a row an admin redelivered or deleted meanwhile is left be.
    WebhookDelivery.objects.filter(pk=delivery_id, status=WebhookDelivery.Status.PENDING).update(
        **fields)
    level = logging.INFO if answer.ok else logging.WARNING
    log.log(level, "webhook %s (delivery %s) to %s, attempt %d: %s; %s", delivery.event,
            delivery_id, shown, attempts,
            f"answered {answer.code}" if answer.code is not None else answer.text, outcome)
    return wait


# --- the watchdog -----------------------------------------------------------------------------


def deliveries_rescue() -> list[int]:
    """Queue again the pending deliveries whose next attempt is long overdue (their message
    was lost). A duplicate is harmless: the attempt claims the row first."""
    margin = max(60.0, settings.FLEETWATCH_WATCHDOG_SECONDS * 2)
    overdue = timezone.now() - timedelta(seconds=margin)
    stuck = list(WebhookDelivery.objects.filter(
        Q(next_attempt_at__lt=overdue) | Q(next_attempt_at__isnull=True, created_at__lt=overdue),
        status=WebhookDelivery.Status.PENDING).order_by("pk").values_list("pk", flat=True)[:500])
    for delivery_id in stuck:
        delivery_queue(delivery_id)
    if stuck:
        log.warning("webhooks watchdog: re-queued deliveries %s", stuck)
    return stuck


def incident_deliveries(incident_id: int) -> list[dict[str, Any]]:
    """What was sent about an incident, oldest first, for its page: the on-call notifications
    (collectors.Delivery) and the webhook subscribers' deliveries, in one list."""
    rows: list[dict[str, Any]] = [
        {"at": d.created_at, "to": f"{d.channel} {d.target}", "event": d.event or d.subject,
         "status": d.status, "attempts": d.attempts, "response": d.response}
        for d in notify.deliveries_for_incident(incident_id)]
    # A subscriber's answer is the subscriber's text, shown to admins only (API: the
    # delivery's ``response``; here ``response_excerpt``, for a page that knows its reader is
    # an admin): everyone else sees the status code, or that no HTTP answer came.
    rows += [
        {"at": d.created_at, "to": f"webhook {d.subscription.name}", "event": d.event,
         "status": d.status, "attempts": d.attempts,
         "response": str(d.response_code) if d.response_code is not None else (
             "no HTTP answer" if d.attempts else ""),
         "response_excerpt": f"{d.response_code or ''} {d.response}".strip()}
        for d in WebhookDelivery.objects.filter(incident_id=incident_id)
        .select_related("subscription")]
    return sorted(rows, key=lambda r: r["at"])
