"""The migrations to one delivery model keep every row: collectors.Delivery's step notifications
are copied into incidents.Delivery (and back, going back), subscription deliveries stay."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.apps.registry import Apps
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

BEFORE = [("collectors", "0007_push_receipts_safe_signal_data"),
          ("incidents", "0006_diagnosis_state")]

pytestmark = pytest.mark.django_db(transaction=True)


def migrate(targets: list[tuple[str, str]] | None = None) -> Apps:
    """Migrate to ``targets`` (None: the latest of everything); the models as they were then."""
    executor = MigrationExecutor(connection)
    targets = targets if targets is not None else executor.loader.graph.leaf_nodes()
    executor.migrate(targets)
    executor.loader.build_graph()
    return executor.loader.project_state(targets).apps


@pytest.fixture
def at_latest_afterwards() -> Iterator[None]:
    try:
        yield
    finally:
        migrate()  # the other tests need today's schema


def test_notifications_move_into_the_one_model_and_back(at_latest_afterwards: None) -> None:
    old = migrate(BEFORE)
    now = timezone.now()
    notification: dict[str, Any] = {
        "channel": "slack", "target": "https://hooks.slack.com/services/…",
        "event": "incident.notify", "subject": "gpu-003 down", "incident_id": 4242,
        "payload": {"text": "XID 79", "delivery_key": "incident-7-remediation-3-notify"},
        "status": "delivered", "attempts": 2, "response": "answered 200: ok (after HTTP 503)",
        "created_at": now, "delivered_at": now}
    old.get_model("collectors", "Delivery").objects.create(**notification)
    subscription = old.get_model("incidents", "WebhookSubscription").objects.create(
        name="pager", url="https://hooks.example/x", secret="s" * 32)
    old.get_model("incidents", "WebhookDelivery").objects.create(
        subscription=subscription, event="ping", event_id="e-1", payload={"event": "ping"},
        status="delivered", attempts=1, response="ok")

    new = migrate()
    rows = {d.channel: d for d in new.get_model("incidents", "Delivery").objects.all()}
    assert set(rows) == {"subscription", "slack"}
    copied = rows["slack"]
    for name, value in notification.items():
        assert getattr(copied, name) == value, name
    assert copied.event_id == "incident-7-remediation-3-notify"  # its key, for the API filter
    assert copied.subscription_id is None
    kept = rows["subscription"]
    assert (kept.subscription_id, kept.event, kept.event_id) == (subscription.pk, "ping", "e-1")

    back = migrate(BEFORE)
    [restored] = back.get_model("collectors", "Delivery").objects.all()
    for name, value in notification.items():
        assert getattr(restored, name) == value, name
    assert back.get_model("incidents", "WebhookDelivery").objects.get().event_id == "e-1"
