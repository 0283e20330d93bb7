"""The node agent: NVML (a fake with pynvml's functions), the kernel log and InfiniBand sysfs
(fixture files), the on-disk spool, and pushes to a live FleetWatch over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from collectors import services as collectors
from collectors.agent import __version__
from collectors.agent.infiniband import InfinibandSource
from collectors.agent.kernel import FileReader, KernelLine
from collectors.agent.nvml import NvmlEvents, NvmlSource
from collectors.agent.push import Pusher
from collectors.agent.runner import Agent, KernelLog, StateFile, pci_key
from collectors.agent.spool import Spool
from collectors.knowledge import agent as proto
from collectors.knowledge import dcgm
from collectors.models import Node, Signal
from incidents import diagnosing
from incidents.tokens import agent_token_create
from tests.conftest import token_for, wait_for
from tests.harness.fake_nvml import FakeNvml

XID79 = ("NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, "
         "GPU has fallen off the bus.")


def _nvml(count: int = 2) -> tuple[FakeNvml, NvmlSource]:
    nvml = FakeNvml(count)
    return nvml, NvmlSource("gpu-003", nvml)


def test_fake_nvml_handles_compare_as_pynvml_handles_do() -> None:
    # What broke the old agent: a handle from an event is a new ctypes pointer, never == to
    # the one held (pynvml's handles compare by identity).
    nvml = FakeNvml(1)
    assert nvml.nvmlDeviceGetHandleByIndex(0) != nvml.nvmlDeviceGetHandleByIndex(0)


def test_an_xid_event_names_the_gpu_it_happened_on() -> None:
    nvml, source = _nvml(4)
    seen: list[dict[str, Any]] = []
    events = NvmlEvents(source, seen.extend)
    events.start()
    try:
        assert sorted(g for g, _ in nvml.registered) == [0, 1, 2, 3]
        nvml.fire(2, 79)
        wait_for(lambda: seen, 3, "the XID event")
        nvml.fire(3, dbe=True)
        wait_for(lambda: len(seen) == 2, 3, "the double-bit ECC event")
    finally:
        events.stop()
    assert seen[0] == {"source": "dcgm", "node": "gpu-003", "gpu": 2, "via": "nvml",
                       "metric": dcgm.XID_ERRORS, "value": 79,
                       "uuid": "GPU-00000002-0000-0000-0000-fakefakefake"}
    assert (seen[1]["gpu"], seen[1]["metric"], seen[1]["event"]) == (3, dcgm.ECC_DBE_VOL_TOTAL,
                                                                      "dbe")


def test_nvml_reports_changes_not_samples() -> None:
    nvml, source = _nvml(2)
    assert source.poll() == []  # healthy GPUs at work are not news
    assert source.poll() == []
    nvml.gpus[0].update(clocks=dcgm.HW_THERMAL, temp=91)  # hardware thermal slowdown
    nvml.gpus[1].update(dbe=2, remap=(0, 1, 1, 1))
    found = {(s["gpu"], s["metric"]): s["value"] for s in source.poll()}
    assert found == {(0, dcgm.CLOCKS_EVENT_REASONS): dcgm.HW_THERMAL, (0, dcgm.GPU_TEMP): 91,
                     (1, dcgm.ECC_DBE_VOL_TOTAL): 2, (1, dcgm.UNCORRECTABLE_REMAPPED_ROWS): 1,
                     (1, dcgm.ROW_REMAP_PENDING): 1, (1, dcgm.ROW_REMAP_FAILURE): 1}
    # Still in slowdown: reported again (sustained is what diagnosis needs); the rest is not.
    assert {(s["gpu"], s["metric"]) for s in source.poll()} == {(0, dcgm.CLOCKS_EVENT_REASONS)}
    nvml.gpus[0].update(clocks=0, temp=62)
    assert {(s["gpu"], s["metric"], s["value"]) for s in source.poll()} == {
        (0, dcgm.CLOCKS_EVENT_REASONS, 0), (0, dcgm.GPU_TEMP, 62)}  # the end of it, once
    assert source.poll() == []
    nvml.gpus[1].update(memory_temp=74, power=420_000)  # small moves: not news
    assert source.poll() == []
    nvml.gpus[1].update(memory_temp=88, power=650_000)  # HBM heating, power up by half
    assert {(s["metric"], s["value"], s["previous"]) for s in source.poll()} == {
        (dcgm.MEMORY_TEMP, 88, 70), (dcgm.POWER_USAGE, 650, 400)}


def test_nvml_pcie_link_below_its_maximum_and_nvlink_down_are_reported() -> None:
    nvml, source = _nvml(2)
    nvml.gpus[1].update(pcie_width=8)  # trained at x8 at boot: news on the first reading
    first = source.poll()
    assert [(s["gpu"], s["metric"], s["value"], s["max"]) for s in first] == [
        (1, dcgm.PCIE_LINK_WIDTH, 8, 16)]
    nvml.gpus[0]["nvlink"][2] = False
    nvml.gpus[0]["nvlink_errors"] = 7
    got = {(s["metric"], s["value"]) for s in source.poll()}
    assert got == {(proto.NVLINK_LINKS_DOWN, 1), (dcgm.NVLINK_REPLAY_ERRORS, 7)}


def test_a_gpu_lost_and_a_driver_reload_are_reports_not_crashes() -> None:
    nvml, source = _nvml(2)
    source.poll()
    nvml.gpus[1]["lost"] = True
    got = source.poll()
    assert [(r["event"], r["gpu"]) for r in got] == [(proto.GPU_LOST, 1)]
    assert "GPU is lost" in got[0]["message"]
    assert source.poll() == []  # once
    nvml.gpus[1]["lost"] = False
    assert [r["event"] for r in source.poll()] == [proto.GPU_BACK]
    nvml.driver_loaded = False  # unloaded for an upgrade
    assert [r["event"] for r in source.poll()] == [proto.NVML_UNAVAILABLE]
    nvml.driver_loaded = True
    assert [r["event"] for r in source.poll()] == [proto.NVML_REINIT]
    assert nvml.inits == 2 and len(source.gpus) == 2


def test_a_field_a_gpu_does_not_support_is_left_out() -> None:
    nvml = FakeNvml(1)
    nvml.gpus[0]["supported"] = False  # no ECC, no remapped rows (a consumer GPU)
    source = NvmlSource("gpu-003", nvml)
    assert source.poll() == []
    assert source.utilisation() == {0: 90.0}


def test_kernel_lines_from_a_file_are_sent_once(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,100,1000,-;an old line from before the agent started\n")
    reader = FileReader(kmsg)
    log = KernelLog("gpu-003", reader, StateFile(tmp_path / "state.json"), lambda r: None)
    with kmsg.open("a") as fh:
        fh.write(f"3,101,2000,-;{XID79}\n")
        fh.write("6,102,2100,-;usb 1-1: new high-speed USB device\n")
        fh.write("6,103,2200,-;mlx5_core 0000:0c:00.0 enp12s0np0: Link down\n")
        fh.write("6,104,2300,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=12")  # still being written
    got = log.records(reader.read(0))
    assert [s["message"] for s in got] == [XID79, "mlx5_core 0000:0c:00.0 enp12s0np0: Link down"]
    assert all(s["source"] == "kernel" and s["node"] == "gpu-003" for s in got)
    with kmsg.open("a") as fh:
        fh.write("34, name=python3, An uncorrectable double bit error\n")
    assert [s["message"] for s in log.records(reader.read(0))] == [
        "NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double bit error"]
    assert reader.read(0) == []
    kmsg.write_text(f"{XID79}\n")  # rotated: read from the start
    assert [s["message"] for s in log.records(reader.read(0))] == [XID79]


def test_a_kernel_xid_line_is_given_the_gpu_nvml_knows_at_that_pci_address(tmp_path: Path) -> None:
    _, source = _nvml(4)  # GPUs at 18:00.0, 28:00.0, 38:00.0, 48:00.0
    log = KernelLog("gpu-003", FileReader(tmp_path / "none"), StateFile(tmp_path / "s.json"),
                    lambda r: None,
                    lambda key: next((g.index for g in source.gpus if pci_key(g.pci) == key), None))
    line = "NVRM: Xid (PCI:0000:38:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    assert log.records([KernelLine(line)])[0]["gpu"] == 2
    assert "gpu" not in log.records([KernelLine(line.replace(":38:", ":99:"))])[0]


def _port(root: Path, device: str, port: int, state: str, **counters: int) -> None:
    d = root / device / "ports" / str(port)
    (d / "counters").mkdir(parents=True, exist_ok=True)
    (d / "state").write_text(f"{state}\n")
    for name, value in counters.items():
        (d / "counters" / name).write_text(f"{value}\n")


def test_infiniband_sysfs_reports_state_changes_and_counter_rises(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE", link_downed=3, link_error_recovery=0, symbol_error=0)
    _port(tmp_path, "mlx5_1", 1, "4: ACTIVE", link_downed=0)
    source = InfinibandSource("gpu-004", tmp_path)
    assert source.poll() == []  # the first reading is the baseline, whatever the totals
    _port(tmp_path, "mlx5_0", 1, "1: DOWN", link_downed=4, link_error_recovery=0, symbol_error=0)
    got = source.poll()
    assert {"source": "nic", "node": "gpu-004", "device": "mlx5_0", "port": 1,
            "counter": "link_downed", "value": 4, "previous": 3} in got
    assert {"source": "nic", "node": "gpu-004", "device": "mlx5_0", "port": 1,
            "state": "DOWN"} in got
    assert len(got) == 2
    assert source.poll() == []
    # The HCA falls off the bus: its ports go, which is news once; back, news again.
    import shutil

    shutil.rmtree(tmp_path / "mlx5_1")
    assert source.poll() == [{"source": "nic", "node": "gpu-004", "device": "mlx5_1", "port": 1,
                              "state": "ABSENT"}]
    assert source.poll() == []
    _port(tmp_path, "mlx5_1", 1, "4: ACTIVE", link_downed=0)
    assert source.poll() == [{"source": "nic", "node": "gpu-004", "device": "mlx5_1", "port": 1,
                              "state": "ACTIVE"}]


@pytest.fixture
def fleet_nodes(transactional_db: None, sim_fleet: Any) -> None:
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)


def _agent(tmp_path: Path, url: str, token: str, kmsg: Path) -> Agent:
    runner = Agent("gpu-003", Spool(tmp_path / "spool.jsonl"), Pusher(url, token, timeout=2))
    runner.kernel = KernelLog("gpu-003", FileReader(kmsg, offset=0),
                              StateFile(tmp_path / "state.json"), runner.spool.add)
    return runner


def test_agent_pushes_to_fleetwatch_and_keeps_signals_while_it_is_down(
        fleet_nodes: None, live_server: Any, tmp_path: Path) -> None:
    token = agent_token_create("gpu-003")[1]
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    # FleetWatch unreachable: the signal waits in the spool.
    down = _agent(tmp_path, "http://127.0.0.1:9", token, kmsg)
    kmsg.write_text(f"{XID79}\n")
    assert down.kernel is not None and down.kernel.pass_once(0) == 1
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
                                                     tmp_path: Path) -> None:
    from django.core.management import call_command

    token_file = tmp_path / "token"
    call_command("fleetwatch", "agent-token", "--node", "gpu-006",
                 stdout=token_file.open("w"))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    sysfs = tmp_path / "ib"
    _port(sysfs, "mlx5_0", 1, "4: ACTIVE", link_downed=0)

    with kmsg.open("a") as fh:  # a file is followed from where the state file says: 0
        fh.write("6,1,1,-;mlx5_core 0000:0c:00.0 enp12s0np0: Link down\n")
    (tmp_path / "state.json").write_text(json.dumps({"file": str(kmsg), "file_offset": 0}))

    def one_pass() -> None:
        call_command("fleetwatch", "agent", "--node", "gpu-006", "--url", live_server.url,
                     "--token-file", str(token_file), "--no-nvml", "--passes", "1",
                     "--interval", "0", "--kmsg", str(kmsg), "--sysfs-root", str(sysfs),
                     "--kernel-log", "file", "--state-dir", str(tmp_path))

    one_pass()
    # The kernel log is read in a thread of its own, which a one-pass agent on a busy machine
    # (the suite's other workers) may stop before it has read the file, or after the last
    # send: the line is then sent by the next run, from the spool or from the file (whose
    # offset is kept only once the line is spooled), and never twice (asserted below).
    for _ in range(2):
        if Signal.objects.filter(source="kernel").exists():
            break
        one_pass()
    assert list(Signal.objects.filter(source="kernel").values_list("node_name", "message")) == [
        ("gpu-006", "mlx5_core 0000:0c:00.0 enp12s0np0: Link down")]


def test_a_torn_spool_line_is_skipped_not_fatal(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    spool.add([{"at": "2026-12-03T10:00:00Z", "source": "kernel", "message": "a"}])
    with spool.path.open("a") as fh:
        fh.write('{"at": "2026-12-03T10:00:01Z", "sour')  # power lost mid-write
        fh.write("\n")
    spool.add([{"at": "2026-12-03T10:00:02Z", "source": "kernel", "message": "b"}])
    assert [s["message"] for s in spool.pending(10)] == ["a", "b"]
    spool.drop(1)
    assert [s["message"] for s in spool.pending(10)] == ["b"]


def test_the_spool_at_its_cap_keeps_the_older_records_and_reports_what_it_dropped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = Spool(tmp_path / "spool.jsonl", node="gpu-003", max_bytes=1000,
                  clock=lambda: "2026-12-04T10:00:00.000Z")
    records = [{"at": "2026-12-04T09:00:00Z", "source": "kernel", "node": "gpu-003",
                "message": f"line {i:02d} " + "x" * 60} for i in range(20)]
    written = spool.add(records)
    assert 0 < written < 20 and spool.size() <= 1000
    assert [r["message"] for r in spool.pending(100)] == [r["message"] for r in records[:written]]
    assert spool.dropped == 20 - written
    assert [r.message for r in caplog.records if r.levelname == "ERROR"] == [
        f"spool {spool.path} is full ({spool.size()} bytes waiting, cap 1000): newer records are dropped "
        "until FleetWatch takes the older ones"]
    spool.drop(written)  # FleetWatch is back and took them
    spool.add(records[:1])
    report, first = spool.pending(10)
    assert (report["event"], report["dropped"], report["node"]) == (proto.SPOOL_FULL,
                                                                   20 - written, "gpu-003")
    assert report["since"] == "2026-12-04T10:00:00.000Z" and first == records[0]
    assert spool.dropped == 0


class _Server:
    """A FleetWatch stand-in on a free port, answering what a test says."""

    def __init__(self, answers: dict[tuple[str, str], Any]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.seen: list[tuple[str, str, dict[str, str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile_body = self.rfile.read(length)
                outer.seen.append((self.command, self.path, dict(self.headers)))
                raw = self.rfile_body
                answer = answers.get((self.command, self.path), (404, {"detail": "no"}))
                code, body = answer(json.loads(raw or b"null")) if callable(answer) else answer
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def _run_cli(tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from collectors.agent.cli import main

    (tmp_path / "token").write_text("fw_token\n")
    code = main(["--url", url, "--node", "gpu-003", "--token-file", str(tmp_path / "token"),
                 "--state-dir", str(tmp_path / "state"), "--no-nvml", "--kernel-log", "off",
                 "--sysfs-root", str(tmp_path / "none"), "--passes", "1", "--interval", "0"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("answer", "says"), [
    ((200, {"version": "0.9.0", "protocols": {"oldest": 5, "newest": 6}}),
     "is too old for FleetWatch 0.9.0"),
    ((200, {"version": "0.0.1", "protocols": {"oldest": 1, "newest": 1}}),
     "is newer than FleetWatch 0.0.1"),
])
def test_an_agent_fleetwatch_does_not_take_stops_at_start_and_says_which_to_upgrade(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], answer: tuple[int, Any],
        says: str) -> None:
    server = _Server({("GET", "/api/v1/agent/"): answer})
    try:
        code, err = _run_cli(tmp_path, server.url, capsys)
    finally:
        server.close()
    assert code == 3 and says in err
    assert [(m, p) for m, p, _ in server.seen] == [("GET", "/api/v1/agent/")]  # nothing pushed


def test_a_404_at_the_version_check_is_not_taken_for_a_mismatch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    # A FleetWatch older than the agent, a wrong URL, or an ingress mid-deploy: the agent
    # says so and keeps its signals until it can ask again.
    server = _Server({("GET", "/api/v1/agent/"): (404, {"detail": "Not found."})})
    try:
        code, _ = _run_cli(tmp_path, server.url, capsys)
    finally:
        server.close()
    assert code == 0
    assert "answered 404: the URL is not FleetWatch's, or FleetWatch is older" in caplog.text
    assert {m for m, _, _ in server.seen} == {"GET"}  # never pushed without a version check


def test_an_agent_that_cannot_reach_fleetwatch_at_start_spools_and_checks_later(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    code, _ = _run_cli(tmp_path, "http://127.0.0.1:9", capsys)
    assert code == 0 and "version check postponed (signals are spooled meanwhile)" in caplog.text


def test_a_push_answered_426_keeps_the_spool_whole(tmp_path: Path) -> None:
    server = _Server({("POST", "/api/v1/signals/"): (426, {"detail": "agent speaks 2; upgrade"})})
    try:
        runner = Agent("gpu-003", Spool(tmp_path / "spool.jsonl"), Pusher(server.url, "t"))
        runner.spool.add([{"at": "2026-12-04T10:00:00Z", "source": "kernel", "node": "gpu-003",
                           "message": XID79}])
        assert runner.flush() == 0
        assert len(runner.spool) == 1 and not (tmp_path / "spool.rejected").exists()
        headers = server.seen[0][2]
        assert headers[proto.AGENT_HEADER] == f"fleetwatch-agent/{__version__} protocol={proto.PROTOCOL}"
    finally:
        server.close()


def test_fleetwatch_tells_an_agent_which_protocols_it_takes_and_refuses_others(
        fleet_nodes: None, client: Any) -> None:
    token = agent_token_create("gpu-003")[1]
    r = client.get("/api/v1/agent/", HTTP_AUTHORIZATION=f"Token {token}")
    assert r.status_code == 200 and r.json() == {
        "version": __version__, "protocols": {"oldest": proto.OLDEST_PROTOCOL,
                                              "newest": proto.PROTOCOL},
        "header": "FleetWatch-Agent"}
    good = {"at": "2026-12-03T10:00:00Z", "source": "kernel", "node": "gpu-003", "message": XID79}
    before = Signal.objects.count()
    for header, says in (("fleetwatch-agent/9.0.0 protocol=99", "upgrade FleetWatch"),
                         ("fleetwatch-agent/0.0.1 protocol=0", "install the agent built"),
                         ("fleetwatch-agent/x protocol=two", "speaks push protocol -1")):
        r = client.post("/api/v1/signals/", {"signals": [good]}, content_type="application/json",
                        HTTP_AUTHORIZATION=f"Token {token}", HTTP_FLEETWATCH_AGENT=header)
        assert r.status_code == 426 and says in r.json()["detail"], r.json()
    assert Signal.objects.count() == before
    for header in (proto.agent_header(__version__), None):  # this agent; an older one, or a monitor
        extra = {"HTTP_FLEETWATCH_AGENT": header} if header else {}
        r = client.post("/api/v1/signals/", {"signals": [good]}, content_type="application/json",
                        HTTP_AUTHORIZATION=f"Token {token}", **extra)
        assert r.status_code == 201


def test_the_agent_package_imports_nothing_of_the_server() -> None:
    # What a GPU node installs (collectors/agent/pyproject.toml): no Django, no server module.
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('django', 'rest_framework', 'celery', 'collectors.models'):\n"
            "    sys.modules[name] = None  # importing one fails\n"
            "import collectors.agent.cli\n")
    done = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr


def _nvml_agent(url: str, tmp_path: Path, gpus: int) -> tuple[FakeNvml, NvmlSource, Agent]:
    """An agent for gpu-003 reading a fake NVML, pushing to ``url`` with the node's token."""
    nvml = FakeNvml(gpus)
    source = NvmlSource("gpu-003", nvml)
    runner = Agent("gpu-003", Spool(tmp_path / "spool.jsonl"),
                   Pusher(url, agent_token_create("gpu-003")[1], timeout=5), [source])
    return nvml, source, runner


