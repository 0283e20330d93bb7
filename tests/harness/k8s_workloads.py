"""The workload side of the Kubernetes test server: batch/v1 Job defaulting, and (with
``K8sTestServer(run_pods=True)``) a job controller, a scheduler and a kubelet stand-in.

The API server (``k8s_server.py``) stores Jobs and Pods; what a cluster's controllers and
kubelets do with them happens here, in one background thread that looks at the cluster every
``interval`` seconds (0.1 s), holding the server's lock while it changes objects:

- the job controller creates a Job's pods from its template (``<job>-<5 random chars>``,
  owned by the Job), counts their outcomes into ``status`` (``active``, ``ready``,
  ``succeeded``, ``failed``, ``startTime``, ``completionTime``) and ends the Job with the
  conditions Kubernetes 1.32 writes: ``SuccessCriteriaMet`` + ``Complete``, or
  ``FailureTarget`` + ``Failed`` (``BackoffLimitExceeded`` past ``backoffLimit``,
  ``DeadlineExceeded`` past ``activeDeadlineSeconds``, whose active pods are killed and
  deleted). ``ttlSecondsAfterFinished`` deletes a finished Job and its pods. ``suspend``
  deletes the active pods and sets ``Suspended``;
- the scheduler binds Job-owned pods without ``spec.nodeName`` to the first node (by name)
  that passes the default profile's filters in their order: NodeUnschedulable (a cordoned
  node, unless the pod tolerates ``node.kubernetes.io/unschedulable:NoSchedule``),
  TaintToleration (NoSchedule/NoExecute taints, plus the ``node.kubernetes.io/not-ready`` or
  ``unreachable`` taint the node lifecycle controller puts on a node that is not Ready),
  NodeAffinity (``nodeSelector`` and required node affinity, ``matchExpressions`` on labels
  and ``matchFields`` on ``metadata.name``). No node fits: the pod stays Pending with
  ``PodScheduled`` False, reason ``Unschedulable`` and the scheduler's message, retried every
  tick. Resources (CPU, memory, GPUs) and pod (anti-)affinity are not considered;
- the kubelet runs a bound Job pod (or a Job pod created with ``spec.nodeName``) once its
  node exists and is Ready: the FIRST container's ``command`` + ``args`` (``$(VAR)``
  expanded) as a local subprocess ON THE TEST MACHINE, in its own process group, with the
  container's plain ``env`` values plus ``PATH`` of the server process and ``HOSTNAME`` =
  the pod's name, in a scratch directory. THE IMAGE IS IGNORED: nothing is pulled, no
  filesystem, user or isolation of a container. A container without ``command`` (which
  would run the image's entrypoint) or whose command cannot be executed fails at once as
  containerd reports it: ``state.terminated`` reason ``StartError``, exit code 128. Other
  containers of the pod are not run. stdout and stderr go, merged, into the pod's log (the
  last 1 MiB kept in memory) served by ``pods/log``. Exit 0: phase Succeeded
  (``Completed``); otherwise Failed (``Error``), or with ``restartPolicy: OnFailure`` the
  container is restarted at once (``restartCount`` + 1, no CrashLoopBackOff delay).
  Deleting a pod kills its process group at once (no grace period).

Not done: the job controller's pod-failure backoff (10 s, 20 s, ... before a failed pod is
replaced; here the replacement comes at the next tick), Indexed completion mode (indexes
are not assigned), ``podFailurePolicy``, ``successPolicy``, ``backoffLimitPerIndex``,
``managedBy``, events, and the Job tracking finalizers (counts are kept in memory).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tests.harness.k8s_rules import ApiError

if TYPE_CHECKING:
    from tests.harness.k8s_server import K8sTestServer

Obj = dict[str, Any]

JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
LOG_CAP = 1 << 20  # a pod's log keeps its last MiB (a kubelet rotates its log files too)
# k8s.io/apimachinery/pkg/util/rand: the generated-name alphabet (no vowels, no 0/1/3).
NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"
FINISHED = ("Succeeded", "Failed")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def random_suffix() -> str:
    return "".join(secrets.choice(NAME_CHARS) for _ in range(5))


# --- defaulting on create (the API server's, not a controller's) ------------------------------


def default_pod_spec(spec: Obj) -> None:
    """The defaults the API server gives a pod spec (pkg/apis/core/v1/defaults.go), in place.
    restartPolicy defaults to Always, which a Job then refuses, as on a cluster."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("securityContext", {})
    for c in spec.get("containers") or []:
        if not isinstance(c, dict):
            continue
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        c.setdefault("resources", {})
        image = str(c.get("image") or "")
        tag = image.rsplit("/", 1)[-1]
        latest = "@" not in tag and (":" not in tag or tag.endswith(":latest"))
        c.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")


