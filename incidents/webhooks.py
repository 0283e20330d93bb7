"""Webhooks out: subscribers hear about incidents (see WebhookSubscription)."""

from __future__ import annotations


def event_emit(event: str, incident_id: int, remediation_id: int | None = None) -> list[int]:
    """Record a delivery for each subscription that wants ``event`` and queue it."""
    # Filled in by the webhooks work (deliveries, signing, retries).
    return []
