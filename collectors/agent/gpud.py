"""The local gpud's events, forwarded as evidence (``FLEETWATCH_AGENT_GPUD_URL``; off unset).

gpud (leptonai/gpud) serves ``GET /v1/events?startTime=<RFC 3339>``: a list of
``{"component", "startTime", "endTime", "events": [{"component", "time", "name", "type",
"message"}]}`` (api/v1 GPUdComponentEvents), one entry per component such as
``accelerator-nvidia-error-xid``. Each event not sent before becomes one ``gpud`` record; the
diagnosis weighs it like any other source (incidents/diagnosis/parsers.parse_gpud_event).

gpud being down, slow or answering nonsense is logged and skipped: it is an outage of this
source, and says nothing about the node (no records, so nothing to blame it on). gpud serves
HTTPS with a self-signed certificate on localhost:15132 by default; the agent talks to it on
the node itself, so the certificate is not checked.
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

log = logging.getLogger(__name__)

# The first read looks this far back: gpud keeps days of events, and older ones are history
# the diagnosis window would not read anyway.
LOOKBACK = timedelta(minutes=10)
TIMEOUT_S = 5.0


def _https_unverified() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class GpudSource:
    """A Poller (collectors.agent.runner): new gpud events at each pass."""

    def __init__(self, node: str, url: str, *,
                 fetch: Callable[[str], Any] | None = None,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.node, self.url = node, url.rstrip("/")
        self.fetch = fetch or self._fetch
        self.now = now
        self.since: datetime | None = None
        self.sent: set[tuple[str, str, str, str]] = set()  # events at ``since`` already sent
        self.down = False

    def _fetch(self, url: str) -> Any:
        context = _https_unverified() if url.startswith("https:") else None
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            return json.load(response)

    def poll(self) -> list[dict[str, Any]]:
        since = self.since or self.now() - LOOKBACK
        url = f"{self.url}/v1/events?startTime={since.strftime('%Y-%m-%dT%H:%M:%SZ')}"
        try:
            body = self.fetch(url)
            if not isinstance(body, list):
                raise ValueError(f"expected a list of components, got {type(body).__name__}")
        except Exception as exc:  # any failure is the same outage of gpud
            if not self.down:
                log.warning("gpud at %s not read (%s): its events are missing until it answers; "
                            "this says nothing about the node", self.url, exc)
            self.down = True
            return []
        if self.down:
            log.info("gpud at %s answers again", self.url)
            self.down = False
        records = []
        newest = since
        for component in body:
            if not isinstance(component, dict):
                continue
            for event in component.get("events") or []:
                record = self._record(component, event)
                if record is None:
                    continue
                at, key, rec = record
                if at < since or (at == since and key in self.sent):
                    continue
                records.append(rec)
                if at > newest:
                    newest, self.sent = at, set()
                if at == newest:
                    self.sent.add(key)
        self.since = newest
        return records

    def _record(self, component: dict[str, Any], event: Any,
                ) -> tuple[datetime, tuple[str, str, str, str], dict[str, Any]] | None:
        if not isinstance(event, dict) or not isinstance(event.get("time"), str):
            return None
        try:
            at = datetime.fromisoformat(event["time"].replace("Z", "+00:00"))
        except ValueError:
            return None
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        at = at.astimezone(UTC).replace(microsecond=0)  # startTime has whole seconds
        name = str(event.get("component") or component.get("component") or "")
        fields = {"component": name, "name": str(event.get("name") or ""),
                  "type": str(event.get("type") or ""),
                  "message": str(event.get("message") or "")}
        key = (name, fields["name"], fields["type"], fields["message"])
        stamp = at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return at, key, {"at": stamp, "source": "gpud", "node": self.node, **fields}
