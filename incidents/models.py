"""Incidents, their evidence, the remediations run for them, and the audit trail."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone
from knox.models import AbstractAuthToken

from collectors.knowledge import causes
from collectors.models import Cluster, Signal

# The root causes an incident can have, derived from collectors.knowledge (values and labels
# are the migration's: adding a cause there is a migration here).
RootCause = models.TextChoices(  # type: ignore[call-overload]  # stubs lack the (value, label) form
    "RootCause", [(name, (value, label)) for name, value, label in causes.choices()])
# Severities, likewise (collectors.knowledge.causes.Severity).
Severity = models.TextChoices(  # type: ignore[call-overload]  # as RootCause
    "Severity", [(name, (value, label)) for name, value, label in causes.severity_choices()])


class IncidentQuerySet(models.QuerySet["Incident"]):
    def real(self) -> IncidentQuerySet:
        """Incidents of real faults: fire drills' left out."""
        return self.filter(drill__isnull=True)


class Incident(models.Model):
    class Status(models.TextChoices):
        OPEN = "open", "open"
        REMEDIATING = "remediating", "remediating"
        NEEDS_ATTENTION = "needs_attention", "needs attention"
        RESOLVED = "resolved", "resolved"

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="incidents")
    root_cause = models.CharField(max_length=32, choices=RootCause.choices)
    confidence = models.FloatField()
    explanation = models.TextField()
    playbook = models.CharField(max_length=64, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.OPEN)
    # What the diagnosis blames, for dedupe: "gpu_hardware:gpu-007".
    fingerprint = models.CharField(max_length=256, db_index=True)
    nodes = models.JSONField(default=list, blank=True)
    jobs = models.JSONField(default=list, blank=True)
    switch = models.CharField(max_length=64, blank=True)
    storm = models.BooleanField(
        default=False, help_text="groups the faults of one root cause that came as one event "
        "(a rack, a driver rollout, a power feed): its nodes are the storm's, past the storm "
        "brake; no remediation runs from it")
    detected_at = models.DateTimeField(help_text="when the first signal behind it was observed")
    opened_at = models.DateTimeField(default=timezone.now)
    resolved_at = models.DateTimeField(null=True, blank=True)
    phases = models.JSONField(default=dict, blank=True, help_text="phase -> seconds")
    # Who repaired it, for mean time to repair kept apart: "automation" (no person acted),
    # "person" (someone approved, continued or resolved it), "" while open.
    repaired_by = models.CharField(max_length=16, blank=True)
    # Someone said "I have it": the page stops asking for attention (an actor string).
    acknowledged_by = models.CharField(max_length=150, blank=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    # The person on call who owns it now (incidents.oncall changes it, audited).
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True,
                              blank=True, related_name="incidents_owned")
    severity = models.CharField(max_length=8, choices=Severity.choices,
                                default=causes.Severity.SEV3.value,
                                help_text="from the root cause when opened; an operator may "
                                "change it")
    # The nodes its chart draws, kept as they were when it opened (the blamed nodes and the
    # other nodes of its jobs): jobs end and move, and the chart must still show who was hit.
    nodes_charted = models.JSONField(default=list, blank=True)
    signals = models.ManyToManyField(Signal, through="Evidence", related_name="incidents")
    # Set: a fire drill's incident, opened by its synthetic fault (incidents.drills). Shown as
    # a drill everywhere; no real-incident figure, safety budget or page counts it.
    drill = models.ForeignKey("Drill", on_delete=models.PROTECT, null=True, blank=True,
                              related_name="incidents")

    objects = IncidentQuerySet.as_manager()

    class Meta:
        ordering = ["-opened_at"]
        permissions = [("operate", "Can start, approve and cancel remediations")]
        constraints = [
            # The same fault seen by two diagnosis runs at once is still one incident.
            models.UniqueConstraint(
                fields=["cluster", "fingerprint"], condition=~Q(status="resolved"),
                name="incident_one_open_per_fingerprint",
            )
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.root_cause} {', '.join(self.nodes) or self.switch}"


class Evidence(models.Model):
    incident = models.ForeignKey(Incident, on_delete=models.CASCADE, related_name="evidence")
    signal = models.ForeignKey(Signal, on_delete=models.CASCADE, related_name="evidence")
    role = models.CharField(max_length=16, default="cause", help_text="cause or symptom")
    added_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["incident", "signal"], name="evidence_unique")
        ]


