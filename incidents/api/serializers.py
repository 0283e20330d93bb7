"""What the incidents app's API reads and writes (the fleet's: collectors/api/serializers.py).
Output serializers are read-only views of the models (state changes go through the services,
never through ``save()``); the few input serializers validate a body before the view hands it
to a service."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from collectors.api.serializers import SignalSerializer
from collectors.models import Cluster
from incidents.models import (
    ApiToken,
    AuditEntry,
    Drill,
    Incident,
    Remediation,
    RootCause,
    Severity,
    Step,
)
from incidents.oncall import NOTE_KEY_MAX_CHARS, NOTE_MAX_CHARS
from incidents.tokens import SCOPES

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
    cluster: serializers.SlugRelatedField[Cluster] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    root_cause = serializers.ChoiceField(choices=RootCause.choices, read_only=True)
    owner: serializers.SlugRelatedField[AbstractBaseUser] = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True,
        help_text="the person on call who owns it, or null")
    severity = serializers.ChoiceField(choices=Severity.choices, read_only=True)
    drill = serializers.IntegerField(
        source="drill_id", read_only=True, allow_null=True,
        help_text="the fire drill whose synthetic fault opened it (/api/v1/drills/ID/); null "
                  "for a real fault")

    class Meta:
        model = Incident
        fields = ["id", "cluster", "root_cause", "confidence", "explanation", "playbook",
                  "status", "severity", "nodes", "jobs", "switch", "storm", "detected_at",
                  "opened_at", "resolved_at", "phases", "repaired_by", "acknowledged_by",
                  "acknowledged_at", "owner", "nodes_charted", "drill", "remediations"]


class AssignSerializer(serializers.Serializer):
    owner = serializers.CharField(allow_null=True, allow_blank=True, max_length=150,
                                  help_text="the username of an operator or admin; null or "
                                  "empty for nobody")

    def validate_owner(self, value: str | None) -> AbstractBaseUser | None:
        if not value:
            return None
        from incidents.selectors import oncall_people

        person: AbstractBaseUser | None = oncall_people().filter(username=value).first()
        if person is not None:
            return person
        raise serializers.ValidationError(
            f"no operator or admin named {value!r}: only they can own an incident")


class SeveritySerializer(serializers.Serializer):
    severity = serializers.ChoiceField(choices=Severity.choices)


class NoteSerializer(serializers.Serializer):
    text = serializers.CharField(max_length=NOTE_MAX_CHARS,
                                 help_text="what the note says (shown on the timeline)")
    key = serializers.CharField(max_length=NOTE_KEY_MAX_CHARS, required=False, default="",
                                allow_blank=True, write_only=True,
                                help_text="optional: a second note with the same key is "
                                "refused (409), so a retried call adds one note")


class NoteOutSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    at = serializers.DateTimeField()
    actor = serializers.CharField()
    text = serializers.CharField(source="result")


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
    type = serializers.ChoiceField(choices=["signal", "diagnosis", "step", "note", "audit"])
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


# --- policy ---------------------------------------------------------------------------------


class StepModesSerializer(serializers.Serializer):
    replace = serializers.CharField()
    reboot = serializers.CharField()
    reset_gpu = serializers.CharField()


class RootCausePolicySerializer(serializers.Serializer):
    value = serializers.CharField()
    # A field named like DRF's Field.label attribute (a string): the stubs see a clash.
    label = serializers.CharField()  # type: ignore[assignment]
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


class PolicyClusterSerializer(PolicyNowSerializer):
    name = serializers.CharField()
    fleet = serializers.CharField(help_text="sim or real")
    provider = serializers.CharField()
    provider_command = serializers.CharField(allow_blank=True, help_text="the program only")


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
    clusters = PolicyClusterSerializer(
        many=True, help_text="each cluster's sources and its rails' counts now (the rails "
                             "count per cluster)")
    # The default cluster's (FLEETWATCH_CLUSTER), as before there were several.
    now = PolicyNowSerializer(help_text="the default cluster's; see clusters")
    provider = serializers.CharField(help_text="the default cluster's; see clusters")
    provider_command = serializers.CharField(allow_blank=True,
                                             help_text="the default cluster's; see clusters")
    fleet = serializers.CharField(help_text="the default cluster's; see clusters")
    notifiers = NotifierSerializer(many=True)

    def to_representation(self, instance: dict[str, Any]) -> dict[str, Any]:
        # The page's notifier rows are (channel, target, detail) tuples.
        rows = [dict(zip(("channel", "target", "detail"), row, strict=True))
                for row in instance["notifiers"]]
        default = next(c for c in instance["clusters"]
                       if c["name"] == settings.FLEETWATCH_CLUSTER)
        return super().to_representation({
            **instance, "notifiers": rows, "now": default, "provider": default["provider"],
            "provider_command": default["provider_command"], "fleet": default["fleet"]})


# --- tokens ---------------------------------------------------------------------------------


class TokenSerializer(serializers.ModelSerializer):
    """A token as listed: never the key (it is not stored), never the digest."""

    user: serializers.SlugRelatedField[AbstractBaseUser] = serializers.SlugRelatedField(
        slug_field="username", read_only=True)
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


class JobWhySerializer(serializers.Serializer[Any]):
    """Why a job died: ``incidents.why.Why`` (the job's page and ``manage.py fleetwatch why``
    read the same answer)."""

    job = serializers.CharField(help_text="the Slurm job id")
    cluster = serializers.CharField()
    user = serializers.CharField(help_text="the job's owner in Slurm")
    state = serializers.CharField(help_text="Slurm's job state now")
    headline = serializers.CharField(help_text="the answer in one line")
    stopped_by = serializers.ChoiceField(["fault", "application", "nothing", "unknown"],
                                         help_text="a fault of the fleet, the job's own error, "
                                         "nothing (still fine), or unknown to FleetWatch")
    job_at_fault = serializers.BooleanField(help_text="the job's own code stopped it")
    fault = serializers.CharField(help_text="what broke, e.g. XID 79 (...) on gpu-003 GPU 5")
    root_cause = serializers.CharField()
    at = serializers.DateTimeField(allow_null=True, help_text="when the fault was first seen")
    node = serializers.CharField()
    gpu = serializers.IntegerField(allow_null=True)
    incident = serializers.IntegerField(allow_null=True)
    incident_url = serializers.CharField()
    action = serializers.CharField(help_text="what FleetWatch did to the job")
    requeued_at = serializers.DateTimeField(allow_null=True)
    resumed_from_step = serializers.IntegerField(allow_null=True)
    steps_lost = serializers.IntegerField(allow_null=True)
    downtime_seconds = serializers.FloatField(allow_null=True)
    evidence = serializers.ListField(child=serializers.CharField())
    restarts = serializers.IntegerField()
    submitted_at = serializers.DateTimeField(allow_null=True,
                                             help_text="first submitted (kept across requeues)")
    first_started_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True, help_text="the latest start")
    slurm_comment = serializers.CharField(help_text="FleetWatch's words in the job, as Slurm "
                                          "reports them")
    link = serializers.CharField(help_text="the job's page (with FLEETWATCH_BASE_URL)")


# --- fire drills (incidents.drills) -------------------------------------------------------------


class DrillEventSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    type = serializers.CharField(help_text="drill (the drill's own), incident, step, would "
                                           "(a call recorded, not made) or call (made)")
    title = serializers.CharField()
    detail = serializers.CharField(allow_blank=True)


class DrillSerializer(serializers.ModelSerializer):
    """A fire drill: its result (and why), its canary, each phase's seconds (as far as it got,
    while it runs), its incident and remediation."""

    cluster: serializers.SlugRelatedField[Cluster] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    duration_seconds = serializers.FloatField(read_only=True, allow_null=True)
    signal = serializers.IntegerField(source="signal_id", read_only=True, allow_null=True,
                                      help_text="the synthetic fault as stored")
    incident = serializers.SerializerMethodField(help_text="its incident, once one opened")
    phases = serializers.SerializerMethodField(
        help_text="seconds per phase: inject, detect, decide, first_action, drain, requeue, "
                  "replace, resume, cleanup, total (those it reached)")

    class Meta:
        model = Drill
        fields = ["id", "cluster", "status", "reason", "mode", "trigger", "requested_by", "node",
                  "budget_seconds", "over_budget", "started_at", "deadline", "finished_at",
                  "duration_seconds", "signal", "incident", "phases", "alerted_at"]

    def get_incident(self, drill: Drill) -> int | None:
        incident = next(iter(drill.incidents.all()), None)
        return incident.pk if incident is not None else None

    def get_phases(self, drill: Drill) -> dict[str, float]:
        live: dict[str, float] | None = self.context.get("phases")
        return dict(live if live is not None else drill.phases or {})


class DrillReportSerializer(DrillSerializer):
    """A drill with its whole report: its remediation's steps and its timeline."""

    remediation = serializers.SerializerMethodField()
    timeline = serializers.SerializerMethodField()

    class Meta(DrillSerializer.Meta):
        fields = [*DrillSerializer.Meta.fields, "remediation", "timeline"]

    @extend_schema_field(RemediationSerializer(allow_null=True))
    def get_remediation(self, drill: Drill) -> dict[str, Any] | None:
        rem = self.context.get("remediation")
        return dict(RemediationSerializer(rem).data) if rem is not None else None

    @extend_schema_field(DrillEventSerializer(many=True))
    def get_timeline(self, drill: Drill) -> list[Any]:
        return list(DrillEventSerializer(self.context.get("timeline", []), many=True).data)


class DrillConflictSerializer(serializers.Serializer):
    """409 from starting a drill: one runs already (``drill`` is its id); none was started."""

    detail = serializers.CharField()
    status = serializers.CharField()
    drill = serializers.IntegerField()
