"""API for webhook subscriptions and their deliveries.

Anyone with a role may read them; only admins create, change, delete, test and redeliver (a
subscription sends the fleet's incidents to a URL of its choosing). The signing secret is
write-only: generated unless given, shown once in the answer to the create, never after.
Subscription URLs are shown without user:password or query string (where receivers like to
put a token), since viewers may read the list.
"""

from __future__ import annotations

import secrets
from typing import Any
from urllib.parse import urlsplit

from django.core.validators import URLValidator
from django.db import IntegrityError, transaction
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter

from collectors.redaction import redact_url
from collectors.roles import ADMIN, ADMIN_ONLY, READ, actor_from_request, role_of
from incidents import webhooks
from incidents.models import Delivery, WebhookSubscription

SECRET_MIN_CHARS = 16


def _http_url(value: str) -> None:
    # A function rather than URLValidator itself, which the schema would print as format: uri.
    URLValidator(schemes=["http", "https"])(value)


class WebhookSubscriptionSerializer(serializers.ModelSerializer):
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=WebhookSubscription.Event.choices),
        required=False, allow_empty=True,
        help_text="Events to send; empty or left out: all of them")
    secret = serializers.CharField(
        write_only=True, required=False, min_length=SECRET_MIN_CHARS, max_length=128,
        trim_whitespace=False,
        help_text="HMAC-SHA256 signing key; generated when left out, never shown again")

    # A plain string, not a URL, in the schema: what is shown back is the URL cut short
    # ("https://hooks.example/services/…"), which is no longer a valid URI.
    url = serializers.CharField(
        max_length=500, validators=[_http_url],
        help_text="http(s) URL the events are POSTed to; shown back as its host and first path "
                  "segment only (hook URLs often carry their key in the path)")

    class Meta:
        model = WebhookSubscription
        fields = ["id", "name", "url", "events", "active", "secret", "created_by", "created_at"]
        read_only_fields = ["created_by", "created_at"]

    def validate_url(self, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https"):
            raise serializers.ValidationError("Use an http:// or https:// URL.")
        if parts.fragment:
            raise serializers.ValidationError("A URL fragment is never sent; leave it out.")
        try:
            # A name that does not resolve here may in production's DNS: each delivery checks
            # again (and refuses then) anyway.
            webhooks.target_check(value, resolve_failure_ok=True)
        except webhooks.TargetRefused as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value

    def validate_events(self, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))  # duplicates dropped, order kept

    def to_representation(self, instance: WebhookSubscription) -> dict[str, Any]:
        data = super().to_representation(instance)
        # Slack-style hook URLs carry their key in the path: show the host and first segment.
        data["url"] = redact_url(instance.url, keep_path=False)
        return data


class WebhookSubscriptionCreatedSerializer(WebhookSubscriptionSerializer):
    """The answer to a create: the only time the secret is shown."""

    secret = serializers.CharField(read_only=True, help_text="Keep it: it is not shown again")

    class Meta(WebhookSubscriptionSerializer.Meta):
        pass

    def to_representation(self, instance: WebhookSubscription) -> dict[str, Any]:
        data = super().to_representation(instance)
        data["secret"] = instance.secret
        return data


class WebhookDeliverySerializer(serializers.ModelSerializer):
    # Never null here (the viewset lists subscriptions' deliveries only), though the one
    # Delivery model allows it for a step's notification.
    subscription = serializers.IntegerField(source="subscription_id", read_only=True)
    subscription_name = serializers.CharField(source="subscription.name", read_only=True)
    response = serializers.CharField(
        read_only=True,
        help_text="the start of the receiver's answer, or why there was none: admins only "
                  "(empty for everyone else, who see response_code)")

    class Meta:
        model = Delivery
        fields = ["id", "subscription", "subscription_name", "event", "event_id", "incident",
                  "status", "attempts", "response_code", "response", "created_at",
                  "next_attempt_at", "delivered_at", "payload"]
        read_only_fields = fields

    def to_representation(self, instance: Delivery) -> dict[str, Any]:
        data = super().to_representation(instance)
        # What a receiver answered is its text, which a subscription aimed at an internal
        # service would turn into a way to read it: only admins (who manage subscriptions)
        # see it.
        request = self.context.get("request")
        if request is None or role_of(request.user) != ADMIN:
            data["response"] = ""
        return data


