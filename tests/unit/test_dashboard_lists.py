"""The dashboard's attention area, its figures (out-of-service nodes are not failed ones, a
down source's figures are stale) and the lists' sort and CSV export, as the pages render them
(the browser tests drive the same in Chromium: tests/browser/test_person_on_call.py)."""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from collectors.models import Cluster, Gpu, Job, Node, Signal, SourceHealth
from incidents.models import Incident, Remediation

pytestmark = pytest.mark.django_db

NOW = timezone.now()


@pytest.fixture
def ops(client: Client, operator: Any) -> Client:
    client.force_login(operator)
    return client


@pytest.fixture
def fleet() -> Cluster:
    cluster = Cluster.objects.create(name="lab")
    for name, health, pool, in_service in (("gpu-001", "healthy", "gpu", True),
                                           ("gpu-002", "failed", "gpu", True),
                                           ("gpu-003", "failed", "rma", True),  # sent to RMA
                                           ("gpu-004", "failed", "gpu", False)):  # replaced
        node = Node.objects.create(cluster=cluster, name=name, health=health, pool=pool,
                                   in_service=in_service, slurm_state="IDLE", leaf_switch="leaf-a")
        Gpu.objects.create(node=node, index=0, health=health)
    return cluster


def _count(page: str, testid: str) -> str:
    found = re.search(rf'data-testid="{testid}"[^>]*><b>(\d+)', page)
    assert found, testid
    return found.group(1)


def test_out_of_service_nodes_are_not_counted_failed(ops: Client, fleet: Cluster) -> None:
    page = ops.get("/").content.decode()
    assert _count(page, "count-nodes") == "2"
    assert _count(page, "count-failed") == "1"
    assert _count(page, "count-gpus-failed") == "1"
    assert 'data-testid="failed-nodes"' in page and ">gpu-002</a>" in page
    assert ">gpu-003</a>" not in page


def test_attention_first_counted_in_the_title_and_stale_figures(ops: Client,
                                                               fleet: Cluster) -> None:
    page = ops.get("/").content.decode()
    assert "<title>Dashboard · FleetWatch" in page
    assert 'data-testid="attention-none"' in page

    SourceHealth.objects.create(cluster=fleet, name="kubernetes", healthy=False,
                                last_error="connection refused", last_run_at=NOW,
                                consecutive_failures=3)
    SourceHealth.objects.create(cluster=fleet, name="slurm", healthy=True, last_run_at=NOW,
                                last_success_at=NOW)
    incident = Incident.objects.create(
        cluster=fleet, root_cause="gpu_hardware", confidence=0.9, explanation="XID 79",
        status="open", fingerprint="fp", nodes=["gpu-002"], detected_at=NOW,
        opened_at=NOW - timedelta(minutes=2))
    rem = Remediation.objects.create(incident=incident, playbook="replace_node",
                                     mode="approve", status="awaiting_approval",
                                     requested_by="system", nodes=["gpu-002"])
    # A failed remediation of a resolved incident needs nobody.
    done = Incident.objects.create(
        cluster=fleet, root_cause="thermal", confidence=0.9, explanation="hot",
        status="resolved", fingerprint="fp2", nodes=["gpu-001"], detected_at=NOW,
        opened_at=NOW, resolved_at=NOW)
    Remediation.objects.create(incident=done, playbook="replace_node", mode="auto",
                               status="failed", requested_by="system")

    page = ops.get("/").content.decode()
    # The remediation, the source and the incident: the incident counts once with its
    # remediation.
    assert "<title>(2) Dashboard · FleetWatch" in page
    assert re.search(r'data-testid="attention-count">2<', page)
    assert f'data-testid="attention-remediation-{rem.pk}" data-status="awaiting_approval"' in page
    assert 'data-testid="attention-source-kubernetes"' in page and "connection refused" in page
    assert f'data-testid="open-incident-{incident.pk}"' in page
    assert page.index('data-testid="attention"') < page.index('data-testid="fleet-counts"') \
        < page.index('id="gpu-grid"')
    assert re.search(r'data-testid="count-cordoned" data-stale="kubernetes"', page)
    assert "stale: kubernetes down" in page
    assert not re.search(r'data-testid="count-failed" data-stale', page)
    # The live part carries the title for htmx to put on the tab.
    live = ops.get("/dashboard/live").content.decode()
    assert "<title>(2) Dashboard · FleetWatch" in live


def test_lists_sort_by_a_column_and_export_csv(ops: Client, fleet: Cluster) -> None:
    page = ops.get("/nodes/?sort=-name").content.decode()
    assert re.findall(r'data-testid="node-row-([\w-]+)"', page) == [
        "gpu-004", "gpu-003", "gpu-002", "gpu-001"]
    assert 'aria-sort="descending"' in page
    assert 'data-sort="name"' in page

    response = ops.get("/nodes/?sort=-name&health=failed&_export=csv")
    assert response["Content-Type"].startswith("text/csv")
    assert 'filename="fleetwatch-nodes.csv"' in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [r["Node"] for r in rows] == ["gpu-004", "gpu-003", "gpu-002"]
    assert rows[0]["Health"] == "failed" and rows[0]["GPUs"] == "0/1 healthy, 1 failed"
    assert rows[0]["Cluster"] == "lab"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rows[0]["Updated"])
    assert "<" not in response.content.decode()

    # A job named like a formula is text in the CSV, not a formula a spreadsheet runs.
    Job.objects.create(cluster=fleet, slurm_id="77", name='=HYPERLINK("http://x","y")',
                       user="@me", nodes=["gpu-002"])
    jobs = list(csv.DictReader(io.StringIO(ops.get("/jobs/?_export=csv").content.decode())))
    assert jobs[0]["Name"] == "'=HYPERLINK(\"http://x\",\"y\")" and jobs[0]["User"] == "'@me"
    assert jobs[0]["Nodes"] == "gpu-002" and jobs[0]["State"] == ""

    # A filter that does not parse is the list's 400, never an unfiltered CSV.
    bad = ops.get("/audit/?incident=x&_export=csv")
    assert bad.status_code == 400 and not bad["Content-Type"].startswith("text/csv")


