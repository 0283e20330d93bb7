"""GPU and NIC telemetry from Prometheus: dcgm-exporter and node_exporter series, read with PromQL.

``PrometheusTelemetry`` implements ``TelemetryClient`` with the maintained
``prometheus-api-client`` package. It is built for a fleet of 100,000 GPUs:

- One instant query per field (about fifteen in all), never one per GPU or node. Each query
  aggregates with ``max by (<identity labels>)``, so Prometheus returns a handful of labels per
  series instead of a dozen (the answer for 100,000 GPUs stays a few MB per field), and two
  jobs scraping one exporter (a ServiceMonitor and a PodMonitor, say) collapse into one GPU.
- GPUs are merged by (node, gpu index). The node is the ``Hostname`` label dcgm-exporter
  prints (``hostname`` in some versions and relabelled setups), else the host part of the
  ``instance`` label Prometheus adds, unless that is an IP address (Prometheus's default for
  a target not relabelled): no node name, so such series are skipped and counted in one
  warning rather than made into a node called 10.2.0.17. A GPU is reported when any of its
  fields is; a field with no series is ``None`` (or 0 for the XID, clock-reason and row-remap
  gauges, whose absence means nothing happened). A GPU with no data is never reported as failed by this client.
- Staleness: an instant query sees only series with a sample in the last 5 minutes (the
  server's ``--query.lookback-delta``), and none at all of a series that vanished from its
  target's page or whose target stopped answering (Prometheus writes staleness markers). A GPU
  that is gone, or a node whose exporter is down, therefore drops out of ``gpu_metrics()``
  within one scrape instead of being reported forever with its last values. A node with no
  series at all is not a failure to FleetWatch (the Slurm and Kubernetes collectors see a
  dead node); one GPU gone while its node's others report is one off the bus, and the
  collector marks it failed. ``lookback="10m"`` reads ``last_over_time(...[10m])`` instead,
  for exporters scraped less often than the lookback; the price is that a vanished GPU is still
  reported for that long.

Incremental polls (``changes(cursor, watch)``, what the collector calls): dcgm-exporter is
scraped every 15 s or so, scrape targets are spread over that interval, and FleetWatch polls
every 5 s, so at each poll only about a third of the GPUs have a new sample. Reading every GPU
every poll costs seconds at 100,000 GPUs (decoding the answer is most of it), so after the
first poll the client asks only for what is new:

- Utilisation and temperature: the samples newer than the last poll's reading time
  (``U and timestamp(U) > t``; ``timestamp()`` of a selector is the sample's own time),
  evaluated ``SCRAPE_LAG`` seconds in the past. A scrape's samples carry its start time but
  become visible only when it ends: reading up to a moment by which every scrape that started
  before it has ended, and from that moment on at the next poll, reads each sample once (one
  from a scrape slower than ``SCRAPE_LAG`` is read at the GPU's next scrape instead, 15 s
  later). A GPU without a new sample is
  not in the answer, or is listed in ``unsampled_*`` when another field brought it: its
  reading is as stored, not missing. Both queries carry the lean labels; the identity labels
  (UUID, model) come from a third query, only for the GPUs whose identity is new since the
  last poll (a new GPU, a swapped one, one back from silence).
- The fault fields are read whole every poll, as before: their queries are sparse already.
- A GPU that falls off the bus stops printing its series and Prometheus marks them stale: no
  new sample to read. The nodes that report fewer GPUs now than at the last poll's reading
  time (``count by`` node, compared with itself ``@`` then: an answer of a few series) have
  their GPUs listed (``present``), so the collector can name the silent one; so have the
  nodes the caller asks to ``watch`` (those with a fault to clear: a GPU left out of a sparse
  answer has quiet fields only if it still reports). A node with no series at all is never
  listed, and never read as failed.
- NIC ports: only the ports whose state is not ACTIVE, whose state or a counter changed in the
  last ``NIC_CHANGE_WINDOW`` seconds (``changes()``), or that appeared since the last poll
  (``unless ... @ t``), with all their fields in one query. A flap (DOWN, link_downed up,
  ACTIVE again) stays in the answer for the whole window, so each step of it is read. A poll
  more than ``NIC_CHANGE_WINDOW - NIC_CHANGE_SLACK`` seconds after the last reads every port.
- The cursor holds the reading time, on Prometheus's clock (the evaluation time its answers
  carry, never FleetWatch's), and which Prometheus it came from; no cursor, another
  Prometheus, or ``lookback`` set: every GPU and port is read, as ``gpu_metrics()`` and
  ``nic_ports()`` do.

A node's page (``gpu_readings(nodes, fields)``): the latest value of any dcgm-exporter
fields for a few nodes' GPUs (power, clocks, memory, PCIe link, ...), one instant query over
the three host-label spellings, nothing filtered or cached; a field with no series is absent,
never 0. Not part of any poll.

Fields not exported: dcgm-exporter's stock counters file leaves out several fields FleetWatch
relies on (``dcgm.RELIED_ON``). One ``count by (__name__)`` query over the DCGM metric names,
asked at most every ``FIELD_CHECK_INTERVAL`` seconds per Prometheus, names each missing one
in ``last_warnings`` (the collector run's warnings, on the Sources page) with what is lost;
the source stays usable. No DCGM series at all says nothing here (no exporter at all shows
as no GPUs).

Errors: Prometheus unreachable, a timeout or a 5xx answer raise ``ClientError`` (transient,
after ``urllib3`` retries with backoff); a query Prometheus rejects (400/422), a wrong URL
(404) or refused credentials (401/403) raise ``ClientError(permanent=True)``. A series with a
value or labels that cannot be read is skipped and described in ``last_warnings``; the rest is
kept.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import math
import operator
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, NamedTuple

import orjson
import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from collectors.clients.base import (
    ClientError,
    GpuFieldHistory,
    GpuHistory,
    GpuKey,
    GpuMetric,
    HistoryPoint,
    NicPort,
    TelemetryChanges,
)
from collectors.clients.exposition import (
    IB_STATE_IDS,
    IB_STATES,
)
from collectors.knowledge import dcgm
from collectors.knowledge.dcgm import (
    CLOCK_THROTTLE_REASONS,
    CLOCKS_EVENT_REASONS,
    FIRST_SLOWDOWN_BIT,
    NVLINK_ERROR_COUNTERS,
)

# Labels that name a GPU's node, most specific first. dcgm-exporter prints Hostname (the node's
# name, or NODE_NAME in Kubernetes); instance is the scrape target and the last resort.
NODE_LABELS = ("Hostname", "hostname")
GPU_GROUP = ("Hostname", "hostname", "instance", "gpu", "UUID", "uuid", "modelName")
GPU_LEAN_GROUP = ("Hostname", "hostname", "instance", "gpu")
NIC_GROUP = ("Hostname", "hostname", "instance", "device", "port")


@dataclass(frozen=True)
class _Query:
    attr: str  # the GpuMetric / NicPort field it fills
    names: tuple[str, ...]  # metric names (an exporter prints one of them)
    combine: str = "max"  # how the names add up: max (one of them exists) or sum (counters)
    # Only the labels that say which GPU (no UUID, no model): fewer bytes per series, for the
    # queries every GPU answers; another query brings the identity labels.
    lean: bool = False
    # A comparison that keeps only the series worth reading ("!= 0"): at 100,000 GPUs most
    # of them hold the quiet value, and a series not sent costs nothing to decode. A GPU
    # absent from such a query has the quiet value (0, or None for a running total).
    keep: str = ""


GPU_QUERIES = (
    _Query("last_xid", (dcgm.XID_ERRORS,), keep="!= 0"),
    # Every GPU, every poll: the dashboard's grid, and a GPU with neither has gone silent.
    _Query("utilization", (dcgm.GPU_UTIL,), lean=True),
    _Query("temperature", (dcgm.GPU_TEMP,)),
    # Renamed in DCGM 3.2; an older exporter prints the throttle name. Below 0x8 the bits are
    # idle, application clocks and the software power cap, none of which diagnosis reads.
    _Query("clock_event_reasons", (CLOCKS_EVENT_REASONS, CLOCK_THROTTLE_REASONS),
           keep=f">= {FIRST_SLOWDOWN_BIT}"),
    _Query("dbe_total", (dcgm.ECC_DBE_VOL_TOTAL,), keep="> 0"),
    _Query("row_remap_failure", (dcgm.ROW_REMAP_FAILURE,), keep="> 0"),
    _Query("uncorrectable_remapped_rows", (dcgm.UNCORRECTABLE_REMAPPED_ROWS,), keep="> 0"),
    _Query("nvlink_errors", NVLINK_ERROR_COUNTERS, "sum", keep="> 0"),
    _Query("pcie_replays", (dcgm.PCIE_REPLAY_COUNTER,), keep="> 0"),
)
NIC_QUERIES = (
    _Query("state", ("node_infiniband_state_id",)),
    _Query("link_downed", ("node_infiniband_link_downed_total",)),
    _Query("link_error_recovery", ("node_infiniband_link_error_recovery_total",)),
    _Query("symbol_error", ("node_infiniband_symbol_error_total",)),
)
NIC_FIELDS = {name: query.attr for query in NIC_QUERIES for name in query.names}
# The fault fields: a GPU with a sample that passes its query's ``keep`` has something to
# report (a remote write carrying one rings the collector's doorbell, services.py).
FAULT_QUERIES = {name: query for query in GPU_QUERIES if query.keep for name in query.names}
_KEEP = re.compile(r"(!=|>=|<=|==|>|<)\s*(\S+)")
_COMPARE = {"!=": operator.ne, ">=": operator.ge, "<=": operator.le, "==": operator.eq,
            ">": operator.gt, "<": operator.lt}
# Gauges whose missing series means "nothing to report" (GpuMetric has no None for them).
GPU_INT_FIELDS = ("last_xid", "clock_event_reasons", "row_remap_failure")

# DCGM's "no value" sentinels (DCGM_INT32_BLANK.., DCGM_INT64_BLANK.., DCGM_FP64_BLANK..).
# dcgm-exporter normally skips blank fields, but some versions print them as numbers
# (9.223372036854776e+18 for a memory temperature the GPU does not report).
DCGM_INT32_BLANK = 0x7FFFFFF0
DCGM_FP64_BLANK = 140737488355328.0

MAX_POINTS = 11_000  # Prometheus refuses a range query with more points per series
FIELD_HISTORY_NODES = 200  # nodes per range query of gpu_field_history
MAX_WARNINGS_PER_QUERY = 20

# Incremental polls (see the module docstring).
READING_NAMES = (dcgm.GPU_UTIL, dcgm.GPU_TEMP)
READING_FIELDS = ("utilization", "temperature")
NODE_GROUP = ("Hostname", "hostname", "instance")
# Seconds a scrape may take between its timestamp (its start) and its samples becoming
# visible: readings are evaluated this long before Prometheus's now. dcgm-exporter serves
# values it has already collected, so its scrapes take milliseconds.
SCRAPE_LAG = 2.0
# A port whose state or counters changed within this many seconds is read every poll: long
# enough to hold the sample before the change (node_exporter scraped every minute at worst)
# and any poll's lateness; a poll further than WINDOW - SLACK from the last reads every port.
NIC_CHANGE_WINDOW = 300.0
NIC_CHANGE_SLACK = 120.0
PRESENCE_NODES_PER_QUERY = 200  # nodes per regex when listing a node's GPUs (URL length)
# Requests in flight at once when an incremental poll sends its queries together: Prometheus
# evaluates up to 20 by default (--query.max-concurrency); a poll leaves it room for others.
QUERY_THREADS = 4
# The relied-on DCGM fields are checked at most this often (seconds): an exporter's counters
# file changes with a redeploy, not between two polls.
FIELD_CHECK_INTERVAL = 300.0
DCGM_NAME_PATTERN = "DCGM_FI_.+"
# Prometheus (url and matchers) -> (monotonic time of the check, its warnings).
_FIELD_CHECKS: dict[str, tuple[float, list[str]]] = {}


# GpuMetric's fields after node and gpu, with the values of a GPU no series mentions: no
# reading (None), and 0 for the gauges whose missing series means nothing happened.
_METRIC_DEFAULTS = ["", None, None, 0, *(f.default for f in dataclasses.fields(GpuMetric)[6:])]
_METRIC_SLOT = {f.name: i for i, f in enumerate(dataclasses.fields(GpuMetric))}
_UUID, _MODEL = _METRIC_SLOT["uuid"], _METRIC_SLOT["model"]


class _GpuRead(NamedTuple):
    gpus: list[GpuMetric]
    sampled: dict[str, set[GpuKey]]  # per reading field, the GPUs it was read for
    evaluated_at: float | None  # the earliest evaluation time of the reading queries


def fault_sample(labels: Mapping[str, str], value: float) -> tuple[str, str, str] | None:
    """(node, gpu, metric name) when a series' sample is a fault field's value a poll would
    read (it passes the field's ``keep``: an XID, a slowdown bit, a double-bit error...);
    None for anything else, and for a value DCGM marks blank."""
    query = FAULT_QUERIES.get(labels.get("__name__", ""))
    if query is None or _is_dcgm_blank(value):
        return None
    match = _KEEP.fullmatch(query.keep)
    if match is None or not _COMPARE[match.group(1)](value, float(match.group(2))):
        return None
    node = PrometheusTelemetry.node_of(labels)
    return (node, labels.get("gpu", ""), labels["__name__"]) if node else None


# A full read of node_exporter's ports (no Hostname label) asks this of each port's four
# series: 50,000 times for 12,500 hosts, each an ip_address() parse that fails.
@functools.lru_cache(maxsize=65536)
def node_from_instance(instance: str) -> str | None:
    """``gpu-003:9400`` -> ``gpu-003``; ``gpu-003.dc1.example.com:9400`` -> ``gpu-003`` (Slurm
    and Kubernetes use short names). An IP address (``10.1.2.3:9100``, ``[fd00::3]:9400``:
    what Prometheus puts in ``instance`` unless relabelled, node_exporter's series have no
    other host label) is no node name: None, so no phantom node is made of it."""
    host = instance.strip()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if not host:
        return None
    if not host[0].isdigit() and ":" not in host:
        # No IPv4 address starts with anything but a digit, no IPv6 one lacks a colon: a
        # host name, without ip_address()'s raise and catch (12,500 of them at a first poll).
        return host.split(".", 1)[0]
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        return host.split(".", 1)[0]


def _ip_instance(labels: object) -> bool:
    """Whether a series' only host label is an ``instance`` holding an IP address."""
    if not isinstance(labels, dict) or any(labels.get(k) for k in NODE_LABELS):
        return False
    instance = labels.get("instance")
    return isinstance(instance, str) and bool(instance.strip()) \
        and node_from_instance(instance) is None


def promql_string(value: str) -> str:
    """A PromQL double-quoted string literal."""
    return json.dumps(value)


def _node_matchers(nodes: Iterable[str]) -> list[str]:
    """Label matchers for the series of these nodes, one per label an exporter may name its
    node by (NODE_LABELS), then its instance (a host name with a domain or a port)."""
    node_re = "|".join(re.escape(n) for n in nodes)
    return [*(f"{label}=~{promql_string(node_re)}" for label in NODE_LABELS),
            f"instance=~{promql_string(f'({node_re})([.:].*)?')}"]


def _excerpt(series: object, limit: int = 300) -> str:
    text = json.dumps(series, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def _evaluated_at(result: Sequence[Any]) -> float | None:
    """The evaluation time Prometheus stamped on an instant query's answer (every sample of
    an instant vector carries it), or None for an empty or odd answer."""
    try:
        return float(result[0]["value"][0])
    except (IndexError, KeyError, TypeError, ValueError):
        return None


def _is_dcgm_blank(value: float) -> bool:
    return value >= DCGM_FP64_BLANK or DCGM_INT32_BLANK <= value <= 0x7FFFFFFF


class _Blank(NamedTuple):
    node: str
    labels: dict[str, str]


@dataclass
class _Warnings:
    """Warnings of one read, at most a few per query so a broken exporter cannot flood."""

    items: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    # Series skipped because their node is an IP:port instance: one warning for them all.
    ip_instances: int = 0

    def add(self, query: str, message: str) -> None:
        n = self.counts[query] = self.counts.get(query, 0) + 1
        if n <= MAX_WARNINGS_PER_QUERY:
            self.items.append(message)

    def finish(self) -> list[str]:
        for query, n in self.counts.items():
            if n > MAX_WARNINGS_PER_QUERY:
                self.items.append(f"{query}: {n - MAX_WARNINGS_PER_QUERY} more series skipped")
        if self.ip_instances:
            self.items.append(
                f"{self.ip_instances} series skipped: their instance label is an IP address "
                "and they carry no Hostname label, so their node is unknown (relabel them with "
                "the node's name: deploy/prometheus/relabel-node-name.yaml)")
        return self.items


class PrometheusTelemetry:
    """``TelemetryClient`` over a Prometheus that scrapes dcgm-exporter and node_exporter."""

    def __init__(
        self,
        url: str,
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
        verify_tls: bool | str = True,
        lookback: str | None = None,
        *,
        matchers: str = "",
        retries: int = 2,
        backoff: float = 0.5,
    ) -> None:
        """``verify_tls``: False, True, or a CA bundle path. ``matchers``: label matchers added
        to every selector, for a Prometheus that holds more than this fleet (``cluster="a"``
        or ``job="dcgm-exporter"``)."""
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.lookback = lookback
        self.matchers = matchers.strip().strip("{}").strip().rstrip(",")
        session = requests.Session()
        session.verify = verify_tls
        # Transient failures only: refused or reset connections and gateway errors. The last
        # answer is returned rather than raised (raise_on_status=False) so its body, which
        # says why, reaches the error message.
        retry = Retry(total=retries, connect=retries, read=1, status=retries,
                      backoff_factor=backoff, status_forcelist=(502, 503, 504),
                      allowed_methods=frozenset({"GET", "POST"}), raise_on_status=False)
        self._prom = PrometheusConnect(url=self.url, headers=headers, retry=retry,
                                       session=session, timeout=timeout)
        self._warnings: dict[str, list[str]] = {}
        # Answers being fetched ahead of the code that reads them (_sent_together), by
        # (expression, evaluation time).
        self._ahead: dict[tuple[str, float | None], Future[bytes]] = {}

    @property
    def last_warnings(self) -> list[str]:
        """What the latest gpu_metrics(), nic_ports(), gpu_history() and gpu_readings() calls
        skipped."""
        return [w for ws in self._warnings.values() for w in ws]

    def close(self) -> None:
        self._prom.close()

    # --- queries ---

    def _selector(self, names: Sequence[str], extra: str = "") -> str:
        matchers = [m for m in (self.matchers, extra) if m]
        if len(names) == 1:
            return f"{names[0]}{{{', '.join(matchers)}}}" if matchers else names[0]
        regex = "|".join(re.escape(n) for n in names)
        return "{" + ", ".join([f"__name__=~{promql_string(regex)}", *matchers]) + "}"

    def _instant_expr(self, query: _Query, group: Sequence[str],
                      nodes: Sequence[str] = ()) -> str:
        if nodes:
            # The node under whichever label the exporter uses, as in gpu_readings: `or`
            # drops a series an earlier alternative already matched.
            selectors = [self._selector(query.names, m) for m in _node_matchers(nodes)]
        else:
            selectors = [self._selector(query.names)]
        if self.lookback:
            selectors = [f"last_over_time({s}[{self.lookback}])" for s in selectors]
        selector = " or ".join(selectors)
        by = ", ".join(group)
        keep = f" {query.keep}" if query.keep else ""
        if query.combine == "sum" and len(query.names) > 1:
            # Each counter once per GPU (max over duplicate jobs), then the counters added.
            return f"sum by ({by}) (max by (__name__, {by}) ({selector})){keep}"
        return f"max by ({by}) ({selector}){keep}"

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """The library's and requests' exceptions as ClientError, transient or permanent."""
        try:
            yield
        except requests.exceptions.Timeout as exc:
            raise ClientError(f"Prometheus at {self.url} timed out after {self.timeout}s "
                              f"({what})") from exc
        except requests.exceptions.RetryError as exc:
            raise ClientError(f"Prometheus at {self.url} kept failing ({what}): {exc}") from exc
        except requests.exceptions.ConnectionError as exc:
            reason = _root_cause(exc)
            if "timed out" in reason:  # a read timeout, after its retry, arrives as this
                raise ClientError(f"Prometheus at {self.url} timed out after {self.timeout}s "
                                  f"({what}): {reason}") from exc
            raise ClientError(f"Prometheus at {self.url} unreachable ({what}): {reason}") from exc
        except requests.exceptions.RequestException as exc:
            raise ClientError(f"Prometheus request failed ({what}): {exc}") from exc
        except PrometheusApiClientException as exc:
            # The library keeps only "HTTP Status Code N (b'body')" of the response.
            match = re.search(r"HTTP Status Code (\d+)", str(exc))
            status = int(match.group(1)) if match else 0
            permanent = status in (400, 401, 403, 404, 405, 422)
            raise ClientError(f"Prometheus answered {status or '?'} to {what}: "
                              f"{str(exc)[:500]}", permanent=permanent) from exc
        except (ValueError, KeyError, TypeError) as exc:
            # A 200 that is not the query API's JSON: a proxy's login page, say.
            raise ClientError(f"Prometheus at {self.url} answered something unreadable "
                              f"({what}): {exc}") from exc

    def _query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, evaluated now or ``at`` (epoch seconds, Prometheus's clock): its
        answer fetched ahead (``_sent_together``) where it was, else asked now."""
        ahead = self._ahead.pop((expr, at), None)
        with self._errors(expr):
            body = ahead.result() if ahead is not None else self._instant_answer(expr, at)
            # orjson, not the json module requests would use: an answer for 100,000 GPUs is
            # megabytes, and decoding it was most of a poll that reads every GPU.
            result = orjson.loads(body)["data"]["result"]
        if not isinstance(result, list):
            raise ClientError(f"Prometheus answered a {type(result).__name__} to {expr}, "
                              "not an instant vector")
        return result

    def _instant_answer(self, expr: str, at: float | None) -> bytes:
        """The body of Prometheus's answer to an instant query: the request
        ``PrometheusConnect.custom_query`` sends (its session, retries and headers), which
        decodes the body with the json module itself."""
        params = {"query": expr, "timeout": f"{self.timeout:g}s"}
        if at is not None:
            params["time"] = f"{at:.3f}"
        prom = self._prom
        response = prom._session.request(
            method=prom._method, url=f"{self.url}/api/v1/query", params=params,
            verify=prom._session.verify, headers=prom.headers, auth=prom.auth,
            cert=prom._session.cert, timeout=self.timeout)
        if response.status_code != 200:
            # As the library raises it: _errors reads the status from this message.
            raise PrometheusApiClientException(
                f"HTTP Status Code {response.status_code} ({response.content!r})")
        return response.content

    @contextmanager
    def _sent_together(self, wanted: Iterable[tuple[str, float | None]]) -> Iterator[None]:
        """Send the instant queries ``wanted`` (expression, evaluation time) at once, a few
        requests at a time on the client's session, while the block reads and decodes their
        answers in its own order (``_query`` waits for each). An incremental poll asks a
        dozen queries that depend on none of each other's answers: one after the other, each
        a round trip and Prometheus's evaluation, they were a poll's whole time and the
        doorbell's wait between a fault scraped and its signal stored. A query the block does
        not ask is dropped; one it asks that is not here is sent then, as ever."""
        keys = list(dict.fromkeys(wanted))
        if len(keys) < 2:
            yield
            return
        pool = ThreadPoolExecutor(max_workers=min(len(keys), QUERY_THREADS),
                                  thread_name_prefix="prometheus-query")
        self._ahead = {key: pool.submit(self._instant_answer, *key) for key in keys}
        try:
            yield
        finally:
            self._ahead = {}
            # A read that failed (or the task's time limit) stops here: what has not started
            # never does, and what is in flight ends on its own timeout without holding the
            # poll up. The answers wait in memory until read: at most the poll's dozen.
            pool.shutdown(wait=False, cancel_futures=True)

    def _query_range(self, expr: str, start: datetime, end: datetime,
                     step: float) -> list[dict[str, Any]]:
        with self._errors(expr):
            result = self._prom.custom_query_range(
                expr, start_time=start, end_time=end, step=f"{step:g}s",
                params={"timeout": f"{self.timeout:g}s"}, timeout=self.timeout)
        if not isinstance(result, list):
            raise ClientError(f"Prometheus answered a {type(result).__name__} to {expr}, "
                              "not a range vector")
        return result

    # --- reading series ---

    @staticmethod
    def node_of(labels: Mapping[str, str]) -> str | None:
        """The node a series belongs to: its Hostname label, else its instance's host."""
        for name in NODE_LABELS:
            if labels.get(name):
                return labels[name]
        if labels.get("instance"):
            return node_from_instance(labels["instance"])
        return None

    def _field_warnings(self) -> list[str]:
        """One warning per relied-on DCGM field the exporter does not export (its stock
        counters file leaves several out), from one query for the DCGM metric names,
        re-asked at most every FIELD_CHECK_INTERVAL seconds (the client is built per run, so
        the answer is kept per Prometheus and matchers). No DCGM series at all: no exporter,
        which the empty readings already show; nothing said here."""
        key = f"{self.url} {self.matchers}"
        now = time.monotonic()
        cached = _FIELD_CHECKS.get(key)
        if cached is not None and now - cached[0] < FIELD_CHECK_INTERVAL:
            return cached[1]
        expr = self._exported_fields_expr()
        names = {s["metric"]["__name__"] for s in self._query(expr)
                 if isinstance(s, dict) and isinstance(s.get("metric"), dict)
                 and isinstance(s["metric"].get("__name__"), str)}
        warnings = ([dcgm.missing_field_warning(name) for name in dcgm.missing_fields(names)]
                    if names else [])
        _FIELD_CHECKS[key] = (now, warnings)
        return warnings

    def _exported_fields_expr(self) -> str:
        # One series per metric name: a few dozen in the answer, whatever the fleet's size.
        matchers = ", ".join(m for m in (f'__name__=~"{DCGM_NAME_PATTERN}"', self.matchers) if m)
        return f"count by (__name__) ({{{matchers}}})"

    def _samples(self, expr: str, series: Iterable[Any], warnings: _Warnings,
                 key_labels: Sequence[str], blanks: list[tuple[str, dict[str, str]]] | None = None
                 ) -> Iterator[tuple[str, dict[str, str], float]]:
        """(node, labels, value) of each readable series; the others become warnings.
        ``blanks``: where to put (node, labels) of the series holding DCGM's blank value
        (a sample that says "no value", which is news for a reading).

        Written for 100,000 series a query: the common case (a Hostname label or a host name
        in instance, the key
        labels, a finite number) takes one short path, and only the odd series go through
        the checks that say what is wrong with them."""
        blank_count = 0
        one = key_labels[0] if len(key_labels) == 1 else None  # the usual case: "gpu"
        for s in series:
            try:
                labels = s["metric"]
                node = labels.get("Hostname") or labels.get("hostname") \
                    or node_from_instance(labels.get("instance") or "")
                value = float(s["value"][1])
                if (node and (labels.get(one) if one is not None
                              else all(labels.get(k) for k in key_labels))
                        and value == value and value < DCGM_INT32_BLANK and value > -math.inf):
                    yield node, labels, value
                    continue
            except (KeyError, IndexError, TypeError, ValueError, AttributeError):
                pass
            checked = self._sample_checked(expr, s, warnings, key_labels)
            if isinstance(checked, _Blank):
                blank_count += 1  # no value: as if the exporter had skipped it
                if blanks is not None:
                    blanks.append((checked.node, checked.labels))
            elif checked is not None:
                yield checked
        if blank_count:
            warnings.add(expr, f"{expr}: {blank_count} DCGM blank value(s) read as missing")

    def _sample_checked(self, expr: str, s: Any, warnings: _Warnings, key_labels: Sequence[str]
                        ) -> tuple[str, dict[str, str], float] | _Blank | None:
        try:
            labels = s["metric"]
            raw = s["value"][1]
        except (KeyError, IndexError, TypeError):
            warnings.add(expr, f"{expr}: malformed series skipped: {_excerpt(s)}")
            return None
        node = self.node_of(labels) if isinstance(labels, dict) else None
        missing = [k for k in key_labels if not isinstance(labels, dict) or not labels.get(k)]
        if node is None and _ip_instance(labels):
            warnings.ip_instances += 1
            return None
        if node is None or missing:
            what = ", ".join(missing) if node else "Hostname, hostname or instance"
            warnings.add(expr, f"{expr}: series without {what} skipped: {_excerpt(s)}")
            return None
        try:
            value = float(raw)
        except (TypeError, ValueError):
            value = math.nan
        if math.isnan(value) or math.isinf(value):
            warnings.add(expr, f"{expr}: unreadable value {raw!r} skipped: {_excerpt(s)}")
            return None
        if _is_dcgm_blank(value):
            return _Blank(node, labels)
        return node, labels, value

    def gpu_metrics(self, nodes: Sequence[str] | None = None) -> list[GpuMetric]:
        self._warnings["fields"] = self._field_warnings()
        warnings = _Warnings()
        if nodes is None:
            gpus = self._gpu_read(None, warnings).gpus
        else:
            wanted, gpus = sorted(set(nodes)), []
            for start in range(0, len(wanted), PRESENCE_NODES_PER_QUERY):
                chunk = wanted[start:start + PRESENCE_NODES_PER_QUERY]
                # A series matched by its instance while its Hostname names another machine
                # is that machine's.
                gpus += [m for m in self._gpu_read(None, warnings, nodes=chunk).gpus
                         if m.node in chunk]
        self._warnings["gpu_metrics"] = warnings.finish()
        return gpus

    def _gpu_read(self, since: float | None, warnings: _Warnings,
                  at: float | None = None, nodes: Sequence[str] = ()) -> _GpuRead:
        """Every GPU with a series (``since`` None), or the GPUs with a utilisation or
        temperature sample newer than ``since`` and those with a fault field to report.
        ``at``: when to evaluate the readings (now if None); the fault fields are read now.
        ``nodes``: only the GPUs of these nodes (``since`` None only).

        A reading holding DCGM's blank value counts as read, with no value: a GPU whose
        utilisation and temperature are both blank is reported with neither (off the bus)."""
        # Each GPU gathered as GpuMetric's fields in order and made with one positional
        # call: at 100,000 GPUs, keyword calls and a dict per GPU cost most of a second.
        gpus: dict[GpuKey, list[Any]] = {}
        sampled: dict[str, set[GpuKey]] = {attr: set() for attr in READING_FIELDS}
        evaluated: list[float] = []
        for query, expr, when in self._gpu_plan(since, at, nodes):
            reading = query.attr in sampled
            result = self._query(expr, when)
            blanks: list[tuple[str, dict[str, str]]] | None = [] if reading else None
            seen = sampled.get(query.attr)
            if reading and (evaluated_at := _evaluated_at(result)) is not None:
                evaluated.append(evaluated_at)
            slot, as_int = _METRIC_SLOT[query.attr], query.attr in GPU_INT_FIELDS
            for node, labels, value in self._samples(expr, result, warnings, ("gpu",), blanks):
                gpu = self._gpu_entry(gpus, expr, node, labels, query.lean, warnings)
                if gpu is None:
                    continue
                if seen is not None:
                    seen.add((node, gpu[1]))
                if as_int:
                    gpu[slot] = int(value)
                elif gpu[slot] is not None:
                    # Two series for one GPU and field (two Hostname spellings, a GPU moved
                    # between pods): keep the larger, as max by would. (Each field has one
                    # query, and no value before it.)
                    gpu[slot] = max(gpu[slot], value)
                else:
                    gpu[slot] = value
            for node, labels in blanks or ():
                gpu = self._gpu_entry(gpus, expr, node, labels, query.lean, warnings)
                if gpu is not None and seen is not None:
                    seen.add((node, gpu[1]))
        if since is not None:
            expr = self._new_identity_expr(since)
            for node, labels, _ in self._samples(expr, self._query(expr), warnings, ("gpu",)):
                self._gpu_entry(gpus, expr, node, labels, False, warnings)
        metrics = [GpuMetric(*g) for g in gpus.values()]
        return _GpuRead(metrics, sampled, min(evaluated) if evaluated else None)

    def _gpu_plan(self, since: float | None, at: float | None,
                  nodes: Sequence[str] = ()) -> list[tuple[_Query, str, float | None]]:
        """``_gpu_read``'s queries in its order: each with its expression and evaluation time
        (the readings ``at``, the fault fields now)."""
        plan: list[tuple[_Query, str, float | None]] = []
        for query in GPU_QUERIES:
            reading = query.attr in READING_FIELDS
            if reading and since is not None:
                # Lean labels: the identity labels of the GPUs that have new ones come after.
                query = replace(query, lean=True)
                expr = self._new_samples_expr(query, GPU_LEAN_GROUP, since)
            else:
                expr = self._instant_expr(query, GPU_LEAN_GROUP if query.lean else GPU_GROUP,
                                          nodes)
            plan.append((query, expr, at if reading else None))
        return plan

    @staticmethod
    def _gpu_entry(gpus: dict[GpuKey, list[Any]], expr: str, node: str,
                   labels: dict[str, str], lean: bool, warnings: _Warnings
                   ) -> list[Any] | None:
        """The GPU a series belongs to (created on first sight, as GpuMetric's fields in
        order), or None if its gpu label is not an index."""
        try:
            index = int(labels["gpu"])
        except ValueError:
            warnings.add(expr, f"{expr}: gpu label {labels['gpu']!r} is not an index: "
                               f"{_excerpt(labels)}")
            return None
        gpu = gpus.get((node, index))
        if gpu is None:
            gpu = gpus[(node, index)] = [node, index, *_METRIC_DEFAULTS]
        if not lean and not gpu[_UUID]:
            gpu[_UUID] = labels.get("UUID") or labels.get("uuid") or ""
            gpu[_MODEL] = gpu[_MODEL] or labels.get("modelName", "")
        return gpu

    def _new_samples_expr(self, query: _Query, group: Sequence[str], since: float) -> str:
        """The GPUs whose field has a sample newer than ``since`` (epoch seconds):
        ``timestamp()`` of a selector is each sample's own time, not the evaluation's."""
        selector = self._selector(query.names)
        return f"max by ({', '.join(group)}) ({selector} and timestamp({selector}) > {since:.3f})"

    def _new_identity_expr(self, since: float) -> str:
        """The GPUs whose identity labels (UUID, model) have no series at ``since``."""
        selector = self._selector(READING_NAMES)
        by = ", ".join(GPU_GROUP)
        return f"max by ({by}) ({selector}) unless max by ({by}) ({selector} @ {since:.3f})"

    def _dropped_expr(self, since: float) -> str:
        # Each GPU once (max by drops duplicate jobs), whichever of the two fields it prints.
        gpus = f"max by ({', '.join(GPU_LEAN_GROUP)})"
        count = f"count by ({', '.join(NODE_GROUP)})"
        selector = self._selector(READING_NAMES)
        return f"{count} ({gpus} ({selector})) < {count} ({gpus} ({selector} @ {since:.3f}))"

    def _dropped(self, since: float, warnings: _Warnings) -> set[str]:
        """The nodes with fewer GPUs reporting (a utilisation or temperature series) now than
        at ``since``; a node with none now is not among them."""
        expr = self._dropped_expr(since)
        return {node for node, _, _ in self._samples(expr, self._query(expr), warnings, ())}

    def _now(self) -> float | None:
        """Prometheus's clock: the evaluation time it stamps on an answer."""
        return _evaluated_at(self._query("vector(time())"))

    def _present_expr(self, nodes: Sequence[str]) -> str:
        # The node under whichever label the exporter uses; `or` drops a GPU an earlier
        # alternative already matched.
        lean = ", ".join(GPU_LEAN_GROUP)
        return " or ".join(f"group by ({lean}) ({self._selector(READING_NAMES, m)})"
                           for m in _node_matchers(nodes))

    def _present(self, nodes: Sequence[str], warnings: _Warnings) -> dict[str, set[int]]:
        """The GPU indexes of these nodes that have a utilisation or temperature series."""
        present: dict[str, set[int]] = {n: set() for n in nodes}
        for start in range(0, len(nodes), PRESENCE_NODES_PER_QUERY):
            expr = self._present_expr(nodes[start:start + PRESENCE_NODES_PER_QUERY])
            for node, labels, _ in self._samples(expr, self._query(expr), warnings, ("gpu",)):
                try:
                    index = int(labels["gpu"])
                except ValueError:
                    continue
                if node in present:
                    present[node].add(index)
        return present

    def nic_ports(self) -> list[NicPort]:
        warnings = _Warnings()
        values: dict[tuple[str, str, int], dict[str, int]] = {}
        for query in NIC_QUERIES:
            expr = self._instant_expr(query, NIC_GROUP)
            self._port_values(expr, self._query(expr), warnings, values, query.attr)
        ports = self._ports(values, warnings)
        self._warnings["nic_ports"] = warnings.finish()
        return ports

    def _nic_changes_expr(self, since: float) -> str:
        """Every field of the ports worth reading: not ACTIVE, a state or counter that changed
        within NIC_CHANGE_WINDOW, or a port that had no series at ``since``."""
        by = ", ".join(NIC_GROUP)
        names = [name for query in NIC_QUERIES for name in query.names]
        state = self._selector(("node_infiniband_state_id",))
        window = f"{NIC_CHANGE_WINDOW:g}s"
        worth = [f"max by ({by}) (changes({self._selector((name,))}[{window}])) > 0"
                 for name in names]
        worth.append(f"max by ({by}) ({state}) != {IB_STATE_IDS['ACTIVE']}")
        worth.append(f"(max by ({by}) ({state}) unless max by ({by}) ({state} @ {since:.3f}))")
        return (f"max by (__name__, {by}) ({self._selector(names)}) "
                f"and on ({by}) ({' or '.join(worth)})")

    def _nic_changes(self, since: float) -> list[NicPort]:
        warnings = _Warnings()
        values: dict[tuple[str, str, int], dict[str, int]] = {}
        expr = self._nic_changes_expr(since)
        self._port_values(expr, self._query(expr), warnings, values, None)
        ports = self._ports(values, warnings)
        self._warnings["nic_ports"] = warnings.finish()
        return ports

    def _port_values(self, expr: str, result: list[dict[str, Any]], warnings: _Warnings,
                     values: dict[tuple[str, str, int], dict[str, int]],
                     attr: str | None) -> None:
        """Add each series' value to its port: the field ``attr``, or (None) the field its
        metric name says."""
        for node, labels, value in self._samples(expr, result, warnings, ("device", "port")):
            try:
                port = int(labels["port"])
            except ValueError:
                warnings.add(expr, f"{expr}: port label {labels['port']!r} is not a number")
                continue
            field_name = attr or NIC_FIELDS.get(labels.get("__name__", ""))
            if field_name is None:
                continue
            values.setdefault((node, labels["device"], port), {})[field_name] = int(value)

    @staticmethod
    def _ports(values: dict[tuple[str, str, int], dict[str, int]],
               warnings: _Warnings) -> list[NicPort]:
        result = []
        for (node, device, port), p in sorted(values.items()):
            if "state" not in p:
                # Counters without a state: never guess a port down.
                warnings.add("node_infiniband_state_id",
                             f"{node} {device} port {port}: no node_infiniband_state_id; skipped")
                continue
            result.append(NicPort(
                node=node, device=device, port=port,
                state=IB_STATES.get(p["state"], f"STATE_{p['state']}"),
                link_downed=p.get("link_downed", 0),
                link_error_recovery=p.get("link_error_recovery", 0),
                symbol_error=p.get("symbol_error", 0)))
        return result

    def changes(self, cursor: Mapping[str, Any] | None,
                watch: Iterable[str] = ()) -> TelemetryChanges:
        """What changed since the poll that returned ``cursor`` (see the module docstring).
        ``watch``: nodes whose GPUs to list in ``present`` on an incremental poll."""
        source = f"{self.url} {self.matchers}".strip()
        self._warnings["fields"] = self._field_warnings()
        since: float | None = None
        if cursor and cursor.get("source") == source and not self.lookback:
            try:
                since = float(cursor["at"])
            except (KeyError, TypeError, ValueError):
                since = None
        if since is not None:
            now = self._now()
            # A Prometheus whose clock went back (or another one behind the same URL): the
            # cursor means nothing there; read everything.
            if now is None or now - SCRAPE_LAG >= since:
                return self._changes_since(since, now, watch, source)
        warnings = _Warnings()
        read = self._gpu_read(None, warnings)
        self._warnings["gpu_metrics"] = warnings.finish()
        ports = self.nic_ports()
        at = read.evaluated_at
        # Read now, so the samples of scrapes still running are read at the next poll.
        return TelemetryChanges(read.gpus, ports, {} if at is None or self.lookback
                                else {"at": at - SCRAPE_LAG, "source": source})

    def _changes_since(self, since: float, now: float | None, watch: Iterable[str],
                       source: str) -> TelemetryChanges:
        warnings = _Warnings()
        # No answer to say what time it is (an odd Prometheus): read up to now, and keep
        # the cursor where it was.
        at = None if now is None else now - SCRAPE_LAG
        # The NIC window must reach back past the last poll and the sample before it.
        complete_ports = now is None or now - since > NIC_CHANGE_WINDOW - NIC_CHANGE_SLACK
        nic_exprs = ([self._instant_expr(q, NIC_GROUP) for q in NIC_QUERIES] if complete_ports
                     else [self._nic_changes_expr(since)])
        # Every query but the presence one (it names the nodes the dropped one finds).
        with self._sent_together([
                *((expr, when) for _, expr, when in self._gpu_plan(since, at)),
                (self._new_identity_expr(since), None), (self._dropped_expr(since), None),
                *((expr, None) for expr in nic_exprs)]):
            read = self._gpu_read(since, warnings, at)
            listed = sorted(self._dropped(since, warnings) | set(watch))
            present = self._present(listed, warnings) if listed else {}
            self._warnings["gpu_metrics"] = warnings.finish()
            ports = self.nic_ports() if complete_ports else self._nic_changes(since)
        keys = {(m.node, m.gpu) for m in read.gpus}
        return TelemetryChanges(
            read.gpus, ports, {"at": since if at is None else at, "source": source},
            complete_gpus=False, complete_ports=complete_ports,
            unsampled_utilization=keys - read.sampled["utilization"],
            unsampled_temperature=keys - read.sampled["temperature"],
            present={node: gpus for node, gpus in present.items() if gpus})

    def gpu_history(self, nodes: Sequence[str], start: datetime, end: datetime,
                    step_seconds: float = 15.0) -> GpuHistory:
        """Utilisation and temperature of the nodes' GPUs from ``start`` to ``end``, for
        charts: ``{node: {gpu: [HistoryPoint(at, utilization, temperature), ...]}}``.

        Two range queries in all. A point where one field has no sample carries None for it;
        a GPU with no samples in the range is absent."""
        if not nodes:
            return {}
        if end <= start:
            raise ClientError(f"empty time range {start} .. {end}", permanent=True)
        span = (end - start).total_seconds()
        step = max(float(step_seconds), math.ceil(span / MAX_POINTS), 1.0)
        wanted = set(nodes)
        matchers = _node_matchers(sorted(wanted))
        warnings = _Warnings()
        points: dict[tuple[str, int], dict[float, list[float | None]]] = {}
        for slot, name in enumerate((dcgm.GPU_UTIL, dcgm.GPU_TEMP)):
            expr = self._nodes_expr(name, matchers)
            for s in self._query_range(expr, start, end, step):
                labels = s.get("metric", {}) if isinstance(s, dict) else {}
                node = self.node_of(labels)
                try:
                    index = int(labels["gpu"])
                    values = s["values"]
                except (KeyError, ValueError, TypeError):
                    warnings.add(expr, f"{expr}: series skipped: {_excerpt(s)}")
                    continue
                if node not in wanted:
                    continue
                series = points.setdefault((node, index), {})
                for at, raw in values:
                    try:
                        value: float | None = float(raw)
                    except (TypeError, ValueError):
                        value = None
                    if value is not None and (math.isnan(value) or _is_dcgm_blank(value)):
                        value = None
                    series.setdefault(float(at), [None, None])[slot] = value
        self._warnings["gpu_history"] = warnings.finish()
        history: GpuHistory = {}
        for (node, index), series in sorted(points.items()):
            history.setdefault(node, {})[index] = [
                HistoryPoint(at, util, temp) for at, (util, temp) in sorted(series.items())]
        return history

    def _readings_expr(self, nodes: Sequence[str], fields: Sequence[str]) -> str:
        # The node under whichever label the exporter uses, as in gpu_history. `or` matches
        # series on their labels less the metric name, so each alternative holds every field
        # and drops only the series an earlier one already has (the same series: a Hostname
        # series also matched by its instance).
        alternatives = []
        for matcher in _node_matchers(nodes):
            selector = self._selector(fields, matcher)
            alternatives.append(f"last_over_time({selector}[{self.lookback}])"
                                if self.lookback else selector)
        # max by: two jobs scraping one exporter are one GPU, with a handful of labels each.
        return f"max by (__name__, {', '.join(GPU_LEAN_GROUP)}) ({' or '.join(alternatives)})"

    def gpu_readings(self, nodes: Sequence[str],
                     fields: Sequence[str]) -> dict[tuple[str, int], dict[str, float]]:
        """The latest value of each of ``fields`` (dcgm-exporter metric names) for the nodes'
        GPUs, ``{(node, gpu): {field: value}}``: one instant query (per
        PRESENCE_NODES_PER_QUERY nodes). A field with no series, a stale one (the exporter
        stopped printing it: a GPU off the bus) or one holding DCGM's blank value is absent
        for that GPU, never 0; a GPU with none of them is absent. For a node's page, not for
        polls: nothing is cached, nothing filtered."""
        wanted_fields = sorted(set(fields))
        wanted_nodes = sorted(set(nodes))
        readings: dict[tuple[str, int], dict[str, float]] = {}
        if not wanted_fields or not wanted_nodes:
            return readings
        asked, warnings = set(wanted_fields), _Warnings()
        for start in range(0, len(wanted_nodes), PRESENCE_NODES_PER_QUERY):
            chunk = set(wanted_nodes[start:start + PRESENCE_NODES_PER_QUERY])
            expr = self._readings_expr(sorted(chunk), wanted_fields)
            for node, labels, value in self._samples(expr, self._query(expr), warnings,
                                                     ("gpu", "__name__")):
                name = labels["__name__"]
                if node not in chunk or name not in asked:
                    # Matched by its instance while its Hostname names another machine.
                    continue
                try:
                    index = int(labels["gpu"])
                except ValueError:
                    warnings.add(expr, f"{expr}: gpu label {labels['gpu']!r} is not an index: "
                                       f"{_excerpt(labels)}")
                    continue
                gpu = readings.setdefault((node, index), {})
                # Two series for one GPU and field (two Hostname spellings): the larger, as
                # max by would.
                gpu[name] = max(value, gpu.get(name, value))
        self._warnings["gpu_readings"] = warnings.finish()
        return readings


    def _nodes_expr(self, name: str, matchers: Sequence[str]) -> str:
        """One field of the nodes ``matchers`` (``_node_matchers``) select, a series per GPU.
        The node under whichever label the exporter uses; `or` drops a series the earlier
        selectors already matched (same labels), so no GPU is counted twice."""
        alternatives = [self._selector([name], m) for m in matchers]
        return f"max by (Hostname, hostname, instance, gpu) ({' or '.join(alternatives)})"

    def gpu_field_history(self, nodes: Sequence[str], fields: Sequence[str], start: datetime,
                          end: datetime, step_seconds: float) -> GpuFieldHistory:
        """The fields of the nodes' GPUs from ``start`` to ``end``: one range query per field
        and group of FIELD_HISTORY_NODES nodes (a job of a thousand nodes is a few queries, not
        a regular expression of a thousand names). Values as the exporter gives them (a
        counter is its running total); DCGM's blank values and unreadable points are left
        out, and a series without a GPU index or node is a warning."""
        if not nodes or not fields:
            return {}
        if end <= start:
            raise ClientError(f"empty time range {start} .. {end}", permanent=True)
        span = (end - start).total_seconds()
        step = max(float(step_seconds), math.ceil(span / MAX_POINTS), 1.0)
        wanted = sorted(set(nodes))
        warnings = _Warnings()
        history: GpuFieldHistory = {}
        for i in range(0, len(wanted), FIELD_HISTORY_NODES):
            group = set(wanted[i:i + FIELD_HISTORY_NODES])
            matchers = _node_matchers(sorted(group))
            for name in dict.fromkeys(fields):
                expr = self._nodes_expr(name, matchers)
                for s in self._query_range(expr, start, end, step):
                    labels = s.get("metric", {}) if isinstance(s, dict) else {}
                    node = self.node_of(labels)
                    try:
                        index = int(labels["gpu"])
                        values = s["values"]
                    except (KeyError, ValueError, TypeError):
                        warnings.add(expr, f"{expr}: series skipped: {_excerpt(s)}")
                        continue
                    if node not in group:
                        continue
                    points = history.setdefault((node, index), {}).setdefault(name, [])
                    for at, raw in values:
                        try:
                            value = float(raw)
                        except (TypeError, ValueError):
                            continue
                        if math.isnan(value) or math.isinf(value) or _is_dcgm_blank(value):
                            continue
                        points.append((float(at), value))
        self._warnings["gpu_field_history"] = warnings.finish()
        for series in history.values():
            for points in series.values():
                points.sort()
        return {k: {f: p for f, p in v.items() if p} for k, v in sorted(history.items())
                if any(v.values())}


def _root_cause(exc: requests.exceptions.ConnectionError) -> str:
    """"Failed to establish a new connection: [Errno 111] Connection refused", not the layers
    of urllib3 wrapping around it."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return str(reason or exc)
