"""An API-compatible Kubernetes API server for tests: real ``kubectl`` and the official Python
client talk to it as they would to a cluster.

No API server can be installed on the test machines, so this serves the part of the API that
FleetWatch and an operator's ``kubectl get/cordon/uncordon/drain`` use, with the semantics
that matter to them:

- discovery (``/version``, ``/api``, ``/api/v1``, ``/apis``, ``/apis/{group}[/{version}]``;
  groups apps, batch, events.k8s.io, policy),
  legacy (unaggregated) only: kubectl asks for aggregated discovery first and falls back when
  the answer is a plain ``APIVersions``/``APIGroupList``, as against an older server;
- nodes, pods, namespaces, core/v1 events, events.k8s.io/v1 events (one store, converted on
  the way out, so an event has the same uid through both APIs, as in a real cluster),
  policy/v1 PodDisruptionBudgets (status computed as the disruption controller would),
  apps/v1 DaemonSets (kubectl drain looks a DaemonSet pod's owner up) and batch/v1 Jobs
  (created with the API server's defaults: the generated ``batch.kubernetes.io/controller-uid``
  selector and the template's job-name/controller-uid labels, parallelism/completions 1,
  backoffLimit 6, ...; ``kubectl get jobs`` columns as in 1.32);
- get, list (label and field selectors, ``limit``/``continue``), watch (``resourceVersion``,
  ``allowWatchBookmarks``, ``timeoutSeconds``, 410 Gone as an ERROR event), create, replace,
  delete, JSON/merge/strategic-merge patch (``metadata.resourceVersion`` in a patch is a
  precondition, as on the real server), the ``status`` subresource,
  ``pods/eviction`` honouring PodDisruptionBudgets (429 TooManyRequests), and ``pods/log``
  (``text/plain``; ``container``, ``tailLines``, ``limitBytes``; the API server's 400s for an
  unknown container or one still waiting to start; empty for a pod this server did not run
  or that has no node yet). Deleting a Job propagates as the garbage collector would:
  ``propagationPolicy`` Background/Foreground (body or query) deletes its pods, Orphan or
  none (batch/v1's default) leaves them without the owner reference;
- ``meta.k8s.io/v1`` Tables when the client asks for them, so ``kubectl get`` prints columns;
- the API server's refusals, in its words (``k8s_rules.py``): a malformed label or field
  selector or an unsupported field label is a 400 BadRequest; a body that does not decode into
  the Go type a 400 (create/update) or a 422 on ``patch``; invalid names, label keys and values,
  annotation keys, taints, pod containers, a Job's restartPolicy (OnFailure or Never), its
  counts and its template labels (which hold a Job's name to 63 characters) a 422 Invalid
  with ``details.causes``; a body in a media type it cannot read a 415 (JSON is read, and
  protobuf for batch/v1 Jobs only, as ``kubectl create job`` sends: ``k8s_proto.py``).
  Seeds and the control API below are taken as given (they play the kubelet and the
  controllers), and objects are served with the fields Go always writes (full
  ``status.nodeInfo``, container ``image``/``imageID``, ...), so the official client's typed
  models read them.

What it does not do: authorization beyond one bearer token (plus an optional read-only token
that gets 403 on writes), admission (a namespace need not exist), the update rules of
validation (a pod's spec, a Job's template may change), YAML bodies, server-side apply,
finalizers, graceful deletion (a deleted or evicted pod is gone at once, as if its kubelet
had finished instantly; Foreground deletion of a Job too), consistent snapshots for
``continue`` (a continued list reads the current state; a continue token older than the
compaction point gets 410 as on the real server), protobuf beyond Jobs, following a log
(``follow`` returns what there is so far), and OpenAPI beyond a v3 stub: ``/openapi/v3`` lists
each kind's PATCH with the ``fieldValidation`` parameter, so ``kubectl create -f`` leaves
validation to the server; the parameter is accepted but unknown fields are not reported, and
there are no schemas (``kubectl explain`` does not work; v2 is a 404).

Running pods (``run_pods=True``, CLI ``--run-pods``; off by default, when nothing acts on a
Job): a job controller, a scheduler and a kubelet stand-in in ``k8s_workloads.py`` (see its
docstring) run each Job's pod as a LOCAL PROCESS ON THE TEST MACHINE: the first container's
``command`` + ``args`` with its ``env``; THE IMAGE IS IGNORED (a container without
``command`` fails with StartError). Only Job-owned pods are scheduled and run; seeded and
other pods stay as given. A pod pinned to a tainted, cordoned or NotReady node stays Pending
(``PodScheduled`` False, ``Unschedulable``, the scheduler's message) until it fits. Jobs end
Complete or Failed (BackoffLimitExceeded, DeadlineExceeded) with the 1.32 conditions;
``ttlSecondsAfterFinished`` deletes them.

A small test-only control API under ``/_test/`` (and the same on the Python object) changes
the cluster as a kubelet or a controller would: a node's Ready condition, a pod's readiness,
a new event, and compaction of the watch history (so a test can force 410 Gone).

Node pools (``pools=`` or the seed's ``"pools"``): a stand-in for a cloud's node-pool
controller or the cluster-autoscaler, which this server otherwise lacks. With
``pools={"gpu": {"spares": ["gpu-017", "gpu-018"], "delay": 1.0, "ready_delay": 0.5}}``, when a
Node labelled ``<pool_label>=gpu`` (``fleetwatch.io/pool`` unless the pool names its own
``"label"``) is deleted, the next spare name joins the pool ``delay`` seconds later as a new
Node with the same pool label (an ADDED watch event, as when a new VM's kubelet registers),
Ready at once or, with ``ready_delay``, NotReady first and Ready that much later (MODIFIED).
No spares left: nothing joins (a pool at its maximum size). ``provisioned`` lists what it did.

Run: ``python -m tests.harness.k8s_server --port 0 --seed seed.json --kubeconfig out.yaml
[--run-pods]`` (prints the port); or ``K8sTestServer(seed, run_pods=True).start()`` from
Python (``stop()`` kills what still runs).
"""

from __future__ import annotations

import argparse
import base64
import bisect
import contextlib
import copy
import hashlib
import json
import math
import re
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.harness import k8s_proto, k8s_rules, k8s_workloads
from tests.harness.k8s_rules import ApiError, SelectorError
from tests.harness.k8s_workloads import now_iso, parse_time  # one clock for server and kubelet

Obj = dict[str, Any]

SERVER_VERSION = {
    "major": "1", "minor": "32", "gitVersion": "v1.32.0-fleetwatch-test",
    "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.23.4", "compiler": "gc",
    "platform": "linux/amd64",
}
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


def now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def go_bool(value: str | None) -> bool:
    """A query flag as the API server parses it (Go's strconv.ParseBool: true, True, 1, t)."""
    return (value or "") in ("1", "t", "T", "true", "TRUE", "True")


def query_int(params: dict[str, str], name: str) -> int:
    """An int64 query parameter as the API server decodes it: a 400 in strconv's words."""
    text = params.get(name) or ""
    if not text:
        return 0
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ApiError(400, f'strconv.ParseInt: parsing {k8s_rules.go_quote(text)}: invalid '
                       "syntax")
    if not -2**63 <= int(text) < 2**63:
        raise ApiError(400, f'strconv.ParseInt: parsing {k8s_rules.go_quote(text)}: value out '
                       "of range")
    return int(text)


# --- the API surface -----------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    store: str  # where the objects live (both event APIs share one store)
    short_names: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
RESOURCES = [
    Resource("", "v1", "namespaces", "Namespace", False, "namespaces", ("ns",), ("status",)),
    Resource("", "v1", "nodes", "Node", False, "nodes", ("no",), ("status",)),
    Resource("", "v1", "pods", "Pod", True, "pods", ("po",), ("status", "eviction", "log"),
             ("all",)),
    Resource("", "v1", "events", "Event", True, "events", ("ev",)),
    Resource("events.k8s.io", "v1", "events", "Event", True, "events", ("ev",)),
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True,
             "poddisruptionbudgets", ("pdb",), ("status",)),
    Resource("apps", "v1", "daemonsets", "DaemonSet", True, "daemonsets", ("ds",), ("status",),
             ("all",)),
    Resource("batch", "v1", "jobs", "Job", True, "jobs", (), ("status",), ("all",)),
]
GROUPS = ["apps", "batch", "events.k8s.io", "policy"]
STATUS_STORES = {"nodes", "pods", "poddisruptionbudgets", "daemonsets", "namespaces", "jobs"}


def find_resource(group: str, version: str, plural: str) -> Resource | None:
    for r in RESOURCES:
        if (r.group, r.version, r.plural) == (group, version, plural):
            return r
    return None


def resource_list(group: str, version: str) -> Obj | None:
    members = [r for r in RESOURCES if (r.group, r.version) == (group, version)]
    if not members:
        return None
    resources: list[Obj] = []
    for r in members:
        entry: Obj = {"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                      "kind": r.kind, "verbs": VERBS, "storageVersionHash": r.kind}
        if r.short_names:
            entry["shortNames"] = list(r.short_names)
        if r.categories:
            entry["categories"] = list(r.categories)
        resources.append(entry)
        for sub in r.subresources:
            if sub == "eviction":
                # kubectl drain finds the Eviction API through this entry's group/version.
                resources.append({"name": f"{r.plural}/eviction", "singularName": "",
                                  "namespaced": True, "group": "policy", "version": "v1",
                                  "kind": "Eviction", "verbs": ["create"]})
            elif sub == "log":
                resources.append({"name": f"{r.plural}/log", "singularName": "",
                                  "namespaced": True, "kind": "Pod", "verbs": ["get"]})
            else:
                resources.append({"name": f"{r.plural}/{sub}", "singularName": "",
                                  "namespaced": r.namespaced, "kind": r.kind,
                                  "verbs": ["get", "patch", "update"]})
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
            "resources": resources}


