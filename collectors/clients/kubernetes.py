"""The real Kubernetes client: the official ``kubernetes`` package, in-cluster or from a
kubeconfig.

Reads go through the generated API methods with ``_preload_content=False`` and are parsed here
from JSON rather than into the generated models: one malformed object (an events.k8s.io Event
without ``eventTime`` is a classic) must cost that object, not the whole list, and it is
reported in ``last_warnings``.

``ready`` on a node follows base.K8sNode: the Ready condition's ``True`` -> True, ``False`` ->
False, ``Unknown`` (the node controller's mark when the kubelet stops posting status) -> None,
and no Ready condition at all -> None; ``ready_reason`` carries the condition's reason
(``NodeStatusUnknown``, ``KubeletNotReady``, ...), so Unknown stays distinguishable from "not
reported". The collector stores the status string and ``normalize.k8s_node_changes`` announces
every change between True, False and Unknown (diagnosis reads Unknown as not ready).

Errors: connection refused, timeouts, 5xx, 409 and 429 are ``ClientError(permanent=False)``;
400/401/403/404/405/415/422 are permanent, with the API server's own message.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from functools import cached_property
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException

from collectors.clients.base import (
    K8S_CORDON_REASON,
    K8S_CORDONED_BY,
    K8S_CORDONED_BY_FLEETWATCH,
    K8S_GATE,
    ActionResult,
    CheckJob,
    ClientError,
    EvictionBlocked,
    K8sEvent,
    K8sNode,
    K8sPod,
    NotFound,
    PodCheckSpec,
    Taint,
    relabel_call,
    relabelled,
)
from collectors.knowledge.slurm import SLINKY_POD_HOSTNAME_LABEL, SLINKY_POD_NAME_LABEL

Obj = dict[str, Any]

CORDONED_BY_VALUE = K8S_CORDONED_BY_FLEETWATCH
GPU_RESOURCE = "nvidia.com/gpu"
CHECK_CONTAINER = "check"
# A finished check Job stays this long for a person to read (kubectl logs job/NAME), then
# Kubernetes' TTL controller removes it: the gate has its output by then.
CHECK_JOB_TTL_SECONDS = 7 * 24 * 3600
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
PERMANENT_STATUSES = frozenset({400, 401, 403, 404, 405, 406, 415, 422})
PAGE_SIZE = 500
# The two event APIs; the cursor of event_changes is keyed by these names.
CORE_EVENTS = "core"
EVENTS_V1 = "events.k8s.io"


class KubernetesApiError(ClientError):
    """A ClientError that keeps the HTTP status the API server answered (0: no answer)."""

    def __init__(self, message: str, *, status: int = 0, permanent: bool = False) -> None:
        super().__init__(message, permanent=permanent)
        self.status = status


class KubernetesNotFound(KubernetesApiError, NotFound):
    """The API server's 404: the named object does not exist."""


class KubernetesEvictionBlocked(KubernetesApiError, EvictionBlocked):
    """The Eviction API's 429: the pod's PodDisruptionBudget allows no disruption now."""


class _Gone(Exception):
    """A watch's resourceVersion is older than the server keeps: relist."""