def test_node_page_shows_what_dcgm_and_kubernetes_reported(ops: Client, fleet: Cluster,
                                                           settings: Any, tmp_path: Path) -> None:
    settings.FLEETWATCH_SIM_STATE = tmp_path / "sim-fleet.json"  # never seeded
    node = Node.objects.get(name="gpu-002")
    node.nic_ports = {"mlx5_0/1": {"state": "DOWN", "link_downed": 4, "link_error_recovery": 1}}
    node.k8s_annotations = {"fleetwatch.io/cordoned-by": "incident-7"}
    node.k8s_ready_status, node.k8s_unschedulable = "True", True
    node.k8s_labels = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    node.k8s_taints = [["nvidia.com/gpu", "present", "NoSchedule"]]
    node.k8s_conditions = {"SysLogsXIDError": ["True", "SysLogsXIDErrorIsNotHealthy",
                                               "ErrorCode:79 PCI:0000:ef:00"]}
    node.save()
    Gpu.objects.filter(node=node).update(clock_event_reasons=0x40 | 0x08, dbe_total=3.0)
    Signal.objects.create(cluster=fleet, source="dcgm", kind="dcgm_field", node=node,
                          node_name=node.name, gpu_index=0, value="2",
                          data={"metric": "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "value": 2},
                          observed_at=NOW - timedelta(minutes=5))
    Signal.objects.create(cluster=fleet, source="dcgm", kind="dcgm_field", node=node,
                          node_name=node.name, gpu_index=0, value="5",
                          data={"metric": "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "value": 5},
                          observed_at=NOW - timedelta(minutes=1))
    page = ops.get("/nodes/gpu-002/").content.decode()
    clocks = re.search(r'data-testid="gpu-clock-events-0">([^<]*)<', page)
    assert clocks and clocks.group(1) == "hw slowdown, hw thermal slowdown"
    dcgm = re.search(r'data-testid="gpu-dcgm-0">(.*?)</td>', page, re.S)
    # The newest value of the field, once.
    assert dcgm and "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS</code> 5 " in dcgm.group(1)
    assert dcgm.group(1).count("REMAPPED_ROWS") == 1
    assert "<code>mlx5_0/1</code></td><td>DOWN</td><td>4</td>" in page
    assert "fleetwatch.io/cordoned-by=incident-7" in page
    assert "cordoned (unschedulable)" in page
    assert "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3" in page
    assert "nvidia.com/gpu=present:NoSchedule" in page
    conditions = re.search(r'data-testid="node-conditions">(.*?)</dd>', page, re.S)
    assert conditions and "SysLogsXIDError=True" in conditions.group(1)
    assert "ErrorCode:79 PCI:0000:ef:00" in conditions.group(1)
    # Its pods and GPU readings are read as the page opens: here no source answers (the
    # simulated fleet is not seeded), and the page says so.
    assert 'data-testid="pods-unavailable">Pods unavailable: Kubernetes unavailable: ' \
        "simulated fleet not seeded" in page
    assert 'data-testid="readings-unavailable">Readings unavailable: ' in page


def test_incident_list_shows_severity_and_owner_sorts_by_them_and_exports_them(
        ops: Client, fleet: Cluster, operator: Any) -> None:
    from collectors.roles import user_with_role

    other = user_with_role("bea", "operator", "bea-pass-123")[0]
    made = {}
    for i, (severity, owner) in enumerate((("sev3", operator), ("sev1", None),
                                           ("sev4", other), ("sev2", operator))):
        made[severity] = Incident.objects.create(
            cluster=fleet, root_cause="gpu_hardware", confidence=0.9, explanation="XID 79",
            fingerprint=f"fp-{i}", nodes=["gpu-002"], detected_at=NOW, severity=severity,
            owner=owner, opened_at=NOW - timedelta(minutes=i))

    def ids(url: str) -> list[int]:
        return [int(i) for i in re.findall(r'data-testid="incident-row-(\d+)"',
                                           ops.get(url).content.decode())]

    page = ops.get("/incidents/").content.decode()
    row = page[page.index(f'data-testid="incident-row-{made["sev1"].pk}"'):]
    row = row[:row.index("</tr>")]
    assert '<span class="badge sev-sev1">SEV1 critical</span>' in row and ">-</td>" in row
    assert 'data-sort="severity"' in page and 'data-sort="owner"' in page
    # SEV1 first (the worst), then by owner's name (the unowned last).
    assert ids("/incidents/?sort=severity") == [made[s].pk for s in ("sev1", "sev2", "sev3",
                                                                     "sev4")]
    by_owner = ids("/incidents/?sort=owner")
    assert by_owner[0] == made["sev4"].pk and by_owner[-1] == made["sev1"].pk
    assert set(by_owner[1:3]) == {made["sev3"].pk, made["sev2"].pk}

    rows = list(csv.DictReader(io.StringIO(
        ops.get("/incidents/?sort=severity&_export=csv").content.decode())))
    assert [(r["Severity"], r["Owner"]) for r in rows] == [
        ("sev1", ""), ("sev2", operator.username), ("sev3", operator.username), ("sev4", "bea")]
