"""Sending to FleetWatch: batches over HTTP(S) with the node's token and an idempotency key,
and the version check against the server's API."""

from __future__ import annotations

from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from collectors.agent import __version__
from collectors.knowledge import agent as proto


class Pusher:
    """Sends batches to FleetWatch's ``POST /api/v1/signals/`` with the node's token."""

    def __init__(self, url: str, token: str, *, timeout: float = 5.0,
                 session: requests.Session | None = None, verify: str | bool = True,
                 cluster: str = "") -> None:
        self.base = url.rstrip("/")
        # The node's cluster where one FleetWatch watches several ("" : its default). A
        # server from before clusters ignores the field.
        self.cluster = cluster
        self.url = self.base + "/api/v1/signals/"
        self.timeout = timeout
        self.session = session or requests.Session()
        # Retries for the blips (a restart behind a load balancer); a longer outage is the
        # spool's job, so keep them short. Safe to repeat: every push carries its batch's key.
        # The last answer comes back (not an exception), so push() can tell a gateway's 502
        # or 504, which may be this batch's doing, from an unreachable server.
        # Retry-After is not obeyed here: a proxy's "retry in an hour" would hold the agent
        # (and its stop on SIGTERM) that long; the spool already waits between sends.
        retry = Retry(total=2, backoff_factor=0.5, status_forcelist=(502, 503, 504),
                      allowed_methods=frozenset({"POST"}), raise_on_status=False,
                      respect_retry_after_header=False)
        self.session.mount("http://", HTTPAdapter(max_retries=retry))
        self.session.mount("https://", HTTPAdapter(max_retries=retry))
        self.session.headers["Authorization"] = f"Token {token}"
        self.session.headers[proto.AGENT_HEADER] = proto.agent_header(__version__)
        self.session.headers["User-Agent"] = f"fleetwatch-agent/{__version__}"
        self.session.verify = verify

    def check_version(self) -> str:
        """Ask FleetWatch which agent protocols it takes (``GET /api/v1/agent/``). Returns a
        line for the log; raises ``VersionMismatch`` when this agent's is not among them, and
        ``PushFailed`` when FleetWatch cannot be asked now (the agent spools meanwhile)."""
        try:
            response = self.session.get(self.base + "/api/v1/agent/", timeout=self.timeout)
        except requests.RequestException as exc:
            raise PushFailed(f"FleetWatch unreachable: {exc}", retry=True) from exc
        if response.status_code == 404:
            # A FleetWatch older than this agent, a wrong URL, or an ingress mid-deploy: not
            # a certain mismatch, so asked again later (the signals are spooled meanwhile).
            raise PushFailed(
                f"{self.base}/api/v1/agent/ answered 404: the URL is not FleetWatch's, or "
                f"FleetWatch is older than this agent ({__version__}, protocol "
                f"{proto.PROTOCOL}) and must be upgraded first", retry=True, status=404)
        if response.status_code != 200:
            raise PushFailed(f"FleetWatch answered {response.status_code} to the version check: "
                             f"{response.text[:300]}", retry=True, status=response.status_code)
        try:
            info = response.json()
            oldest, newest = int(info["protocols"]["oldest"]), int(info["protocols"]["newest"])
        except (ValueError, KeyError, TypeError) as exc:
            raise PushFailed(f"unreadable version answer from FleetWatch: {exc}",
                             retry=True) from exc
        server = info.get("version", "?")
        if oldest > proto.PROTOCOL:
            raise VersionMismatch(
                f"this agent ({__version__}, protocol {proto.PROTOCOL}) is too old for FleetWatch "
                f"{server} at {self.base} (protocols {oldest} to {newest}): install the agent "
                "built from FleetWatch's own release")
        if newest < proto.PROTOCOL:
            raise VersionMismatch(
                f"this agent ({__version__}, protocol {proto.PROTOCOL}) is newer than FleetWatch "
                f"{server} at {self.base} (protocols {oldest} to {newest}): upgrade FleetWatch "
                "first, or install the agent built from its release")
        return (f"FleetWatch {server} at {self.base} takes agent protocols {oldest} to {newest}; "
                f"this agent {__version__} speaks {proto.PROTOCOL}")

    def push(self, signals: list[dict[str, Any]], key: str | None = None) -> None:
        """Raises ``PushFailed`` unless FleetWatch stored the whole batch (now, or earlier
        under the same ``key``: a retry whose first answer was lost)."""
        headers = {"Idempotency-Key": key} if key else {}
        try:
            body: dict[str, Any] = {"signals": signals}
            if self.cluster:
                body["cluster"] = self.cluster
            response = self.session.post(self.url, json=body, headers=headers,
                                         timeout=self.timeout)
        except requests.RequestException as exc:
            raise PushFailed(f"FleetWatch unreachable: {exc}", retry=True) from exc
        code = response.status_code
        if code == 201:
            return
        message = f"FleetWatch answered {code}: {response.text[:300]}"
        if code == 426:
            # FleetWatch does not take this agent's protocol: every batch would be refused
            # alike, so none is set aside; they wait for an upgrade of one side.
            raise VersionMismatch(message)
        if code in (401, 404, 408, 429, 503):
            # A token being rotated, a proxy mid-deploy, "later, please": not this batch's
            # fault, so no try is counted and the spool waits as long as it takes.
            raise PushFailed(message, retry=True, status=code)
        # Any other server error may be this very batch (a record the server trips on): tried
        # again a few times, then set aside. 400/403/413/422: refused, set aside at once.
        raise PushFailed(message, retry=code >= 500, bounded=True, status=code)


class PushFailed(Exception):
    """``retry``: worth sending again; ``bounded``: only a few times (the answer may be about
    this batch), else for as long as it takes (FleetWatch is away). ``status``: FleetWatch's
    HTTP answer, if there was one."""

    def __init__(self, message: str, *, retry: bool, bounded: bool = False,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.retry = retry
        self.bounded = bounded
        self.status = status


class VersionMismatch(PushFailed):
    """FleetWatch does not take this agent's protocol (the message says which to upgrade)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry=True, status=426)