def test_an_nvml_xid_is_pushed_at_once_not_at_the_next_pass(fleet_nodes: None, live_server: Any,
                                                            tmp_path: Path) -> None:
    import threading

    nvml, source, runner = _nvml_agent(live_server.url, tmp_path, 8)
    runner.events = NvmlEvents(source, runner.urgent)
    # One pass, then a wait of a minute before the next: only the event path can send it.
    loop = threading.Thread(target=runner.run, args=(60.0, 2), daemon=True)
    loop.start()
    try:
        wait_for(lambda: runner.version_ok, 10, "the agent's version check")
        nvml.fire(5, 79)
        # Well before the next pass, a minute away.
        stored = wait_for(lambda: Signal.objects.filter(source="dcgm", node_name="gpu-003",
                                                        gpu_index=5).first(), 20, "the XID")
        assert loop.is_alive()
    finally:
        runner.stopping.set()
        runner.wake.set()
        loop.join(10)
    assert (stored.data["metric"], stored.data["value"]) == (dcgm.XID_ERRORS, 79)
    assert stored.data["uuid"] == "GPU-00000005-0000-0000-0000-fakefakefake"
    assert not loop.is_alive()


def test_a_lost_gpu_reaches_fleetwatch_as_a_signal(fleet_nodes: None, live_server: Any,
                                                   tmp_path: Path) -> None:
    nvml, _, runner = _nvml_agent(live_server.url, tmp_path, 2)
    runner.collect()
    nvml.gpus[1]["lost"] = True
    runner.collect()
    assert runner.flush() == 1
    stored = Signal.objects.get(source="dcgm", node_name="gpu-003")
    assert (stored.gpu_index, stored.data["event"]) == (1, proto.GPU_LOST)
    assert "GPU is lost" in stored.message


