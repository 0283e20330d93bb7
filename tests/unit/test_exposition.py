"""The exporter text FleetWatch's simulated dcgm-exporter serves, and the pure parts of the
Prometheus client that reads it back (label fallbacks, skipped series, query text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from collectors.clients.base import GpuMetric, NicPort
from collectors.clients.exposition import (
    format_value,
    render_dcgm,
    render_node_infiniband,
)
from collectors.clients.prometheus import (
    GPU_GROUP,
    GPU_QUERIES,
    PrometheusTelemetry,
    _Warnings,
    node_from_instance,
)
from collectors.knowledge.dcgm import CLOCK_THROTTLE_REASONS
from collectors.sim.exporter import SimExporter
from collectors.sim.fleet import SimFleet

# One sample line of the text format: name{labels} value
SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\} (?P<value>\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse(text: str) -> dict[str, list[tuple[dict[str, str], str]]]:
    """A strict reader of the exposition format: every sample belongs to the family whose
    HELP and TYPE came just before it, and every line is one of the three kinds."""
    families: dict[str, list[tuple[dict[str, str], str]]] = {}
    helped = typed = ""
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped = line.split(" ", 3)[2]
            assert helped not in families, f"{helped} printed twice"
        elif line.startswith("# TYPE "):
            _, _, typed, kind = line.split(" ")
            assert typed == helped and kind in {"gauge", "counter"}
            families[typed] = []
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            assert match["name"] == typed, f"{match['name']} outside its family"
            labels = dict(LABEL.findall(match["labels"]))
            assert ",".join(f'{k}="{v}"' for k, v in labels.items()) == match["labels"]
            families[typed].append((labels, match["value"]))
    return families


def gpu(node: str = "gpu-001", index: int = 0, **kw: object) -> GpuMetric:
    values: dict[str, object] = {"uuid": f"GPU-{node}-{index}", "utilization": 97.5,
                                 "temperature": 66.0, "last_xid": 0}
    values.update(kw)
    return GpuMetric(node, index, **values)  # type: ignore[arg-type]


def test_dcgm_page_has_exporter_labels_in_order() -> None:
    text = render_dcgm([gpu(index=3, power_w=512.25, memory_temperature=70, dbe_total=0,
                            nvlink_errors=0, pcie_replays=2)])
    families = parse(text)
    labels, value = families["DCGM_FI_DEV_GPU_UTIL"][0]
    assert list(labels) == ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
                            "DCGM_FI_DRIVER_VERSION"]
    assert labels["gpu"] == "3" and labels["device"] == "nvidia3"
    assert re.fullmatch(r"00000000:[0-9A-F]{2}:00\.0", labels["pci_bus_id"])
    assert labels["Hostname"] == "gpu-001" and value == "97.5"
    assert families["DCGM_FI_DEV_POWER_USAGE"][0][1] == "512.25"
    assert families["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"][0][1] == "2"
    assert "# TYPE DCGM_FI_DEV_XID_ERRORS gauge" in text
    assert "# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered." in text
    assert "# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter" in text
    assert set(families) >= {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_MEMORY_TEMP",
                             "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
                             "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"}


def test_blank_fields_are_left_out_like_dcgm_does() -> None:
    """A GPU off the bus has no utilisation: no line at all, never a 0."""
    families = parse(render_dcgm([gpu(index=0), gpu(index=1, utilization=None,
                                                    temperature=None, last_xid=79)]))
    assert [labels["gpu"] for labels, _ in families["DCGM_FI_DEV_GPU_UTIL"]] == ["0"]
    assert [(labels["gpu"], v) for labels, v in families["DCGM_FI_DEV_XID_ERRORS"]] == [
        ("0", "0"), ("1", "79")]
    assert "DCGM_FI_DEV_POWER_USAGE" not in families  # no GPU reported it
    # Off the bus (neither utilisation nor temperature): its last XID alone, no quiet 0s.
    assert [labels["gpu"] for labels, _ in families["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"]] == ["0"]
    assert [labels["gpu"] for labels, _ in families["DCGM_FI_DEV_ROW_REMAP_FAILURE"]] == ["0"]


def test_label_variants_old_field_name_and_pods() -> None:
    metrics = [gpu(index=0, clock_event_reasons=0x40)]
    lower = parse(render_dcgm(metrics, "hostname", clock_field=CLOCK_THROTTLE_REASONS,
                              pods={("gpu-001", 0): {"container": "main", "namespace": "ml",
                                                     "pod": "train-0"}}))
    labels, value = lower[CLOCK_THROTTLE_REASONS][0]
    assert value == "64" and "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" not in lower
    assert labels["hostname"] == "gpu-001" and "Hostname" not in labels
    assert (labels["container"], labels["namespace"], labels["pod"]) == ("main", "ml", "train-0")
    bare = parse(render_dcgm(metrics, None, instance_port=9400))
    labels, _ = bare["DCGM_FI_DEV_GPU_UTIL"][0]
    assert "Hostname" not in labels and labels["instance"] == "gpu-001:9400"


def test_label_values_are_escaped() -> None:
    text = render_dcgm([gpu(model='A "quoted" \\ model\nx')])
    assert 'modelName="A \\"quoted\\" \\\\ model\\nx"' in text
    parse(text)


@pytest.mark.parametrize(("value", "text"), [
    (0, "0"), (79, "79"), (True, "1"), (455.5, "455.5"), (70.0, "70"),
    (9.223372036854776e18, "9.223372036854776e+18"), (float("nan"), "NaN"),
    (float("inf"), "+Inf")])
def test_values_print_as_go_prints_them(value: float, text: str) -> None:
    assert format_value(value) == text


def test_node_exporter_infiniband_families() -> None:
    ports = [NicPort("gpu-001", "mlx5_0", 1, "ACTIVE", 3, 1, 7),
             NicPort("gpu-002", "mlx5_0", 1, "DOWN", 4)]
    one = parse(render_node_infiniband(ports[:1]))
    assert list(one) == sorted(one)  # the Go client sorts families by name
    assert one["node_infiniband_state_id"] == [({"device": "mlx5_0", "port": "1"}, "4")]
    assert one["node_infiniband_physical_state_id"][0][1] == "5"
    assert one["node_infiniband_link_downed_total"][0][1] == "3"
    assert one["node_infiniband_link_error_recovery_total"][0][1] == "1"
    assert one["node_infiniband_symbol_error_total"][0][1] == "7"
    both = parse(render_node_infiniband(ports, instance_port=9100))
    assert [(labels["instance"], v) for labels, v in both["node_infiniband_state_id"]] == [
        ("gpu-001:9100", "4"), ("gpu-002:9100", "1")]


def test_sim_exporter_page_covers_the_in_service_fleet(tmp_path: Path) -> None:
    fleet = SimFleet(tmp_path / "fleet.json", 20)
    fleet.seed()
    families = parse(SimExporter(tmp_path / "fleet.json", 20).render())
    util = families["DCGM_FI_DEV_GPU_UTIL"]
    assert len(util) == 16 * 8
    assert {labels["instance"] for labels, _ in util} == {f"gpu-{i:03d}:9400" for i in range(1, 17)}
    assert len(families["node_infiniband_state_id"]) == 16
    page = parse(SimExporter(tmp_path / "fleet.json", 20).render("gpu-002"))
    assert {labels["Hostname"] for labels, _ in page["DCGM_FI_DEV_GPU_TEMP"]} == {"gpu-002"}
    assert "instance" not in page["node_infiniband_state_id"][0][0]


# --- the client's pure parts ------------------------------------------------------------------


@pytest.mark.parametrize(("instance", "node"), [
    ("gpu-003:9400", "gpu-003"), ("gpu-003", "gpu-003"), ("gpu-003.dc1.example.com:9100", "gpu-003"),
    # An IP address is no node name (Prometheus's instance unless relabelled).
    ("10.1.2.3:9400", None), ("[fd00::3]:9400", None), ("10.1.2.3", None), ("fd00::3", None)])
def test_node_from_instance(instance: str, node: str | None) -> None:
    assert node_from_instance(instance) == node


def test_unreadable_series_are_skipped_and_reported() -> None:
    client = PrometheusTelemetry("http://127.0.0.1:1")
    series = [
        {"metric": {"Hostname": "gpu-001", "gpu": "0"}, "value": [1.0, "97"]},
        {"metric": {"hostname": "gpu-002", "gpu": "1"}, "value": [1.0, "88"]},
        {"metric": {"instance": "gpu-003:9400", "gpu": "2"}, "value": [1.0, "77"]},
        {"metric": {"Hostname": "gpu-004"}, "value": [1.0, "1"]},  # no gpu label
        {"metric": {"gpu": "0", "job": "dcgm"}, "value": [1.0, "1"]},  # no node at all
        {"metric": {"Hostname": "gpu-005", "gpu": "0"}, "value": [1.0, "NaN"]},
        {"metric": {"Hostname": "gpu-006", "gpu": "0"}, "value": [1.0, "9.223372036854776e+18"]},
        {"metric": {"Hostname": "gpu-007", "gpu": "0"}},  # not a sample at all
    ]
    warnings = _Warnings()
    read = list(client._samples("Q", series, warnings, ("gpu",)))
    assert [(node, value) for node, _, value in read] == [
        ("gpu-001", 97.0), ("gpu-002", 88.0), ("gpu-003", 77.0)]
    text = "\n".join(warnings.finish())
    assert "without gpu" in text and "gpu-004" in text
    assert "without Hostname, hostname or instance" in text
    assert "unreadable value 'NaN'" in text and "gpu-005" in text
    assert "1 DCGM blank value(s)" in text
    assert "malformed series" in text and "gpu-007" in text


def test_queries_aggregate_by_identity_and_honour_options() -> None:
    client = PrometheusTelemetry("http://127.0.0.1:1", matchers='{cluster="a"}', lookback="10m")
    exprs = {q.attr: client._instant_expr(q, GPU_GROUP) for q in GPU_QUERIES}
    assert exprs["utilization"] == (
        "max by (Hostname, hostname, instance, gpu, UUID, uuid, modelName) "
        '(last_over_time(DCGM_FI_DEV_GPU_UTIL{cluster="a"}[10m]))')
    assert "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS" in exprs["clock_event_reasons"]
    assert "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" in exprs["clock_event_reasons"]
    assert exprs["nvlink_errors"].startswith("sum by (")
    assert len(exprs) == len(GPU_QUERIES) <= 12  # a dozen queries whatever the fleet's size


def test_sample_times_and_hidden_gpus(tmp_path: Path) -> None:
    """Test devices of the simulated exporter: a node's samples stamped with a time of their
    own (Prometheus then has one sample per time: no new one until it moves), and a GPU the
    exporter no longer prints (the driver lost it)."""
    text = render_dcgm([gpu(index=0), gpu("gpu-002", 1)], timestamps={"gpu-002": 1700000000.25})
    lines = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_GPU_UTIL{")]
    assert lines[0].endswith("} 97.5") and lines[1].endswith("} 97.5 1700000000250")
    fleet = SimFleet(tmp_path / "fleet.json", 20)
    fleet.seed()
    exporter = SimExporter(tmp_path / "fleet.json", 20)
    exporter.hidden.add(("gpu-003", 5))
    util = parse(exporter.render())["DCGM_FI_DEV_GPU_UTIL"]
    assert len(util) == 16 * 8 - 1
    assert ("gpu-003", "5") not in {(labels["Hostname"], labels["gpu"]) for labels, _ in util}


def test_incremental_queries() -> None:
    """The PromQL of an incremental poll (what tests/bench/collectors.py's model evaluates,
    and tests/integration/test_prometheus.py runs against a real Prometheus)."""
    client = PrometheusTelemetry("http://127.0.0.1:1", matchers='job="dcgm"')
    util = next(q for q in GPU_QUERIES if q.attr == "utilization")
    assert client._new_samples_expr(util, ("Hostname", "gpu"), 1700000000.5) == (
        'max by (Hostname, gpu) (DCGM_FI_DEV_GPU_UTIL{job="dcgm"} and '
        'timestamp(DCGM_FI_DEV_GPU_UTIL{job="dcgm"}) > 1700000000.500)')
    dropped = client._dropped_expr(1700000000.5)
    assert dropped.startswith("count by (Hostname, hostname, instance) (max by (")
    assert " < count by (" in dropped and dropped.endswith("@ 1700000000.500))")
    assert "unless" in client._new_identity_expr(1700000000.5)
    nic = client._nic_changes_expr(1700000000.5)
    assert nic.startswith("max by (__name__, Hostname, hostname, instance, device, port) (")
    assert 'changes(node_infiniband_link_downed_total{job="dcgm"}[300s])) > 0' in nic
    assert 'node_infiniband_state_id{job="dcgm"}) != 4' in nic
    assert '@ 1700000000.500' in nic
    present = client._present_expr(["gpu-001", "gpu-002"])
    assert present.count("group by (") == 3 and 'Hostname=~"gpu\\\\-001|gpu\\\\-002"' in present
