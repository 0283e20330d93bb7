"""Bad-input battery: hostile requests at every API operation and page family; no answer may be
a server error.

It starts its own server (gunicorn with deploy/gunicorn.conf.py, as production runs it) on a
free port, on SQLite (a file of its own) or PostgreSQL (a database of its own on the server
DATABASE_URL names, created and dropped here), with a small world (tests/api/world.py: a node,
an incident awaiting approval, a failed remediation, a webhook...), then fires:

- NUL bytes (raw and ``%00``), lone surrogates, invalid UTF-8, 20-digit and non-numeric values,
  ``1e999`` and ``NaN`` in every path parameter and every documented query parameter, plus
  garbage cursors;
- for every operation with a body: each documented field replaced by the same poisons (as JSON
  text, so ``1e999``/``NaN`` reach the server as they are), deeply nested JSON, wrong content
  types, invalid UTF-8, a chunked body, an oversized body, the documented maximum batch;
- poisoned pushed signals (NUL, lone surrogate, 1e999 in extra fields, another node, a
  ``collector`` record), then every reader of what was stored (signals, timelines, replays,
  pages);
- what an older version may have stored (lone surrogates, NULs, deep JSON in signal data,
  written underneath the models), then the same readers;
- duplicated concurrent creates and actions (tokens and webhooks with one name, remediate,
  approve, cancel, retry while a newer remediation is active, one push with one
  Idempotency-Key), each of which must take effect once;
- the page families with the same poisons in paths, query strings and form fields, unknown
  page actions, the login form, the Django admin's model pages, undocumented methods;

as an admin, an operator, a viewer, a user with no role, a node agent's token and nobody (the
reduced set for all but the admin), and counts the answers by status class, listing every 5xx
and every duplicate that took effect twice. ``--quick`` (what ``make test`` runs) sends fewer
variants of each poison.

    python -m tests.bench.bad_input --database sqlite            # or postgres (DATABASE_URL)
    python -m tests.bench.bad_input --app-dir /tmp/checkout ...  # the server from another tree
    python -m tests.bench.bad_input --base-url URL --token KEY   # an already running server

With ``--base-url`` only the API part runs, with the one token for every role (no world is
built, ids are guessed: most answers will be 404s). Exit status 1 when any 5xx was seen.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
PASSWORD = "battery-pass-123"
ROLES = ("admin", "operator", "viewer", "norole")

# Poisons for a path segment or a query value, already URL-encoded (except the raw NUL, which
# goes on the wire as a byte: gunicorn may refuse it itself, which is fine).
URL_POISONS: dict[str, str] = {
    "nul-raw": "x\x00y",
    "nul-pct": "x%00y",
    "surrogate-pct": "%ED%A0%80",
    "bad-utf8": "%FF%FE",
    "digits20": "99999999999999999999",
    "non-numeric": "abc",
    "1e999": "1e999",
    "nan": "NaN",
    "negative": "-1",
    "long": "a" * 3000,
    "traversal": "..%2F..%2Fetc%2Fpasswd",
    "script": "%3Cscript%3Ealert(1)%3C%2Fscript%3E",
}
# The smaller set the non-admin callers get.
URL_POISONS_SHORT = ("nul-pct", "surrogate-pct", "digits20")
# Poisons for a JSON value, as JSON text (so 1e999 and NaN reach the server as written).
JSON_POISONS: dict[str, str] = {
    "nul": '"a\\u0000b"',
    "surrogate": '"\\ud800"',
    "1e999": "1e999",
    "nan": "NaN",
    "-inf": "-Infinity",
    "digits20": "99999999999999999999",
    "non-numeric": '"abc"',
    "object": '{"a": 1}',
    "array": '["a\\u0000"]',
    "null": "null",
    "nested": "[" * 5000 + "]" * 5000,
    "long": json.dumps("x" * 100_000),
}
JSON_POISONS_SHORT = ("nul", "surrogate", "nested")


@dataclass(frozen=True)
class Profile:
    """Which poisons go where. The admin (past every permission check) gets the ``*_full``
    sets, the other callers the ``*_short`` ones."""

    url_full: tuple[str, ...]  # path parameters
    url_short: tuple[str, ...]
    json_full: tuple[str, ...]  # body fields
    json_short: tuple[str, ...]
    query: tuple[str, ...]  # each documented query parameter
    query_numeric: tuple[str, ...]  # and the numeric ones also
    query_unknown: tuple[str, ...]  # an undocumented query parameter
    page_query: tuple[str, ...]  # each query parameter a page reads


FULL = Profile(tuple(URL_POISONS), URL_POISONS_SHORT, tuple(JSON_POISONS), JSON_POISONS_SHORT,
               ("nul-pct", "surrogate-pct", "digits20"), ("non-numeric", "1e999", "nan", "negative"),
               ("nul-raw", "nul-pct", "surrogate-pct", "bad-utf8", "long"),
               ("nul-pct", "surrogate-pct", "non-numeric"))
# For `make test`: every class of input still fired, fewer variants of each.
QUICK = Profile(("nul-raw", "nul-pct", "surrogate-pct", "digits20", "non-numeric", "long"),
                ("nul-pct",), ("nul", "surrogate", "1e999", "nan", "digits20", "nested"), ("nul",),
                ("nul-pct", "digits20"), ("non-numeric", "1e999"), ("nul-pct", "bad-utf8"), ("nul-pct",))
CURSORS = ["garbage", "%00", base64.b64encode(b"p=1e999").decode(),
           base64.b64encode(b"p=\x00&r=1").decode(), base64.b64encode(b"p=99999999999999999999").decode(),
           base64.b64encode(b"o=99999999999999999999").decode(), "cD0yMDI2LTEyLTAz%00",
           base64.b64encode("p=\udcff".encode("utf-8", "surrogatepass")).decode()]


@dataclass
class Probe:
    method: str
    path: str  # on the wire as is (already URL-encoded, may hold a raw NUL)
    who: str  # a role, "agent", "anon", or "page:<role>" (a session)
    label: str  # what is hostile about it, for the report
    body: bytes = b""
    content_type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False


@dataclass
class Answer:
    probe: Probe
    status: int  # 0: no answer (reset, timeout)
    content_type: str = ""
    excerpt: str = ""


@dataclass
class Target:
    base_url: str
    tokens: dict[str, str]  # who -> API key
    sessions: dict[str, dict[str, str]] = field(default_factory=dict)  # role -> cookies
    world: dict[str, Any] = field(default_factory=dict)

    @property
    def host_port(self) -> tuple[str, int]:
        parsed = urllib.parse.urlsplit(self.base_url)
        return parsed.hostname or "127.0.0.1", parsed.port or 80


# --- the wire ---------------------------------------------------------------------------------


def send(target: Target, probe: Probe, timeout: float = 60.0) -> Answer:
    """One request over a fresh connection, written by hand so that anything (a raw NUL, a bad
    Content-Length, chunks) reaches the server as written."""
    host, port = target.host_port
    headers = {"Host": f"{host}:{port}", "Connection": "close", "Accept": "*/*",
               "User-Agent": "fleetwatch-bad-input", **probe.headers}
    if probe.who in target.tokens and "Authorization" not in probe.headers:
        headers["Authorization"] = f"Token {target.tokens[probe.who]}"
    if probe.who.startswith("page:"):
        cookies = target.sessions.get(probe.who[5:], {})
        if cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
            if "csrftoken" in cookies:
                headers["X-CSRFToken"] = cookies["csrftoken"]
    if probe.content_type:
        headers["Content-Type"] = probe.content_type
    body = probe.body
    if probe.chunked:
        headers["Transfer-Encoding"] = "chunked"
        step = max(1, len(body) // 3 or 1)
        parts = [body[i:i + step] for i in range(0, len(body), step)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    elif body or probe.method in ("POST", "PUT", "PATCH"):
        headers["Content-Length"] = str(len(body))
    head = f"{probe.method} ".encode() + probe.path.encode("utf-8", "surrogateescape") + b" HTTP/1.1\r\n"
    head += b"".join(f"{k}: {v}\r\n".encode("utf-8", "surrogateescape") for k, v in headers.items())
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            # The server may answer (a 400 or 413) and close before reading a big body:
            # the answer is still there to read.
            with suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(head + b"\r\n" + body)
            response = http.client.HTTPResponse(sock, method=probe.method)
            response.begin()
            data = response.read(4096) if probe.method != "HEAD" else b""
            return Answer(probe, response.status, response.getheader("Content-Type", ""),
                          data[:300].decode("utf-8", "replace"))
    except (OSError, http.client.HTTPException) as exc:
        return Answer(probe, 0, "", f"no answer: {type(exc).__name__}: {exc}"[:300])


def login(target: Target, username: str) -> dict[str, str]:
    """Session cookies for ``username``, through the login form as a person gets them."""
    host, port = target.host_port
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/login/")
    page = conn.getresponse()
    html = page.read().decode()
    cookies = _cookies(page.getheaders())
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    form = urllib.parse.urlencode({"username": username, "password": PASSWORD,
                                   "csrfmiddlewaretoken": match.group(1) if match else ""})
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/login/", body=form, headers={
        "Content-Type": "application/x-www-form-urlencoded",
        "Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())})
    answer = conn.getresponse()
    answer.read()
    cookies.update(_cookies(answer.getheaders()))
    if answer.status != 302 or "sessionid" not in cookies:
        raise RuntimeError(f"could not log in as {username}: {answer.status}")
    return cookies


def _cookies(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    found = {}
    for name, value in headers:
        if name.lower() == "set-cookie":
            key, _, rest = value.partition("=")
            found[key.strip()] = rest.split(";", 1)[0]
    return found


# --- the probes -------------------------------------------------------------------------------


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _with_poison(sample: dict[str, Any], key: str, poison: str) -> bytes:
    """``sample`` as JSON with ``key``'s value replaced by the JSON text ``poison``."""
    marker = f"@@{secrets.token_hex(4)}@@"
    text = json.dumps({**sample, key: marker})
    return text.replace(json.dumps(marker), poison).encode("utf-8", "surrogatepass")


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        found: Any = schema
        for part in node["$ref"].lstrip("#/").split("/"):
            found = found[part]
        node = found
    return node


