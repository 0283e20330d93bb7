"""Node providers for real fleets: Slurm's own reboot, a Kubernetes node pool, a site's program,
and a combination of them (``base.NodeProvider`` is the interface; ``sim.SimProvider`` is the
simulated one).

- ``SlurmRebootProvider``: ``scontrol reboot ASAP nextstate=RESUME reason="fleetwatch: ..."``.
  Slurm drains the node at once, reboots it through its ``RebootProgram`` when its jobs have
  ended and resumes it when slurmd registers again. Slurm cannot reset a GPU or bring new
  hardware: those are refused, saying what to configure instead. It reboots through the node's
  own slurmd, so a node that does not respond cannot be rebooted this way (that takes a power
  cycle through the BMC: a command provider).
- ``KubernetesPoolProvider``: deletes the Node object and waits for the node pool to bring a
  new node (see the class for what a cluster must do for that to happen).
- ``CommandProvider``: runs a configured program ``<command> <action> <node> [args...]``.
- ``CompositeProvider``: replace with one provider, reboot with another, reset with a third.

Every action names the outside call as an operator would type it (``ActionResult.call``) and
is idempotent: asking again for what is under way reports its progress.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from collectors.clients.base import (
    K8S_ANNOTATION_PREFIX,
    SLURM_REASON_PREFIX,
    ActionResult,
    ClientError,
    NodeProvider,
    NoProvider,
    ProviderStatus,
    Replacement,
    SlurmNode,
)

if TYPE_CHECKING:
    from collectors.clients.kubernetes import KubernetesApi

PROVIDER_STATES = frozenset({"ready", "provisioning", "rebooting", "resetting", "replaced",
                             "failed", "unknown"})


@dataclass(frozen=True)
class ProviderReplacement(Replacement):
    """A ``Replacement`` that also carries the outside call made and what must be remembered.

    ``data`` is what the remediation step persists and hands back to
    ``replacement_status(node, data)``, so a later poll (another worker, after a restart) can
    compute progress without the provider keeping state. ``base.Replacement`` has neither field
    yet; this subclass stays compatible with code that reads only the base fields."""

    call: str = ""
    data: dict[str, object] = field(default_factory=dict)


class CommandError(ClientError):
    """A failed run of a command provider's program, with what the audit trail should record."""

    def __init__(self, message: str, *, call: str, data: dict[str, object],
                 permanent: bool = False) -> None:
        super().__init__(message, permanent=permanent)
        self.call = call
        self.data = data


# --- Slurm ----------------------------------------------------------------------------------------


class RebootingSlurm(Protocol):
    """What SlurmRebootProvider needs of ``slurm.SlurmCli``."""

    def node(self, name: str) -> SlurmNode: ...
    def reboot(self, node: str, reason: str) -> ActionResult: ...


REBOOT_FLAGS = ("REBOOT_REQUESTED", "REBOOT_ISSUED")