def _openapi_gv_doc(group: str, version: str) -> Obj:
    """A group/version's OpenAPI v3 document, reduced to what kubectl reads of it: each
    kind's PATCH operation with its GVK and the fieldValidation parameter (kubectl's
    server-side validation check). No schemas: the server validates, as with --validate=strict
    against a real one."""
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    paths: Obj = {}
    for r in RESOURCES:
        if (r.group, r.version) != (group, version):
            continue
        at = f"{base}/namespaces/{{namespace}}/{r.plural}/{{name}}" if r.namespaced else (
            f"{base}/{r.plural}/{{name}}")
        paths[at] = {"patch": {
            "x-kubernetes-group-version-kind": {"group": group, "version": version,
                                                "kind": r.kind},
            "parameters": [{"name": "fieldValidation", "in": "query",
                            "schema": {"type": "string", "uniqueItems": True}}],
            "responses": {"200": {"description": "OK"}}}}
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"},
            "paths": paths, "components": {"schemas": {}}}


def openapi_v3(rest: list[str]) -> Obj:
    """/openapi/v3 (the index of group/versions) and /openapi/v3/{api|apis/group}/{version}."""
    gvs = sorted({(r.group, r.version) for r in RESOURCES})
    if not rest:
        index: Obj = {}
        for group, version in gvs:
            key = f"apis/{group}/{version}" if group else f"api/{version}"
            digest = hashlib.sha256(json.dumps(_openapi_gv_doc(group, version)).encode())
            index[key] = {"serverRelativeURL": f"/openapi/v3/{key}?hash="
                                               f"{digest.hexdigest()[:32].upper()}"}
        return {"paths": index}
    wanted = ("", rest[1]) if rest[0] == "api" and len(rest) == 2 else (
        (rest[1], rest[2]) if rest[0] == "apis" and len(rest) == 3 else None)
    if wanted not in gvs:
        raise ApiError(404, "the server could not find the requested resource")
    return _openapi_gv_doc(*wanted)


def api_group(name: str) -> Obj:
    gv = {"groupVersion": f"{name}/v1", "version": "v1"}
    return {"kind": "APIGroup", "apiVersion": "v1", "name": name, "versions": [gv],
            "preferredVersion": gv}


def not_found(r: Resource, name: str) -> ApiError:
    group = f".{r.group}" if r.group else ""
    return ApiError(404, f'{r.plural}{group} "{name}" not found',
                    details={"name": name, "group": r.group, "kind": r.plural})


def conflict(r: Resource, name: str) -> ApiError:
    return ApiError(409, f'Operation cannot be fulfilled on {r.plural} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try "
                    "again", details={"name": name, "group": r.group, "kind": r.plural})


# --- selectors ------------------------------------------------------------------------------


def label_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A ``labelSelector`` parsed as the API server parses it (SelectorError if malformed)."""
    return k8s_rules.label_matcher(text)


def selector_object_matches(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A ``metav1.LabelSelector``: null matches nothing, ``{}`` matches everything."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (
                op == "NotIn" and key in labels and labels[key] in values) or (
                op == "Exists" and key not in labels) or (
                op == "DoesNotExist" and key in labels):
            return False
    return True


# The field selectors each resource supports on the real server (others are a 400).
FIELDS = {
    "nodes": {"metadata.name", "spec.unschedulable"},
    "namespaces": {"metadata.name", "status.phase"},
    "pods": {"metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy",
             "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork",
             "status.phase", "status.podIP", "status.nominatedNodeName"},
    "events": {"metadata.name", "metadata.namespace", "involvedObject.kind",
               "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
               "involvedObject.apiVersion", "involvedObject.resourceVersion",
               "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"},
    "poddisruptionbudgets": {"metadata.name", "metadata.namespace"},
    "daemonsets": {"metadata.name", "metadata.namespace"},
    "jobs": {"metadata.name", "metadata.namespace", "status.successful"},
}
# events.k8s.io/v1 names the same fields its own way.
EVENTS_V1_FIELDS = {"regarding.": "involvedObject.", "reportingController": "reportingComponent",
                    "deprecatedSource": "source"}


def _dig(obj: Obj, path: str) -> str:
    if path == "status.successful":  # a Job's field label for status.succeeded
        return str((obj.get("status") or {}).get("succeeded") or 0)
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if path == "source" and isinstance(value, dict):
        value = value.get("component")
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


# The kinds whose field labels core/v1 converts itself ("field label not supported: x"); the
# others answer with the generic metadata.name/metadata.namespace message.
CONVERTED_FIELD_KINDS = {"nodes", "namespaces", "pods", "events", "jobs"}


def field_selector(text: str, r: Resource) -> Callable[[Obj], bool]:
    """A ``fieldSelector`` as the API server takes it: parsed (SelectorError if malformed), then
    every field checked against what the resource indexes (ApiError 400 if not)."""
    tests: list[Callable[[Obj], bool]] = []
    for key, op, value in k8s_rules.parse_field_selector(text):
        if r.group == "events.k8s.io":
            for new, old in EVENTS_V1_FIELDS.items():
                if key.startswith(new):
                    key = old + key[len(new):]
        if key not in FIELDS.get(r.store, set()):
            raise ApiError(400, k8s_rules.unsupported_field(
                key, r.store in CONVERTED_FIELD_KINDS))
        if op == "!=":
            tests.append(lambda o, k=key, v=value: _dig(o, k) != v)
        else:
            tests.append(lambda o, k=key, v=value: _dig(o, k) == v)
    return lambda obj: all(t(obj) for t in tests)


# --- patches --------------------------------------------------------------------------------

# Lists the strategic merge patch merges by a key (the ones in the objects served here).
MERGE_KEYS = {"conditions": "type", "addresses": "type", "containers": "name",
              "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ownerReferences": "uid", "ports": "containerPort",
              "imagePullSecrets": "name", "containerStatuses": "name"}
PRIMITIVE_MERGE = {"finalizers"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    result = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for k, v in patch.items():
        if k.startswith("$setElementOrder/") or k in ("$retainKeys", "$patch"):
            continue
        if k.startswith("$deleteFromPrimitiveList/"):
            key = k.split("/", 1)[1]
            result[key] = [x for x in result.get(key) or [] if x not in v]
            continue
        if v is None:
            result.pop(k, None)
        elif isinstance(v, dict):
            result[k] = strategic_merge_patch(result.get(k), v)
        elif isinstance(v, list) and k in MERGE_KEYS:
            result[k] = _merge_list(result.get(k) or [], v, MERGE_KEYS[k])
        elif isinstance(v, list) and k in PRIMITIVE_MERGE:
            existing = list(result.get(k) or [])
            result[k] = existing + [x for x in v if x not in existing]
        else:
            result[k] = copy.deepcopy(v)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    result = [copy.deepcopy(i) for i in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            result.append(copy.deepcopy(item))
            continue
        at = next((n for n, cur in enumerate(result)
                   if isinstance(cur, dict) and cur.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del result[at]
        elif at is None:
            result.append({k: v for k, v in item.items() if not k.startswith("$")})
        else:
            result[at] = strategic_merge_patch(result[at], item)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(target: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 JSON patch."""
    doc: Any = copy.deepcopy(target)

    def parent(path: str) -> tuple[Any, str]:
        parts = _pointer(path)
        if not parts:
            raise ApiError(422, "cannot patch the whole document")
        node = doc
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        return node, parts[-1]

    def get(path: str) -> Any:
        node = doc
        for p in _pointer(path):
            node = node[int(p)] if isinstance(node, list) else node[p]
        return node

    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        try:
            if kind in ("add", "replace", "copy", "move"):
                value = copy.deepcopy(op.get("value")) if kind in ("add", "replace") else (
                    copy.deepcopy(get(op["from"])))
                if kind == "move":
                    node, last = parent(op["from"])
                    node.pop(int(last)) if isinstance(node, list) else node.pop(last)
                node, last = parent(path)
                if isinstance(node, list):
                    if kind == "replace":
                        node[int(last)] = value
                    else:
                        node.insert(len(node) if last == "-" else int(last), value)
                else:
                    if kind == "replace" and last not in node:
                        raise KeyError(last)
                    node[last] = value
            elif kind == "remove":
                node, last = parent(path)
                node.pop(int(last)) if isinstance(node, list) else node.pop(last)
            elif kind == "test":
                if get(path) != op.get("value"):
                    raise ApiError(422, f"test operation failed at {path}")
            else:
                raise ApiError(422, f"unknown JSON patch operation {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, f"the JSON patch could not be applied at {path!r}: {e}") from None
    return doc


# --- the cluster's objects ------------------------------------------------------------------


def quantity(value: Any, total: int) -> int:
    """An IntOrString (``2`` or ``"50%"``) scaled against ``total``, rounded up."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(total * int(value[:-1]) / 100)
    return int(value)


def pod_ready(pod: Obj) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def node_condition(status: str, reason: str = "", message: str = "") -> Obj:
    ts = now_iso()
    reason = reason or {"True": "KubeletReady", "False": "KubeletNotReady"}.get(
        status, "NodeStatusUnknown")
    message = message or {"True": "kubelet is posting ready status",
                          "False": "container runtime is down"}.get(
        status, "Kubelet stopped posting node status.")
    return {"type": "Ready", "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": ts, "lastTransitionTime": ts}


def expand_node(spec: Obj) -> Obj:
    """A seed node: a full Node object, or the short form {name, labels, ready, ...}."""
    if "metadata" in spec:
        return copy.deepcopy(spec)
    name = spec["name"]
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
              **(spec.get("labels") or {})}
    ready = spec.get("ready", "True")
    ready = {True: "True", False: "False", None: "Unknown"}.get(ready, ready)
    return {
        "metadata": {"name": name, "labels": labels,
                     "annotations": dict(spec.get("annotations") or {})},
        "spec": {"unschedulable": True} if spec.get("unschedulable") else {},
        "status": {
            "conditions": [node_condition(str(ready))],
            "addresses": [{"type": "Hostname", "address": name}],
            "capacity": {"cpu": "96", "memory": "2Ti", "nvidia.com/gpu": str(spec.get("gpus", 8)),
                         "pods": "110"},
            "allocatable": {"cpu": "95", "memory": "2047Gi",
                            "nvidia.com/gpu": str(spec.get("gpus", 8)), "pods": "110"},
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": node_info(name),
        },
    }


def node_info(name: str) -> Obj:
    """status.nodeInfo as a kubelet reports it: every field set (typed clients require them);
    the machine's ids derived from its name, the boot id new at each registration."""
    machine = uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.fleetwatch.test")
    return {"machineID": machine.hex, "systemUUID": str(machine).upper(),
            "bootID": str(uuid.uuid4()), "kernelVersion": "6.1.0-28-amd64",
            "osImage": "Debian GNU/Linux 12 (bookworm)",
            "containerRuntimeVersion": "containerd://1.7.24", "kubeletVersion": "v1.32.0",
            "kubeProxyVersion": "v1.32.0", "operatingSystem": "linux", "architecture": "amd64"}


def expand_pod(spec: Obj) -> Obj:
    """A seed pod: a full Pod, or {namespace, name, node, labels, owner: {kind, name},
    ready, phase, emptyDir, mirror}."""
    if "metadata" in spec:
        return copy.deepcopy(spec)
    meta: Obj = {"name": spec["name"], "namespace": spec.get("namespace", "default"),
                 "labels": dict(spec.get("labels") or {}),
                 "annotations": dict(spec.get("annotations") or {})}
    owner = spec.get("owner")
    if owner:
        meta["ownerReferences"] = [{
            "apiVersion": owner.get("apiVersion", "apps/v1"), "kind": owner["kind"],
            "name": owner["name"], "uid": owner.get("uid", str(uuid.uuid5(
                uuid.NAMESPACE_URL, f"{meta['namespace']}/{owner['kind']}/{owner['name']}"))),
            "controller": True, "blockOwnerDeletion": True}]
    if spec.get("mirror"):
        meta["annotations"][MIRROR_ANNOTATION] = secrets.token_hex(16)
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": spec["node"],
                                    "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, spec["node"])),
                                    "controller": True}]
    volumes = [{"name": "scratch", "emptyDir": {}}] if spec.get("emptyDir") else []
    ready = bool(spec.get("ready", True))
    phase = spec.get("phase", "Running")
    image = spec.get("image", "registry.local/train:latest")
    # What the kubelet reports of a started container: the image by digest and the runtime's id.
    digest = hashlib.sha256(image.encode()).hexdigest()
    container_id = hashlib.sha256(f"{meta['namespace']}/{meta['name']}".encode()).hexdigest()
    started = now_iso()
    return {
        "metadata": meta,
        "spec": {"nodeName": spec["node"], "containers": [
            {"name": "main", "image": image, "imagePullPolicy": "IfNotPresent",
             "terminationMessagePath": "/dev/termination-log",
             "terminationMessagePolicy": "File", "resources": {}}],
            "volumes": volumes, "restartPolicy": "Always", "schedulerName": "default-scheduler",
            "dnsPolicy": "ClusterFirst", "terminationGracePeriodSeconds": 30,
            "serviceAccountName": "default"},
        "status": {"phase": phase, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False",
             "lastTransitionTime": started}],
            "hostIP": "10.0.0.1", "startTime": started, "qosClass": "BestEffort",
            "containerStatuses": [{"name": "main", "ready": ready, "started": True,
                                   "restartCount": 0, "image": image,
                                   "imageID": f"{image.rsplit(':', 1)[0]}@sha256:{digest}",
                                   "containerID": f"containerd://{container_id}",
                                   "lastState": {},
                                   "state": {"running": {"startedAt": started}}}]},
    }


