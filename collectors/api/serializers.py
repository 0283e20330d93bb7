"""What the fleet's API endpoints read and write (clusters, nodes, GPUs, jobs, signals,
sources), and the error answers every endpoint documents. Output serializers are read-only
views of the models; the push's input serializers validate a batch before the view hands it
to collectors.services."""

from __future__ import annotations

import json
import re

from django.conf import settings
from rest_framework import serializers

from collectors.models import Cluster, CollectorRun, Gpu, Job, Node, Signal
from collectors.sources import cluster_names

# --- errors (for the schema: what a 4xx answer carries) --------------------------------------


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()


class ConflictSerializer(serializers.Serializer):
    """409: the action does not fit the current state; ``status`` is the state it is in."""

    detail = serializers.CharField()
    status = serializers.CharField(required=False)


# --- the fleet ------------------------------------------------------------------------------


class ClusterSerializer(serializers.ModelSerializer):
    class Meta:
        model = Cluster
        fields = ["id", "name", "description"]


class GpuSerializer(serializers.ModelSerializer):
    class Meta:
        model = Gpu
        fields = ["index", "uuid", "utilization", "temperature", "last_xid", "health"]


class GpuDetailSerializer(serializers.ModelSerializer):
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = Gpu
        fields = ["id", "node", "index", "uuid", "utilization", "temperature", "last_xid",
                  "last_xid_at", "health", "updated_at"]


class NodeSerializer(serializers.ModelSerializer):
    gpus = GpuSerializer(many=True, read_only=True)
    cluster: serializers.SlugRelatedField[Cluster] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = Node
        fields = ["id", "cluster", "name", "slurm_name", "pool", "leaf_switch", "in_service",
                  "health", "slurm_state", "slurm_flags", "slurm_reason", "k8s_ready",
                  "k8s_unschedulable", "k8s_annotations", "nic_state", "updated_at", "gpus"]


class JobSerializer(serializers.ModelSerializer):
    cluster: serializers.SlugRelatedField[Cluster] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = Job
        # gpus: {node: [GPU indices]} from Slurm's gres_detail; a node missing: not said.
        fields = ["id", "cluster", "slurm_id", "name", "user", "state", "nodes", "gpus",
                  "restart_count", "step", "checkpoint_step", "resumed_from_step", "started_at",
                  "updated_at"]


class SignalSerializer(serializers.ModelSerializer):
    cluster: serializers.SlugRelatedField[Cluster] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    node = serializers.CharField(source="node_name", read_only=True)
    gpu = serializers.IntegerField(source="gpu_index", read_only=True, allow_null=True)
    job = serializers.CharField(source="job_id", read_only=True)

    class Meta:
        model = Signal
        fields = ["id", "cluster", "source", "kind", "node", "gpu", "job", "code", "value",
                  "message", "data", "observed_at", "ingested_at"]


