"""One delivery model, one retry mechanism: every message FleetWatch sends out.

Two kinds of message, one ``Delivery`` row each and the same path:

- an event to a webhook subscription (``incidents.webhooks``: built once, one row per
  subscription that wants it), driven by Celery: each attempt is the ``webhook_deliver`` task,
  a transient failure re-queues it with a countdown;
- a remediation step's notification to an on-call channel (``collectors.clients.notify``'s
  webhook, Slack and e-mail transports), driven in the step itself: the step needs to know
  whether anyone was told, so its attempts run in turn within the call, with the channel's own
  short pacing (``StepDeliveries``, registered with the notifier when the app starts).

Either way:

1. the row is written, pending, and committed *before* the outside call;
2. ``attempt`` claims it (one conditional UPDATE, so two workers with the same message never
   both send), makes one attempt through the kind's transport and records the answer;
3. a transient failure (no connection, a timeout, 408, 429, 5xx) waits ``Backoff.wait``:
   growing by a factor each time, at least what a 429/503's Retry-After asks, never more
   than the ceiling; any other failure, or the last attempt, fails the row for good;
4. ``rescue`` (beat) re-queues subscription deliveries whose next attempt is long overdue (their
   message was lost with a killed worker or a restarted broker). A step's notification is not
   rescued: its transport holds secrets no row keeps; the step's own retry sends it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from collectors import queueing
from collectors.clients import notify
from collectors.clock import SYSTEM_CLOCK, Clock
from incidents.models import Delivery

log = logging.getLogger(__name__)

# A message whose countdown ends now may be handled by a worker whose clock is a little behind
# the one that scheduled it: that early arrival is still the retry, not a duplicate.
DUE_SLACK_S = 2.0
# While an attempt is in flight the row's next_attempt_at is pushed this far past the
# transport's timeout: a duplicate message (a rescue, a broker redelivery) finds it not due.
LEASE_EXTRA_S = 30.0
SUBSCRIPTION_BACKOFF_FACTOR = 5


class Skip(Exception):
    """Raised by a transport that will not send this row at all (its subscription was switched
    off): the row fails with this message, no attempt counted."""


@dataclass(frozen=True)
class Backoff:
    """How often and how far apart: the one back-off rule, with each kind's numbers."""

    max_attempts: int
    base: float  # the wait after the first failed attempt
    factor: float  # each further wait is this many times the one before
    ceiling: float  # no wait is longer, whatever Retry-After says

    def wait(self, attempts: int, retry_after: float | None = None) -> float:
        """The wait after the ``attempts``-th failed attempt."""
        wait = float(min(self.ceiling, self.base * self.factor ** max(0, attempts - 1)))
        if retry_after is not None:  # the receiver said when: honour it, within reason
            wait = float(min(max(wait, retry_after), self.ceiling))
        return wait


def subscription_backoff() -> Backoff:
    """Webhook subscriptions: 5, 25, 125, 625 s... (defaults), as configured."""
    return Backoff(max_attempts=settings.FLEETWATCH_WEBHOOK_MAX_ATTEMPTS,
                   base=settings.FLEETWATCH_WEBHOOK_BACKOFF_SECONDS,
                   factor=SUBSCRIPTION_BACKOFF_FACTOR,
                   ceiling=settings.FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS)


def channel_backoff(channel: notify.Channel) -> Backoff:
    """A step's channel: its own few retries, seconds apart, within the step's call."""
    return Backoff(max_attempts=channel.retries + 1, base=channel.backoff, factor=2,
                   ceiling=channel.retry_after_max)


# --- one attempt ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempted:
    """One attempt's result: the answer (None: skipped), the row's attempts so far, and the
    wait before the next one (None: no next one)."""

    answer: notify.Answer | None
    attempts: int
    wait: float | None


def claim(delivery_id: int, now: datetime, lease_s: float) -> bool:
    """Take the row for one attempt, if it is pending and due. One conditional UPDATE, so two
    workers with the same message cannot both send (and it works on SQLite too)."""
    lease = now + timedelta(seconds=lease_s + LEASE_EXTRA_S)
    due = Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now + timedelta(seconds=DUE_SLACK_S))
    return bool(Delivery.objects.filter(
        due, pk=delivery_id, status=Delivery.Status.PENDING).update(next_attempt_at=lease))