def _sample_value(schema: dict[str, Any], prop: dict[str, Any]) -> Any:
    prop = _resolve(schema, prop)
    if "enum" in prop:
        return prop["enum"][0]
    if "allOf" in prop:
        return _sample_value(schema, prop["allOf"][0])
    kind = prop.get("type", "string")
    if kind == "integer":
        return 1
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    if kind == "array":
        return [_sample_value(schema, prop.get("items", {}))]
    if kind == "object":
        return {}
    if prop.get("format") == "date-time":
        return "2026-12-03T10:00:00Z"
    if prop.get("format") == "uri":
        return "https://hooks.example.com/fleetwatch"
    return f"battery-{secrets.token_hex(3)}"


def _body_sample(schema: dict[str, Any], operation: dict[str, Any]) -> dict[str, Any] | None:
    content = operation.get("requestBody", {}).get("content", {})
    body = content.get("application/json", {}).get("schema")
    if not body:
        return None
    body = _resolve(schema, body)
    return {name: _sample_value(schema, prop) for name, prop in body.get("properties", {}).items()
            if not prop.get("readOnly")}


def signal_record(node: str, **extra: Any) -> dict[str, Any]:
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"at": at, "source": "kernel", "node": node,
            "message": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", **extra}


def push_probes(target: Target, who: str, node: str) -> Iterator[Probe]:
    """Poisoned records pushed to /api/v1/signals/: each a batch of one."""
    path = "/api/v1/signals/"
    for name, poison in JSON_POISONS.items():
        for key in ("message", "node", "gpu", "value", "job", "at", "extra_field", "source"):
            sample = {"signals": [signal_record(node)]}
            record_text = _with_poison(sample["signals"][0], key, poison).decode(
                "utf-8", "surrogatepass")
            yield Probe("POST", path, who, f"push {key}={name}",
                        f'{{"signals": [{record_text}]}}'.encode("utf-8", "surrogatepass"),
                        "application/json")
    # Keys with NUL and surrogates, the collector record of the issue, another node's record.
    for label, raw_key in [("NUL", '"k\\u0000"'), ("surrogate", '"k\\ud800"'),
                           ("empty", '""'), ("long", json.dumps("k" * 5000))]:
        record = json.dumps(signal_record(node))[:-1] + f", {raw_key}: \"v\"}}"
        yield Probe("POST", path, who, f"push extra key {label}",
                    f'{{"signals": [{record}]}}'.encode(), "application/json")
    yield Probe("POST", path, who, "push collector record",
                _json({"signals": [{"at": signal_record(node)["at"], "source": "collector",
                                    "node": node, "name": "slurm", "healthy": False}]}),
                "application/json")
    yield Probe("POST", path, who, "push for another node",
                _json({"signals": [signal_record("gpu-002")]}), "application/json")
    yield Probe("POST", path, who, "push with 1e999 in a nested extra",
                b'{"signals": [%s]}' % _with_poison(signal_record(node), "extra", '{"a": [1e999]}'),
                "application/json")
    yield Probe("POST", path, who, "push nested 200000 deep",
                b'{"signals": [' + b"[" * 200_000 + b"]" * 200_000 + b"]}", "application/json")
    # The documented maximum batch, each message at its documented maximum.
    big = {"signals": [signal_record(node, message="m" * 4000) for _ in range(1000)]}
    yield Probe("POST", path, who, "push max batch (1000 x 4000 chars)", _json(big),
                "application/json")
    yield Probe("POST", path, who, "push max batch, chunked", _json(big), "application/json",
                chunked=True)


