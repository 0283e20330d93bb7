"""The parsers on what the sources really print."""

from __future__ import annotations

import pytest

from collectors.knowledge import dcgm
from collectors.knowledge.slurm import drained_by
from collectors.knowledge.xid import XID_TABLE, xid_info
from incidents.diagnosis import parsers as p

REQUIRED_XIDS = [13, 31, 32, 38, 43, 45, 46, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109,
                 119, 120, 121, 136, 140, 143, *range(144, 151), 154, 155, 156, 158]


@pytest.mark.parametrize("code", REQUIRED_XIDS)
def test_the_xid_table_covers_the_codes_operators_meet(code: int) -> None:
    info = xid_info(code)
    assert info is not None, code
    assert info.meaning and info.action
    assert info.klass in {"gpu_hardware", "gpu_memory", "nvlink", "application", "driver",
                          "consequence", "recovery"}


def test_xid_classes_follow_the_rules() -> None:
    assert {c for c, x in XID_TABLE.items() if x.klass == "nvlink" and x.opens} >= {
        74, 136, *range(144, 151)}
    assert {48, 63, 64, 94, 95, 140} <= {c for c, x in XID_TABLE.items() if x.klass == "gpu_memory"}
    assert {13, 31, 43, 68, 69} <= {c for c, x in XID_TABLE.items() if x.klass == "application"}
    assert XID_TABLE[119].repeat == XID_TABLE[120].repeat == 2
    assert XID_TABLE[45].klass == "consequence" and not XID_TABLE[45].opens


@pytest.mark.parametrize(("line", "code", "pci", "process"), [
    ("NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     79, "0000:9b:00", "<unknown>"),
    ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double bit error "
     "(DBE) has been detected on GPU in the framebuffer at partition 1, subpartition 0.",
     48, "0000:3b:00", "python3"),
    ("Dec 02 10:00:01 gpu-007 kernel: NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New "
     "row marked for remapping, reset gpu to activate.", 63, "0000:10:1c", ""),
    ("[ 8312.440162] NVRM: Xid (0000:86:00): 13, pid=4411, name=python, Graphics Exception",
     13, "0000:86:00", "python"),
])
def test_kernel_xid_lines(line: str, code: int, pci: str, process: str) -> None:
    parsed = p.parse_kernel(line)
    assert isinstance(parsed, p.KernelXid)
    assert (parsed.code, parsed.pci) == (code, pci)
    if process:
        assert parsed.process == process


def test_xid154_names_the_recovery_action() -> None:
    parsed = p.parse_kernel("NVRM: Xid (PCI:0000:3b:00): 154, pid='<unknown>', name=<unknown>, "
                            "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot "
                            "Required)")
    assert isinstance(parsed, p.KernelXid)
    assert parsed.recovery_action == 2
    assert p.recovery_action_name(parsed.recovery_action) == "Node Reboot Required"


@pytest.mark.parametrize(("text", "action"), [
    ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", 1),
    # The "from" name contains a "t": the target is still found.
    ("GPU recovery action changed from 0x2 (Node Reboot Required) to 0x1 (GPU Reset Required)", 1),
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", 0),
    ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", 3),
    ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", 4),
    ("GPU recovery action changed from None to Node Reboot Required.", 2),
])
def test_xid154_recovery_action_in_every_form(text: str, action: int) -> None:
    parsed = p.parse_kernel(f"[ 912.3] NVRM: Xid (PCI:0000:3b:00): 154, pid='<unknown>', "
                            f"name=<unknown>, {text}")
    assert isinstance(parsed, p.KernelXid) and parsed.code == 154
    assert parsed.recovery_action == action


def test_xid154_without_a_readable_action_says_so() -> None:
    parsed = p.parse_kernel("NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed")
    assert isinstance(parsed, p.KernelXid) and parsed.recovery_action is None
    assert p.recovery_action_name(None) == "unknown"


@pytest.mark.parametrize(("line", "up"), [
    ("mlx5_core 0000:0c:00.0 enp12s0np0: Link down", False),
    ("mlx5_core 0000:0c:00.0 enp12s0np0: Link up", True),
    ("kernel: ice 0000:17:00.0 ens1f0: NIC Link is Down", False),
])
def test_netdev_link_lines(line: str, up: bool) -> None:
    parsed = p.parse_kernel(line)
    assert isinstance(parsed, p.NetdevLink)
    assert parsed.up is up


def test_unrelated_kernel_lines_are_noise() -> None:
    assert p.parse_kernel("EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode") is None
    assert p.parse_kernel("mlx5_core 0000:0c:00.0: firmware version: 28.39.1002") is None


