"""Webhooks out: subscribers hear about incidents (see WebhookSubscription).

The path of one event:

1. ``event_emit`` (called by services on commit) builds the payload once and writes one
   ``Delivery`` (channel ``subscription``) per active subscription that wants the event, then
   queues ``incidents.tasks.webhook_deliver`` for each. It never raises: the change that
   caused the event is already committed, and a broken webhook must not look like a failed
   approval.
2. ``delivery_attempt`` makes one HTTP attempt through the one delivery mechanism
   (``incidents.deliveries``: claim, attempt, back-off) and records it on the row. The
   database row is the truth: the task only asks it "send now?" and "when next?". A transient
   failure (no connection, a timeout, 408, 429, 5xx) is tried again after a growing delay
   (FLEETWATCH_WEBHOOK_BACKOFF_SECONDS, times 5 per attempt, at most
   FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS, longer when a 429/503 asks with Retry-After)
   until FLEETWATCH_WEBHOOK_MAX_ATTEMPTS; any other answer that is not 2xx (a 410 from a
   receiver that is gone, a redirect) fails at once.
3. ``deliveries.rescue`` (beat) re-queues pending rows whose next attempt is long overdue: the
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
import socket
import time
import uuid
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3
from django.conf import settings
from django.db import transaction
from django.urls import reverse
from django.utils import timezone
from requests.adapters import HTTPAdapter

from collectors.clients import notify
from collectors.redaction import redact_url
from incidents import deliveries
from incidents.models import Delivery, Incident, Remediation, WebhookSubscription

log = logging.getLogger(__name__)

PING = "ping"
USER_AGENT = "FleetWatch-Webhooks/1"
EXCERPT_CHARS = 500


# --- the payload ------------------------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


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
        # How bad (sev1, the worst, to sev4) and who on call has it (a user name; null: nobody).
        "severity": incident.severity,
        "owner": incident.owner.get_username() if incident.owner is not None else None,
        # The page exists only where FLEETWATCH_BASE_URL says where people reach FleetWatch.
        "url": notify.incident_url(incident.pk),
        "api_url": notify.absolute_url(reverse("api:incident-detail", kwargs={"pk": incident.pk})),
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
        "approve_url": (notify.absolute_url(reverse("api:remediation-approve", kwargs={"pk": rem.pk}))
                        if waiting else None),
    }


def payload_build(event: str, incident_id: int, remediation_id: int | None = None) -> dict[str, Any]:
    """The JSON every subscriber gets for one event: the incident (and remediation) as they are
    now, just after the change was committed."""
    incident = Incident.objects.select_related("owner").get(pk=incident_id)
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


def _delivery_new(subscription: WebhookSubscription, event: str, event_id: str,
                  payload: dict[str, Any], incident_id: int | None = None) -> Delivery:
    return Delivery.objects.create(
        channel=Delivery.Channel.SUBSCRIPTION, subscription=subscription,
        target=redact_url(subscription.url, keep_path=False)[:300],
        event=event, event_id=event_id, incident_id=incident_id, payload=payload,
        next_attempt_at=timezone.now())


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
        with transaction.atomic():
            ids = [_delivery_new(s, event, payload["event_id"], payload, incident_id).pk for s in subscriptions]
    except Exception:
        log.exception("webhooks: %s for incident %s not recorded", event, incident_id)
        return []
    for delivery_id in ids:
        deliveries.queue(delivery_id)
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
        event_id = str(uuid.uuid4())
        payload = {"event": event, "event_id": event_id,
                   "occurred_at": timezone.now().isoformat(), "checkpoint": checkpoint,
                   "incident": None, "remediation": None}
        with transaction.atomic():
            ids = [_delivery_new(s, event, event_id, payload).pk for s in subscriptions]
    except Exception:
        log.exception("webhooks: audit checkpoint not recorded")
        return []
    for delivery_id in ids:
        deliveries.queue(delivery_id)
    return ids


def ping_send(subscription: WebhookSubscription) -> Delivery:
    """A ``ping`` to one subscription, attempted now so the caller sees the answer; a
    transient failure goes on retrying in the background like any delivery."""
    event_id = str(uuid.uuid4())
    payload: dict[str, Any] = {
        "event": PING,
        "event_id": event_id,
        "occurred_at": timezone.now().isoformat(),
        "subscription": {"id": subscription.pk, "name": subscription.name,
                         "events": list(subscription.events or [])},
        "incident": None,
        "remediation": None,
    }
    # Committed before the call, so the row is there even if this request dies mid-send.
    with transaction.atomic():
        delivery = _delivery_new(subscription, PING, event_id, payload)
    countdown = delivery_attempt(delivery.pk)
    if countdown is not None:
        transaction.on_commit(lambda: deliveries.queue(delivery.pk, countdown))
    delivery.refresh_from_db()
    return delivery


class RedeliverRefused(Exception):
    """A redelivery that would race one already under way."""


def redeliver(delivery_id: int) -> Delivery:
    """Send a finished delivery's event again, as a new delivery row (the old one stays as the
    record of what happened) with the same event id, so receivers can dedupe.

    Refused while the delivery, or an earlier redelivery of the same event to the same
    subscription, is still pending: pressing the button twice sends once."""
    with transaction.atomic():
        # Only the delivery's row is locked: the subscription (an outer join, now that a
        # delivery may have none) is only read.
        original = Delivery.objects.select_for_update(of=("self",)).select_related(
            "subscription").get(pk=delivery_id, channel=Delivery.Channel.SUBSCRIPTION)
        if original.status == Delivery.Status.PENDING:
            raise RedeliverRefused(f"delivery {original.pk} is still pending "
                                   f"(attempt {original.attempts + 1} is due)")
        busy = (Delivery.objects.filter(
            subscription_id=original.subscription_id, event_id=original.event_id,
            status=Delivery.Status.PENDING).values_list("pk", flat=True).first())
        if busy is not None:
            raise RedeliverRefused(f"delivery {busy} of the same event is already pending")
        subscription = original.subscription
        assert subscription is not None  # a subscription's delivery (filtered above)
        if not subscription.active:
            raise RedeliverRefused(f"subscription {subscription.name!r} is inactive")
        copy = _delivery_new(subscription, original.event, original.event_id,
                             original.payload, original.incident_id)
        transaction.on_commit(lambda: deliveries.queue(copy.pk))
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


def body_bytes(payload: dict[str, Any]) -> bytes:
    """The exact bytes sent (and signed). Compact and key-sorted, so every attempt of a
    delivery sends the same body."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True, default=str).encode()