class SlurmRebootProvider:
    """Reboots through Slurm; refuses what Slurm cannot do."""

    def __init__(self, slurm: RebootingSlurm) -> None:
        self.slurm = slurm

    def reboot(self, node: str, reason: str) -> ActionResult:
        current = self.slurm.node(node)  # unknown: NotFound, permanent
        flags = set(current.flags)
        if not flags & set(REBOOT_FLAGS):
            if "NOT_RESPONDING" in flags:
                raise ClientError(
                    f"{node} is not responding: Slurm reboots a node through its own slurmd, "
                    "which cannot be reached; a power cycle through the BMC needs a command "
                    "provider (FLEETWATCH_PROVIDER=command)", permanent=True)
            held = "DRAIN" in flags or current.state == "DOWN"
            if held and not current.reason.startswith(SLURM_REASON_PREFIX):
                # nextstate=RESUME would lift a drain that is not FleetWatch's (Ownership).
                raise ClientError(
                    f"{node} was drained or marked down by someone else ({current.reason!r}); "
                    "not rebooting it with nextstate=RESUME", permanent=True)
        result = self.slurm.reboot(node, reason)
        return ActionResult(result.call, result.changed, result.detail,
                            {**result.data, "state_before": _state_words(current)})

    def status(self, node: str) -> ProviderStatus:
        current = self.slurm.node(node)  # unknown: NotFound, permanent
        flags = set(current.flags)
        words = _state_words(current)
        if "REBOOT_ISSUED" in flags:
            return ProviderStatus(node, "rebooting", f"reboot issued, waiting for slurmd to "
                                  f"register ({words})")
        if "REBOOT_REQUESTED" in flags:
            return ProviderStatus(node, "rebooting", f"reboot requested, waiting for its jobs "
                                  f"to end ({words})")
        if "POWERING_UP" in flags:
            return ProviderStatus(node, "provisioning", words)
        if current.state == "DOWN" or flags & {"NOT_RESPONDING", "FAIL", "POWERED_DOWN"}:
            return ProviderStatus(node, "failed", f"{words}: {current.reason}".rstrip(": "))
        if current.state in ("FUTURE", "UNKNOWN"):
            return ProviderStatus(node, "unknown", words)
        # Up and talking to slurmctld; whether it takes jobs (DRAIN) is Slurm's, not ours.
        return ProviderStatus(node, "ready", words + (f": {current.reason}"
                                                      if current.reason else ""))

    def reset_gpu(self, node: str, gpu: int | None) -> ActionResult:
        raise ClientError(
            f"Slurm has no GPU reset (for {node}): configure FLEETWATCH_PROVIDER=command with a "
            "site program that runs `nvidia-smi --gpu-reset -i N` on the node, or reboot it",
            permanent=True)

    def replace(self, node: str) -> Replacement:
        raise ClientError(
            f"Slurm cannot bring new hardware to replace {node}: configure a node pool "
            "(FLEETWATCH_PROVIDER=kubernetes) or a site program (FLEETWATCH_PROVIDER=command)",
            permanent=True)

    def replacement_status(self, node: str, data: Mapping[str, Any] | None = None,
                           ) -> Replacement | None:
        return None


def _state_words(node: SlurmNode) -> str:
    return "+".join((node.state, *node.flags))


# --- Kubernetes node pools ------------------------------------------------------------------------

# Labels that name a node's pool, in the order they are tried: FleetWatch's own, then the
# clouds' and Karpenter's.
POOL_LABELS = (
    "fleetwatch.io/pool",
    "karpenter.sh/nodepool",
    "cloud.google.com/gke-nodepool",
    "eks.amazonaws.com/nodegroup",
    "kubernetes.azure.com/agentpool",
)
REPLACES_ANNOTATION = f"{K8S_ANNOTATION_PREFIX}replaces"
RECORD_ANNOTATION = f"{K8S_ANNOTATION_PREFIX}replacement"
RECORD_REASON = "FleetWatchReplacingNode"


