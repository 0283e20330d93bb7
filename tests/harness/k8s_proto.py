"""Decoding of the Kubernetes protobuf wire format, for the few bodies kubectl sends that way.

``kubectl create job`` (a typed client-go call) POSTs its Job as
``application/vnd.kubernetes.protobuf`` and does not fall back to JSON on a 415, so the test
server reads that one type: the envelope (``k8s\\0`` + ``runtime.Unknown``) and a batch/v1 Job
with the fields of k8s.io/api's generated.proto that a Job from kubectl or a client can carry.
Fields not in the tables below are skipped (their JSON counterpart stays unset); nothing is
ever encoded as protobuf (answers are JSON, which clients accept too).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tests.harness.k8s_rules import ApiError

Obj = dict[str, Any]
MAGIC = b"k8s\x00"
MEDIA_TYPE = "application/vnd.kubernetes.protobuf"

# message -> field number -> (JSON name, kind, repeated). Kinds: str, int, bool, bytes,
# time (metav1.Time), smap (map<string,string>), qmap (map<string,Quantity>), or a message.
F = tuple[str, str, bool]
SCHEMA: dict[str, dict[int, F]] = {
    "Unknown": {1: ("typeMeta", "TypeMeta", False), 2: ("raw", "bytes", False),
                3: ("contentEncoding", "str", False), 4: ("contentType", "str", False)},
    "TypeMeta": {1: ("apiVersion", "str", False), 2: ("kind", "str", False)},
    "Job": {1: ("metadata", "ObjectMeta", False), 2: ("spec", "JobSpec", False)},
    "ObjectMeta": {1: ("name", "str", False), 2: ("generateName", "str", False),
                   3: ("namespace", "str", False), 5: ("uid", "str", False),
                   6: ("resourceVersion", "str", False), 11: ("labels", "smap", False),
                   12: ("annotations", "smap", False),
                   13: ("ownerReferences", "OwnerReference", True),
                   14: ("finalizers", "str", True)},
    "OwnerReference": {1: ("kind", "str", False), 3: ("name", "str", False),
                       4: ("uid", "str", False), 5: ("apiVersion", "str", False),
                       6: ("controller", "bool", False),
                       7: ("blockOwnerDeletion", "bool", False)},
    "JobSpec": {1: ("parallelism", "int", False), 2: ("completions", "int", False),
                3: ("activeDeadlineSeconds", "int", False), 4: ("selector", "LabelSelector", False),
                5: ("manualSelector", "bool", False), 6: ("template", "PodTemplateSpec", False),
                7: ("backoffLimit", "int", False), 8: ("ttlSecondsAfterFinished", "int", False),
                9: ("completionMode", "str", False), 10: ("suspend", "bool", False),
                12: ("backoffLimitPerIndex", "int", False),
                13: ("maxFailedIndexes", "int", False),
                14: ("podReplacementPolicy", "str", False), 15: ("managedBy", "str", False)},
    "LabelSelector": {1: ("matchLabels", "smap", False),
                      2: ("matchExpressions", "Requirement", True)},
    "Requirement": {1: ("key", "str", False), 2: ("operator", "str", False),
                    3: ("values", "str", True)},
    "PodTemplateSpec": {1: ("metadata", "ObjectMeta", False), 2: ("spec", "PodSpec", False)},
    "PodSpec": {2: ("containers", "Container", True), 3: ("restartPolicy", "str", False),
                4: ("terminationGracePeriodSeconds", "int", False),
                5: ("activeDeadlineSeconds", "int", False), 6: ("dnsPolicy", "str", False),
                7: ("nodeSelector", "smap", False), 8: ("serviceAccountName", "str", False),
                10: ("nodeName", "str", False), 11: ("hostNetwork", "bool", False),
                16: ("hostname", "str", False), 18: ("affinity", "Affinity", False),
                19: ("schedulerName", "str", False), 20: ("initContainers", "Container", True),
                22: ("tolerations", "Toleration", True),
                24: ("priorityClassName", "str", False)},
    "Container": {1: ("name", "str", False), 2: ("image", "str", False),
                  3: ("command", "str", True), 4: ("args", "str", True),
                  5: ("workingDir", "str", False), 7: ("env", "EnvVar", True),
                  8: ("resources", "ResourceRequirements", False),
                  13: ("terminationMessagePath", "str", False),
                  14: ("imagePullPolicy", "str", False),
                  20: ("terminationMessagePolicy", "str", False)},
    "EnvVar": {1: ("name", "str", False), 2: ("value", "str", False)},
    "ResourceRequirements": {1: ("limits", "qmap", False), 2: ("requests", "qmap", False)},
    "Toleration": {1: ("key", "str", False), 2: ("operator", "str", False),
                   3: ("value", "str", False), 4: ("effect", "str", False),
                   5: ("tolerationSeconds", "int", False)},
    "Affinity": {1: ("nodeAffinity", "NodeAffinity", False)},
    "NodeAffinity": {1: ("requiredDuringSchedulingIgnoredDuringExecution", "NodeSelector",
                         False)},
    "NodeSelector": {1: ("nodeSelectorTerms", "NodeSelectorTerm", True)},
    "NodeSelectorTerm": {1: ("matchExpressions", "Requirement", True),
                         2: ("matchFields", "Requirement", True)},
    "Time": {1: ("seconds", "int", False), 2: ("nanos", "int", False)},
    "Quantity": {1: ("string", "str", False)},
    "Entry": {1: ("key", "bytes", False), 2: ("value", "bytes", False)},
}
KINDS = {("batch/v1", "Job"): "Job"}


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(data):
            raise ValueError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    out: list[tuple[int, int | bytes]] = []
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            out.append((number, value))
        elif wire == 2:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise ValueError("truncated field")
            out.append((number, data[at:at + size]))
            at += size
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def _scalar(kind: str, raw: int | bytes) -> Any:
    if kind == "int" and isinstance(raw, int):
        return raw - (1 << 64) if raw >= 1 << 63 else raw
    if kind == "bool" and isinstance(raw, int):
        return bool(raw)
    if kind == "str" and isinstance(raw, bytes):
        return raw.decode()
    if kind == "bytes" and isinstance(raw, bytes):
        return raw
    raise ValueError(f"a {kind} field has the wrong wire type")


def decode_message(kind: str, data: bytes) -> Obj:
    schema = SCHEMA[kind]
    out: Obj = {}
    for number, raw in _fields(data):
        if number not in schema:
            continue  # a field this server does not read
        name, field_kind, repeated = schema[number]
        if field_kind in ("smap", "qmap"):
            entry = decode_message("Entry", _scalar("bytes", raw))
            value: Any = entry.get("value", b"")
            if field_kind == "qmap":
                value = decode_message("Quantity", value).get("string", "")
            else:
                value = value.decode()
            out.setdefault(name, {})[entry.get("key", b"").decode()] = value
            continue
        if field_kind == "time":
            t = decode_message("Time", _scalar("bytes", raw))
            value = datetime.fromtimestamp(t.get("seconds", 0), UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ")
        elif field_kind in SCHEMA:
            value = decode_message(field_kind, _scalar("bytes", raw))
        else:
            value = _scalar(field_kind, raw)
        if repeated:
            out.setdefault(name, []).append(value)
        elif value not in ("", False):
            # Go writes every non-pointer string and bool; JSON would have left them out.
            out[name] = value
    return out


def decode(body: bytes) -> Obj:
    """A protobuf request body as the JSON object it stands for (400 if unreadable)."""
    try:
        if not body.startswith(MAGIC):
            raise ValueError("provided data does not appear to be a protobuf message, expected "
                             "prefix [107 56 115 0]")
        envelope = decode_message("Unknown", body[len(MAGIC):])
        meta = envelope.get("typeMeta") or {}
        kind = KINDS.get((meta.get("apiVersion", ""), meta.get("kind", "")))
        if kind is None:
            raise ValueError(f"the test server reads no {meta.get('kind')} in protobuf")
        obj = decode_message(kind, envelope.get("raw", b""))
    except (ValueError, UnicodeDecodeError, KeyError) as e:
        raise ApiError(400, f"the protobuf body could not be decoded: {e}") from None
    return {"apiVersion": meta["apiVersion"], "kind": meta["kind"], **obj}