def _save(serializer: serializers.BaseSerializer[Any], **extra: Any) -> Any:
    """Save; a name taken meanwhile is the same 400 as one taken before. The serializer's
    unique check reads before it writes, so two creates with one name at the same moment
    both pass it, and the database's unique constraint refuses the second."""
    try:
        with transaction.atomic():
            return serializer.save(**extra)
    except IntegrityError:
        name = serializer.validated_data.get("name", "")
        if WebhookSubscription.objects.filter(name=name).exists():
            raise serializers.ValidationError(
                {"name": ["webhook subscription with this name already exists."]}) from None
        raise


_ADMIN = {a: ADMIN_ONLY for a in ("create", "update", "partial_update", "destroy", "test")}
_CONFLICT = OpenApiResponse(description="refused in the delivery's current state; `detail` "
                                        "says why")


@extend_schema_view(
    create=extend_schema(responses={201: WebhookSubscriptionCreatedSerializer},
                         description="Subscribe a URL. The answer carries the signing secret: "
                                     "the only time it is shown."),
)
class WebhookSubscriptionViewSet(viewsets.ModelViewSet):
    """Who hears about incidents, and which events. Admins only change them."""

    serializer_class = WebhookSubscriptionSerializer
    queryset = WebhookSubscription.objects.order_by("name")
    access = {"list": READ, "retrieve": READ, **_ADMIN}
    filterset_fields = ["active"]

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        subscription = _save(serializer, created_by=actor_from_request(request),
                             secret=serializer.validated_data.get("secret")
                             or secrets.token_urlsafe(32))
        return Response(WebhookSubscriptionCreatedSerializer(subscription).data,
                        status=status.HTTP_201_CREATED)

    def perform_update(self, serializer: serializers.BaseSerializer[Any]) -> None:
        _save(serializer)

    @extend_schema(request=None, responses={201: WebhookDeliverySerializer},
                   description="Send a `ping` event now and answer with its delivery (a "
                               "transient failure goes on being retried like any delivery).")
    @action(detail=True, methods=["post"])
    def test(self, request: Request, pk: str | None = None) -> Response:
        delivery = webhooks.ping_send(self.get_object())
        return Response(WebhookDeliverySerializer(delivery, context={"request": request}).data,
                        status=status.HTTP_201_CREATED)


class WebhookDeliveryViewSet(viewsets.ReadOnlyModelViewSet):
    """Every event sent or being sent to a subscription, with its last attempt's answer."""

    serializer_class = WebhookDeliverySerializer
    # The subscriptions' deliveries only: a step's notification to the on-call (the same model)
    # has no subscription and shows on its incident's page.
    queryset = (Delivery.objects.filter(channel=Delivery.Channel.SUBSCRIPTION)
                .select_related("subscription").order_by("-created_at", "-id"))
    access = {"list": READ, "retrieve": READ, "redeliver": ADMIN_ONLY}
    filterset_fields = ["subscription", "status", "event", "incident", "event_id"]
    ordering_fields = ["created_at", "delivered_at", "attempts"]

    @extend_schema(request=None, responses={202: WebhookDeliverySerializer, 409: _CONFLICT},
                   description="Send a finished delivery's event again, as a new delivery "
                               "with the same event id. 409 while it, or a redelivery of "
                               "it, is still pending.")
    @action(detail=True, methods=["post"])
    def redeliver(self, request: Request, pk: str | None = None) -> Response:
        original = self.get_object()
        try:
            copy = webhooks.redeliver(original.pk)
        except webhooks.RedeliverRefused as exc:
            original.refresh_from_db()
            return Response({"detail": str(exc), "status": original.status},
                            status=status.HTTP_409_CONFLICT)
        return Response(WebhookDeliverySerializer(copy, context={"request": request}).data,
                        status=status.HTTP_202_ACCEPTED)


def register(router: DefaultRouter) -> None:
    """Add the webhook endpoints to the API router."""
    router.register("webhooks", WebhookSubscriptionViewSet, basename="webhook")
    router.register("webhook-deliveries", WebhookDeliveryViewSet, basename="webhook-delivery")