def test_a_gpu_without_a_handle_at_start_leaves_the_others_read() -> None:
    nvml = FakeNvml(3)
    real = nvml.nvmlDeviceGetHandleByIndex

    def handle(i: int) -> Any:
        if i == 1:  # fell off the bus before the agent started
            raise nvml.NVMLError(15)  # NVML_ERROR_GPU_IS_LOST
        return real(i)

    nvml.nvmlDeviceGetHandleByIndex = handle  # type: ignore[method-assign]
    source = NvmlSource("gpu-003", nvml)
    first = source.poll()
    assert [(r["event"], r["gpu"]) for r in first] == [(proto.GPU_LOST, 1)]
    nvml.gpus[2].update(dbe=1)
    source.poll()  # baseline of the counters
    nvml.gpus[2].update(dbe=2)
    assert [(r["gpu"], r["metric"]) for r in source.poll()] == [(2, dcgm.ECC_DBE_VOL_TOTAL)]


def test_nvml_unavailable_is_said_once_and_events_resume_after_nvml_restarts() -> None:
    nvml, source = _nvml(2)
    seen: list[dict[str, Any]] = []
    events = NvmlEvents(source, seen.extend)
    events.start()
    try:
        nvml.driver_loaded = False
        reports = source.poll() + source.poll() + source.poll()
        assert [r["event"] for r in reports] == [proto.NVML_UNAVAILABLE]
        nvml.driver_loaded = True
        assert [r["event"] for r in source.poll()] == [proto.NVML_REINIT]
        # The event thread registers on the new handles and goes on.
        wait_for(lambda: events.generation == source.generation, 10, "the new event set")
        nvml.fire(1, 48)
        wait_for(lambda: seen, 5, "an XID after the restart")
    finally:
        events.stop()
    assert (seen[0]["gpu"], seen[0]["value"]) == (1, 48)


