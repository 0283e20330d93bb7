"""API for lending nodes between Slurm training and Kubernetes inference (incidents/lending):
the capacity now and over time, the loans, and a person's (or a program's) lend, approve,
decline, return and retry. Thin: the selectors read, the services act, as on the capacity
page. Reads need a role; actions need ``operate``. An action that does not fit (a node that is
not FleetWatch's to lend, the floor, a loan in another state) answers 409 with why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import django_filters
from django_filters.rest_framework import FilterSet
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter

from collectors.api.permissions import OPERATE, READ, READ_ONLY
from collectors.api.serializers import ConflictSerializer, ErrorSerializer
from collectors.api.views import NamedNotFound
from collectors.clients.base import ClientError
from collectors.models import Cluster
from collectors.roles import actor_from_request
from incidents.lending import selectors, services
from incidents.models import Loan
from incidents.status import InvalidTransition

CONFLICT = OpenApiResponse(ConflictSerializer, description="Does not fit the current state")
NO_CLUSTER = OpenApiResponse(ErrorSerializer, description="No such cluster")
CLUSTER = OpenApiParameter("cluster", str, description="the cluster (the default one when "
                                                        "absent)")


def _cluster(request: Request) -> Cluster:
    try:
        return services.cluster_to_read(request.query_params.get("cluster"))
    except ClientError as exc:
        raise NotFound(str(exc)) from None


class LoanSerializer(serializers.ModelSerializer):
    cluster: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    state = serializers.JSONField(read_only=True, help_text="what the steps found and did")
    direction = serializers.CharField(read_only=True, help_text="lend or return")

    class Meta:
        model = Loan
        fields = ["id", "cluster", "node", "pool", "status", "direction", "step", "mode",
                  "automatic", "requested_by", "reason", "approved_by", "hold_reason",
                  "return_requested_by", "return_reason", "return_automatic", "created_at",
                  "started_at", "lent_at", "return_requested_at", "returned_at", "finished_at",
                  "deadline", "detail", "error", "state"]
        read_only_fields = fields


class LendSerializer(serializers.Serializer):
    node = serializers.CharField(max_length=128, help_text="the node (its Kubernetes name)")
    cluster = serializers.CharField(max_length=64, required=False, allow_blank=True,
                                    help_text="the node's cluster (the default one when "
                                              "absent)")
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True,
                                   help_text="why, for the audit trail")


class ReturnSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True,
                                   help_text="why, for the audit trail")


class PoolCapacitySerializer(serializers.Serializer):
    pool = serializers.CharField()
    counts = serializers.DictField(child=serializers.FloatField(allow_null=True),
                                   help_text="GPUs by use, nodes lent and moving, and the "
                                             "cluster's pending demand")
    mode = serializers.CharField()
    floor = serializers.IntegerField()
    ceiling = serializers.IntegerField()
    floor_setting = serializers.CharField()
    ceiling_setting = serializers.CharField()
    training = serializers.IntegerField()
    lent = serializers.IntegerField()
    room = serializers.IntegerField(help_text="nodes that may still be lent now")


class DemandSerializer(serializers.Serializer):
    known = serializers.BooleanField(help_text="false: Slurm's figures are missing or stale")
    jobs = serializers.IntegerField()
    gpus = serializers.IntegerField()
    oldest_wait_seconds = serializers.FloatField(allow_null=True)
    gpu_weighted_wait_seconds = serializers.FloatField(allow_null=True)
    why_unknown = serializers.CharField()
    waiting = serializers.ListField(child=serializers.DictField())


class NodeUseSerializer(serializers.Serializer):
    name = serializers.CharField()
    pool = serializers.CharField()
    use = serializers.CharField()
    category = serializers.CharField()
    gpus = serializers.IntegerField()
    allocated = serializers.IntegerField()
    blocked = serializers.CharField()
    slurm_name = serializers.CharField()


class CapacitySerializer(serializers.Serializer):
    cluster = serializers.CharField()
    totals = serializers.DictField(child=serializers.IntegerField(), help_text="GPUs by use")
    pools = PoolCapacitySerializer(many=True)
    demand = DemandSerializer()
    lendable = NodeUseSerializer(many=True, help_text="idle nodes that could be lent now")
    not_lendable = NodeUseSerializer(many=True, help_text="training nodes that may not be "
                                                           "lent now, with why")
    loans = LoanSerializer(many=True, help_text="the live loans")
    decision = serializers.DictField(help_text="the automatic policy's last decision")
    decided_at = serializers.DateTimeField(allow_null=True)


class CapacityHistorySerializer(serializers.Serializer):
    range = serializers.CharField()
    gpus = serializers.DictField(child=serializers.DictField(), help_text="GPUs by use: "
                                 "{label: {x: [times], y: [GPUs]}}")
    demand = serializers.DictField(child=serializers.DictField())
    nodes = serializers.DictField(child=serializers.DictField())


@extend_schema(parameters=[CLUSTER], responses={200: CapacitySerializer, 404: NO_CLUSTER})
class CapacityView(GenericAPIView):
    """Capacity now: GPUs by pool and use (Slurm training allocated, idle, drained; moving;
    Kubernetes inference allocated, idle; in repair; RMA), Slurm's pending demand, the nodes
    that could be lent now, the live loans and the automatic policy's last decision."""

    serializer_class = CapacitySerializer
    access = {"GET": READ}

    def get(self, request: Request) -> Response:
        return Response(CapacitySerializer(selectors.capacity(_cluster(request))).data)


