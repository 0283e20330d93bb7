"""The automatic lending decision, as a pure function: plain data in, plain data out.

Given every node of a cluster (its pool and its use now), Slurm's pending GPU demand, what the
last decision remembered and the policy, ``decide`` answers which idle training nodes go out
to inference and which lent nodes come back. No Django, no database, no clock of its own
(``now`` comes in), so it is unit-tested tick by tick and driven through a whole demand curve
by tests/bench/lending.py.

The rules, in order:

1. The floor: a pool's training nodes (idle or busy in Slurm) plus those already on their way
   back never fall below its floor. When they do (a training node failed, or the floor was
   raised) lent nodes come back, whatever the demand.
2. Demand: Slurm's pending GPU demand above ``return_above_gpus`` for ``demand_seconds``
   brings back as many lent nodes as the demand needs, less the idle training nodes that
   could take it and the nodes already coming back.
3. Lending: only once demand has stayed at or below ``lend_below_gpus`` for ``quiet_seconds``,
   and only nodes idle in Slurm for ``idle_seconds``, not back from a loan within
   ``cooldown_seconds``, at most ``max_moves`` per pool per decision, never past the pool's
   ceiling, never below its floor. Nothing goes out in a decision that brings something back.

Hysteresis, so nodes do not bounce: two thresholds (lend at or below the lower, return above
the higher), each held for a time, and the cooldown. Unknown demand (Slurm unread, or its
figures stale) moves nothing but what the floor needs, and keeps the timers as they were.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A node's use, as the decision sees it.
TRAINING_IDLE = "training_idle"  # in Slurm, schedulable, no job
TRAINING_BUSY = "training_busy"  # in Slurm, running a job
LENDING = "lending"  # on its way out (draining in Slurm, being made schedulable)
LENT = "lent"  # serving inference
RETURNING = "returning"  # on its way back
OUT = "out"  # no capacity now: drained or cordoned by someone, down, in repair
USES = (TRAINING_IDLE, TRAINING_BUSY, LENDING, LENT, RETURNING, OUT)

EVERY_POOL = "*"  # a per-pool setting's value for the pools it does not name


@dataclass(frozen=True)
class Share:
    """A count of nodes ("8") or a share of a pool's nodes ("50%")."""

    count: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str) -> Share:
        text = text.strip()
        if text.endswith("%"):
            return cls(percent=float(text[:-1]))
        return cls(count=int(text))

    def of(self, size: int, *, round_up: bool) -> int:
        if self.count is not None:
            return self.count
        exact = size * (self.percent or 0.0) / 100.0
        # A floor is a minimum (rounded up), a ceiling a maximum (rounded down); the epsilon
        # keeps 3 * 100/3 % from rounding to 4.
        return math.ceil(exact - 1e-9) if round_up else math.floor(exact + 1e-9)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else str(self.count)


@dataclass(frozen=True)
class Policy:
    floor: Mapping[str, Share] = field(default_factory=lambda: {EVERY_POOL: Share(percent=50)})
    ceiling: Mapping[str, Share] = field(
        default_factory=lambda: {EVERY_POOL: Share(percent=25)})
    lend_below_gpus: int = 0
    return_above_gpus: int = 0
    idle_seconds: float = 1800.0
    quiet_seconds: float = 1800.0
    demand_seconds: float = 300.0
    cooldown_seconds: float = 3600.0
    max_moves: int = 2

    def _share(self, shares: Mapping[str, Share], pool: str) -> Share:
        return shares.get(pool) or shares.get(EVERY_POOL) or Share(count=0)

    def floor_of(self, pool: str, size: int) -> int:
        """Training nodes the pool keeps, whatever the demand (at most all of them)."""
        return min(size, self._share(self.floor, pool).of(size, round_up=True))

    def ceiling_of(self, pool: str, size: int) -> int:
        """The most nodes the pool lends at once (never into its floor)."""
        return max(0, min(self._share(self.ceiling, pool).of(size, round_up=False),
                          size - self.floor_of(pool, size)))


@dataclass(frozen=True)
class NodeView:
    name: str
    pool: str
    use: str  # one of USES
    gpus: int = 8
    blocked: str = ""  # why it may not be lent now ("" : it may)
    returned_at: float | None = None  # when its last loan came back (epoch seconds)
    lent_at: float | None = None  # when its current loan began


@dataclass(frozen=True)
class Memory:
    """What one decision hands the next: since when demand has been above the return
    threshold (``high_since``) or at or below the lend threshold (``low_since``), and since when
    each training node has been idle."""

    high_since: float | None = None
    low_since: float | None = None
    idle_since: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"high_since": self.high_since, "low_since": self.low_since,
                "idle_since": dict(self.idle_since)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Memory:
        data = data or {}

        def when(value: Any) -> float | None:
            return float(value) if isinstance(value, int | float) else None

        idle = data.get("idle_since")
        return cls(when(data.get("high_since")), when(data.get("low_since")),
                   {str(k): float(v) for k, v in idle.items() if isinstance(v, int | float)}
                   if isinstance(idle, dict) else {})


@dataclass(frozen=True)
class Move:
    node: str
    pool: str
    why: str


@dataclass(frozen=True)
class PoolFigures:
    pool: str
    size: int  # the pool's nodes the decision was given
    floor: int
    ceiling: int
    training: int  # idle or busy in Slurm
    lent: int  # lent or on the way out
    returning: int


