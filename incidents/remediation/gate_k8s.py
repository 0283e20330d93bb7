"""The return-to-service gate on a node of a pool Kubernetes schedules (FLEETWATCH_KUBERNETES_POOLS).

Such a pool has no Slurm to hold the node or run the checks in, so the gate does with Kubernetes
what incidents/remediation/gate.py does with Slurm:

1. **Hold.** The node is cordoned (FleetWatch's cordon, ``fleetwatch.io/cordoned-by``; one a
   repair left is kept) and tainted ``fleetwatch.io/gate=<key>:NoSchedule``: no user's pod is
   scheduled there, even if someone uncordons it meanwhile. Pods holding its GPUs (other than
   DaemonSets' and static pods) are waited for. A node cordoned by someone else is theirs, and the
   gate cannot run; a node not Ready (or not registered yet) is waited for, up to
   ``start_seconds``.
2. **Check.** Each check as a batch/v1 Job of ``plan.image`` in ``plan.namespace``, one pod pinned
   to the node by node affinity, asking for every GPU the node offers, tolerating NoSchedule taints
   (the cordon and the gate's own), no retry, the check's minutes as its deadline
   (collectors.clients.kubernetes.check_job_manifest). The pod's exit status is the verdict, as a
   Slurm check job's; its log is the output.
3. **Verdict.** Passed: the node is uncordoned (it is in Kubernetes service), then the gate's taint
   is removed. Failed or could not run: the node stays cordoned, its cordon reason now the checks'
   verdict (``fleetwatch: acceptance check ... failed``), a Job that never started is deleted, and
   the taint removed (the cordon holds the node).

Pure, as gate.py: the caller hands in the Kubernetes client and ``call`` (audited outside calls).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from collectors.clients.base import (
    K8S_CORDON_REASON,
    K8S_CORDONED_BY,
    K8S_CORDONED_BY_FLEETWATCH,
    K8S_GATE,
    SLURM_REASON_PREFIX,
    CheckJob,
    ClientError,
    K8sNode,
    KubernetesClient,
    PodCheckSpec,
)
from collectors.knowledge.acceptance import CHECK_JOB_PREFIX
from incidents.remediation.gate import (
    ACTIVE,
    PASSED,
    QUEUED,
    Call,
    GatePlan,
    PlannedCheck,
    Progress,
    check_script,
    give_up_after,
    poll,
)

CHECK_LABEL = "fleetwatch.io/check"
# A Job's name is a DNS-1123 label: at most 63 characters (its pods carry it as a label).
_NAME_MAX = 63


def gate_poll_kubernetes(k8s: KubernetesClient, plan: GatePlan, state: dict[str, Any],
                         call: Call, now: float) -> Progress:
    """Advance the gate on Kubernetes as far as it goes now; ``state`` is updated in place."""
    return poll(KubernetesRunner(k8s, call), plan, state, now)


def fleetwatch_cordoned(node: K8sNode) -> bool:
    """Whether the node's cordon is FleetWatch's own (its mark says so): FleetWatch's to lift."""
    return node.annotations.get(K8S_CORDONED_BY) == K8S_CORDONED_BY_FLEETWATCH


def lift_fleetwatch_cordon(k8s: KubernetesClient, node: str, call: Call, target: str) -> None:
    """Uncordon ``node`` if it is cordoned and the cordon is FleetWatch's; someone else's stays
    theirs. ``target`` names the audited call (each call's target is its own)."""
    found = k8s.node(node)
    if found.unschedulable and fleetwatch_cordoned(found):
        call("k8s.uncordon", target, k8s.uncordon, node)


def job_name(key: str, check: str) -> str:
    """The check Job's name: ``fleetwatch-check-<key>-<check>`` as a DNS-1123 label (lower
    case, letters, digits and '-'), shortened with a hash of the whole when too long."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"{CHECK_JOB_PREFIX}{key}-{check}".lower()).strip("-")
    if len(name) <= _NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:_NAME_MAX - 9].rstrip('-')}-{digest}"


def label_value(text: str) -> str:
    """``text`` as a label value (63 characters of [A-Za-z0-9._-], alphanumeric at the ends)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63].strip("-._")


