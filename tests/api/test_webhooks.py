"""Webhooks out, as a subscriber and an admin see them: subscriptions through the API, signed
deliveries for each incident event arriving at a real HTTP receiver on loopback, retries with
backoff, failures recorded, redelivery, and no secret in any answer or log line.

The delivery task runs in-process (Celery's eager ``apply``, its ``self.retry`` included), so
these tests need the database but no worker; the backoff is cut to milliseconds through the
settings, which is all the eager retry sees of it."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock

import pytest
from django.db import connection, connections
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from collectors import services as collectors
from collectors.clients.notify import verify_signature
from collectors.roles import ADMIN, user_with_role
from collectors.sim.fleet import SimFleet
from incidents import deliveries, lifecycle, tasks, webhooks
from incidents.diagnosis import Diagnosis
from incidents.models import AuditEntry, Delivery, Incident, WebhookSubscription
from incidents.remediation import engine
from tests.conftest import token_for

SECRET = "whsec-shared-with-the-receiver-0123456789"
URL_TOKEN = "QUERYTOKEN-must-not-show-0xdeadbeef"
DEAD = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused at once
EVENTS = ["incident.opened", "incident.updated", "remediation.awaiting_approval",
          "incident.resolved"]
DIAG = Diagnosis(root_cause="gpu_hardware", nodes=("gpu-003",), confidence=0.97,
                 playbook="replace_node", explanation="XID 79 on gpu-003",
                 detected_at=datetime(2026, 12, 2, 10, 0, tzinfo=UTC), jobs=("3001",))


# --- a receiver on loopback -------------------------------------------------------------------


@dataclass
class Hit:
    path: str
    query: str
    headers: dict[str, str]
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


@dataclass
class Receiver:
    url: str
    hits: list[Hit] = field(default_factory=list)
    # Per path, the statuses to answer in turn; the last one repeats. Default: 200.
    plan: dict[str, list[int]] = field(default_factory=dict)
    delay: float = 0.0

    def to(self, path: str) -> list[Hit]:
        return [h for h in self.hits if h.path == path]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver("")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            path, _, query = self.path.partition("?")
            hit = Hit(path, query, dict(self.headers.items()),
                      self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                rx.hits.append(hit)
                statuses = rx.plan.get(path, [200])
                code = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            time.sleep(rx.delay)
            answer = b'{"ok": true}' if code < 300 else f"receiver says {code}".encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rx.url = f"http://127.0.0.1:{server.server_port}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield rx
    server.shutdown()
    server.server_close()


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fast(settings: Any) -> None:
    settings.FLEETWATCH_WEBHOOK_BACKOFF_SECONDS = 0.001
    settings.FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS = 0.01
    settings.FLEETWATCH_WEBHOOK_MAX_ATTEMPTS = 4
    settings.FLEETWATCH_HTTP_TIMEOUT = 3.0
    settings.FLEETWATCH_BASE_URL = "https://fleetwatch.example"
    # The receiver listens on loopback, which a webhook may target only when an admin allows
    # it (see test_webhook_targets.py).
    settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]


@pytest.fixture
def sent() -> Iterator[list[int]]:
    """Queueing a delivery runs its task here and now (with its retries), as a worker would;
    remediation steps are not run (they are not what these tests are about)."""
    queued: list[int] = []
    crashed: list[BaseException] = []

    def run_now(args: list[int], countdown: float | None = None, **_: Any) -> None:
        queued.append(args[0])
        result = tasks.webhook_deliver.apply(args=args)  # retries run in turn, here
        if result.failed():
            crashed.append(result.result)

    with mock.patch.object(tasks.webhook_deliver, "apply_async", side_effect=run_now), \
            mock.patch.object(engine, "step_enqueue"):
        yield queued
    # The caller logs and carries on (it must), so a bug in the task is reported here.
    assert not crashed, crashed


@pytest.fixture
def cluster(db: None, sim_fleet: SimFleet) -> Any:
    return collectors.cluster_default()


@pytest.fixture
def admin(db: None) -> APIClient:
    client = APIClient()
    ada = user_with_role("ada", ADMIN)[0]
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(ada, ('read', 'operate'), 'ops')}")
    return client


def subscribe(name: str, url: str, events: list[str] | None = None,
              secret: str = SECRET) -> WebhookSubscription:
    return WebhookSubscription.objects.create(name=name, url=url, secret=secret,
                                              events=events or [], created_by="user:ada")


def verified(hit: Hit, secret: str = SECRET) -> bool:
    return verify_signature(secret, hit.headers["X-FleetWatch-Timestamp"], hit.raw,
                            hit.headers.get("X-FleetWatch-Signature", ""))


def rows(**filters: Any) -> list[Delivery]:
    return list(Delivery.objects.filter(**filters).order_by("id"))


def committed(capture: Callable[..., Any]) -> Any:
    """Run what a change queued for after its commit (the tests' transaction never commits)."""
    return capture(execute=True)


# --- subscriptions through the API ------------------------------------------------------------


def test_an_admin_subscribes_and_sees_the_secret_once(admin: APIClient, receiver: Receiver,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"{receiver.url}/hook?token={URL_TOKEN}"
    r = admin.post("/api/v1/webhooks/", {"name": "pager", "url": url,
                                         "events": ["incident.opened", "incident.resolved"]},
                   format="json")
    assert r.status_code == 201, r.content
    created = r.json()
    generated = created["secret"]
    assert len(generated) >= 32
    assert created["events"] == ["incident.opened", "incident.resolved"]
    assert created["created_by"] == "token:ops" and created["active"] is True
    sub = WebhookSubscription.objects.get(pk=created["id"])
    assert sub.secret == generated and sub.url == url  # stored whole: signing and sending need it
    # The token in the URL is the subscriber's secret as much as the signing key is.
    assert URL_TOKEN not in r.content.decode()

    # Never again: not in the list, not in the detail, not in the answer to a change.
    listed = admin.get("/api/v1/webhooks/")
    detail = admin.get(f"/api/v1/webhooks/{sub.pk}/")
    changed = admin.patch(f"/api/v1/webhooks/{sub.pk}/", {"active": False}, format="json")
    for answer in (listed, detail, changed):
        assert answer.status_code == 200
        assert generated not in answer.content.decode()
        assert URL_TOKEN not in answer.content.decode()
        assert "secret" not in answer.content.decode()
    assert detail.json()["url"] == f"{receiver.url}/hook/…"  # host and first path segment
    assert listed.json()["results"][0]["name"] == "pager"
    assert WebhookSubscription.objects.get(pk=sub.pk).active is False

    # A secret given by the admin is used and not echoed after creation either.
    r = admin.post("/api/v1/webhooks/", {"name": "own", "url": receiver.url + "/own",
                                         "secret": SECRET}, format="json")
    assert r.status_code == 201 and r.json()["secret"] == SECRET
    assert r.json()["events"] == []  # all events
    r = admin.patch(f"/api/v1/webhooks/{r.json()['id']}/",
                    {"secret": "rotated-" + SECRET}, format="json")
    assert r.status_code == 200 and SECRET not in r.content.decode()
    assert WebhookSubscription.objects.get(name="own").secret == "rotated-" + SECRET

    assert admin.delete(f"/api/v1/webhooks/{sub.pk}/").status_code == 204
    assert not WebhookSubscription.objects.filter(pk=sub.pk).exists()
    # Every change left an audit entry naming the token; no log line holds a secret.
    assert AuditEntry.objects.filter(verb="api.call", actor="token:ops").count() == 5
    for secret in (generated, SECRET, URL_TOKEN):
        assert secret not in caplog.text


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "x", "url": "ftp://example.com/hook"}, "url"),
    ({"name": "x", "url": "not a url"}, "url"),
    ({"name": "x", "url": "javascript:alert(1)"}, "url"),
    ({"name": "x", "url": "https://example.com/hook", "events": ["incident.exploded"]}, "events"),
    ({"name": "x", "url": "https://example.com/hook", "events": "incident.opened"}, "events"),
    ({"name": "x", "url": "https://example.com/hook", "secret": "short"}, "secret"),
    ({"name": "", "url": "https://example.com/hook"}, "name"),
    ({"url": "https://example.com/hook"}, "name"),
    ({"name": "taken", "url": "https://example.com/hook"}, "name"),
])
def test_bad_subscriptions_get_400_with_field_errors(admin: APIClient, body: dict[str, Any],
                                                     field: str) -> None:
    subscribe("taken", "https://example.com/other")
    r = admin.post("/api/v1/webhooks/", body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json(), r.json()
    assert WebhookSubscription.objects.count() == 1


def test_people_without_admin_may_read_but_not_change(db: None, operator: Any,
                                                      viewer: Any) -> None:
    sub = subscribe("pager", "https://example.com/hook")
    for user in (viewer, operator):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user)}")
        assert client.get("/api/v1/webhooks/").status_code == 200
        assert client.get("/api/v1/webhook-deliveries/").status_code == 200
        assert client.post("/api/v1/webhooks/", {"name": "mine", "url": "https://e.com/"},
                           format="json").status_code == 403
        assert client.patch(f"/api/v1/webhooks/{sub.pk}/", {"active": False},
                            format="json").status_code == 403
        assert client.post(f"/api/v1/webhooks/{sub.pk}/test/").status_code == 403
        assert client.delete(f"/api/v1/webhooks/{sub.pk}/").status_code == 403
    assert APIClient().get("/api/v1/webhooks/").status_code == 401
    assert WebhookSubscription.objects.get().active is True


