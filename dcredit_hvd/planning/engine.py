"""The simulator's event engine: one iteration of the gate and Horovod's background loop.

``simulator`` describes what is modelled and drives this engine iteration by iteration; the
engine only orders events in time.  Per iteration it sees gradients become ready (``_READY``),
Horovod cycles start (``_TICK``), collectives end (``_END``) and, when each all-reduce is split
in its two halves (``Halves``), units become ready for their all-gather (``_GATHER``).

The gate drives the SAME ``Policy`` objects the runtime drives, through their interface
(``bind``, ``start_iteration``, ``on_ready`` then pump, ``on_backward_end`` then pump,
``on_complete`` then pump; pump = release the queue head while ``admit`` says yes).  With halves
there are two queues and two policies: the reduce-scatters under the job's policy, the
all-gathers under the gather rule (``Halves.gather``).  A Horovod cycle takes every released
block, fuses consecutive blocks of one kind into buffers of at most ``fusion_bytes`` and runs
those collectives back to back (Horovod fuses only responses of one type).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..policies.base import Policy
from .blocks import Block, TensorLayout
from .costmodel import CostModel
from .profile import Profile

#: Order of simultaneous events (see ``simulator``'s docstring).
_READY, _GATHER, _TICK, _END = 0, 1, 2, 3
#: The collective each stage runs: one all-reduce, or the two halves.
ALLREDUCE, REDUCE_SCATTER, ALL_GATHER = "allreduce", "reduce_scatter", "all_gather"


@dataclass(frozen=True)
class Op:
    """One collective Horovod ran: when, how many bytes, which blocks (their ``(tensor, index)``)."""

    start: float
    end: float
    nbytes: int
    blocks: tuple[tuple[int, int], ...]
    kind: str = ALLREDUCE


@dataclass(frozen=True)
class Execution:
    """How the transport runs the collectives the gate releases: what a simulation must be told
    to price a schedule as it will run (``Transport.execution`` says it for each library).

    Horovod's background loop starts a cycle every ``cycle_s`` and fuses the collectives one
    cycle took into buffers of at most ``fusion_bytes``, whatever the policy (one all-reduce per
    tensor under ``wfbp`` is fused there like ``hvd.DistributedOptimizer``'s).  torch.distributed
    starts each collective at once, alone: ``cycle_s = 0``, ``fusion_bytes = 0``.
    """

    cycle_s: float
    fusion_bytes: int


class SimulationStalled(RuntimeError):
    """The policy refused the head of the queue with nothing in flight and nothing to come."""


@dataclass(frozen=True)
class Halves:
    """Each all-reduce as a reduce-scatter during backward and an all-gather later.

    ``gather`` is the window rule of the all-gathers, driven like any policy (phase 2 from the
    start: ``on_backward_end`` comes before its first block).  ``after_step``: every all-gather
    waits until the last reduce-scatter has finished and the shard updates, ``shard_update_s``
    (the sharded mode; none for DeAR), have run one after another: ``step()`` synchronises the
    reduce-scatters, updates, then starts the all-gathers, as the runtime does.  Otherwise a
    unit's all-gather is ready once its own shard is updated: the updates run one at a time in
    the order the reduce-scatters end, during backward too (a schedule the runtime does not
    run; kept to price it).  ``simulator`` charges the updates' time to the training thread
    before the next forward.
    ``update_in_forward``: the full update runs just before the layer's forward (DeAR updates
    each module in its forward pre-hook); otherwise it already happened on the shard.
    """

    scatter_cost: CostModel
    gather_cost: CostModel
    gather: Policy
    after_step: bool
    update_in_forward: bool
    shard_update_s: tuple[float, ...] = ()


@dataclass
class Iteration:
    """What one iteration's communication did."""

    done: list[float]          # when each unit's last block finished (its all-gather, if halves)
    last_end: float            # when the iteration's last collective finished
    busy: float                # link busy seconds
    ops: list[Op] = field(default_factory=list)