def attempt(delivery_id: int, send: Callable[[Delivery], notify.Answer], backoff: Backoff, *,
            lease_s: float) -> Attempted | None:
    """One attempt at one delivery through ``send``, recorded on its row. None when it is not
    this call's to send (not pending: already delivered or failed; or not due: another
    attempt is in flight or due later). Safe to call any number of times."""
    now = timezone.now()
    if not claim(delivery_id, now, lease_s):
        log.debug("delivery %s: not pending or not due; nothing to do", delivery_id)
        return None
    delivery = Delivery.objects.select_related("subscription").get(pk=delivery_id)
    try:
        answer = send(delivery)
    except Skip as exc:
        Delivery.objects.filter(pk=delivery_id).update(
            status=Delivery.Status.FAILED, next_attempt_at=None, response=str(exc))
        return Attempted(None, delivery.attempts, None)
    attempts = delivery.attempts + 1
    fields: dict[str, Any] = {"attempts": attempts, "response_code": answer.code,
                              "response": answer.text}
    done_at = timezone.now()
    wait: float | None = None
    if answer.ok:
        fields |= {"status": Delivery.Status.DELIVERED, "delivered_at": done_at,
                   "next_attempt_at": None}
        outcome = "delivered"
    elif answer.retryable and attempts < backoff.max_attempts:
        wait = backoff.wait(attempts, answer.retry_after)
        fields["next_attempt_at"] = done_at + timedelta(seconds=wait)
        outcome = f"will retry in {wait:g}s"
    else:
        fields |= {"status": Delivery.Status.FAILED, "next_attempt_at": None}
        outcome = "failed, out of attempts" if answer.retryable else "failed for good"
    # Conditional on still pending: a row an admin redelivered or deleted meanwhile is left be.
    Delivery.objects.filter(pk=delivery_id, status=Delivery.Status.PENDING).update(**fields)
    to = (f"webhook {delivery.event} (delivery {delivery_id}) to {delivery.target}"
          if delivery.channel == Delivery.Channel.SUBSCRIPTION
          else f"notify {delivery.channel} (delivery {delivery_id}) to {delivery.target}")
    log.log(logging.INFO if answer.ok else logging.WARNING, "%s, attempt %d: %s; %s", to,
            attempts, f"answered {answer.code}" if answer.code is not None else answer.text,
            outcome)
    return Attempted(answer, attempts, wait)


# --- queueing and the watchdog (subscription deliveries) --------------------------------------


def queue(delivery_id: int, countdown: float | None = None) -> bool:
    """Hand one subscription delivery to a worker, now. False (logged) when the broker would
    not take it: the row stays pending and ``rescue`` queues it later."""
    try:
        queueing.enqueue(queueing.WEBHOOK_DELIVER, delivery_id, countdown=countdown,
                         on_commit=False)
    except Exception as exc:  # the broker is down: the rescue picks the row up later
        log.warning("webhook delivery %s not queued (%s: %s); the rescue will retry it",
                    delivery_id, type(exc).__name__, exc)
        return False
    return True


def rescue() -> list[int]:
    """Queue again the pending subscription deliveries whose next attempt is long overdue
    (their message was lost). A duplicate is harmless: the attempt claims the row first."""
    margin = max(60.0, settings.FLEETWATCH_WATCHDOG_SECONDS * 2)
    overdue = timezone.now() - timedelta(seconds=margin)
    stuck = list(Delivery.objects.filter(
        Q(next_attempt_at__lt=overdue) | Q(next_attempt_at__isnull=True, created_at__lt=overdue),
        channel=Delivery.Channel.SUBSCRIPTION, status=Delivery.Status.PENDING,
    ).order_by("pk").values_list("pk", flat=True)[:500])
    for delivery_id in stuck:
        queue(delivery_id)
    if stuck:
        log.warning("deliveries watchdog: re-queued deliveries %s", stuck)
    return stuck


# --- a step's notifications -------------------------------------------------------------------