def api_probes(target: Target, schema: dict[str, Any], who: str, full: bool,
               profile: Profile = FULL) -> list[Probe]:
    """Every operation of the schema with poisoned path parameters, query parameters and
    bodies. ``full`` (the admin, who gets past every permission check) takes every poison;
    the other callers a few, enough to show that a refusal is not a crash."""
    probes: list[Probe] = []
    url_poisons = {k: URL_POISONS[k] for k in (profile.url_full if full else profile.url_short)}
    world_ids = target.world.get("path_parameters", {})
    for template, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            method = method.upper()
            params = operation.get("parameters", []) + item.get("parameters", [])
            path_params = [p["name"] for p in params if p.get("in") == "path"]
            query_params = {p["name"]: p.get("schema", {}).get("type", "string")
                            for p in params if p.get("in") == "query"}
            real = world_ids.get(template, {})

            def fill(values: dict[str, str], template: str = template) -> str:
                for key, value in values.items():
                    template = template.replace(f"{{{key}}}", value)
                return template

            real_path = fill({p: str(real.get(p, "1")) for p in path_params})
            for name, poison in url_poisons.items():
                for p in path_params:
                    path = fill({q: (poison if q == p else str(real.get(q, "1")))
                                 for q in path_params})
                    probes.append(Probe(method, path, who, f"path {p}={name}"))
            if method == "GET":
                probes.extend(_query_probes(real_path, who, query_params, full, profile))
                continue
            sample = _body_sample(schema, operation) or {}
            json_poisons = {k: JSON_POISONS[k] for k in (profile.json_full if full else profile.json_short)}
            for key in (list(sample) or ["field"]) if full else (list(sample) or ["field"])[:1]:
                for name, poison in json_poisons.items():
                    probes.append(Probe(method, real_path, who, f"body {key}={name}",
                                        _with_poison(sample, key, poison), "application/json"))
            probes.extend(_body_shapes(method, real_path, who, sample, full))
    return probes


def _query_probes(path: str, who: str, params: dict[str, str], full: bool,
                  profile: Profile) -> Iterator[Probe]:
    """Each documented query parameter with NUL, a lone surrogate and a 20-digit number; the
    numeric ones also with a word, 1e999 and NaN; an unknown one with every poison."""
    values = profile.query if full else ("nul-pct",)
    chosen = params if full else dict(list(params.items())[:2])
    for q, kind in chosen.items():
        names = values + (profile.query_numeric if full and kind in ("integer", "number") else ())
        for name in names:
            yield Probe("GET", f"{path}?{q}={URL_POISONS[name]}", who, f"query {q}={name}")
    if not full:
        return
    for name in profile.query_unknown:
        yield Probe("GET", f"{path}?unknown={URL_POISONS[name]}", who, f"query unknown={name}")
    if "cursor" in params:
        for cursor in CURSORS:
            yield Probe("GET", f"{path}?cursor={cursor}", who, f"cursor {cursor[:20]}")
    yield Probe("GET", f"{path}?format=%00", who, "query format=nul")
    yield Probe("GET", f"{path}?page_size=99999999999999999999&limit=-1", who, "page size 20 digits")


