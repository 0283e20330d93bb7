"""Fail-slow (incidents.diagnosis.slow): a node slower than its job's peers, with its numbers.

The analysis is pure: these tests build a window of readings by hand (every GPU of a job, a
reading a minute) and check what a person reads: who is blamed, and the figures, gaps and
durations the explanation gives. The replay scenarios (tests/scenarios/fail-slow-*,
healthy-*) check the same through ``diagnose``; the benchmark (tests/bench/fail_slow.py)
measures it on simulated fleets.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from collectors.knowledge import dcgm
from incidents.diagnosis import JobInfo, Observation, diagnose_window
from incidents.diagnosis.progress import parse_checkpoint, parse_pace, parse_straggler_report
from incidents.diagnosis.slow import Thresholds, Window, analyse, parse_downtrain

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC).timestamp()
NODES = [f"gpu-{i:03d}" for i in range(1, 9)]
Readings = dict[tuple[str, int], dict[str, list[tuple[float, float, int | None]]]]


def _window(effect: Callable[[str, int, int], dict[str, float]] | None = None, *,
            nodes: list[str] = NODES, gpus: int = 4, minutes: int = 20,
            fields: tuple[str, ...] = (dcgm.SM_CLOCK, dcgm.POWER_USAGE, dcgm.GPU_UTIL),
            seed: int = 1) -> Readings:
    """Every GPU of the job, one reading a minute: clocks at 1,980 MHz (a little jitter),
    power near 690 W, utilisation in the 90s; ``effect(node, gpu, minute)`` changes one."""
    rng = random.Random(seed)
    readings: Readings = {}
    for node in nodes:
        for g in range(gpus):
            series = readings.setdefault((node, g), {})
            for m in range(minutes):
                fx = effect(node, g, m) if effect else {}
                t = T0 + 60 * m + 7
                values = {
                    dcgm.SM_CLOCK: fx.get("mhz") or rng.choice((1965, 1980, 1980, 1995))
                    * fx.get("clock", 1.0),
                    dcgm.POWER_USAGE: rng.uniform(670, 710) * fx.get("power", 1.0),
                    dcgm.GPU_UTIL: min(100.0, rng.uniform(93, 99) + fx.get("util", 0.0)),
                    dcgm.CLOCKS_EVENT_REASONS: fx.get("reasons", 0.0),
                    dcgm.PCIE_LINK_GEN: fx.get("gen", 5.0), dcgm.PCIE_MAX_LINK_GEN: 5.0,
                    dcgm.PCIE_LINK_WIDTH: fx.get("width", 16.0), dcgm.PCIE_MAX_LINK_WIDTH: 16.0,
                }
                for name in fields:
                    series.setdefault(name, []).append((t, values[name], None))
    return readings


JOB = JobInfo("4123", "alice", tuple(NODES))


def _slow(node: str, gpu: int | None, since: int, **fx: float
          ) -> Callable[[str, int, int], dict[str, float]]:
    def effect(n: str, g: int, m: int) -> dict[str, float]:
        return dict(fx) if n == node and (gpu is None or g == gpu) and m >= since else {}
    return effect


def test_one_gpu_with_a_low_sm_clock_is_found_with_its_numbers() -> None:
    readings = _window(_slow("gpu-007", 3, 8, mhz=1110, reasons=dcgm.SW_POWER_CAP))
    for g in range(4):  # the clock-event reasons, read for every GPU
        readings[("gpu-007", g)][dcgm.CLOCKS_EVENT_REASONS] = [
            (T0 + 60 * m + 7, dcgm.SW_POWER_CAP if g == 3 and m >= 8 else 0, None)
            for m in range(20)]
    result = analyse(Window([JOB], readings))
    (finding,) = result.findings
    assert finding.node == "gpu-007" and finding.gpus == (3,) and finding.jobs == ("4123",)
    text = finding.explanation
    assert text.startswith("gpu-007 is slower than the other 7 nodes of job 4123 (alice): "
                           "GPU 3: SM clock 1,110 MHz vs its peers' median 1,980 MHz (-44%) "
                           "for 12 min from 10:08")
    assert "clock-event reasons: sw power cap" in text
    # One figure alone waits for a person: below automatic repair.
    assert finding.confidence < 0.8
    (clock,) = [d for d in finding.deviations if d.field == dcgm.SM_CLOCK]
    assert clock.value == pytest.approx(1110, abs=1) and clock.peers == pytest.approx(1980)
    assert clock.seconds == 12 * 60


def test_a_power_capped_node_agrees_on_two_figures_and_is_surer() -> None:
    readings = _window(_slow("gpu-002", None, 5, clock=0.78, power=0.6, util=3))
    (finding,) = analyse(Window([JOB], readings)).findings
    assert finding.node == "gpu-002" and finding.gpus == (0, 1, 2, 3)
    assert "GPUs 0-3: SM clock" in finding.explanation
    assert "power" in finding.explanation and "(-40%)" in finding.explanation
    assert finding.confidence >= 0.7


def test_a_pcie_link_below_its_maximum_while_working_is_direct_evidence() -> None:
    fields = (dcgm.SM_CLOCK, dcgm.GPU_UTIL, dcgm.PCIE_LINK_GEN, dcgm.PCIE_MAX_LINK_GEN,
              dcgm.PCIE_LINK_WIDTH, dcgm.PCIE_MAX_LINK_WIDTH)
    # Gen3 on one GPU; it works while its peers wait for it (their utilisation 15 points down).
    def effect(n: str, g: int, m: int) -> dict[str, float]:
        if n == "gpu-005" and g == 1:
            return {"gen": 3, "util": 4}
        return {"util": -15}
    (finding,) = analyse(Window([JOB], _window(effect, fields=fields))).findings
    assert finding.node == "gpu-005"
    assert "GPU 1: PCIe Gen3 x16 while working (max Gen5 x16)" in finding.explanation
    assert "while its peers wait for it" in finding.explanation


def test_a_narrow_link_alone_is_a_finding_that_waits_for_a_person() -> None:
    fields = (dcgm.SM_CLOCK, dcgm.GPU_UTIL, dcgm.PCIE_LINK_WIDTH, dcgm.PCIE_MAX_LINK_WIDTH)
    result = analyse(Window([JOB], _window(_slow("gpu-004", 2, 0, width=8), fields=fields)))
    (finding,) = result.findings
    assert finding.node == "gpu-004" and finding.confidence == 0.55
    assert "GPU 2: PCIe x16 while working" not in finding.explanation
    assert "GPU 2: PCIe x8 while working (max x16)" in finding.explanation
    assert "Nothing else in the window shows how much it holds the job back" in \
        finding.explanation


def test_a_narrow_link_read_once_is_only_noted() -> None:
    readings = _window(fields=(dcgm.SM_CLOCK, dcgm.GPU_UTIL))
    readings[("gpu-004", 2)][dcgm.PCIE_LINK_WIDTH] = [(T0 + 307, 8.0, None)]
    readings[("gpu-004", 2)][dcgm.PCIE_MAX_LINK_WIDTH] = [(T0 + 307, 16.0, None)]
    result = analyse(Window([JOB], readings))
    assert result.findings == []
    (note,) = result.notes
    assert note.node == "gpu-004" and "PCIe x8 while working (max x16)" in note.text


def test_gen1_while_idle_is_power_saving_not_a_narrow_link() -> None:
    fields = (dcgm.GPU_UTIL, dcgm.PCIE_LINK_GEN, dcgm.PCIE_MAX_LINK_GEN)
    result = analyse(Window([JOB], _window(_slow("gpu-004", None, 0, gen=1, util=-95),
                                           fields=fields)))
    assert result.findings == [] and result.notes == []


@pytest.mark.parametrize(("name", "effect"), [
    # Every GPU of the job at once (a rack's power cap): nobody is slower than the peers.
    ("whole job", lambda n, g, m: {"clock": 0.75, "power": 0.6} if m >= 5 else {}),
    # A dip shorter than the sustained time.
    ("blip", lambda n, g, m: {"clock": 0.6} if n == "gpu-003" and g == 0 and 6 <= m < 9 else {}),
    # Pipeline stages: different work, a steady 12 % apart in power.
    ("stages", lambda n, g, m: {"power": 0.88} if n in ("gpu-001", "gpu-008") else {}),
    # Jitter only.
    ("quiet", lambda n, g, m: {}),
    # The job ends unevenly: idle nodes are not slow nodes.
    ("ending", lambda n, g, m: {"util": -97, "clock": 0.17, "power": 0.1}
     if m >= 14 + NODES.index(n) % 4 else {}),
    # A checkpoint every 5 minutes: everyone idle for a minute.
    ("checkpoints", lambda n, g, m: {"util": -95, "clock": 0.2} if m % 5 == 4 else {}),
])
def test_look_alikes_stay_quiet(name: str, effect: Callable[[str, int, int], dict[str, float]]
                                ) -> None:
    assert analyse(Window([JOB], _window(effect))).findings == [], name


def test_a_node_is_compared_with_its_own_job_only() -> None:
    """Two jobs: one runs 25 % slower clocks everywhere (its own setting), the other not. No
    node of either is slower than its own job's peers."""
    a = JobInfo("1", "a", tuple(NODES[:4]))
    b = JobInfo("2", "b", tuple(NODES[4:]))
    readings = _window(lambda n, g, m: {"clock": 0.75} if n in NODES[:4] else {})
    assert analyse(Window([a, b], readings)).findings == []