# --- events from the incident lifecycle -------------------------------------------------------


def test_an_incidents_life_reaches_subscribers_signed_and_filtered(
        cluster: Any, settings: Any, receiver: Receiver, sent: list[int],
        django_capture_on_commit_callbacks: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    settings.FLEETWATCH_POLICY_MODE = "approve"  # so the remediation waits for a person
    subscribe("everything", f"{receiver.url}/all?token={URL_TOKEN}")
    subscribe("closures", f"{receiver.url}/resolved", events=["incident.resolved"])
    WebhookSubscription.objects.filter(pk=subscribe("paused", f"{receiver.url}/paused").pk
                                       ).update(active=False)

    with committed(django_capture_on_commit_callbacks):
        incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    with committed(django_capture_on_commit_callbacks):
        lifecycle.incident_acknowledge(incident.pk, actor="user:olivia")
    with committed(django_capture_on_commit_callbacks):
        lifecycle.incident_resolve_by_hand(incident.pk, actor="user:olivia", note="fixed by hand")

    everything = receiver.to("/all")
    assert sorted(h.headers["X-FleetWatch-Event"] for h in everything) == sorted(EVENTS)
    assert [h.headers["X-FleetWatch-Event"] for h in receiver.to("/resolved")] == [
        "incident.resolved"]
    assert not receiver.to("/paused")
    for hit in receiver.hits:
        assert verified(hit), hit.headers
        assert not verified(hit, "another-secret-entirely")
        body = hit.json
        assert hit.headers["Content-Type"] == "application/json"
        assert hit.headers["User-Agent"].startswith("FleetWatch-Webhooks/")
        assert body["event"] == hit.headers["X-FleetWatch-Event"]
        assert body["event_id"] == hit.headers["X-FleetWatch-Event-Id"]
        row = Delivery.objects.get(pk=int(hit.headers["X-FleetWatch-Delivery"]))
        assert (row.status, row.attempts, row.response_code) == ("delivered", 1, 200)
        assert row.incident_id == incident.pk and row.event == body["event"]
        assert body["incident"]["id"] == incident.pk
        assert body["incident"]["url"] == f"https://fleetwatch.example/incidents/{incident.pk}/"
        assert body["incident"]["api_url"] == \
            f"https://fleetwatch.example/api/v1/incidents/{incident.pk}/"
        assert body["incident"]["nodes"] == ["gpu-003"] and body["incident"]["jobs"] == ["3001"]
        assert body["incident"]["root_cause"] == "gpu_hardware"
    by_event = {h.json["event"]: h.json for h in everything}
    waiting = by_event["remediation.awaiting_approval"]["remediation"]
    rem = incident.remediations.get()
    assert waiting["id"] == rem.pk and waiting["status"] == "awaiting_approval"
    assert waiting["playbook"] == "replace_node" and waiting["mode"] == "approve"
    assert waiting["approve_url"] == (
        f"https://fleetwatch.example/api/v1/remediations/{rem.pk}/approve/")
    assert by_event["incident.updated"]["incident"]["acknowledged_by"] == "user:olivia"
    resolved = by_event["incident.resolved"]["incident"]
    assert resolved["status"] == "resolved" and resolved["resolved_at"]
    # One event id per event, shared by every subscriber that got it.
    [closure] = receiver.to("/resolved")
    assert closure.json["event_id"] == by_event["incident.resolved"]["event_id"]
    assert Delivery.objects.count() == 5 == len(sent)
    assert SECRET not in caplog.text and URL_TOKEN not in caplog.text


def test_payloads_carry_the_severity_and_the_owner_as_they_change(
        cluster: Any, receiver: Receiver, sent: list[int], operator: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    from incidents import oncall

    subscribe("pager", f"{receiver.url}/pager", events=["incident.opened", "incident.updated"])
    with committed(django_capture_on_commit_callbacks):
        incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    with committed(django_capture_on_commit_callbacks):
        oncall.incident_assign(incident.pk, operator, actor="user:olivia")
    with committed(django_capture_on_commit_callbacks):
        oncall.incident_severity_set(incident.pk, "sev1", actor="user:olivia")
    with committed(django_capture_on_commit_callbacks):
        oncall.incident_assign(incident.pk, None, actor="user:olivia")
    bodies = [h.json for h in receiver.to("/pager")]
    assert all(verified(h) for h in receiver.to("/pager"))
    seen = [(b["event"], b["incident"]["severity"], b["incident"]["owner"]) for b in bodies]
    # Opened at the root cause's severity (an XID 79: SEV2) and nobody's (its status moves
    # on as its remediation starts: updates too); then taken, made SEV1 and given up, each an
    # incident.updated carrying both as they are then.
    assert seen[0] == ("incident.opened", "sev2", None)
    assert seen[-3:] == [("incident.updated", "sev2", "olivia"),
                         ("incident.updated", "sev1", "olivia"),
                         ("incident.updated", "sev1", None)]
    assert all(s[1:] == ("sev2", None) for s in seen[1:-3])


def test_an_event_for_nothing_or_a_vanished_incident_never_raises(
        db: None, caplog: pytest.LogCaptureFixture) -> None:
    assert webhooks.event_emit("incident.opened", 424242) == []  # no subscription: no query
    subscribe("pager", "https://example.com/hook")
    assert webhooks.event_emit("incident.opened", 424242) == []
    assert "not recorded" in caplog.text and not Delivery.objects.exists()


# --- retries, failures, idempotence -----------------------------------------------------------


def emit(cluster: Any, capture: Any) -> Incident:
    with committed(capture):
        incident, _ = lifecycle.incident_record(cluster.pk, DIAG)
    return incident


def test_two_500s_then_200_is_delivered_on_the_third_attempt(
        cluster: Any, receiver: Receiver, sent: list[int],
        django_capture_on_commit_callbacks: Any) -> None:
    subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    receiver.plan["/hook"] = [500, 500, 200]
    emit(cluster, django_capture_on_commit_callbacks)
    [row] = rows()
    assert (row.status, row.attempts, row.response_code) == ("delivered", 3, 200)
    assert row.delivered_at is not None and row.next_attempt_at is None
    hits = receiver.to("/hook")
    assert len(hits) == 3
    # The same body and event id every time (receivers dedupe on it), freshly signed each time.
    assert len({h.raw for h in hits}) == 1
    assert len({h.headers["X-FleetWatch-Event-Id"] for h in hits}) == 1
    assert all(verified(h) for h in hits)
    # People see it on the incident's page, with the answer that came back.
    page = Client()
    page.force_login(user_with_role("vera", "viewer")[0])
    html = page.get(f"/incidents/{row.incident_id}/").content.decode()
    section = html[html.index('data-testid="deliveries"'):]
    assert "webhook pager" in section and "incident.opened" in section
    assert "delivered" in section and "<td>3</td>" in section


def test_a_gone_receiver_fails_at_once(cluster: Any, receiver: Receiver, sent: list[int],
                                       django_capture_on_commit_callbacks: Any) -> None:
    subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    receiver.plan["/hook"] = [410]
    emit(cluster, django_capture_on_commit_callbacks)
    [row] = rows()
    assert (row.status, row.attempts, row.response_code) == ("failed", 1, 410)
    assert row.response == "receiver says 410" and row.next_attempt_at is None
    assert len(receiver.hits) == 1


def test_a_rate_limit_is_retried(cluster: Any, receiver: Receiver, sent: list[int],
                                 django_capture_on_commit_callbacks: Any) -> None:
    subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    receiver.plan["/hook"] = [429, 200]
    emit(cluster, django_capture_on_commit_callbacks)
    assert [(r.status, r.attempts) for r in rows()] == [("delivered", 2)]


def test_an_unreachable_receiver_fails_after_the_last_attempt(
        cluster: Any, sent: list[int], django_capture_on_commit_callbacks: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    subscribe("pager", f"{DEAD}/hook?token={URL_TOKEN}", events=["incident.opened"])
    emit(cluster, django_capture_on_commit_callbacks)
    [row] = rows()
    assert (row.status, row.attempts, row.response_code) == ("failed", 4, None)
    assert "ConnectionError" in row.response and len(row.response) <= 500
    assert URL_TOKEN not in row.response
    assert caplog.text.count("will retry") == 3 and "failed, out of attempts" in caplog.text
    assert URL_TOKEN not in caplog.text and SECRET not in caplog.text


def test_the_backoff_grows_and_is_capped(settings: Any) -> None:
    settings.FLEETWATCH_WEBHOOK_BACKOFF_SECONDS = 5
    settings.FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS = 3600
    assert [deliveries.subscription_backoff().wait(n) for n in range(1, 7)] == [5, 25, 125, 625, 3125, 3600]


def test_a_delivery_left_for_a_switched_off_subscription_is_not_sent(
        cluster: Any, receiver: Receiver, django_capture_on_commit_callbacks: Any) -> None:
    sub = subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    with mock.patch.object(deliveries, "queue"), mock.patch.object(engine, "step_enqueue"):
        emit(cluster, django_capture_on_commit_callbacks)
    WebhookSubscription.objects.filter(pk=sub.pk).update(active=False)
    [row] = rows()
    assert webhooks.delivery_attempt(row.pk) is None
    row.refresh_from_db()
    assert (row.status, row.attempts) == ("failed", 0) and "deactivated" in row.response
    assert not receiver.hits


def test_a_delivered_delivery_is_not_sent_again(cluster: Any, receiver: Receiver,
                                                sent: list[int],
                                                django_capture_on_commit_callbacks: Any) -> None:
    subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    emit(cluster, django_capture_on_commit_callbacks)
    [row] = rows()
    # A duplicate message (broker redelivery, the watchdog) finds it done.
    assert webhooks.delivery_attempt(row.pk) is None
    assert tasks.webhook_deliver.apply(args=[row.pk]).successful()
    assert deliveries.rescue() == []
    assert len(receiver.hits) == 1
    assert Delivery.objects.get(pk=row.pk).attempts == 1


@pytest.mark.django_db(transaction=True)
def test_two_workers_with_the_same_message_send_once(receiver: Receiver,
                                                     sim_fleet: SimFleet) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL")
    cluster = collectors.cluster_default()
    incident = Incident.objects.create(cluster=cluster, root_cause="thermal", confidence=1,
                                       explanation="hot", fingerprint="t", nodes=["gpu-001"],
                                       detected_at=timezone.now())
    subscribe("pager", f"{receiver.url}/hook")
    receiver.delay = 0.3  # both start while the first is still waiting for its answer
    with mock.patch.object(deliveries, "queue"):
        [delivery_id] = webhooks.event_emit("incident.opened", incident.pk)
    barrier = threading.Barrier(2)

    def work() -> None:
        barrier.wait()
        try:
            webhooks.delivery_attempt(delivery_id)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(receiver.hits) == 1
    row = Delivery.objects.get(pk=delivery_id)
    assert (row.status, row.attempts) == ("delivered", 1)


def test_the_watchdog_sends_deliveries_whose_message_was_lost(
        cluster: Any, receiver: Receiver, settings: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    # The broker took nothing: the row waits, pending.
    with mock.patch.object(tasks.webhook_deliver, "apply_async", side_effect=OSError("down")), \
            mock.patch.object(engine, "step_enqueue"):
        emit(cluster, django_capture_on_commit_callbacks)
    [row] = rows()
    assert row.status == "pending" and row.attempts == 0
    with mock.patch.object(tasks.webhook_deliver, "apply_async",
                           side_effect=lambda args, **_: tasks.webhook_deliver.apply(args=args)):
        assert deliveries.rescue() == []  # not overdue yet
        Delivery.objects.filter(pk=row.pk).update(
            next_attempt_at=timezone.now() - timedelta(minutes=10))
        assert deliveries.rescue() == [row.pk]
    row.refresh_from_db()
    assert (row.status, row.attempts) == ("delivered", 1) and len(receiver.hits) == 1


# --- deliveries through the API ---------------------------------------------------------------


def test_deliveries_are_listed_filtered_and_redelivered(
        cluster: Any, admin: APIClient, receiver: Receiver, sent: list[int],
        django_capture_on_commit_callbacks: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    pager = subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    subscribe("audit", f"{receiver.url}/audit", events=["incident.opened"])
    receiver.plan["/hook"] = [410, 200]
    incident = emit(cluster, django_capture_on_commit_callbacks)

    listed = admin.get("/api/v1/webhook-deliveries/", {"subscription": pager.pk}).json()
    assert listed["count"] == 1
    [failed] = listed["results"]
    assert failed["status"] == "failed" and failed["response_code"] == 410
    assert failed["subscription_name"] == "pager" and failed["incident"] == incident.pk
    assert failed["payload"]["event"] == "incident.opened"
    assert admin.get("/api/v1/webhook-deliveries/", {"status": "delivered"}).json()["count"] == 1
    assert admin.get("/api/v1/webhook-deliveries/",
                     {"event": "incident.opened", "incident": incident.pk}).json()["count"] == 2
    assert admin.get("/api/v1/webhook-deliveries/", {"status": "bogus"}).status_code == 400
    assert SECRET not in json.dumps(listed)

    # The receiver is back: send it again, as a new delivery with the same event id.
    with committed(django_capture_on_commit_callbacks):
        r = admin.post(f"/api/v1/webhook-deliveries/{failed['id']}/redeliver/")
    assert r.status_code == 202, r.content
    again = Delivery.objects.get(pk=r.json()["id"])
    assert (again.status, again.attempts) == ("delivered", 1)
    assert again.event_id == failed["event_id"] and again.pk != failed["id"]
    assert Delivery.objects.get(pk=failed["id"]).status == "failed"  # the record stays
    hits = receiver.to("/hook")
    assert len(hits) == 2 and hits[0].raw == hits[1].raw and verified(hits[1])
    assert AuditEntry.objects.filter(verb="api.call", target__contains="redeliver").exists()
    assert SECRET not in caplog.text


def test_a_step_notification_is_a_delivery_on_the_page_but_not_a_webhook_delivery(
        cluster: Any, admin: APIClient, receiver: Receiver, sent: list[int],
        django_capture_on_commit_callbacks: Any) -> None:
    # One model for both kinds: the step's notification (through collectors' notifier) and the
    # subscription's event are Delivery rows; the webhook API lists the subscriptions' only.
    from collectors.clients.notify import WebhookNotifier

    subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    incident = emit(cluster, django_capture_on_commit_callbacks)
    result = WebhookNotifier(f"{receiver.url}/oncall", backoff=0.0).notify(
        "gpu-003 down", "XID 79", {"incident": incident.pk, "delivery_key": "k-1"})
    assert result.changed
    channels = sorted(Delivery.objects.filter(incident=incident).values_list("channel", "status"))
    assert channels == [("subscription", "delivered"), ("webhook", "delivered")]
    listed = admin.get("/api/v1/webhook-deliveries/").json()
    assert [d["subscription_name"] for d in listed["results"]] == ["pager"]
    step_row = Delivery.objects.get(channel="webhook")
    assert admin.get(f"/api/v1/webhook-deliveries/{step_row.pk}/").status_code == 404
    assert admin.post(f"/api/v1/webhook-deliveries/{step_row.pk}/redeliver/").status_code == 404
    # The incident's page lists both, oldest first.
    page = Client()
    page.force_login(user_with_role("vera", "viewer")[0])
    html = page.get(f"/incidents/{incident.pk}/").content.decode()
    section = html[html.index('data-testid="deliveries"'):]
    assert section.index("webhook pager") < section.index(f"webhook {receiver.url}/oncall")
    # The rescue re-queues subscription deliveries only: a step's has no transport to rebuild.
    Delivery.objects.filter(pk=step_row.pk).update(
        status="pending", next_attempt_at=timezone.now() - timedelta(hours=1))
    assert deliveries.rescue() == []


def test_the_backoff_honours_retry_after_within_its_ceiling() -> None:
    backoff = deliveries.Backoff(max_attempts=8, base=5, factor=5, ceiling=3600)
    assert backoff.wait(2) == 25
    assert backoff.wait(2, retry_after=120) == 120  # the receiver asked for longer
    assert backoff.wait(2, retry_after=1) == 25  # never sooner than the back-off
    assert backoff.wait(2, retry_after=86400) == 3600  # never past the ceiling


def test_redeliver_pressed_twice_sends_once(cluster: Any, admin: APIClient,
                                            receiver: Receiver, sent: list[int],
                                            django_capture_on_commit_callbacks: Any) -> None:
    subscribe("pager", f"{receiver.url}/hook", events=["incident.opened"])
    receiver.plan["/hook"] = [410]
    emit(cluster, django_capture_on_commit_callbacks)
    [failed] = rows()
    # The first press's delivery has not gone out yet (its message is still queued).
    first = admin.post(f"/api/v1/webhook-deliveries/{failed.pk}/redeliver/")
    second = admin.post(f"/api/v1/webhook-deliveries/{failed.pk}/redeliver/")
    assert first.status_code == 202
    assert second.status_code == 409 and "already pending" in second.json()["detail"]
    pending = first.json()["id"]
    r = admin.post(f"/api/v1/webhook-deliveries/{pending}/redeliver/")
    assert r.status_code == 409 and r.json()["status"] == "pending"
    assert Delivery.objects.count() == 2


def test_the_test_button_pings_and_shows_the_answer(admin: APIClient, receiver: Receiver,
                                                    sent: list[int]) -> None:
    sub = subscribe("pager", f"{receiver.url}/hook", events=["incident.resolved"])
    r = admin.post(f"/api/v1/webhooks/{sub.pk}/test/")
    assert r.status_code == 201, r.content
    body = r.json()
    assert (body["event"], body["status"], body["attempts"], body["response_code"]) == (
        "ping", "delivered", 1, 200)
    [hit] = receiver.hits
    assert hit.headers["X-FleetWatch-Event"] == "ping" and verified(hit)
    assert hit.json["subscription"]["name"] == "pager" and hit.json["incident"] is None

    receiver.plan["/hook"] = [404]
    r = admin.post(f"/api/v1/webhooks/{sub.pk}/test/")
    assert r.json()["status"] == "failed" and r.json()["response_code"] == 404
    # A subscription is tested before it is switched on; its events wait for that.
    receiver.plan["/hook"] = [200]
    WebhookSubscription.objects.filter(pk=sub.pk).update(active=False)
    assert admin.post(f"/api/v1/webhooks/{sub.pk}/test/").json()["status"] == "delivered"
    assert admin.post("/api/v1/webhooks/99999/test/").status_code == 404


# --- with a real worker -----------------------------------------------------------------------


@pytest.fixture
def worker_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read by the worker process (its environment is copied when it starts)."""
    monkeypatch.setenv("FLEETWATCH_WEBHOOK_BACKOFF_SECONDS", "0.5")
    monkeypatch.setenv("FLEETWATCH_WEBHOOK_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("FLEETWATCH_WEBHOOK_ALLOW_HOSTS", "127.0.0.1")  # the loopback receiver


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_retries_through_the_broker(worker_backoff: None, receiver: Receiver,
                                                  celery_worker_process: Any) -> None:
    from tests.conftest import wait_for

    cluster = collectors.cluster_default()
    incident = Incident.objects.create(cluster=cluster, root_cause="thermal", confidence=1,
                                       explanation="hot", fingerprint="t", nodes=["gpu-001"],
                                       detected_at=timezone.now())
    subscribe("pager", f"{receiver.url}/hook", events=["incident.resolved"])
    receiver.plan["/hook"] = [503, 200]
    [delivery_id] = webhooks.event_emit("incident.resolved", incident.pk)

    def delivered() -> Delivery | None:
        return Delivery.objects.filter(pk=delivery_id, status="delivered").first()

    row = wait_for(delivered, 60, "the delivery, retried once by the worker")
    assert row.attempts == 2 and len(receiver.to("/hook")) == 2
    assert all(verified(h) for h in receiver.to("/hook"))


def test_a_key_in_the_url_path_is_never_shown_to_readers(db: None, viewer: Any) -> None:
    # Slack-style incoming hooks carry their key in the path, not the query string.
    subscribe("slack", "https://hooks.slack.example/services/T1/B2/PATHKEY0123456789")
    reader = APIClient()
    reader.credentials(HTTP_AUTHORIZATION=f"Token {token_for(viewer, ('read',))}")
    listed = reader.get("/api/v1/webhooks/")
    assert listed.status_code == 200
    assert listed.json()["results"][0]["url"] == "https://hooks.slack.example/services/…"
    assert "PATHKEY" not in listed.content.decode()