def _body_shapes(method: str, path: str, who: str, sample: dict[str, Any],
                 full: bool) -> Iterator[Probe]:
    """The same operation with bodies of the wrong shape, encoding or transport."""
    valid = _json(sample)
    yield Probe(method, path, who, "nested 100000 deep", b"[" * 100_000 + b"]" * 100_000,
                "application/json")
    if not full:
        return
    yield Probe(method, path, who, "invalid utf-8 body", b'{"name": "\xff\xfe"}', "application/json")
    yield Probe(method, path, who, "form with NUL", b"name=a%00b&note=%00&url=%00",
                "application/x-www-form-urlencoded")
    yield Probe(method, path, who, "json as text/plain", valid, "text/plain")
    yield Probe(method, path, who, "json array body", b'["a\\u0000"]', "application/json")
    yield Probe(method, path, who, "json null body", b"null", "application/json")
    yield Probe(method, path, who, "json string body", b'"\\ud800"', "application/json")
    yield Probe(method, path, who, "empty json body", b"", "application/json")
    yield Probe(method, path, who, "truncated json", valid[:-1], "application/json")
    yield Probe(method, path, who, "json utf-16 charset", valid, "application/json; charset=utf-16")
    yield Probe(method, path, who, "json unknown charset", valid, "application/json; charset=x-nope")
    yield Probe(method, path, who, "xml body", b"<a>\x00</a>", "application/xml")
    yield Probe(method, path, who, "multipart with NUL",
                b"--b\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\na\x00b\r\n--b--\r\n",
                "multipart/form-data; boundary=b")
    yield Probe(method, path, who, "multipart without boundary", b"x", "multipart/form-data")
    yield Probe(method, path, who, "chunked json", valid, "application/json", chunked=True)
    yield Probe(method, path, who, "oversized json (8 MB)",
                _json({**sample, "pad": "x" * 8_000_000}), "application/json")
    yield Probe(method, path, who, "content-length larger than body", valid, "application/json",
                headers={"Content-Length": str(len(valid) + 10)})


def header_probes(who: str) -> Iterator[Probe]:
    path = "/api/v1/incidents/"
    for label, value in [("token with NUL", "Token fw_abc\x00def"), ("token %00", "Token %00"),
                         ("token surrogate", "Token \udcff\udcfe"), ("empty token", "Token "),
                         ("token 10k chars", "Token " + "a" * 10_000),
                         ("basic with NUL user", "Basic " + base64.b64encode(b"a\x00b:pw").decode()),
                         ("bearer garbage", "Bearer %00")]:
        yield Probe("GET", path, who, f"authorization {label}", headers={"Authorization": value})
    yield Probe("GET", path, who, "accept with NUL", headers={"Accept": "application/json\x00"})
    yield Probe("GET", path, who, "accept version garbage",
                headers={"Accept": "application/json; version=%00"})
    yield Probe("GET", path, who, "X-Request-ID with NUL", headers={"X-Request-ID": "a\x00b"})
    yield Probe("GET", path, who, "X-Forwarded-For garbage", headers={"X-Forwarded-For": "%00, ::zz"})
    yield Probe("GET", path, who, "Idempotency-Key with NUL",
                headers={"Idempotency-Key": "a\x00b"})
    yield Probe("POST", "/api/v1/signals/", who, "push with idempotency key surrogate",
                _json({"signals": [signal_record("gpu-001")]}), "application/json",
                headers={"Idempotency-Key": "\udcff" * 300})


PAGE_FAMILIES = [
    "/", "/dashboard/live", "/dashboard/gpu-grid.json", "/nodes/", "/nodes/{node}/",
    "/nodes/{node}/telemetry.json", "/jobs/", "/jobs/{job}/", "/incidents/", "/incidents/{incident}/",
    "/incidents/{incident}/live", "/incidents/{incident}/chart.json",
    "/incidents/{incident}/replay.json", "/incidents/{incident}/postmortem.md", "/audit/",
    "/audit/verify", "/sources/", "/policy/", "/api/schema/", "/api/docs/", "/login/", "/healthz",
    "/metrics", "/admin/", "/admin/login/",
]
PAGE_QUERY = ["group", "by", "cluster", "page", "minutes", "status", "root_cause", "node", "q",
              "health", "pool", "action", "actor", "since", "until", "next", "format", "order"]


# The pages whose query strings are read (filters, grouping, paging, time ranges).
PAGE_WITH_QUERY = {"/", "/dashboard/live", "/dashboard/gpu-grid.json", "/nodes/", "/jobs/",
                   "/incidents/", "/audit/", "/nodes/{node}/telemetry.json"}