def test_one_node_jobs_compare_a_gpu_with_its_node_mates() -> None:
    job = JobInfo("77", "kim", ("gpu-001",))
    readings = _window(_slow("gpu-001", 5, 4, clock=0.75), nodes=["gpu-001"], gpus=8)
    (finding,) = analyse(Window([job], readings)).findings
    assert finding.explanation.startswith("gpu-001 GPU 5 is slower than its node-mates in job 77")


def test_one_gpu_jobs_are_not_compared() -> None:
    jobs = [JobInfo(str(g), "u", ("gpu-001",), {"gpu-001": (g,)}) for g in range(4)]
    readings = _window(lambda n, g, m: {"clock": 1 - 0.1 * g}, nodes=["gpu-001"])
    assert analyse(Window(jobs, readings)).findings == []


def test_a_job_that_ended_is_not_compared_after_its_end() -> None:
    readings = _window(_slow("gpu-006", None, 12, clock=0.5))
    ended = T0 + 60 * 12
    assert analyse(Window([JOB], readings, spans={"4123": (T0, ended)})).findings == []
    assert analyse(Window([JOB], readings)).findings  # running: found


def test_the_sustained_time_is_a_threshold() -> None:
    readings = _window(_slow("gpu-006", 0, 13, clock=0.7))  # the last 7 minutes
    assert analyse(Window([JOB], readings)).findings
    assert not analyse(Window([JOB], readings), Thresholds(sustain_s=600)).findings


