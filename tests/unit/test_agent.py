"""The node agent: NVML (a fake with pynvml's functions), the kernel log and InfiniBand sysfs
(fixture files), the on-disk spool, and pushes to a live FleetWatch over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from collectors import agent
from collectors import services as collectors
from collectors.models import Node, Signal
from incidents import diagnosing
from incidents.tokens import agent_token_create
from tests.conftest import token_for

XID79 = ("NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, "
         "GPU has fallen off the bus.")


class FakeNvml:
    """The pynvml functions the agent calls, over a list of GPUs a test changes."""

    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    def __init__(self, count: int = 2) -> None:
        self.gpus = [dict(util=90, temp=60, clocks=0, dbe=0, remap=0) for _ in range(count)]
        self.pending: list[tuple[int, int]] = []  # (gpu index, xid)
        self.registered: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlEventSetCreate(self) -> str:
        return "events"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, events: str) -> None:
        self.registered.append(handle)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self.gpus[h]["util"])

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self.gpus[h]["temp"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self.gpus[h]["clocks"]

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return self.gpus[h]["dbe"]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        if self.gpus[h]["remap"] is None:
            raise self.NVMLError("Not Supported")
        return (0, 0, 0, self.gpus[h]["remap"])

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
        if not self.pending:
            raise self.NVMLError_Timeout()
        gpu, xid = self.pending.pop(0)
        return SimpleNamespace(device=gpu, eventData=xid)


def test_nvml_reports_xid_events_and_changes_not_samples() -> None:
    nvml = FakeNvml(count=2)
    source = agent.NvmlSource("gpu-003", nvml)
    assert nvml.registered == [0, 1]
    assert source.poll() == []  # a healthy GPU at work is not news
    nvml.pending.append((1, 79))
    assert source.xid_events() == [{"source": "dcgm", "node": "gpu-003", "gpu": 1, "via": "nvml",
                                    "metric": "DCGM_FI_DEV_XID_ERRORS", "value": 79}]
    assert source.xid_events() == []  # each event once
    nvml.gpus[0].update(clocks=0x40, temp=91)  # hardware thermal slowdown
    nvml.gpus[1].update(dbe=2, remap=1)
    found = {(s["gpu"], s["metric"]): s["value"] for s in source.poll()}
    assert found == {(0, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"): 0x40, (0, "DCGM_FI_DEV_GPU_TEMP"): 91,
                     (1, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"): 2, (1, "DCGM_FI_DEV_ROW_REMAP_FAILURE"): 1}
    # Still throttling: reported again (sustained is what thermal needs); the remap is not.
    assert {(s["gpu"], s["metric"]) for s in source.poll()} == {
        (0, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"), (0, "DCGM_FI_DEV_GPU_TEMP")}


def test_nvml_field_a_gpu_does_not_support_is_left_unknown() -> None:
    nvml = FakeNvml(count=1)
    nvml.gpus[0]["remap"] = None
    source = agent.NvmlSource("gpu-003", nvml)
    assert source.poll() == []
    assert source.utilisation()[0].remap_failure is False and source.utilisation()[0].util == 90


def test_kernel_log_sends_xid_and_link_lines_once(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,100,1000,-;an old line from before the agent started\n")
    source = agent.KernelLogSource("gpu-003", kmsg)
    with kmsg.open("a") as fh:
        fh.write(f"3,101,2000,-;{XID79}\n")
        fh.write("6,102,2100,-;usb 1-1: new high-speed USB device\n")
        fh.write("6,103,2200,-;mlx5_core 0000:0c:00.0 enp12s0np0: Link down\n")
        fh.write("6,104,2300,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=12")  # still being written
    got = source.poll()
    assert [s["message"] for s in got] == [XID79, "mlx5_core 0000:0c:00.0 enp12s0np0: Link down"]
    assert all(s["source"] == "kernel" and s["node"] == "gpu-003" for s in got)
    with kmsg.open("a") as fh:
        fh.write("34, name=python3, An uncorrectable double bit error\n")
    assert [s["message"] for s in source.poll()] == [
        "NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double bit error"]
    assert source.poll() == []
    kmsg.write_text(f"{XID79}\n")  # rotated: read from the start
    assert [s["message"] for s in source.poll()] == [XID79]


def _port(root: Path, device: str, port: int, state: str, **counters: int) -> None:
    d = root / device / "ports" / str(port)
    (d / "counters").mkdir(parents=True, exist_ok=True)
    (d / "state").write_text(f"{state}\n")
    for name, value in counters.items():
        (d / "counters" / name).write_text(f"{value}\n")


def test_infiniband_sysfs_reports_state_changes_and_counter_rises(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE", link_downed=3, link_error_recovery=0, symbol_error=0)
    _port(tmp_path, "mlx5_1", 1, "4: ACTIVE", link_downed=0)
    source = agent.InfinibandSource("gpu-004", tmp_path)
    assert source.poll() == []  # the first reading is the baseline, whatever the totals
    _port(tmp_path, "mlx5_0", 1, "1: DOWN", link_downed=4, link_error_recovery=0, symbol_error=0)
    got = source.poll()
    assert {"source": "nic", "node": "gpu-004", "device": "mlx5_0", "port": 1,
            "counter": "link_downed", "value": 4, "previous": 3} in got
    assert {"source": "nic", "node": "gpu-004", "device": "mlx5_0", "port": 1,
            "state": "DOWN"} in got
    assert len(got) == 2
    assert source.poll() == []


@pytest.fixture
def fleet_nodes(transactional_db: None, sim_fleet: Any) -> None:
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)


def _agent(tmp_path: Path, url: str, token: str, kmsg: Path) -> agent.Agent:
    return agent.Agent("gpu-003", agent.Spool(tmp_path / "spool.jsonl"),
                       agent.Pusher(url, token, timeout=2),
                       [agent.KernelLogSource("gpu-003", kmsg)])


def test_agent_pushes_to_fleetwatch_and_keeps_signals_while_it_is_down(
        fleet_nodes: None, live_server: Any, tmp_path: Path) -> None:
    token = agent_token_create("gpu-003")[1]
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    # FleetWatch unreachable: the signal waits in the spool.
    down = _agent(tmp_path, "http://127.0.0.1:9", token, kmsg)
    kmsg.write_text(f"{XID79}\n")
    assert down.collect() == 1
    assert down.flush() == 0
    assert len(down.spool) == 1 and not Signal.objects.filter(source="kernel").exists()
    # Back up: the same spool is sent, once.
    up = _agent(tmp_path, live_server.url, token, kmsg)
    assert up.flush() == 1 and len(up.spool) == 0
    assert up.flush() == 0
    stored = Signal.objects.get(source="kernel")
    assert (stored.node_name, stored.message) == ("gpu-003", XID79)
    # Diagnosis reads a pushed line exactly as it reads a replay file's.
    found = diagnosing.diagnose_signals([stored.pk])
    assert [(i.root_cause, list(i.nodes)) for i in found] == [("gpu_hardware", ["gpu-003"])]


def test_agent_token_pushes_only_for_its_own_node(fleet_nodes: None, live_server: Any,
                                                  tmp_path: Path) -> None:
    token = agent_token_create("gpu-003")[1]
    runner = _agent(tmp_path, live_server.url, token, tmp_path / "none")
    runner.spool.add([{"at": "2026-12-03T10:00:00Z", "source": "kernel", "node": "gpu-004",
                       "message": XID79}])
    assert runner.flush() == 1  # refused, moved aside for a person: retrying cannot help
    rejected = [json.loads(line) for line in
                (tmp_path / "spool.rejected").read_text().splitlines()]
    assert "only push signals for gpu-003" in rejected[0]["error"]
    assert rejected[0]["signals"][0]["node"] == "gpu-004"
    assert not Signal.objects.filter(source="kernel").exists()


def _push(client: Any, token: str, body: Any) -> Any:
    return client.post("/api/v1/signals/", body, content_type="application/json",
                       HTTP_AUTHORIZATION=f"Token {token}")


def test_push_api_rejects_bad_batches_whole(fleet_nodes: None, client: Any,
                                            settings: Any) -> None:
    token = agent_token_create("gpu-003")[1]
    good = {"at": "2026-12-03T10:00:00Z", "source": "kernel", "node": "gpu-003",
            "message": XID79}
    before = Signal.objects.count()
    r = _push(client, token, {"signals": [good, {"source": "kernel", "node": "gpu-003"}]})
    assert r.status_code == 400 and "at" in json.dumps(r.json())
    r = _push(client, token, {"signals": [good, {**good, "at": "2026-12-03T10:00:00"}]})
    assert r.status_code == 400 and "UTC offset" in json.dumps(r.json())
    r = _push(client, token, {"signals": [good, {**good, "source": "gossip"}]})
    assert r.status_code == 400 and "source" in json.dumps(r.json())
    r = _push(client, token, "not json at all")
    assert r.status_code == 400
    settings.FLEETWATCH_INGEST_MAX_BATCH = 2
    r = _push(client, token, {"signals": [good] * 3})
    assert r.status_code == 413 and "over the limit of 2" in r.json()["detail"]
    assert Signal.objects.count() == before  # nothing half-written
    r = _push(client, "not-a-token", {"signals": [good]})
    assert r.status_code == 401


def test_operator_pushes_for_any_known_node_but_not_unknown_ones(
        fleet_nodes: None, client: Any, operator: Any) -> None:
    token = token_for(operator)
    rec = {"at": "2026-12-03T10:00:00Z", "source": "dcgm", "node": "gpu-005", "gpu": 2,
           "metric": "DCGM_FI_DEV_XID_ERRORS", "value": 48}
    r = _push(client, token, {"signals": [rec, {**rec, "node": "gpu-999"}]})
    assert r.status_code == 422 and "gpu-999" in r.json()["detail"]
    assert not Signal.objects.filter(node_name="gpu-005", source="dcgm").exists()
    r = _push(client, token, {"signals": [rec]})
    assert r.status_code == 201 and r.json() == {"stored": 1}
    signal = Signal.objects.get(node_name="gpu-005", source="dcgm")
    assert signal.gpu_index == 2 and signal.data["metric"] == "DCGM_FI_DEV_XID_ERRORS"
    assert signal.node == Node.objects.get(name="gpu-005")


def test_viewer_may_not_push(fleet_nodes: None, client: Any, viewer: Any) -> None:
    token = token_for(viewer)
    r = _push(client, token, {"signals": [{"at": "2026-12-03T10:00:00Z", "source": "kernel",
                                           "node": "gpu-003", "message": XID79}]})
    assert r.status_code == 403


def test_agent_command_runs_a_pass_with_a_token_file(fleet_nodes: None, live_server: Any,
                                                     tmp_path: Path, monkeypatch: Any) -> None:
    from django.core.management import call_command

    token_file = tmp_path / "token"
    call_command("fleetwatch", "agent-token", "--node", "gpu-006",
                 stdout=token_file.open("w"))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    sysfs = tmp_path / "ib"
    _port(sysfs, "mlx5_0", 1, "4: ACTIVE", link_downed=0)

    class AppendAfterStart(agent.KernelLogSource):
        # The agent starts at the end of the log; the line arrives after it started.
        def poll(self) -> list[dict[str, Any]]:
            with kmsg.open("a") as fh:
                fh.write("6,1,1,-;mlx5_core 0000:0c:00.0 enp12s0np0: Link down\n")
            return super().poll()

    monkeypatch.setattr(agent, "KernelLogSource", AppendAfterStart)
    call_command("fleetwatch", "agent", "--node", "gpu-006", "--url", live_server.url,
                 "--token-file", str(token_file), "--no-nvml", "--passes", "1",
                 "--interval", "0", "--kmsg", str(kmsg), "--sysfs-root", str(sysfs),
                 "--spool", str(tmp_path / "spool.jsonl"))
    assert list(Signal.objects.filter(source="kernel").values_list("node_name", "message")) == [
        ("gpu-006", "mlx5_core 0000:0c:00.0 enp12s0np0: Link down")]


def test_a_torn_spool_line_is_skipped_not_fatal(tmp_path: Path) -> None:
    spool = agent.Spool(tmp_path / "spool.jsonl")
    spool.add([{"at": "2026-12-03T10:00:00Z", "source": "kernel", "message": "a"}])
    with spool.path.open("a") as fh:
        fh.write('{"at": "2026-12-03T10:00:01Z", "sour')  # power lost mid-write
        fh.write("\n")
    spool.add([{"at": "2026-12-03T10:00:02Z", "source": "kernel", "message": "b"}])
    assert [s["message"] for s in spool.pending(10)] == ["a", "b"]
    spool.drop(1)
    assert [s["message"] for s in spool.pending(10)] == ["b"]
