"""A node's page on real sources: its GPU readings from a real Prometheus scraping the simulated
dcgm-exporter, and its pods from the Kubernetes test server, asked by the machine's Kubernetes
name while Slurm calls it something else (Slinky). A Kubernetes API that goes away leaves the
page saying so, with the readings still there."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from collectors.clients.prometheus import PrometheusTelemetry
from collectors.knowledge import dcgm
from collectors.models import Cluster, Gpu, Node
from collectors.sim.exporter import SimExporter
from collectors.sim.fleet import SimFleet
from tests.conftest import wait_for
from tests.harness.k8s_server import K8sTestServer
from tests.harness.prometheus import PrometheusServer, ScrapeTarget

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

NODE = "gpu-001"  # the machine: its Kubernetes node and dcgm-exporter's Hostname
SLURM_NAME = "slinky-0"  # what Slurm (slurm-operator's NodeSet pod) calls it
PODS = [
    {"namespace": "slurm", "name": SLURM_NAME, "node": NODE, "labels": {"app": "slurmd"},
     "owner": {"kind": "NodeSet", "name": "slinky", "apiVersion": "slinky.slurm.net/v1alpha1"}},
    {"namespace": "train", "name": "llm-0", "node": NODE,
     "labels": {"app": "llm", "fleetwatch.io/no-auto-replace": "true"},
     "owner": {"kind": "StatefulSet", "name": "llm"}},
    {"namespace": "train", "name": "eval-0", "node": NODE, "ready": False, "phase": "Pending",
     "owner": {"kind": "Job", "name": "eval", "apiVersion": "batch/v1"}},
    {"namespace": "gpu-operator", "name": "dcgm-exporter-x1", "node": NODE,
     "labels": {"app": "dcgm-exporter"}, "owner": {"kind": "DaemonSet", "name": "dcgm-exporter"}},
]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[str]:
    fleet = SimFleet(tmp_path / "sim-fleet.json", 1.0)
    fleet.seed(nodes=8, spares=0)  # job 3001 runs on all eight: busy GPUs
    exporter = SimExporter(fleet.path, 1.0)
    prom = PrometheusServer(tmp_path / "prometheus",
                            [ScrapeTarget(f"127.0.0.1:{exporter.start()}", job="dcgm")], "1s")
    try:
        prom.start()
        client = PrometheusTelemetry(prom.url)
        wait_for(lambda: len(client.gpu_readings([NODE], [dcgm.PCIE_LINK_GEN])) == 8, 30,
                 "Prometheus to scrape the exporter")
        yield prom.url
    finally:
        prom.stop()
        exporter.stop()


@pytest.fixture
def k8s(tmp_path: Path) -> Iterator[K8sTestServer]:
    server = K8sTestServer({"nodes": [{"name": NODE, "labels": {"fleetwatch.io/pool": "gpu"}}],
                            "pods": PODS}, kubeconfig_path=tmp_path / "kubeconfig.yaml")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _section(page: str, testid: str) -> str:
    start = page.index(f'data-testid="{testid}"')
    return page[start:page.index("</section>", start)]


def _row(html: str, testid: str) -> str:
    start = html.index(f'data-testid="{testid}"')
    return html[start:html.index("</tr>", start)]


def test_node_page_reads_prometheus_and_the_pods_of_its_kubernetes_name(
        client: Client, operator: Any, settings: Any, prometheus: str,
        k8s: K8sTestServer) -> None:
    settings.FLEETWATCH_FLEET, settings.FLEETWATCH_STORE_GPU_SAMPLES = "real", False
    settings.FLEETWATCH_PROMETHEUS_URL = prometheus
    settings.FLEETWATCH_PROMETHEUS_MATCHERS = 'job="dcgm"'
    settings.FLEETWATCH_KUBECONFIG = str(k8s.kubeconfig_path)
    cluster = Cluster.objects.create(name="lab")
    node = Node.objects.create(cluster=cluster, name=NODE, slurm_name=SLURM_NAME,
                               health="healthy", k8s_ready=True, k8s_ready_status="True")
    Gpu.objects.bulk_create([Gpu(node=node, index=g, health="healthy") for g in range(8)])
    client.force_login(operator)

    page = client.get(f"/nodes/{NODE}/").content.decode()
    readings = _section(page, "gpu-readings")
    assert "Readings unavailable" not in readings
    assert re.findall(r'data-testid="readings-row-(\d+)"', readings) == [str(g) for g in range(8)]
    gpu = _row(readings, "readings-row-3")
    assert re.search(r"\d{3} W <span class=\"muted\">of 700 W</span>", gpu)
    # Gen5 x16 under load (an idle GPU's link steps down to Gen1, said as power saving).
    assert re.search(r'readings-pcie-3">Gen[15] x16 <span class="muted">of Gen5 x16</span>',
                     gpu), gpu
    assert "below its maximum" not in gpu
    # Boost SM clocks (a little under 1,980 MHz between scrapes), or idle ones; memory 2,619.
    assert re.search(r"[\d,]+ MHz · 2,619 MHz", gpu), gpu
    assert 'data-testid="readings-missing"' not in readings

    pods = _section(page, "node-pods")
    assert "Pods unavailable" not in pods
    assert re.findall(r'data-testid="pod-row-([\w.-]+)"', pods) == [
        "gpu-operator-dcgm-exporter-x1", f"slurm-{SLURM_NAME}", "train-eval-0", "train-llm-0"]
    assert "NodeSet" in _row(pods, f"pod-row-slurm-{SLURM_NAME}")
    llm = _row(pods, "pod-row-train-llm-0")
    assert 'data-testid="pod-no-auto-replace"' in llm and "StatefulSet" in llm
    pending = _row(pods, "pod-row-train-eval-0")
    assert "Pending" in pending and '<span class="bad-t">no</span>' in pending
    assert 'data-testid="pod-no-auto-replace"' not in pending

    # The API server goes away: the page still renders, says why, and keeps the readings.
    k8s.stop()
    page = client.get(f"/nodes/{NODE}/").content.decode()
    assert re.search(r'data-testid="pods-unavailable">Pods unavailable: Kubernetes '
                     r"unavailable: .*unreachable", page)
    assert 'data-testid="readings-row-3"' in page and 'data-testid="node-health">healthy' in page