class StepDeliveries:
    """``collectors.clients.notify.DeliveryLog``: a step's notification to one channel, as a
    Delivery row, its attempts made here and now (see the module's docstring)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        # Paces the attempts. The row's due time is the database's clock, so a clock that
        # does not really wait suits back-offs shorter than DUE_SLACK_S only.
        self.clock = clock

    def deliver(self, channel: notify.Channel, message: notify.Message) -> notify.Outcome:
        call, target = channel.call_text(), channel.target[:300]
        if message.key:
            done = (Delivery.objects.filter(channel=channel.channel, target=target,
                                            status=Delivery.Status.DELIVERED,
                                            payload__delivery_key=message.key)
                    .order_by("id").first())
            if done is not None:
                return notify.Outcome(channel.channel, call, "skipped",
                                      f"already delivered ({message.key}, delivery {done.pk})",
                                      done.pk)
        # Its own transaction, committed before the call: the row must exist (and be seen by
        # anyone looking, the receiver included) even if this worker dies during the send.
        with transaction.atomic():
            row = Delivery.objects.create(
                channel=channel.channel, target=target, event=message.event[:64],
                event_id=(message.key or "")[:64], subject=message.subject[:300],
                payload=message.recorded_payload(), incident_id=message.incident_id,
                next_attempt_at=timezone.now())
        earlier: list[str] = []
        crashed = False

        def send(delivery: Delivery) -> notify.Answer:
            nonlocal crashed
            try:
                answer = channel.send(message, delivery.pk)
            except Exception as exc:  # a bug in one channel must not silence the others
                # No traceback: its frames' text could hold the hook URL the channel hides.
                crashed = True
                answer = notify.Answer(False, channel.redact(f"{type(exc).__name__}: {exc}"),
                                       retryable=False, label=type(exc).__name__)
            text = channel.final_text(answer, delivery.attempts + 1, earlier)
            earlier.append(answer.label or answer.text)
            return replace(answer, text=text[:2000])

        backoff = channel_backoff(channel)
        last: notify.Answer | None = None
        while (done_now := attempt(row.pk, send, backoff, lease_s=channel.timeout)) is not None:
            last = done_now.answer
            if done_now.wait is None:
                break
            self.clock.sleep(done_now.wait)
        if last is None:  # not claimable: nothing of ours was sent
            return notify.Outcome(channel.channel, call, "failed", "not sent", row.pk)
        if last.ok:
            return notify.Outcome(channel.channel, call, "delivered", last.text, row.pk)
        return notify.Outcome(channel.channel, call, "failed", last.text, row.pk,
                              permanent=not last.retryable and not crashed)


# --- what was sent about an incident ----------------------------------------------------------


def incident_rows(incident_id: int) -> QuerySet[Delivery]:
    """Every delivery about an incident, oldest first (the order the story is read)."""
    return (Delivery.objects.filter(incident_id=incident_id).select_related("subscription")
            .order_by("created_at", "id"))


def incident_deliveries(incident_id: int) -> list[dict[str, Any]]:
    """What was sent about an incident, oldest first, for its page: the on-call notifications
    and the webhook subscribers' deliveries, in one list."""
    rows: list[dict[str, Any]] = []
    for d in incident_rows(incident_id):
        if d.channel != Delivery.Channel.SUBSCRIPTION:
            rows.append({"at": d.created_at, "to": f"{d.channel} {d.target}",
                         "event": d.event or d.subject, "status": d.status,
                         "attempts": d.attempts, "response": d.response})
            continue
        # A subscriber's answer is the subscriber's text, shown to admins only (API: the
        # delivery's ``response``; here ``response_excerpt``, for a page that knows its reader
        # is an admin): everyone else sees the status code, or that no HTTP answer came.
        name = d.subscription.name if d.subscription is not None else "(deleted)"
        rows.append({"at": d.created_at, "to": f"webhook {name}", "event": d.event,
                     "status": d.status, "attempts": d.attempts,
                     "response": str(d.response_code) if d.response_code is not None else (
                         "no HTTP answer" if d.attempts else ""),
                     "response_excerpt": f"{d.response_code or ''} {d.response}".strip()})
    return rows