class DiagnosisState(models.Model):
    """Per cluster, whether diagnosis is due and whether a run is queued or running.

    Pushes and collector runs mark it in the transaction that stores their signals, so no
    stored signal can go unnoticed; a burst of pushes marks one row instead of queueing one
    task per batch. A run claims what was marked (``pending_since`` moves to ``running_from``),
    diagnoses the window from there, then clears its claim. See diagnosing.diagnosis_run.
    """

    cluster = models.OneToOneField(Cluster, on_delete=models.CASCADE,
                                   related_name="diagnosis_state")
    # The earliest observation time among stored signals no run has claimed yet (None: none).
    pending_since = models.DateTimeField(null=True, blank=True)
    # A task was sent and has not started: announcements send no other (None: none queued).
    queued_at = models.DateTimeField(null=True, blank=True)
    # The run in progress: when it started (a lease; a killed worker's run expires) and the
    # earliest observation time it claimed, given back to pending if it fails or dies.
    running_since = models.DateTimeField(null=True, blank=True)
    running_from = models.DateTimeField(null=True, blank=True)
    runs = models.PositiveBigIntegerField(default=0, help_text="diagnosis runs finished")
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_run_ms = models.FloatField(null=True, blank=True)

    def __str__(self) -> str:
        return f"diagnosis of {self.cluster_id}: pending since {self.pending_since}"


class Remediation(models.Model):
    class Mode(models.TextChoices):
        AUTO = "auto", "auto"
        APPROVE = "approve", "approve first"
        OBSERVE = "observe", "observe only"

    class Status(models.TextChoices):
        AWAITING_APPROVAL = "awaiting_approval", "awaiting approval"
        RUNNING = "running", "running"
        BLOCKED = "blocked", "waiting for a person"
        SUCCEEDED = "succeeded", "succeeded"
        OBSERVED = "observed", "observed (no action taken)"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"

    ACTIVE = (Status.AWAITING_APPROVAL, Status.RUNNING, Status.BLOCKED)

    incident = models.ForeignKey(Incident, on_delete=models.CASCADE, related_name="remediations")
    playbook = models.CharField(max_length=64)
    mode = models.CharField(max_length=16, choices=Mode.choices)
    status = models.CharField(max_length=20, choices=Status.choices)
    requested_by = models.CharField(max_length=150, help_text="system, or a user's name")
    requested_by_user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                          null=True, blank=True, related_name="+")
    approved_by = models.CharField(max_length=150, blank=True)
    approved_at = models.DateTimeField(null=True, blank=True)
    blocked_reason = models.TextField(blank=True)
    # The nodes it acts on (one remediation per node at a time; budgets count these).
    nodes = models.JSONField(default=list, blank=True)
    # Why it waits for a person although its mode is auto: the fleet budget, the storm
    # brake, a cooldown. Empty when it simply runs in approve mode.
    hold_reason = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # One live remediation per incident: a second click finds the first.
            models.UniqueConstraint(
                fields=["incident"], condition=Q(status__in=["awaiting_approval", "running",
                                                             "blocked"]),
                name="remediation_one_active_per_incident",
            )
        ]

    def __str__(self) -> str:
        return f"remediation {self.pk} ({self.playbook}, {self.status})"

    @property
    def is_active(self) -> bool:
        return self.status in self.ACTIVE