class KubernetesPoolProvider:
    """Replaces a node by deleting its Node object and waiting for its pool to bring a new one.

    ``replace(node)`` reads the node's pool (the first of ``pool_labels`` it carries), records
    the pool's members at that moment, then deletes the Node (conditional on its uid, so a
    same-named newcomer is never deleted). ``replacement_status(node, data)`` looks for a node
    in the same pool that was not a member then and is Ready, and claims it with the
    ``fleetwatch.io/replaces=<old node>`` annotation, so two replacements in one pool never
    take the same newcomer. A newcomer with the deleted node's *name* is not counted: that is
    the old machine's kubelet registering itself again, and is reported as such.

    What is remembered, so that any worker can answer later without state of its own: the
    ``data`` of the returned ``ProviderReplacement`` (``pool_label``, ``pool``, ``members``,
    ``uid``, ``deleted_at``), which the remediation step persists and passes back; the same
    record in a core/v1 Event on the node (reason ``FleetWatchReplacingNode``, annotation
    ``fleetwatch.io/replacement``) in ``namespace``, found again when ``data`` is not passed
    and also visible to ``kubectl get events`` (events expire: one hour by default); and this
    object's own memory.

    Deleting the Node object replaces the machine where the node's lifetime is tied to it:
    Karpenter (its termination finalizer drains and terminates the instance) and node-pool
    controllers that watch Node deletions. Where it is not (a cloud managed instance group
    or scale set keeps the VM running, whose kubelet then registers the node again), the
    VM must be deleted instead: a command provider calling the cloud's CLI.

    Needs RBAC: ``delete`` on nodes and ``create`` on events, beyond what the collector uses.
    """

    def __init__(self, api: KubernetesApi, pool_labels: Sequence[str] = POOL_LABELS, *,
                 namespace: str = "default") -> None:
        self.api = api
        self.pool_labels = tuple(pool_labels)
        self.namespace = namespace
        self._records: dict[str, dict[str, Any]] = {}

    # Plumbing over KubernetesApi's generic helpers: it has no delete or labelled list of
    # nodes of its own yet.

    def _get_node(self, node: str) -> dict[str, Any] | None:
        from collectors.clients.kubernetes import KubernetesApiError

        try:
            return self.api._read_node(node)
        except KubernetesApiError as e:
            if e.status == 404:
                return None
            raise

    def _pool_nodes(self, label: str, pool: str) -> list[dict[str, Any]]:
        items, _ = self.api._list(f"list nodes in pool {label}={pool}", self.api.core.list_node,
                                  label_selector=f"{label}={pool}")
        return [i for i in items if isinstance(i, dict)]

    def _pool_of(self, obj: dict[str, Any]) -> tuple[str, str] | None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for label in self.pool_labels:
            if labels.get(label):
                return label, str(labels[label])
        return None

    def _find_record(self, node: str) -> dict[str, Any] | None:
        if node in self._records:
            return self._records[node]
        try:
            items, _ = self.api._list(
                f"find the replacement record of {node}", self.api.core.list_namespaced_event,
                namespace=self.namespace,
                field_selector=f"involvedObject.kind=Node,involvedObject.name={node},"
                               f"reason={RECORD_REASON}")
        except ClientError:
            return None  # the record is a fallback; the caller says what is missing
        found: list[dict[str, Any]] = []
        for item in items:
            raw = ((item.get("metadata") or {}).get("annotations") or {}).get(RECORD_ANNOTATION)
            with contextlib.suppress(ValueError, TypeError):
                record = json.loads(cast(str, raw))  # None: TypeError, suppressed
                if isinstance(record, dict) and record.get("pool"):
                    found.append(record)
        if not found:
            return None
        record = max(found, key=lambda r: float(r.get("deleted_at") or 0))
        self._records[node] = record
        return record

    def _write_record(self, node: str, record: dict[str, Any]) -> str:
        """The replacement's record as an Event on the node; '' or why it could not be written."""
        from kubernetes import client

        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record["deleted_at"]))
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                name=f"{node}.fleetwatch-replace-{int(record['deleted_at'] * 1000):x}",
                namespace=self.namespace, annotations={RECORD_ANNOTATION: json.dumps(record)}),
            involved_object=client.V1ObjectReference(kind="Node", name=node, api_version="v1",
                                                     uid=record.get("uid") or None),
            reason=RECORD_REASON, type="Normal",
            message=(f"FleetWatch deleted node {node} so that node pool "
                     f"{record['pool_label']}={record['pool']} replaces it"),
            first_timestamp=stamp, last_timestamp=stamp, count=1,
            source=client.V1EventSource(component="fleetwatch"),
            reporting_component="fleetwatch", reporting_instance="fleetwatch")
        try:
            self.api._call(f"record the replacement of {node}",
                           self.api.core.create_namespaced_event, self.namespace, body,
                           _preload_content=False)
        except ClientError as e:
            return str(e)
        return ""

    def replace(self, node: str) -> Replacement:
        call = f"kubectl delete node {node}"
        obj = self._get_node(node)
        record = self._find_record(node)
        uid = str(((obj or {}).get("metadata") or {}).get("uid") or "")
        if record is not None and (obj is None or uid != record.get("uid")):
            # Deleted already (a node under the same name since is not ours to delete):
            # report progress, never delete twice.
            status = self.replacement_status(node, record)
            assert status is not None
            return ProviderReplacement(node, status.new_node, status.ready,
                                       f"already deleted; {status.detail}", call, dict(record))
        if obj is None:
            raise ClientError(f"node {node} does not exist and FleetWatch has no record of "
                              "deleting it: nothing to replace", permanent=True)
        pool = self._pool_of(obj)
        if pool is None:
            raise ClientError(f"node {node} carries none of the pool labels "
                              f"({', '.join(self.pool_labels)}): no node pool would bring a "
                              "replacement", permanent=True)
        label, name = pool
        unrecorded = ""
        if record is None:
            members = sorted(str(o["metadata"]["name"]) for o in self._pool_nodes(label, name))
            record = {"pool_label": label, "pool": name, "members": members, "uid": uid,
                      "deleted_at": time.time()}
            # The record first, then the outside change: a crash in between leaves a record
            # of a deletion not made, and the next replace() finds the node (same uid) still
            # there and deletes it then.
            unrecorded = self._write_record(node, record)
        self._records[node] = record
        from kubernetes import client

        from collectors.clients.kubernetes import KubernetesApiError

        try:
            self.api._call(f"delete node {node}", self.api.core.delete_node, node,
                           body=client.V1DeleteOptions(
                               preconditions=client.V1Preconditions(uid=uid or None)),
                           _preload_content=False)
        except KubernetesApiError as e:
            if e.status != 404:
                self._records.pop(node, None)
                raise
        data: dict[str, object] = {**record, "request": f"DELETE /api/v1/nodes/{node}"}
        if unrecorded:
            data["record_error"] = unrecorded
        return ProviderReplacement(
            node, "", False, f"deleted {node}; waiting for node pool {label}={name} to bring a "
            "new node", call, data)

    def replacement_status(self, node: str, data: Mapping[str, Any] | None = None,
                           ) -> Replacement | None:
        record = dict(data) if data and data.get("pool") else self._find_record(node)
        if record is None:
            return None
        label, pool = str(record["pool_label"]), str(record["pool"])
        members = set(record.get("members") or ())
        nodes = self._pool_nodes(label, pool)
        from collectors.clients.kubernetes import node_from

        fresh: list[tuple[dict[str, Any], Any]] = []
        back = ""
        for obj in sorted(nodes, key=lambda o: str(o["metadata"].get("creationTimestamp") or "")):
            parsed = node_from(obj)
            annotations = parsed.annotations
            if annotations.get(REPLACES_ANNOTATION) == node:
                return Replacement(node, parsed.name, parsed.ready is True,
                                   "ready" if parsed.ready else "joined the pool, not Ready yet")
            if parsed.name == node:
                back = (f"{node} registered again under its old name: its machine still runs "
                        "(deleting the Node object does not stop a VM in this pool)")
                continue
            if parsed.name in members or annotations.get(REPLACES_ANNOTATION):
                continue  # there before, or another replacement's newcomer
            fresh.append((obj, parsed))
        for obj, parsed in fresh:
            if parsed.ready is True and self._claim(obj, node):
                return Replacement(node, parsed.name, True, "ready")
        if fresh:
            names = ", ".join(p.name for _, p in fresh)
            return Replacement(node, "", False, f"{names} joined the pool, not Ready yet"
                               + (f"; {back}" if back else ""))
        return Replacement(node, "", False, back or f"waiting for node pool {label}={pool}")

    def _claim(self, obj: dict[str, Any], node: str) -> bool:
        """Mark a newcomer as this node's replacement; False if another claim won the race."""
        from collectors.clients.kubernetes import KubernetesApiError

        meta = obj["metadata"]
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion"),
                              "annotations": {REPLACES_ANNOTATION: node}}}
        try:
            self.api._call(f"claim {meta['name']} as the replacement of {node}",
                           self.api.core.patch_node, meta["name"], patch,
                           _preload_content=False)
        except KubernetesApiError as e:
            if e.status in (404, 409):
                return False  # gone, or changed under us: the next poll looks again
            raise
        return True

    def status(self, node: str) -> ProviderStatus:
        obj = self._get_node(node)
        if obj is None:
            if self._find_record(node) is not None:
                return ProviderStatus(node, "replaced", "deleted by FleetWatch for its node pool "
                                      "to replace")
            return ProviderStatus(node, "unknown", "not a node of this Kubernetes cluster")
        from collectors.clients.kubernetes import node_from

        parsed = node_from(obj)
        if parsed.ready is True:
            return ProviderStatus(node, "ready", "Ready")
        if parsed.ready is False:
            return ProviderStatus(node, "failed", f"NotReady ({parsed.ready_reason})")
        return ProviderStatus(node, "unknown", f"Ready condition Unknown ({parsed.ready_reason})")

    def reboot(self, node: str, reason: str) -> ActionResult:
        raise ClientError(f"a Kubernetes node pool cannot reboot {node}: combine it with Slurm's "
                          "reboot (FLEETWATCH_PROVIDER=kubernetes does) or a command provider",
                          permanent=True)

    def reset_gpu(self, node: str, gpu: int | None) -> ActionResult:
        raise ClientError(f"a Kubernetes node pool cannot reset a GPU of {node}: configure a "
                          "command provider (FLEETWATCH_PROVIDER=command)", permanent=True)