def test_node_iteration_times_are_a_figure_and_the_jobs_slowdown_is_told() -> None:
    jobs = [JOB]
    paces = {}
    for i, node in enumerate(NODES):
        series = []
        for m in range(20):
            line = f"step {100 + m} took {1.02 * (1.15 if node == 'gpu-003' else 1.0):.3f} s"
            pace = parse_pace(line)
            assert pace is not None
            series.append((T0 + 60 * m + i, pace, None))
        paces[("4123", node)] = series
    (finding,) = analyse(Window(jobs, {}, paces)).findings
    assert finding.node == "gpu-003"
    assert "its own iteration time 1,173 ms vs its peers' median 1,020 ms (+15%)" in \
        finding.explanation


def test_rank_zeros_iteration_time_says_how_much_the_job_slowed() -> None:
    readings = _window(_slow("gpu-008", 1, 6, clock=0.7))
    paces = {("4123", "gpu-001"): [
        (T0 + 60 * m, p, None) for m in range(20)
        if (p := parse_pace(f" iteration {1000 + m * 10}/ 500000 | elapsed time per iteration "
                            f"(ms): {1020 * (1.3 if m >= 7 else 1.0):.1f} |")) is not None]}
    (finding,) = analyse(Window([JOB], readings, paces)).findings
    assert "Job 4123's iteration time went from 1,020 ms to 1,326 ms (+30%)" in \
        finding.explanation


def test_the_replay_engine_finds_it_and_a_harder_fault_wins() -> None:
    at = datetime.fromtimestamp
    obs = []
    readings = _window(_slow("gpu-007", 3, 5, clock=0.6))
    for (node, gpu), series in readings.items():
        for metric, samples in series.items():
            obs += [Observation(at(t, UTC), "dcgm", node, gpu, metric=metric, value=v)
                    for t, v, _ in samples]
    obs.sort(key=lambda o: o.at)
    found = diagnose_window(obs, {}, [JOB]).diagnoses
    assert [(d.root_cause, d.nodes) for d in found] == [("fail_slow", ("gpu-007",))]
    assert found[0].playbook == "replace_at_checkpoint"
    xid = Observation(at(T0 + 60 * 15, UTC), "kernel", "gpu-007", message=(
        "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
        "the bus."))
    result = diagnose_window([*obs, xid], {}, [JOB])
    assert [(d.root_cause, d.nodes) for d in result.diagnoses] == [("gpu_hardware", ("gpu-007",))]
    assert any("also slower than its job's peers" in n.text for n in result.notes)