class Step(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        RUNNING = "running", "running"
        WAITING = "waiting", "waiting"
        BLOCKED = "blocked", "waiting for a person"
        AWAITING_APPROVAL = "awaiting_approval", "awaiting approval"
        SUCCEEDED = "succeeded", "succeeded"
        SKIPPED = "skipped", "skipped"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"

    DONE = (Status.SUCCEEDED, Status.SKIPPED, Status.FAILED, Status.CANCELLED)

    remediation = models.ForeignKey(Remediation, on_delete=models.CASCADE, related_name="steps")
    order = models.PositiveSmallIntegerField()
    kind = models.CharField(max_length=48)
    title = models.CharField(max_length=200)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    # Risky steps (replace, reboot, reset) carry their own mode: an auto playbook can still
    # ask a person before it replaces a node, or only record that it would have.
    mode = models.CharField(max_length=16, choices=Remediation.Mode.choices,
                            default=Remediation.Mode.AUTO)
    approved_by = models.CharField(max_length=150, blank=True)
    approved_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    checks = models.PositiveIntegerField(default=0, help_text="polls while waiting")
    detail = models.TextField(blank=True, help_text="what the step is doing or waiting for")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)
    # Held while an executor runs outside any transaction, so a duplicate delivery of the
    # same step backs off instead of making the outside calls a second time.
    lease_until = models.DateTimeField(null=True, blank=True)
    # When the step is due to run or be re-checked (set when it is queued). The watchdog
    # queues again a step whose time has long passed with nobody holding its lease: its
    # message was lost with a killed worker or a restarted broker.
    next_check_at = models.DateTimeField(null=True, blank=True, db_index=True)
    # The outside calls this step has completed ("verb target"), saved as each one returns:
    # a step run again after its worker died mid-way does not make them a second time.
    done_calls = models.JSONField(default=list, blank=True)
    result: Any = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["remediation", "order"]
        constraints = [
            models.UniqueConstraint(fields=["remediation", "order"], name="step_unique_order")
        ]

    def __str__(self) -> str:
        return f"step {self.order} {self.kind} ({self.status})"

    @property
    def duration_seconds(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.finished_at or timezone.now()
        return (end - self.started_at).total_seconds()


class GateRun(models.Model):
    """One run of the return-to-service gate on a node: the acceptance checks it ran, their
    verdict and output (incidents/remediation/gate.py). A playbook's gate step records its
    runs here; other code starts one on its own (incidents.gates.node_gate_start) and this row
    is then its working state too."""

    class Status(models.TextChoices):
        AWAITING_APPROVAL = "awaiting_approval", "awaiting approval"
        RUNNING = "running", "running"
        PASSED = "passed", "passed: in service"
        FAILED = "failed", "failed: held"
        CANNOT_RUN = "cannot_run", "could not run: held"
        UNCHECKED = "unchecked", "no check configured"
        OBSERVED = "observed", "observed (no action taken)"
        CANCELLED = "cancelled", "cancelled"

    FINAL = (Status.PASSED, Status.FAILED, Status.CANNOT_RUN, Status.UNCHECKED, Status.OBSERVED,
             Status.CANCELLED)

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="gate_runs")
    node = models.CharField(max_length=128, db_index=True)
    # Names its reservation (fleetwatch-gate-KEY) and its check jobs: unique per run.
    key = models.CharField(max_length=64, unique=True)
    repair = models.CharField(max_length=16, help_text="what was done to the node before")
    reason = models.TextField(blank=True, help_text="why it was asked for")
    requested_by = models.CharField(max_length=150, default="system")
    mode = models.CharField(max_length=16, choices=Remediation.Mode.choices,
                            default=Remediation.Mode.AUTO)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.RUNNING)
    checks = models.JSONField(default=list, blank=True, help_text="the checks it runs")
    detail = models.TextField(blank=True, help_text="what it is doing, or its verdict")
    # The gate's own state (reservation, check jobs, each check's result and output).
    state: Any = models.JSONField(default=dict, blank=True)
    # The outside calls it completed (a run after a crash does not make them again).
    done_calls = models.JSONField(default=list, blank=True)
    remediation = models.ForeignKey(Remediation, on_delete=models.SET_NULL, null=True,
                                    blank=True, related_name="gate_runs")
    step = models.ForeignKey(Step, on_delete=models.SET_NULL, null=True, blank=True,
                             related_name="gate_runs")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    next_check_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"gate {self.key} on {self.node} ({self.status})"

    @property
    def results(self) -> list[dict[str, Any]]:
        found = (self.state or {}).get("results") or []
        return [r for r in found if isinstance(r, dict)]


class AppendOnlyError(Exception):
    pass


class AuditQuerySet(models.QuerySet["AuditEntry"]):
    def update(self, **kwargs: Any) -> int:
        raise AppendOnlyError("the audit trail is append-only")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise AppendOnlyError("the audit trail is append-only")


