"""What the engine does to stay linear at 100,000 GPUs, held to the verdicts it gave before.

The window is read as it comes and sorted only when it is out of order; the rules look up
leaves, symptom lines and faults in indexes instead of scanning fleet-wide lists. These tests
pin the readings that depend on order and on those look-ups.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

from incidents.diagnosis import JobInfo, Observation, diagnose, diagnose_window, facts

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
XID79 = "NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
WATCHDOG = "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7) ran for 600013 ms"


def obs(seconds: float, source: str, ident: int | None = None, **fields: Any) -> Observation:
    return Observation.from_record({"source": source, **fields}, T0 + timedelta(seconds=seconds),
                                   id=ident)


def dcgm(seconds: float, node: str, gpu: int, metric: str, value: float,
         ident: int | None = None) -> Observation:
    return Observation(T0 + timedelta(seconds=seconds), "dcgm", node, gpu, "", metric, value,
                       id=ident)


def window() -> list[Observation]:
    """A small fleet's minute, in time order: a gauge that reads 79, 0, 79 again; a GPU
    bouncing off its thermal limit; a flapping port; quiet samples everywhere else."""
    out: list[Observation] = []
    ident = 0
    xid = {0: 0.0, 15: 79.0, 30: 0.0, 45: 79.0}
    for s in (0, 15, 30, 45):
        for n in range(4):
            node = f"gpu-{n:03d}"
            for g in range(2):
                hot = node == "gpu-002" and g == 1
                for metric, value in (
                        ("DCGM_FI_DEV_GPU_TEMP", 93.0 if hot else 55.0),
                        ("DCGM_FI_DEV_GPU_UTIL", 97.0),
                        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 0x40 if hot and s != 30 else 0.0),
                        ("DCGM_FI_DEV_XID_ERRORS",
                         xid[s] if node == "gpu-001" and g == 0 else 0.0)):
                    out.append(dcgm(s, node, g, metric, value, ident))
                    ident += 1
        if s == 15:
            out.append(obs(s, "nic", ident, node="gpu-003", device="mlx5_0", port=1,
                           state="DOWN"))
            out.append(obs(s, "nic", ident + 1, node="gpu-003", device="mlx5_0", port=1,
                           state="ACTIVE"))
            ident += 2
    return out


def test_a_window_out_of_order_is_sorted_and_read_as_the_ordered_one() -> None:
    ordered = window()
    # Scrapes arriving in a shuffled order, each in its own order (the sort keeps ties as they
    # come, so this is the one shuffle whose sorted form is the ordered window).
    scrapes: dict[datetime, list[Observation]] = {}
    for o in ordered:
        scrapes.setdefault(o.at, []).append(o)
    blocks = list(scrapes.values())
    random.Random(18).shuffle(blocks)
    shuffled = [o for block in blocks for o in block]
    assert shuffled != ordered
    got = facts.extract(shuffled)
    assert got == facts.extract(ordered)
    assert [(x.node, x.gpu, x.code) for x in got.xids] == [("gpu-001", "GPU 0", 79)] * 2
    assert [(r.node, r.gpu, r.samples) for r in got.thermal_runs] == [("gpu-002", "GPU 1", 3)]
    assert diagnose_window(shuffled) == diagnose_window(ordered)
    assert {(d.root_cause, d.nodes) for d in diagnose(ordered)} == {
        ("gpu_hardware", ("gpu-001",)), ("thermal", ("gpu-002",)),
        ("network_flap", ("gpu-003",))}


def test_only_a_change_of_the_xid_gauge_is_news_even_when_zeros_are_passed_over() -> None:
    readings = [0, 0, 79, 79, 0, 0, 48, 48, 0]
    window = [dcgm(15 * k, "gpu-009", 4, "DCGM_FI_DEV_XID_ERRORS", v, k)
              for k, v in enumerate(readings)]
    got = facts.extract(window)
    assert [(x.code, x.id) for x in got.xids] == [(79, 2), (48, 6)]


def test_a_quiet_clock_sample_still_closes_a_slowdown_on_a_node_that_had_one() -> None:
    # Slowed for three scrapes, released long enough to be a new slowdown when it comes back.
    masks = [(0, 0x40), (15, 0x40), (30, 0x40), (45, 0), (200, 0x40)]
    window = [dcgm(s, "gpu-004", 2, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", m) for s, m in masks]
    runs = facts.extract(window).thermal_runs
    assert [(r.samples, r.closed) for r in runs] == [(3, True), (1, False)]
    assert runs[0].t_end - runs[0].t_start == 45


def test_a_dead_leaf_among_many_names_only_the_leaves_that_stayed_clean() -> None:
    topology = {f"leaf-{i:02d}": [f"gpu-{i:02d}{k}" for k in range(4)] for i in range(20)}
    window = [obs(k * 0.5, "nic", node=n, device="mlx5_0", port=1, state="DOWN")
              for k, n in enumerate(topology["leaf-07"])]
    # One node elsewhere loses its link at the same moment, and one much later.
    window.insert(1, obs(0.2, "nic", node="gpu-120", device="mlx5_0", port=1, state="DOWN"))
    window.append(obs(400, "nic", node="gpu-151", device="mlx5_0", port=1, state="DOWN"))
    result = diagnose(window, topology)
    [switch] = [d for d in result if d.root_cause == "switch_failure"]
    assert switch.switch == "leaf-07" and switch.nodes == tuple(topology["leaf-07"])
    assert "leaf-12" not in switch.explanation and "stayed clean" in switch.explanation
    assert {d.nodes for d in result if d.root_cause == "network_flap"} == {
        ("gpu-120",), ("gpu-151",)}


def test_peers_timing_out_after_a_gpu_fault_are_its_victims_in_the_order_they_wrote() -> None:
    jobs = [JobInfo(str(100 + j), f"user{j}", tuple(f"gpu-{j}{k}" for k in range(4)))
            for j in range(30)]
    window = [obs(0, "kernel", 1, node="gpu-52", message=XID79)]
    window += [obs(20 + k, "job_log", 10 + k, job="105", node=f"gpu-5{k}",
                   message=WATCHDOG) for k in (3, 1, 0)]
    # Another job's timeouts are not this fault's victims.
    window += [obs(21, "job_log", 30, job="106", node="gpu-60", message=WATCHDOG)]
    [d] = [d for d in diagnose(window, {}, jobs) if d.root_cause == "gpu_hardware"]
    assert d.evidence == (1, 10, 11, 13)  # by time: gpu-50, gpu-51, gpu-53
    assert "from 10:00:20" in d.explanation and "gpu-60" not in d.explanation


def test_one_source_claiming_most_of_a_large_fleet_is_an_outage_except_where_corroborated(
) -> None:
    nodes = [f"gpu-{i:04d}" for i in range(400)]
    window = [obs(i * 0.1, "slurm", node=n, node_state=["DOWN", "NOT_RESPONDING"],
                  reason="Not responding") for i, n in enumerate(nodes[:300])]
    window.append(obs(35, "kubernetes", node="gpu-0123", condition="Ready", status="Unknown",
                      reason="NodeStatusUnknown"))
    window.sort(key=lambda o: o.at)
    result = diagnose_window(window, {"leaf": nodes})
    [note] = [n for n in result.notes if n.kind == "source_outage"]
    assert "300 of 400 nodes" in note.text and "gpu-0123" not in note.nodes
    assert len(note.nodes) == 299
    assert [(d.root_cause, d.nodes) for d in result.diagnoses] == [
        ("node_unreachable", ("gpu-0123",))]


def test_stand_ins_appended_after_the_rows_are_read_without_a_sort(monkeypatch: Any) -> None:
    # The live window: rows in time order, then two source-less observations per node that
    # sent only idle samples (their first and last time), in no particular order.
    rows = window()
    stand_ins = [Observation(T0 + timedelta(seconds=s), "", node)
                 for node, s in (("gpu-007", 50), ("gpu-007", 2), ("gpu-008", -5), ("gpu-008", 61))]
    live = rows + stand_ins
    reads = []
    real = facts._extract
    monkeypatch.setattr(facts, "_extract", lambda o: reads.append(len(o)) or real(o))
    got = facts.extract(live)
    assert reads == [len(live)]  # one pass, no sort
    assert got == real(sorted(live, key=lambda o: o.at))
    assert {"gpu-007", "gpu-008"} <= got.nodes_seen
    assert (got.first, got.last) == (T0 - timedelta(seconds=5), T0 + timedelta(seconds=61))
    # A reading out of order still sends the window through the sort.
    reads.clear()
    assert facts.extract([*rows, rows[0]]) == real(sorted([*rows, rows[0]], key=lambda o: o.at))
    assert len(reads) == 2
