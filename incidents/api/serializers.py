from __future__ import annotations

import re

from rest_framework import serializers

from collectors.models import Gpu, Node
from incidents.models import Incident, Remediation, Step


class StepSerializer(serializers.ModelSerializer):
    duration_seconds = serializers.FloatField(read_only=True)

    class Meta:
        model = Step
        fields = ["order", "kind", "title", "status", "mode", "approved_by", "approved_at",
                  "attempts", "checks", "detail", "started_at", "finished_at",
                  "duration_seconds", "result", "error"]


class RemediationSerializer(serializers.ModelSerializer):
    steps = StepSerializer(many=True, read_only=True)

    class Meta:
        model = Remediation
        fields = ["id", "incident", "playbook", "mode", "status", "nodes", "hold_reason",
                  "requested_by", "approved_by", "approved_at", "blocked_reason", "created_at",
                  "started_at", "finished_at", "steps"]


class IncidentSerializer(serializers.ModelSerializer):
    remediations = RemediationSerializer(many=True, read_only=True)
    cluster = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Incident
        fields = ["id", "cluster", "root_cause", "confidence", "explanation", "playbook",
                  "status", "nodes", "jobs", "switch", "detected_at", "opened_at",
                  "resolved_at", "phases", "repaired_by", "remediations"]


class GpuSerializer(serializers.ModelSerializer):
    class Meta:
        model = Gpu
        fields = ["index", "uuid", "utilization", "temperature", "last_xid", "health"]


class NodeSerializer(serializers.ModelSerializer):
    gpus = GpuSerializer(many=True, read_only=True)
    cluster = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Node
        fields = ["id", "cluster", "name", "pool", "leaf_switch", "in_service", "health",
                  "slurm_state", "slurm_flags", "slurm_reason", "k8s_ready",
                  "k8s_unschedulable", "k8s_annotations", "nic_state", "updated_at", "gpus"]


class SignalInSerializer(serializers.Serializer):
    """One pushed signal, in the replay format (shared/REPLAY.md): ``at`` and ``source``,
    the source's fields, and any extra fields (kept as they are)."""

    SOURCES = ["kernel", "dcgm", "nic", "slurm", "kubernetes", "job_log", "collector"]
    at = serializers.DateTimeField()
    source = serializers.ChoiceField(choices=SOURCES)
    node = serializers.CharField(max_length=128, required=False, allow_blank=True)
    gpu = serializers.IntegerField(min_value=0, max_value=255, required=False, allow_null=True)
    job = serializers.CharField(max_length=32, required=False, allow_blank=True)
    message = serializers.CharField(max_length=4000, required=False, allow_blank=True)
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
        return {**extra, **validated}


class SignalBatchSerializer(serializers.Serializer):
    signals = SignalInSerializer(many=True, allow_empty=False)