# --- a site's program -----------------------------------------------------------------------------

EXCERPT = 4000  # characters of stdout/stderr kept for the audit trail
PERMANENT_EXIT = 2


class CommandProvider:
    """Runs ``<command> <action> <node> [args...]`` for each action, without a shell.

    Actions and their arguments: ``replace NODE``, ``replacement-status NODE``, ``reboot NODE
    REASON``, ``reset-gpu NODE GPU`` (``all`` for every GPU), ``status NODE``.

    Output: ``replace`` and ``replacement-status`` print one JSON object ``{"new_node": "...",
    "ready": false, "detail": "..."}`` (``replacement-status`` may print ``null`` or nothing:
    no replacement known); ``status`` prints ``{"state": "...", "detail": "..."}`` with a
    state from ``base.ProviderStatus``; ``reboot`` and ``reset-gpu`` print a line of plain text
    for the audit trail, or a JSON object ``{"changed": false, "detail": "..."}`` to say that
    nothing had to be done (asked again while already under way).

    Exit status: 0 is success; 2 is a permanent failure (the request is wrong: an unknown
    node, an action the site does not support; not retried); any other status, or a run
    longer than ``timeout`` seconds (its whole process group is killed), is transient and the
    step retries it. The program must be idempotent: a retried step runs it again.

    ``ActionResult.call`` is the exact argv, ``shlex.join``-ed; ``data`` holds ``argv``,
    ``exit_status``, ``stdout``, ``stderr`` (excerpts) and ``seconds``. A failure raises
    ``CommandError`` with the same ``call`` and ``data``.
    """

    def __init__(self, command: str, timeout: float = 600.0,
                 env: Mapping[str, str] | None = None) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise ValueError("a command provider needs a command (FLEETWATCH_PROVIDER_COMMAND)")
        self.timeout = timeout
        self.env = {**os.environ, **(env or {})}

    def run(self, action: str, node: str, *args: str) -> tuple[str, dict[str, object]]:
        """Run the program; its stdout and the audit data, or CommandError."""
        argv = [*self.argv, action, node, *args]
        call = shlex.join(argv)
        started = time.monotonic()
        try:
            # Its own session, so a timeout kills whatever it started too (a shell script's
            # children would otherwise keep the pipes open and the wait going).
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=self.env,
                                    start_new_session=True)
        except OSError as e:
            raise CommandError(f"`{call}` could not be started: {e.strerror or e}", call=call,
                               data={"argv": argv}, permanent=True) from e
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            data = _run_data(argv, None, stdout, stderr, started)
            raise CommandError(f"`{call}` timed out after {self.timeout:g}s", call=call,
                               data=data) from None
        data = _run_data(argv, proc.returncode, stdout, stderr, started)
        if proc.returncode != 0:
            said = (stderr.strip() or stdout.strip()).splitlines()
            message = f"`{call}` failed with exit status {proc.returncode}"
            if said:
                message += f": {said[-1][:300]}"
            raise CommandError(message, call=call, data=data,
                               permanent=proc.returncode == PERMANENT_EXIT)
        return stdout, data

    def _json(self, action: str, node: str, *args: str) -> tuple[Any, str, dict[str, object]]:
        stdout, data = self.run(action, node, *args)
        call = shlex.join([*self.argv, action, node, *args])
        text = stdout.strip()
        if not text:
            return None, call, data
        try:
            return json.loads(text), call, data
        except ValueError as e:
            # A program that says success but prints something else is broken, not busy.
            raise CommandError(f"`{call}` printed no JSON ({e}): {text[:200]!r}", call=call,
                               data=data, permanent=True) from e

    def _replacement(self, node: str, payload: Any, call: str, data: dict[str, object],
                     ) -> ProviderReplacement:
        if not isinstance(payload, dict):
            raise CommandError(f"`{call}` printed {payload!r}, not a JSON object", call=call,
                               data=data, permanent=True)
        return ProviderReplacement(node, str(payload.get("new_node") or ""),
                                   payload.get("ready") is True, str(payload.get("detail") or ""),
                                   call, data)

    def replace(self, node: str) -> Replacement:
        payload, call, data = self._json("replace", node)
        return self._replacement(node, payload, call, data)

    def replacement_status(self, node: str, data: Mapping[str, Any] | None = None,
                           ) -> Replacement | None:
        payload, call, run = self._json("replacement-status", node)
        if payload is None:
            return None
        return self._replacement(node, payload, call, run)

    def _act(self, action: str, node: str, *args: str) -> ActionResult:
        stdout, data = self.run(action, node, *args)
        call = shlex.join([*self.argv, action, node, *args])
        text = stdout.strip()
        changed, detail = True, text.splitlines()[-1] if text else f"{action} {node}: done"
        if text.startswith("{"):
            with contextlib.suppress(ValueError):
                payload = json.loads(text)
                if isinstance(payload, dict):
                    changed = payload.get("changed", True) is not False
                    detail = str(payload.get("detail") or detail)
        return ActionResult(call, changed, detail, data)

    def reboot(self, node: str, reason: str) -> ActionResult:
        reason = " ".join(reason.split())
        if not reason.startswith(SLURM_REASON_PREFIX):
            reason = f"{SLURM_REASON_PREFIX} {reason}".rstrip()
        return self._act("reboot", node, reason)

    def reset_gpu(self, node: str, gpu: int | None) -> ActionResult:
        return self._act("reset-gpu", node, "all" if gpu is None else str(gpu))

    def status(self, node: str) -> ProviderStatus:
        payload, call, data = self._json("status", node)
        if not isinstance(payload, dict):
            raise CommandError(f"`{call}` printed {payload!r}, not a JSON object", call=call,
                               data=data, permanent=True)
        state = str(payload.get("state") or "unknown")
        detail = str(payload.get("detail") or "")
        if state not in PROVIDER_STATES:
            detail, state = f"the program said {state!r}" + (f": {detail}" if detail else ""), \
                "unknown"
        return ProviderStatus(node, state, detail)


