"""Where a webhook may point: public addresses only, unless an admin allows more
(FLEETWATCH_WEBHOOK_ALLOW_HOSTS); checked when subscribing and again at each delivery, which
connects to the address it checked; and what a receiver answered is shown to admins only."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.test import Client
from rest_framework.test import APIClient

from collectors.roles import ADMIN, OPERATOR, VIEWER, user_with_role
from incidents import webhooks
from incidents.models import Delivery, Incident, WebhookSubscription
from tests.api.test_webhooks import Receiver, receiver  # noqa: F401 (a fixture)
from tests.conftest import token_for

pytestmark = pytest.mark.django_db

INTERNAL = [
    "http://127.0.0.1/hook", "http://localhost:8000/hook", "http://10.0.0.5/hook",
    "http://172.16.3.4/hook", "http://192.168.1.1/hook", "http://100.64.0.1/hook",
    "http://169.254.169.254/latest/meta-data/", "http://0.0.0.0/hook", "http://224.0.0.1/hook",
    "http://240.0.0.1/hook", "http://[::1]/hook", "http://[::]/hook", "http://[fe80::1]/hook",
    "http://[fc00::1]/hook", "http://[ff02::1]/hook",
    # The same addresses spelled otherwise: IPv4-mapped, 6to4 and NAT64 IPv6, and the
    # decimal, hex and short forms the resolver turns into 127.0.0.1 and 10.0.0.1.
    "http://[::ffff:127.0.0.1]/hook", "http://[::ffff:a00:1]/hook",
    "http://[2002:7f00:1::1]/hook", "http://[64:ff9b::a00:1]/hook",
    "http://2130706433/hook", "http://0x7f000001/hook", "http://127.1/hook",
    "http://017700000001/hook", "http://167772161/hook",
]


@pytest.fixture
def admin_api(settings: Any) -> APIClient:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS = []
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user_with_role('ada', ADMIN)[0])}")
    return client


@pytest.mark.parametrize("url", INTERNAL)
def test_internal_targets_are_refused(admin_api: APIClient, url: str) -> None:
    response = admin_api.post("/api/v1/webhooks/", {"name": "probe", "url": url}, format="json")
    # (Django's URL check already refuses a few spellings, such as a bare decimal host.)
    assert response.status_code == 400, response.content
    assert "url" in response.json() and not WebhookSubscription.objects.exists()
    # The check each delivery makes refuses them all, however the row got there.
    with pytest.raises(webhooks.TargetRefused, match="not a public address"):
        webhooks.target_check(url)


def test_public_targets_and_names_that_do_not_resolve_here_are_taken(
        admin_api: APIClient) -> None:
    for name, url in (("public", "https://93.184.215.14/hook"),
                      ("public6", "https://[2606:4700::1111]/hook"),
                      # Resolved only in production's DNS: checked at each delivery instead.
                      ("later", "https://hooks.invalid/hook")):
        response = admin_api.post("/api/v1/webhooks/", {"name": name, "url": url}, format="json")
        assert response.status_code == 201, response.content


def test_an_admin_may_allow_hosts_and_ranges(admin_api: APIClient, settings: Any) -> None:
    settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS = ["localhost", "10.20.0.0/16", "fd00::/8"]
    for name, url in (("by-name", "http://localhost:8000/hook"),
                      ("in-range", "http://10.20.3.4/hook"),
                      ("v6-range", "http://[fd00::5]/hook")):
        response = admin_api.post("/api/v1/webhooks/", {"name": name, "url": url}, format="json")
        assert response.status_code == 201, response.content
    # Outside the allowed range is still refused; so is changing a subscription to it.
    refused = admin_api.post("/api/v1/webhooks/", {"name": "out", "url": "http://10.21.0.1/"},
                             format="json")
    assert refused.status_code == 400 and "url" in refused.json()
    hook = WebhookSubscription.objects.get(name="in-range")
    moved = admin_api.patch(f"/api/v1/webhooks/{hook.pk}/", {"url": "http://127.0.0.1/x"},
                            format="json")
    assert moved.status_code == 400 and "url" in moved.json()
    hook.refresh_from_db()
    assert hook.url == "http://10.20.3.4/hook"


def test_a_bad_allow_list_stops_the_start(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "FLEETWATCH_WEBHOOK_ALLOW_HOSTS": "hooks.corp, not a host/99"}
    done = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0 and "FLEETWATCH_WEBHOOK_ALLOW_HOSTS" in done.stderr


# --- at delivery ------------------------------------------------------------------------------


@pytest.fixture
def incident(sim_fleet: Any) -> Incident:
    from collectors import services as collectors

    return Incident.objects.create(cluster=collectors.cluster_default(), root_cause="thermal",
                                   confidence=1, explanation="hot", fingerprint="t",
                                   nodes=["gpu-001"], detected_at=sim_fleet_now())


def sim_fleet_now() -> Any:
    from django.utils import timezone

    return timezone.now()


@pytest.fixture
def no_queue() -> Iterator[None]:
    from incidents import tasks

    with mock.patch.object(tasks.webhook_deliver, "apply_async"):
        yield


def test_a_subscription_that_now_points_inside_is_not_sent(
        receiver: Receiver, incident: Incident, settings: Any, no_queue: None) -> None:  # noqa: F811
    # Made while allowed (or written straight into the database); the allow list changed.
    WebhookSubscription.objects.create(name="inside", url=f"{receiver.url}/hook", secret="s" * 32)
    settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS = []
    [delivery_id] = webhooks.event_emit("incident.opened", incident.pk)
    assert webhooks.delivery_attempt(delivery_id) is None  # not retried: failed for good
    row = Delivery.objects.get(pk=delivery_id)
    assert row.status == "failed" and row.response_code is None
    assert row.response.startswith("not sent: 127.0.0.1 is not a public address")
    assert receiver.hits == []


def test_the_delivery_connects_to_the_address_it_checked(
        receiver: Receiver, incident: Incident, settings: Any, no_queue: None) -> None:  # noqa: F811
    # DNS rebinding: the name answers an allowed address when checked and another one right
    # after (a resolver stand-in plays the attacker's DNS server, which this machine cannot
    # run). The delivery goes to the address that was checked, with the name as its Host.
    port = int(receiver.url.rsplit(":", 1)[1])
    settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1/32"]
    WebhookSubscription.objects.create(name="rebind", url=f"http://rebind.test:{port}/hook",
                                       secret="s" * 32)
    real = socket.getaddrinfo
    answers = iter(["127.0.0.1"])

    def rebinding(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "rebind.test":
            address = next(answers, "10.255.255.1")  # first answer checked; then inside
            return real(address, *args, **kwargs)
        return real(host, *args, **kwargs)

    with mock.patch.object(socket, "getaddrinfo", rebinding):
        [delivery_id] = webhooks.event_emit("incident.opened", incident.pk)
        assert webhooks.delivery_attempt(delivery_id) is None
    row = Delivery.objects.get(pk=delivery_id)
    assert row.status == "delivered", row.response
    [hit] = receiver.hits
    assert hit.headers["Host"] == f"rebind.test:{port}"


# --- who sees the answer ----------------------------------------------------------------------


def test_only_admins_read_what_the_receiver_answered(
        receiver: Receiver, incident: Incident, settings: Any, no_queue: None) -> None:  # noqa: F811
    settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    receiver.plan["/hook"] = [503]
    WebhookSubscription.objects.create(name="pager", url=f"{receiver.url}/hook", secret="s" * 32)
    [delivery_id] = webhooks.event_emit("incident.opened", incident.pk)
    webhooks.delivery_attempt(delivery_id)
    excerpt = "receiver says 503"
    assert Delivery.objects.get(pk=delivery_id).response == excerpt
    for role, sees in ((VIEWER, False), (OPERATOR, False), (ADMIN, True)):
        user = user_with_role(f"{role}-reader", role)[0]
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user, ('read', 'operate'))}")
        for path in ("/api/v1/webhook-deliveries/", f"/api/v1/webhook-deliveries/{delivery_id}/"):
            body = api.get(path).json()
            row = body["results"][0] if "results" in body else body
            assert row["response_code"] == 503
            assert (row["response"] == excerpt) is sees, (role, row)
        if role != ADMIN:
            page = Client()
            page.force_login(user)
            html = page.get(f"/incidents/{incident.pk}/").content.decode()
            assert "webhook pager" in html and excerpt not in html


def test_an_https_delivery_to_the_checked_address_still_checks_the_certificate_name(
        incident: Incident, settings: Any, no_queue: None, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Pinned to the checked address, TLS still sends the name (SNI) and checks the receiver's
    # certificate against it: a certificate for another name is refused.
    import shutil
    import ssl
    import subprocess
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=hooks.test",
                    "-addext", "subjectAltName=DNS:hooks.test"], check=True, capture_output=True)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    seen: dict[str, str] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen["host"] = self.headers["Host"]
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))

    def sni(sock: Any, name: str | None, ctx: Any) -> None:
        seen.setdefault("sni", name or "")

    context.sni_callback = sni
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    real = socket.getaddrinfo

    def resolver(host: str, *args: Any, **kwargs: Any) -> Any:
        # Both names point at the receiver, as a DNS server would say.
        return real("127.0.0.1" if host in ("hooks.test", "other.test") else host, *args,
                    **kwargs)

    try:
        with mock.patch.object(socket, "getaddrinfo", resolver):
            for name in ("hooks.test", "other.test"):
                WebhookSubscription.objects.create(name=name, url=f"https://{name}:{port}/h",
                                                   secret="s" * 32, events=["incident.opened"])
            good, bad = webhooks.event_emit("incident.opened", incident.pk)
            webhooks.delivery_attempt(good)
            webhooks.delivery_attempt(bad)
    finally:
        server.shutdown()
        server.server_close()
    assert Delivery.objects.get(pk=good).status == "delivered"
    assert seen == {"sni": "hooks.test", "host": f"hooks.test:{port}"}
    failed = Delivery.objects.get(pk=bad)
    assert failed.status == "pending" and failed.response_code is None
    assert "certificate" in failed.response.lower()
