from __future__ import annotations

from rest_framework import serializers

from collectors.models import Gpu, Node
from incidents.models import Incident, Remediation, Step


class StepSerializer(serializers.ModelSerializer):
    duration_seconds = serializers.FloatField(read_only=True)

    class Meta:
        model = Step
        fields = ["order", "kind", "title", "status", "attempts", "checks", "detail",
                  "started_at", "finished_at", "duration_seconds", "result", "error"]


class RemediationSerializer(serializers.ModelSerializer):
    steps = StepSerializer(many=True, read_only=True)

    class Meta:
        model = Remediation
        fields = ["id", "playbook", "mode", "status", "requested_by", "approved_by",
                  "approved_at", "blocked_reason", "created_at", "started_at", "finished_at",
                  "steps"]


class IncidentSerializer(serializers.ModelSerializer):
    remediations = RemediationSerializer(many=True, read_only=True)
    cluster = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Incident
        fields = ["id", "cluster", "root_cause", "confidence", "explanation", "playbook",
                  "status", "nodes", "jobs", "switch", "detected_at", "opened_at",
                  "resolved_at", "phases", "remediations"]


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
