"""The Slurm client over slurmrestd (Slurm's REST API) with JWT, as under Slinky.

Reads and node actions go through slurmrestd; the JSON it answers is the same data_parser
JSON as the CLI's ``--json`` and is read by the same parsers (``slurm.parse_nodes`` /
``parse_jobs``). Actions read the current state first (a retried step does nothing twice)
and keep FleetWatch's ownership rules: every reason FleetWatch sets starts with
``fleetwatch:``, and resume() refuses a node whose reason does not.

API version
    The server's OpenAPI document (``GET /openapi/v3``) is read once; FleetWatch uses the
    highest ``/slurm/v0.0.N/`` it serves among the versions FleetWatch was tested with
    (``KNOWN_VERSIONS``). A server that serves only newer ones is used at its highest, with
    a warning. A 404 under the chosen prefix (the server dropped that version after an
    upgrade) re-reads the document once and retries; a second 404 fails the read.

What maps to what (found on a real 25.11.7 slurmrestd, tests/integration/test_slurmrestd.py)
    nodes()      ``GET /slurm/v0.0.N/nodes/``
    node(name)   ``GET /slurm/v0.0.N/node/{name}`` (an unknown name: 200 with "Failure to
                 query node NAME" in 25.11, read as NotFound)
    jobs()       ``GET /slurm/v0.0.N/jobs/`` (finished jobs slurmctld still holds, MinJobAge,
                 are included: the REST call applies no state filter, unlike ``squeue``)
    drain/down/resume  ``POST /slurm/v0.0.N/node/{name}`` with ``{"state": [...], "reason"}``
    cancel(TERM) ``DELETE /slurm/v0.0.N/job/{id}`` without a signal: Slurm's own stop, as plain
                 ``scancel`` (SIGTERM to every process, KillWait, then SIGKILL). Another
                 signal: ``DELETE ...?signal=SIGUSR1&flags=FULL_JOB``, only delivered.
    topology()   slurmrestd has no topology endpoint (and 25.11 nodes' ``topology`` field is
                 empty under topology/tree): the leaves come from a copy of the cluster's
                 ``topology.conf`` (``topology_file``, FLEETWATCH_SLURM_TOPOLOGY_FILE);
                 without one the switch of each node is unknown, said in ``last_warnings``.

requeue(), requeue_hold(), reboot(): slurmrestd has no endpoint for them, in any version
    (25.11's openapi/slurmctld offers job submit/update/signal and node update only; a node
    update to ``REBOOT_REQUESTED`` is answered 500 "Invalid node state transition"; the
    ``FEDERATION_REQUEUE`` signal flag only marks a federated job and requeues nothing).
    Tried on real 25.11 and not chosen: ``POST node/{name} state=DOWN`` does make slurmctld
    requeue the requeueable jobs on that node at once (NODE_FAIL, restart count + 1), but
    it kills them without SIGTERM (no checkpoint), takes every job on the node (a shared
    node's neighbours too), and with ReturnToService=2 the node is back a second later.
    Chosen: these three calls run ``scontrol requeue|requeuehold|reboot`` authenticated by
    the same JWT (``SLURM_JWT`` in its environment: auth/jwt, no munge, no root), which
    needs only the ``scontrol`` binary and a slurm.conf naming the controller with
    ``AuthAltTypes=auth/jwt`` (FLEETWATCH_SLURM_BIN_DIR, FLEETWATCH_SLURM_CONF). The state
    is still read over REST first. Where no scontrol is installed the call is refused
    plainly (``ClientError(permanent=True)``) and the remediation stops for a person.

Errors: slurmrestd unreachable, a token refused (401 without one; 25.11 answers 511
"Protocol authentication error" for an expired or foreign one), a dropped version, a 5xx or
an ``errors`` entry from slurmctld, a body without the records asked for: each raises
``ClientError`` naming the cause, so the Slurm source turns red and no node is read as
failed. slurmctld's own ``/readyz`` and ``/metrics`` (``ctld_url``, 25.11+) are read before
the nodes: a controller that is not ready fails the read; metrics that disagree with the
REST answer, or are not served, are reported in ``last_warnings``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import requests

from collectors.clients.base import (
    SLURM_REASON_PREFIX,
    ActionResult,
    CheckJob,
    CheckJobSpec,
    ClientError,
    NotFound,
    SlurmJob,
    SlurmNode,
    SlurmReservation,
    job_comment,
    job_comment_check,
)
from collectors.clients.slurm import (
    ACTIVE_JOB_STATES,
    check_job_from,
    check_jobs_of,
    classify,
    job_with_id,
    node_named,
    owned_reason,
    owned_reservation,
    parse_jobs,
    parse_nodes,
    parse_reservations,
    parse_topology,
    payload_errors,
    requeue_held,
    requeue_stopped,
    reservation_held,
    signal_name,
)

# The data_parser versions FleetWatch was tested with over REST (24.05 ... 25.11).
KNOWN_VERSIONS = (41, 42, 43, 44)
# A token is renewed (re-read, or minted) this long before its exp claim.
RENEW_MARGIN_SECONDS = 60.0
_PREFIX_RE = re.compile(r"^/slurm/v0\.0\.(\d+)/")


# --- JWT ---------------------------------------------------------------------------------------


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def jwt_hs256(claims: Mapping[str, Any], key: bytes) -> str:
    """An HS256 JWT (RFC 7519), as ``scontrol token`` makes: Slurm's auth/jwt checks the
    signature with its jwt_hs256.key and reads ``sun`` (the user) and ``exp``."""
    header = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    body = _b64url(json.dumps(dict(claims), separators=(",", ":")).encode())
    signing = f"{header}.{body}".encode()
    return f"{header}.{body}.{_b64url(hmac.new(key, signing, hashlib.sha256).digest())}"


def jwt_expiry(token: str) -> float | None:
    """The ``exp`` claim of a JWT (not verified: slurmctld does that), None without one."""
    try:
        claims = json.loads(_b64url_decode(token.split(".")[1]))
    except (IndexError, ValueError):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None


class TokenSource:
    """Where the JWT comes from: a fixed token, a file re-read when it changes or runs out (a
    rotated Kubernetes Secret), or the HS256 key to mint short-lived tokens with."""

    def __init__(self, *, token: str = "", token_file: str = "", key_file: str = "",
                 user: str = "", lifespan: int = 1800,
                 clock: Callable[[], float] = time.time) -> None:
        if not (token or token_file or key_file):
            raise ValueError("a JWT, a JWT file or the JWT key file is needed")
        if key_file and not user:
            raise ValueError("minting tokens from the key needs the user name (sun claim)")
        self.token, self.token_file, self.key_file = token.strip(), token_file, key_file
        self.user, self.lifespan, self.clock = user, lifespan, clock
        self._file_stamp: tuple[float, int] | None = None
        self._current = self.token
        self._expires: float | None = jwt_expiry(self.token) if self.token else None

    def describe(self) -> str:
        if self.key_file:
            return f"tokens minted with {self.key_file}"
        if self.token_file:
            return f"the token in {self.token_file}"
        return "FLEETWATCH_SLURM_JWT"

    def _due(self) -> bool:
        return (not self._current or (self._expires is not None
                and self._expires - RENEW_MARGIN_SECONDS <= self.clock()))

    def get(self) -> str:
        if self.key_file:
            if self._due():
                try:
                    key = Path(self.key_file).read_bytes()
                except OSError as exc:
                    raise ClientError(f"cannot read the Slurm JWT key {self.key_file}: "
                                      f"{exc.strerror}", permanent=True) from exc
                now = int(self.clock())
                self._current = jwt_hs256({"iat": now, "exp": now + self.lifespan,
                                           "sun": self.user}, key)
                self._expires = float(now + self.lifespan)
            return self._current
        if self.token_file:
            try:
                stat = os.stat(self.token_file)
            except OSError as exc:
                raise ClientError(f"cannot read the Slurm JWT file {self.token_file}: "
                                  f"{exc.strerror}", permanent=False) from exc
            stamp = (stat.st_mtime, stat.st_size)
            if stamp != self._file_stamp or self._due():
                try:
                    text = Path(self.token_file).read_text().strip()
                except OSError as exc:
                    raise ClientError(f"cannot read the Slurm JWT file {self.token_file}: "
                                      f"{exc.strerror}", permanent=False) from exc
                # `scontrol token` prints SLURM_JWT=...; a Secret holds the token alone.
                self._current = text.removeprefix("SLURM_JWT=")
                self._expires = jwt_expiry(self._current)
                self._file_stamp = stamp
        if not self._current:
            raise ClientError(f"{self.describe()} is empty", permanent=True)
        if self._expires is not None and self._expires <= self.clock():
            raise ClientError(
                f"the Slurm JWT from {self.describe()} expired at "
                f"{time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(self._expires))}"
                + (" (the file was re-read; is the Secret rotated?)" if self.token_file else ""),
                permanent=not self.token_file)
        return self._current


# --- the client --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Answer:
    status: int
    payload: Any


class RestError(ClientError):
    """slurmrestd answered with errors; ``status``: its HTTP status."""

    def __init__(self, message: str, *, status: int, permanent: bool = False) -> None:
        super().__init__(message, permanent=permanent)
        self.status = status


class SlurmRest:
    """``SlurmClient`` over slurmrestd. See the module docstring for what maps to what."""

    source = "slurm"
    last_warnings: list[str]

    def __init__(self, url: str, tokens: TokenSource, *, user: str = "", timeout: float = 10.0,
                 ctld_url: str = "", topology_file: str = "", bin_dir: str = "",
                 slurm_conf: str = "", session: requests.Session | None = None) -> None:
        self.url = url.rstrip("/")
        self.tokens = tokens
        self.user = user
        self.timeout = timeout
        self.ctld_url = ctld_url.rstrip("/")
        self.topology_file = topology_file
        self.bin_dir = bin_dir
        self.slurm_conf = slurm_conf
        self.session = session or requests.Session()
        self.last_warnings: list[str] = []
        self._version: int | None = None
        self._version_warning = ""
        # The OpenAPI document's paths and their methods, as the server served them.
        self._paths: dict[str, set[str]] = {}

    # --- HTTP ----------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"X-SLURM-USER-TOKEN": self.tokens.get(), "Accept": "application/json"}
        if self.user:
            headers["X-SLURM-USER-NAME"] = self.user
        return headers

    def _send(self, method: str, url: str, body: Any = None) -> requests.Response:
        try:
            return self.session.request(method, url, headers=self._headers(), json=body,
                                        timeout=self.timeout)
        except requests.Timeout as exc:
            raise ClientError(f"slurmrestd at {self.url} did not answer within "
                              f"{self.timeout:g}s ({method} {url})") from exc
        except requests.RequestException as exc:
            raise ClientError(f"slurmrestd at {self.url} is unreachable: "
                              f"{type(exc).__name__}: {exc}") from exc

    def version(self) -> int:
        """The /slurm/v0.0.N/ this client uses, from the server's OpenAPI document."""
        if self._version is None:
            self._version, self._version_warning = self._pick_version()
        return self._version

    def _pick_version(self) -> tuple[int, str]:
        response = self._send("GET", f"{self.url}/openapi/v3")
        self._check_auth(response, "GET /openapi/v3")
        if response.status_code != 200:
            raise ClientError(f"slurmrestd answered {response.status_code} to GET /openapi/v3: "
                              f"{response.text[:200]!r}")
        try:
            paths = response.json().get("paths")
            served = {int(m.group(1)) for p in paths if (m := _PREFIX_RE.match(p))}
            self._paths = {p: {str(m).lower() for m in methods} for p, methods in paths.items()
                           if isinstance(methods, Mapping)}
        except (ValueError, AttributeError, TypeError) as exc:
            raise ClientError(f"slurmrestd's OpenAPI document has no paths: {exc}",
                              permanent=True) from exc
        known = sorted(served & set(KNOWN_VERSIONS))
        if known:
            return known[-1], ""
        if served and max(served) > KNOWN_VERSIONS[-1]:
            newest = max(served)
            return newest, (f"slurmrestd serves only /slurm/v0.0.{newest}/, which FleetWatch was "
                            f"not tested with (known: v0.0.{KNOWN_VERSIONS[0]}-"
                            f"v0.0.{KNOWN_VERSIONS[-1]}); reading it anyway")
        if served:
            raise ClientError(f"slurmrestd at {self.url} serves only "
                              f"{', '.join(f'v0.0.{v}' for v in sorted(served))}, older than "
                              f"any FleetWatch reads (v0.0.{KNOWN_VERSIONS[0]}+)", permanent=True)
        raise ClientError(f"slurmrestd at {self.url} serves no /slurm/ API (is it started with "
                          "-s slurmctld?)", permanent=True)

    def _check_auth(self, response: requests.Response, what: str) -> None:
        if response.status_code == 401:
            raise ClientError(f"slurmrestd refused {what} (401 {response.text.strip()[:80]}): "
                              f"no valid token from {self.tokens.describe()}", permanent=True)
        if response.status_code == 511 or (response.status_code >= 400 and
                                           "authentication" in response.text.lower()):
            raise ClientError(
                f"slurmctld refused the JWT from {self.tokens.describe()} ({what}: "
                f"{response.status_code} {self._errors_text(response) or 'authentication error'}"
                "): expired, or signed with another key than the cluster's jwt_hs256.key",
                permanent=True)

    @staticmethod
    def _errors_text(response: requests.Response) -> str:
        try:
            return payload_errors(response.json()) or ""
        except ValueError:
            return ""

    def _path(self, path: str) -> str:
        return f"/slurm/v0.0.{self.version()}/{path}"

    def _call(self, method: str, path: str, body: Any = None, *,
              params: Mapping[str, str] | None = None) -> _Answer:
        """One API call under the chosen version; the payload, or ClientError naming why."""
        for attempt in range(2):
            full = self._path(path)
            query = "&".join(f"{k}={quote(v)}" for k, v in (params or {}).items())
            what = f"{method} {full}" + (f"?{query}" if query else "")
            response = self._send(method, self.url + full + (f"?{query}" if query else ""), body)
            self._check_auth(response, what)
            if response.status_code == 404 and not response.text.lstrip().startswith("{"):
                # Not a record that is missing (that answers JSON with errors): the prefix
                # itself is gone, as after an upgrade that dropped the version.
                dropped = self._version
                self._version = None
                if attempt == 0 and self.version() != dropped:
                    continue  # the server moved on to another version: use it
                if self._version == dropped:
                    raise ClientError(f"slurmrestd answered 404 to {what}: "
                                      f"{response.text.strip()[:160]!r}", permanent=True)
                self._version = None
                raise ClientError(f"slurmrestd no longer serves /slurm/v0.0.{dropped}/ "
                                  f"({what} answered 404)", permanent=True)
            try:
                payload = response.json()
            except ValueError as exc:
                raise ClientError(f"slurmrestd answered {response.status_code} to {what} with "
                                  f"no JSON: {response.text[:200]!r}",
                                  permanent=response.status_code < 500) from exc
            errors = payload_errors(payload)
            if errors or response.status_code >= 400:
                message = errors or f"HTTP {response.status_code}"
                kind = classify(message)
                raise RestError(f"slurmrestd {what} failed ({response.status_code}): "
                                f"{message}", status=response.status_code,
                                permanent=kind is True)
            return _Answer(response.status_code, payload)
        raise AssertionError("unreachable")

    @staticmethod
    def _call_text(method: str, path: str, body: Any = None, query: str = "") -> str:
        text = f"{method} {path}" + (f"?{query}" if query else "")
        return text + (f" {json.dumps(body, separators=(',', ':'))}" if body is not None else "")

    # --- slurmctld's own health ----------------------------------------------------------------

    def _controller_health(self) -> tuple[list[str], set[str]]:
        """slurmctld's /readyz (must answer 2xx) and the nodes /metrics/nodes lists (for a
        cross-check with the REST answer); nothing without ``ctld_url``."""
        if not self.ctld_url:
            return [], set()
        try:
            ready = self.session.get(f"{self.ctld_url}/readyz", timeout=self.timeout)
        except requests.RequestException as exc:
            raise ClientError(f"slurmctld at {self.ctld_url} is unreachable "
                              f"(GET /readyz): {type(exc).__name__}: {exc}") from exc
        if ready.status_code == 404:
            return [f"slurmctld at {self.ctld_url} serves no /readyz (Slurm older than 25.11?)"], set()
        if not 200 <= ready.status_code < 300:
            raise ClientError(f"slurmctld is not ready: GET {self.ctld_url}/readyz answered "
                              f"{ready.status_code} {ready.text.strip()[:120]}")
        try:
            metrics = self.session.get(f"{self.ctld_url}/metrics/nodes", timeout=self.timeout)
        except requests.RequestException as exc:
            return [f"slurmctld /metrics/nodes unreadable: {exc}"], set()
        if metrics.status_code != 200:
            return [f"slurmctld /metrics/nodes answered {metrics.status_code} "
                    "(MetricsType=metrics/openmetrics not set?)"], set()
        return [], set(re.findall(r'^slurm_node_cpus\{node="([^"]+)"\}', metrics.text,
                                  re.MULTILINE))

    # --- reads ---------------------------------------------------------------------------------

    def nodes(self) -> list[SlurmNode]:
        warnings, in_metrics = self._controller_health()
        answer = self._call("GET", "nodes/")
        nodes, parsed = parse_nodes(answer.payload)
        warnings += parsed
        if in_metrics and in_metrics != {n.name for n in nodes}:
            missing = sorted(in_metrics - {n.name for n in nodes})
            warnings.append(f"slurmctld /metrics lists {len(in_metrics)} nodes, "
                            f"slurmrestd {len(nodes)}" + (f" (not in REST: {missing[:10]})"
                                                          if missing else ""))
        self.last_warnings = [w for w in [self._version_warning, *warnings] if w]
        return nodes

    def jobs(self) -> list[SlurmJob]:
        answer = self._call("GET", "jobs/")
        jobs, warnings = parse_jobs(answer.payload)
        self.last_warnings = [w for w in [self._version_warning, *warnings] if w]
        return jobs

    def topology(self) -> dict[str, list[str]]:
        if not self.topology_file:
            self.last_warnings = ["slurmrestd has no topology: set FLEETWATCH_SLURM_TOPOLOGY_FILE "
                                  "to a copy of the cluster's topology.conf to know each node's "
                                  "leaf switch"]
            return {}
        self.last_warnings = []
        try:
            text = Path(self.topology_file).read_text()
        except OSError as exc:
            raise ClientError(f"cannot read FLEETWATCH_SLURM_TOPOLOGY_FILE {self.topology_file}: "
                              f"{exc.strerror}", permanent=True) from exc
        return parse_topology(text)

    def node(self, name: str) -> SlurmNode:
        try:
            answer = self._call("GET", f"node/{quote(name, safe='')}")
        except RestError as exc:
            # 25.11 answers an unknown name 200 with "Failure to query node NAME", and a
            # slurmctld it cannot reach 500 with the same description and the reason beside
            # it ("Unable to contact slurm controller"): only the first is no such node.
            unknown = ("failure to query node" in str(exc).lower() and exc.status < 500
                       and classify(str(exc)) is not False)
            if not unknown:
                raise
            raise NotFound(f"Invalid node name specified: {name} is not a node of this "
                           f"cluster ({exc})", permanent=True) from exc
        nodes, warnings = parse_nodes(answer.payload)
        self.last_warnings = [w for w in [self._version_warning, *warnings] if w]
        return node_named(nodes, name)

    def _job(self, job_id: str) -> SlurmJob:
        return job_with_id(self.jobs(), job_id)

    # --- node actions --------------------------------------------------------------------------

    def _update_node(self, node: str, body: dict[str, Any], detail: str) -> ActionResult:
        path = f"node/{quote(node, safe='')}"
        self._call("POST", path, body)
        return ActionResult(self._call_text("POST", self._path(path), body), True, detail)

    def drain(self, node: str, reason: str) -> ActionResult:
        body = {"state": ["DRAIN"], "reason": owned_reason(reason)}
        current = self.node(node)
        if "DRAIN" in current.flags:
            # Drained already, by us or by someone else: their reason stays as it is.
            return ActionResult(self._call_text("POST", self._path(f"node/{node}"), body), False,
                                f"{node} already drained: {current.reason}")
        return self._update_node(node, body, f"{node} drained")

    def down(self, node: str, reason: str) -> ActionResult:
        body = {"state": ["DOWN"], "reason": owned_reason(reason)}
        current = self.node(node)
        if current.state == "DOWN":
            return ActionResult(self._call_text("POST", self._path(f"node/{node}"), body), False,
                                f"{node} already down: {current.reason}")
        return self._update_node(node, body, f"{node} down")

    def resume(self, node: str) -> ActionResult:
        body = {"state": ["RESUME"]}
        current = self.node(node)
        # 25.11 keeps the reason after a RESUME: a node neither drained nor down is in
        # service whatever its reason says, so a retried resume changes nothing.
        if "DRAIN" not in current.flags and current.state != "DOWN":
            return ActionResult(self._call_text("POST", self._path(f"node/{node}"), body), False,
                                f"{node} is not drained or down")
        if not current.reason.startswith(SLURM_REASON_PREFIX):
            raise ClientError(f"{node} was drained by someone else ({current.reason!r}); "
                              "not resuming", permanent=True)
        return self._update_node(node, body, f"{node} resumed")

    def reboot(self, node: str, reason: str) -> ActionResult:
        """``scontrol reboot ASAP nextstate=RESUME`` with the JWT (no REST endpoint)."""
        reason = owned_reason(reason)
        args = ["scontrol", "reboot", "ASAP", "nextstate=RESUME", f"reason={reason}", node]
        current = self.node(node)
        pending = {"REBOOT_REQUESTED", "REBOOT_ISSUED"} & set(current.flags)
        if pending:
            return ActionResult(shlex.join(args), False,
                                f"{node} reboot already {sorted(pending)[0].lower()}")
        self._scontrol(args)
        return ActionResult(shlex.join(args), True, f"{node} reboot requested (ASAP, then RESUME)")

    # --- job actions ---------------------------------------------------------------------------

    def cancel(self, job_id: str, signal: str, grace_seconds: int) -> ActionResult:
        """SIGTERM: ``DELETE job/{id}`` with no signal, Slurm's own stop (SIGTERM, KillWait,
        SIGKILL), as SlurmCli's plain ``scancel``. slurmrestd does not tell KillWait, so the
        grace is the cluster's and ``kill_wait_seconds`` is None. Other signals are only
        delivered (``signal=SIG...&flags=FULL_JOB``, batch script included)."""
        sig = signal_name(signal)
        path = f"job/{quote(str(job_id), safe='')}"
        params = {} if sig == "TERM" else {"signal": f"SIG{sig}", "flags": "FULL_JOB"}
        query = "&".join(f"{k}={v}" for k, v in params.items())
        call = self._call_text("DELETE", self._path(path), query=query)
        data: dict[str, object] = {"signal": sig, "requested_grace_seconds": grace_seconds,
                                   "kill_wait_seconds": None}
        job = self._job(job_id)
        if job.state not in ACTIVE_JOB_STATES:
            return ActionResult(call, False, f"job {job_id} is {job.state}", data)
        self._call("DELETE", path, params=params)
        detail = (f"job {job_id} sent SIGTERM; SIGKILL after the cluster's KillWait"
                  if sig == "TERM" else f"job {job_id} sent SIG{sig}")
        return ActionResult(call, True, detail, data)

    def requeue(self, job_id: str) -> ActionResult:
        """``scontrol requeue`` with the JWT, for a job that has stopped (no REST endpoint)."""
        return requeue_stopped(self._job(job_id), self._scontrol)

    def requeue_hold(self, job_id: str) -> ActionResult:
        def hold() -> ActionResult:
            # A pending job is held over REST: priority 0 is what `scontrol hold` sets.
            body = {"hold": True}
            path = f"job/{quote(str(job_id), safe='')}"
            self._call("POST", path, body)
            return ActionResult(self._call_text("POST", self._path(path), body), True,
                                f"job {job_id} held")

        return requeue_held(self._job(job_id), self._scontrol, hold)

    def set_comment(self, job_id: str, text: str, field: str) -> ActionResult:
        """``POST job/{id}`` with ``{"admin_comment": ...}`` (or ``"comment"``): slurmrestd's
        job update; the admin comment needs the token's user to be an operator."""
        job_comment_check(field)
        job = self._job(job_id)
        current = job.admin_comment if field == "admin_comment" else job.comment
        body = {field: job_comment(current, text)}
        path = f"job/{quote(str(job_id), safe='')}"
        call = self._call_text("POST", self._path(path), body)
        if current == body[field]:
            return ActionResult(call, False, f"job {job_id} {field} already says it")
        self._call("POST", path, body)
        return ActionResult(call, True, f"job {job_id} {field}: {body[field]}",
                            {"field": field, "comment": body[field]})

    # --- the return-to-service gate ------------------------------------------------------------

    def _serves(self, method: str, path: str) -> bool:
        """Whether the server's OpenAPI document has ``method`` on ``/slurm/v0.0.N/path``."""
        return method.lower() in self._paths.get(self._path(path), set())

    def _me(self) -> str:
        """The user FleetWatch acts as: X-SLURM-USER-NAME, else the token's ``sun`` claim."""
        if self.user:
            return self.user
        try:
            claims = json.loads(base64.urlsafe_b64decode(
                (part := self.tokens.get().split(".")[1]) + "=" * (-len(part) % 4)))
        except (IndexError, ValueError):
            claims = {}
        user = claims.get("sun") if isinstance(claims, dict) else None
        if not isinstance(user, str) or not user:
            raise ClientError("cannot tell which Slurm user FleetWatch is (no "
                              "FLEETWATCH_SLURM_USER and the token names none): a reservation "
                              "for its check jobs needs it", permanent=True)
        return user

    def reservations(self) -> list[SlurmReservation]:
        answer = self._call("GET", "reservations/")
        found, warnings = parse_reservations(answer.payload)
        self.last_warnings = [w for w in [self._version_warning, *warnings] if w]
        return found

    def reserve(self, name: str, node: str) -> ActionResult:
        """``POST reservation`` (v0.0.43+, Slurm 25.05 on): the node alone, from now, without
        end, for FleetWatch's user, flags MAINT and IGNORE_JOBS (see SlurmCli.reserve).

        Slurm 24.05 and 24.11 (v0.0.41, v0.0.42) serve reservations read-only (GET and
        DELETE; found in 25.11's data_parser sources and its OpenAPI document): there the
        reservation is made with ``scontrol create reservation`` and the same JWT, as requeue
        is (FLEETWATCH_SLURM_BIN_DIR, FLEETWATCH_SLURM_CONF); without scontrol it is refused
        naming the version."""
        owned_reservation(name)
        user = self._me()
        self.version()
        body = {"name": name, "node_list": [node], "users": [user],
                "start_time": {"set": True, "infinite": False, "number": int(time.time())},
                "duration": {"set": False, "infinite": True, "number": 0},
                "flags": ["MAINT", "IGNORE_JOBS"]}
        rest = self._serves("post", "reservation")
        args = ["scontrol", "create", "reservation", f"ReservationName={name}", f"Nodes={node}",
                "StartTime=now", "Duration=UNLIMITED", f"Users={user}", "Flags=MAINT,IGNORE_JOBS"]
        call = self._call_text("POST", self._path("reservation"), body) if rest else shlex.join(args)
        held = reservation_held(self.reservations(), name, node, call)
        if held is not None:
            return held
        detail = f"reservation {name} holds {node} (only {user}'s jobs run there)"
        if rest:
            self._call("POST", "reservation", body)
            return ActionResult(call, True, detail)
        try:
            self._scontrol(args)
        except ClientError as exc:
            raise ClientError(f"slurmrestd v0.0.{self.version()} cannot create reservations "
                              "(POST reservation is served from v0.0.43, Slurm 25.05): "
                              f"{exc}", permanent=exc.permanent) from exc
        return ActionResult(call, True, detail + " (scontrol with the JWT: no REST endpoint "
                            f"for it in v0.0.{self.version()})")

    def unreserve(self, name: str) -> ActionResult:
        """``DELETE reservation/{name}`` (every version), after cancelling FleetWatch's check
        jobs still queued or running in it."""
        owned_reservation(name)
        path = f"reservation/{quote(name, safe='')}"
        call = self._call_text("DELETE", self._path(path))
        if not any(r.name == name for r in self.reservations()):
            return ActionResult(call, False, f"reservation {name} is gone already")
        cancelled = [j.job_id for j in check_jobs_of(self.jobs(), name)]
        for job_id in cancelled:
            self._call("DELETE", f"job/{quote(job_id, safe='')}")
        self._call("DELETE", path)
        return ActionResult(call, True, f"reservation {name} deleted" + (
            f"; check job(s) {', '.join(cancelled)} cancelled" if cancelled else ""),
            {"cancelled": cancelled} if cancelled else {})

    def submit_check(self, spec: CheckJobSpec) -> ActionResult:
        """``POST job/submit``: the script and a job description (the node alone, whole, in
        its reservation). Its environment is only what the script needs to start; FleetWatch's
        own never reaches slurmrestd."""
        job: dict[str, Any] = {
            "name": spec.name, "script": spec.script, "required_nodes": [spec.node],
            "minimum_nodes": 1, "maximum_nodes": 1, "reservation": spec.reservation,
            "time_limit": {"set": True, "infinite": False, "number": spec.minutes},
            "standard_output": spec.output, "current_working_directory": "/tmp",
            "environment": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "shared": ["none"], "requeue": False}
        if spec.partition:
            job["partition"] = spec.partition
        if spec.gpus:
            job["tres_per_node"] = f"gres/gpu:{spec.gpus}"
        body = {"job": job}
        call = self._call_text("POST", self._path("job/submit"),
                               {"job": {**job, "script": f"<{len(spec.script)} bytes>"}})
        for found in self.jobs():
            if found.name == spec.name:
                return ActionResult(call, False, f"check job {found.job_id} ({spec.name}) "
                                    "already submitted", {"job_id": found.job_id})
        answer = self._call("POST", "job/submit", body)
        job_id = answer.payload.get("job_id") if isinstance(answer.payload, Mapping) else None
        if not isinstance(job_id, int):
            raise ClientError(f"slurmrestd's job submit answer has no job_id: "
                              f"{str(answer.payload)[:200]}", permanent=True)
        return ActionResult(call, True, f"check job {job_id} submitted ({spec.name} on "
                            f"{spec.node})", {"job_id": str(job_id)})

    def check_job(self, job_id: str, output: str = "") -> CheckJob | None:
        try:
            answer = self._call("GET", f"job/{quote(str(job_id), safe='')}")
        except ClientError as exc:
            # An id slurmctld no longer holds (ended more than MinJobAge ago).
            if "invalid job id" in str(exc).lower() or "unable to query" in str(exc).lower():
                return None
            raise
        jobs, _ = parse_jobs(answer.payload)
        return check_job_from(next((j for j in jobs if j.job_id == str(job_id)), None), output)

    # --- the scontrol calls slurmrestd has no endpoint for --------------------------------------

    def _scontrol(self, args: list[str]) -> str:
        command = shlex.join(args)
        program = os.path.join(self.bin_dir, args[0]) if self.bin_dir else args[0]
        env = {**os.environ, "SLURM_JWT": self.tokens.get()}
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        try:
            proc = subprocess.run([program, *args[1:]], env=env, capture_output=True, text=True,
                                  timeout=self.timeout * 2, stdin=subprocess.DEVNULL)
        except FileNotFoundError as exc:
            raise ClientError(
                f"`{command}`: slurmrestd has no endpoint for this, and FleetWatch runs scontrol "
                f"for it with the same JWT, but {program} is not installed here: install the "
                "Slurm client (scontrol) and set FLEETWATCH_SLURM_BIN_DIR and "
                "FLEETWATCH_SLURM_CONF (a slurm.conf with AuthAltTypes=auth/jwt)",
                permanent=True) from exc
        except subprocess.TimeoutExpired as exc:
            raise ClientError(f"`{command}` timed out after {self.timeout * 2:g}s") from exc
        if proc.returncode != 0:
            message = proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}"
            raise ClientError(f"`{command}` (JWT auth) failed: {message}",
                              permanent=classify(message) is True)
        return proc.stdout
