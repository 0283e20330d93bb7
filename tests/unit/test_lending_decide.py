"""The automatic lending decision (incidents/lending/decide.py), tick by tick: the floor is
never breached, the ceiling never passed, nothing moves before its time, nothing bounces, and
unknown demand moves nothing. Pure: no database, no clock but the ``now`` handed in."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from incidents.lending import decide
from incidents.lending.decide import (
    LENDING,
    LENT,
    OUT,
    RETURNING,
    TRAINING_BUSY,
    TRAINING_IDLE,
    Memory,
    NodeView,
    Policy,
    Share,
)

MIN = 60.0
POLICY = Policy(floor={"*": Share(percent=50)}, ceiling={"*": Share(percent=25)},
                lend_below_gpus=0, return_above_gpus=0, idle_seconds=30 * MIN,
                quiet_seconds=30 * MIN, demand_seconds=5 * MIN, cooldown_seconds=60 * MIN,
                max_moves=2)


def pool(n: int, use: str = TRAINING_IDLE, name: str = "gpu") -> list[NodeView]:
    return [NodeView(f"gpu-{i:03d}", name, use) for i in range(1, n + 1)]


def test_shares_round_the_safe_way() -> None:
    assert Share.parse("50%").of(7, round_up=True) == 4  # a floor: at least half
    assert Share.parse("25%").of(7, round_up=False) == 1  # a ceiling: at most a quarter
    assert Share.parse("3").of(100, round_up=True) == 3
    assert str(Share.parse("12.5%")) == "12.5%"
    # A ceiling never reaches into the floor: 80% lendable but a 50% floor keeps half.
    rules = Policy(floor={"*": Share(percent=50)}, ceiling={"*": Share(percent=80)})
    assert rules.ceiling_of("gpu", 10) == 5
    # Per pool, with the "*" entry for the others.
    rules = Policy(floor={"*": Share(percent=50), "a100": Share(count=1)})
    assert (rules.floor_of("a100", 8), rules.floor_of("h100", 8)) == (1, 4)


def test_idle_nodes_go_out_only_after_quiet_demand_and_idle_time() -> None:
    nodes = pool(8)
    first = decide.decide(nodes, 0, Memory(), POLICY, now=0.0)
    assert first.lend == () and first.memory.low_since == 0.0
    assert set(first.memory.idle_since) == {n.name for n in nodes}
    assert "idle nodes may go out after 30 min" in " ".join(first.notes)
    later = decide.decide(nodes, 0, first.memory, POLICY, now=30 * MIN)
    # The ceiling (25% of 8 = 2) and the moves per decision (2) bound it.
    assert [m.node for m in later.lend] == ["gpu-001", "gpu-002"]
    assert "idle in Slurm for 30 min" in later.lend[0].why


def test_a_node_idle_for_less_than_the_idle_time_stays() -> None:
    memory = Memory(low_since=0.0, idle_since={"gpu-001": 0.0, "gpu-002": 25 * MIN})
    nodes = [*pool(2), *[NodeView(f"gpu-{i:03d}", "gpu", TRAINING_BUSY) for i in range(3, 9)]]
    decision = decide.decide(nodes, 0, memory, POLICY, now=40 * MIN)
    assert [m.node for m in decision.lend] == ["gpu-001"]
    # A node busy in this decision forgets its idle time.
    busy = [replace(n, use=TRAINING_BUSY) if n.name == "gpu-001" else n for n in nodes]
    assert "gpu-001" not in decide.decide(busy, 0, memory, POLICY, now=40 * MIN).memory.idle_since


def test_the_floor_and_the_ceiling_bound_the_lending() -> None:
    rules = replace(POLICY, ceiling={"*": Share(percent=100)}, max_moves=100)
    memory = Memory(low_since=0.0, idle_since={f"gpu-{i:03d}": 0.0 for i in range(1, 9)})
    decision = decide.decide(pool(8), 0, memory, rules, now=60 * MIN)
    assert len(decision.lend) == 4  # the floor: half of 8 stays in training
    (fig,) = decision.pools
    assert (fig.size, fig.floor, fig.ceiling, fig.training) == (8, 4, 4, 8)
    # Already 4 out: none more, however idle the rest.
    lent = [replace(n, use=LENT) if i < 4 else n for i, n in enumerate(pool(8))]
    assert decide.decide(lent, 0, memory, rules, now=60 * MIN).lend == ()


def test_blocked_nodes_and_the_cooldown_are_respected() -> None:
    nodes = pool(8)
    nodes[0] = replace(nodes[0], blocked="cordoned in Kubernetes by someone else")
    nodes[1] = replace(nodes[1], returned_at=50 * MIN)  # back 10 min ago
    memory = Memory(low_since=0.0, idle_since={n.name: 0.0 for n in nodes})
    decision = decide.decide(nodes, 0, memory, POLICY, now=60 * MIN)
    assert [m.node for m in decision.lend] == ["gpu-003", "gpu-004"]
    assert [m.node for m in decide.decide(nodes, 0, memory, POLICY,
                                          now=111 * MIN).lend] == ["gpu-002", "gpu-003"]


def test_demand_held_brings_back_what_it_needs_and_nothing_goes_out() -> None:
    nodes = [*[NodeView(f"gpu-{i:03d}", "gpu", TRAINING_BUSY) for i in range(1, 6)],
             NodeView("gpu-006", "gpu", LENT, lent_at=10.0),
             NodeView("gpu-007", "gpu", LENT, lent_at=20.0),
             NodeView("gpu-008", "gpu", LENDING, lent_at=30.0)]
    first = decide.decide(nodes, 12, Memory(low_since=0.0), POLICY, now=100 * MIN)
    assert first.bring_back == () and first.memory.high_since == 100 * MIN
    assert first.memory.low_since is None  # demand: the quiet time starts over
    assert "nodes come back once that has lasted 5 min" in " ".join(first.notes)
    held = decide.decide(nodes, 12, first.memory, POLICY, now=105 * MIN)
    # 12 GPUs need 2 nodes: the one still on its way out first, then the latest lent.
    assert [m.node for m in held.bring_back] == ["gpu-008", "gpu-007"]
    assert held.lend == ()
    # An idle training node takes part of the demand: one node back is enough.
    with_idle = [replace(nodes[0], use=TRAINING_IDLE), *nodes[1:]]
    assert [m.node for m in decide.decide(with_idle, 12, first.memory, POLICY,
                                          now=105 * MIN).bring_back] == ["gpu-008"]
    # Nodes already coming back count too.
    coming = [*nodes[:5], replace(nodes[5], use=RETURNING), *nodes[6:]]
    assert [m.node for m in decide.decide(coming, 12, first.memory, POLICY,
                                          now=105 * MIN).bring_back] == ["gpu-008"]


def test_a_blip_of_demand_brings_nothing_back() -> None:
    nodes = [*pool(6, TRAINING_BUSY), NodeView("gpu-007", "gpu", LENT),
             NodeView("gpu-008", "gpu", LENT)]
    memory = Memory(low_since=0.0)
    for minute, pending in ((100, 8), (102, 16), (103, 0), (104, 8), (106, 8)):
        decision = decide.decide(nodes, pending, memory, POLICY, now=minute * MIN)
        assert decision.bring_back == (), minute
        memory = decision.memory
    assert memory.high_since == 104 * MIN  # the blip at 103 started the clock over


def test_the_floor_brings_nodes_back_whatever_the_demand() -> None:
    # Three training nodes failed: 3 left below a floor of 4; two are lent.
    nodes = [*[NodeView(f"gpu-{i:03d}", "gpu", OUT, blocked="in repair") for i in range(1, 4)],
             *[NodeView(f"gpu-{i:03d}", "gpu", TRAINING_BUSY) for i in range(4, 7)],
             NodeView("gpu-007", "gpu", LENT), NodeView("gpu-008", "gpu", LENT)]
    decision = decide.decide(nodes, None, Memory(), POLICY, now=0.0)
    assert [m.node for m in decision.bring_back] == ["gpu-007"]
    assert "below its floor of 4" in decision.bring_back[0].why


def test_unknown_demand_moves_nothing_and_keeps_the_clocks() -> None:
    memory = Memory(high_since=None, low_since=0.0, idle_since={n.name: 0.0 for n in pool(8)})
    decision = decide.decide(pool(8), None, memory, POLICY, now=120 * MIN)
    assert decision.lend == () and decision.bring_back == ()
    assert decision.memory.low_since == 0.0
    assert "not known now" in decision.notes[0]


def test_memory_survives_json() -> None:
    memory = Memory(1.0, None, {"gpu-001": 2.5})
    assert Memory.from_json(memory.to_json()) == memory
    assert Memory.from_json({"idle_since": "junk", "high_since": "x"}) == Memory()


# --- a whole demand curve, with the fleet answering the decisions -------------------------------


def run_curve(wanted: Callable[[float], int], *, nodes: int = 16, hours: float = 48,
              tick: float = MIN, rules: Policy = POLICY,
              events: list[tuple[float, str, str]] | None = None) -> list[dict[str, float]]:
    """Training wants ``wanted(t)`` GPUs; the training nodes run what fits (8 GPUs each), the
    rest is pending. Lends and returns take effect at the next tick."""
    names = [f"gpu-{i:03d}" for i in range(1, nodes + 1)]
    lent: dict[str, float] = {}
    returned: dict[str, float] = {}
    memory = Memory()
    history: list[dict[str, float]] = []
    t = 0.0
    while t < hours * 3600:
        training = [n for n in names if n not in lent]
        want = wanted(t)
        running = min(want, 8 * len(training))
        busy = set(training[: math.ceil(running / 8)])
        views = [NodeView(n, "gpu", LENT if n in lent else TRAINING_BUSY if n in busy
                          else TRAINING_IDLE, lent_at=lent.get(n), returned_at=returned.get(n))
                 for n in names]
        decision = decide.decide(views, want - running, memory, rules, t)
        memory = decision.memory
        for move in decision.lend:
            lent[move.node] = t
        for move in decision.bring_back:
            del lent[move.node]
            returned[move.node] = t
        if events is not None:
            events += [(t, "lend", m.node) for m in decision.lend]
            events += [(t, "back", m.node) for m in decision.bring_back]
        history.append({"t": t, "lent": len(lent), "training": nodes - len(lent),
                        "pending": want - running, "lends": len(decision.lend),
                        "backs": len(decision.bring_back)})
        t += tick
    return history


def test_a_daily_curve_lends_at_night_returns_by_day_and_never_bounces() -> None:
    def wanted(t: float) -> int:  # 15 nodes' worth by day, 4 at night
        hour = (t / 3600) % 24
        return 120 if 8 <= hour < 20 else 32

    history = run_curve(wanted)
    floor = POLICY.floor_of("gpu", 16)
    assert min(h["training"] for h in history) >= floor
    assert max(h["lent"] for h in history) == POLICY.ceiling_of("gpu", 16) == 4
    # Out at night, back by day: a handful of moves a day, not one per tick.
    moves = sum(h["lends"] + h["backs"] for h in history)
    assert 0 < moves <= 4 * 2 * 2  # 4 nodes, out and back, two days
    # By day the demand takes 15 of 16 nodes: all but one come back within minutes, and
    # nothing waits in Slurm after that.
    day = [h for h in history if 9 <= (h["t"] / 3600) % 24 < 19]
    assert all(h["lent"] <= 1 and h["pending"] == 0 for h in day)
    assert max(h["lent"] for h in history if (h["t"] / 3600) % 24 < 7) == 4  # out at night


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=160), min_size=4, max_size=40))
def test_no_curve_breaches_the_floor_or_lends_within_the_cooldown(levels: list[int]) -> None:
    """Whatever the demand does (a step every 30 min), training keeps its floor and no node
    goes out again within the cooldown of coming back."""
    events: list[tuple[float, str, str]] = []
    history = run_curve(lambda t: levels[int(t // 1800) % len(levels)], hours=24,
                        events=events)
    assert min(h["training"] for h in history) >= POLICY.floor_of("gpu", 16)
    assert max(h["lent"] for h in history) <= POLICY.ceiling_of("gpu", 16)
    back_at: dict[str, float] = {}
    lent_at: dict[str, float] = {}
    for t, what, node in events:
        if what == "lend":
            assert t - back_at.get(node, -math.inf) >= POLICY.cooldown_seconds, (node, t)
            lent_at[node] = t
        else:
            # Back only after demand held for the demand time (or the floor): never in the
            # same decision that lent it.
            assert t > lent_at[node]
            back_at[node] = t