def _run_data(argv: list[str], status: int | None, stdout: str | None, stderr: str | None,
              started: float) -> dict[str, object]:
    return {"argv": argv, "exit_status": status, "stdout": _excerpt(stdout or ""),
            "stderr": _excerpt(stderr or ""), "seconds": round(time.monotonic() - started, 3)}


def _excerpt(text: str) -> str:
    # The end of the output says most about how a program ended.
    return text if len(text) <= EXCERPT else "[...]" + text[-EXCERPT:]


# --- combining ------------------------------------------------------------------------------------

# When providers disagree about a node, what is under way wins over what is settled.
STATUS_ORDER = ("rebooting", "resetting", "provisioning", "failed", "replaced", "ready", "unknown")


class CompositeProvider:
    """Routes each action to the provider configured for it: e.g. reboot with Slurm, replace
    with a Kubernetes node pool. A missing one refuses, as ``NoProvider`` does. ``status``
    asks each distinct provider and reports the most pressing answer (a reboot under way
    over "ready"); providers that cannot answer for the node are skipped."""

    def __init__(self, replace: NodeProvider | None = None, reboot: NodeProvider | None = None,
                 reset: NodeProvider | None = None) -> None:
        none = NoProvider()
        self.replacer: NodeProvider = replace or none
        self.rebooter: NodeProvider = reboot or none
        self.resetter: NodeProvider = reset or none

    def replace(self, node: str) -> Replacement:
        return self.replacer.replace(node)

    def replacement_status(self, node: str, data: Mapping[str, Any] | None = None,
                           ) -> Replacement | None:
        method: Callable[..., Replacement | None] = self.replacer.replacement_status
        if data is None or "data" not in inspect.signature(method).parameters:
            return method(node)
        return method(node, data)

    def reboot(self, node: str, reason: str) -> ActionResult:
        return self.rebooter.reboot(node, reason)

    def reset_gpu(self, node: str, gpu: int | None) -> ActionResult:
        return self.resetter.reset_gpu(node, gpu)

    def status(self, node: str) -> ProviderStatus:
        seen: list[ProviderStatus] = []
        errors: list[ClientError] = []
        for provider in _distinct([self.rebooter, self.replacer, self.resetter]):
            if isinstance(provider, NoProvider):
                continue
            try:
                seen.append(provider.status(node))
            except ClientError as e:
                errors.append(e)
        if not seen:
            if errors:
                raise errors[0]
            return ProviderStatus(node, "unknown", "no node provider is configured")
        return min(seen, key=lambda s: STATUS_ORDER.index(s.state)
                   if s.state in STATUS_ORDER else len(STATUS_ORDER))


def _distinct(providers: list[NodeProvider]) -> list[NodeProvider]:
    out: list[NodeProvider] = []
    for p in providers:
        if not any(p is q for q in out):
            out.append(p)
    return out
