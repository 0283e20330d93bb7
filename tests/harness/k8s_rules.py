"""What the real Kubernetes API server checks before it touches storage, with its own words.

The test server (``k8s_server.py``) answers through these rules so that a client meets the
errors a cluster gives: a malformed ``labelSelector`` or ``fieldSelector`` is a 400 BadRequest
whose message is the one k8s.io/apimachinery writes (``unable to parse requirement: ...``,
``field label not supported: ...``); an object whose JSON does not fit the Go types is a 400
(create/update) or a 422 on the ``patch`` field (patch), as encoding/json words it; an object
with bad names, label keys or values, or taints is a 422 Invalid Status with ``details.causes``
(one per field error, ``field.Error.ErrorBody()`` as the message). The texts follow the
Kubernetes 1.32 sources (labels/selector.go, fields/selector.go, util/validation,
util/validation/field, api/errors); the grammar is re-implemented here, not translated.

Also here: the fields a real API server always serialises (Go struct fields without
``omitempty``), so that typed clients that insist on them (the official Python client's
models) read this server's objects as they read a cluster's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


class ApiError(Exception):
    """Answered as a ``Status`` object, the way the API server reports failures."""

    REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
               405: "MethodNotAllowed", 406: "NotAcceptable", 409: "Conflict", 410: "Expired",
               415: "UnsupportedMediaType", 422: "Invalid", 429: "TooManyRequests",
               500: "InternalError"}

    def __init__(self, code: int, message: str, *, reason: str = "",
                 details: Obj | None = None) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.reason = reason or self.REASONS.get(code, "Unknown")
        self.details = details

    def status(self) -> Obj:
        body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


# --- Go's formatting --------------------------------------------------------------------------


def go_quote(text: str) -> str:
    """Go's ``%q`` for a string (what field errors print for a bad value)."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\a\b\f\n\r\t\v":
            out.append({"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
                        "\t": "\\t", "\v": "\\v"}[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out) + '"'


def go_value(value: Any) -> str:
    """Go's ``%+v`` of a decoded JSON value (``map[a:1 b:[x y]]``)."""
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{go_value(v)}" for k, v in sorted(value.items())) + "]"
    if isinstance(value, list):
        return "[" + " ".join(go_value(v) for v in value) + "]"
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# --- field errors (k8s.io/apimachinery/pkg/util/validation/field) -----------------------------

TYPE_WORDS = {"FieldValueInvalid": "Invalid value", "FieldValueRequired": "Required value",
              "FieldValueNotSupported": "Unsupported value", "FieldValueDuplicate":
              "Duplicate value", "FieldValueForbidden": "Forbidden", "FieldValueTooLong":
              "Too long"}
_NO_VALUE = ("FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong")


@dataclass
class FieldError:
    type: str
    field: str
    value: Any = ""
    detail: str = ""

    def body(self) -> str:
        words = TYPE_WORDS[self.type]
        if self.type in _NO_VALUE:
            text = words
        elif isinstance(self.value, str):
            text = f"{words}: {go_quote(self.value)}"
        elif isinstance(self.value, bool):
            text = f"{words}: {'true' if self.value else 'false'}"
        elif isinstance(self.value, int | float):
            text = f"{words}: {self.value}"
        else:
            text = f"{words}: {json.dumps(self.value, separators=(',', ':'))}"
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"

    def cause(self) -> Obj:
        return {"reason": self.type, "message": self.body(), "field": self.field}


def invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError("FieldValueInvalid", path, value, detail)


def aggregate(errors: list[Any]) -> str:
    """utilerrors.Aggregate's message: one error as is, several as ``[a, b]`` (repeats once)."""
    seen: list[str] = []
    for e in errors:
        if str(e) not in seen:
            seen.append(str(e))
    return seen[0] if len(seen) == 1 else "[" + ", ".join(seen) + "]"


def invalid_object(kind: str, group: str, name: str, errors: list[FieldError]) -> ApiError:
    """errors.NewInvalid: 422, reason Invalid, one cause per field error."""
    qualified = f"{kind}.{group}" if group else kind
    details: Obj = {"causes": [e.cause() for e in errors]}
    for key, value in (("name", name), ("group", group), ("kind", kind)):
        if value:
            details[key] = value
    return ApiError(422, f"{qualified} {go_quote(name)} is invalid: {aggregate(errors)}",
                    details=details)