def default_job(job: Obj) -> None:
    """What the API server does to a new Job (batch/v1 defaults and the job strategy's
    generated selector), in place. ``metadata.uid`` and ``metadata.name`` must be set."""
    meta = job["metadata"]
    uid, name = meta["uid"], meta["name"]
    spec = job.setdefault("spec", {})
    template = spec.setdefault("template", {})
    if not isinstance(template, dict):
        return  # decoding refused it already; nothing to default
    tmeta = template.setdefault("metadata", {})
    if not spec.get("manualSelector"):
        selector = spec.get("selector") or {}
        selector.setdefault("matchLabels", {})[JOB_UID_LABEL] = uid
        spec["selector"] = selector
        tmeta["labels"] = {**(tmeta.get("labels") or {}), JOB_UID_LABEL: uid,
                           "controller-uid": uid, JOB_NAME_LABEL: name, "job-name": name}
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
    spec.setdefault("parallelism", 1)
    if spec.get("backoffLimitPerIndex") is None:
        spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("podReplacementPolicy",
                    "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed")
    default_pod_spec(template.setdefault("spec", {}))
    job.setdefault("status", {})


# --- scheduling ---------------------------------------------------------------------------------


def tolerates(toleration: Obj, taint: Obj) -> bool:
    """v1.Toleration.ToleratesTaint: effect empty matches all effects, key empty (operator
    Exists) matches all keys; operator empty means Equal."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Exists":
        return True
    return op == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def tolerated(tolerations: list[Obj], taint: Obj) -> bool:
    return any(tolerates(t, taint) for t in tolerations)


def node_taints(node: Obj) -> list[Obj]:
    """The node's taints, with the one the node lifecycle controller adds to a node whose
    Ready condition is not True (not-ready for False, unreachable for Unknown)."""
    taints = list((node.get("spec") or {}).get("taints") or [])
    ready = next((c for c in (node.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), None)
    status = ready.get("status") if ready else "Unknown"
    if status != "True":
        key = "node.kubernetes.io/not-ready" if status == "False" else (
            "node.kubernetes.io/unreachable")
        if not any(t.get("key") == key for t in taints):
            taints.append({"key": key, "effect": "NoSchedule"})
    return taints


def _expression_matches(expr: Obj, value: str | None) -> bool:
    op, values = expr.get("operator"), [str(v) for v in expr.get("values") or []]
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            have, want = int(value), int(values[0])
        except ValueError:
            return False
        return have > want if op == "Gt" else have < want
    return False


def affinity_matches(pod_spec: Obj, node: Obj) -> bool:
    """nodeSelector and requiredDuringSchedulingIgnoredDuringExecution (terms ORed, the
    expressions of a term ANDed; an empty term matches nothing)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in (pod_spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if not required:
        return True
    name = (node.get("metadata") or {}).get("name")
    for term in required.get("nodeSelectorTerms") or []:
        exprs = term.get("matchExpressions") or []
        fields = term.get("matchFields") or []
        if not exprs and not fields:
            continue
        if all(_expression_matches(e, labels.get(e.get("key"))) for e in exprs) and all(
                _expression_matches(f, name if f.get("key") == "metadata.name" else None)
                for f in fields):
            return True
    return False


def unfit_reason(pod_spec: Obj, node: Obj) -> str | None:
    """Why the default scheduler's filters reject ``node`` for the pod (the first failing
    plugin, in the profile's order), in the scheduler's words; None if it fits."""
    tolerations = pod_spec.get("tolerations") or []
    if (node.get("spec") or {}).get("unschedulable") and not tolerated(
            tolerations, {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}):
        return "node(s) were unschedulable"
    for taint in node_taints(node):
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerated(
                tolerations, taint):
            return (f"node(s) had untolerated taint {{{taint.get('key', '')}: "
                    f"{taint.get('value', '')}}}")
    if not affinity_matches(pod_spec, node):
        return "node(s) didn't match Pod's node affinity/selector"
    return None


def schedule(pod_spec: Obj, nodes: list[Obj]) -> tuple[str | None, str]:
    """(the node to bind to, "") or (None, the scheduler's FailedScheduling message)."""
    reasons: dict[str, int] = {}
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        why = unfit_reason(pod_spec, node)
        if why is None:
            return node["metadata"]["name"], ""
        reasons[why] = reasons.get(why, 0) + 1
    if not nodes:
        return None, "no nodes available to schedule pods"
    n = len(nodes)
    shown = ", ".join(sorted(f"{count} {why}" for why, count in reasons.items()))
    # Every reason here is UnschedulableAndUnresolvable, so preemption cannot help anywhere.
    return None, (f"0/{n} nodes are available: {shown}. preemption: 0/{n} nodes are "
                  f"available: {n} Preemption is not helpful for scheduling.")


# --- the kubelet's side of a pod ------------------------------------------------------------


class PodLog:
    """A container's output, the last LOG_CAP bytes of it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lock = threading.Lock()

    def append(self, chunk: bytes) -> None:
        with self.lock:
            self.data += chunk
            if len(self.data) > LOG_CAP:
                del self.data[: len(self.data) - LOG_CAP]

    def read(self) -> bytes:
        with self.lock:
            return bytes(self.data)


@dataclass
class Running:
    namespace: str
    name: str
    proc: subprocess.Popen[bytes]
    reader: threading.Thread
    started: str
    container_id: str
    restarts: int = 0
    last_state: Obj = field(default_factory=dict)  # the previous run's end, after a restart


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the container's whole process group (what stopping a container's cgroup does)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


_VAR_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args ($$ escapes; unknown refs stay)."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR_REF.sub(sub, text)


def _owner(obj: Obj, kind: str = "Job") -> Obj | None:
    return next((o for o in (obj.get("metadata") or {}).get("ownerReferences") or []
                 if o.get("controller") and o.get("kind") == kind), None)


def _condition(type_: str, status: str, reason: str = "", message: str = "") -> Obj:
    ts = now_iso()
    out: Obj = {"type": type_, "status": status, "lastProbeTime": None,
                "lastTransitionTime": ts}
    if reason:
        out["reason"] = reason
    if message:
        out["message"] = message
    return out


def _set_condition(conditions: list[Obj], new: Obj) -> list[Obj]:
    """Replace the condition of that type; an unchanged status keeps its transition time."""
    old = next((c for c in conditions if c.get("type") == new["type"]), None)
    if old is not None and old.get("status") == new["status"]:
        new = {**new, "lastTransitionTime": old.get("lastTransitionTime")}
    return [*(c for c in conditions if c.get("type") != new["type"]), new]


def _has(conditions: list[Obj], type_: str) -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conditions)


class Workloads:
    """The controllers and kubelets of the test cluster. ``run`` False: only what the API
    server itself does (log reads, deletion propagation) is used; no thread runs."""

    def __init__(self, server: K8sTestServer, run: bool = False, interval: float = 0.1) -> None:
        self.server = server
        self.run = run
        self.interval = interval
        self.running: dict[str, Running] = {}  # pod uid -> its running container
        self.logs: dict[str, PodLog] = {}  # pod uid -> its log
        # Job uid -> pod uid -> "succeeded"/"failed": the outcomes counted so far (the real
        # controller keeps them through finalizers; a deleted pod stays counted).
        self.counted: dict[str, dict[str, str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workdir: str | None = None

    # --- lifecycle ---

    def start(self) -> None:
        if not self.run or (self._thread is not None and self._thread.is_alive()):
            return
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="k8s-test-pods-")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="k8s-test-workloads",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self.server.cond:
            running, self.running = self.running, {}
        for run in running.values():
            _kill_group(run.proc)
            run.reader.join(timeout=2)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as e:  # keep the cluster alive; a bug shows in the server's log
                print(f"k8s test server workloads: {type(e).__name__}: {e}", flush=True)

    def tick(self) -> None:
        """One pass of the kubelet, the scheduler and the job controller."""
        with self.server.cond:
            if self.server.stopping:
                return
            self._reap()
            self._schedule()
            self._start_pods()
            self._sync_jobs()

    # --- hooks the API server calls ---

    def pod_deleted(self, pod: Obj) -> None:
        """A pod is gone from the API: its kubelet kills the containers (no grace period)."""
        uid = pod["metadata"].get("uid", "")
        run = self.running.pop(uid, None)
        self.logs.pop(uid, None)
        if run is not None:
            _kill_group(run.proc)

    def job_deleted(self, job: Obj, policy: str) -> None:
        """The garbage collector's share of deleting a Job: Background/Foreground delete its
        pods, Orphan (batch/v1's default) leaves them without the owner reference."""
        meta = job["metadata"]
        uid, ns = meta.get("uid"), meta.get("namespace", "default")
        self.counted.pop(str(uid), None)
        for (pns, name), pod in list(self.server.objects["pods"].items()):
            refs = pod["metadata"].get("ownerReferences") or []
            if pns != ns or not any(r.get("uid") == uid for r in refs):
                continue
            if policy in ("Background", "Foreground"):
                self.server.delete("pods", pns, name)
            else:
                pod = copy.deepcopy(pod)
                kept = [r for r in refs if r.get("uid") != uid]
                if kept:
                    pod["metadata"]["ownerReferences"] = kept
                else:
                    pod["metadata"].pop("ownerReferences", None)
                self.server.replace("pods", pod)

    def read_log(self, pod: Obj, params: dict[str, str]) -> str:
        """GET pods/{name}/log: the API server's container checks, then what the kubelet
        has (its log so far; nothing for a pod it did not run)."""
        meta, spec = pod["metadata"], pod.get("spec") or {}
        name = meta["name"]
        containers = [c.get("name", "") for c in spec.get("containers") or []]
        inits = [c.get("name", "") for c in spec.get("initContainers") or []]
        container = params.get("container") or ""
        if not container:
            if len(containers) != 1:
                message = (f"a container name must be specified for pod {name}, choose one "
                           f"of: [{' '.join(containers)}]")
                if inits:
                    message += f" or one of the init containers: [{' '.join(inits)}]"
                raise ApiError(400, message)
            container = containers[0]
        elif container not in containers + inits:
            raise ApiError(400, f"container {container} is not valid for pod {name}")
        if not spec.get("nodeName"):
            return ""  # no node to ask yet: the API server streams nothing
        uid = meta.get("uid", "")
        log = self.logs.get(uid)
        if log is None:
            if self.run and _owner(pod) is not None and (
                    (pod.get("status") or {}).get("phase") in (None, "Pending")):
                raise ApiError(400, f'container "{container}" in pod "{name}" is waiting to '
                               "start: ContainerCreating")
            return ""  # a pod this server did not run (a seed): no output to show
        if container != containers[0]:
            return ""  # only the first container runs
        if params.get("previous") in ("1", "t", "T", "true", "TRUE", "True"):
            run = self.running.get(uid)
            if run is None or not run.restarts:
                raise ApiError(400, f'previous terminated container "{container}" in pod '
                               f'"{name}" not found')
        data = log.read()
        tail = params.get("tailLines")
        if tail not in (None, ""):
            n = _nonnegative(tail, "tailLines")
            data = b"".join(data.splitlines(keepends=True)[-n:]) if n else b""
        limit = params.get("limitBytes")
        if limit not in (None, ""):
            n = _nonnegative(limit, "limitBytes")
            if n < 1:
                raise ApiError(422, "PodLogOptions \"\" is invalid: limitBytes: Invalid value: "
                               f"{n}: must be greater than 0")
            data = data[:n]
        return data.decode("utf-8", "replace")

    # --- the kubelet ---

    def _pod(self, namespace: str, name: str, uid: str) -> Obj | None:
        pod = self.server.objects["pods"].get((namespace, name))
        return pod if pod is not None and pod["metadata"].get("uid") == uid else None

    def _reap(self) -> None:
        """Exited containers: the pod's status says so (or OnFailure restarts them)."""
        for uid, run in list(self.running.items()):
            code = run.proc.poll()
            if code is None:
                continue
            # The container's other processes die with it, and its output is complete.
            _kill_group(run.proc)
            run.reader.join(timeout=2)
            del self.running[uid]
            pod = self._pod(run.namespace, run.name, uid)
            if pod is None:
                continue
            pod = copy.deepcopy(pod)
            finished = now_iso()
            terminated = {"exitCode": code if code >= 0 else 128 - code,
                          "reason": "Completed" if code == 0 else "Error",
                          "startedAt": run.started, "finishedAt": finished,
                          "containerID": run.container_id}
            if code != 0 and pod["spec"].get("restartPolicy") == "OnFailure":
                self._start(pod, restarts=run.restarts + 1,
                            last_state={"terminated": terminated})
                continue
            self._finish(pod, terminated, run.restarts, run.last_state)

    def _finish(self, pod: Obj, terminated: Obj, restarts: int,
                last_state: Obj | None = None) -> None:
        succeeded = terminated.get("exitCode") == 0
        status = pod.setdefault("status", {})
        status["phase"] = "Succeeded" if succeeded else "Failed"
        reason = "PodCompleted" if succeeded else "PodFailed"
        conditions = status.get("conditions") or []
        for type_ in ("PodReadyToStartContainers", "Ready", "ContainersReady"):
            conditions = _set_condition(conditions, _condition(
                type_, "False", "" if type_ == "PodReadyToStartContainers" else reason))
        status["conditions"] = conditions
        container = pod["spec"]["containers"][0]
        status["containerStatuses"] = [{
            "name": container.get("name", ""), "image": container.get("image", ""),
            "imageID": _image_id(container.get("image", "")),
            "containerID": terminated.get("containerID", ""), "ready": False,
            "started": False, "restartCount": restarts, "lastState": last_state or {},
            "state": {"terminated": terminated}}]
        self.server.replace("pods", pod)

    def _start_pods(self) -> None:
        for pod in list(self.server.objects["pods"].values()):
            meta, spec = pod["metadata"], pod.get("spec") or {}
            if (_owner(pod) is None or not spec.get("nodeName")
                    or meta.get("uid") in self.running
                    or (pod.get("status") or {}).get("phase") not in (None, "Pending")):
                continue
            node = self.server.objects["nodes"].get(("", spec["nodeName"]))
            if node is None or any(t.get("key") in ("node.kubernetes.io/not-ready",
                                                    "node.kubernetes.io/unreachable")
                                   for t in node_taints(node)):
                continue  # no kubelet there to run it (yet)
            self._start(copy.deepcopy(pod))

    def _start(self, pod: Obj, restarts: int = 0, last_state: Obj | None = None) -> None:
        """Run the pod's first container as a local process group and mark the pod Running
        (or Failed with StartError when there is nothing it can run)."""
        meta, spec = pod["metadata"], pod["spec"]
        uid, name = meta["uid"], meta["name"]
        container = spec["containers"][0]
        env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
               "HOSTNAME": name}
        for var in container.get("env") or []:
            if var.get("name") and "valueFrom" not in var:
                env[var["name"]] = expand(str(var.get("value") or ""), env)
        argv = [expand(str(a), env) for a in
                (container.get("command") or []) + (container.get("args") or [])]
        started = now_iso()
        container_id = f"containerd://{secrets.token_hex(32)}"
        log = self.logs.setdefault(uid, PodLog())
        failure = ""
        if not container.get("command"):
            failure = ("failed to create containerd task: the FleetWatch test server runs a "
                       "container's command on the test machine and ignores the image "
                       f"{container.get('image', '')!r}: this container has no command")
        else:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, env=env, cwd=self._workdir,
                                        start_new_session=True)
            except OSError as e:
                failure = ("failed to create containerd task: failed to create shim task: OCI "
                           "runtime create failed: runc create failed: unable to start "
                           f'container process: exec: "{argv[0]}": '
                           + ("executable file not found in $PATH"
                              if isinstance(e, FileNotFoundError) else str(e.strerror))
                           + ": unknown")
        self._bind_status(pod)
        if failure:
            self._finish(pod, {"exitCode": 128, "reason": "StartError", "message": failure,
                               "startedAt": "1970-01-01T00:00:00Z", "finishedAt": started,
                               "containerID": container_id}, restarts, last_state)
            return
        reader = threading.Thread(target=_pump, args=(proc, log), daemon=True,
                                  name=f"log-{name}")
        reader.start()
        self.running[uid] = Running(meta["namespace"], name, proc, reader, started,
                                    container_id, restarts, last_state or {})
        status = pod["status"]
        status["phase"] = "Running"
        conditions = status.get("conditions") or []
        for type_ in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady",
                      "PodScheduled"):
            conditions = _set_condition(conditions, _condition(type_, "True"))
        status["conditions"] = conditions
        status["containerStatuses"] = [{
            "name": container.get("name", ""), "image": container.get("image", ""),
            "imageID": _image_id(container.get("image", "")), "containerID": container_id,
            "ready": True, "started": True, "restartCount": restarts,
            "lastState": last_state or {}, "state": {"running": {"startedAt": started}}}]
        self.server.replace("pods", pod)

    def _bind_status(self, pod: Obj) -> None:
        status = pod.setdefault("status", {})
        status.setdefault("startTime", now_iso())
        status.setdefault("hostIP", "10.0.0.1")
        status.setdefault("hostIPs", [{"ip": "10.0.0.1"}])
        ip = f"10.244.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 2}"
        status.setdefault("podIP", ip)
        status.setdefault("podIPs", [{"ip": status["podIP"]}])
        status.setdefault("qosClass", "BestEffort")
        conditions = status.get("conditions") or []
        for type_ in ("Initialized", "PodScheduled"):
            conditions = _set_condition(conditions, _condition(type_, "True"))
        status["conditions"] = conditions

    # --- the scheduler ---

    def _schedule(self) -> None:
        nodes = list(self.server.objects["nodes"].values())
        for pod in list(self.server.objects["pods"].values()):
            spec = pod.get("spec") or {}
            status = pod.get("status") or {}
            if (_owner(pod) is None or spec.get("nodeName")
                    or status.get("phase") not in (None, "Pending")):
                continue
            node, message = schedule(spec, nodes)
            pod = copy.deepcopy(pod)
            conditions = pod.setdefault("status", {}).get("conditions") or []
            if node is not None:
                pod["spec"]["nodeName"] = node
                pod["status"]["conditions"] = _set_condition(
                    conditions, _condition("PodScheduled", "True"))
                self.server.replace("pods", pod)
                continue
            old = next((c for c in conditions if c.get("type") == "PodScheduled"), None)
            if old is not None and old.get("message") == message and old.get(
                    "status") == "False":
                continue  # already says so: no new resourceVersion for nothing
            pod["status"]["phase"] = "Pending"
            pod["status"]["conditions"] = _set_condition(conditions, _condition(
                "PodScheduled", "False", "Unschedulable", message))
            self.server.replace("pods", pod)

    # --- the job controller ---

    def _new_pod(self, job: Obj) -> None:
        meta = job["metadata"]
        template = copy.deepcopy(job["spec"].get("template") or {})
        tmeta = template.get("metadata") or {}
        pod_meta: Obj = {
            "name": f"{meta['name']}-{random_suffix()}", "generateName": f"{meta['name']}-",
            "namespace": meta.get("namespace", "default"),
            "labels": dict(tmeta.get("labels") or {}),
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                 "uid": meta["uid"], "controller": True,
                                 "blockOwnerDeletion": True}]}
        if tmeta.get("annotations"):
            pod_meta["annotations"] = dict(tmeta["annotations"])
        spec = template.get("spec") or {}
        default_pod_spec(spec)
        self.server.create("pods", {"metadata": pod_meta, "spec": spec, "status": {
            "phase": "Pending", "qosClass": "BestEffort"}})

    def _sync_jobs(self) -> None:
        now = time.time()
        pods_by_owner: dict[str, list[Obj]] = {}
        for pod in self.server.objects["pods"].values():
            ref = _owner(pod)
            if ref is not None:
                pods_by_owner.setdefault(str(ref.get("uid")), []).append(pod)
        for (ns, name), job in list(self.server.objects["jobs"].items()):
            try:
                self._sync_job(job, pods_by_owner.get(job["metadata"]["uid"], []), now)
            except (KeyError, TypeError, ValueError) as e:  # a malformed seed: skip it
                print(f"k8s test server: job {ns}/{name}: {type(e).__name__}: {e}", flush=True)

    def _sync_job(self, job: Obj, pods: list[Obj], now: float) -> None:
        meta, spec = job["metadata"], job.get("spec") or {}
        old_status = job.get("status") or {}
        status = copy.deepcopy(old_status)
        conditions: list[Obj] = list(status.get("conditions") or [])
        if _has(conditions, "Complete") or _has(conditions, "Failed"):
            ttl = spec.get("ttlSecondsAfterFinished")
            done = next((parse_time(c.get("lastTransitionTime")) for c in conditions
                         if c.get("type") in ("Complete", "Failed")), None)
            if ttl is not None and done is not None and now >= done + float(ttl):
                gone = self.server.delete("jobs", meta.get("namespace", "default"),
                                          meta["name"])
                if gone is not None:
                    self.job_deleted(gone, "Background")
            return
        counted = self.counted.setdefault(meta["uid"], {})
        for pod in pods:
            phase = (pod.get("status") or {}).get("phase")
            if phase in FINISHED:
                counted[pod["metadata"]["uid"]] = "succeeded" if phase == "Succeeded" else (
                    "failed")
        active = [p for p in pods if (p.get("status") or {}).get("phase") not in FINISHED]
        succeeded = sum(1 for v in counted.values() if v == "succeeded")
        failed = sum(1 for v in counted.values() if v == "failed")
        completions = spec.get("completions")
        parallelism = int(spec["parallelism"]) if spec.get("parallelism") is not None else 1
        backoff = int(spec["backoffLimit"]) if spec.get("backoffLimit") is not None else 6
        template_spec = (spec.get("template") or {}).get("spec") or {}

        if spec.get("suspend"):
            for pod in active:
                self.server.delete("pods", pod["metadata"]["namespace"],
                                   pod["metadata"]["name"])
            active = []
            conditions = _set_condition(conditions, _condition(
                "Suspended", "True", "JobSuspended", "Job suspended"))
            status.pop("startTime", None)
        else:
            if _has(conditions, "Suspended"):
                conditions = _set_condition(conditions, _condition(
                    "Suspended", "False", "JobResumed", "Job resumed"))
            failure: tuple[str, str] | None = None
            started = parse_time(status.get("startTime"))
            deadline = spec.get("activeDeadlineSeconds")
            restarts = sum(int(cs.get("restartCount") or 0) for p in active
                           for cs in (p.get("status") or {}).get("containerStatuses") or [])
            if deadline is not None and started is not None and now >= started + deadline:
                failure = ("DeadlineExceeded", "Job was active longer than specified deadline")
            elif failed > backoff or (template_spec.get("restartPolicy") == "OnFailure" and (
                    restarts > 0 if backoff == 0 else restarts >= backoff)):
                failure = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
            done = (completions is not None and succeeded >= int(completions)) or (
                completions is None and succeeded > 0 and not active)
            if failure is not None or done:
                # The job is over: what still runs is stopped, as the controller does.
                for pod in active:
                    self.server.delete("pods", pod["metadata"]["namespace"],
                                       pod["metadata"]["name"])
                active = []
                if failure is not None:
                    for type_ in ("FailureTarget", "Failed"):
                        conditions = _set_condition(conditions, _condition(type_, "True",
                                                                           *failure))
                else:
                    for type_ in ("SuccessCriteriaMet", "Complete"):
                        conditions = _set_condition(conditions, _condition(
                            type_, "True", "CompletionsReached",
                            "Reached expected number of succeeded pods"))
                    status["completionTime"] = now_iso()
            else:
                want = parallelism if completions is None else min(
                    parallelism, int(completions) - succeeded)
                if not status.get("startTime"):
                    status["startTime"] = now_iso()
                for _ in range(max(0, want - len(active))):
                    self._new_pod(job)
                active = [p for p in self.server.objects["pods"].values()
                          if (_owner(p) or {}).get("uid") == meta["uid"]
                          and (p.get("status") or {}).get("phase") not in FINISHED]
        status["active"] = len(active)
        status["ready"] = sum(1 for p in active if any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (p.get("status") or {}).get("conditions") or []))
        status["terminating"] = 0
        status["uncountedTerminatedPods"] = {}
        for key, value in (("succeeded", succeeded), ("failed", failed)):
            if value:
                status[key] = value
            else:
                status.pop(key, None)
        if not status["active"]:
            status.pop("active")  # omitempty, as Go writes it
        if conditions:
            status["conditions"] = conditions
        if status != old_status:
            self.server.replace("jobs", {**copy.deepcopy(job), "status": status})


def _nonnegative(text: str, name: str) -> int:
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ApiError(400, f'strconv.ParseInt: parsing "{text}": invalid syntax')
    value = int(text)
    if value < 0:
        raise ApiError(422, f'PodLogOptions "" is invalid: {name}: Invalid value: {value}: '
                       "must be greater than or equal to 0")
    return value


def _image_id(image: str) -> str:
    digest = hashlib.sha256(image.encode()).hexdigest()
    return f"{image.rsplit(':', 1)[0]}@sha256:{digest}" if image else ""


def _pump(proc: subprocess.Popen[bytes], log: PodLog) -> None:
    """Copy the container's merged stdout/stderr into its log until EOF."""
    stream = proc.stdout
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError):
        while True:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                break
            log.append(chunk)
    with contextlib.suppress(OSError):
        stream.close()