def headers_for(delivery: Delivery, secret: str, raw: bytes,
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


def _post(delivery: Delivery, subscription: WebhookSubscription) -> notify.Answer:
    url, shown = subscription.url, redact_url(subscription.url, keep_path=False)
    # urllib3 logs each request's path (DEBUG): keep a token in the URL out of the log.
    notify.log_redactor.add(url, shown)
    raw = body_bytes(delivery.payload)
    try:
        session = _session_for(url)
    except TargetRefused as exc:
        # A name that does not resolve may again (DNS trouble): tried again as any connection
        # failure. An address we do not send to fails at once: it will not become one
        # without an admin changing the subscription or the allow list.
        return notify.Answer(False, notify.excerpt(f"not sent: {exc}", EXCERPT_CHARS),
                             retryable=isinstance(exc, TargetUnresolved))
    headers = {**headers_for(delivery, subscription.secret, raw), "Host": _host_header(url)}
    return notify.post(session, url, raw, headers, timeout=settings.FLEETWATCH_HTTP_TIMEOUT,
                       limit=EXCERPT_CHARS, redact=lambda text: notify.scrub(text, url, shown))


def _send(delivery: Delivery) -> notify.Answer:
    subscription = delivery.subscription
    if subscription is None:  # not a subscription's delivery: nothing here sends it
        raise deliveries.Skip(f"not sent: a {delivery.channel} delivery is not a webhook's")
    if not subscription.active and delivery.event != PING:  # a ping tests it before activating
        raise deliveries.Skip("not sent: the subscription was deactivated")
    return _post(delivery, subscription)


def delivery_attempt(delivery_id: int) -> float | None:
    """One attempt at one subscription delivery, recorded on its row. Returns the seconds to
    wait before the next attempt, or None when there is nothing more to do (delivered, failed
    for good, or not this call's to send: already delivered, or another attempt is in flight
    or due later). Safe to call any number of times."""
    done = deliveries.attempt(delivery_id, _send, deliveries.subscription_backoff(),
                              lease_s=settings.FLEETWATCH_HTTP_TIMEOUT)
    return done.wait if done is not None else None