def page_probes(target: Target, who: str, full: bool, profile: Profile = FULL) -> list[Probe]:
    """Every page family with poisoned paths and query strings, the incident actions with
    poisoned form fields, unknown actions and the demo's inject form."""
    w = target.world
    real = {"node": w.get("node", "gpu-001"), "job": w.get("job", "4242"),
            "incident": str(w.get("incident", 1))}
    poisons = ({k: URL_POISONS[k] for k in profile.url_full} if full
               else {k: URL_POISONS[k] for k in ("nul-pct", "digits20")})
    query_values = profile.page_query if full else ("nul-pct",)
    probes: list[Probe] = []
    for template in PAGE_FAMILIES:
        params = re.findall(r"\{(\w+)\}", template)
        real_path = template.format(**real)
        probes.append(Probe("GET", real_path, who, "page as is"))
        for name, poison in poisons.items():
            for p in params:
                probes.append(Probe("GET", template.format(**{**real, p: poison}), who,
                                    f"page path {p}={name}"))
        if full:
            for name in ("nul-raw", "nul-pct", "surrogate-pct"):
                probes.append(Probe("GET", real_path + URL_POISONS[name], who,
                                    f"page path suffix {name}"))
        keys = (PAGE_QUERY if template in PAGE_WITH_QUERY else PAGE_QUERY[:4]) if full else ["page"]
        for q in keys:
            for name in query_values:
                probes.append(Probe("GET", f"{real_path}?{q}={URL_POISONS[name]}", who,
                                    f"page query {q}={name}"))
            if full and q in ("page", "minutes"):
                for name in ("digits20", "1e999", "negative"):
                    probes.append(Probe("GET", f"{real_path}?{q}={URL_POISONS[name]}", who,
                                        f"page query {q}={name}"))
    incident = real["incident"]
    form = "application/x-www-form-urlencoded"
    values = [("nul", "%00"), ("non-numeric", "abc"), ("digits20", "9" * 20), ("1e999", "1e999"),
              ("surrogate", "%ED%A0%80"), ("empty", "")]
    for action in ("start", "approve", "cancel", "continue", "retry", "resolve", "acknowledge"):
        for name, value in values if full else values[:3]:
            probes.append(Probe("POST", f"/incidents/{incident}/{action}", who,
                                f"page action {action} remediation={name}",
                                f"remediation={value}&note={value}".encode(), form))
    for action in ("%3Cscript%3Ealert(1)%3C%2Fscript%3E", "x%00y", "%ED%A0%80", "a" * 3000,
                   "x\x00y"):
        probes.append(Probe("POST", f"/incidents/{incident}/{action}", who,
                            f"page unknown action {action[:16]!r}", b"", form))
    probes.append(Probe("POST", f"/incidents/{incident}/approve", who,
                        "page action json body", b'{"remediation": 1e999}', "application/json"))
    probes.append(Probe("POST", f"/incidents/{'9' * 20}/approve", who,
                        "page action incident 20 digits", b"remediation=1", form))
    for key, value in [("gpu", "abc"), ("gpu", "9" * 20), ("code", "1e999"), ("code", "%00"),
                       ("node", "%00"), ("node", "%ED%A0%80"), ("kind", "%00"), ("switch", "%00"),
                       ("gpu", "-1"), ("kind", "nope")]:
        probes.append(Probe("POST", "/demo/inject", who, f"inject {key}={value[:12]}",
                            f"kind=xid&node=gpu-001&{key}={value}".encode(), form))
    probes.append(Probe("POST", "/demo/inject", who, "inject nested form",
                        b"&".join([b"a[]=1"] * 5000), form))
    return probes


def method_probes(schema: dict[str, Any], who: str) -> Iterator[Probe]:
    """Methods an operation does not document, on every API path (real ids not needed)."""
    for template in schema.get("paths", {}):
        path = re.sub(r"\{[^}]+\}", "1", template)
        for method in ("OPTIONS", "HEAD", "TRACE", "PROPFIND"):
            yield Probe(method, path, who, f"method {method}")
    yield Probe("GET", "/api/v1/" + "a/" * 4000, who, "path 8000 characters")
    yield Probe("GET", "/api/v1/incidents/?status=a&status=b&status=%00", who, "repeated query")