class AuditEntry(models.Model):
    """One state change or outside call. Rows are never updated or deleted (the ORM refuses,
    and on PostgreSQL a trigger does too), and each carries the hash of the one before it, so
    ``manage.py fleetwatch audit verify`` finds a row changed or removed behind our back."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=150, help_text="system, user:NAME or token:NAME")
    request_id = models.CharField(max_length=64, blank=True,
                                  help_text="the web request or Celery task that acted")
    verb = models.CharField(max_length=64)
    target = models.CharField(max_length=200)
    call = models.TextField(blank=True, help_text="the outside call made, if any")
    ok = models.BooleanField(default=True)
    result = models.TextField(blank=True)
    duration_ms = models.FloatField(null=True, blank=True, help_text="of the outside call")
    data = models.JSONField(default=dict, blank=True)
    prev_hash = models.CharField(max_length=64, blank=True)
    hash = models.CharField(max_length=64, blank=True, db_index=True)
    incident = models.ForeignKey(Incident, on_delete=models.PROTECT, null=True, blank=True,
                                 related_name="audit")
    remediation = models.ForeignKey(Remediation, on_delete=models.PROTECT, null=True,
                                    blank=True, related_name="audit")
    step = models.ForeignKey(Step, on_delete=models.PROTECT, null=True, blank=True,
                             related_name="audit")

    objects = AuditQuerySet.as_manager()

    class Meta:
        ordering = ["at", "id"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%H:%M:%S} {self.actor} {self.verb} {self.target}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise AppendOnlyError("the audit trail is append-only")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AppendOnlyError("the audit trail is append-only")


class ApiToken(AbstractAuthToken):
    """An API token for a program: stored as a hash (django-rest-knox keeps only a digest and
    the first characters to look it up), with scopes, an expiry and revocation. What a call may
    do is its owner's role *and* the token's scopes; a node agent's token belongs to the
    ``agent:<node>`` user and may only push signals for that node."""

    class Scope(models.TextChoices):
        READ = "read", "read"
        OPERATE = "operate", "operate"
        INGEST = "ingest", "ingest"

    # Unique so that "token:NAME" in the audit trail and the logs names one token.
    name = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_by = models.CharField(max_length=150, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.CharField(max_length=150, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"token {self.name} ({self.user})"

    @property
    def expired(self) -> bool:
        return self.expiry is not None and self.expiry <= timezone.now()

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if self.expired else "active"


class WebhookSubscription(models.Model):
    """Somebody's URL that wants to hear about incidents. Payloads are signed with HMAC-SHA256
    over "timestamp.body" with ``secret`` (kept in clear: signing needs it; never shown after
    creation and never logged)."""

    class Event(models.TextChoices):
        INCIDENT_OPENED = "incident.opened", "incident opened"
        INCIDENT_UPDATED = "incident.updated", "incident updated"
        APPROVAL_WAITING = "remediation.awaiting_approval", "remediation waiting for approval"
        INCIDENT_RESOLVED = "incident.resolved", "incident resolved"
        # Not about an incident: sent only to subscriptions that list it (see webhooks.OPT_IN).
        AUDIT_CHECKPOINT = "audit.checkpoint", "audit trail checkpoint (only where listed)"

    name = models.CharField(max_length=64, unique=True)
    url = models.URLField(max_length=500)
    secret = models.CharField(max_length=128)
    events = models.JSONField(default=list, help_text="Event values; empty means all")
    active = models.BooleanField(default=True)
    created_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"webhook {self.name}"


class Delivery(models.Model):
    """One message sent (or being sent), with every attempt's outcome: an event to a webhook
    subscription, or a remediation step's notification to an on-call channel. One model and
    one retry mechanism for both (incidents.deliveries)."""

    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        DELIVERED = "delivered", "delivered"
        FAILED = "failed", "failed"

    class Channel(models.TextChoices):
        SUBSCRIPTION = "subscription", "webhook subscription"
        # A step's notification, through collectors.clients.notify's channels.
        WEBHOOK = "webhook", "notification webhook"
        SLACK = "slack", "Slack-compatible webhook"
        EMAIL = "email", "e-mail"

    channel = models.CharField(max_length=16, choices=Channel.choices,
                               default=Channel.SUBSCRIPTION)
    subscription = models.ForeignKey(WebhookSubscription, on_delete=models.CASCADE,
                                     null=True, blank=True, related_name="deliveries")
    target = models.CharField(max_length=300, blank=True,
                              help_text="URL or addresses, never a secret")
    event = models.CharField(max_length=64, blank=True)
    event_id = models.CharField(max_length=64, blank=True,
                                help_text="the same on every retry (notifications: their key)")
    subject = models.CharField(max_length=300, blank=True)
    # No database constraint: a notification may name an incident that is gone (or, in a
    # test, never was); deleting an incident still empties the field (SET_NULL, in Django).
    incident = models.ForeignKey(Incident, on_delete=models.SET_NULL, null=True, blank=True,
                                 db_constraint=False, related_name="deliveries")
    payload = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    response_code = models.IntegerField(null=True, blank=True)
    response = models.TextField(blank=True, help_text="an excerpt of the answer, or the error")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "deliveries"

    def __str__(self) -> str:
        to = self.subscription_id if self.channel == self.Channel.SUBSCRIPTION else self.target
        return f"{self.event} to {self.channel} {to}: {self.status}"


class Drill(models.Model):
    """A fire drill: FleetWatch proving its own repair loop on a canary node with no user job
    (incidents.drills). A synthetic fault goes in through FleetWatch's own pipeline, and the
    drill follows it: incident opened, remediation planned, its steps run in observe mode (or
    on the canary for real), each phase timed, then everything put back."""

    class Status(models.TextChoices):
        RUNNING = "running", "running"
        PASSED = "passed", "passed"
        FAILED = "failed", "failed"
        SKIPPED = "skipped", "skipped"

    class Mode(models.TextChoices):
        OBSERVE = "observe", "observe (would call, nothing changed)"
        CANARY = "canary", "canary (for real on the canary)"

    class Trigger(models.TextChoices):
        SCHEDULE = "schedule", "schedule"
        MANUAL = "manual", "by hand"

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="drills")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    reason = models.TextField(blank=True, help_text="why it failed or was skipped")
    mode = models.CharField(max_length=16, choices=Mode.choices)
    trigger = models.CharField(max_length=16, choices=Trigger.choices)
    requested_by = models.CharField(max_length=150, help_text="system, user:NAME or token:NAME")
    node = models.CharField(max_length=128, blank=True, help_text="the canary, once chosen")
    budget_seconds = models.FloatField()
    over_budget = models.BooleanField(default=False)
    started_at = models.DateTimeField(default=timezone.now, db_index=True)
    deadline = models.DateTimeField(help_text="started_at + budget: not done by then, it fails")
    finished_at = models.DateTimeField(null=True, blank=True)
    # The synthetic fault as stored (a kernel XID 79 line on the canary), and the secret that
    # marks it as this drill's (a pushed signal cannot claim to be one).
    signal = models.ForeignKey(Signal, on_delete=models.SET_NULL, null=True, blank=True,
                               related_name="+")
    nonce = models.CharField(max_length=32)
    phases = models.JSONField(default=dict, blank=True, help_text="phase -> seconds")
    # What the drill itself did and saw, in order: {"at", "what", "detail"} (the incident's
    # own story is read from its records).
    events = models.JSONField(default=list, blank=True)
    # Canary mode: the canary's Slurm and Kubernetes state before the drill, to put it back.
    canary_before = models.JSONField(default=dict, blank=True)
    alerted_at = models.DateTimeField(null=True, blank=True,
                                      help_text="when the failure alert was sent")
    # When a follow-up last looked at it: the watchdog starts a new one only when the chain
    # of follow-ups died (a killed worker), not one more beside a live chain.
    checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            # One drill at a time, fleet-wide: a second press finds the first.
            models.UniqueConstraint(fields=["status"], condition=Q(status="running"),
                                    name="drill_one_running"),
        ]

    def __str__(self) -> str:
        return f"drill {self.pk} ({self.status}{', ' + self.node if self.node else ''})"

    @property
    def duration_seconds(self) -> float | None:
        end = self.finished_at or (timezone.now() if self.status == self.Status.RUNNING
                                   else None)
        return None if end is None else round((end - self.started_at).total_seconds(), 3)
class Loan(models.Model):
    """A node lent from Slurm training to Kubernetes inference, and its way back
    (incidents/lending). One row carries both directions: the lend's steps, then the
    return's. Its outside calls are audited (``data.loan`` names the loan) and recorded in
    ``done_calls`` as each returns, so a run after a worker's death makes none twice."""

    class Status(models.TextChoices):
        PROPOSED = "proposed", "waiting for approval to lend"
        LENDING = "lending", "lending"
        LENT = "lent", "lent to inference"
        RETURN_PROPOSED = "return_proposed", "waiting for approval to return"
        RETURNING = "returning", "returning to training"
        RETURNED = "returned", "returned to training"
        FAILED = "failed", "stopped: needs a person"
        CANCELLED = "cancelled", "cancelled"

    # A node has at most one loan in these.
    LIVE = (Status.PROPOSED, Status.LENDING, Status.LENT, Status.RETURN_PROPOSED,
            Status.RETURNING, Status.FAILED)
    # A worker runs its steps.
    RUNNING = (Status.LENDING, Status.RETURNING)

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="loans")
    node = models.CharField(max_length=128, help_text="the machine's (Kubernetes) name")
    pool = models.CharField(max_length=64, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices)
    step = models.CharField(max_length=32, blank=True, help_text="the step under way")
    mode = models.CharField(max_length=16, choices=Remediation.Mode.choices,
                            default=Remediation.Mode.AUTO)
    automatic = models.BooleanField(default=False, help_text="lent by the demand policy")
    requested_by = models.CharField(max_length=150)
    reason = models.TextField(blank=True, help_text="why it was lent")
    approved_by = models.CharField(max_length=150, blank=True)
    hold_reason = models.TextField(blank=True, help_text="why an automatic lend waits for a "
                                   "person")
    return_requested_by = models.CharField(max_length=150, blank=True)
    return_reason = models.TextField(blank=True)
    return_automatic = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    lent_at = models.DateTimeField(null=True, blank=True)
    return_requested_at = models.DateTimeField(null=True, blank=True)
    returned_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Past this, a lend still waiting for the node's jobs to end is given up (the node goes
    # back to Slurm): FLEETWATCH_LEND_DRAIN_DEADLINE_MINUTES from its start.
    deadline = models.DateTimeField(null=True, blank=True)
    detail = models.TextField(blank=True, help_text="what it is doing or waiting for")
    error = models.TextField(blank=True)
    # What the steps found and did (the node as it was before the lend, the slurmd pod,
    # evictions waiting on a budget), read by the later steps and the return.
    state: Any = models.JSONField(default=dict, blank=True)
    done_calls = models.JSONField(default=list, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    # Held while a worker runs its steps outside any transaction (see Step.lease_until).
    lease_until = models.DateTimeField(null=True, blank=True)
    next_check_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "node"],
                condition=Q(status__in=["proposed", "lending", "lent", "return_proposed",
                                        "returning", "failed"]),
                name="loan_one_live_per_node"),
        ]
        indexes = [models.Index(fields=["cluster", "status"], name="loan_cluster_status")]

    def __str__(self) -> str:
        return f"loan {self.pk} of {self.node} ({self.status})"

    @property
    def is_live(self) -> bool:
        return self.status in self.LIVE

    @property
    def direction(self) -> str:
        """"lend" or "return": which half of the loan its steps are in."""
        return "return" if self.step.startswith("return") or self.status in (
            self.Status.RETURN_PROPOSED, self.Status.RETURNING, self.Status.RETURNED) \
            else "lend"