# --- parsers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("line", "kind", "value"), [
    (" iteration     1040/  500000 | consumed samples: 532480 | elapsed time per iteration (ms):"
     " 1461.5 | learning rate: 2.987E-04 |", "time", 1.4615),                      # Megatron-LM
    ("[NeMo I 2026-01-01 12:00:00 perf_metrics:42] train_step_timing in s=1.234", "time", 1.234),
    ("[Rank 0] iter time (s): 0.842 samples/sec: 152.0", "time", 0.842),            # DeepSpeed
    ("Epoch 0:  12%|#2 | 120/1000 [01:23<10:12,  1.44it/s, loss=2.3]", "it/s", 1.44),  # tqdm
    ("Epoch 0:  12%|#2 | 120/1000 [06:23<47:12,  3.21s/it, loss=2.3]", "time", 3.21),
    ("[rank0]:[titan] step:  10  loss:  9.95  memory: 35.2GiB(37%)  tps: 5,213  mfu: 24%",
     "tokens/s", 5213.0),                                                              # torchtitan
    ("{'train_runtime': 100.0, 'train_samples_per_second': 40.1, 'epoch': 1.0}", "samples/s",
     40.1),                                                                            # HF
    ("step_time=1234ms", "time", 1.234),
    ("iteration 120 took 1.5 s", "time", 1.5),
    ("850 ms/iter", "time", 0.85),
])
def test_pace_lines_of_the_common_frameworks(line: str, kind: str, value: float) -> None:
    pace = parse_pace(line)
    assert pace is not None and pace.kind == kind and pace.value == pytest.approx(value)


@pytest.mark.parametrize("line", [
    "lm loss: 2.05 | learning rate: 3E-4", "number of skipped iterations: 0",
    "Saving model checkpoint to out/checkpoint-500", "NCCL INFO Channel 00/32",
])
def test_lines_without_a_pace(line: str) -> None:
    assert parse_pace(line) is None


def test_straggler_reports_one_line_or_one_rank_per_line() -> None:
    one = parse_straggler_report("STRAGGLER DETECTION: GPU relative performance: Worst "
                                 "performing 2/64 ranks: Rank=24 Node=gpu-f04 Score=0.54, "
                                 "Rank=27 Node=gpu-f04 Score=0.55")
    assert one is not None and one.section == "relative"
    assert [(s.rank, s.node, s.score) for s in one.scores] == [(24, "gpu-f04", 0.54),
                                                                (27, "gpu-f04", 0.55)]
    lone = parse_straggler_report("  Rank=76 Node=h100-001-253-012 Score=0.94")
    assert lone is not None and lone.section == "" and lone.scores[0].node == "h100-001-253-012"


@pytest.mark.parametrize(("line", "step"), [
    (" successfully saved checkpoint from iteration    2000 to /ckpt [ t 1/8, p 1/1 ]", 2000),
    ("Saving model checkpoint to out/checkpoint-500", 500),
    ("Epoch 3, global step 4000: 'val_loss' reached 1.23 (best 1.23), saving model to '/x'", 4000),
    ("checkpoint saved at step 400", 400),
])
def test_checkpoint_lines(line: str, step: int) -> None:
    saved = parse_checkpoint(line)
    assert saved is not None and saved.step == step


def test_a_failed_checkpoint_is_not_one() -> None:
    assert parse_checkpoint("failed to save checkpoint: disk full") is None


def test_the_kernels_downtrain_line() -> None:
    line = parse_downtrain("[   40.000000] nvidia 0000:5d:00.0: 63.012 Gb/s available PCIe "
                           "bandwidth, limited by 16.0 GT/s PCIe x4 link at 0000:5b:01.0 "
                           "(capable of 252.048 Gb/s with 16.0 GT/s PCIe x16 link)")
    assert line is not None
    assert (line.driver, line.pci, line.gen, line.width, line.cap_gen, line.cap_width) == (
        "nvidia", "0000:5d:00.0", 4, 4, 4, 16)
    # The same line for a link at its best says nothing is wrong.
    assert parse_downtrain("nvidia 0000:5d:00.0: 504.112 Gb/s available PCIe bandwidth, limited "
                           "by 32.0 GT/s PCIe x16 link at 0000:5b:01.0 (capable of 504.112 Gb/s "
                           "with 32.0 GT/s PCIe x16 link)") is None
