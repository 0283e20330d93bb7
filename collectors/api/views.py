"""The fleet's REST endpoints under /api/v1/: clusters, nodes, GPUs, jobs, signals (read,
and pushed by node agents and other monitors) and sources. Thin: they validate input, read
through collectors.selectors and store pushes through collectors.services.

Each view says in ``access`` what each of its calls needs (collectors/api/permissions.py);
the schema prints it in every operation's description. Nodes are addressed by name and jobs
by Slurm id (with ``?cluster=`` where several clusters share one), clusters by name, GPUs by
id.

Answers: 400 with the fields at fault; 404 naming what was not found; 413 for an oversized
push; 422 for a pushed signal naming a node FleetWatch does not know."""

from __future__ import annotations

from typing import Any

import django.dispatch
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from kombu.exceptions import OperationalError as KombuOperationalError
from rest_framework import mixins, status, viewsets
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from collectors import filters, selectors
from collectors import services as collectors
from collectors.agent import __version__ as agent_version
from collectors.api.pagination import SignalCursor
from collectors.api.permissions import INGEST, READ, READ_ONLY
from collectors.api.serializers import (
    AgentInfoSerializer,
    ClusterSerializer,
    ErrorSerializer,
    GpuDetailSerializer,
    JobSerializer,
    NodeSerializer,
    SignalBatchSerializer,
    SignalSerializer,
    SourceSerializer,
    StoredSerializer,
)
from collectors.clients import remote_write
from collectors.clients.base import ClientError
from collectors.knowledge import agent
from collectors.models import Cluster, Gpu, Node, Signal
from collectors.roles import push_rights

CLUSTER_PARAM = OpenApiParameter(
    "cluster", str, description="the cluster's name, where several clusters share the name")

# Sent when a push is refused (collectors.services.IngestRejected), with ``request``,
# ``error`` and ``signals`` (how many the batch held), before the answer: the incidents app
# records it in the audit trail, which collectors do not import.
push_refused = django.dispatch.Signal()


class NamedNotFound:
    """A 404 that says what was looked for ("no incident 12"), not DRF's generic text."""

    def get_object(self) -> Any:
        try:
            return super().get_object()  # type: ignore[misc]
        except Http404:
            view: Any = self
            lookup = view.kwargs.get(view.lookup_url_kwarg or view.lookup_field)
            name = getattr(view, "not_found_name", "") or \
                view.get_queryset().model._meta.verbose_name
            raise NotFound(f"no {name} {lookup}") from None


# --- the fleet ------------------------------------------------------------------------------


class ClusterViewSet(NamedNotFound, viewsets.ReadOnlyModelViewSet):
    serializer_class = ClusterSerializer
    queryset = Cluster.objects.order_by("name")
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    access = READ_ONLY


@extend_schema(parameters=[OpenApiParameter("name", str, OpenApiParameter.PATH,
                                            description="the node's name")])
class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """Nodes as FleetWatch last saw them, with their GPUs."""

    serializer_class = NodeSerializer
    queryset = Node.objects.select_related("cluster").prefetch_related("gpus").order_by("name")
    filterset_class = filters.NodeFilter
    ordering_fields = ["name", "updated_at", "health", "leaf_switch", "pool"]
    lookup_field = "name"
    # Host names may have dots (``node1.rack2``): anything up to the next slash.
    lookup_value_regex = "[^/]+"
    access = READ_ONLY

    @extend_schema(parameters=[CLUSTER_PARAM])
    def retrieve(self, request: Request, name: str = "") -> Response:
        return super().retrieve(request, name=name)

    def get_object(self) -> Node:
        name, cluster = self.kwargs["name"], self.request.query_params.get("cluster")
        node = selectors.node_get(name, cluster)
        if node is None:
            raise NotFound(f"no node {name}" + (f" in cluster {cluster}" if cluster else ""))
        return node


class GpuViewSet(NamedNotFound, viewsets.ReadOnlyModelViewSet):
    serializer_class = GpuDetailSerializer
    queryset = Gpu.objects.select_related("node").order_by("node__name", "index")
    filterset_class = filters.GpuFilter
    ordering_fields = ["index", "temperature", "utilization", "last_xid", "updated_at"]
    access = READ_ONLY


@extend_schema(parameters=[OpenApiParameter("slurm_id", str, OpenApiParameter.PATH,
                                            description="the Slurm job id")])
class JobViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = JobSerializer
    queryset = selectors.jobs_for_list()
    filterset_class = filters.JobFilter
    ordering_fields = ["updated_at", "started_at", "slurm_id", "restart_count"]
    lookup_field = "slurm_id"
    lookup_value_regex = "[^/]+"
    access = READ_ONLY

    @extend_schema(parameters=[CLUSTER_PARAM])
    def retrieve(self, request: Request, slurm_id: str = "") -> Response:
        return super().retrieve(request, slurm_id=slurm_id)

    def get_object(self) -> Any:
        slurm_id, cluster = self.kwargs["slurm_id"], self.request.query_params.get("cluster")
        job = selectors.job_get(slurm_id, cluster)
        if job is None:
            raise NotFound(f"no job {slurm_id}" + (f" in cluster {cluster}" if cluster else ""))
        return job


class SignalViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Signals: read them (oldest first, cursor-paged: follow ``next``), or push a batch."""

    serializer_class = SignalSerializer
    queryset = Signal.objects.select_related("cluster")
    pagination_class = SignalCursor
    filter_backends = [DjangoFilterBackend]  # the cursor fixes the order
    filterset_class = filters.SignalFilter
    access = {"list": READ, "create": INGEST}

    @property
    def throttle_scope(self) -> str:
        # Pushes have their own budget: an agent catching up must not starve its reads.
        return "ingest" if self.action == "create" else "token"

    @extend_schema(
        request=SignalBatchSerializer,
        parameters=[OpenApiParameter(
            "Idempotency-Key", str, OpenApiParameter.HEADER, required=False,
            description="1 to 128 visible ASCII characters, one per batch: the same batch sent "
                        "again with it (a retry) is stored once, and its answer carries "
                        "\"replayed\": true and the Idempotent-Replayed header")],
        responses={201: StoredSerializer,
                   403: OpenApiResponse(ErrorSerializer, description="A record this caller "
                                        "may not push (source or node), named"),
                   413: OpenApiResponse(ErrorSerializer, description="Batch or body over the "
                                        "limit"),
                   422: OpenApiResponse(ErrorSerializer, description="Unknown node(s), or an "
                                        "Idempotency-Key used for another batch"),
                   426: OpenApiResponse(ErrorSerializer, description="A node agent whose push "
                                        "protocol (FleetWatch-Agent header) this server does "
                                        "not take")},
        description="Push a batch of signals (node agents, other monitors), in the replay "
                    "format. All or nothing: a batch with one bad record stores nothing. What "
                    "a caller may push follows from who it is: an agent's token, its own "
                    "node's kernel, dcgm and nic records; any other ingest token, those and "
                    "job_log records for known nodes; nobody, collector, slurm or kubernetes "
                    "records (403, audited).")
    def create(self, request: Request) -> Response:
        refused = agent_protocol_refusal(request)
        if refused is not None:
            return refused
        signals = request.data.get("signals") if isinstance(request.data, dict) else None
        if isinstance(signals, list) and len(signals) > settings.FLEETWATCH_INGEST_MAX_BATCH:
            return Response({"detail": f"batch of {len(signals)} signals is over the limit of "
                             f"{settings.FLEETWATCH_INGEST_MAX_BATCH}; split it"},
                            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        batch = SignalBatchSerializer(data=request.data)
        batch.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key")
        # Keys are per token (its digest, shortened: a token's key is never stored), else
        # per signed-in person.
        auth_id = getattr(request.auth, "pk", None)
        caller = f"token:{str(auth_id)[:48]}" if auth_id is not None else f"user:{request.user.pk}"
        try:
            result = collectors.signals_ingest(
                batch.validated_data.get("cluster") or settings.FLEETWATCH_CLUSTER,
                batch.validated_data["signals"],
                rights=push_rights(request.user),
                idempotency=(caller, key) if key is not None else None)
        except collectors.IngestRejected as exc:
            # The api.call entry says a push was refused; the audit entry this asks for
            # says why.
            push_refused.send(sender=type(self), request=request, error=exc,
                              signals=len(batch.validated_data["signals"]))
            return Response({"detail": str(exc)}, status=exc.status)
        if result.replayed:
            return Response({"stored": result.stored, "replayed": True},
                            status=status.HTTP_201_CREATED,
                            headers={"Idempotent-Replayed": "true"})
        return Response({"stored": result.stored}, status=status.HTTP_201_CREATED)

    def handle_exception(self, exc: Exception) -> Response:
        if isinstance(exc, RequestDataTooBig):
            # Django's own answer would be an HTML 400.
            return Response(
                {"detail": f"request body over the limit of {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} "
                           "bytes (DATA_UPLOAD_MAX_MEMORY_SIZE, room for "
                           f"FLEETWATCH_INGEST_MAX_BATCH={settings.FLEETWATCH_INGEST_MAX_BATCH} "
                           "signals of the largest size); split the batch"},
                status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        return super().handle_exception(exc)


def agent_protocol_refusal(request: Request) -> Response | None:
    """426 for a node agent whose push protocol this server does not take (its
    FleetWatch-Agent header), saying which side to upgrade; None for any other caller."""
    protocol = agent.header_protocol(request.headers.get(agent.AGENT_HEADER))
    if protocol is None or agent.OLDEST_PROTOCOL <= protocol <= agent.PROTOCOL:
        return None
    shown = request.headers.get(agent.AGENT_HEADER, "")[:80]
    side = ("upgrade FleetWatch" if protocol > agent.PROTOCOL
            else "install the agent built from this FleetWatch's release")
    return Response({"detail": f"agent {shown!r} speaks push protocol {protocol}; FleetWatch "
                               f"takes {agent.OLDEST_PROTOCOL} to {agent.PROTOCOL}: {side}. "
                               "Nothing stored."},
                    status=status.HTTP_426_UPGRADE_REQUIRED)


class AgentViewSet(viewsets.ViewSet):
    """What a node agent checks at start: the push protocols this server takes and the
    version of the agent built with it."""

    access = {"list": INGEST}
    answers_one_object = True  # for the schema (incidents.api.schema)

    @extend_schema(responses=AgentInfoSerializer)
    def list(self, request: Request) -> Response:
        return Response({"version": agent_version,
                         "protocols": {"oldest": agent.OLDEST_PROTOCOL, "newest": agent.PROTOCOL},
                         "header": agent.AGENT_HEADER})


class PrometheusWriteViewSet(viewsets.ViewSet):
    """Prometheus remote write (1.0: snappy-compressed protobuf), the telemetry doorbell: a
    fault field's new value among the samples queues the cluster's telemetry collection at
    once, instead of at its next poll (collectors.services.telemetry_doorbell). Nothing is
    stored from the samples themselves. Configure it in Prometheus's ``remote_write`` with
    ``authorization: {type: Token, credentials: <an ingest token>}`` and keep only the DCGM
    fault fields (deploy/prometheus/remote-write-fleetwatch.yaml)."""

    access = {"create": INGEST}
    throttle_scope = "ingest"

    @extend_schema(
        request={"application/x-protobuf": {"type": "string", "format": "binary"}},
        parameters=[OpenApiParameter("cluster", str, OpenApiParameter.QUERY, required=False,
                                     description="the cluster this Prometheus scrapes (one "
                                                 "of FLEETWATCH_CLUSTERS; default "
                                                 "FLEETWATCH_CLUSTER)")],
        responses={204: OpenApiResponse(description="Read (a collection queued or not)"),
                   400: OpenApiResponse(ErrorSerializer, description="Not a remote-write "
                                        "body, or an unknown cluster"),
                   413: OpenApiResponse(ErrorSerializer, description="Body over the limit"),
                   503: OpenApiResponse(ErrorSerializer, description="The task broker is "
                                        "unreachable (Prometheus retries)")})
    def create(self, request: Request) -> Response:
        name = request.query_params.get("cluster") or settings.FLEETWATCH_CLUSTER
        try:
            cluster = collectors.cluster_get(name)
            series = remote_write.decode(request.body)
        except (ClientError, remote_write.RemoteWriteError) as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        except RequestDataTooBig:
            return Response({"detail": "request body over DATA_UPLOAD_MAX_MEMORY_SIZE "
                             f"({settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes)"},
                            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        try:
            collectors.telemetry_doorbell(cluster, series)
        except KombuOperationalError as exc:
            return Response({"detail": f"task broker unreachable: {exc}"},
                            status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- sources ------------------------------------------------------------------------------


class SourceViewSet(viewsets.ViewSet):
    """Each collector's health and its recent runs (a handful of rows: not paged)."""

    access = {"list": READ}

    @extend_schema(responses=SourceSerializer(many=True))
    def list(self, request: Request) -> Response:
        return Response(SourceSerializer(selectors.sources_overview(), many=True).data)