# --- names and labels (k8s.io/apimachinery/pkg/util/validation, as of 1.32) -------------------

_QNAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_QNAME_MSG = ("must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
              "with an alphanumeric character")
_LABEL_VALUE_FMT = f"({_QNAME_FMT})?"
_LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, "
                    "'-', '_' or '.', and must start and end with an alphanumeric character")
_DNS_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters "
                  "or '-', and must start and end with an alphanumeric character")
_DNS_SUBDOMAIN_FMT = _DNS_LABEL_FMT + "(\\." + _DNS_LABEL_FMT + ")*"
_DNS_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                      "characters, '-' or '.', and must start and end with an alphanumeric "
                      "character")


def regex_error(message: str, fmt: str, *examples: str) -> str:
    if not examples:
        return f"{message} (regex used for validation is '{fmt}')"
    shown = " or ".join(f"'{e}', " for e in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{fmt}')"


def _matches(fmt: str, value: str) -> bool:
    return re.fullmatch(fmt, value) is not None


def _max_len(n: int) -> str:
    return f"must be no more than {n} characters"


def _size(value: str) -> int:
    return len(value.encode())  # Go's len() counts bytes


def is_dns1123_subdomain(value: str) -> list[str]:
    errs = [_max_len(253)] if _size(value) > 253 else []
    if not _matches(_DNS_SUBDOMAIN_FMT, value):
        errs.append(regex_error(_DNS_SUBDOMAIN_MSG, _DNS_SUBDOMAIN_FMT, "example.com"))
    return errs


def is_dns1123_label(value: str) -> list[str]:
    errs = [_max_len(63)] if _size(value) > 63 else []
    if not _matches(_DNS_LABEL_FMT, value):
        errs.append("must not contain dots" if _matches(_DNS_SUBDOMAIN_FMT, value)
                    else regex_error(_DNS_LABEL_MSG, _DNS_LABEL_FMT, "my-name", "123-abc"))
    return errs


def is_qualified_name(value: str) -> list[str]:
    """A label key or annotation key: ``[prefix/]name``."""
    errs: list[str] = []
    parts = value.split("/")
    if len(parts) > 2:
        return ["a qualified name " + regex_error(_QNAME_MSG, _QNAME_FMT, "MyName", "my.name",
                                                  "123-abc")
                + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errs.append("prefix part must be non-empty")
        else:
            errs += ["prefix part " + m for m in is_dns1123_subdomain(prefix)]
    if not name:
        errs.append("name part must be non-empty")
    elif _size(name) > 63:
        errs.append("name part " + _max_len(63))
    if not _matches(_QNAME_FMT, name):
        errs.append("name part " + regex_error(_QNAME_MSG, _QNAME_FMT, "MyName", "my.name",
                                               "123-abc"))
    return errs


def is_label_value(value: str) -> list[str]:
    errs = [_max_len(63)] if _size(value) > 63 else []
    if not _matches(_LABEL_VALUE_FMT, value):
        errs.append(regex_error(_LABEL_VALUE_MSG, _LABEL_VALUE_FMT, "MyValue", "my_value",
                                "12345"))
    return errs


# --- label selectors (k8s.io/apimachinery/pkg/labels) ------------------------------------------


class SelectorError(ValueError):
    """A selector the API server refuses: its message is the server's."""


# Token kinds; the lexer's literal tokens (``in``/``notin`` are words, the rest symbols).
END, IDENT, ERROR = "end", "identifier", "error"
_LITERALS = {")": ")", ",": ",", "!": "!", "==": "==", "=": "=", ">": ">", "in": "in",
             "<": "<", "!=": "!=", "notin": "notin", "(": "("}
_SYMBOL_CHARS = set("=!(),><")
_SPACE = " \t\r\n"
# The operators after a key, in the order the parser's error message lists them.
_BINARY = {"in": "in", "notin": "notin", "=": "=", "==": "==", "!=": "!=", ">": "gt", "<": "lt"}


def _lex(text: str) -> list[tuple[str, str]]:
    """Tokens as the apimachinery lexer scans them: symbols greedily (longest known), words up
    to a symbol or a blank; a run of symbols that is no operator is an error token."""
    items: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in _SPACE:
            i += 1
        if i >= n:
            items.append((END, ""))
            return items
        if text[i] in _SYMBOL_CHARS:
            buf, best = "", None
            while i < n and text[i] in _SYMBOL_CHARS:
                if buf + text[i] in _LITERALS:
                    buf += text[i]
                    best = buf
                    i += 1
                elif best is not None:
                    break
                else:
                    buf += text[i]
                    i += 1
            items.append((best, best) if best is not None
                         else (ERROR, f"error expected: keyword found '{buf}'"))
        else:
            start = i
            while i < n and text[i] not in _SYMBOL_CHARS and text[i] not in _SPACE:
                i += 1
            word = text[start:i]
            items.append((word, word) if word in ("in", "notin") else (IDENT, word))


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # in notin = == != gt lt exists !
    values: tuple[str, ...]

    def matches(self, labels: dict[str, str]) -> bool:
        if self.op in ("in", "=", "=="):
            return self.key in labels and labels[self.key] in self.values
        if self.op in ("notin", "!="):
            return self.key not in labels or labels[self.key] not in self.values
        if self.op == "exists":
            return self.key in labels
        if self.op == "!":
            return self.key not in labels
        try:  # gt / lt: both sides integers, else no match
            have, want = int(labels[self.key]), int(self.values[0])
        except (KeyError, ValueError):
            return False
        return have > want if self.op == "gt" else have < want


def new_requirement(key: str, op: str, values: list[str]) -> Requirement:
    """labels.NewRequirement's checks; the parser's path is nil, so fields read ``key``,
    ``values[i]`` and ``values[i][key]``."""
    errs = [invalid("key", key, "; ".join(m)) for m in [is_qualified_name(key)] if m]
    if op in ("gt", "lt"):
        for i, v in enumerate(values):
            if not re.fullmatch(r"[+-]?[0-9]+", v) or not -2**63 <= int(v) < 2**63:
                errs.append(invalid(f"values[{i}]", v,
                                    "for 'Gt', 'Lt' operators, the value must be an integer"))
    for i, v in enumerate(values):
        msgs = is_label_value(v)
        if msgs:
            errs.append(invalid(f"values[{i}][{key}]", v, "; ".join(msgs)))
    if errs:
        raise SelectorError(aggregate(errs))
    return Requirement(key, op, tuple(values))


class _Parser:
    """The label selector grammar: ``[!]key [op value | in|notin (v,...)]`` joined by commas."""

    def __init__(self, text: str) -> None:
        self.items = _lex(text)
        self.pos = 0

    def look(self, values: bool = True) -> tuple[str, str]:
        tok, lit = self.items[self.pos]
        # Where a value may stand, ``in`` and ``notin`` are plain words.
        return (IDENT if values and tok in ("in", "notin") else tok), lit

    def take(self, values: bool = True) -> tuple[str, str]:
        found = self.look(values)
        self.pos += 1
        return found

    def parse(self) -> list[Requirement]:
        found: list[Requirement] = []
        while True:
            tok, lit = self.look()
            if tok == END:
                return found
            if tok not in (IDENT, "!"):
                raise SelectorError(f"found '{lit}', expected: !, identifier, or 'end of string'")
            try:
                found.append(self.requirement())
            except SelectorError as e:
                raise SelectorError(f"unable to parse requirement: {e}") from None
            tok, lit = self.take()
            if tok == END:
                return found
            if tok != ",":
                raise SelectorError(f"found '{lit}', expected: ',' or 'end of string'")
            nxt, nlit = self.look()
            if nxt not in (IDENT, "!"):
                raise SelectorError(f"found '{nlit}', expected: identifier after ','")

    def requirement(self) -> Requirement:
        tok, key = self.take()
        op = ""
        if tok == "!":
            op = "!"
            tok, key = self.take()
        if tok != IDENT:
            raise SelectorError(f"found '{key}', expected: identifier")
        msgs = is_qualified_name(key)
        if msgs:
            raise SelectorError(str(invalid("<nil>", key, "; ".join(msgs))))
        if self.look()[0] in (END, ","):
            op = op or "exists"
        if op in ("exists", "!"):
            return new_requirement(key, op, [])
        tok, lit = self.take(values=False)
        if tok not in _BINARY:
            raise SelectorError(f"found '{lit}', expected: " + ", ".join(
                ["in", "notin", "=", "==", "!=", "gt", "lt"]))
        op = _BINARY[tok]
        values = self.value_set() if op in ("in", "notin") else self.exact_value()
        return new_requirement(key, op, sorted(values))

    def value_set(self) -> set[str]:
        tok, lit = self.take()
        if tok != "(":
            raise SelectorError(f"found '{lit}' expected: '('")
        tok, lit = self.look()
        if tok == ")":
            self.take()
            return {""}
        if tok not in (IDENT, ","):
            raise SelectorError(f"found '{lit}', expected: ',', ')' or identifier")
        values = self.value_list()
        if self.take()[0] != ")":
            raise SelectorError(f"found '{lit}', expected: ')'")
        return values

    def value_list(self) -> set[str]:
        values: set[str] = set()
        while True:
            tok, lit = self.take()
            if tok == IDENT:
                values.add(lit)
                nxt, nlit = self.look()
                if nxt == ",":
                    continue
                if nxt == ")":
                    return values
                raise SelectorError(f"found '{nlit}', expected: ',' or ')'")
            if tok != ",":
                raise SelectorError(f"found '{lit}', expected: ',', or identifier")
            # Empty values around commas: "(,a)", "(a,)", "(a,,b)" all hold "".
            values.add("")
            nxt, _ = self.look()
            if nxt == ")":
                return values
            if nxt == ",":
                self.take()

    def exact_value(self) -> set[str]:
        if self.look()[0] in (END, ","):
            return {""}
        tok, lit = self.take()
        if tok == IDENT:
            return {lit}
        raise SelectorError(f"found '{lit}', expected: identifier")


def parse_label_selector(text: str) -> list[Requirement]:
    """labels.Parse: the requirements, or SelectorError with the server's message."""
    return sorted(_Parser(text).parse(), key=lambda r: r.key)


def label_matcher(text: str) -> Callable[[dict[str, str]], bool]:
    requirements = parse_label_selector(text)
    return lambda labels: all(r.matches(labels) for r in requirements)


# --- field selectors (k8s.io/apimachinery/pkg/fields) ------------------------------------------


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not backslash-escaped (the backslash stays in the term)."""
    terms, start, escaped = [], 0, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == ",":
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return terms


def _unescape(value: str) -> str:
    out, escaped = [], False
    for ch in value:
        if escaped:
            if ch not in "\\,=":
                raise SelectorError(f"invalid field selector: invalid escape sequence: \\{ch}")
            out.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in ",=":
            # Go prints the rune with %v: its code point.
            raise SelectorError(f"invalid field selector: unescaped character in value: "
                                f"{ord(ch)}")
        else:
            out.append(ch)
    if escaped:
        raise SelectorError("invalid field selector: invalid escape sequence: \\")
    return "".join(out)


def parse_field_selector(text: str) -> list[tuple[str, str, str]]:
    """fields.ParseSelector: (field, "=" | "!=", value) terms, sorted as the server sorts them."""
    terms: list[tuple[str, str, str]] = []
    for part in sorted(_split_terms(text)):
        if not part:
            continue
        split = next(((part[:i], op, part[i + len(op):]) for i in range(len(part))
                      for op in ("!=", "==", "=") if part.startswith(op, i)), None)
        if split is None:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
        lhs, op, rhs = split
        terms.append((lhs, "!=" if op == "!=" else "=", _unescape(rhs)))
    return terms


def unsupported_field(label: str, kind_has_conversion: bool) -> str:
    """The error of a field label the resource does not index: the kinds with their own
    conversion function (core/v1 nodes, pods, events, namespaces) word it one way, the rest
    (runtime.DefaultMetaV1FieldSelectorConversion) another."""
    if kind_has_conversion:
        return f"field label not supported: {label}"
    return (f"{go_quote(label)} is not a known field selector: only \"metadata.name\", "
            "\"metadata.namespace\"")


# --- decoding: JSON that does not fit the Go types -----------------------------------------

# (path, Go struct holding the field, Go type); "*" stands for any list index or map key.
_COMMON_SCHEMA: list[tuple[tuple[str, ...], str, str]] = [
    (("metadata", "name"), "ObjectMeta", "string"),
    (("metadata", "generateName"), "ObjectMeta", "string"),
    (("metadata", "namespace"), "ObjectMeta", "string"),
    (("metadata", "resourceVersion"), "ObjectMeta", "string"),
    (("metadata", "labels"), "ObjectMeta", "map[string]string"),
    (("metadata", "labels", "*"), "ObjectMeta", "string"),
    (("metadata", "annotations"), "ObjectMeta", "map[string]string"),
    (("metadata", "annotations", "*"), "ObjectMeta", "string"),
    (("metadata", "finalizers"), "ObjectMeta", "[]string"),
    (("metadata", "finalizers", "*"), "ObjectMeta", "string"),
    (("metadata", "ownerReferences"), "ObjectMeta", "[]v1.OwnerReference"),
]
_SCHEMAS: dict[str, list[tuple[tuple[str, ...], str, str]]] = {
    "nodes": [
        (("spec", "unschedulable"), "NodeSpec", "bool"),
        (("spec", "providerID"), "NodeSpec", "string"),
        (("spec", "podCIDR"), "NodeSpec", "string"),
        (("spec", "taints"), "NodeSpec", "[]v1.Taint"),
        (("spec", "taints", "*"), "NodeSpec", "v1.Taint"),
        (("spec", "taints", "*", "key"), "Taint", "string"),
        (("spec", "taints", "*", "value"), "Taint", "string"),
        (("spec", "taints", "*", "effect"), "Taint", "v1.TaintEffect"),
        (("status", "conditions"), "NodeStatus", "[]v1.NodeCondition"),
    ],
    "pods": [
        (("spec", "nodeName"), "PodSpec", "string"),
        (("spec", "containers"), "PodSpec", "[]v1.Container"),
        (("spec", "containers", "*", "name"), "Container", "string"),
        (("spec", "containers", "*", "image"), "Container", "string"),
        (("status", "phase"), "PodStatus", "v1.PodPhase"),
        (("status", "conditions"), "PodStatus", "[]v1.PodCondition"),
    ],
    "poddisruptionbudgets": [
        (("spec", "selector"), "PodDisruptionBudgetSpec", "*v1.LabelSelector"),
    ],
    "jobs": [
        (("spec", "selector"), "JobSpec", "*v1.LabelSelector"),
        (("spec", "template"), "JobSpec", "v1.PodTemplateSpec"),
        (("spec", "template", "spec", "containers"), "PodSpec", "[]v1.Container"),
        (("spec", "template", "spec", "containers", "*", "name"), "Container", "string"),
        (("spec", "template", "spec", "containers", "*", "image"), "Container", "string"),
        (("spec", "template", "spec", "containers", "*", "command"), "Container", "[]string"),
        (("spec", "template", "spec", "containers", "*", "args"), "Container", "[]string"),
        (("spec", "template", "spec", "nodeName"), "PodSpec", "string"),
        (("spec", "template", "spec", "restartPolicy"), "PodSpec", "v1.RestartPolicy"),
        (("spec", "suspend"), "JobSpec", "bool"),
        (("spec", "manualSelector"), "JobSpec", "bool"),
    ],
}
_STRING_TYPES = {"string", "v1.TaintEffect", "v1.PodPhase", "v1.RestartPolicy"}


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int | float):
        return "number"
    return "array" if isinstance(value, list) else "object"


def _fits(value: Any, go_type: str) -> bool:
    if value is None:
        return True  # null leaves the Go zero value
    if go_type in _STRING_TYPES:
        return isinstance(value, str)
    if go_type == "bool":
        return isinstance(value, bool)
    if go_type.startswith("[]"):
        return isinstance(value, list)
    return isinstance(value, dict)  # maps, structs, pointers to structs


def decode_error(store: str, obj: Any) -> str | None:
    """encoding/json's complaint about ``obj`` as the Go type of ``store``, or None."""
    if not isinstance(obj, dict):
        return f"json: cannot unmarshal {_json_kind(obj)} into Go value of type struct"
    for path, struct, go_type in _COMMON_SCHEMA + _SCHEMAS.get(store, []):
        for value in _at(obj, path):
            if not _fits(value, go_type):
                field_path = ".".join(p for p in path if p != "*")
                return (f"json: cannot unmarshal {_json_kind(value)} into Go struct field "
                        f"{struct}.{field_path} of type {go_type}")
    return None


def _at(obj: Any, path: tuple[str, ...]) -> list[Any]:
    nodes = [obj]
    for part in path:
        nxt: list[Any] = []
        for node in nodes:
            if part == "*":
                if isinstance(node, dict):
                    nxt += list(node.values())
                elif isinstance(node, list):
                    nxt += node
            elif isinstance(node, dict) and part in node:
                nxt.append(node[part])
        nodes = nxt
    return nodes


# --- validation (pkg/apis/core/validation and friends, the parts these objects use) ---------

# How each kind's metadata.name is checked.
_NAME_RULES: dict[str, Callable[[str], list[str]]] = {
    "namespaces": is_dns1123_label, "nodes": is_dns1123_subdomain,
    "pods": is_dns1123_subdomain, "events": is_dns1123_subdomain,
    "poddisruptionbudgets": is_dns1123_subdomain, "daemonsets": is_dns1123_subdomain,
    # A Job's name is checked as a subdomain (ValidateReplicationControllerName); it is its
    # pods' job-name label value that holds it to 63 characters (spec.template.labels).
    "jobs": is_dns1123_subdomain,
}
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_ANNOTATIONS_MAX = 256 * 1024


def validate_meta(store: str, meta: Obj) -> list[FieldError]:
    errs: list[FieldError] = []
    name = meta.get("name") or ""
    if not name:
        errs.append(FieldError("FieldValueRequired", "metadata.name",
                               detail="name or generateName is required"))
    else:
        errs += [invalid("metadata.name", name, m) for m in _NAME_RULES[store](name)]
    for key, value in sorted((meta.get("labels") or {}).items()):
        errs += [invalid("metadata.labels", key, m) for m in is_qualified_name(key)]
        errs += [invalid("metadata.labels", value, m) for m in is_label_value(value)]
    annotations = meta.get("annotations") or {}
    for key in sorted(annotations):
        errs += [invalid("metadata.annotations", key, m)
                 for m in is_qualified_name(key.lower())]
    if sum(_size(k) + _size(v) for k, v in annotations.items()) > _ANNOTATIONS_MAX:
        errs.append(FieldError("FieldValueTooLong", "metadata.annotations",
                               detail=f"may not be more than {_ANNOTATIONS_MAX} bytes"))
    return errs


def validate_taints(taints: list[Obj]) -> list[FieldError]:
    errs: list[FieldError] = []
    seen: set[tuple[str, str]] = set()
    for i, taint in enumerate(taints):
        at = f"spec.taints[{i}]"
        key, value, effect = taint.get("key") or "", taint.get("value") or "", \
            taint.get("effect") or ""
        errs += [invalid(f"{at}.key", key, m) for m in is_qualified_name(key)]
        msgs = is_label_value(value)
        if msgs:
            errs.append(invalid(f"{at}.value", value, ";".join(msgs)))
        if not effect:
            errs.append(FieldError("FieldValueRequired", f"{at}.effect"))
        elif effect not in TAINT_EFFECTS:
            errs.append(FieldError("FieldValueNotSupported", f"{at}.effect", effect,
                                   "supported values: " + ", ".join(f'"{e}"'
                                                                    for e in TAINT_EFFECTS)))
        if (key, effect) in seen:
            errs.append(invalid(at, taint, "taints must be unique by key and effect pair"))
        seen.add((key, effect))
    return errs


def validate_pod_spec(spec: Obj, path: str = "spec") -> list[FieldError]:
    containers = spec.get("containers") or []
    if not containers:
        return [FieldError("FieldValueRequired", f"{path}.containers")]
    errs: list[FieldError] = []
    names: set[str] = set()
    for i, c in enumerate(containers):
        at = f"{path}.containers[{i}]"
        name = c.get("name") or ""
        if not name:
            errs.append(FieldError("FieldValueRequired", f"{at}.name"))
        else:
            errs += [invalid(f"{at}.name", name, m) for m in is_dns1123_label(name)]
            if name in names:
                errs.append(FieldError("FieldValueDuplicate", f"{at}.name", name))
            names.add(name)
        if not (c.get("image") or "").strip():
            errs.append(FieldError("FieldValueRequired", f"{at}.image"))
    return errs


JOB_RESTART_POLICIES = ("OnFailure", "Never")


def validate_job_spec(spec: Obj) -> list[FieldError]:
    """ValidateJobSpec and the pod template's checks (pkg/apis/batch/validation), the parts
    a Job created here can get wrong."""
    errs: list[FieldError] = []
    for key in ("parallelism", "completions", "activeDeadlineSeconds", "backoffLimit",
                "ttlSecondsAfterFinished"):
        value = spec.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            errs.append(invalid(f"spec.{key}", value, "must be greater than or equal to 0"))
    if spec.get("selector") is None:
        errs.append(FieldError("FieldValueRequired", "spec.selector"))
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    for key, value in sorted(labels.items()):
        errs += [invalid("spec.template.labels", key, m) for m in is_qualified_name(key)]
        errs += [invalid("spec.template.labels", value, m) for m in is_label_value(value)]
    tspec = template.get("spec") or {}
    errs += validate_pod_spec(tspec, "spec.template.spec")
    policy = tspec.get("restartPolicy") or ""
    if policy not in JOB_RESTART_POLICIES:
        errs.append(FieldError("FieldValueNotSupported", "spec.template.spec.restartPolicy",
                               policy, "supported values: " + ", ".join(
                                   f'"{p}"' for p in JOB_RESTART_POLICIES)))
    return errs


def validate(store: str, obj: Obj) -> list[FieldError]:
    """The field errors the API server would find in ``obj`` (empty: it may be stored)."""
    errs = validate_meta(store, obj.get("metadata") or {})
    spec = obj.get("spec") or {}
    if store == "nodes":
        errs += validate_taints(spec.get("taints") or [])
    elif store == "pods":
        errs += validate_pod_spec(spec)
    elif store == "jobs":
        errs += validate_job_spec(spec)
        completions = spec.get("completions")
        name = (obj.get("metadata") or {}).get("name") or ""
        if spec.get("completionMode") == "Indexed" and isinstance(completions, int) \
                and completions > 0 and is_dns1123_label(f"{name}-{completions - 1}"):
            # An Indexed Job's pods are named <job>-<index> as their hostname.
            errs.append(invalid("metadata.name", name, "will not able to create pod with "
                                f"invalid DNS label: {name}-{completions - 1}"))
    elif store == "poddisruptionbudgets" and spec.get("minAvailable") is not None \
            and spec.get("maxUnavailable") is not None:
        errs.append(invalid("spec", spec, "minAvailable and maxUnavailable cannot be both set"))
    return errs


# --- what Go always writes -----------------------------------------------------------------

NODE_INFO_FIELDS = ("machineID", "systemUUID", "bootID", "kernelVersion", "osImage",
                    "containerRuntimeVersion", "kubeletVersion", "kubeProxyVersion",
                    "operatingSystem", "architecture")
_CONTAINER_STATUS_ZERO: Obj = {"name": "", "state": {}, "lastState": {}, "ready": False,
                               "restartCount": 0, "image": "", "imageID": ""}


def serialised(store: str, obj: Obj) -> Obj:
    """``obj`` with the fields a Go API server always writes (struct fields without
    ``omitempty``) filled with their zero values where the object lacks them. Works in place."""
    if store == "nodes":
        status = obj.setdefault("status", {})
        info = status.setdefault("nodeInfo", {})
        for key in NODE_INFO_FIELDS:
            info.setdefault(key, "")
        status.setdefault("daemonEndpoints", {}).setdefault("kubeletEndpoint", {}).setdefault(
            "Port", 0)
        obj.setdefault("spec", {})
    elif store == "pods":
        status = obj.setdefault("status", {})
        for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
            for cs in status.get(key) or []:
                for field_, zero in _CONTAINER_STATUS_ZERO.items():
                    cs.setdefault(field_, zero)
        spec = obj.setdefault("spec", {})
        spec.setdefault("containers", None)
    elif store == "jobs":
        spec = obj.setdefault("spec", {})
        template = spec.setdefault("template", {})
        template.setdefault("metadata", {})
        template.setdefault("spec", {}).setdefault("containers", None)
        obj.setdefault("status", {})
    elif store == "daemonsets":
        spec = obj.setdefault("spec", {})
        template = spec.setdefault("template", {})
        template.setdefault("metadata", {})
        template.setdefault("spec", {}).setdefault("containers", None)
        status = obj.setdefault("status", {})
        for key in ("currentNumberScheduled", "desiredNumberScheduled", "numberMisscheduled",
                    "numberReady"):
            status.setdefault(key, 0)
    return obj
