"""Copy the step notifications recorded in collectors.Delivery into incidents.Delivery (which
collectors' migration 0008 then drops). Reversible: going back copies them out again."""

from typing import Any

from django.db import migrations

BATCH = 500
# collectors.Delivery's field -> incidents.Delivery's field of the same meaning.
SAME = ("channel", "target", "event", "subject", "payload", "incident_id", "status", "attempts",
        "response", "created_at", "delivered_at")


def forwards(apps: Any, schema_editor: Any) -> None:
    Old = apps.get_model("collectors", "Delivery")
    New = apps.get_model("incidents", "Delivery")
    batch = []
    for old in Old.objects.order_by("id").iterator(chunk_size=BATCH):
        key = (old.payload or {}).get("delivery_key") if isinstance(old.payload, dict) else None
        batch.append(New(event_id=str(key or "")[:64], next_attempt_at=None,
                         **{name: getattr(old, name) for name in SAME}))
        if len(batch) >= BATCH:
            New.objects.bulk_create(batch)
            batch = []
    if batch:
        New.objects.bulk_create(batch)


def backwards(apps: Any, schema_editor: Any) -> None:
    Old = apps.get_model("collectors", "Delivery")
    New = apps.get_model("incidents", "Delivery")
    notifications = New.objects.exclude(channel="subscription")
    Old.objects.bulk_create(
        [Old(**{name: getattr(new, name) for name in SAME})
         for new in notifications.order_by("id").iterator(chunk_size=BATCH)],
        batch_size=BATCH)
    notifications.delete()


class Migration(migrations.Migration):

    dependencies = [
        ('collectors', '0007_push_receipts_safe_signal_data'),
        ('incidents', '0007_delivery_one_model'),
    ]
    # The copy reads collectors.Delivery, which collectors' next migration drops.
    run_before = [
        ('collectors', '0008_delete_delivery'),
    ]

    operations = [
        migrations.RunPython(forwards, backwards),
    ]
