"""What the API reads and writes. Output serializers are read-only views of the models (state
changes go through the services, never through ``save()``); the few input serializers
validate a body before the view hands it to a service."""

from __future__ import annotations

import json
import re
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from rest_framework import serializers

from collectors.models import Cluster, CollectorRun, Gpu, Job, Node, Signal
from incidents.models import ApiToken, AuditEntry, Incident, Remediation, RootCause, Step
from incidents.tokens import SCOPES

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
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Gpu
        fields = ["id", "node", "index", "uuid", "utilization", "temperature", "last_xid",
                  "last_xid_at", "health", "updated_at"]


class NodeSerializer(serializers.ModelSerializer):
    gpus = GpuSerializer(many=True, read_only=True)
    cluster = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Node
        fields = ["id", "cluster", "name", "pool", "leaf_switch", "in_service", "health",
                  "slurm_state", "slurm_flags", "slurm_reason", "k8s_ready",
                  "k8s_unschedulable", "k8s_annotations", "nic_state", "updated_at", "gpus"]


class JobSerializer(serializers.ModelSerializer):
    cluster = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Job
        fields = ["id", "cluster", "slurm_id", "name", "user", "state", "nodes",
                  "restart_count", "step", "checkpoint_step", "resumed_from_step", "started_at",
                  "updated_at"]


class SignalSerializer(serializers.ModelSerializer):
    cluster = serializers.SlugRelatedField(slug_field="name", read_only=True)
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

    SOURCES = ["kernel", "dcgm", "nic", "slurm", "kubernetes", "job_log", "collector"]
    at = serializers.DateTimeField(help_text="RFC 3339 with an offset: 2026-12-03T10:00:00Z")
    source = serializers.ChoiceField(choices=SOURCES)
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
    signals = SignalInSerializer(many=True, allow_empty=False)


class StoredSerializer(serializers.Serializer):
    stored = serializers.IntegerField(help_text="how many signals were stored")
    replayed = serializers.BooleanField(
        required=False, help_text="only on a retry under an Idempotency-Key already used for "
                                  "this batch: nothing new was stored, ``stored`` is the first "
                                  "push's")


# --- incidents and their repair -------------------------------------------------------------


class StepSerializer(serializers.ModelSerializer):
    duration_seconds = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = Step
        fields = ["id", "remediation", "order", "kind", "title", "status", "mode",
                  "approved_by", "approved_at", "attempts", "checks", "detail", "started_at",
                  "finished_at", "duration_seconds", "result", "error"]


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
    root_cause = serializers.ChoiceField(choices=RootCause.choices, read_only=True)

    class Meta:
        model = Incident
        fields = ["id", "cluster", "root_cause", "confidence", "explanation", "playbook",
                  "status", "nodes", "jobs", "switch", "detected_at", "opened_at",
                  "resolved_at", "phases", "repaired_by", "acknowledged_by", "acknowledged_at",
                  "remediations"]


class ResolveSerializer(serializers.Serializer):
    note = serializers.CharField(max_length=500, required=False, allow_blank=True, default="",
                                 help_text="why it is over: fixed by hand, not a fault, ...")


class AuditEntrySerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditEntry
        fields = ["id", "at", "actor", "request_id", "verb", "target", "call", "ok", "result",
                  "duration_ms", "data", "incident", "remediation", "step", "prev_hash", "hash"]


class TimelineItemSerializer(serializers.Serializer):
    """One moment of an incident's story; which of signal, step and audit is set follows
    ``type``."""

    at = serializers.DateTimeField()
    type = serializers.ChoiceField(choices=["signal", "diagnosis", "step", "audit"])
    title = serializers.CharField()
    text = serializers.CharField(required=False, allow_null=True)
    signal = SignalSerializer(required=False, allow_null=True)
    step = StepSerializer(required=False, allow_null=True)
    audit = AuditEntrySerializer(source="entry", required=False, allow_null=True)


class AuditVerifySerializer(serializers.Serializer):
    ok = serializers.BooleanField()
    checked = serializers.IntegerField(help_text="entries whose hash and link were checked")
    first_bad = serializers.IntegerField(allow_null=True,
                                         help_text="id of the first entry that fails")
    detail = serializers.CharField(help_text="the result in words")
    reason = serializers.CharField(allow_blank=True)
    unchained = serializers.IntegerField(help_text="entries from before the hash chain")
    head = serializers.CharField(allow_blank=True,
                                 help_text="the last good hash: keep it elsewhere to detect a "
                                           "cut-off tail")


# --- sources and policy ---------------------------------------------------------------------


class CollectorRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = CollectorRun
        fields = ["started_at", "finished_at", "duration_ms", "ok", "error", "counts",
                  "warnings"]


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


class StepModesSerializer(serializers.Serializer):
    replace = serializers.CharField()
    reboot = serializers.CharField()
    reset_gpu = serializers.CharField()


class RootCausePolicySerializer(serializers.Serializer):
    value = serializers.CharField()
    label = serializers.CharField()
    playbook = serializers.CharField(allow_null=True)
    mode = serializers.CharField(help_text="auto, approve or observe")
    step_modes = StepModesSerializer(help_text="the mode of each risky step class")


class PlaybookStepSerializer(serializers.Serializer):
    kind = serializers.CharField()
    title = serializers.CharField()
    risk = serializers.CharField(allow_blank=True)


class PlaybookSerializer(serializers.Serializer):
    name = serializers.CharField(source="playbook.name")
    description = serializers.CharField(source="playbook.description")
    root_causes = serializers.ListField(child=serializers.CharField())
    escalation = serializers.BooleanField(help_text="run only as an escalation of another")
    touches_nodes = serializers.BooleanField(source="playbook.touches_nodes")
    budgeted = serializers.BooleanField(source="playbook.budgeted")
    steps = PlaybookStepSerializer(source="playbook.steps", many=True)


class BudgetsSerializer(serializers.Serializer):
    max_nodes = serializers.IntegerField()
    max_percent = serializers.FloatField()
    storm_incidents = serializers.IntegerField()
    storm_minutes = serializers.IntegerField()
    cooldown_minutes = serializers.IntegerField()
    rma_after = serializers.IntegerField()
    flaps_before_replace = serializers.IntegerField()
    recovery_stable_minutes = serializers.FloatField()
    node_back_minutes = serializers.FloatField()
    step_timeout_seconds = serializers.IntegerField()
    step_max_attempts = serializers.IntegerField()


class PolicyNowSerializer(serializers.Serializer):
    storm = serializers.IntegerField(help_text="incidents in the storm window now")
    busy_nodes = serializers.ListField(child=serializers.CharField(),
                                       help_text="nodes in a remediation now")


class NotifierSerializer(serializers.Serializer):
    channel = serializers.CharField()
    target = serializers.CharField(allow_blank=True, help_text="redacted; empty when off")
    detail = serializers.CharField(allow_blank=True)


class PolicySerializer(serializers.Serializer):
    default_mode = serializers.CharField()
    root_causes = RootCausePolicySerializer(many=True)
    risks = serializers.ListField(child=serializers.CharField())
    playbooks = PlaybookSerializer(many=True)
    budgets = BudgetsSerializer()
    now = PolicyNowSerializer()
    provider = serializers.CharField()
    provider_command = serializers.CharField(allow_blank=True)
    fleet = serializers.CharField()
    notifiers = NotifierSerializer(many=True)

    def to_representation(self, instance: dict[str, Any]) -> dict[str, Any]:
        # The page's notifier rows are (channel, target, detail) tuples.
        rows = [dict(zip(("channel", "target", "detail"), row, strict=True))
                for row in instance["notifiers"]]
        return super().to_representation({**instance, "notifiers": rows})


# --- tokens ---------------------------------------------------------------------------------


class TokenSerializer(serializers.ModelSerializer):
    """A token as listed: never the key (it is not stored), never the digest."""

    user = serializers.SlugRelatedField(slug_field="username", read_only=True)
    state = serializers.ChoiceField(choices=["active", "expired", "revoked"], read_only=True)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=SCOPES), read_only=True)

    class Meta:
        model = ApiToken
        fields = ["name", "user", "scopes", "state", "created", "expiry", "created_by",
                  "last_used_at", "revoked_at", "revoked_by"]


class TokenCreateSerializer(serializers.Serializer):
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", max_length=64,
                                  help_text="unique; names the token in the audit and in its "
                                            "URL: letters, digits, '.', '_' and '-'")
    user = serializers.SlugRelatedField(slug_field="username",
                                        queryset=get_user_model().objects.all(),
                                        help_text="whose role the token carries")
    scopes = serializers.MultipleChoiceField(choices=SCOPES, allow_empty=False)
    days = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=3650,
                                  help_text="lifetime; 0 never expires; absent: the default")

    def validate_name(self, value: str) -> str:
        if ApiToken.objects.filter(name=value).exists():
            raise serializers.ValidationError(
                "a token with this name exists (names stay taken after revoking)")
        return value


class TokenCreatedSerializer(TokenSerializer):
    key = serializers.CharField(help_text="the key: shown this once, never stored")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "key"]