class KubernetesRunner:
    """The checks as Kubernetes Jobs on a cordoned, tainted node."""

    scheduler = "Kubernetes"

    def __init__(self, k8s: KubernetesClient, call: Call) -> None:
        self.k8s, self.call = k8s, call

    def hold(self, plan: GatePlan, state: dict[str, Any], now: float) -> None:
        if state.get("held"):
            return
        try:
            node = self.k8s.node(plan.node)
        except ClientError as exc:
            if not exc.permanent:
                raise
            give_up_after(plan, state, now, f"waiting for {plan.node} to register with "
                           f"Kubernetes ({exc})")
            return
        if node.ready is not True:
            give_up_after(plan, state, now, f"waiting for {plan.node} to be Ready "
                           f"({node.ready_reason or 'Ready: ' + str(node.ready)})")
        if node.unschedulable and not fleetwatch_cordoned(node):
            raise ClientError(f"{plan.node} was cordoned by someone else: theirs to release; "
                              "no acceptance check runs on it", permanent=True)
        # Each call's target differs from every other's: an audited call is remembered by its
        # verb and target, and one remembered is not made again (after a crash).
        target = f"{plan.node} (gate {plan.key})"
        if not state.get("tainted"):
            self.call("k8s.relabel", f"{target}: hold", self.k8s.relabel, plan.node, {},
                      [(K8S_GATE, plan.key, "NoSchedule")], [], {K8S_GATE: plan.key})
            state["tainted"] = True
        if not node.unschedulable:
            self.call("k8s.cordon", f"{target}: hold", self.k8s.cordon, plan.node,
                      f"{SLURM_REASON_PREFIX} acceptance checks before service (gate {plan.key})")
            state["cordoned_by_gate"] = True
        # Pods holding GPUs (a DaemonSet's or a static pod's never go: the check runs beside
        # them, as their node's own agents) must end first: the check takes every GPU.
        busy = sorted(f"{p.namespace}/{p.name}" for p in self.k8s.pods_on_node(plan.node)
                      if p.gpus and p.owner_kind != "DaemonSet" and not p.mirror
                      and K8S_GATE not in p.labels
                      and p.phase not in ("Succeeded", "Failed"))
        if busy:
            # A cordon evicts nothing: a pod that does not end by itself in start_seconds
            # keeps the gate from running (the node stays held), said with its name.
            give_up_after(plan, state, now, f"waiting for pod(s) {', '.join(busy[:5])}"
                          f"{f' and {len(busy) - 5} more' if len(busy) > 5 else ''} on "
                          f"{plan.node} to end before its acceptance checks")
        state["held"] = True
        state.setdefault("gpus", node.gpus)

    def submit(self, plan: GatePlan, check: PlannedCheck, state: dict[str, Any]) -> str:
        name = job_name(plan.key, check.name)
        spec = PodCheckSpec(name=name, namespace=plan.namespace, node=plan.node,
                            image=plan.image,
                            script=check_script(check, plan, state.get("gpus")),
                            minutes=check.minutes, gpus=state.get("gpus"),
                            labels={K8S_GATE: label_value(plan.key),
                                    CHECK_LABEL: label_value(check.name)})
        self.call("k8s.submit_check", f"{plan.node} {plan.namespace}/{name}",
                  self.k8s.submit_check, spec)
        return name  # its name is its id: found again after a crash

    def read(self, plan: GatePlan, check: PlannedCheck, job_id: str) -> CheckJob | None:
        return self.k8s.check_job(plan.namespace, job_id)

    def forgotten(self, job_id: str) -> str:
        return f"Job {job_id} was deleted before its result was read"

    def output_at(self, plan: GatePlan, check: PlannedCheck, job_id: str) -> str:
        return f"kubectl logs -n {plan.namespace} job/{job_id}"

    def finish(self, plan: GatePlan, state: dict[str, Any]) -> None:
        target = f"{plan.node} (gate {plan.key})"
        # A Job that never ran to its end (it did not start in time, the gate gave up) goes:
        # it would otherwise start on the node later, under no gate.
        ended = {r["check"] for r in state.get("results", [])
                 if r.get("state") not in QUEUED | ACTIVE and "state" in r}
        for check, job_id in sorted((state.get("jobs") or {}).items()):
            if check not in ended and job_id not in state.setdefault("cancelled", []):
                self.call("k8s.cancel_check", f"{plan.namespace}/{job_id}",
                          self.k8s.cancel_check, plan.namespace, job_id)
                state["cancelled"].append(job_id)
        if state["verdict"] == PASSED:
            if not state.get("released"):
                lift_fleetwatch_cordon(self.k8s, plan.node, self.call, target)
                state["released"] = True
        elif not state.get("recordoned"):
            why = f"{SLURM_REASON_PREFIX} {' '.join(state['why'].split())[:220]} (gate {plan.key})"
            node = self.k8s.node(plan.node)
            if not node.unschedulable:
                self.call("k8s.cordon", f"{target}: verdict", self.k8s.cordon, plan.node, why)
            elif fleetwatch_cordoned(node):
                # FleetWatch's cordon stays; its reason is now the checks' verdict.
                self.call("k8s.relabel", f"{target}: verdict", self.k8s.relabel, plan.node,
                          {}, [], [], {K8S_CORDON_REASON: why})
            state["recordoned"] = True
        if state.get("tainted") and not state.get("untainted"):
            self.call("k8s.relabel", f"{target}: release", self.k8s.relabel, plan.node, {}, [],
                      [K8S_GATE], {K8S_GATE: None})
            state["untainted"] = True

    def held(self, state: Mapping[str, Any], node: str) -> str:
        if state.get("tainted") and not state.get("untainted"):
            return f"{node} held cordoned and tainted {K8S_GATE}"
        return f"{node} stays cordoned"