@dataclass(frozen=True)
class Decision:
    lend: tuple[Move, ...]
    bring_back: tuple[Move, ...]
    notes: tuple[str, ...]
    memory: Memory
    pools: tuple[PoolFigures, ...]

    def to_json(self) -> dict[str, Any]:
        return {"lend": [m.__dict__ for m in self.lend],
                "bring_back": [m.__dict__ for m in self.bring_back],
                "notes": list(self.notes), "pools": [p.__dict__ for p in self.pools]}


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _back_order(nodes: Iterable[NodeView]) -> list[NodeView]:
    """Which lent nodes come back first: those still on their way out (they serve nothing
    yet), then the most recently lent (the longest-serving inference nodes stay)."""
    return sorted(nodes, key=lambda n: (n.use != LENDING, -(n.lent_at or 0.0), n.name))


def _by_pool(nodes: Iterable[NodeView]) -> dict[str, list[NodeView]]:
    by_pool: dict[str, list[NodeView]] = {}
    for node in nodes:
        by_pool.setdefault(node.pool, []).append(node)
    return dict(sorted(by_pool.items()))


def pool_figures(nodes: Sequence[NodeView], policy: Policy) -> tuple[PoolFigures, ...]:
    """Each pool's size, floor, ceiling and nodes in training, lent and coming back."""
    figures = []
    for pool, members in _by_pool(nodes).items():
        size = len(members)
        figures.append(PoolFigures(
            pool, size, policy.floor_of(pool, size), policy.ceiling_of(pool, size),
            sum(n.use in (TRAINING_IDLE, TRAINING_BUSY) for n in members),
            sum(n.use in (LENT, LENDING) for n in members),
            sum(n.use == RETURNING for n in members)))
    return tuple(figures)


def decide(nodes: Sequence[NodeView], pending_gpus: int | None, memory: Memory,
           policy: Policy, now: float) -> Decision:
    """Which nodes go out and which come back now (see the module's docstring)."""
    if pending_gpus is None:
        high, low = memory.high_since, memory.low_since
    else:
        high = (memory.high_since if memory.high_since is not None else now) \
            if pending_gpus > policy.return_above_gpus else None
        low = (memory.low_since if memory.low_since is not None else now) \
            if pending_gpus <= policy.lend_below_gpus else None
    idle_since = {n.name: memory.idle_since.get(n.name, now) for n in nodes
                  if n.use == TRAINING_IDLE}
    remembered = Memory(high, low, idle_since)

    by_pool = _by_pool(nodes)
    figures = pool_figures(nodes, policy)

    notes: list[str] = []
    back: list[Move] = []
    chosen: set[str] = set()

    # 1. The floor, whatever the demand.
    for fig in figures:
        short = fig.floor - fig.training - fig.returning
        if short <= 0 or not fig.lent:
            continue
        lent = [n for n in by_pool[fig.pool] if n.use in (LENT, LENDING)]
        for node in _back_order(lent)[:short]:
            back.append(Move(node.name, fig.pool, f"pool {fig.pool or '-'} has "
                             f"{fig.training} training node(s), below its floor of "
                             f"{fig.floor}"))
            chosen.add(node.name)

    if pending_gpus is None:
        notes.append("Slurm's pending demand is not known now (its source is down or its "
                     "figures are stale): nothing moves on demand")
        return Decision((), tuple(back), tuple(notes), remembered, tuple(figures))

    # 2. Demand held above the return threshold brings nodes back.
    if high is not None:
        held = now - high
        if held < policy.demand_seconds:
            notes.append(f"{pending_gpus} GPU(s) pending for {_minutes(held)}: nodes come "
                         f"back once that has lasted {_minutes(policy.demand_seconds)}")
        else:
            lent = [n for n in nodes if n.use in (LENT, LENDING) and n.name not in chosen]
            per_node = max(1, round(sum(n.gpus for n in lent) / len(lent))) if lent else 8
            idle = sum(n.use == TRAINING_IDLE and not n.blocked for n in nodes)
            coming = sum(n.use == RETURNING for n in nodes) + len(back)
            need = math.ceil(pending_gpus / per_node) - idle - coming
            for node in _back_order(lent)[:max(0, need)]:
                back.append(Move(node.name, node.pool, f"{pending_gpus} GPU(s) pending in "
                                 f"Slurm for {_minutes(held)} (more than "
                                 f"{policy.return_above_gpus})"))
                chosen.add(node.name)
            if need <= 0:
                notes.append(f"{pending_gpus} GPU(s) pending: the {idle} idle training "
                             f"node(s) and {coming} on their way back can take it")
            elif not lent:
                notes.append(f"{pending_gpus} GPU(s) pending and no node lent to bring back")

    # 3. Lending, only when nothing comes back and demand has been quiet long enough.
    lend: list[Move] = []
    if back:
        notes.append("nothing goes out while nodes come back")
    elif low is None:
        notes.append(f"{pending_gpus} GPU(s) pending (more than {policy.lend_below_gpus}): "
                     "nothing goes out")
    elif now - low < policy.quiet_seconds:
        notes.append(f"demand quiet for {_minutes(now - low)}: idle nodes may go out after "
                     f"{_minutes(policy.quiet_seconds)}")
    else:
        for fig in figures:
            room = min(fig.training - fig.floor, fig.ceiling - fig.lent, policy.max_moves)
            if room <= 0:
                continue
            candidates = [
                n for n in by_pool[fig.pool]
                if n.use == TRAINING_IDLE and not n.blocked
                and now - idle_since[n.name] >= policy.idle_seconds
                and (n.returned_at is None or now - n.returned_at >= policy.cooldown_seconds)]
            candidates.sort(key=lambda n: (idle_since[n.name], n.name))
            for node in candidates[:room]:
                lend.append(Move(node.name, fig.pool, f"idle in Slurm for "
                                 f"{_minutes(now - idle_since[node.name])}, no pending demand "
                                 f"for {_minutes(now - low)}"))
    return Decision(tuple(lend), tuple(back), tuple(notes), remembered, tuple(figures))