def expand_pdb(spec: Obj) -> Obj:
    """A seed PDB: a full object, or {namespace, name, selector: {labels}, minAvailable |
    maxUnavailable}."""
    if "metadata" in spec:
        return copy.deepcopy(spec)
    body: Obj = {"selector": {"matchLabels": dict(spec.get("selector") or {})}}
    for key in ("minAvailable", "maxUnavailable"):
        if key in spec:
            body[key] = spec[key]
    return {"metadata": {"name": spec["name"], "namespace": spec.get("namespace", "default")},
            "spec": body}


def core_event(node: str, reason: str, message: str, type_: str = "Normal",
               namespace: str = "default", component: str = "kubelet") -> Obj:
    """A node event as the kubelet or the node controller records it through core/v1."""
    ts = now_iso()
    return {
        "metadata": {"name": f"{node}.{secrets.token_hex(8)}", "namespace": namespace},
        "involvedObject": {"kind": "Node", "name": node, "uid": node, "apiVersion": "v1"},
        "reason": reason, "message": message, "type": type_,
        "source": {"component": component, "host": node},
        "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
        "reportingComponent": component, "reportingInstance": node,
    }


def events_v1_event(node: str, reason: str, note: str, type_: str = "Normal",
                    namespace: str = "default", controller: str = "kubelet") -> Obj:
    """A node event as a newer component records it through events.k8s.io/v1."""
    return {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": f"{node}.{secrets.token_hex(8)}", "namespace": namespace},
        "eventTime": now_micro(), "reportingController": controller, "reportingInstance": node,
        "action": reason, "reason": reason, "note": note, "type": type_,
        "regarding": {"kind": "Node", "name": node, "uid": node, "apiVersion": "v1"},
    }


