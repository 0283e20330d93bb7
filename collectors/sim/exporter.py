"""A dcgm-exporter and node_exporter stand-in for the simulated fleet, served over HTTP.

A real Prometheus scrapes it, so an XID injected into the simulation reaches FleetWatch the way
it does in production: exporter text, a scrape, the TSDB, a PromQL query. Each scrape reads the
fleet afresh through ``SimTelemetry`` (one locked read of the shared state file).

Pages:

- ``/metrics``: every in-service node. In production each node runs its own exporters and
  Prometheus labels each target's series with ``instance``; one page standing in for all of
  them labels each series ``instance="<node>:9400"`` (GPUs) or ``"<node>:9100"`` (NIC ports)
  itself, so scrape it with ``honor_labels: true`` and the TSDB holds what it would hold in
  production. dcgm-exporter's own ``Hostname`` label is there as well.
- ``/nodes/<name>/metrics``: one node's page exactly as its exporters print it (no
  ``instance``: give each such target its own ``instance`` label in the scrape config).
  ``SimExporter(..., node=name)`` serves that page as ``/metrics`` on its own port.

Run it: ``python -m collectors.sim.exporter --state PATH [--speed 20] --port 9400``.
``--counters PATH`` exports only the fields a dcgm-exporter counters file lists
(deploy/dcgm-exporter/counters.csv, say); ``--counters default`` only those of dcgm-exporter's
stock default set, which leaves out several fields FleetWatch relies on.
It needs no Django settings (the simulator imports none).
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import threading
from collections.abc import Collection, Mapping
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from collectors.clients.base import ClientError, GpuMetric
from collectors.clients.exposition import (
    render_dcgm,
    render_node_infiniband,
)
from collectors.knowledge import dcgm
from collectors.knowledge.dcgm import CLOCK_THROTTLE_REASONS, CLOCKS_EVENT_REASONS, GPU_IDLE
from collectors.sim.fleet import SimFleet, SimTelemetry

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DCGM_PORT = 9400  # dcgm-exporter's default port, used in the instance labels
NODE_EXPORTER_PORT = 9100
NODE_PATH = re.compile(r"^/nodes/(?P<node>[A-Za-z0-9._-]+)/metrics/?$")


def counters_set(spec: str) -> frozenset[str]:
    """The DCGM fields an exporter exports: ``default`` (dcgm-exporter's stock
    default-counters.csv) or the path of a counters file. A file that cannot be read or
    parsed raises ValueError naming it."""
    if spec == "default":
        return frozenset(dcgm.EXPORTER_DEFAULT_FIELDS)
    try:
        return frozenset(dcgm.counters_csv_fields(Path(spec).read_text()))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"counters file {spec}: {exc}") from exc


def _realistic(metric: GpuMetric, reading: Mapping[str, float] | None = None) -> GpuMetric:
    """Fill in the fields the simulation leaves empty with what a healthy H100 reports, so
    the page has every field FleetWatch reads; ``reading``: the GPU's
    ``SimTelemetry.gpu_readings`` (its power, so the node page and the exporter agree). A GPU
    without utilisation has fallen off the bus: DCGM reports it blank, and so does this (only
    its last XID stays)."""
    if metric.utilization is None:
        return metric
    power = (reading or {}).get(dcgm.POWER_USAGE)
    # Seeded per GPU and whole percent of load, so a page is stable between two scrapes of
    # an idle fleet yet moves with the load.
    rng = random.Random(f"{metric.uuid}/{int(metric.utilization)}")
    temp = metric.temperature if metric.temperature is not None else 35.0
    return replace(
        metric,
        power_w=metric.power_w if metric.power_w is not None else power if power is not None
        else round(70 + 6.3 * metric.utilization + rng.uniform(-5, 5), 3),
        memory_temperature=metric.memory_temperature if metric.memory_temperature is not None
        else round(temp + 4 + rng.uniform(0, 2)),
        dbe_total=metric.dbe_total if metric.dbe_total is not None else 0,
        nvlink_errors=metric.nvlink_errors if metric.nvlink_errors is not None else 0,
        pcie_replays=metric.pcie_replays if metric.pcie_replays is not None else 0,
        uncorrectable_remapped_rows=metric.uncorrectable_remapped_rows
        if metric.uncorrectable_remapped_rows is not None else 0,
        clock_event_reasons=metric.clock_event_reasons
        | (GPU_IDLE if metric.utilization == 0 else 0),  # idle clocks run down, and say why
    )


class SimExporter:
    """The exporter in a background thread: ``port = SimExporter(path).start()``, ``.stop()``."""

    def __init__(
        self,
        state_path: Path | str,
        speed: float = 20.0,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        hostname_label: str | None = "Hostname",
        clock_field: str = CLOCKS_EVENT_REASONS,
        kubernetes: bool = False,
        node: str | None = None,
        instance_labels: bool = True,
        counters: Collection[str] | None = None,
    ) -> None:
        """``counters``: the DCGM fields to export (see ``counters_set``); None: all."""
        self.fleet = SimFleet(Path(state_path), speed)
        self.telemetry = SimTelemetry(self.fleet)
        self.host, self.port = host, port
        self.hostname_label = hostname_label
        self.clock_field = clock_field
        self.kubernetes = kubernetes
        self.node = node
        self.instance_labels = instance_labels
        self.counters = None if counters is None else frozenset(counters)
        self.scrapes = 0  # pages served, for tests and the log
        # For tests: GPUs the exporter no longer prints (the driver lost them: dcgm-exporter
        # stops emitting their series), and nodes whose GPU samples carry a fixed time (no new
        # sample until it moves; see render_dcgm's timestamps).
        self.hidden: set[tuple[str, int]] = set()
        self.sample_times: dict[str, float] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- the page ---

    def render(self, node: str | None = None) -> str:
        """The page for one node, or for the whole fleet when ``node`` is None."""
        node = node or self.node
        metrics = [m for m in self.telemetry.gpu_metrics()
                   if (node is None or m.node == node) and (m.node, m.gpu) not in self.hidden]
        # Clocks, memory, PCIe link and traffic: what a node's page and the fail-slow
        # analysis read.
        readings = self.telemetry.gpu_readings(
            sorted({m.node for m in metrics}),
            tuple(dict.fromkeys((*dcgm.NODE_PAGE_FIELDS, *dcgm.FAIL_SLOW_FIELDS))))
        gpus = [_realistic(m, readings.get((m.node, m.gpu))) for m in metrics]
        ports = [p for p in self.telemetry.nic_ports() if node is None or p.node == node]
        combined = node is None and self.instance_labels
        pods = self._pods(gpus) if self.kubernetes else None
        return (render_dcgm(gpus, self.hostname_label, clock_field=self.clock_field,
                            instance_port=DCGM_PORT if combined else None, pods=pods,
                            timestamps=dict(self.sample_times), fields=self.counters,
                            readings=readings)
                + render_node_infiniband(ports,
                                         instance_port=NODE_EXPORTER_PORT if combined else None))

    def _pods(self, gpus: list[GpuMetric]) -> dict[tuple[str, int], dict[str, str]]:
        """dcgm-exporter's pod mapping: a node's GPUs belong to its slurmd pod while a job runs
        there (Slurm on Kubernetes), and to no pod otherwise."""
        state = self.fleet.snapshot()
        busy = {n for job in state["jobs"].values() if job["state"] == "RUNNING"
                for n in job["nodes"]}
        pods = {p["node"]: p for p in state["pods"] if p["labels"].get("app") == "slurmd"}
        mapping = {}
        for m in gpus:
            pod = pods.get(m.node)
            if m.node in busy and pod is not None:
                mapping[(m.node, m.gpu)] = {"container": "slurmd", "namespace": pod["namespace"],
                                            "pod": pod["name"]}
        return mapping

    # --- the server ---

    def start(self) -> int:
        """Start serving; returns the port (useful with ``port=0``)."""
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                match = NODE_PATH.match(path)
                if path in ("/metrics", "/metrics/") or match:
                    self._metrics(match["node"] if match else None)
                elif path in ("/", "/health"):
                    self._send(200, "fleetwatch simulated dcgm-exporter/node_exporter\n")
                else:
                    self._send(404, "not found\n")

            def _metrics(self, node: str | None) -> None:
                try:
                    body = exporter.render(node)
                except ClientError as exc:
                    # The simulated outage of the telemetry source: the exporter is down, the
                    # scrape fails, Prometheus marks the series stale.
                    self._send(503, f"{exc}\n")
                    return
                exporter.scrapes += 1
                self._send(200, body, CONTENT_TYPE)

            def _send(self, status: int, body: str, content_type: str = "text/plain") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("sim exporter: " + format, *args)

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name=f"sim-exporter-{self.port}", daemon=True)
        self._thread.start()
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> SimExporter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m collectors.sim.exporter",
        description="Serve the simulated fleet's GPUs (dcgm-exporter format) and NIC ports "
                    "(node_exporter format) for Prometheus to scrape.")
    parser.add_argument("--state", type=Path, required=True, help="the simulated fleet's file")
    parser.add_argument("--speed", type=float, default=20.0,
                        help="simulation speed; use the same as the rest of FleetWatch")
    parser.add_argument("--port", type=int, default=DCGM_PORT)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--hostname-label", default="Hostname",
                        choices=["Hostname", "hostname", "none"],
                        help="the host label dcgm-exporter prints (none: rely on instance)")
    parser.add_argument("--clock-field", default="event", choices=["event", "throttle"],
                        help="throttle: the pre-DCGM-3.2 name DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
    parser.add_argument("--kubernetes", action="store_true",
                        help="add dcgm-exporter's pod labels (container, namespace, pod)")
    parser.add_argument("--node", help="serve only this node's page at /metrics")
    parser.add_argument("--no-instance-labels", action="store_true",
                        help="do not label the combined page's series with instance")
    parser.add_argument("--counters", metavar="PATH",
                        help="export only the fields of this dcgm-exporter counters file, or "
                             "'default' for dcgm-exporter's stock default set")
    args = parser.parse_args(argv)
    try:
        counters = None if args.counters is None else counters_set(args.counters)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    exporter = SimExporter(
        args.state, args.speed, args.port, host=args.host,
        hostname_label=None if args.hostname_label == "none" else args.hostname_label,
        clock_field=CLOCK_THROTTLE_REASONS if args.clock_field == "throttle"
        else CLOCKS_EVENT_REASONS,
        kubernetes=args.kubernetes, node=args.node,
        instance_labels=not args.no_instance_labels, counters=counters)
    port = exporter.start()
    log.info("serving %s at http://%s:%d/metrics", args.state, args.host, port)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.stop()


if __name__ == "__main__":
    main()
