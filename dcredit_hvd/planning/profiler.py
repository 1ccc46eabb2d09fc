"""Measurements of the live job that feed the planner: compute per tensor, and the link.

* ``StepProfiler``: per-tensor ready times ``r_l`` from the gradient hooks' timestamps, measured
  from the end of the model's forward pass (the start of backward, up to the loss), and per-layer
  forward times from module forward pre/post hooks (each layer's own time, without the hooked
  layers it calls), split evenly among the tensors a module owns directly (``profile.Profile``).
  Iterations are averaged after a warm-up.  ``t_b`` follows from ``r_l`` as
  ``t_b(l) = r_l - r_{l+1}`` with ``r`` made non-decreasing towards the input (a gradient never
  counts as ready before a later layer's), so ``Profile.ready_times()`` gives back the measured
  ``r_l``.
* ``measure_cost_model``: times all-reduces of sizes from a few KiB to tens of MiB through the
  same Horovod path the runtime uses (``comm.submit``, fusion and cycle time as configured), on
  every rank together; rank 0 fits ``T(bytes) = a + b*bytes`` (``costmodel.fit``) and broadcasts
  it, so every rank plans with the same numbers (spec §2, defect 4).

Both run on every rank; only rank 0's figures are used (the plan is computed there and
broadcast), which keeps the plan identical on every rank.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Optional

from .costmodel import CostModel, fit_floored
from .profile import Profile

if TYPE_CHECKING:
    from ..transports.base import Transport

#: All-reduce sizes timed by ``measure_cost_model`` (bytes), capped by the model's size.
COST_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20)


class StepProfiler:
    """Timestamps of forward layers and gradient readiness, averaged over iterations.

    Keys are opaque hashables (the optimizer uses the parameter tensors), so re-indexing the
    tensors between iterations does not disturb the record.
    """

    def __init__(self, warmup: int, steps: int, clock=time.perf_counter) -> None:
        if warmup < 0 or steps < 1:
            raise ValueError(f"profiling needs warmup >= 0 and steps >= 1, got {warmup}, {steps}")
        self.warmup = warmup
        self.steps = steps
        self._clock = clock
        self.iterations = 0                 # completed iterations seen (warm-up included)
        self._forward_end: Optional[float] = None
        self._layer_start: dict[Any, float] = {}
        self._open: list[list] = []          # [layer, time of hooked layers it called]
        self._ready: dict[Hashable, float] = {}
        self._fwd: dict[Hashable, float] = defaultdict(float)
        self._sum_ready: dict[Hashable, list[float]] = defaultdict(list)
        self._sum_fwd: dict[Hashable, list[float]] = defaultdict(list)

    @property
    def done(self) -> bool:
        """True once ``warmup + steps`` iterations have ended (the same step on every rank)."""
        return self.iterations >= self.warmup + self.steps

    # -- events --------------------------------------------------------------------------
    def layer_start(self, module: Any) -> None:
        self._layer_start[module] = self._clock()
        self._open.append([module, 0.0])

    def layer_end(self, module: Any, keys: Sequence[Hashable]) -> None:
        """A layer's own (exclusive) forward time, split among the tensors it owns: the time of
        the hooked layers it calls is theirs (a ViT's embeddings module owns the class token and
        calls the patch convolution; a model's root owns a bare parameter and calls everything),
        so nothing is counted twice."""
        start = self._layer_start.pop(module, None)
        children = 0.0
        while self._open:                       # pop to this layer (skips any that raised)
            entry = self._open.pop()
            if entry[0] is module:
                children = entry[1]
                break
        if start is None:
            return
        inclusive = self._clock() - start
        if self._open:
            self._open[-1][1] += inclusive
        if not keys:
            return
        share = max(inclusive - children, 0.0) / len(keys)
        for key in keys:
            self._fwd[key] += share

    def forward_end(self) -> None:
        """End of the model's forward: ready times are measured from the last one before backward."""
        if not self._ready:
            self._forward_end = self._clock()

    def ready(self, key: Hashable) -> None:
        now = self._clock()
        if self._forward_end is None:
            self._forward_end = now          # no model hook: measure from the first ready gradient
        self._ready.setdefault(key, now - self._forward_end)

    def end_iteration(self) -> None:
        if self.iterations >= self.warmup and self._ready:
            for key, r in self._ready.items():
                self._sum_ready[key].append(r)
            for key, t in self._fwd.items():
                self._sum_fwd[key].append(t)
        self.iterations += 1
        self._ready = {}
        self._fwd = defaultdict(float)
        self._forward_end = None
        self._layer_start.clear()
        self._open.clear()

    # -- result --------------------------------------------------------------------------
    def profile(self, keys: Sequence[Hashable], names: Sequence[str], nbytes: Sequence[int],
                element_size: Sequence[int], kinds: Sequence[str] = ()) -> Profile:
        """The averaged profile of tensors ``keys`` given in forward order (``kinds``:
        ``Profile.kinds``, which tensors may share a buffer)."""
        ready = [statistics.fmean(self._sum_ready[k]) if self._sum_ready.get(k) else None
                 for k in keys]
        t_b = [0.0] * len(keys)
        later = 0.0                                   # r_{l+1}, the later layer's ready time
        for l in range(len(keys) - 1, -1, -1):
            r = later if ready[l] is None else max(ready[l], later)
            t_b[l] = r - later
            later = r
        t_f = [statistics.fmean(self._sum_fwd[k]) if self._sum_fwd.get(k) else 0.0 for k in keys]
        return Profile.from_lists(names, nbytes, element_size, t_f, t_b, kinds=kinds)


#: The collectives a cost model can be fitted for: the all-reduce and its two halves.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def measure_cost_model(max_bytes: int, transport: Transport, reps: int = 3,
                       sizes: Sequence[int] = COST_SIZES, device: Any = "cpu",
                       prefix: str = "dcredit.costmodel", collective: str = "all_reduce",
                       ) -> tuple[CostModel, list[tuple[int, float]]]:
    """Fit ``T(bytes) = a + b*bytes`` from collectives timed on the live communicator:
    all-reduces, or one of their halves (``collective``; ``bytes`` is the whole vector's, as a
    block's, for every one of them: the simulator prices blocks by their size).

    Collective: every rank of ``transport``'s group must call it at the same point; its collectives
    are named under ``prefix`` (one per optimizer: several may be in flight).  Each of ``reps``
    rounds (after one warm-up round) times every size once, each after a one-element all-reduce
    that lines the ranks up.  Returns rank 0's fit and rank 0's
    ``(bytes, median seconds)`` samples, broadcast to every rank.
    """
    import torch

    from ..transports.shards import shard_bounds

    if collective not in COLLECTIVES:
        raise ValueError(f"measure_cost_model: collective {collective!r}, not one of {COLLECTIVES}")

    def run(tensor: Any, name: str) -> None:
        if collective == "reduce_scatter":
            handle = transport.reduce_scatter(tensor, name, transport.average)
        elif collective == "all_gather":
            a, b = shard_bounds(tensor.numel(), transport.size(), transport.rank())
            handle = transport.all_gather(tensor[a:b], name, tensor.numel())
        else:
            handle = transport.submit(tensor, name, transport.average)
        transport.wait(handle)

    chosen = [s for s in sizes if s <= max(max_bytes, 4 * sizes[0])]
    if len(chosen) < 2:
        chosen = list(sizes[:2])
    tensors = {size: torch.zeros(size // 4, dtype=torch.float32, device=device) for size in chosen}
    align = torch.zeros(1, dtype=torch.float32, device=device)
    times: dict[int, list[float]] = {size: [] for size in chosen}
    # Rounds of every size, not every round of one size: a slow moment of a few seconds then
    # slows one sample of each size, which the median drops, instead of every sample of one
    # size, which bends the whole fit (8 emulated hosts, three fits in a row: a = 26.5, 0.25
    # and 0.48 ms, the first one's 512 KiB samples all slow; docs/benchmarks.md).  Before each
    # timed collective, one of a single element lines the ranks up (a barrier, as collective
    # benchmarks time): else the ranks' spread in finishing the last, largest one is charged
    # to the next, smallest one (4 KiB after 32 MiB measured 98-110 ms where 33 ms is its cost).
    for rep in range(reps + 1):                      # the first is a warm-up (negotiation, cache)
        for size in chosen:
            transport.wait(transport.submit(align, f"{prefix}.align", transport.sum))
            start = time.perf_counter()
            run(tensors[size], f"{prefix}.{size}")
            if rep:
                times[size].append(time.perf_counter() - start)
    samples = [(size, statistics.median(times[size])) for size in chosen]
    model = (fit_floored([s for s, _ in samples], [t for _, t in samples])
             if transport.rank() == 0 else None)
    return transport.broadcast_object((model, samples), f"{prefix}.fit")