@pytest.mark.parametrize(("line", "kind"), [
    ("gpu-003:1234:5678 [3] NCCL INFO NET/IB : Got completion from peer 10.0.0.7<45612> with "
     "error 12, opcode 0, len 0, vendor err 129 (Recv) localGid ::ffff:10.0.0.3", p.NCCL_IB_ERROR),
    ("NET/IB : Got completion from peer 10.0.0.7<45612> with status=12 opcode=0 len=0",
     p.NCCL_IB_ERROR),
    ("NET/IB : Got completion from peer 10.0.0.7<45612> with status=IBV_WC_RETRY_EXC_ERR(12) "
     "opcode=0", p.NCCL_IB_ERROR),
    # NCCL 2.23+: ibv_wc_status_str() in words, then the number.
    ("dgx-a-03:881:902 [5] transport/net_ib.cc:2101 NCCL WARN NET/IB: Got completion from peer "
     "10.12.3.4<51002> with status=transport retry counter exceeded(12) opcode=Send(0) "
     "vendor_err=129  localGid ::ffff:10.12.3.9 hca mlx5_3", p.NCCL_IB_ERROR),
    ("NET/IB/GIN: Got completion from peer 10.0.0.7<45612> with status=12 opcode=0 len=0 vendor "
     "err 129 (Recv)", p.NCCL_IB_ERROR),
    ("NCCL WARN NET/IB : remote process exited or there was a network error", p.NCCL_REMOTE),
    ("[Rank 12] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=88, "
     "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600013 milliseconds "
     "before timing out.", p.NCCL_TIMEOUT),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
     "system error", p.NCCL_ERROR),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", p.APP_OOM),
    ("RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB", p.APP_OOM),
    ("Traceback (most recent call last):", p.APP_TRACEBACK),
    ("ValueError: Expected input batch_size (32) to match target batch_size (16).",
     p.APP_EXCEPTION),
    ("srun: error: gpu-003: task 0: Exited with exit code 1", p.APP_EXIT),
    ("/var/spool/slurmd/job123/slurm_script: line 9: 4411 Segmentation fault (core dumped)",
     p.APP_CRASH),
    # Launcher prefixes: PyTorch 2.x ("[rank3]:"), torchrun --tee ("[default0]:"), srun --label.
    ("[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
     p.APP_EXCEPTION),
    ("[default0]:Traceback (most recent call last):", p.APP_TRACEBACK),
    ("3: ValueError: bad shape", p.APP_EXCEPTION),
    ("0: [rank0]: torch.OutOfMemoryError: CUDA out of memory.", p.APP_OOM),
    # PyTorch's watchdog and c10d's own words for a communicator that failed.
    ("[rank0]:[E1205 10:05:12.331000 4123 ProcessGroupNCCL.cpp:1595] [PG 0 (default_pg) Rank 0] "
     "Process group watchdog thread terminated with exception: NCCL error: unhandled system "
     "error", p.NCCL_ERROR),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
     "peer [10.0.0.2]:29500", p.NCCL_ERROR),
    ("torch.distributed.DistStoreError: Socket Timeout", p.NCCL_ERROR),
    # torchrun's summary that a worker failed: the worker said why; weak on its own.
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", p.APP_EXIT),
    ("[2026-12-05 10:05:20,331] torch.distributed.elastic.multiprocessing.api: [ERROR] failed "
     "(exitcode: 1) local_rank: 0 (pid: 4123) of binary: /usr/bin/python3", p.APP_EXIT),
])
def test_job_output_lines(line: str, kind: str) -> None:
    parsed = p.parse_job_line(line)
    assert parsed is not None and parsed.kind == kind


def test_ordinary_training_output_is_noise() -> None:
    assert p.parse_job_line("step 1200 loss 2.314 lr 3.0e-4 tokens/s 412000") is None
    assert p.parse_job_line("srun: error: gpu-003: task 0: Exited with exit code 0") is None


@pytest.mark.parametrize("line", [
    # A job told to stop (scancel, a time limit, torchrun stopping the other workers).
    "srun: error: gpu-003: task 3: Exited with exit code 143",
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4100 got signal: 15",
    "slurmstepd: error: *** JOB 90002 ON gpu-005 CANCELLED AT 2026-12-05T10:09:00 DUE TO TIME "
    "LIMIT ***",
])
def test_a_job_told_to_stop_is_not_a_failure(line: str) -> None:
    assert p.parse_job_line(line) is None


@pytest.mark.parametrize(("value", "tokens"), [
    (["IDLE", "DRAIN"], {"IDLE", "DRAIN"}),                                  # 23.02+
    ({"state": "down", "state_flags": ["NOT_RESPONDING"]}, {"DOWN", "NOT_RESPONDING"}),  # 22.05
    ("down*", {"DOWN", "NOT_RESPONDING"}),                                   # sinfo
    ("idle+drain", {"IDLE", "DRAIN"}),
    # sinfo's suffixes and short names (man sinfo, NODE STATE CODES)
    ("idle~", {"IDLE", "POWERED_DOWN"}),
    ("mix@", {"MIXED", "REBOOT_REQUESTED"}),
    ("alloc", {"ALLOCATED"}),
    ("drng", {"DRAINING"}),
    (None, set()),
])
def test_slurm_node_states(value: object, tokens: set[str]) -> None:
    assert p.slurm_node_state(value) == tokens


