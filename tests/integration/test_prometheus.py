"""GPU telemetry through a real Prometheus: Debian's ``prometheus`` scrapes the simulated
dcgm-exporter/node_exporter every second, and ``PrometheusTelemetry`` reads it back with PromQL.

One Prometheus and one simulated fleet serve the whole module (starting them is most of its
time). The fleet runs at speed 1, so a link flap stays down for its full five seconds and
several scrapes see it. Tests compare with the simulation's own view rather than assume what
the others injected, so they hold in any order; the outage test runs last since it kills
Prometheus.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from collectors.clients import Clients, prometheus
from collectors.clients.base import ClientError, GpuMetric
from collectors.clients.notify import WebhookNotifier
from collectors.clients.prometheus import SCRAPE_LAG, PrometheusTelemetry
from collectors.knowledge import dcgm
from collectors.knowledge.dcgm import CLOCK_THROTTLE_REASONS
from collectors.services import collect_source
from collectors.sim import fleet as sim
from collectors.sim.exporter import SimExporter, counters_set
from collectors.sim.fleet import SimFleet, SimKubernetes, SimProvider, SimSlurm, SimTelemetry
from tests.conftest import ROOT, wait_for
from tests.harness.prometheus import PrometheusError, PrometheusServer, ScrapeTarget, find_binary

pytestmark = pytest.mark.integration

SPEED = 1.0
GPUS = 16 * 8
PER_NODE = ("gpu-001", "gpu-002")
COUNTERS = ROOT / "deploy" / "dcgm-exporter" / "counters.csv"


@dataclass
class Stack:
    fleet: SimFleet
    prom: PrometheusServer
    exporter: SimExporter

    def client(self, job: str = "dcgm", **kw: object) -> PrometheusTelemetry:
        return PrometheusTelemetry(self.prom.url, matchers=f'job="{job}"', **kw)  # type: ignore[arg-type]


def _by_gpu(metrics: list[GpuMetric]) -> dict[tuple[str, int], GpuMetric]:
    return {(m.node, m.gpu): m for m in metrics}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        find_binary()
    except PrometheusError as exc:
        pytest.fail(str(exc))
    root = tmp_path_factory.mktemp("prometheus")
    fleet = SimFleet(root / "sim-fleet.json", SPEED)
    fleet.seed()
    exporters = {
        "dcgm": SimExporter(fleet.path, SPEED),
        # An older exporter build: lowercase host label, the pre-3.2 clock field, pod labels.
        "dcgm-lower": SimExporter(fleet.path, SPEED, hostname_label="hostname",
                                  clock_field=CLOCK_THROTTLE_REASONS, kubernetes=True),
        # No host label: the node comes from the instance label alone.
        "dcgm-bare": SimExporter(fleet.path, SPEED, hostname_label=None),
        # dcgm-exporter installed with its stock counters, and with the file FleetWatch ships.
        "dcgm-default": SimExporter(fleet.path, SPEED, counters=counters_set("default")),
        "dcgm-shipped": SimExporter(fleet.path, SPEED, counters=counters_set(str(COUNTERS))),
        # Neither a host label nor an instance of its own: Prometheus's instance is
        # 127.0.0.1:port, an IP address, as for an exporter not relabelled.
        "dcgm-ip": SimExporter(fleet.path, SPEED, hostname_label=None, instance_labels=False),
    }
    targets = []
    for job, exporter in exporters.items():
        targets.append(ScrapeTarget(f"127.0.0.1:{exporter.start()}", job=job))
    main = targets[0].address
    # One target per node, as in production: each its own page and instance.
    targets += [ScrapeTarget(main, f"/nodes/{node}/metrics", {"instance": f"{node}:9400"},
                             job="per-node") for node in PER_NODE]
    prom = PrometheusServer(root / "prom", targets, "1s")
    try:
        prom.start()
        built = Stack(fleet, prom, exporters["dcgm"])
        for job, count in (("dcgm", GPUS), ("dcgm-lower", GPUS), ("dcgm-bare", GPUS),
                           ("dcgm-default", GPUS), ("dcgm-shipped", GPUS),
                           ("per-node", 8 * len(PER_NODE))):
            client = built.client(job)
            wait_for(lambda c=client, n=count: len(c.gpu_metrics()) == n, 30,
                     f"Prometheus to scrape job {job}")
        yield built
    finally:
        prom.stop()
        for exporter in exporters.values():
            exporter.stop()


def test_every_gpu_of_the_fleet_through_promql(stack: Stack) -> None:
    client = stack.client()
    metrics = _by_gpu(client.gpu_metrics())
    truth = _by_gpu(SimTelemetry(stack.fleet).gpu_metrics())
    assert len(metrics) == GPUS
    assert set(metrics) == set(truth)  # in-service nodes only: the sim reports no spares
    for key, m in metrics.items():
        assert m.uuid == truth[key].uuid
        assert m.model == "NVIDIA H100 80GB HBM3"
        if m.last_xid == 0:  # a GPU off the bus has no readings (another test makes one)
            assert m.utilization is not None and 0 <= m.utilization <= 100
            assert m.temperature is not None and 20 < m.temperature < 100
            # Not read on a poll (nothing diagnoses them), and the quiet counters (all 0
            # here) are left out by the queries' filters: at 100,000 GPUs most are quiet.
            assert (m.power_w, m.memory_temperature) == (None, None)
            assert (m.dbe_total, m.nvlink_errors, m.pcie_replays) == (None, None, None)
            assert (m.clock_event_reasons, m.row_remap_failure) == (0, 0)
    assert client.last_warnings == []


def test_injected_xid_arrives_on_that_gpu_only(stack: Stack) -> None:
    with stack.fleet.transaction() as state:
        sim.inject_xid(state, "gpu-003", 5, 79, time.time())
    client = stack.client()
    metrics = wait_for(
        # A scrape that does not hold GPU 5 yet is "not yet", not an error.
        lambda: getattr((ms := _by_gpu(client.gpu_metrics())).get(("gpu-003", 5)), "last_xid",
                        None) == 79 and ms,
        15, "XID 79 on gpu-003 GPU 5 in Prometheus")
    xids = {key: m.last_xid for key, m in metrics.items() if m.last_xid}
    truth = {(m.node, m.gpu): m.last_xid for m in SimTelemetry(stack.fleet).gpu_metrics()
             if m.last_xid}
    assert xids == truth  # whatever else was injected, exactly what the simulation says
    assert [g for (node, g) in xids if node == "gpu-003"] == [5]
    fallen = metrics[("gpu-003", 5)]
    # Off the bus: the exporter reports it blank; no data is None, never a number.
    assert (fallen.utilization, fallen.temperature) == (None, None)
    assert all(metrics[("gpu-003", g)].temperature is not None for g in range(8) if g != 5)


def test_lowercase_hostname_old_clock_field_and_pod_labels(stack: Stack) -> None:
    # Idle GPUs report the GPU_IDLE clock-event bit (0x1), which the poll's filter (bits from
    # 0x8 up: slowdowns) leaves out through either field name, while utilisation drops to 0.
    job = SimSlurm(stack.fleet).jobs()
    vit = next(j for j in job if j.job_id == "3003")
    SimSlurm(stack.fleet).cancel("3003", "TERM", 0)
    lower, upper = stack.client("dcgm-lower"), stack.client("dcgm")

    def idle(client: PrometheusTelemetry) -> dict[tuple[str, int], GpuMetric] | None:
        ms = _by_gpu(client.gpu_metrics())
        ok = all(ms[(n, g)].utilization == 0 and ms[(n, g)].clock_event_reasons == 0
                 for n in vit.nodes for g in range(8))
        return ms if ok else None

    old = wait_for(lambda: idle(lower), 15, "idle GPUs through DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
    new = wait_for(lambda: idle(upper), 15, "idle GPUs through DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
    assert len(old) == GPUS and set(old) == set(new)
    assert all(old[k].uuid == new[k].uuid for k in old)
    assert lower.last_warnings == []


def test_instance_is_the_node_when_no_host_label(stack: Stack) -> None:
    bare = _by_gpu(stack.client("dcgm-bare").gpu_metrics())
    named = _by_gpu(stack.client("dcgm").gpu_metrics())
    assert set(bare) == set(named)
    assert all(bare[k].uuid == named[k].uuid for k in bare)


def test_the_gpus_of_a_few_nodes_are_read_alone_under_every_node_label(stack: Stack) -> None:
    # A remediation step asks about its node: its GPUs only, as the whole read has them,
    # whichever label names the node (Hostname, hostname, only the instance).
    wanted = ["gpu-004", "gpu-011"]
    for job in ("dcgm", "dcgm-lower", "dcgm-bare"):
        client = stack.client(job)
        whole = {k: m for k, m in _by_gpu(client.gpu_metrics()).items() if k[0] in wanted}
        few = _by_gpu(client.gpu_metrics(wanted))
        assert set(few) == set(whole) == {(n, g) for n in wanted for g in range(8)}, job
        assert all((few[k].uuid, few[k].last_xid, few[k].model) ==
                   (whole[k].uuid, whole[k].last_xid, whole[k].model) for k in few), job
        assert client.gpu_metrics([]) == [] and client.gpu_metrics(["gpu-999"]) == [], job
        # A name that is a prefix of another's matches only itself.
        assert {m.node for m in client.gpu_metrics(["gpu-01"])} == set(), job


def test_one_target_per_node(stack: Stack) -> None:
    client = stack.client("per-node")
    assert {m.node for m in client.gpu_metrics()} == set(PER_NODE)
    ports = client.nic_ports()
    assert [(p.node, p.device, p.port) for p in ports] == [(n, "mlx5_0", 1) for n in PER_NODE]


def test_link_flap_reaches_nic_ports(stack: Stack) -> None:
    client = stack.client()

    def port() -> sim.NicPort:
        return next(p for p in client.nic_ports() if p.node == "gpu-007")

    before = port()
    assert before.state == "ACTIVE" and len(client.nic_ports()) == 16
    with stack.fleet.transaction() as state:
        sim.inject_link_flap(state, "gpu-007", 2, time.time(), SPEED)
    wait_for(lambda: (p := port()).state == "DOWN" and p.link_downed == before.link_downed + 2,
             15, "gpu-007's port DOWN with link_downed +2")
    # The simulated link comes back after 5 s; the counter keeps what happened.
    wait_for(lambda: port().state == "ACTIVE", 20, "gpu-007's port ACTIVE again")
    assert port().link_downed == before.link_downed + 2
    assert all(p.state == "ACTIVE" for p in client.nic_ports() if p.node != "gpu-007")


def test_gpu_history_over_the_last_minute(stack: Stack) -> None:
    client = stack.client()
    end = datetime.now(UTC)
    start = end - timedelta(minutes=1)
    history = client.gpu_history(["gpu-001", "gpu-010"], start, end, 1)
    assert set(history) == {"gpu-001", "gpu-010"}
    for node, gpus in history.items():
        assert sorted(gpus) == list(range(8)), node
        for points in gpus.values():
            assert len(points) >= 2
            assert [p.at for p in points] == sorted({p.at for p in points})
            assert start.timestamp() - 1 <= points[0].at and points[-1].at <= end.timestamp() + 1
            assert any(p.utilization is not None and p.temperature is not None for p in points)
    assert client.gpu_history([], start, end, 1) == {}
    # The lowercase label finds the same GPUs.
    assert set(stack.client("dcgm-lower").gpu_history(["gpu-010"], start, end, 5)["gpu-010"]) \
        == set(range(8))


def _readings_as(truth: dict[tuple[str, int], dict[str, float]], fields: set[str] | None = None,
                 rename: dict[str, str] | None = None) -> dict[tuple[str, int], dict[str, float]]:
    """The simulation's readings as an exporter printing only ``fields``, under its own names
    (``rename``), reports them."""
    out = {}
    for key, values in truth.items():
        # A running counter (NVLink traffic) moves between the scrape and this read.
        kept = {(rename or {}).get(k, k): v for k, v in values.items()
                if (fields is None or k in fields) and k not in dcgm.COUNTER_FIELDS}
        if kept:
            out[key] = kept
    return out


def test_gpu_readings_of_nodes_in_one_query(stack: Stack) -> None:
    """The node page's read: the latest value of each field for the nodes' GPUs, the same
    whichever host label the exporter prints; a field not exported is absent, never 0."""
    with stack.fleet.transaction() as state:
        sim.inject_xid(state, "gpu-003", 5, 79, time.time())  # as another test does
    fields = dcgm.NODE_PAGE_FIELDS
    sim_telemetry = SimTelemetry(stack.fleet)
    nodes = ["gpu-003", "gpu-010"]

    def matches(job: str, wanted: list[str], **how: Any) -> dict[tuple[str, int], Any]:
        client = stack.client(job)
        # Compared with the simulation now: a job that ends between the two reads is a
        # "not yet", as in the other tests.
        return wait_for(
            lambda: (got := client.gpu_readings(wanted, fields)) and _readings_as(got)
            == _readings_as(sim_telemetry.gpu_readings(wanted, fields), **how) and got,
            20, f"{job}'s readings to match the simulation")

    readings = matches("dcgm", nodes)
    assert ("gpu-003", 5) not in readings  # off the bus: no readings at all, not zeros
    assert sorted(g for n, g in readings if n == "gpu-010") == list(range(8))
    gpu = readings[("gpu-010", 0)]
    # Gen5 x16 at most (an idle GPU's link steps down a generation to save power).
    assert (gpu[dcgm.PCIE_MAX_LINK_GEN], gpu[dcgm.PCIE_MAX_LINK_WIDTH]) == (5, 16)
    assert gpu[dcgm.PCIE_LINK_GEN] in (1, 5)
    assert gpu[dcgm.MEM_CLOCK] == 2619 and gpu[dcgm.POWER_MGMT_LIMIT] == 700
    assert stack.client().last_warnings == []
    # The lowercase host label and the pre-3.2 clock field; no host label at all (the
    # instance names the node); one target per node.
    matches("dcgm-lower", nodes, rename={dcgm.CLOCKS_EVENT_REASONS: CLOCK_THROTTLE_REASONS})
    matches("dcgm-bare", nodes)
    matches("per-node", ["gpu-001"])
    # dcgm-exporter's stock counters: clocks and framebuffer, no PCIe link or power limit.
    stock = matches("dcgm-default", nodes, fields=set(dcgm.EXPORTER_DEFAULT_FIELDS))
    assert dcgm.SM_CLOCK in stock[("gpu-010", 1)]
    assert dcgm.PCIE_LINK_GEN not in stock[("gpu-010", 1)]
    # One field; a node no exporter knows; nothing asked.
    one = stack.client().gpu_readings(["gpu-010"], [dcgm.PCIE_LINK_WIDTH])
    assert one == {("gpu-010", g): {dcgm.PCIE_LINK_WIDTH: 16.0} for g in range(8)}
    assert stack.client().gpu_readings(["gpu-0"], fields) == {}
    assert stack.client().gpu_readings([], fields) == {}
    assert stack.client().gpu_readings(["gpu-010"], []) == {}


def test_gpu_field_history_shows_a_straggler_through_promql(stack: Stack) -> None:
    """The fail-slow figures of a few nodes over a range, one query per field: a power-capped
    node and a GPU whose PCIe link trained at Gen3, against their peers, under each way the
    exporter names the node; the analysis finds the straggler in what comes back. On four
    nodes of a job that is working (another test here stops one, another hangs one)."""
    from incidents.diagnosis import JobInfo
    from incidents.diagnosis.slow import Thresholds, Window, analyse

    def working() -> list[str]:
        jobs = stack.fleet.snapshot()["jobs"].values()
        return next((j["nodes"][:4] for j in jobs if j["state"] == "RUNNING"
                     and j["stalled_at"] is None and len(j["nodes"]) >= 4), [])

    if not working():
        with stack.fleet.transaction() as state:
            sim.submit_job(state, "straggler-test", "tara", num_nodes=4)
    nodes = wait_for(working, 15, "a job working on four nodes")
    a, b, c = nodes[:3]
    injected = time.time()
    with stack.fleet.transaction() as state:
        sim.inject_slow(state, a, 1, "pcie-gen", 0, injected)
        sim.inject_slow(state, b, -1, "power-cap", 40, injected)
    client = stack.client()

    def history() -> dict[tuple[str, int], dict[str, list[tuple[float, float]]]]:
        end = datetime.now(UTC)
        return client.gpu_field_history(nodes, dcgm.FAIL_SLOW_FIELDS, end - timedelta(seconds=20),
                                        end, 1)

    def shows_it(h: dict[tuple[str, int], dict[str, list[tuple[float, float]]]]) -> bool:
        gen = h.get((a, 1), {}).get(dcgm.PCIE_LINK_GEN, [])
        capped = h.get((b, 0), {}).get(dcgm.CLOCKS_EVENT_REASONS, [])
        return bool(gen and gen[-1][1] == 3 and capped and capped[-1][1] == dcgm.SW_POWER_CAP)

    def read() -> dict[tuple[str, int], dict[str, list[tuple[float, float]]]] | None:
        h = history()
        return h if shows_it(h) else None

    wait_for(read, 20, "the injected slowness in Prometheus")
    # Read again a few scrapes later: each field is its own query, so a scrape landing
    # between two of them (the job just started, the cap just applied) can end one field's
    # series on the scrape before the change and another's on the one after.
    time.sleep(3)
    found = history()
    assert shows_it(found)
    assert {n for n, _ in found} == set(nodes)  # only the nodes asked for
    assert all(sorted(g for n, g in found if n == node) == list(range(8)) for node in nodes)
    for (node, gpu), fields in found.items():
        assert set(fields) <= set(dcgm.FAIL_SLOW_FIELDS) and dcgm.SM_CLOCK in fields
        for points in fields.values():
            assert [t for t, _ in points] == sorted({t for t, _ in points}), (node, gpu)
    last = {k: {f: p[-1][1] for f, p in v.items()} for k, v in found.items()}
    assert last[(a, 1)][dcgm.PCIE_MAX_LINK_GEN] == 5
    assert last[(a, 0)][dcgm.PCIE_LINK_GEN] == 5
    capped = [v[dcgm.POWER_USAGE] for (n, _), v in last.items() if n == b]
    others = [v[dcgm.POWER_USAGE] for (n, _), v in last.items() if n == c]
    assert max(capped) < min(others)
    # A counter comes back as its running total, rising.
    nvlink = found[(c, 0)][dcgm.NVLINK_BANDWIDTH_TOTAL]
    assert nvlink[-1][1] > nvlink[0][1]
    # The node under the lowercase label and under the instance label alone: the same GPUs.
    end = datetime.now(UTC)
    for job in ("dcgm-lower", "dcgm-bare"):
        other = stack.client(job).gpu_field_history([b], [dcgm.SM_CLOCK], end
                                                    - timedelta(seconds=10), end, 2)
        assert sorted(other) == [(b, g) for g in range(8)], job
    assert client.gpu_field_history([], [dcgm.SM_CLOCK], end - timedelta(seconds=5), end, 1) == {}
    with pytest.raises(ClientError):
        client.gpu_field_history(nodes, [dcgm.SM_CLOCK], end, end - timedelta(seconds=5), 1)
    # What the analysis makes of it: the node all of whose GPUs are capped, is the straggler
    # of a job on these four nodes (two seconds of Prometheus history are a "minute" here, and
    # ten of them are sustained).
    time.sleep(max(0.0, injected + 12 - time.time()))
    end = datetime.now(UTC)
    readings = {k: {f: [(t, v, None) for t, v in p] for f, p in fields.items()}
                for k, fields in client.gpu_field_history(
                    nodes, dcgm.FAIL_SLOW_FIELDS, end - timedelta(seconds=20), end, 1).items()}
    result = analyse(Window([JobInfo("1", "t", tuple(nodes))], readings),
                     Thresholds(bucket_s=2, sustain_s=6, min_buckets=3))
    assert b in {f.node for f in result.findings}
    with stack.fleet.transaction() as state:  # leave the fleet as the other tests expect it
        for node in (a, b):
            for g in state["nodes"][node]["gpus"]:
                g.pop("slow", None)


def test_collect_source_reads_prometheus(stack: Stack, db: None) -> None:
    from collectors.models import CollectorRun, Gpu, Signal

    with stack.fleet.transaction() as state:
        sim.inject_xid(state, "gpu-010", 1, 94, time.time())
    telemetry = stack.client()
    wait_for(lambda: _by_gpu(telemetry.gpu_metrics())[("gpu-010", 1)].last_xid == 94, 15,
             "XID 94 on gpu-010 GPU 1 in Prometheus")
    clients = Clients(SimSlurm(stack.fleet), SimKubernetes(stack.fleet), telemetry,
                      SimProvider(stack.fleet), WebhookNotifier(None))
    result = collect_source("telemetry", clients=clients)
    assert result.healthy, result.error
    assert Gpu.objects.count() == GPUS
    row = Gpu.objects.get(node__name="gpu-010", index=1)
    assert (row.last_xid, row.uuid) == (94, _by_gpu(SimTelemetry(stack.fleet).gpu_metrics())[
        ("gpu-010", 1)].uuid)
    assert Gpu.objects.filter(node__name="gpu-011", utilization__isnull=False).count() == 8
    signal = Signal.objects.get(kind="xid", node_name="gpu-010", gpu_index=1)
    assert (signal.code, signal.source) == (94, "dcgm")
    run = CollectorRun.objects.get(source="telemetry")
    assert run.ok and run.counts["gpus"] == GPUS and run.counts["nic_ports"] == 16
    assert run.warnings == []


def test_fields_the_exporter_leaves_out_are_named_and_the_source_stays_usable(
        stack: Stack, db: None, client: Any, operator: Any) -> None:
    from collectors.models import CollectorRun, Node

    prometheus._FIELD_CHECKS.clear()  # asked afresh, not from the fixture's reads
    stock = stack.client("dcgm-default")
    assert len(stock.gpu_metrics()) == GPUS  # read as usual
    ecc = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL not exported: double-bit ECC faults will not be seen"
    assert ecc in stock.last_warnings
    expected = dcgm.missing_fields(set(dcgm.EXPORTER_DEFAULT_FIELDS))
    assert [w.split(" ", 1)[0] for w in stock.last_warnings] == expected
    assert dcgm.NVLINK_CRC_FLIT_ERRORS in expected and dcgm.XID_ERRORS not in expected
    shipped = stack.client("dcgm-shipped")
    assert len(shipped.gpu_metrics()) == GPUS and shipped.last_warnings == []

    # A collector run against the stock exporter: healthy, no node failed for it, and the
    # warnings on the run, the Sources page and the API.
    result = collect_source("telemetry", clients=_clients(stack, stack.client("dcgm-default")))
    assert result.healthy, result.error
    run = CollectorRun.objects.filter(source="telemetry").latest("started_at")
    assert run.ok and ecc in run.warnings
    failed_by_xid = {m.node for m in SimTelemetry(stack.fleet).gpu_metrics() if m.last_xid}
    assert set(Node.objects.filter(health="failed").values_list("name", flat=True)) \
        <= failed_by_xid
    client.force_login(operator)
    page = client.get("/sources/").content.decode()
    assert f"{len(expected)} warning(s)" in page and ecc in page
    api = client.get("/api/v1/sources/")
    assert api.status_code == 200, api.content
    [telemetry] = [s for s in api.json() if s["name"] == "telemetry"]
    assert ecc in telemetry["recent_runs"][0]["warnings"]


def test_an_ip_instance_is_not_a_node(stack: Stack) -> None:
    client = stack.client("dcgm-ip")
    gpus = wait_for(lambda: (client.gpu_metrics(), client.last_warnings)[1], 30,
                    "the IP-instance exporter scraped")
    assert client.gpu_metrics() == []  # no phantom node named 127.0.0.1
    assert any(" series skipped: their instance label is an IP address" in w for w in gpus)
    assert all("127.0.0.1" not in p.node for p in client.nic_ports())


def test_the_shipped_relabelling_names_the_node_of_an_ip_target(stack: Stack,
                                                                 tmp_path: Path) -> None:
    """deploy/prometheus/relabel-node-name.yaml's Kubernetes rules in a real Prometheus: the
    target is an IP address and its exporter prints no host label (node_exporter's case);
    the pod's node, which Kubernetes service discovery would set (Debian's Prometheus is built
    without it, so the target carries the same __meta labels), becomes Hostname."""
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "relabel-node-name.yaml")
                             .read_text())
    jobs = {job["job_name"]: job for job in shipped["scrape_configs"]}
    exporter = SimExporter(stack.fleet.path, SPEED, hostname_label=None, instance_labels=False)
    port = exporter.start()
    meta = {"__meta_kubernetes_pod_node_name": "gpu-005",
            "__meta_kubernetes_pod_label_app_kubernetes_io_name": "dcgm-exporter",
            "__meta_kubernetes_pod_container_port_number": "9400"}
    target = ScrapeTarget(f"127.0.0.1:{port}", "/nodes/gpu-005/metrics", meta,
                          job="dcgm-exporter")
    static = [ScrapeTarget(f"127.0.0.1:{port}", "/nodes/gpu-006/metrics",
                           group.get("labels", {}) | {"Hostname": "gpu-006"},
                           job="dcgm-exporter-static")
              for group in jobs["dcgm-exporter-static"]["static_configs"][:1]]
    prom = PrometheusServer(tmp_path / "prom", [target, *static], "1s", honor_labels=False,
                            relabel={"dcgm-exporter": jobs["dcgm-exporter"]["relabel_configs"]})
    try:
        prom.start()
        k8s = PrometheusTelemetry(prom.url, matchers='job="dcgm-exporter"')
        gpus = wait_for(lambda: k8s.gpu_metrics(), 30, "the relabelled target scraped")
        assert {m.node for m in gpus} == {"gpu-005"} and len(gpus) == 8
        assert {p.node for p in k8s.nic_ports()} == {"gpu-005"}
        assert k8s.last_warnings == []
        labelled = PrometheusTelemetry(prom.url, matchers='job="dcgm-exporter-static"')
        assert {m.node for m in wait_for(lambda: labelled.gpu_metrics(), 30,
                                         "the static target scraped")} == {"gpu-006"}
    finally:
        prom.stop()
        exporter.stop()


# --- incremental polls: what collect_source reads after its first poll ----------------------


def _clients(stack: Stack, telemetry: PrometheusTelemetry) -> Clients:
    return Clients(SimSlurm(stack.fleet), SimKubernetes(stack.fleet), telemetry,
                   SimProvider(stack.fleet), WebhookNotifier(None))


def _collect(clients: Clients) -> dict[str, int]:
    """One telemetry run; its counts."""
    from collectors.models import CollectorRun

    result = collect_source("telemetry", clients=clients)
    assert result.healthy, result.error
    run = CollectorRun.objects.filter(source="telemetry").order_by("-started_at").first()
    assert run is not None and run.warnings == []
    return dict(run.counts)


def _prometheus_now(client: PrometheusTelemetry) -> float:
    return float(client._query("vector(time())")[0]["value"][1])


def test_a_poll_reads_only_the_samples_new_since_the_last(stack: Stack, db: None) -> None:
    """gpu-004's page says its samples were taken at one moment: Prometheus keeps one sample
    per timestamp, so gpu-004 has nothing new until that moment moves, like a node between
    two of its scrapes 15 s apart, while every other node is scraped each second."""
    from collectors.models import Gpu, SourceHealth

    telemetry, node = stack.client(), "gpu-004"
    clients = _clients(stack, telemetry)
    stamps = f'timestamp(DCGM_FI_DEV_GPU_UTIL{{job="dcgm", Hostname="{node}"}})'

    def stamped(at: float) -> bool:
        series = telemetry._query(stamps)
        return len(series) == 8 and all(abs(float(s["value"][1]) - at) < 0.01 for s in series)

    def stored() -> dict[int, tuple[float | None, float | None, str]]:
        return {g.index: (g.utilization, g.temperature, g.health)
                for g in Gpu.objects.filter(node__name=node)}

    def past_cursor(seconds: float) -> bool:
        # Readings are evaluated SCRAPE_LAG seconds back: wait until that moment is past
        # the cursor by more than a scrape of the other nodes.
        cursor = SourceHealth.objects.get(name="telemetry").cursor["at"]
        return _prometheus_now(telemetry) - SCRAPE_LAG > cursor + seconds

    # A moment ahead of every scrape so far: the first page stamped with it makes Prometheus
    # end the node's unstamped series (stale markers at that scrape's time), and a sample
    # may only follow the last one in time.
    frozen = time.time() + 2
    stack.exporter.sample_times[node] = frozen
    try:
        wait_for(lambda: stamped(frozen), 15, f"{node}'s samples stamped {frozen}")
        first = _collect(clients)  # no cursor: every GPU
        assert first["incremental"] == 0 and first["gpus"] == GPUS
        before = stored()
        assert all(util is not None and health == "healthy" for util, _, health in before.values())

        wait_for(lambda: past_cursor(1.5), 15, "Prometheus's clock past the cursor")
        counts = _collect(clients)
        # Every GPU but gpu-004's has a sample newer than the last poll; gpu-004's are
        # neither read nor taken for missing.
        assert counts["incremental"] == 1 and counts["gpus"] == GPUS - 8
        assert stored() == before

        # gpu-004 is scraped again: the next poll reads it.
        moved = time.time() + 1
        stack.exporter.sample_times[node] = moved
        wait_for(lambda: stamped(moved), 15, f"{node}'s samples stamped {moved}")
        wait_for(lambda: _prometheus_now(telemetry) - SCRAPE_LAG > moved, 15,
                 "Prometheus's clock past the new samples")
        counts = _collect(clients)
        assert counts["incremental"] == 1 and counts["gpus"] == GPUS
        now = {int(s["metric"]["gpu"]): float(s["value"][1]) for s in telemetry._query(
            f'DCGM_FI_DEV_GPU_UTIL{{job="dcgm", Hostname="{node}"}}')}
        assert {g: util for g, (util, _, _) in stored().items()} == now
    finally:
        del stack.exporter.sample_times[node]


def test_a_gpu_gone_silent_while_its_node_reports_is_failed(stack: Stack, db: None) -> None:
    """dcgm-exporter stops printing a GPU the driver lost; Prometheus marks its series stale.
    No new sample says so: the per-node count does. A node whose GPUs all went quiet is
    another matter (its exporter is down): not read as failed."""
    from collectors.models import Gpu, Node

    telemetry = stack.client()
    clients = _clients(stack, telemetry)
    silent, gone = ("gpu-005", 2), "gpu-006"

    def reporting(node: str) -> int:
        series = telemetry._query(f'count(DCGM_FI_DEV_GPU_TEMP{{job="dcgm", Hostname="{node}"}})')
        return int(float(series[0]["value"][1])) if series else 0

    assert _collect(clients)["incremental"] == 0
    assert Gpu.objects.get(node__name=silent[0], index=silent[1]).health == "healthy"
    stack.exporter.hidden.add(silent)
    stack.exporter.hidden.update((gone, g) for g in range(8))
    try:
        wait_for(lambda: reporting(silent[0]) == 7 and reporting(gone) == 0, 15,
                 f"{silent[0]} GPU {silent[1]} and {gone} stale in Prometheus")
        counts = _collect(clients)
        assert counts["incremental"] == 1
        gpu = Gpu.objects.get(node__name=silent[0], index=silent[1])
        assert (gpu.utilization, gpu.temperature, gpu.health) == (None, None, "failed")
        others = Gpu.objects.filter(node__name=silent[0]).exclude(index=silent[1])
        assert {g.health for g in others} == {"healthy"}
        assert all(g.utilization is not None for g in others)
        assert Node.objects.get(name=silent[0]).health == "failed"
        # The whole node quiet: as it was.
        assert {(g.health, g.utilization is not None)
                for g in Gpu.objects.filter(node__name=gone)} == {("healthy", True)}
        assert Node.objects.get(name=gone).health == "healthy"
    finally:
        stack.exporter.hidden.clear()
    wait_for(lambda: reporting(silent[0]) == 8 and reporting(gone) == 8, 15,
             "the GPUs back in Prometheus")
    wait_for(lambda: _collect(clients) and Node.objects.get(name=silent[0]).health == "healthy",
             15, f"{silent[0]} healthy again")
    gpu = Gpu.objects.get(node__name=silent[0], index=silent[1])
    assert gpu.health == "healthy" and gpu.utilization is not None


def test_incremental_polls_see_every_step_of_a_link_flap(stack: Stack, db: None) -> None:
    """Incremental polls read only the ports that changed lately, and still see the port go
    DOWN with link_downed up, then come back ACTIVE, as reading every port did."""
    from collectors.models import Node, Signal

    telemetry, node = stack.client(), "gpu-012"
    clients = _clients(stack, telemetry)
    assert _collect(clients)["incremental"] == 0  # every port: the baseline
    before = Node.objects.get(name=node).nic_link_downed
    with stack.fleet.transaction() as state:
        sim.inject_link_flap(state, node, 3, time.time(), SPEED)
    runs: list[dict[str, int]] = []

    def back() -> bool:
        runs.append(_collect(clients))
        return Signal.objects.filter(node_name=node, kind="nic_state", value="ACTIVE").exists()

    wait_for(back, 30, f"{node}'s port DOWN and back ACTIVE through incremental polls")
    assert all(r["incremental"] == 1 and r["nic_ports"] < 16 for r in runs)
    signals = [(s.kind, s.value) for s in Signal.objects.filter(
        node_name=node, source="nic").order_by("id")]
    assert signals == [("nic_state", "DOWN"), ("nic_counter", str(before + 3)),
                       ("nic_state", "ACTIVE")] or signals == [
        ("nic_counter", str(before + 3)), ("nic_state", "DOWN"), ("nic_state", "ACTIVE")]
    stored = Node.objects.get(name=node)
    assert (stored.nic_state, stored.nic_link_downed) == ("ACTIVE", before + 3)


def test_exporter_page_is_valid_exposition_format(stack: Stack) -> None:
    """promtool (from the prometheus package) parses the page; its only complaints are the
    naming lints dcgm-exporter's own names fail (camelCase labels, counters without _total,
    DCGM_FI_DEV_PCIE_REPLAY_COUNTER naming its type)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: it comes with Debian's prometheus package")
    with urllib.request.urlopen(stack.exporter.url, timeout=10) as response:
        page = response.read()
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    checked = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True,
                             timeout=30)
    output = (checked.stdout + checked.stderr).decode()
    assert checked.returncode in (0, 3), output[-3000:]  # 3: lint findings only
    lints = {line.split(" ", 1)[1] for line in output.splitlines() if line.strip()}
    assert lints <= {"label names should be written in 'snake_case' not 'camelCase'",
                     'counter metrics should have "_total" suffix',
                     "metric name should not include type 'counter'"}, lints


