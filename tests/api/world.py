"""A small fleet with one of everything the API can address, for the API tests: a node with
GPUs, a job, signals, an incident whose remediation waits for approval (opened through the
services, as diagnosis would), a failed remediation with its failed step, a source with runs,
an audit entry, a spare token and a webhook subscription with a delivery."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.utils import timezone

from collectors import services as collectors
from collectors.models import Cluster, CollectorRun, Gpu, Job, Node, Signal, SourceHealth
from collectors.roles import ADMIN, user_with_role
from incidents import lifecycle
from incidents.audit import audit_record
from incidents.diagnosis.types import Diagnosis
from incidents.models import (
    AuditEntry,
    Delivery,
    Drill,
    Incident,
    Loan,
    Remediation,
    Step,
    WebhookSubscription,
)
from incidents.tokens import token_create

NODE, OTHER_NODE, JOB = "gpu-001", "gpu-002", "4242"


@dataclass
class World:
    cluster: Cluster
    node: Node
    gpu: Gpu
    job: Job
    signal: Signal
    incident: Incident
    remediation: Remediation  # awaiting approval
    failed: Remediation
    failed_step: Step
    audit: AuditEntry
    token_name: str  # a spare token, for the token endpoints to act on
    webhook: WebhookSubscription
    delivery: Delivery
    drill: Drill  # a fire drill that failed, with its reason and phases
    loan: Loan  # a lend of OTHER_NODE proposed by the demand policy, waiting for a person

    def path_parameters(self, template: str) -> dict[str, str]:
        """This world's object for each parameter of an OpenAPI path (``/api/v1/nodes/{name}/``
        -> ``{"name": "gpu-001"}``)."""
        collection = template.split("/")[3]
        ids = {"incidents": self.incident.pk, "remediations": self.remediation.pk,
               "steps": self.failed_step.pk, "audit": self.audit.pk, "gpus": self.gpu.pk,
               "webhooks": self.webhook.pk, "webhook-deliveries": self.delivery.pk,
               "drills": self.drill.pk, "loans": self.loan.pk}
        names = {"clusters": self.cluster.name, "nodes": self.node.name,
                 "tokens": self.token_name}
        values = {"id": str(ids.get(collection, 0)), "name": names.get(collection, "x"),
                  "slurm_id": self.job.slurm_id}
        return {k: v for k, v in values.items() if f"{{{k}}}" in template}

    def path(self, template: str) -> str:
        """An OpenAPI path with its parameters filled in with this world's objects."""
        for key, value in self.path_parameters(template).items():
            template = template.replace(f"{{{key}}}", value)
        return template


