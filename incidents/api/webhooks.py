"""API for webhook subscriptions and their deliveries (filled in by the webhooks work)."""

from __future__ import annotations

from rest_framework.routers import DefaultRouter


def register(router: DefaultRouter) -> None:
    """Add the webhook endpoints to the API router."""