def test_the_spool_drains_without_rewriting_itself_and_survives_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from collectors.agent import spool as spool_module

    spool = Spool(tmp_path / "spool.jsonl")
    spool.add([{"at": "2026-12-04T10:00:00Z", "source": "kernel", "message": f"m{i}"}
               for i in range(100)])
    size = spool.size()
    sealed = spool.batch(30)
    assert sealed is not None
    spool.drop(30)
    assert spool.size() == size and len(spool) == 70  # sent records are skipped, not copied
    again = Spool(tmp_path / "spool.jsonl")  # a restart
    assert len(again) == 70 and again.pending(1)[0]["message"] == "m30"
    monkeypatch.setattr(spool_module, "COMPACT_BYTES", 100)
    again.batch(40)
    again.drop(40)  # past the threshold and half the file: the sent part is cut off
    assert again.size() < size / 2 and again.head["offset"] == 0
    assert [r["message"] for r in again.pending(100)] == [f"m{i}" for i in range(70, 100)]


def test_a_spool_left_by_an_older_agent_is_sent_with_its_sealed_key(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    lines = [{"_batch": {"key": "k-old", "count": 2, "tries": 1}},
             *({"at": "2026-12-04T10:00:00Z", "source": "kernel", "message": f"m{i}"}
               for i in range(3))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    spool = Spool(path)
    batch = spool.batch(500)
    assert batch is not None
    assert (batch.key, [s["message"] for s in batch.signals], batch.tries) == ("k-old",
                                                                                ["m0", "m1"], 1)
    assert len(spool) == 3


def test_a_full_disk_counts_records_as_dropped_not_a_crash(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from collectors.agent import spool as spool_module

    spool = Spool(tmp_path / "spool.jsonl", node="gpu-003")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_module.os, "fsync", full)
    assert spool.add([{"at": "2026-12-04T10:00:00Z", "source": "kernel", "message": "x"}]) == 0
    assert spool.dropped == 1
    monkeypatch.undo()
    spool.add([{"at": "2026-12-04T10:00:01Z", "source": "kernel", "message": "y"}])
    got = spool.pending(10)
    assert [(r.get("event"), r.get("dropped"), r["message"]) for r in got][1:] == [
        (None, None, "y")]
    assert (got[0]["event"], got[0]["dropped"]) == (proto.SPOOL_FULL, 1)


def test_a_batch_too_large_for_fleetwatch_is_sent_in_halves(tmp_path: Path) -> None:
    server = _Server({("POST", "/api/v1/signals/"): lambda body: (
        (413, {"detail": "too large"}) if len(body["signals"]) > 2 else (201, {"stored": 1}))})
    try:
        runner = Agent("gpu-003", Spool(tmp_path / "spool.jsonl"), Pusher(server.url, "t"),
                       batch=8)
        runner.spool.add([{"at": "2026-12-04T10:00:00Z", "source": "kernel", "node": "gpu-003",
                           "message": f"m{i}"} for i in range(7)])
        assert runner.flush() == 7 and len(runner.spool) == 0
        assert runner.batch <= 2 and not (tmp_path / "spool.rejected").exists()
    finally:
        server.close()


@pytest.mark.parametrize(("args", "env", "says"), [
    (["--token-file", "/nonexistent/token"], {}, "cannot read the token file /nonexistent/token"),
    ([], {"FLEETWATCH_AGENT_KERNEL_LOG": "jounral"}, "FLEETWATCH_AGENT_KERNEL_LOG='jounral'"),
    ([], {"FLEETWATCH_AGENT_LOG_LEVEL": "LOUD"}, "log level 'LOUD'"),
])
def test_wrong_settings_stop_the_agent_with_status_2_and_say_which(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        args: list[str], env: dict[str, str], says: str) -> None:
    from collectors.agent.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLEETWATCH_AGENT_TOKEN", "fw_token")
    code = main(["--url", "http://127.0.0.1:9", "--state-dir", str(tmp_path), "--no-nvml",
                 "--passes", "1", *args])
    assert code == 2 and says in capsys.readouterr().err


def test_a_second_agent_on_the_same_state_directory_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from collectors.agent.cli import lock_state_dir, main

    held = lock_state_dir(tmp_path)
    assert held is not None
    try:
        code = main(["--url", "http://127.0.0.1:9", "--state-dir", str(tmp_path), "--no-nvml"])
    finally:
        held.close()
    assert code == 2 and "another agent is running with" in capsys.readouterr().err


def test_the_agent_wheel_holds_every_module_of_the_agent() -> None:
    """The wheel lists its files one by one (collectors/agent/pyproject.toml): a module added to
    the agent and not listed there is missing on every GPU node that installs the package, and
    the agent dies at its first import of it."""
    import tomllib

    agent = Path(__file__).resolve().parents[2] / "collectors" / "agent"
    meta = tomllib.loads((agent / "pyproject.toml").read_text())
    listed = set(meta["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"])
    modules = {p.name for p in agent.glob("*.py")}
    assert modules - listed == set(), "agent modules the wheel leaves out"