def event_to_v1(core: Obj) -> Obj:
    """core/v1 Event -> events.k8s.io/v1 Event (what the API server's conversion does)."""
    out: Obj = {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": copy.deepcopy(core.get("metadata") or {})}
    pairs = [("involvedObject", "regarding"), ("message", "note"), ("related", "related"),
             ("reason", "reason"), ("type", "type"), ("action", "action"),
             ("eventTime", "eventTime"), ("reportingComponent", "reportingController"),
             ("reportingInstance", "reportingInstance"),
             ("firstTimestamp", "deprecatedFirstTimestamp"),
             ("lastTimestamp", "deprecatedLastTimestamp"), ("count", "deprecatedCount"),
             ("source", "deprecatedSource")]
    for old, new in pairs:
        if core.get(old) is not None:
            out[new] = copy.deepcopy(core[old])
    series = core.get("series")
    if series:
        out["series"] = {"count": series.get("count"),
                         "lastObservedTime": series.get("lastObservedTime")}
    return out


def event_to_core(ev: Obj) -> Obj:
    """events.k8s.io/v1 Event -> core/v1 Event (the storage form)."""
    out: Obj = {"metadata": copy.deepcopy(ev.get("metadata") or {})}
    pairs = [("regarding", "involvedObject"), ("note", "message"), ("related", "related"),
             ("reason", "reason"), ("type", "type"), ("action", "action"),
             ("eventTime", "eventTime"), ("reportingController", "reportingComponent"),
             ("reportingInstance", "reportingInstance"),
             ("deprecatedFirstTimestamp", "firstTimestamp"),
             ("deprecatedLastTimestamp", "lastTimestamp"), ("deprecatedCount", "count"),
             ("deprecatedSource", "source")]
    for new, old in pairs:
        if ev.get(new) is not None:
            out[old] = copy.deepcopy(ev[new])
    if ev.get("series"):
        out["series"] = copy.deepcopy(ev["series"])
    return out


@dataclass
class Change:
    rv: int
    store: str
    type: str  # ADDED / MODIFIED / DELETED
    obj: Obj
    old: Obj | None


# --- the server -----------------------------------------------------------------------------


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], api: K8sTestServer) -> None:
        self.api = api
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake runs here, in the connection's own thread, so a slow or silent
        # client cannot hold up accept().
        if isinstance(request, ssl.SSLSocket):
            try:
                request.settimeout(30)
                request.do_handshake()
                request.settimeout(None)
            except (OSError, ssl.SSLError):
                return
        super().finish_request(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Close kept-alive connections too: a stopped server must look down to its clients,
        not keep answering on connections opened before."""
        with self.connections_lock:
            for conn in list(self.connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


class K8sTestServer:
    """The cluster: objects, a global resourceVersion, a bounded change history, and an HTTP
    front that speaks the Kubernetes API. Thread-safe; one lock guards everything."""

    def __init__(self, seed: Obj | str | Path | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None, readonly_token: str | None = None,
                 history_size: int = 1000, bookmark_interval: float = 5.0,
                 max_watch_seconds: float = 1800.0, kubeconfig_path: str | Path | None = None,
                 tls: bool = True, pools: dict[str, Obj] | None = None,
                 pool_label: str = "fleetwatch.io/pool", run_pods: bool = False) -> None:
        self.host, self.requested_port = host, port
        # kubectl sends credentials only over TLS (client-go drops them for http:// servers),
        # so the token is checked over HTTPS with a throwaway self-signed certificate; with
        # tls=False requests without credentials are served as anonymous.
        self.tls = tls
        self.ca_pem = b""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.token = token or secrets.token_urlsafe(24)
        self.readonly_token = readonly_token
        self.history_size = history_size
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self.kubeconfig_path: Path | None = Path(kubeconfig_path) if kubeconfig_path else None
        self.cond = threading.Condition()
        self.rv = 0
        self.compacted_rv = 0  # a watch from an rv below this gets 410 Gone
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {
            r.store: {} for r in RESOURCES}
        self.history: list[Change] = []
        # The replicas each pod controller (ReplicaSet, StatefulSet, ...) is taken to want: the
        # most pods it ever had at once. The disruption controller counts expected pods from
        # the controllers' scale, so an evicted pod not yet replaced still counts.
        self.controllers: dict[tuple[str, str], Obj] = {}
        self.requests: deque[tuple[str, str, str]] = deque(maxlen=2000)
        # The node-pool stand-in: pool name -> {"spares": [...], "delay": s, "ready_delay": s,
        # "label": key}; what it provisioned as (deleted node, new node, pool).
        self.pool_label = pool_label
        self.pools: dict[str, Obj] = {name: {**copy.deepcopy(conf),
                                             "spares": list(conf.get("spares") or [])}
                                      for name, conf in (pools or {}).items()}
        self.provisioned: list[tuple[str, str, str]] = []
        self._timers: list[threading.Timer] = []
        self.stopping = False
        self.port = 0
        self._http: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        # The job controller, scheduler and kubelet (k8s_workloads.py): their thread runs only
        # with run_pods=True (it runs Job pods' commands on this machine); without it, Jobs
        # are stored and served but nothing acts on them.
        self.run_pods = run_pods
        self.workloads = k8s_workloads.Workloads(self, run=run_pods)
        if seed is not None:
            self.load_seed(seed)

    # --- lifecycle ---

    def start(self) -> int:
        self.stopping = False
        # A restarted server comes back on the same port, so kubeconfigs stay valid.
        self._http = _HttpServer((self.host, self.port or self.requested_port), self)
        self.port = self._http.server_address[1]
        if self.tls:
            context = self._tls_context()
            self._http.socket = context.wrap_socket(self._http.socket, server_side=True,
                                                    do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._http.serve_forever, name="k8s-test-server",
                                        kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        self.workloads.start()
        if self.kubeconfig_path is not None:
            self.write_kubeconfig(self.kubeconfig_path)
        return self.port

    def _tls_context(self) -> ssl.SSLContext:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="k8s-test-server-")
            key, cert = Path(self._tmp.name, "key.pem"), Path(self._tmp.name, "cert.pem")
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                 "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
                 "-days", "7", "-subj", "/CN=fleetwatch-k8s-test-server", "-addext",
                 f"subjectAltName=IP:{self.host},IP:127.0.0.1,DNS:localhost"],
                check=True, capture_output=True, timeout=30)
            self.ca_pem = cert.read_bytes()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(Path(self._tmp.name, "cert.pem"), Path(self._tmp.name, "key.pem"))
        return context

    @property
    def ca_path(self) -> Path | None:
        return Path(self._tmp.name, "cert.pem") if self._tmp is not None else None

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            timers, self._timers = self._timers, []
        for timer in timers:
            timer.cancel()
        self.workloads.stop()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http.drop_connections()
            self._http = None

    def __enter__(self) -> K8sTestServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def write_kubeconfig(self, path: str | Path, token: str | None = None) -> Path:
        path = Path(path)
        ca = (f"    certificate-authority-data: {base64.b64encode(self.ca_pem).decode()}\n"
              if self.tls else "")
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            "clusters:\n- name: fleetwatch-test\n  cluster:\n"
            f"    server: {self.url}\n{ca}"
            "contexts:\n- name: fleetwatch-test\n  context:\n    cluster: fleetwatch-test\n"
            "    user: fleetwatch-test\n    namespace: default\n"
            "current-context: fleetwatch-test\n"
            "users:\n- name: fleetwatch-test\n  user:\n"
            f"    token: {json.dumps(token or self.token)}\n")
        path.chmod(0o600)
        if self.kubeconfig_path is None:
            self.kubeconfig_path = path
        return path

    # --- seeding ---

    def load_seed(self, seed: Obj | str | Path) -> None:
        if not isinstance(seed, dict):
            seed = json.loads(Path(seed).read_text())
        namespaces = {"default", "kube-system"}
        pods = [expand_pod(p) for p in seed.get("pods", [])]
        for p in pods:
            namespaces.add(p["metadata"].get("namespace", "default"))
        for ns in sorted(namespaces | set(seed.get("namespaces", []))):
            self.create("namespaces", {"metadata": {"name": ns}, "status": {"phase": "Active"}})
        for n in seed.get("nodes", []):
            self.create("nodes", expand_node(n))
        daemonsets = {(d["metadata"].get("namespace", "default"), d["metadata"]["name"])
                      for d in seed.get("daemonsets", [])}
        for d in seed.get("daemonsets", []):
            self.create("daemonsets", d)
        for p in pods:
            # A DaemonSet pod's owner must exist: kubectl drain looks it up.
            ns = p["metadata"].get("namespace", "default")
            for ref in p["metadata"].get("ownerReferences") or []:
                if ref.get("kind") == "DaemonSet" and (ns, ref["name"]) not in daemonsets:
                    daemonsets.add((ns, ref["name"]))
                    self.create("daemonsets", {
                        "metadata": {"name": ref["name"], "namespace": ns, "uid": ref["uid"]},
                        "spec": {"selector": {"matchLabels": {"app": ref["name"]}},
                                 # A real DaemonSet always has its pod template.
                                 "template": {"metadata": {"labels": {"app": ref["name"]}},
                                              "spec": {"containers": [
                                                  {"name": ref["name"],
                                                   "image": f"registry.local/{ref['name']}"}]}}},
                        "status": {"currentNumberScheduled": 0, "desiredNumberScheduled": 0,
                                   "numberMisscheduled": 0, "numberReady": 0}})
            self.create("pods", p)
        for b in seed.get("poddisruptionbudgets", []):
            self.create("poddisruptionbudgets", expand_pdb(b))
        for e in seed.get("events", []):
            self.create("events", e if "metadata" in e else core_event(
                e["node"], e["reason"], e.get("message", ""), e.get("type", "Normal")))
        for name, conf in (seed.get("pools") or {}).items():
            self.pools[name] = {**copy.deepcopy(conf), "spares": list(conf.get("spares") or [])}

    # --- storage (call with or without the lock held: it is re-entrant enough) ---

    def _record(self, store: str, type_: str, obj: Obj, old: Obj | None) -> None:
        self.history.append(Change(self.rv, store, type_, obj, old))
        if len(self.history) > self.history_size:
            dropped = self.history[: len(self.history) - self.history_size]
            del self.history[: len(dropped)]
            self.compacted_rv = max(self.compacted_rv, dropped[-1].rv)
        self.cond.notify_all()

    def create(self, store: str, obj: Obj, namespace: str | None = None,
               validate_as: Resource | None = None) -> Obj:
        """Store a new object. ``validate_as``: it came through the API as that resource, so
        it is validated as the API server would (422 Invalid); seeds and the test control API
        (a kubelet's or a controller's doing) are taken as given."""
        with self.cond:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            if namespace is not None:
                meta["namespace"] = namespace
            namespaced = store not in ("nodes", "namespaces")
            if namespaced:
                meta.setdefault("namespace", "default")
            else:
                meta.pop("namespace", None)
            if not meta.get("name"):
                if meta.get("generateName"):
                    meta["name"] = meta["generateName"] + k8s_workloads.random_suffix()
                else:
                    raise ApiError(422, "metadata.name: Required value: name or generateName is "
                                   "required")
            if store == "jobs":
                # The job strategy needs the uid before validation: the generated selector
                # and the template's labels carry it.
                if validate_as is not None or not meta.get("uid"):
                    meta["uid"] = str(uuid.uuid4())  # the API server ignores a client's uid
                k8s_workloads.default_job(obj)
            if validate_as is not None:
                errors = k8s_rules.validate(store, obj)
                if errors:
                    raise k8s_rules.invalid_object(validate_as.kind, validate_as.group,
                                                   meta["name"], errors)
            key = (meta.get("namespace", ""), meta["name"])
            if key in self.objects[store]:
                raise ApiError(409, f'{store} "{meta["name"]}" already exists',
                               reason="AlreadyExists")
            self.rv += 1
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_iso())
            meta["resourceVersion"] = str(self.rv)
            if store in ("poddisruptionbudgets", "daemonsets", "jobs"):
                meta["generation"] = 1
            obj.pop("kind", None)
            obj.pop("apiVersion", None)
            self.objects[store][key] = obj
            if store == "pods":
                self._count_controller(obj)
            self._record(store, "ADDED", copy.deepcopy(obj), None)
            return copy.deepcopy(obj)

    def _count_controller(self, pod: Obj) -> None:
        meta = pod["metadata"]
        ref = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        if ref is None:
            return
        key = (meta["namespace"], ref["uid"])
        live = sum(1 for p in self.objects["pods"].values()
                   if p["metadata"].get("namespace") == meta["namespace"]
                   and any(o.get("uid") == ref["uid"] and o.get("controller")
                           for o in p["metadata"].get("ownerReferences") or []))
        known = self.controllers.get(key, {"replicas": 0})
        self.controllers[key] = {"replicas": max(known["replicas"], live),
                                 "labels": dict(meta.get("labels") or {})}

    def replace(self, store: str, obj: Obj) -> Obj:
        """Store a new version of an existing object (new resourceVersion, MODIFIED)."""
        with self.cond:
            meta = obj["metadata"]
            key = (meta.get("namespace", ""), meta["name"])
            old = self.objects[store][key]
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj.pop("kind", None)
            obj.pop("apiVersion", None)
            for field_ in ("uid", "creationTimestamp", "name", "namespace"):
                if field_ in old["metadata"]:
                    obj["metadata"][field_] = old["metadata"][field_]
            if "generation" in old["metadata"]:
                changed = obj.get("spec") != old.get("spec")
                obj["metadata"]["generation"] = old["metadata"]["generation"] + int(changed)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.objects[store][key] = obj
            self._record(store, "MODIFIED", copy.deepcopy(obj), copy.deepcopy(old))
            return copy.deepcopy(obj)

    def delete(self, store: str, namespace: str, name: str) -> Obj | None:
        with self.cond:
            old = self.objects[store].pop((namespace, name), None)
            if old is None:
                return None
            self.rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self.rv)
            self._record(store, "DELETED", gone, copy.deepcopy(old))
            if store == "nodes":
                self._node_left_pool(gone)
            elif store == "pods":
                self.workloads.pod_deleted(gone)  # its kubelet stops the containers
            return copy.deepcopy(gone)

    # --- the node-pool stand-in (a cloud's node-pool controller / cluster-autoscaler) ---

    def _pool_of(self, node: Obj) -> str | None:
        labels = node["metadata"].get("labels") or {}
        for name, conf in self.pools.items():
            if labels.get(conf.get("label") or self.pool_label) == name:
                return name
        return None

    def _node_left_pool(self, node: Obj) -> None:
        """A pool member is gone: schedule its replacement (called with the lock held)."""
        pool = self._pool_of(node)
        if pool is None or self.stopping:
            return
        conf = self.pools[pool]
        if not conf["spares"]:
            return  # the pool is at its maximum size: nothing joins
        new = conf["spares"].pop(0)
        self.provisioned.append((node["metadata"]["name"], new, pool))
        timer = threading.Timer(float(conf.get("delay", 1.0)), self._join_pool, (new, pool))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _join_pool(self, name: str, pool: str) -> None:
        """A new VM's kubelet registers its Node (Ready unless the pool has a ready_delay)."""
        conf = self.pools[pool]
        ready_delay = float(conf.get("ready_delay", 0.0))
        with self.cond:
            if self.stopping:
                return
            self.create("nodes", expand_node({
                "name": name, "labels": {conf.get("label") or self.pool_label: pool},
                "ready": "False" if ready_delay > 0 else "True"}))
            if ready_delay > 0:
                timer = threading.Timer(ready_delay, self._pool_node_ready, (name,))
                timer.daemon = True
                self._timers.append(timer)
                timer.start()

    def _pool_node_ready(self, name: str) -> None:
        with self.cond:
            if not self.stopping and self.get("nodes", "", name) is not None:
                self.set_node_ready(name, True)

    def get(self, store: str, namespace: str, name: str) -> Obj | None:
        with self.cond:
            obj = self.objects[store].get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    # --- what a kubelet or a controller would do (the test control API) ---

    def set_node_ready(self, name: str, status: str | bool | None, reason: str = "",
                       message: str = "") -> Obj:
        status = {True: "True", False: "False", None: "Unknown"}.get(status, status)  # type: ignore[arg-type]
        with self.cond:
            node = self.get("nodes", "", name)
            if node is None:
                raise ApiError(404, f'nodes "{name}" not found')
            conditions = [c for c in node.setdefault("status", {}).get("conditions") or []
                          if c.get("type") != "Ready"]
            node["status"]["conditions"] = [*conditions, node_condition(str(status), reason,
                                                                        message)]
            return self.replace("nodes", node)

    def set_node_condition(self, name: str, kind: str, status: str, reason: str = "",
                           message: str = "") -> Obj:
        """Set a condition other than Ready, as a health tool does through the node's status
        (NVSentinel's platform connector, Node Problem Detector)."""
        with self.cond:
            node = self.get("nodes", "", name)
            if node is None:
                raise ApiError(404, f'nodes "{name}" not found')
            ts = now_iso()
            conditions = [c for c in node.setdefault("status", {}).get("conditions") or []
                          if c.get("type") != kind]
            node["status"]["conditions"] = [*conditions, {
                "type": kind, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": ts, "lastTransitionTime": ts}]
            return self.replace("nodes", node)

    def set_pod_ready(self, namespace: str, name: str, ready: bool) -> Obj:
        with self.cond:
            pod = self.get("pods", namespace, name)
            if pod is None:
                raise ApiError(404, f'pods "{name}" not found')
            status = pod.setdefault("status", {})
            status["conditions"] = [c for c in status.get("conditions") or []
                                    if c.get("type") != "Ready"] + [
                {"type": "Ready", "status": "True" if ready else "False",
                 "lastTransitionTime": now_iso()}]
            for cs in status.get("containerStatuses") or []:
                cs["ready"] = ready
            return self.replace("pods", pod)

    def add_pod(self, spec: Obj) -> Obj:
        return self.create("pods", expand_pod(spec))

    def add_node_event(self, node: str, reason: str, message: str, type_: str = "Normal",
                       api: str = "core") -> Obj:
        """Record a node event through core/v1 (kubelet, node controller) or
        events.k8s.io/v1; either way both APIs show it, with one uid."""
        if api == "core":
            return self.create("events", core_event(node, reason, message, type_))
        return self.create("events", event_to_core(events_v1_event(node, reason, message,
                                                                    type_)))

    def compact(self) -> int:
        """Forget the change history up to now: watches from an older resourceVersion get
        410 Gone, as after an etcd compaction or a watch-cache window roll-over."""
        with self.cond:
            self.compacted_rv = self.rv
            self.history.clear()
            self.cond.notify_all()
            return self.compacted_rv

    # --- PodDisruptionBudgets, as the disruption controller computes them ---

    def pdb_status(self, pdb: Obj) -> Obj:
        ns = pdb["metadata"].get("namespace", "default")
        spec = pdb.get("spec") or {}
        pods = [p for (pns, _), p in self.objects["pods"].items()
                if pns == ns and selector_object_matches(spec.get("selector"),
                                                         p["metadata"].get("labels") or {})
                and not p["metadata"].get("deletionTimestamp")]
        owned = {(ns, o["uid"]) for p in pods for o in p["metadata"].get("ownerReferences") or []
                 if o.get("controller")}
        owned |= {k for k, c in self.controllers.items()
                  if k[0] == ns and selector_object_matches(spec.get("selector"), c["labels"])}
        unowned = sum(1 for p in pods if not any(
            o.get("controller") for o in p["metadata"].get("ownerReferences") or []))
        expected = unowned + sum(self.controllers[k]["replicas"] for k in owned
                                 if k in self.controllers)
        healthy = sum(1 for p in pods if pod_ready(p))
        if spec.get("minAvailable") is not None:
            desired = quantity(spec["minAvailable"], expected)
        elif spec.get("maxUnavailable") is not None:
            desired = max(0, expected - quantity(spec["maxUnavailable"], expected))
        else:
            desired = 0
        return {"observedGeneration": pdb["metadata"].get("generation", 1),
                "currentHealthy": healthy, "desiredHealthy": desired,
                "disruptionsAllowed": max(0, healthy - desired), "expectedPods": expected,
                "conditions": [{"type": "DisruptionAllowed",
                                "status": "True" if healthy > desired else "False",
                                "reason": "SufficientPods" if healthy > desired
                                else "InsufficientPods", "message": "",
                                "lastTransitionTime": now_iso(),
                                "observedGeneration": pdb["metadata"].get("generation", 1)}]}

    def evict(self, namespace: str, name: str, body: Obj, dry_run: bool) -> Obj:
        """POST pods/{name}/eviction, as the API server's eviction REST handler decides."""
        with self.cond:
            pod = self.objects["pods"].get((namespace, name))
            pods = next(r for r in RESOURCES if r.plural == "pods")
            if pod is None:
                raise not_found(pods, name)
            if (body.get("metadata") or {}).get("name") not in (None, name):
                raise ApiError(400, "name in URL does not match name in Eviction object")
            pre = ((body.get("deleteOptions") or {}).get("preconditions")) or {}
            if pre.get("uid") and pre["uid"] != pod["metadata"]["uid"]:
                raise ApiError(409, f"Precondition failed: UID in precondition: {pre['uid']}, "
                               f"UID in object meta: {pod['metadata']['uid']}")
            phase = (pod.get("status") or {}).get("phase")
            if phase not in ("Succeeded", "Failed", "Pending"):
                labels = pod["metadata"].get("labels") or {}
                pdbs = [b for (bns, _), b in self.objects["poddisruptionbudgets"].items()
                        if bns == namespace and selector_object_matches(
                            (b.get("spec") or {}).get("selector"), labels)]
                if len(pdbs) > 1:
                    raise ApiError(500, "This pod has more than one PodDisruptionBudget, which "
                                   "the eviction subresource does not support.")
                if pdbs:
                    st = self.pdb_status(pdbs[0])
                    healthy_enough = (not pod_ready(pod)
                                      and st["currentHealthy"] >= st["desiredHealthy"])
                    if st["disruptionsAllowed"] <= 0 and not healthy_enough:
                        pdb_name = pdbs[0]["metadata"]["name"]
                        raise ApiError(
                            429, "Cannot evict pod as it would violate the pod's disruption "
                            "budget.", details={"causes": [{
                                "reason": "DisruptionBudget",
                                "message": f"The disruption budget {pdb_name} needs "
                                           f"{st['desiredHealthy']} healthy pods and has "
                                           f"{st['currentHealthy']} currently"}]})
            if not dry_run:
                # No kubelet here: the pod's containers stop at once, so it is deleted now.
                self.delete("pods", namespace, name)
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "code": 201}

    # --- reading ---

    def out(self, r: Resource, obj: Obj) -> Obj:
        """An object as the API returns it through resource ``r``."""
        if r.store == "events" and r.group == "events.k8s.io":
            return event_to_v1(obj)
        result = {"kind": r.kind, "apiVersion": r.api_version,
                  **k8s_rules.serialised(r.store, copy.deepcopy(obj))}
        if r.store == "poddisruptionbudgets":
            result["status"] = self.pdb_status(obj)
        return result

    def select(self, r: Resource, namespace: str | None, params: dict[str, str],
               ) -> Callable[[Obj], bool]:
        try:
            labels = (label_selector(params["labelSelector"]) if params.get("labelSelector")
                      else None)
            fields = (field_selector(params["fieldSelector"], r) if params.get("fieldSelector")
                      else None)
        except SelectorError as e:  # the query parameters do not decode: a 400, as upstream
            raise ApiError(400, str(e)) from None

        def match(obj: Obj) -> bool:
            meta = obj.get("metadata") or {}
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            if labels is not None and not labels(meta.get("labels") or {}):
                return False
            return fields is None or fields(obj)

        return match

    def list(self, r: Resource, namespace: str | None, params: dict[str, str]) -> Obj:
        match = self.select(r, namespace, params)
        with self.cond:
            list_rv = self.rv
            start = ""
            if params.get("continue"):
                try:
                    token = json.loads(base64.urlsafe_b64decode(params["continue"]))
                    list_rv, start = int(token["rv"]), str(token["start"])
                except (ValueError, KeyError, TypeError):
                    raise ApiError(400, "continue key is not valid") from None
                if list_rv < self.compacted_rv:
                    raise ApiError(410, "The provided continue parameter is too old to display "
                                   "a consistent list result. You can start a new list without "
                                   "the continue parameter.")
            keys = sorted(k for k, o in self.objects[r.store].items()
                          if "/".join(k) > start and match(o))
            limit = query_int(params, "limit")
            page = keys[:limit] if limit > 0 else keys
            items = [self.out(r, self.objects[r.store][k]) for k in page]
            meta: Obj = {"resourceVersion": str(list_rv)}
            if limit > 0 and len(keys) > limit:
                meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                    {"rv": list_rv, "start": "/".join(page[-1])}).encode()).decode()
                meta["remainingItemCount"] = len(keys) - limit
        for item in items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {"kind": f"{r.kind}List", "apiVersion": r.api_version, "metadata": meta,
                "items": items}

    def changes_after(self, rv: int) -> list[Change]:
        at = bisect.bisect_right([c.rv for c in self.history], rv)
        return self.history[at:]