def test_slurm_job_states_and_exit_codes() -> None:
    assert p.slurm_job_state(["NODE_FAIL"]) == p.slurm_job_state("node_fail") == "NODE_FAIL"
    assert p.slurm_exit_code(256) == p.ExitCode(1, None)      # 22.05: raw wait status
    assert p.slurm_exit_code(0) == p.ExitCode(0, None)
    assert p.slurm_exit_code("1:0") == p.ExitCode(1, None)
    assert p.slurm_exit_code("0:9") == p.ExitCode(0, 9)
    modern = {"status": ["FAILED"], "return_code": {"set": True, "infinite": False, "number": 2},
              "signal": {"id": {"set": False, "infinite": False, "number": 0}, "name": ""}}
    assert p.slurm_exit_code(modern) == p.ExitCode(2, None)
    assert p.slurm_exit_code({"status": "SUCCESS", "return_code": 0}).failed is False
    assert p.slurm_exit_code(None) is None


def test_clock_event_reason_bits() -> None:
    assert dcgm.clock_event_reasons(0x40 | 0x8) == ["hw slowdown", "hw thermal slowdown"]
    assert dcgm.clock_event_reasons(0x80) == ["hw power brake slowdown"]
    assert not 0x80 & dcgm.THERMAL_BITS and 0x20 & dcgm.THERMAL_BITS


def test_kubernetes_ready_condition() -> None:
    assert p.k8s_ready("Ready", "True") is True
    assert p.k8s_ready("Ready", "Unknown") is False
    assert p.k8s_ready("MemoryPressure", "True") is None


@pytest.mark.parametrize(("mask", "in_run", "thermal"), [
    (0x0, False, False),
    (0x40, False, True),        # hw thermal
    (0x20, False, True),        # sw thermal
    (0x48, False, True),
    (0x8, False, True),         # hw slowdown alone: heat, if the GPU is hot (checked later)
    (0x88, False, False),       # hw slowdown from the power brake
    (0x88, True, True),         # ... unless the GPU was already slowing down for heat
    (0x80, True, False),
    (0x4 | 0x1, False, False),  # power cap, idle
])
def test_clock_event_masks_that_mean_heat(mask: int, in_run: bool, thermal: bool) -> None:
    assert dcgm.thermal_mask(mask, in_run) is thermal


def test_exporter_labels_and_samples_given_as_strings_are_read_as_numbers() -> None:
    from datetime import UTC, datetime

    from incidents.diagnosis.types import Observation

    at = datetime(2026, 12, 2, tzinfo=UTC)
    o = Observation.from_record({"source": "dcgm", "node": "n1", "gpu": "3",
                                 "metric": "DCGM_FI_DEV_XID_ERRORS", "value": "79"}, at)
    assert (o.gpu, o.value) == (3, 79.0)
    o = Observation.from_record({"source": "dcgm", "node": "n1", "gpu": "x",
                                 "metric": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "value": "0x40"}, at)
    assert (o.gpu, o.value) == (None, 64.0)
    o = Observation.from_record({"source": "dcgm", "gpu": True, "value": "n/a"}, at)
    assert (o.gpu, o.value) == (None, None)


@pytest.mark.parametrize(("text", "key"), [
    ("PCI:0000:3B:00", "0000:3b:00"), ("0000:3b:00.0", "0000:3b:00"),
    ("00000000:3B:00.0", "0000:3b:00"), ("3b:00.0", "0000:3b:00"), ("0019:01:00", "0019:01:00"),
])
def test_every_spelling_of_a_gpu_address_is_one_key(text: str, key: str) -> None:
    # XID lines, AER lines and NVML each spell the address their own way; one GPU, one key.
    assert p.pci_address(text) == key


def test_who_drained_a_node_is_read_from_the_reason() -> None:
    assert drained_by("Low RealMemory [slurm@2024-12-19T11:03:34]") == "slurmctld"
    assert drained_by("swap PSU [root@2024-12-19T11:03:34]") == "an administrator"
    assert drained_by("swap PSU") == "an administrator"


def test_a_kernel_lines_reading_is_kept_for_the_next_run_within_bounds() -> None:
    """Diagnosis runs re-read their window's kernel lines; a short line's reading is kept (the
    same frozen object), a long one read each time, so whatever is pushed (up to 4,000
    characters a message) the cache stays within KEPT_LINES short lines."""
    line = "NVRM: Xid (PCI:0000:8a:00): 79, pid=2231, name=python, GPU has fallen off the bus."
    first = p.parse_kernel(line)
    assert isinstance(first, p.KernelXid) and first.code == 79
    assert p.parse_kernel(line) is first
    long_line = line + " " + "x" * p.KEPT_LINE_CHARS
    assert p.parse_kernel(long_line) == p.parse_kernel(long_line)
    assert p.parse_kernel(long_line) is not p.parse_kernel(long_line)
    assert p._parse_kernel_kept.cache_info().maxsize == p.KEPT_LINES