def test_exporter_runs_without_django(stack: Stack, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "collectors.sim.exporter", "--state",
         str(stack.fleet.path), "--speed", str(SPEED), "--port", "0",
         "--hostname-label", "hostname"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = wait_for(lambda: proc.stdout.readline() or (proc.poll() is not None and "exit"),
                        20, "the exporter to start")
        assert "serving" in line, line
        url = line.rsplit(" at ", 1)[1].strip()
        with urllib.request.urlopen(url, timeout=10) as response:
            page = response.read().decode()
        assert 'hostname="gpu-016"' in page and "node_infiniband_state_id" in page
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_bad_query_is_permanent(stack: Stack) -> None:
    client = PrometheusTelemetry(stack.prom.url, matchers='job=~"("')  # not a regex
    with pytest.raises(ClientError) as info:
        client.gpu_metrics()
    assert info.value.permanent
    assert "400" in str(info.value)


def test_hung_prometheus_times_out(stack: Stack) -> None:
    client = stack.client(timeout=1.0)
    stack.prom.pause()
    try:
        with pytest.raises(ClientError) as info:
            client.gpu_metrics()
        assert not info.value.permanent
        assert "timed out" in str(info.value)
        with pytest.raises(ClientError, match="timed out"):
            client.gpu_readings(["gpu-001"], dcgm.NODE_PAGE_FIELDS)
    finally:
        stack.prom.resume()
    # Back, it answers again; the first answers after a hang may still miss the scrapes it
    # was catching up on (seen under a loaded CI machine): wait for them, not for luck.
    wait_for(lambda: len(client.gpu_metrics()) == GPUS, 30, "every GPU read after the hang")


def test_prometheus_down_is_transient_and_recovers(stack: Stack) -> None:
    client = stack.client(timeout=3.0)
    stack.prom.kill()
    try:
        with pytest.raises(ClientError) as info:
            client.gpu_metrics()
        assert not info.value.permanent
        assert "unreachable" in str(info.value)
        with pytest.raises(ClientError) as info:
            client.nic_ports()
        assert not info.value.permanent
        with pytest.raises(ClientError, match="unreachable"):
            client.gpu_readings(["gpu-001"], dcgm.NODE_PAGE_FIELDS)
    finally:
        stack.prom.start()
    wait_for(lambda: len(client.gpu_metrics()) == GPUS, 30, "Prometheus answering again")
