"""Node clocks: offsets told from what several sources say about one moment, and the rules
reading a skewed node's lines on the cluster's clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from incidents.diagnosis import JobInfo, Observation, clocks, diagnose, diagnose_window
from incidents.diagnosis.facts import extract

T0 = datetime(2026, 12, 5, 10, 0, tzinfo=UTC)
RANKS = ("gpu-001", "gpu-002", "gpu-003", "gpu-004")
XID79 = "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID31 = ("NVRM: Xid (PCI:0000:ba:00): 31, pid=7712, name=python, Ch 00000018, intr 00000000. "
         "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7fa0_12000000.")


def watchdog(rank: int, seq: int = 4411) -> str:
    return (f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, "
            "OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for "
            "600021 milliseconds before timing out.")


def obs(seconds: float, source: str, **fields: Any) -> Observation:
    return Observation.from_record({"source": source, **fields}, T0 + timedelta(seconds=seconds))


def skews(window: list[Observation]) -> dict[str, float]:
    found = clocks.estimate(extract(sorted(window, key=lambda o: o.at)))
    return {node: skew.offset for node, skew in found.items()}


def test_the_rank_whose_watchdog_fires_minutes_apart_from_the_others_has_the_clock_off() -> None:
    window = [obs(600 + i, "job_log", job="9", node=n, message=watchdog(i * 8))
              for i, n in enumerate(RANKS)]
    window[2] = obs(600 + 2 + 185, "job_log", job="9", node=RANKS[2], message=watchdog(16))
    found = skews(window)
    assert set(found) == {RANKS[2]}
    assert found[RANKS[2]] == pytest.approx(184, abs=2)


def test_ranks_seconds_apart_are_not_a_skew() -> None:
    window = [obs(600 + 4 * i, "job_log", job="9", node=n, message=watchdog(i * 8))
              for i, n in enumerate(RANKS)]
    assert skews(window) == {}


def test_a_kernel_xid_minutes_after_dcgm_read_it_is_a_clock_ahead() -> None:
    window = [obs(t, "dcgm", node="gpu-002", gpu=5, metric="DCGM_FI_DEV_XID_ERRORS",
                  value=79 if t >= 330 else 0) for t in range(0, 600, 30)]
    window.append(obs(330 + 240, "kernel", node="gpu-002", message=XID79))
    found = skews(window)
    # The exporter read it up to a scrape (and its own collection, 45 s together when the
    # window does not show the interval) after the moment: 240 to 285 s ahead; the middle.
    assert found["gpu-002"] == pytest.approx(240 + 45 / 2)


def test_a_kernel_xid_seconds_after_the_gauge_is_a_right_clock() -> None:
    window = [obs(0, "dcgm", node="gpu-002", gpu=5, metric="DCGM_FI_DEV_XID_ERRORS", value=79),
              obs(5, "kernel", node="gpu-002", message=XID79)]
    assert skews(window) == {}


def test_a_repeated_xid_is_not_paired_with_a_gauge_reading_of_another() -> None:
    # XID 31 twice, five minutes apart; the gauge read 31 once (it stays 31 after): only the
    # second line is that reading's, and it is 20 s before it.
    window = [obs(0, "dcgm", node="gpu-002", gpu=6, metric="DCGM_FI_DEV_XID_ERRORS", value=0),
              obs(20, "kernel", node="gpu-002", message=XID31),
              obs(310, "kernel", node="gpu-002", message=XID31),
              obs(330, "dcgm", node="gpu-002", gpu=6, metric="DCGM_FI_DEV_XID_ERRORS", value=31)]
    assert skews(window) == {}


def test_output_after_slurm_saw_the_job_end_bounds_the_clock() -> None:
    window = [obs(10, "slurm", job="9", job_state="RUNNING", nodes=list(RANKS)),
              obs(100, "job_log", job="9", node="gpu-003", message="step 10 loss 1.2"),
              obs(300, "slurm", job="9", job_state="FAILED", nodes=list(RANKS), exit_code=1),
              obs(420, "job_log", job="9", node="gpu-003", message="step 11 loss 1.1")]
    found = skews(window)
    assert found["gpu-003"] == pytest.approx(115, abs=1)


def test_a_skewed_node_fault_is_read_before_its_consequences() -> None:
    """gpu-002's clock is 4 minutes ahead: its XID 79 is stamped after the other ranks'
    watchdog timeouts and after Slurm failed the job, but its own rank's output after the
    job's end gives the clock away; one GPU fault, the job's failure is its consequence."""
    job = JobInfo("9", "alice", RANKS)
    window = [obs(10, "slurm", job="9", job_state="RUNNING", nodes=list(RANKS))]
    window += [obs(900 + i, "job_log", job="9", node=n, message=watchdog(i * 8))
               for i, n in enumerate(RANKS) if n != "gpu-002"]
    window += [obs(905, "job_log", job="9", node="gpu-001",
                   message="[rank0]: ValueError: step produced no gradients"),
               obs(910, "slurm", job="9", job_state="FAILED", nodes=list(RANKS), exit_code=1),
               obs(300 + 240, "kernel", node="gpu-002", message=XID79),
               obs(1150, "job_log", job="9", node="gpu-002",
                   message="[rank8]: RuntimeError: CUDA error: unspecified launch failure")]
    result = diagnose_window(sorted(window, key=lambda o: o.at), {}, [job])
    assert [(d.root_cause, d.nodes) for d in result.diagnoses] == [("gpu_hardware", ("gpu-002",))]
    [note] = [n for n in result.notes if n.kind == "clock"]
    assert note.nodes == ("gpu-002",) and "ahead" in note.text


def test_without_anchors_nothing_is_moved() -> None:
    window = [obs(100, "kernel", node="gpu-002", message=XID79)]
    [d] = diagnose(window)
    assert d.detected_at == T0 + timedelta(seconds=100)