def build_world(settings: Any) -> World:
    settings.FLEETWATCH_POLICY_MODE = "approve"  # the remediation waits for a person
    # The tests' users sign in with tokens or force_login: a slow password hash buys nothing.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    cluster = collectors.cluster_default()
    now = timezone.now()
    nodes = {}
    for name in (NODE, OTHER_NODE):
        nodes[name] = Node.objects.create(cluster=cluster, name=name, pool="gpu",
                                          leaf_switch="leaf-a", health=Node.Health.HEALTHY,
                                          slurm_state="IDLE")
        for index in range(2):
            Gpu.objects.create(node=nodes[name], index=index, health=Node.Health.HEALTHY,
                               temperature=40.0, utilization=90.0)
    node = nodes[NODE]
    job = Job.objects.create(cluster=cluster, slurm_id=JOB, name="train", user="ana",
                             state="RUNNING", nodes=[NODE, OTHER_NODE], started_at=now)
    signal = Signal.objects.create(cluster=cluster, source="dcgm", kind="xid", node=node,
                                   node_name=NODE, gpu_index=1, job_id=JOB, code=79,
                                   message="XID 79", observed_at=now - timedelta(minutes=1))
    incident, _ = lifecycle.incident_record(cluster.pk, Diagnosis(
        root_cause="gpu_hardware", nodes=(NODE,), confidence=0.97, playbook="replace_node",
        explanation=f"XID 79 (GPU has fallen off the bus) on {NODE}",
        detected_at=now - timedelta(minutes=1), jobs=(JOB,), evidence=(signal.pk,)))
    remediation = incident.remediations.get()
    assert remediation.status == Remediation.Status.AWAITING_APPROVAL
    # A second, older incident whose repair failed at its second step.
    old = Incident.objects.create(
        cluster=cluster, root_cause="thermal", confidence=0.9, explanation="hot",
        playbook="cool_down", status=Incident.Status.NEEDS_ATTENTION,
        fingerprint=f"thermal:{OTHER_NODE}", nodes=[OTHER_NODE],
        detected_at=now - timedelta(hours=2), opened_at=now - timedelta(hours=2))
    failed = Remediation.objects.create(
        incident=old, playbook="cool_down", mode="auto", status=Remediation.Status.FAILED,
        requested_by="system", nodes=[OTHER_NODE], started_at=now - timedelta(hours=2),
        finished_at=now - timedelta(hours=1))
    Step.objects.create(remediation=failed, order=1, kind="notify", title="Notify",
                        status=Step.Status.SUCCEEDED, started_at=now - timedelta(hours=2),
                        finished_at=now - timedelta(hours=2))
    failed_step = Step.objects.create(remediation=failed, order=2, kind="drain",
                                      title="Drain the node", status=Step.Status.FAILED,
                                      error="slurm said no", started_at=now - timedelta(hours=1),
                                      finished_at=now - timedelta(hours=1))
    source = SourceHealth.objects.create(cluster=cluster, name="slurm", healthy=True,
                                         last_run_at=now, last_success_at=now, runs=3)
    for ok in (True, False):
        CollectorRun.objects.create(cluster=cluster, source=source.name, started_at=now,
                                    finished_at=now, duration_ms=12.5, ok=ok,
                                    error="" if ok else "timeout", counts={"nodes": 2})
    audit = audit_record("test.seeded", "the API test world", incident=incident)
    admin = user_with_role("ada", ADMIN, "admin-pass-1")[0]
    token_name = "spare-token"
    token_create(admin, token_name, ["read"])
    webhook = WebhookSubscription.objects.create(
        name="hook", url="http://127.0.0.1:9/hook", secret="s" * 32, events=[])
    delivery = Delivery.objects.create(
        subscription=webhook, event="incident.opened", event_id="e-1", incident=incident,
        payload={"event": "incident.opened"}, status=Delivery.Status.DELIVERED,
        attempts=1, response_code=200, delivered_at=now)
    drill = Drill.objects.create(
        cluster=cluster, status=Drill.Status.FAILED, mode=Drill.Mode.OBSERVE,
        trigger=Drill.Trigger.SCHEDULE, requested_by="system", node=OTHER_NODE,
        budget_seconds=300.0, started_at=now - timedelta(hours=3),
        deadline=now - timedelta(hours=3) + timedelta(seconds=300),
        finished_at=now - timedelta(hours=3) + timedelta(seconds=12), nonce="0" * 16,
        reason="remediation 9 failed at step 2 drain_and_cancel: slurmctld unreachable",
        phases={"inject": 0.2, "detect": 1.5, "decide": 0.3, "total": 12.0},
        events=[{"at": (now - timedelta(hours=3)).isoformat(), "what": "started",
                 "detail": "schedule"}])
    loan = Loan.objects.create(cluster=cluster, node=OTHER_NODE, pool="gpu",
                               status=Loan.Status.PROPOSED, step="lend_check", mode="approve",
                               automatic=True, requested_by="system",
                               reason="idle in Slurm for 30 min, no pending demand")
    return World(cluster=cluster, node=node, gpu=node.gpus.get(index=1), job=job,
                 signal=signal, incident=incident, remediation=remediation, failed=failed,
                 failed_step=failed_step, audit=audit, token_name=token_name,
                 webhook=webhook, delivery=delivery, drill=drill, loan=loan)


def signal_body(node: str = NODE) -> dict[str, Any]:
    at = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    return {"signals": [{"at": at, "source": "kernel", "node": node,
                         "message": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"}]}