# --- Tables for kubectl get ------------------------------------------------------------------


def age(ts: Any) -> str:
    started = parse_time(ts)
    if started is None:
        return "<unknown>"
    s = max(0, int(time.time() - started))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 48 * 3600:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def human_duration(seconds: float) -> str:
    """duration.HumanDuration (k8s.io/apimachinery), as kubectl's DURATION column shows it."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    return f"{hours // 24}d"


def format_selector(selector: Obj | None) -> str:
    """metav1.FormatLabelSelector."""
    if selector is None:
        return "<none>"
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for e in selector.get("matchExpressions") or []:
        op = {"In": "in", "NotIn": "notin"}.get(e.get("operator", ""), "")
        if op:
            parts.append(f"{e.get('key')} {op} ({','.join(e.get('values') or [])})")
        elif e.get("operator") == "Exists":
            parts.append(str(e.get("key")))
        else:
            parts.append(f"!{e.get('key')}")
    return ",".join(parts) or "<none>"


def job_cells(obj: Obj) -> list[Any]:
    """A Job's row as Kubernetes 1.32's printer makes it (pkg/printers/internalversion)."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    status = obj.get("status") or {}
    conditions = {c.get("type") for c in status.get("conditions") or []
                  if c.get("status") == "True"}
    shown = next((word for cond, word in (
        ("Complete", "Complete"), ("Failed", "Failed"), ("", "Terminating"),
        ("Suspended", "Suspended"), ("FailureTarget", "FailureTarget"),
        ("SuccessCriteriaMet", "SuccessCriteriaMet"))
        if (cond in conditions if cond else bool(meta.get("deletionTimestamp")))), "Running")
    succeeded = int(status.get("succeeded") or 0)
    if spec.get("completions") is not None:
        completions = f"{succeeded}/{spec['completions']}"
    elif spec.get("parallelism") is None or int(spec["parallelism"]) > 1:
        completions = f"{succeeded}/1 of {spec.get('parallelism') or 1}"
    else:
        completions = f"{succeeded}/1"
    started, done = parse_time(status.get("startTime")), parse_time(status.get("completionTime"))
    duration = "" if started is None else human_duration(
        (done if done is not None else time.time()) - started)
    containers = (spec.get("template") or {}).get("spec", {}).get("containers") or []
    return [meta.get("name", ""), shown, completions, duration,
            age(meta.get("creationTimestamp")), ",".join(c.get("name", "") for c in containers),
            ",".join(c.get("image", "") for c in containers),
            format_selector(spec.get("selector"))]