@extend_schema(parameters=[CLUSTER, OpenApiParameter(
    "range", str, enum=list(selectors.CHART_RANGES), description="day (the default) or week"),
    OpenApiParameter("pool", str, description="one pool (all when absent)")],
    responses={200: CapacityHistorySerializer, 404: NO_CLUSTER})
class CapacityHistoryView(GenericAPIView):
    """Capacity over the last day or week, from the stored snapshots (one per pool every
    FLEETWATCH_CAPACITY_SNAPSHOT_SECONDS): what the capacity page's charts draw."""

    serializer_class = CapacityHistorySerializer
    access = {"GET": READ}

    def get(self, request: Request) -> Response:
        span = request.query_params.get("range", "day")
        if span not in selectors.CHART_RANGES:
            raise ValidationError({"range": [f"expected one of "
                                             f"{', '.join(selectors.CHART_RANGES)}"]})
        chart = selectors.capacity_chart(_cluster(request), span,
                                         request.query_params.get("pool"))
        return Response(CapacityHistorySerializer(chart).data)


class LoanFilter(FilterSet):
    status = django_filters.ChoiceFilter(choices=Loan.Status.choices)
    node = django_filters.CharFilter()
    pool = django_filters.CharFilter()
    cluster = django_filters.CharFilter(field_name="cluster__name")

    class Meta:
        model = Loan
        fields = ["status", "node", "pool", "cluster"]


def _conflict(detail: str, state: str) -> Response:
    return Response({"detail": detail, "status": state}, status=status.HTTP_409_CONFLICT)


class LoanViewSet(NamedNotFound, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Loans: a node lent from Slurm training to Kubernetes inference, and its way back.
    Create one to lend a node (it starts at once, as a person's click on the capacity page
    does); approve or decline what the policy proposed; return it; retry a stopped one."""

    serializer_class = LoanSerializer
    queryset = Loan.objects.select_related("cluster").order_by("-created_at", "-id")
    filterset_class = LoanFilter
    ordering_fields = ["created_at", "lent_at", "returned_at"]
    access = {**READ_ONLY, "create": OPERATE, "approve": OPERATE, "decline": OPERATE,
              "return_": OPERATE, "retry": OPERATE}

    @extend_schema(request=LendSerializer, responses={201: LoanSerializer, 409: CONFLICT})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Lend a node to inference now: drained in Slurm (``fleetwatch:`` reason), made
        schedulable in Kubernetes. 409 when it is not FleetWatch's to lend (an
        administrator's drain or cordon, a repair), or the pool's floor or ceiling says no."""
        body = LendSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        try:
            cluster = services.cluster_named(data.get("cluster"))
        except ClientError as exc:
            raise ValidationError({"cluster": [str(exc)]}) from None
        try:
            loan = services.loan_lend(cluster, data["node"], actor=actor_from_request(request),
                                      reason=data.get("reason") or "lent through the API")
        except InvalidTransition as exc:
            return _conflict(str(exc), "refused")
        return Response(LoanSerializer(loan).data, status=status.HTTP_201_CREATED)

    def _act(self, request: Request, fn: Callable[..., Loan], **extra: Any) -> Response:
        loan = self.get_object()
        try:
            fn(loan.pk, actor=actor_from_request(request), **extra)
        except InvalidTransition as exc:
            loan.refresh_from_db()
            return _conflict(str(exc), loan.status)
        return Response(LoanSerializer(Loan.objects.get(pk=loan.pk)).data)

    @extend_schema(request=None, responses={200: LoanSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: str | None = None) -> Response:
        """Approve the lend or the return the policy proposed."""
        return self._act(request, services.loan_approve)

    @extend_schema(request=None, responses={200: LoanSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def decline(self, request: Request, pk: str | None = None) -> Response:
        """Decline it: a proposed lend is cancelled, a proposed return leaves the node lent."""
        return self._act(request, services.loan_decline)

    @extend_schema(request=ReturnSerializer, responses={200: LoanSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"], url_path="return")
    def return_(self, request: Request, pk: str | None = None) -> Response:
        """Bring the node back to training: cordoned, its inference pods evicted through the
        Eviction API (PodDisruptionBudgets honoured), labels and taints put back, resumed in
        Slurm. From half-way out, the lend stops and what it did is undone."""
        body = ReturnSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return self._act(request, services.loan_return,
                         reason=body.validated_data.get("reason") or "returned through the API")

    @extend_schema(request=None, responses={200: LoanSerializer, 409: CONFLICT})
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        """Run the step a stopped loan stopped at again (the calls it completed are not made
        again)."""
        return self._act(request, services.loan_retry)


def register(router: DefaultRouter) -> None:
    """Add the loans endpoints to the API router (the capacity views are in urls.py)."""
    router.register("loans", LoanViewSet, basename="loan")