def parse_time(value: Any) -> float | None:
    """RFC 3339 (``2025-01-02T03:04:05Z`` or with microseconds) -> epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _str_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{what} is not a map of strings")
    return dict(value)


def node_from(obj: Obj) -> K8sNode:
    meta = obj["metadata"]
    name = meta["name"]
    if not isinstance(name, str) or not name:
        raise ValueError("metadata.name is missing")
    ready: bool | None = None
    reason = ""
    others: dict[str, tuple[str, str, str]] = {}
    for condition in (obj.get("status") or {}).get("conditions") or []:
        kind = condition.get("type")
        if kind == "Ready":
            status = condition.get("status")
            if status not in ("True", "False", "Unknown"):
                raise ValueError(f"Ready condition status {status!r}")
            ready = {"True": True, "False": False}.get(status)
            reason = str(condition.get("reason") or "")
        elif isinstance(kind, str) and kind:
            # Any other condition is read as it is: health tools write their own types, and
            # an odd one is their word to show, not a node to refuse.
            others[kind] = (str(condition.get("status") or "Unknown"),
                            str(condition.get("reason") or ""),
                            str(condition.get("message") or ""))
    spec = obj.get("spec") or {}
    taints = tuple((str(t.get("key") or ""), str(t.get("value") or ""), str(t.get("effect") or ""))
                   for t in spec.get("taints") or [] if isinstance(t, dict))
    return K8sNode(name=name, ready=ready, conditions=others, taints=taints,
                   unschedulable=bool(spec.get("unschedulable")),
                   gpus=_gpus((obj.get("status") or {}).get("allocatable")),
                   annotations=_str_map(meta.get("annotations"), "metadata.annotations"),
                   labels=_str_map(meta.get("labels"), "metadata.labels"), ready_reason=reason)


def _gpus(allocatable: Any) -> int | None:
    """The node's allocatable ``nvidia.com/gpu`` (the device plugin's count); None when it
    advertises none or the quantity is not a whole number."""
    value = (allocatable or {}).get(GPU_RESOURCE) if isinstance(allocatable, dict) else None
    try:
        return int(str(value)) if value is not None else None
    except ValueError:
        return None


def pod_from(obj: Obj) -> K8sPod:
    meta = obj["metadata"]
    annotations = _str_map(meta.get("annotations"), "metadata.annotations")
    owners = meta.get("ownerReferences") or []
    controller = next((o for o in owners if o.get("controller")), owners[0] if owners else {})
    status = obj.get("status") or {}
    ready = None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            ready = condition.get("status") == "True"
    return K8sPod(
        namespace=meta["namespace"], name=meta["name"],
        node=(obj.get("spec") or {}).get("nodeName") or "",
        labels=_str_map(meta.get("labels"), "metadata.labels"),
        owner_kind=str(controller.get("kind") or ""), phase=str(status.get("phase") or ""),
        mirror=MIRROR_ANNOTATION in annotations, ready=ready, uid=str(meta.get("uid") or ""),
        annotations=annotations, terminating=bool(meta.get("deletionTimestamp")),
        gpus=_pod_gpus(obj.get("spec") or {}))


def _pod_gpus(spec: Obj) -> int:
    """The GPUs a pod holds: its containers' nvidia.com/gpu (an extended resource is asked
    for in limits, requests equal to them when given); a quantity not a whole number counts 0."""
    total = 0
    for container in spec.get("containers") or []:
        resources = (container or {}).get("resources") or {}
        value = (resources.get("limits") or {}).get(GPU_RESOURCE,
                                                     (resources.get("requests") or {}).get(
                                                         GPU_RESOURCE, 0))
        try:
            total += int(str(value))
        except ValueError:
            continue
    return total


def event_from_core(obj: Obj) -> K8sEvent | None:
    involved = obj.get("involvedObject") or {}
    if involved.get("kind") != "Node":
        return None
    meta = obj["metadata"]
    at = (parse_time(obj.get("lastTimestamp")) or parse_time(obj.get("eventTime"))
          or parse_time((obj.get("series") or {}).get("lastObservedTime"))
          or parse_time(obj.get("firstTimestamp")) or parse_time(meta.get("creationTimestamp")))
    return K8sEvent(node=str(involved["name"]), reason=str(obj.get("reason") or ""),
                    message=str(obj.get("message") or ""), type=str(obj.get("type") or "Normal"),
                    at=at, namespace=str(meta.get("namespace") or "default"),
                    name=str(meta["name"]))


def event_from_v1(obj: Obj) -> K8sEvent | None:
    regarding = obj.get("regarding") or {}
    if regarding.get("kind") != "Node":
        return None
    meta = obj["metadata"]
    at = (parse_time((obj.get("series") or {}).get("lastObservedTime"))
          or parse_time(obj.get("eventTime")) or parse_time(obj.get("deprecatedLastTimestamp"))
          or parse_time(meta.get("creationTimestamp")))
    return K8sEvent(node=str(regarding["name"]), reason=str(obj.get("reason") or ""),
                    message=str(obj.get("note") or ""), type=str(obj.get("type") or "Normal"),
                    at=at, namespace=str(meta.get("namespace") or "default"),
                    name=str(meta["name"]))


def _rv_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# --- the return-to-service gate's check Jobs ---------------------------------------------------


def check_job_manifest(spec: PodCheckSpec) -> Obj:
    """The batch/v1 Job of one acceptance check: one pod, never retried (a check that fails is
    the verdict, not a flake to retry), pinned to the node by a required node affinity on its
    name (what the DaemonSet controller uses: the scheduler still checks the node's resources,
    unlike ``nodeName``), asking for every GPU so nothing shares the node with it.

    It tolerates every NoSchedule taint: the node is cordoned and carries the gate's own taint
    (the check is the one pod meant to run there), and GPU nodes often carry a taint of their
    own. NoExecute taints are not tolerated: a node going NotReady or unreachable evicts the
    check, which then fails rather than hanging."""
    labels = {"app.kubernetes.io/managed-by": "fleetwatch",
              "app.kubernetes.io/component": "acceptance-check", **dict(spec.labels)}
    container: Obj = {"name": CHECK_CONTAINER, "image": spec.image,
                      "command": ["/bin/sh", "-c", spec.script],
                      "imagePullPolicy": "IfNotPresent"}
    if spec.gpus:
        container["resources"] = {"limits": {GPU_RESOURCE: str(spec.gpus)}}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": max(1, spec.minutes) * 60,
            "ttlSecondsAfterFinished": CHECK_JOB_TTL_SECONDS,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                                                  {"nodeSelectorTerms": [{"matchFields": [
                                                      {"key": "metadata.name", "operator": "In",
                                                       "values": [spec.node]}]}]}}},
                    "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [container],
                }}}}


def check_job_state(job: Obj, pod: Obj | None) -> tuple[str, int | None, str]:
    """(state in Slurm's words, the check container's exit code, why it waits or ended) of a
    check Job and its newest pod."""
    status = job.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []
                  if isinstance(c, dict) and c.get("status") == "True"}
    container = _check_container(pod)
    terminated = (container.get("state") or {}).get("terminated") or {}
    code = terminated.get("exitCode")
    exit_code = int(code) if isinstance(code, int) else None
    if "Complete" in conditions:
        return "COMPLETED", exit_code if exit_code is not None else 0, ""
    failed = conditions.get("Failed") or conditions.get("FailureTarget")
    if failed is not None:
        reason = str(failed.get("reason") or "")
        why = f"{reason}: {failed.get('message') or ''}".strip(": ")
        return ("TIMEOUT" if reason == "DeadlineExceeded" else "FAILED"), exit_code, why
    if pod is None:
        return "PENDING", None, "no pod yet"
    pod_status = pod.get("status") or {}
    if pod_status.get("phase") in ("Succeeded", "Failed"):
        # The pod ended; the Job's condition follows on the controller's next pass.
        return ("COMPLETED" if pod_status["phase"] == "Succeeded" else "FAILED"), exit_code, ""
    if pod_status.get("phase") == "Running":
        return "RUNNING", None, ""
    unscheduled = next((c for c in pod_status.get("conditions") or []
                        if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    if unscheduled is not None:
        return "PENDING", None, (f"{unscheduled.get('reason') or 'Unschedulable'}: "
                                 f"{unscheduled.get('message') or ''}").strip(": ")
    waiting = (container.get("state") or {}).get("waiting") or {}
    if waiting:
        return "PENDING", None, (f"{waiting.get('reason') or 'Waiting'}: "
                                 f"{waiting.get('message') or ''}").strip(": ")
    return "PENDING", None, str(pod_status.get("phase") or "Pending")


def _check_container(pod: Obj | None) -> Obj:
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    return next((c for c in statuses if c.get("name") == CHECK_CONTAINER),
                statuses[0] if statuses else {})


class KubernetesApi:
    """``KubernetesClient`` over the Kubernetes API, with the change feeds the collector
    watches (``node_changes``, ``event_changes``)."""

    last_warnings: list[str]

    def __init__(self, kubeconfig: str | None = None, context: str | None = None,
                 timeout: float = 10.0, evict_max_wait: float = 60.0, *,
                 evict_backoff: tuple[float, float] = (0.5, 5.0)) -> None:
        self.timeout = timeout
        self.evict_max_wait = evict_max_wait
        self.evict_backoff = evict_backoff
        self.last_warnings: list[str] = []
        # Nodes a node_changes() watch saw deleted (K8sNode cannot say "gone").
        self.deleted_nodes: list[str] = []
        configuration = client.Configuration()
        # A configuration that cannot be read fails the first call, not the construction:
        # every client of a cluster is built for each collection and step, and one that
        # reads only telemetry (or only Slurm) must not need a Kubernetes configuration.
        self._config_error: ClientError | None = None
        try:
            if kubeconfig is None and context is None and os.environ.get(
                    "KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)
                self.where = "in-cluster"
            else:
                config.load_kube_config(config_file=kubeconfig, context=context,
                                        client_configuration=configuration,
                                        persist_config=False)
                self.where = kubeconfig or "~/.kube/config"
        except (ConfigException, OSError) as e:
            self._config_error = ClientError(f"Kubernetes configuration: {e}", permanent=True)
            self.where = "not configured"
        # Connection failures retry a little inside urllib3; a request that reached the server
        # is never repeated behind our back (an eviction is not idempotent).
        configuration.retries = urllib3.Retry(total=2, connect=2, read=0, redirect=0,
                                              status=0, other=0, backoff_factor=0.2)
        self._configuration = configuration

    @cached_property
    def api_client(self) -> client.ApiClient:
        if self._config_error is not None:
            raise self._config_error
        return client.ApiClient(self._configuration)

    @cached_property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @cached_property
    def events_v1(self) -> client.EventsV1Api:
        return client.EventsV1Api(self.api_client)

    @cached_property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api_client)

    def close(self) -> None:
        if "api_client" in self.__dict__:  # built, so there is a pool to close
            self.api_client.close()

    # --- plumbing ---

    def _timeout(self, read: float | None = None) -> tuple[float, float]:
        # A tuple, always: the client ignores a float _request_timeout.
        return (self.timeout, read if read is not None else self.timeout)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", self._timeout())
        try:
            return fn(*args, **kwargs)
        except ApiException as e:
            raise self._api_error(what, e) from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise KubernetesApiError(f"{what}: Kubernetes API at {self.where} unreachable: {e}",
                                     permanent=False) from e

    @staticmethod
    def _api_error(what: str, e: ApiException) -> KubernetesApiError:
        status = int(e.status or 0)
        message = str(e.reason or "")
        try:
            body = json.loads(e.body) if e.body else {}
            message = str(body.get("message") or message)
            # The API server's own why, where it gives one: which disruption budget refused an
            # eviction and what it needs, which field a write got wrong.
            causes = [str(c.get("message")) for c in (body.get("details") or {}).get("causes")
                      or [] if isinstance(c, dict) and c.get("message")]
            if causes and not all(c in message for c in causes):
                message = f"{message} ({'; '.join(causes)})"
        except (ValueError, TypeError, AttributeError):
            pass
        kind = KubernetesNotFound if status == 404 else KubernetesApiError
        return kind(f"{what}: {status} {message}".strip(), status=status,
                    permanent=status in PERMANENT_STATUSES)

    def _json(self, what: str, response: Any) -> Obj:
        try:
            body = json.loads(response.data)
        except ValueError as e:
            raise KubernetesApiError(f"{what}: the API answered something that is not JSON "
                                     f"({response.data[:200]!r})") from e
        if not isinstance(body, dict):
            raise KubernetesApiError(f"{what}: the API answered {type(body).__name__}, not an "
                                     "object")
        return body

    def _warn(self, what: str, obj: Any, error: Exception) -> None:
        excerpt = json.dumps(obj, default=str)[:300] if obj is not None else ""
        self.last_warnings.append(f"{what}: skipped a malformed object ({error}): {excerpt}")

    def _parse(self, what: str, parse: Callable[[Obj], Any], obj: Any) -> Any:
        try:
            if not isinstance(obj, dict):
                raise TypeError("not an object")
            return parse(obj)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self._warn(what, obj, e)
            return None

    def _list(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> tuple[list[Any], str]:
        """Every page of a list, and the list's resourceVersion."""
        for _ in range(3):
            items: list[Any] = []
            resource_version, cont = "", None
            try:
                while True:
                    body = self._json(what, self._call(what, fn, limit=PAGE_SIZE, _continue=cont,
                                                       _preload_content=False, **kwargs))
                    page = body.get("items")
                    if not isinstance(page, list):
                        raise KubernetesApiError(f"{what}: the list has no items")
                    items += page
                    meta = body.get("metadata") or {}
                    resource_version = resource_version or str(meta.get("resourceVersion") or "")
                    cont = meta.get("continue")
                    if not cont:
                        return items, resource_version
            except KubernetesApiError as e:
                if e.status != 410:
                    raise
                # The continue token expired between pages: start the list again.
        raise KubernetesApiError(f"{what}: the list kept expiring between pages")

    def _watch(self, what: str, fn: Callable[..., Any], resource_version: str,
               timeout_seconds: float, **kwargs: Any) -> Iterator[Obj]:
        """Watch events after ``resource_version`` until the server ends the watch after
        ``timeout_seconds``; raises _Gone on 410."""
        seconds = max(1, math.ceil(timeout_seconds))  # 0 would mean "no timeout" to the API

        def list_call(**params: Any) -> Any:
            # No docstring, so Watch finds no model to build: objects stay dicts (parsed here,
            # one at a time). Its deserialize=False mode cannot be used: it breaks on the
            # ERROR event that carries 410 Gone.
            return fn(**params)

        stream = watch.Watch().stream(
            list_call, resource_version=resource_version, allow_watch_bookmarks=True,
            timeout_seconds=seconds, _request_timeout=self._timeout(seconds + self.timeout),
            **kwargs)
        try:
            yield from stream
        except ApiException as e:
            if e.status == 410:
                raise _Gone(str(e.reason)) from e
            raise self._api_error(what, e) from e
        except ValueError as e:  # a line that is not JSON: the stream cannot be trusted
            raise KubernetesApiError(f"{what}: the watch sent something that is not JSON: "
                                     f"{e}") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise KubernetesApiError(f"{what}: Kubernetes API at {self.where} unreachable: {e}",
                                     permanent=False) from e

    def _read_node(self, node: str) -> Obj:
        response = self._call(f"get node {node}", self.core.read_node, node,
                              _preload_content=False)
        return self._json(f"get node {node}", response)

    # --- reads ---

    def nodes(self) -> list[K8sNode]:
        self.last_warnings = []
        items, _ = self._list("list nodes", self.core.list_node)
        return [n for n in (self._parse("list nodes", node_from, o) for o in items) if n]

    def node(self, name: str) -> K8sNode:
        obj = self._read_node(name)
        try:
            return node_from(obj)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise KubernetesApiError(f"get node {name}: malformed node ({e})") from e

    def pods_on_node(self, node: str) -> list[K8sPod]:
        self.last_warnings = []
        self._read_node(node)  # an unknown node is an error, not an empty node
        items, _ = self._list(f"list pods on {node}", self.core.list_pod_for_all_namespaces,
                              field_selector=f"spec.nodeName={node}")
        pods = [p for p in (self._parse(f"list pods on {node}", pod_from, o) for o in items) if p]
        return sorted(pods, key=lambda p: (p.namespace, p.name))

    def slurm_nodes(self) -> dict[str, str]:
        """Slinky: each running slurmd pod's Slurm node name -> the Kubernetes node it runs on
        (spec.nodeName). Pods not yet scheduled are left out: they are no machine yet."""
        self.last_warnings = []
        items, _ = self._list("list slurmd pods", self.core.list_pod_for_all_namespaces,
                              label_selector=SLINKY_POD_NAME_LABEL)
        found: dict[str, str] = {}
        for pod in items:
            meta = pod.get("metadata") or {}
            spec = pod.get("spec") or {}
            node = spec.get("nodeName")
            slurm = (meta.get("labels") or {}).get(SLINKY_POD_HOSTNAME_LABEL) \
                or spec.get("hostname") or meta.get("name")
            if node and slurm:
                found[str(slurm)] = str(node)
        return found

    # --- change feeds ---

    def node_changes(self, cursor: str | None, timeout_seconds: float,
                     ) -> tuple[list[K8sNode], str, bool]:
        """``(nodes, resourceVersion, relisted)``. No cursor (or a 410 Gone): every node, from a
        list. A cursor: the nodes that changed since (the last state of each), from a watch
        that lasts ``timeout_seconds``; the returned resourceVersion is the newest seen,
        bookmarks included, so a quiet cluster still moves the cursor forward."""
        self.last_warnings, self.deleted_nodes = [], []
        if cursor:
            try:
                return self._node_watch(cursor, timeout_seconds)
            except _Gone:
                self.last_warnings.append(f"node watch from resourceVersion {cursor} expired "
                                          "(410 Gone): relisted")
        items, resource_version = self._list("list nodes", self.core.list_node)
        nodes = [n for n in (self._parse("list nodes", node_from, o) for o in items) if n]
        return nodes, resource_version, True

    def _node_watch(self, cursor: str, timeout_seconds: float,
                    ) -> tuple[list[K8sNode], str, bool]:
        latest: dict[str, K8sNode] = {}
        resource_version = cursor
        for event in self._watch("watch nodes", self.core.list_node, cursor, timeout_seconds):
            kind, obj = event.get("type"), event.get("object")
            rv = ((obj or {}).get("metadata") or {}).get("resourceVersion") if isinstance(
                obj, dict) else None
            if kind in ("ADDED", "MODIFIED"):
                node = self._parse("watch nodes", node_from, obj)
                if node is not None:
                    latest[node.name] = node
                    if node.name in self.deleted_nodes:
                        self.deleted_nodes.remove(node.name)
            elif kind == "DELETED":
                name = ((obj or {}).get("metadata") or {}).get("name")
                if name:
                    latest.pop(name, None)
                    self.deleted_nodes.append(name)
            elif kind != "BOOKMARK":
                self._warn("watch nodes", event, ValueError(f"unknown event type {kind!r}"))
            if rv:
                resource_version = str(rv)
        return sorted(latest.values(), key=lambda n: n.name), resource_version, False

    def event_changes(self, cursor: dict[str, Any] | None, timeout_seconds: float,
                      ) -> tuple[list[K8sEvent], dict[str, Any]]:
        """Node events from core/v1 and events.k8s.io/v1, each listed once and then watched
        from its own resourceVersion (the cursor holds both). One event is visible through
        both APIs with the same uid; it is returned once. After a 410 Gone the API is
        relisted and only events with a newer resourceVersion than the cursor's are returned
        (resourceVersions are etcd revisions: a larger one is a later write)."""
        self.last_warnings = []
        cursor = dict(cursor or {})
        feeds = [(CORE_EVENTS, self.core.list_event_for_all_namespaces, "involvedObject.kind=Node",
                  event_from_core),
                 (EVENTS_V1, self.events_v1.list_event_for_all_namespaces, "regarding.kind=Node",
                  event_from_v1)]
        first = not cursor
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="k8s-events") as pool:
            futures = [pool.submit(self._event_feed, api, fn, selector, parse,
                                   None if first else cursor.get(api), timeout_seconds)
                       for api, fn, selector, parse in feeds]
            results = [f.result() for f in futures]
        seen: dict[str, K8sEvent] = {}
        new_cursor: dict[str, Any] = {}
        for (api, *_), (events, resource_version) in zip(feeds, results, strict=True):
            new_cursor[api] = resource_version
            for uid, event in events:
                seen.setdefault(uid, event)  # core/v1 first: it carries lastTimestamp
        ordered = sorted(seen.values(), key=lambda e: (e.at or 0.0, e.namespace, e.name))
        return ordered, new_cursor

    def _event_feed(self, api: str, fn: Callable[..., Any], selector: str,
                    parse: Callable[[Obj], K8sEvent | None], cursor: str | None,
                    timeout_seconds: float) -> tuple[list[tuple[str, K8sEvent]], str | None]:
        what = f"{api} events"
        if cursor:
            try:
                return self._event_watch(what, fn, selector, parse, cursor, timeout_seconds)
            except _Gone:
                self.last_warnings.append(f"{what} watch from resourceVersion {cursor} expired "
                                          "(410 Gone): relisted")
        try:
            items, resource_version = self._list(f"list {what}", fn, field_selector=selector)
        except KubernetesApiError as e:
            if e.status == 404 and api == EVENTS_V1:  # a server without events.k8s.io/v1
                self.last_warnings.append(f"{what}: not served ({e})")
                return [], None
            raise
        after = _rv_int(cursor)
        events = []
        for obj in items:
            parsed = self._parse(what, lambda o: (o["metadata"].get("uid") or
                                                  f"{o['metadata'].get('namespace')}/"
                                                  f"{o['metadata']['name']}", parse(o)), obj)
            if parsed is None or parsed[1] is None:
                continue
            rv = _rv_int(obj["metadata"].get("resourceVersion"))
            if after is not None and rv is not None and rv <= after:
                continue  # announced before the watch expired
            events.append(parsed)
        return events, resource_version

    def _event_watch(self, what: str, fn: Callable[..., Any], selector: str,
                     parse: Callable[[Obj], K8sEvent | None], cursor: str,
                     timeout_seconds: float) -> tuple[list[tuple[str, K8sEvent]], str]:
        events: dict[str, K8sEvent] = {}
        resource_version = cursor
        for event in self._watch(f"watch {what}", fn, cursor, timeout_seconds,
                                 field_selector=selector):
            kind, obj = event.get("type"), event.get("object")
            meta = (obj or {}).get("metadata") or {} if isinstance(obj, dict) else {}
            if kind in ("ADDED", "MODIFIED"):
                parsed = self._parse(what, parse, obj)
                if parsed is not None:
                    uid = str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")
                    events[uid] = parsed
            if meta.get("resourceVersion"):
                resource_version = str(meta["resourceVersion"])
        return list(events.items()), resource_version

    # --- actions ---

    def cordon(self, node: str, reason: str) -> ActionResult:
        call = (f"kubectl cordon {node} && kubectl annotate node {node} "
                f"{K8S_CORDONED_BY}={CORDONED_BY_VALUE} {K8S_CORDON_REASON}={shlex.quote(reason)}")

        def decide(spec: Obj, annotations: dict[str, str]) -> Obj | ActionResult:
            if spec.get("unschedulable"):
                if annotations.get(K8S_CORDONED_BY) == CORDONED_BY_VALUE:
                    return ActionResult(call, False, f"{node} already cordoned by FleetWatch "
                                        f"({annotations.get(K8S_CORDON_REASON, '')})")
                # Someone else's cordon stays theirs: no FleetWatch mark, so no uncordon later.
                return ActionResult(call, False, f"{node} already cordoned by someone else; "
                                    "left as it is")
            return {"annotations": {K8S_CORDONED_BY: CORDONED_BY_VALUE,
                                    K8S_CORDON_REASON: reason},
                    "spec": {"unschedulable": True}}

        return self._patch_node_checked(node, "cordon", call, f"{node} cordoned: {reason}",
                                        decide)

    def uncordon(self, node: str) -> ActionResult:
        call = (f"kubectl uncordon {node} && kubectl annotate node {node} "
                f"{K8S_CORDONED_BY}- {K8S_CORDON_REASON}-")

        def decide(spec: Obj, annotations: dict[str, str]) -> Obj | ActionResult:
            if not spec.get("unschedulable"):
                return ActionResult(call, False, f"{node} is not cordoned")
            if annotations.get(K8S_CORDONED_BY) != CORDONED_BY_VALUE:
                raise KubernetesApiError(f"{node} was cordoned by someone else; not uncordoning",
                                         permanent=True)
            return {"annotations": {K8S_CORDONED_BY: None, K8S_CORDON_REASON: None},
                    "spec": {"unschedulable": None}}

        return self._patch_node_checked(node, "uncordon", call, f"{node} uncordoned", decide)

    def _patch_node_checked(self, node: str, verb: str, call: str, done: str,
                            decide: Callable[[Obj, dict[str, str]], Obj | ActionResult]
                            ) -> ActionResult:
        """Read the node, let ``decide`` answer (an ActionResult: nothing to do) or name the
        change (annotations and spec), and make it as one patch conditional on the
        resourceVersion just read: the cordon and its ownership mark land together or not at
        all. A node that changed under us (409) is read again, twice at most."""
        for attempt in range(3):
            obj = self._read_node(node)
            meta = obj.get("metadata") or {}
            decided = decide(obj.get("spec") or {}, meta.get("annotations") or {})
            if isinstance(decided, ActionResult):
                return decided
            patch = {"metadata": {"resourceVersion": meta.get("resourceVersion"),
                                  "annotations": decided["annotations"]},
                     "spec": decided["spec"]}
            try:
                self._call(f"{verb} {node}", self.core.patch_node, node, patch,
                           _preload_content=False)
            except KubernetesApiError as e:
                if e.status == 409 and attempt < 2:
                    continue  # the node changed under us: read it again
                raise
            return ActionResult(call, True, done, {"request": f"PATCH /api/v1/nodes/{node}"})
        raise KubernetesApiError(f"{verb} {node}: the node kept changing", permanent=False)

    def relabel(self, node: str, labels: Mapping[str, str | None],
                add_taints: Sequence[Taint], remove_taints: Sequence[str],
                annotations: Mapping[str, str | None]) -> ActionResult:
        """Labels, taints and annotations in one patch, conditional on the resourceVersion
        just read (a node changed under us, 409, is read again): the taint list is sent
        whole, as ``kubectl taint`` does, so a taint someone else added meanwhile is never
        dropped by a stale copy."""
        call = relabel_call(node, labels, add_taints, remove_taints, annotations)
        for attempt in range(3):
            obj = self._read_node(node)
            meta = obj.get("metadata") or {}
            current = node_from(obj)
            new_labels, new_taints, new_annotations = relabelled(
                current.labels, current.taints, current.annotations, labels, add_taints,
                remove_taints, annotations)
            if (new_labels, new_taints, new_annotations) == (
                    current.labels, current.taints, current.annotations):
                return ActionResult(call, False, f"{node} already labelled and tainted so")
            # A merge patch: labels and annotations merge key by key (None removes one); the
            # taints are replaced as one list (null: none left).
            patch: Obj = {"metadata": {
                "resourceVersion": meta.get("resourceVersion"),
                "labels": {k: new_labels.get(k) for k in {*current.labels, *new_labels}
                           if current.labels.get(k) != new_labels.get(k)},
                "annotations": {k: new_annotations.get(k)
                                for k in {*current.annotations, *new_annotations}
                                if current.annotations.get(k) != new_annotations.get(k)}}}
            if new_taints != current.taints:
                patch["spec"] = {"taints": [
                    {"key": k, "effect": e, **({"value": v} if v else {})}
                    for k, v, e in new_taints] or None}
            try:
                self._call(f"relabel {node}", self.core.patch_node, node, patch,
                           _preload_content=False)
            except KubernetesApiError as e:
                if e.status == 409 and attempt < 2:
                    continue
                raise
            return ActionResult(call, True, f"{node} labelled and tainted",
                                {"request": f"PATCH /api/v1/nodes/{node}",
                                 "labels": new_labels, "taints": [list(t) for t in new_taints]})
        raise KubernetesApiError(f"relabel {node}: the node kept changing", permanent=False)

    def evict(self, namespace: str, pod: str) -> ActionResult:
        """Evict through the policy/v1 Eviction API, which honours PodDisruptionBudgets: a 429
        (not yet) is retried with backoff for up to ``evict_max_wait`` seconds."""
        call = f"POST /api/v1/namespaces/{namespace}/pods/{pod}/eviction  # policy/v1 Eviction"
        what = f"evict {namespace}/{pod}"
        try:
            response = self._call(what, self.core.read_namespaced_pod, pod, namespace,
                                  _preload_content=False)
        except KubernetesApiError as e:
            if e.status == 404:
                return ActionResult(call, False, f"{namespace}/{pod} already gone")
            raise
        found = pod_from(self._json(what, response))
        if found.owner_kind == "DaemonSet":
            return ActionResult(call, False, f"{namespace}/{pod} is a DaemonSet pod: left in "
                                "place (as kubectl drain --ignore-daemonsets does)")
        if found.mirror:
            return ActionResult(call, False, f"{namespace}/{pod} is a static (mirror) pod: "
                                "its kubelet owns it, the API cannot evict it")
        if found.terminating:
            return ActionResult(call, False, f"{namespace}/{pod} is already terminating")
        body = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=pod, namespace=namespace),
            # The pod read above, not a same-named replacement (a StatefulSet's).
            delete_options=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid=found.uid or None)))
        started = time.monotonic()
        delay, most = self.evict_backoff
        attempts = 0
        while True:
            attempts += 1
            try:
                self._call(what, self.core.create_namespaced_pod_eviction, pod, namespace, body,
                           _preload_content=False)
                waited = time.monotonic() - started
                return ActionResult(call, True, f"{namespace}/{pod} evicted"
                                    + (f" after {waited:.0f}s of disruption-budget waits"
                                       if attempts > 1 else ""),
                                    {"attempts": attempts, "waited_seconds": round(waited, 1)})
            except KubernetesApiError as e:
                if e.status == 404:
                    return ActionResult(call, False, f"{namespace}/{pod} already gone")
                if e.status == 409:
                    return ActionResult(call, False, f"{namespace}/{pod} already gone (a new "
                                        "pod has its name)")
                if e.status == 500 and "more than one PodDisruptionBudget" in str(e):
                    raise KubernetesApiError(str(e), status=500, permanent=True) from e
                if e.status != 429:
                    raise
                left = self.evict_max_wait - (time.monotonic() - started)
                if left <= 0:
                    raise KubernetesEvictionBlocked(
                        f"{what}: a PodDisruptionBudget blocks the eviction ({e}); still "
                        f"blocked after {attempts} attempts in {self.evict_max_wait:.0f}s",
                        status=429, permanent=False) from e
                time.sleep(min(delay, left))
                delay = min(delay * 2, most)

    # --- the return-to-service gate's check Jobs ---

    def submit_check(self, spec: PodCheckSpec) -> ActionResult:
        call = (f"kubectl create -n {spec.namespace} -f - <<< '<Job {spec.name}: "
                f"{spec.image} on {spec.node}, {spec.gpus or 0} GPU(s), "
                f"{spec.minutes} min deadline>'")
        what = f"create job {spec.namespace}/{spec.name}"
        try:
            self._call(what, self.batch.create_namespaced_job, spec.namespace,
                       check_job_manifest(spec), _preload_content=False)
        except KubernetesApiError as e:
            if e.status == 409:  # created before (a retried poll): that Job is this check
                return ActionResult(call, False, f"check Job {spec.namespace}/{spec.name} "
                                    "exists already", {"job_id": spec.name})
            raise
        return ActionResult(call, True, f"check Job {spec.namespace}/{spec.name} created on "
                            f"{spec.node}", {"job_id": spec.name,
                                             "request": f"POST /apis/batch/v1/namespaces/"
                                                        f"{spec.namespace}/jobs"})

    def _read_job(self, namespace: str, name: str) -> Obj | None:
        """The Job as the API has it; None when it is gone (404)."""
        what = f"get job {namespace}/{name}"
        try:
            return self._json(what, self._call(what, self.batch.read_namespaced_job, name,
                                               namespace, _preload_content=False))
        except KubernetesApiError as e:
            if e.status == 404:
                return None
            raise

    def check_job(self, namespace: str, name: str) -> CheckJob | None:
        job = self._read_job(namespace, name)
        if job is None:
            return None
        # The Job's own selector (its controller-uid), so a same-named Job's leftover pods
        # are not read as this one's; job-name where a Job has none to show.
        match = ((job.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        selector = ",".join(f"{k}={v}" for k, v in sorted(match.items())) or f"job-name={name}"
        pods, _ = self._list(f"list pods of job {namespace}/{name}",
                             self.core.list_namespaced_pod, namespace=namespace,
                             label_selector=selector)
        pods = [p for p in pods if isinstance(p, dict)]
        pod = max(pods, key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp")
                                          or ""), default=None)
        state, exit_code, why = check_job_state(job, pod)
        node = str(((pod or {}).get("spec") or {}).get("nodeName") or "")
        output: str | None = None
        if state not in ("PENDING", "RUNNING") and pod is not None:
            output = self._pod_log(namespace, str(pod["metadata"]["name"]))
        return CheckJob(name, name, state, exit_code, why, (node,) if node else (), output)

    def _pod_log(self, namespace: str, pod: str) -> str | None:
        """The check pod's log (its last 64 KiB), None where the API cannot give it (the
        pod is gone, its node does not answer)."""
        what = f"log of pod {namespace}/{pod}"
        try:
            response = self._call(what, self.core.read_namespaced_pod_log, pod, namespace,
                                  container=CHECK_CONTAINER, limit_bytes=65536,
                                  _preload_content=False)
        except KubernetesApiError:
            return None
        data = response.data
        return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)

    def cancel_check(self, namespace: str, name: str) -> ActionResult:
        call = f"kubectl delete job -n {namespace} {name} --cascade=background"
        what = f"delete job {namespace}/{name}"
        job = self._read_job(namespace, name)
        if job is None:
            return ActionResult(call, False, f"check Job {namespace}/{name} is gone already")
        if K8S_GATE not in ((job.get("metadata") or {}).get("labels") or {}):
            raise KubernetesApiError(f"Job {namespace}/{name} has no {K8S_GATE} label: not "
                                     "FleetWatch's; not deleting it", permanent=True)
        try:
            # Background: the pod goes with the Job (batch/v1 would orphan it by default).
            self._call(what, self.batch.delete_namespaced_job, name, namespace,
                       propagation_policy="Background", _preload_content=False)
        except KubernetesApiError as e:
            if e.status == 404:
                return ActionResult(call, False, f"check Job {namespace}/{name} is gone already")
            raise
        return ActionResult(call, True, f"check Job {namespace}/{name} deleted with its pod")