class Engine:
    """The gate + Horovod loop.  State that survives an iteration: the cycle grid, and a cycle
    start booked but not reached when the iteration's last block completed (carried over)."""

    def __init__(self, profile: Profile, cost: CostModel, policy: Policy,
                 layouts: Sequence[TensorLayout], cycle_s: float, fusion_bytes: int,
                 halves: Halves | None = None) -> None:
        self.policy = policy
        self.layouts = layouts
        self.cycle = cycle_s
        self.fusion = fusion_bytes
        self.halves = halves
        if halves is None:
            self.stages: tuple[tuple[str, CostModel, Policy], ...] = ((ALLREDUCE, cost, policy),)
        else:
            if len(halves.shard_update_s) not in (0, len(layouts)):
                raise ValueError(f"Halves.shard_update_s has {len(halves.shard_update_s)} "
                                 f"entries for {len(layouts)} units")
            halves.gather.bind(layouts)
            self.stages = ((REDUCE_SCATTER, halves.scatter_cost, policy),
                           (ALL_GATHER, halves.gather_cost, halves.gather))
        self.ready = profile.ready_times()
        self.grid = 0.0                       # start of the last Horovod cycle that ran
        self.carried_tick: float | None = None

    def next_tick(self, now: float) -> float:
        """First cycle start after the last one that ran, not before ``now`` (Horovod idles
        on a fixed grid of ``cycle_s`` from its last cycle start)."""
        if self.cycle <= 0:
            return max(now, self.grid)
        k = max(1, math.ceil((now - self.grid) / self.cycle - 1e-9))
        return self.grid + k * self.cycle

    def iteration(self, t0: float) -> Iteration:
        """One iteration's communication; backward starts at ``t0``."""
        return _Run(self, t0).run()