def pod_status_word(obj: Obj) -> str:
    """The STATUS kubectl shows for a pod: the phase, or a container's waiting or terminated
    reason (Completed, Error, ContainerCreating), as the pod printer picks it."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating"
    word = status.get("reason") or status.get("phase", "")
    running = False
    for cs in reversed(status.get("containerStatuses") or []):
        state = cs.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            word = state["waiting"]["reason"]
        elif "terminated" in state:
            term = state["terminated"] or {}
            word = term.get("reason") or (f"Signal:{term['signal']}" if term.get("signal")
                                          else f"ExitCode:{term.get('exitCode', 0)}")
        elif cs.get("ready") and "running" in state:
            running = True
    if word == "Completed" and running:
        word = "Running"
    return str(word)


def _col(name: str, type_: str = "string", priority: int = 0, fmt: str = "") -> Obj:
    return {"name": name, "type": type_, "format": fmt, "description": name,
            "priority": priority}


def table_columns(r: Resource) -> list[Obj]:
    name = _col("Name", fmt="name")
    if r.store == "nodes":
        return [name, _col("Status"), _col("Roles"), _col("Age"), _col("Version"),
                _col("Internal-IP", priority=1), _col("OS-Image", priority=1)]
    if r.store == "pods":
        return [name, _col("Ready"), _col("Status"), _col("Restarts", "string"), _col("Age"),
                _col("IP", priority=1), _col("Node", priority=1)]
    if r.store == "events":
        return [_col("Last Seen"), _col("Type"), _col("Reason"), _col("Object"),
                _col("Message"), _col("Source", priority=1), _col("Count", priority=1),
                _col("Name", priority=1)]
    if r.store == "poddisruptionbudgets":
        return [name, _col("Min Available"), _col("Max Unavailable"),
                _col("Allowed Disruptions", "integer"), _col("Age")]
    if r.store == "namespaces":
        return [name, _col("Status"), _col("Age")]
    if r.store == "jobs":
        return [name, _col("Status"), _col("Completions"), _col("Duration"), _col("Age"),
                _col("Containers", priority=1), _col("Images", priority=1),
                _col("Selector", priority=1)]
    return [name, _col("Age")]


def table_cells(r: Resource, obj: Obj) -> list[Any]:
    meta = obj.get("metadata") or {}
    created = meta.get("creationTimestamp")
    status = obj.get("status") or {}
    if r.store == "nodes":
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"),
                     None)
        shown = "Unknown" if ready is None else (
            "Ready" if ready.get("status") == "True" else "NotReady")
        if (obj.get("spec") or {}).get("unschedulable"):
            shown += ",SchedulingDisabled"
        roles = sorted(k.split("/", 1)[1] for k in meta.get("labels") or {}
                       if k.startswith("node-role.kubernetes.io/"))
        ip = next((a["address"] for a in status.get("addresses") or []
                   if a.get("type") == "InternalIP"), "<none>")
        return [meta["name"], shown, ",".join(roles) or "<none>", age(created),
                (status.get("nodeInfo") or {}).get("kubeletVersion", ""), ip,
                (status.get("nodeInfo") or {}).get("osImage", "")]
    if r.store == "pods":
        cs = status.get("containerStatuses") or []
        total = len((obj.get("spec") or {}).get("containers") or [])
        ready = sum(1 for c in cs if c.get("ready"))
        restarts = sum(int(c.get("restartCount") or 0) for c in cs)
        shown = pod_status_word(obj)
        return [meta["name"], f"{ready}/{total}", shown, str(restarts), age(created),
                status.get("podIP", "<none>"), (obj.get("spec") or {}).get("nodeName", "")]
    if r.store == "events":
        inv = obj.get("involvedObject") or {}
        last = obj.get("lastTimestamp") or obj.get("eventTime") or created
        return [age(last), obj.get("type", ""), obj.get("reason", ""),
                f"{str(inv.get('kind', '')).lower()}/{inv.get('name', '')}",
                obj.get("message", ""), (obj.get("source") or {}).get("component", ""),
                int(obj.get("count") or 1), meta["name"]]
    if r.store == "poddisruptionbudgets":
        spec = obj.get("spec") or {}
        return [meta["name"], str(spec.get("minAvailable", "N/A")),
                str(spec.get("maxUnavailable", "N/A")),
                int((obj.get("status") or {}).get("disruptionsAllowed", 0)), age(created)]
    if r.store == "namespaces":
        return [meta["name"], status.get("phase", "Active"), age(created)]
    if r.store == "jobs":
        return job_cells(obj)
    return [meta["name"], age(created)]


def as_table(r: Resource, objects: list[Obj], resource_version: str, cont: str = "") -> Obj:
    meta: Obj = {"resourceVersion": resource_version}
    if cont:
        meta["continue"] = cont
    return {
        "kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
        "columnDefinitions": table_columns(r),
        "rows": [{"cells": table_cells(r, o), "object": {
            "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": o.get("metadata") or {}}} for o in objects],
    }


# --- HTTP -----------------------------------------------------------------------------------

# The patch formats this server applies (no server-side apply), in the API server's order.
PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json",
               "application/strategic-merge-patch+json")


def undecodable(r: Resource, body: Any) -> None:
    """A create or update body that does not decode into the Go type is a 400, worded as the
    API server's decoder words it."""
    problem = k8s_rules.decode_error(r.store, body)
    if problem is not None:
        raise ApiError(400, f'{r.kind} in version "{r.version}" cannot be handled as a '
                       f"{r.kind}: {problem}")