class SignalInSerializer(serializers.Serializer):
    """One pushed signal, in the replay format (shared/REPLAY.md): ``at`` and ``source``,
    the source's fields, and any extra fields (kept as they are)."""

    SOURCES = ["kernel", "dcgm", "nic", "slurm", "kubernetes", "job_log", "collector", "gpud"]
    at = serializers.DateTimeField(help_text="RFC 3339 with an offset: 2026-12-03T10:00:00Z")
    # A field named like DRF's Field.source attribute (a string): the stubs see a clash.
    source = serializers.ChoiceField(choices=SOURCES)  # type: ignore[assignment]
    node = serializers.CharField(max_length=128, required=False, allow_blank=True)
    gpu = serializers.IntegerField(min_value=0, max_value=255, required=False, allow_null=True)
    job = serializers.CharField(max_length=32, required=False, allow_blank=True)
    message = serializers.CharField(max_length=settings.FLEETWATCH_INGEST_MESSAGE_MAX_CHARS,
                                    required=False, allow_blank=True)
    metric = serializers.CharField(max_length=128, required=False)
    value = serializers.FloatField(required=False, allow_null=True)

    def to_internal_value(self, data: object) -> dict[str, object]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("each signal must be an object")
        validated = super().to_internal_value(data)
        # DRF would quietly read a naive time in the server's zone; a signal's time must say
        # its offset, as RFC 3339 (and the replay format) require.
        raw_at = str(data.get("at", ""))
        if not re.search(r"(Z|[+-]\d\d:?\d\d)$", raw_at.strip(), re.I):
            raise serializers.ValidationError({"at": "needs a UTC offset (RFC 3339)"})
        extra = {k: v for k, v in data.items() if k not in self.fields}
        for key, value in extra.items():
            if not isinstance(value, str | int | float | bool | list | dict | type(None)):
                raise serializers.ValidationError({key: "not a JSON value"})
        # Bounded, so the largest batch always fits the request size limit (settings.py).
        limit = settings.FLEETWATCH_INGEST_EXTRA_MAX_BYTES
        size = len(json.dumps(extra, default=str))
        if size > limit:
            biggest = max(extra, key=lambda k: len(json.dumps(extra[k], default=str)))
            raise serializers.ValidationError({biggest: (
                f"extra fields take {size} bytes as JSON, over the limit of {limit} "
                "(FLEETWATCH_INGEST_EXTRA_MAX_BYTES); this is the largest")})
        return {**extra, **validated}


class SignalBatchSerializer(serializers.Serializer):
    cluster = serializers.CharField(
        required=False, max_length=64,
        help_text="the cluster the signals come from (one of FLEETWATCH_CLUSTERS); "
                  "left out: FLEETWATCH_CLUSTER")
    signals = SignalInSerializer(many=True, allow_empty=False)

    def validate_cluster(self, value: str) -> str:
        known = cluster_names()
        if value not in known:
            raise serializers.ValidationError(
                f"unknown cluster {value!r}; this FleetWatch watches {', '.join(known)}")
        return value


class StoredSerializer(serializers.Serializer):
    stored = serializers.IntegerField(help_text="how many signals were stored")
    replayed = serializers.BooleanField(
        required=False, help_text="only on a retry under an Idempotency-Key already used for "
                                  "this batch: nothing new was stored, ``stored`` is the first "
                                  "push's")


# --- sources ------------------------------------------------------------------------------


class CollectorRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = CollectorRun
        fields = ["started_at", "finished_at", "duration_ms", "ok", "error", "counts",
                  "warnings"]


class AgentProtocolsSerializer(serializers.Serializer):
    oldest = serializers.IntegerField()
    newest = serializers.IntegerField()


class AgentInfoSerializer(serializers.Serializer):
    """What a node agent checks at start (``GET /api/v1/agent/``)."""

    version = serializers.CharField(help_text="the node agent built with this FleetWatch")
    protocols = AgentProtocolsSerializer(help_text="the push protocols FleetWatch takes")
    header = serializers.CharField(help_text="the request header naming an agent's protocol")


class SourceSerializer(serializers.Serializer):
    """A collector's health (from ``selectors.sources_overview``)."""

    name = serializers.CharField(source="source.name")
    cluster = serializers.CharField(source="source.cluster.name")
    healthy = serializers.BooleanField(source="source.healthy", allow_null=True)
    last_run_at = serializers.DateTimeField(source="source.last_run_at", allow_null=True)
    last_success_at = serializers.DateTimeField(source="source.last_success_at", allow_null=True)
    last_error = serializers.CharField(source="source.last_error")
    last_duration_ms = serializers.FloatField(source="source.last_duration_ms", allow_null=True)
    consecutive_failures = serializers.IntegerField(source="source.consecutive_failures")
    runs = serializers.IntegerField(source="source.runs", help_text="runs ever")
    lag_seconds = serializers.FloatField(source="lag", allow_null=True,
                                         help_text="seconds since the last successful run")
    recent_failed = serializers.IntegerField(source="failed_runs",
                                             help_text="failed runs among recent_runs")
    recent_runs = CollectorRunSerializer(source="runs", many=True)