def admin_probes(target: Target) -> list[Probe]:
    """The Django admin's model pages (found on its index as the admin sees it) with poisoned
    searches, orderings, pages and object ids."""
    conn = http.client.HTTPConnection(*target.host_port, timeout=30)
    cookies = target.sessions.get("admin", {})
    conn.request("GET", "/admin/", headers={"Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())})
    html = conn.getresponse().read().decode("utf-8", "replace")
    models = sorted(set(re.findall(r'href="(/admin/\w+/\w+/)"', html)))
    probes = []
    for model in models:
        for query in ("q=%00", "q=%ED%A0%80", "p=abc", "p=99999999999999999999", "o=%00",
                      "o=99", "id__exact=99999999999999999999", "id__gt=abc", "e=1&%00=1"):
            probes.append(Probe("GET", f"{model}?{query}", "page:admin", f"admin list {query}"))
        for obj in ("%00", "99999999999999999999", "abc", "%ED%A0%80"):
            probes.append(Probe("GET", f"{model}{obj}/change/", "page:admin", f"admin object {obj}"))
    return probes


def login_probes() -> Iterator[Probe]:
    form = "application/x-www-form-urlencoded"
    for label, body in [("login NUL user", b"username=a%00b&password=x"),
                        ("login surrogate user", b"username=%ED%A0%80&password=x"),
                        ("login NUL password", b"username=admin&password=%00"),
                        ("login bad utf8", b"username=%FF%FE&password=%FF"),
                        ("login 100k user", b"username=" + b"a" * 100_000 + b"&password=x")]:
        yield Probe("POST", "/login/", "anon", label, body, form)
    yield Probe("POST", "/admin/login/", "anon", "admin login NUL user",
                b"username=a%00b&password=x", form)


def concurrent_probes(target: Target) -> list[list[Probe]]:
    """Groups of identical requests sent at once."""
    w = target.world
    token_body = _json({"name": "battery-dup", "user": "bat-operator", "scopes": ["read"]})
    hook_body = _json({"name": "battery-hook", "url": "https://hooks.example.com/x",
                       "events": []})
    push = _json({"signals": [signal_record(w.get("node", "gpu-001"))]})
    groups = [
        [Probe("POST", "/api/v1/tokens/", "admin", "concurrent token create, one name",
               token_body, "application/json") for _ in range(8)],
        [Probe("POST", "/api/v1/webhooks/", "admin", "concurrent webhook create, one name",
               hook_body, "application/json") for _ in range(8)],
        [Probe("POST", f"/api/v1/incidents/{w.get('old_incident', 1)}/remediate/", "operator",
               "concurrent remediate", b"", "application/json") for _ in range(8)],
        [Probe("POST", f"/api/v1/remediations/{w.get('failed', 1)}/retry/", "operator",
               "concurrent retry while a newer remediation is active", b"", "application/json")
         for _ in range(6)],
        [Probe("POST", f"/api/v1/steps/{w.get('failed_step', 1)}/retry/", "operator",
               "concurrent step retry while a newer remediation is active", b"",
               "application/json") for _ in range(6)],
        [Probe("POST", f"/api/v1/remediations/{w.get('remediation', 1)}/approve/", "operator",
               "concurrent approve", b"", "application/json") for _ in range(4)]
        + [Probe("POST", f"/api/v1/remediations/{w.get('remediation', 1)}/cancel/", "operator",
                 "concurrent cancel", b"", "application/json") for _ in range(4)],
        [Probe("POST", "/api/v1/signals/", "agent", "concurrent push, one idempotency key", push,
               "application/json", headers={"Idempotency-Key": "battery-batch-1"})
         for _ in range(8)],
    ]
    return groups


def reader_probes(target: Target, schema: dict[str, Any]) -> list[Probe]:
    """Every GET operation and page with real ids, after the poisoned pushes: what is stored
    must not break any reader."""
    probes = []
    for template, item in schema.get("paths", {}).items():
        if "get" in item:
            real = target.world.get("path_parameters", {}).get(template, {})
            path = template
            for key, value in real.items():
                path = path.replace(f"{{{key}}}", str(value))
            if "{" not in path:
                probes.append(Probe("GET", path, "admin", "read after poisoned pushes"))
    w = target.world
    for incident in w.get("incidents", []):
        for suffix in ("", "live", "chart.json", "replay.json", "postmortem.md"):
            probes.append(Probe("GET", f"/incidents/{incident}/{suffix}", "page:admin",
                                "page after poisoned pushes"))
        for suffix in ("timeline/", "replay/", ""):
            probes.append(Probe("GET", f"/api/v1/incidents/{incident}/{suffix}", "admin",
                                "read after poisoned pushes"))
    for page in ("/", "/dashboard/live", "/nodes/", f"/nodes/{w.get('node', 'gpu-001')}/",
                 f"/nodes/{w.get('node', 'gpu-001')}/telemetry.json", "/audit/", "/audit/verify",
                 "/sources/", "/metrics"):
        probes.append(Probe("GET", page, "page:admin", "page after poisoned pushes"))
    for q in ("", "?node=gpu-001", "?source=kernel", "?kind=xid", "?ordering=-observed_at"):
        probes.append(Probe("GET", f"/api/v1/signals/{q}", "admin", "signals after poisoned pushes"))
    return probes


# --- running it -------------------------------------------------------------------------------


def run_battery(target: Target, workers: int = 4, profile: Profile = FULL) -> list[Answer]:
    schema = json.loads(send_json(target, "/api/schema/?format=json"))
    answers: list[Answer] = []
    pool = ThreadPoolExecutor(workers)

    def fire(probes: list[Probe]) -> None:
        answers.extend(pool.map(lambda p: send(target, p), probes))

    # 1. Stored poison first, then every reader of it.
    node = target.world.get("node", "gpu-001")
    pushers = [w for w in ("agent", "operator") if w in target.tokens]
    for who in pushers:
        fire(list(push_probes(target, who, node)))
    fire(reader_probes(target, schema))
    # 2. Concurrent duplicates.
    for group in concurrent_probes(target) if target.world else []:
        group = [p for p in group if p.who in target.tokens]
        fire(group)
    # 3. Every operation, every caller (the full set as admin), and the pages.
    for who in [*ROLES, "agent", "anon"]:
        if who in target.tokens or who == "anon":
            fire(api_probes(target, schema, who, full=who == "admin", profile=profile))
    fire(list(header_probes("admin")))
    fire(list(login_probes()))
    fire(list(method_probes(schema, "admin")))
    if "admin" in target.sessions:
        fire(admin_probes(target))
    for role in ROLES:
        if role in target.sessions:
            fire(page_probes(target, f"page:{role}", full=role == "admin", profile=profile))
    if target.world:
        fire(page_probes(target, "anon", full=False))
    # 4. Readers again, after everything.
    fire(reader_probes(target, schema))
    pool.shutdown()
    return answers


def send_json(target: Target, path: str) -> bytes:
    host, port = target.host_port
    conn = http.client.HTTPConnection(host, port, timeout=60)
    token = target.tokens.get("admin") or next(iter(target.tokens.values()), "")
    conn.request("GET", path, headers={"Authorization": f"Token {token}"} if token else {})
    answer = conn.getresponse()
    data = answer.read()
    if answer.status != 200:
        raise RuntimeError(f"GET {path}: {answer.status} {data[:300]!r}")
    return data


def summary(answers: list[Answer]) -> dict[str, Any]:
    classes = Counter("no answer" if a.status == 0 else f"{a.status // 100}xx" for a in answers)
    errors = [a for a in answers if a.status >= 500]
    silent = [a for a in answers if a.status == 0]
    # Django's own HTML error pages under /api/ (gunicorn's refusals of what never reached
    # Django, "text/html" without a charset, are not counted).
    html_api = [a for a in answers if a.probe.path.startswith("/api/v1/") and a.status >= 400
                and a.content_type.startswith("text/html;")]
    return {"requests": len(answers), "by_class": dict(sorted(classes.items())),
            "server_errors": [describe(a) for a in errors],
            "done_twice": done_twice(answers),
            "no_answer": [describe(a) for a in silent],
            "api_errors_not_json": [describe(a) for a in html_api],
            # Every answer, one line each, for reading what a class of input got.
            "answers": [f"{a.status} {a.probe.who} {a.probe.method} {a.probe.path[:100]!r} {a.probe.label}"
                        for a in answers]}


# Identical requests sent at once that must take effect once at most: (label, success status).
ONCE = [("concurrent token create, one name", 201), ("concurrent webhook create, one name", 201),
        ("concurrent remediate", 201), ("concurrent approve", 200), ("concurrent cancel", 200),
        ("concurrent push, one idempotency key", 201)]


def done_twice(answers: list[Answer]) -> list[str]:
    """The concurrent duplicates that took effect more than once (a replayed push, answered
    201 with ``"replayed": true``, took no effect)."""
    found = []
    for label, ok in ONCE:
        took = [a for a in answers if a.probe.label == label and a.status == ok
                and '"replayed": true' not in a.excerpt.replace('":true', '": true')]
        if len(took) > 1:
            found.append(f"{label}: {len(took)} answers {ok} of {sum(a.probe.label == label for a in answers)}")
    return found


def describe(answer: Answer) -> str:
    p = answer.probe
    body = p.body[:80].decode("utf-8", "backslashreplace")
    if len(p.body) > 80:
        body += f"... ({len(p.body)} bytes)"
    path = p.path if len(p.path) < 120 else p.path[:100] + f"...({len(p.path)})"
    excerpt = " ".join(answer.excerpt.split())[:160]
    return (f"{answer.status} {p.method} {path!r} as {p.who}: {p.label}"
            f"{'; body ' + repr(body) if body else ''} -> {answer.content_type} {excerpt!r}")


def report_text(result: dict[str, Any]) -> str:
    lines = [f"{result['requests']} requests: "
             + ", ".join(f"{k}: {v}" for k, v in result["by_class"].items())]
    if result["server_errors"]:
        lines.append(f"{len(result['server_errors'])} server errors:")
        lines += [f"  {line}" for line in result["server_errors"]]
    if result["done_twice"]:
        lines.append("concurrent duplicates that took effect more than once:")
        lines += [f"  {line}" for line in result["done_twice"]]
    if result["no_answer"]:
        lines.append(f"{len(result['no_answer'])} without an answer:")
        lines += [f"  {line}" for line in result["no_answer"]]
    if result["api_errors_not_json"]:
        lines.append(f"{len(result['api_errors_not_json'])} API errors not in JSON:")
        lines += [f"  {line}" for line in result["api_errors_not_json"][:40]]
    return "\n".join(lines)


# --- its own server ---------------------------------------------------------------------------

SETUP = r"""
import json, os, sys
sys.path.insert(0, os.getcwd())
import django
django.setup()
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
call_command("migrate", verbosity=0, interactive=False)
from collectors.roles import ADMIN, OPERATOR, VIEWER, user_with_role
from collectors.sim.fleet import SimFleet
from incidents.tokens import agent_token_create, token_create
from tests.api.world import build_world
SimFleet(settings.FLEETWATCH_SIM_STATE, settings.FLEETWATCH_SIM_SPEED).seed()
# The users first: build_world switches this process to a fast test-only password hasher,
# which the server would not know.
password = os.environ["BATTERY_PASSWORD"]
users = {"admin": user_with_role("bat-admin", ADMIN, password)[0],
         "operator": user_with_role("bat-operator", OPERATOR, password)[0],
         "viewer": user_with_role("bat-viewer", VIEWER, password)[0],
         "norole": User.objects.create_user("bat-norole", password=password)}
world = build_world(settings)
tokens = {role: token_create(user, f"battery-{role}", ["read", "operate", "ingest"])[1]
          for role, user in users.items()}
tokens["agent"] = agent_token_create(world.node.name)[1]
# What an older version may have stored before pushes were checked at the door, written
# underneath the model fields (which may clean it now): JSON text with lone surrogates, NUL
# escapes, non-finite numbers and deep nesting, a NUL in a message; linked to the incident so
# its timeline, replay and pages read them. Each in a savepoint: PostgreSQL refuses most.
from django.db import connection, transaction
from collectors.models import Signal
from incidents.models import Evidence
stored = []
for label, message, data in [
        ("lone surrogate in data", "m", '{"extra": "\\ud800"}'),
        ("NUL in data", "m", '{"extra": "a\\u0000b", "k\\u0000": 1}'),
        ("non-finite in data", "m", '{"v": Infinity, "w": NaN, "x": -Infinity}'),
        ("deep data", "m", '{"d": ' + "[" * 900 + "]" * 900 + "}"),
        ("NUL in message", "a\x00b", "{}"),
        ("not JSON in data", "m", "{not json")]:
    row = Signal.objects.create(cluster=world.cluster, source="kernel", kind="xid",
                                node=world.node, node_name=world.node.name, message="clean",
                                observed_at=world.signal.observed_at, data={})
    Evidence.objects.create(incident=world.incident, signal=row, role="symptom")
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"UPDATE {Signal._meta.db_table} SET message = %s, data = %s "
                           "WHERE id = %s", [message, data, row.pk])
        stored.append(label)
    except Exception as exc:
        stored.append(f"refused: {label}: {type(exc).__name__}")
from drf_spectacular.generators import SchemaGenerator
paths = SchemaGenerator().get_schema(request=None, public=True)["paths"]
params = {}
for template in paths:
    try:
        params[template] = world.path_parameters(template)
    except Exception:
        params[template] = {}
print("BATTERY:" + json.dumps({
    "stored": stored, "tokens": tokens, "usernames": {r: u.username for r, u in users.items()},
    "world": {"node": world.node.name, "job": world.job.slurm_id, "incident": world.incident.pk,
              "old_incident": world.failed.incident_id, "failed": world.failed.pk,
              "failed_step": world.failed_step.pk, "remediation": world.remediation.pk,
              "incidents": [world.incident.pk, world.failed.incident_id],
              "path_parameters": params}}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres_database(url: str) -> Iterator[str]:
    """A database of our own on the server ``url`` names; dropped afterwards."""
    import psycopg

    parsed = urllib.parse.urlsplit(url)
    name = f"fw_badinput_{os.getpid()}_{secrets.token_hex(3)}"
    admin_url = urllib.parse.urlunsplit(parsed._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urllib.parse.urlunsplit(parsed._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def own_server(app_dir: Path, database: str, python: str, log_to: Path | None = None
               ) -> Iterator[Target]:
    """gunicorn from ``app_dir`` on a fresh database with the battery's world."""
    work = Path(tempfile.mkdtemp(prefix="fw-bad-input-"))
    try:
        if database == "sqlite":
            db_url = f"sqlite:///{work / 'battery.sqlite3'}"
            db_cm: AbstractContextManager[str] = nullcontext(db_url)
        else:
            url = os.environ.get("DATABASE_URL", "")
            if not url.startswith(("postgres://", "postgresql://")):
                raise SystemExit("--database postgres needs DATABASE_URL naming a PostgreSQL server "
                                 "(run under tests/harness/with-services.sh)")
            db_cm = postgres_database(url)
        with db_cm as db_url:
            port = _free_port()
            # The filesystem broker in the data folder (no worker runs: what the requests
            # queue just waits) and the throttles out of the way (thousands of requests a
            # minute from one address are the point here); approve mode, so that remediations
            # wait for the actions the battery sends.
            drop = {"DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "FLEETWATCH_CACHE_URL",
                    "DJANGO_SETTINGS_MODULE", "PROMETHEUS_MULTIPROC_DIR"}
            env = {k: v for k, v in os.environ.items() if k not in drop}
            env.update(
                DATABASE_URL=db_url, FLEETWATCH_DATA_DIR=str(work / "data"),
                DJANGO_SETTINGS_MODULE="fleetwatch.settings", BATTERY_PASSWORD=PASSWORD,
                FLEETWATCH_POLICY_MODE="approve", FLEETWATCH_API_RATE="1000000/min",
                FLEETWATCH_API_INGEST_RATE="1000000/min", FLEETWATCH_API_ANON_RATE="1000000/min",
                WEB_CONCURRENCY="4", GUNICORN_TIMEOUT="60", LOG_LEVEL="WARNING",
                PYTHONPATH=str(app_dir))
            setup = subprocess.run([python, "-c", SETUP], cwd=app_dir, env=env, capture_output=True,
                                   text=True, timeout=600)
            line = next((x for x in setup.stdout.splitlines() if x.startswith("BATTERY:")), "")
            if setup.returncode or not line:
                raise RuntimeError(f"setup failed:\n{setup.stdout[-3000:]}\n{setup.stderr[-5000:]}")
            info = json.loads(line[len("BATTERY:"):])
            log = open(log_to or work / "server.log", "wb")  # noqa: SIM115
            gunicorn = str(Path(python).parent / "gunicorn")
            proc = subprocess.Popen([gunicorn, "-c", "deploy/gunicorn.conf.py", "--bind",
                                     f"127.0.0.1:{port}"], cwd=app_dir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                target = Target(f"http://127.0.0.1:{port}", info["tokens"],
                                world={**info["world"], "stored": info["stored"]})
                _wait_up(target, proc)
                for role in ROLES:
                    target.sessions[role] = login(target, info["usernames"][role])
                yield target
            finally:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                log.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _wait_up(target: Target, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gunicorn exited with {proc.returncode}")
        with suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection(*target.host_port, timeout=5)
            conn.request("GET", "/healthz")
            if conn.getresponse().status in (200, 503):
                return
        time.sleep(0.3)
    raise RuntimeError("the server did not answer /healthz within 90 s")


def battery_on_own_server(app_dir: Path, database: str, python: str = sys.executable,
                          server_log: Path | None = None, quick: bool = False) -> dict[str, Any]:
    started = time.monotonic()
    with own_server(app_dir, database, python, server_log) as target:
        answers = run_battery(target, profile=QUICK if quick else FULL)
        stored = target.world["stored"]
    result = summary(answers)
    result["stored_underneath"] = stored
    result.update(database=database, app_dir=str(app_dir),
                  seconds=round(time.monotonic() - started, 1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=["sqlite", "postgres"], action="append",
                        help="start a server on this database (repeatable; default sqlite)")
    parser.add_argument("--app-dir", type=Path, default=ROOT,
                        help="the checkout whose server is started (default: this one)")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python (of a virtualenv with gunicorn) the server runs on")
    parser.add_argument("--base-url", help="an already running server instead of our own")
    parser.add_argument("--token", help="with --base-url: the API token used for every role")
    parser.add_argument("--out", type=Path, help="write <out>/bad_input-<database>.json too")
    parser.add_argument("--quick", action="store_true",
                        help="fewer variants of each poison (the profile `make test` runs)")
    parser.add_argument("--server-log", type=Path,
                        help="keep the server's log (tracebacks of the 5xx) in <dir>/<database>.log")
    args = parser.parse_args(argv)
    results = []
    if args.base_url:
        tokens = {role: args.token for role in ROLES} if args.token else {}
        result = summary(run_battery(Target(args.base_url.rstrip("/"), tokens),
                                     profile=QUICK if args.quick else FULL))
        result.update(database="(running server)", app_dir=args.base_url)
        results.append(result)
    else:
        for database in args.database or ["sqlite"]:
            log = None
            if args.server_log:
                args.server_log.mkdir(parents=True, exist_ok=True)
                log = args.server_log / f"{database}.log"
            results.append(battery_on_own_server(args.app_dir.resolve(), database, args.python, log,
                                                 quick=args.quick))
    for result in results:
        print(f"== {result['database']} ({result['app_dir']}, {result.get('seconds', '?')} s)")
        print(report_text(result))
        if result.get("stored_underneath"):
            print("stored underneath the models before the readers ran: "
                  + "; ".join(result["stored_underneath"]))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"bad_input-{result['database']}.json").write_text(
                json.dumps(result, indent=2))
    return 1 if any(r["server_errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