def propagation(body: Any, params: dict[str, str]) -> str:
    """A delete's propagationPolicy (DeleteOptions body, else the query parameter; the
    deprecated orphanDependents too). None given: batch/v1 Jobs default to Orphan."""
    options = body if isinstance(body, dict) else {}
    policy = options.get("propagationPolicy") or params.get("propagationPolicy") or ""
    if policy:
        if policy not in ("Orphan", "Background", "Foreground"):
            raise ApiError(422, f'DeleteOptions.meta.k8s.io "" is invalid: propagationPolicy: '
                           f'Unsupported value: "{policy}": supported values: "Foreground", '
                           '"Background", "Orphan", "nil"')
        return str(policy)
    orphan = options.get("orphanDependents")
    if orphan is None and "orphanDependents" in params:
        orphan = go_bool(params["orphanDependents"])
    return "Background" if orphan is False else "Orphan"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and chunked watch streams
    server: _HttpServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is kept on the server object instead

    # Every verb goes through one dispatcher.
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # --- plumbing ---

    def _send(self, code: int, body: Obj | str) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type",
                         "text/plain; charset=utf-8" if isinstance(body, str)
                         else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        self.wfile.write(data)

    def _raw_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    @staticmethod
    def _parse_body(raw: bytes) -> Any:
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None

    def _media_type(self) -> str:
        return self.headers.get("Content-Type", "").split(";")[0].strip().lower()

    def _is_protobuf_job(self, method: str) -> bool:
        """A Job created or replaced in protobuf (kubectl create job's typed client sends no
        JSON): the one protobuf body this server reads (k8s_proto.py)."""
        path = urlsplit(self.path).path.rstrip("/")
        return (method in ("POST", "PUT") and self._media_type() == k8s_proto.MEDIA_TYPE
                and path.startswith("/apis/batch/v1/")
                and (path.endswith("/jobs") or "/jobs/" in path))

    def _check_media_type(self, method: str, raw: bytes) -> None:
        """415 for a body this server cannot read, before the body is looked at (as the API
        server negotiates the decoder first). It reads JSON only: no YAML, no protobuf, no
        server-side apply."""
        kind = self._media_type()
        if method == "PATCH" and kind not in PATCH_TYPES:
            raise ApiError(415, "the body of the request was in an unknown format - accepted "
                           "media types include: " + ", ".join(PATCH_TYPES))
        if method in ("POST", "PUT") and raw and kind not in ("", "application/json") \
                and not self._is_protobuf_job(method):
            raise ApiError(415, "the body of the request was in an unknown format - accepted "
                           "media types include: application/json")

    def _dispatch(self, method: str) -> None:
        api = self.server.api
        url = urlsplit(self.path)
        params = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        api.requests.append((method, self.path, self.headers.get("Content-Type", "")))
        try:
            if url.path in ("/healthz", "/livez", "/readyz"):
                self._send(200, "ok")
                return
            auth = self.headers.get("Authorization", "")
            tokens = {api.token} | ({api.readonly_token} if api.readonly_token else set())
            given = auth[7:] if auth.startswith("Bearer ") else ""
            if given not in tokens and (api.tls or given):
                raise ApiError(401, "Unauthorized")
            readonly = bool(given) and given != api.token
            raw = self._raw_body() if method in ("POST", "PUT", "PATCH", "DELETE") else b""
            if not url.path.startswith("/_test/"):
                self._check_media_type(method, raw)
            if self._is_protobuf_job(method) and raw:
                body: Any = k8s_proto.decode(raw)
            else:
                body = self._parse_body(raw) if method in ("POST", "PUT", "PATCH", "DELETE") \
                    else None
            if url.path.startswith("/_test/"):
                self._send(200, self._control(method, url.path, body))
                return
            self._api(method, url.path.rstrip("/") or "/", params, body, readonly)
        except ApiError as e:
            self._send(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug here must reach the client as a 500, not a hang
            self._send(500, ApiError(500, f"{type(e).__name__}: {e}").status())

    # --- the test-only control API ---

    def _control(self, method: str, path: str, body: Any) -> Obj:
        api = self.server.api
        parts = path.strip("/").split("/")[1:]
        body = body or {}
        if method == "POST" and parts == ["compact"]:
            return {"compactedResourceVersion": str(api.compact())}
        if method == "POST" and len(parts) == 3 and parts[0] == "nodes" and parts[2] == "ready":
            return api.set_node_ready(parts[1], body.get("status", "True"),
                                      body.get("reason", ""), body.get("message", ""))
        if method == "POST" and len(parts) == 4 and parts[0] == "pods" and parts[3] == "ready":
            return api.set_pod_ready(parts[1], parts[2], bool(body.get("ready", True)))
        if method == "POST" and parts == ["pods"]:
            return api.add_pod(body)
        if method == "POST" and parts == ["events"]:
            return api.add_node_event(body["node"], body["reason"], body.get("message", ""),
                                      body.get("type", "Normal"), body.get("api", "core"))
        if method == "GET" and parts == ["requests"]:
            return {"requests": [list(r) for r in api.requests]}
        raise ApiError(404, f"no test control endpoint {method} {path}")

    # --- the Kubernetes API ---

    def _api(self, method: str, path: str, params: dict[str, str], body: Any,
             readonly: bool) -> None:
        api = self.server.api
        parts = path.strip("/").split("/") if path != "/" else []
        if method == "GET":
            discovery = self._discovery(parts)
            if discovery is not None:
                self._send(200, discovery)
                return
        if len(parts) >= 2 and parts[0] == "api" and parts[1] == "v1":
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "the server could not find the requested resource",
                           reason="NotFound")
        namespace: str | None = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest:
            raise ApiError(404, "the server could not find the requested resource")
        r = find_resource(group, version, rest[0])
        if r is None or (namespace is not None and not r.namespaced):
            raise ApiError(404, "the server could not find the requested resource")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if len(rest) > 3 or (sub is not None and sub not in r.subresources):
            raise ApiError(404, "the server could not find the requested resource")
        verb = {"GET": "get" if name else ("watch" if go_bool(params.get("watch"))
                                           else "list"),
                "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
        if readonly and verb not in ("get", "list", "watch"):
            target = f'{r.plural} "{name}"' if name else r.plural
            scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            raise ApiError(403, f'{target} is forbidden: User "system:serviceaccount:fleetwatch:'
                           f'readonly" cannot {verb} resource "{r.plural}" in API group '
                           f'"{r.group}" {scope}')
        ns_key = (namespace or "default") if r.namespaced else ""
        if sub == "log":
            if verb != "get":
                raise ApiError(405, "the log subresource only accepts GET")
            with api.cond:
                pod = api.get("pods", ns_key, name or "")
                if pod is None:
                    raise not_found(r, name or "")
                text = api.workloads.read_log(pod, params)
            self._send(200, text)  # text/plain, as the kubelet's log stream
            return
        if name is None:
            self._collection(r, verb, namespace, params, body)
        elif sub == "eviction":
            if method != "POST":
                raise ApiError(405, "the eviction subresource only accepts POST")
            self._send(201, api.evict(ns_key, name, body or {},
                                      params.get("dryRun") == "All"))
        else:
            self._item(r, verb, ns_key, name, sub, params, body)

    def _discovery(self, parts: list[str]) -> Obj | None:
        api = self.server.api
        if parts == ["version"]:
            return SERVER_VERSION
        if parts == ["api"]:
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{api.host}:{api.port}"}]}
        if parts == ["api", "v1"]:
            return resource_list("", "v1")
        if parts == ["apis"]:
            return {"kind": "APIGroupList", "apiVersion": "v1",
                    "groups": [api_group(g) for g in GROUPS]}
        if len(parts) == 2 and parts[0] == "apis" and parts[1] in GROUPS:
            return api_group(parts[1])
        if len(parts) == 3 and parts[0] == "apis":
            found = resource_list(parts[1], parts[2])
            if found is None:
                raise ApiError(404, "the server could not find the requested resource")
            return found
        if parts[:2] == ["openapi", "v3"]:
            return openapi_v3(parts[2:])
        if parts and parts[0] == "openapi":
            raise ApiError(404, "OpenAPI is not served by the FleetWatch test server")
        return None

    def _wants_table(self) -> bool:
        return "as=Table" in self.headers.get("Accept", "")

    def _collection(self, r: Resource, verb: str, namespace: str | None,
                    params: dict[str, str], body: Any) -> None:
        api = self.server.api
        if verb == "watch":
            self._watch(r, namespace, params)
        elif verb == "list":
            listed = api.list(r, namespace, params)
            if self._wants_table():
                self._send(200, as_table(r, [{**i} for i in listed["items"]],
                                         listed["metadata"]["resourceVersion"],
                                         listed["metadata"].get("continue", "")))
            else:
                self._send(200, listed)
        elif verb == "create":
            obj = body or {}
            undecodable(r, obj)
            if r.store == "events" and r.group == "events.k8s.io":
                obj = event_to_core(obj)
            created = api.create(r.store, obj, namespace if r.namespaced else None,
                                 validate_as=r)
            self._send(201, api.out(r, created))
        else:
            raise ApiError(405, f"the server does not allow this method on {r.plural}")

    def _item(self, r: Resource, verb: str, namespace: str, name: str, sub: str | None,
              params: dict[str, str], body: Any) -> None:
        with self.server.api.cond:  # read-modify-write as one step
            code, answer = self._item_locked(r, verb, namespace, name, sub, body, params)
        self._send(code, answer)

    def _item_locked(self, r: Resource, verb: str, namespace: str, name: str, sub: str | None,
                     body: Any, params: dict[str, str] | None = None) -> tuple[int, Obj]:
        api = self.server.api
        current = api.get(r.store, namespace, name)
        if current is None:
            raise not_found(r, name)
        if verb == "get":
            shown = api.out(r, current)
            if self._wants_table():
                return 200, as_table(r, [shown], shown["metadata"]["resourceVersion"])
            return 200, shown
        if verb == "delete":
            pre = (body or {}).get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != current["metadata"]["uid"]:
                raise ApiError(409, "Precondition failed: UID in precondition: "
                               f"{pre['uid']}, UID in object meta: {current['metadata']['uid']}")
            policy = propagation(body, params or {})
            gone = api.delete(r.store, namespace, name)
            if r.store == "jobs" and gone is not None:
                api.workloads.job_deleted(gone, policy)
            return 200, api.out(r, gone or current)
        # update and patch: work on the API's view (events.k8s.io converts both ways).
        view = api.out(r, current)
        if verb == "update":
            undecodable(r, body or {})
            new = copy.deepcopy(body or {})
        else:
            new = self._patched(view, body)
            problem = k8s_rules.decode_error(r.store, new)
            if problem is not None:
                # The patched object does not fit the Go type: 422 on the field "patch", with
                # the patch (strategic) or the patched object (JSON/merge) as the bad value.
                shown = (k8s_rules.go_value(body)
                         if self._media_type() == "application/strategic-merge-patch+json"
                         else json.dumps(new, separators=(",", ":")))
                raise k8s_rules.invalid_object("", "", "", [
                    k8s_rules.invalid("patch", shown, problem)])
        wanted_rv = (new.get("metadata") or {}).get("resourceVersion")
        if verb == "patch" and not (isinstance(body, dict)
                                    and (body.get("metadata") or {}).get("resourceVersion")):
            wanted_rv = None  # only a patch that names a resourceVersion is conditional
        if wanted_rv and wanted_rv != current["metadata"]["resourceVersion"]:
            raise conflict(r, name)
        if r.store == "events" and r.group == "events.k8s.io":
            new = event_to_core(new)
        new.setdefault("metadata", {})
        new["metadata"]["name"], new["metadata"]["namespace"] = name, namespace
        if not namespace:
            new["metadata"].pop("namespace", None)
        if r.store in STATUS_STORES:
            # The main resource ignores status changes; the status subresource ignores
            # everything else, as on the real server.
            if sub == "status":
                new = {**copy.deepcopy(current), "status": new.get("status") or {}}
            else:
                new["status"] = copy.deepcopy(current.get("status") or {})
        new["metadata"].pop("resourceVersion", None)
        errors = k8s_rules.validate(r.store, new)
        if errors:
            raise k8s_rules.invalid_object(r.kind, r.group, name, errors)
        return 200, api.out(r, api.replace(r.store, new))

    def _patched(self, view: Obj, body: Any) -> Obj:
        kind = self._media_type()
        if kind == "application/json-patch+json":
            if not isinstance(body, list):
                raise ApiError(400, "a JSON patch is a list of operations")
            return json_patch(view, body)
        if not isinstance(body, dict):
            raise ApiError(400, "a merge patch is a JSON object")
        if kind == "application/merge-patch+json":
            return merge_patch(view, body)
        return strategic_merge_patch(view, body)  # the media type was checked on arrival

    # --- watch ---

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _event(self, type_: str, obj: Obj) -> None:
        self._chunk(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

    def _watch(self, r: Resource, namespace: str | None, params: dict[str, str]) -> None:
        api = self.server.api
        match = api.select(r, namespace, params)
        try:
            timeout = float(query_int(params, "timeoutSeconds")) or api.max_watch_seconds
        except ValueError:
            raise ApiError(400, "timeoutSeconds must be a number") from None
        bookmarks = go_bool(params.get("allowWatchBookmarks"))
        rv_param = params.get("resourceVersion", "")
        with api.cond:
            if rv_param in ("", "0"):
                # "Start at most recent" / "any": synthetic ADDED for what exists now.
                cursor = api.rv
                initial = [api.out(r, o) for _, o in sorted(api.objects[r.store].items())
                           if match(o)]
                expired: Obj | None = None
            else:
                try:
                    cursor = int(rv_param)
                except ValueError:
                    raise ApiError(400, f"invalid resource version {rv_param!r}") from None
                initial = []
                expired = self._too_old(cursor)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        try:
            for obj in initial:
                self._event("ADDED", obj)
            if expired is not None:
                self._event("ERROR", expired)
            else:
                self._stream(r, match, cursor, time.monotonic() + timeout, bookmarks)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True

    def _too_old(self, cursor: int) -> Obj | None:
        api = self.server.api
        if cursor < api.compacted_rv:
            return ApiError(410, f"too old resource version: {cursor} ({api.compacted_rv})",
                            reason="Expired").status()
        return None

    def _stream(self, r: Resource, match: Callable[[Obj], bool], cursor: int, deadline: float,
                bookmarks: bool) -> None:
        api = self.server.api
        next_bookmark = time.monotonic() + api.bookmark_interval
        while True:
            out: list[tuple[str, Obj]] = []
            with api.cond:
                while True:
                    if api.stopping:
                        return
                    expired = self._too_old(cursor)
                    if expired is not None:  # fell behind a compaction while watching
                        out.append(("ERROR", expired))
                        break
                    changes = [c for c in api.changes_after(cursor) if c.store == r.store]
                    if changes:
                        cursor = changes[-1].rv
                        for c in changes:
                            out += self._translate(r, match, c)
                        if out:
                            break
                    now = time.monotonic()
                    final = now >= deadline - 0.05
                    if bookmarks and (now >= next_bookmark or final):
                        # Everything up to the current global resourceVersion has been sent.
                        cursor = api.rv
                        out.append(("BOOKMARK", {"kind": r.kind, "apiVersion": r.api_version,
                                                 "metadata": {"resourceVersion": str(api.rv)}}))
                        next_bookmark = now + api.bookmark_interval
                        if final:
                            out.append(("END", {}))
                        break
                    if now >= deadline:
                        return
                    wake = min(deadline - 0.05 if bookmarks else deadline,
                               next_bookmark if bookmarks else deadline)
                    api.cond.wait(max(0.01, wake - now))
            for type_, obj in out:
                if type_ == "END":  # the bookmark just before the deadline was the last word
                    return
                self._event(type_, obj)
                if type_ == "ERROR":
                    return
            if time.monotonic() >= deadline:
                return

    def _translate(self, r: Resource, match: Callable[[Obj], bool],
                   c: Change) -> list[tuple[str, Obj]]:
        """A stored change as this watcher sees it: an object that starts or stops matching
        the selectors arrives as ADDED or DELETED, as from the API server's watch cache."""
        api = self.server.api
        now_matches = match(c.obj)
        was = c.old is not None and match(c.old)
        if c.type == "DELETED":
            return [("DELETED", api.out(r, c.obj))] if was else []
        if c.type == "ADDED":
            return [("ADDED", api.out(r, c.obj))] if now_matches else []
        if now_matches and was:
            return [("MODIFIED", api.out(r, c.obj))]
        if now_matches:
            return [("ADDED", api.out(r, c.obj))]
        if was:
            gone = api.out(r, c.obj)
            return [("DELETED", gone)]
        return []


# --- command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    parser.add_argument("--seed", help="a JSON file: nodes, pods, poddisruptionbudgets, ...")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for this server here")
    parser.add_argument("--token", help="the bearer token clients must send (default: random)")
    parser.add_argument("--history-size", type=int, default=1000,
                        help="changes kept for watches; older resourceVersions get 410 Gone")
    parser.add_argument("--bookmark-interval", type=float, default=5.0)
    parser.add_argument("--pools", help='node pools as JSON, e.g. \'{"gpu": {"spares": '
                        '["gpu-017"], "delay": 1.0}}\': a deleted member is replaced')
    parser.add_argument("--run-pods", action="store_true",
                        help="run Jobs: a job controller, scheduler and kubelet that run each "
                        "Job pod's command as a local process (the image is ignored)")
    parser.add_argument("--no-tls", action="store_true",
                        help="plain http (kubectl then sends no token: requests are anonymous)")
    args = parser.parse_args(argv)
    server = K8sTestServer(args.seed, host=args.host, port=args.port, token=args.token,
                           history_size=args.history_size,
                           bookmark_interval=args.bookmark_interval,
                           kubeconfig_path=args.kubeconfig, tls=not args.no_tls,
                           pools=json.loads(args.pools) if args.pools else None,
                           run_pods=args.run_pods)
    port = server.start()
    print(port, flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