class CapacitySnapshot(models.Model):
    """A pool's GPUs by use at one moment (incidents/lending, every
    FLEETWATCH_CAPACITY_SNAPSHOT_SECONDS): what the capacity chart draws. ``counts`` holds
    GPUs per use (training_allocated, training_idle, training_drained, inference_allocated,
    inference_idle, repairing, rma), nodes lent and in transit, and the cluster's pending
    Slurm demand (pending_jobs, pending_gpus, pending_wait_seconds)."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="+")
    pool = models.CharField(max_length=64, blank=True)
    at = models.DateTimeField(default=timezone.now)
    counts = models.JSONField(default=dict)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["cluster", "at"], name="capacity_cluster_at")]

    def __str__(self) -> str:
        return f"capacity of {self.pool or 'no pool'} at {self.at:%H:%M}"


class LendingState(models.Model):
    """What the automatic lending decision remembers between two ticks, per cluster: since
    when demand has been high or low, since when each training node has been idle, and what
    an observe-mode decision last recorded (incidents/lending/decide.py ``Memory``)."""

    cluster = models.OneToOneField(Cluster, on_delete=models.CASCADE, related_name="+")
    memory = models.JSONField(default=dict, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    last_decision = models.JSONField(default=dict, blank=True)

    def __str__(self) -> str:
        return f"lending state of {self.cluster_id}"