class _Run:
    """One iteration of an ``Engine``: the events in time order, each stage's queue, and the
    blocks released but waiting for a cycle."""

    def __init__(self, engine: Engine, t0: float) -> None:
        self.engine = engine
        L = len(engine.layouts)
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0                                      # ties: the order events were booked
        for l in range(L - 1, -1, -1):
            self.events.append((t0 + engine.ready[l], _READY, self.seq, l))
            self.seq += 1
        self.tick_at = engine.carried_tick                # the next cycle start booked, if any
        engine.carried_tick = None
        if self.tick_at is not None:
            self.events.append((self.tick_at, _TICK, self.seq, None))
            self.seq += 1
        heapq.heapify(self.events)
        stages = len(engine.stages)
        self.queues: list[list[tuple[int, int, Block]]] = [[] for _ in range(stages)]
        self.pending: list[tuple[int, Block]] = []        # released, waiting for a Horovod cycle
        blocks = [len(layout.blocks) for layout in engine.layouts]
        self.remaining = [list(blocks) for _ in range(stages)]
        self.outstanding = sum(blocks) * stages
        self.readies_left = L
        self.scattered = 0                                # units whose reduce-scatter finished
        self.updates_free = t0                            # when the last shard update ends
        self.result = Iteration([math.nan] * L, t0, 0.0)

    def run(self) -> Iteration:
        """Every event in time order until each block completed; a stall is an error."""
        for _, _, policy in self.engine.stages:
            policy.start_iteration()
        if len(self.engine.stages) > 1:
            self.engine.stages[1][2].on_backward_end()   # all-gathers: phase 2 throughout
        while self.events:
            if self.outstanding == 0 and self.readies_left == 0:
                break  # only the next (idle) cycle start is left: carry it over
            now, kind, _, data = heapq.heappop(self.events)
            if kind == _READY:
                self._ready(data, now)
            elif kind == _GATHER:
                self._gather_ready(data, now)
            elif kind == _TICK:
                self._cycle(now)
            else:
                self._complete(*data, now)
        if self.outstanding or self.readies_left:
            stuck = [b.name for q in self.queues for _, _, b in sorted(q)[:3]]
            raise SimulationStalled(
                f"{self.engine.policy.describe()} stalled: {self.outstanding} block(s) never "
                f"completed; the policy refuses the queue head with nothing in flight "
                f"(queued: {stuck}...)")
        self.engine.carried_tick = self.tick_at
        return self.result

    def _book(self, when: float, kind: int, data: Any) -> None:
        heapq.heappush(self.events, (when, kind, self.seq, data))
        self.seq += 1

    def _pump(self, now: float) -> None:
        """Release each queue's head while its policy admits it; the first block released
        books the next cycle start."""
        for stage, (_, _, policy) in enumerate(self.engine.stages):
            queue = self.queues[stage]
            while queue and policy.admit(queue[0][2]):
                self.pending.append((stage, heapq.heappop(queue)[2]))
        if self.pending and self.tick_at is None:
            self.tick_at = self.engine.next_tick(now)
            self._book(self.tick_at, _TICK, None)

    def _enqueue(self, stage: int, unit: int) -> None:
        for block in self.engine.layouts[unit].blocks:
            heapq.heappush(self.queues[stage], (block.tensor, block.index, block))
        self.engine.stages[stage][2].on_ready(unit)

    def _ready(self, l: int, now: float) -> None:
        """Gradient ``l`` is ready: its blocks join the queue (tensor 0 ends backward)."""
        self.readies_left -= 1
        self._enqueue(0, l)
        self._pump(now)
        if l == 0:
            self.engine.policy.on_backward_end()
            self._pump(now)

    def _gather_ready(self, units: Sequence[int], now: float) -> None:
        for u in units:
            self._enqueue(1, u)
        self._pump(now)

    def _cycle(self, now: float) -> None:
        """A Horovod cycle starts: it takes every released block, fuses consecutive blocks of
        one stage into buffers of at most ``fusion_bytes`` and runs them back to back."""
        engine = self.engine
        self.tick_at = None
        engine.grid = now
        if not self.pending:
            return
        start = now
        group: list[Block] = []
        size, stage = 0, 0
        for item in self.pending + [None]:  # type: ignore[list-item]
            if group and (item is None or item[0] != stage or engine.fusion <= 0
                          or size + item[1].nbytes > engine.fusion):
                kind, cost, _ = engine.stages[stage]
                end = start + cost.time(size)
                self.result.ops.append(Op(start, end, size, tuple(b.key for b in group), kind))
                self.result.busy += end - start
                self._book(end, _END, (stage, group))
                start, group, size = end, [], 0
            if item is not None:
                stage = item[0]
                group.append(item[1])
                size += item[1].nbytes
        self.pending.clear()
        self.tick_at = start if engine.cycle <= 0 else max(now + engine.cycle, start)
        self._book(self.tick_at, _TICK, None)

    def _complete(self, stage: int, blocks: list[Block], now: float) -> None:
        """One collective ended: its blocks are done, the stage's policy hears of each."""
        policy = self.engine.stages[stage][2]
        last = len(self.engine.stages) - 1
        for block in blocks:
            t = block.tensor
            self.remaining[stage][t] -= 1
            if self.remaining[stage][t] < 0:
                raise AssertionError(f"block {block.key} of {block.name} sent twice")
            if self.remaining[stage][t] == 0:
                if stage == last:
                    self.result.done[t] = now
                else:
                    self._scattered(t, now)
            self.outstanding -= 1
            policy.on_complete(block)
        self.result.last_end = max(self.result.last_end, now)
        self._pump(now)

    def _scattered(self, unit: int, now: float) -> None:
        """Unit ``unit``'s reduce-scatter finished: book its all-gather's readiness."""
        halves = self.engine.halves
        assert halves is not None
        self.scattered += 1
        if halves.after_step:
            if self.scattered == len(self.engine.layouts):
                self._book(now + sum(halves.shard_update_s), _GATHER,
                           range(len(self.engine.layouts)))
            return
        took = halves.shard_update_s[unit] if halves.shard_update_s else 0.0
        self.updates_free = max(self.updates_free, now) + took
        self._book(self.updates_free, _GATHER, (unit,))
