"""An all-reduce's two halves: their costs, the schedules that use them, and their bound.

A ring all-reduce of ``x`` bytes among ``n`` ranks IS a reduce-scatter (``n-1`` steps, each rank
ends with the reduced ``x/n`` bytes of its shard) followed by an all-gather (``n-1`` steps, each
rank's shard reaches every other)::

    T_rs(x) = (n-1) * latency + (n-1)/n * x / bandwidth  = T_ag(x)
    T_rs(x) + T_ag(x) = T_allreduce(x)

DeAR (``policies/dear.py``) runs the reduce-scatters during backward and the all-gathers during
the next forward, so each half overlaps a different pass; so does the sharded mode, where a rank
updates only its shard between the halves and the all-gather carries updated parameters
(ZeRO, FSDP; ``docs/algorithm.md`` §9).  This module gives the simulator those costs
(``split_cost``, ``link_costs``), the wiring of a policy onto the two halves (``make_halves``)
and the bound: no schedule of the halves beats
``max(compute, T_rs(total) + T_ag(total), per-tensor dependencies)``.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..policies.base import InForwardOrder, Policy
from .costmodel import CostModel
from .engine import Halves
from .profile import Profile

#: Policies whose all-gather waits for ``step()`` and whose update runs in the forward pre-hook
#: (the reduced gradient, not a parameter shard, is gathered).
AFTER_STEP = ("dear",)


def split_cost(cost: CostModel) -> tuple[CostModel, CostModel]:
    """A reduce-scatter's and an all-gather's cost from an all-reduce's, where only the
    all-reduce was measured: each half pays half the startup and half the bytes' time; each
    keeps the whole floor (a collective's least time does not shrink because it does less).
    A guess, and a library's halves need not be the ring's: Horovod's Gloo reduce-scatter
    measured 81% of the all-reduce's seconds per byte on 8 emulated hosts (its all-gather 53%),
    so fit the halves where they are run (the sharded optimizer does, and so does the emulated
    bench for DeAR's rows)."""
    half = CostModel(a=cost.a / 2, b=cost.b / 2, floor=cost.floor)
    return half, half


def link_costs(bandwidth_bits_per_s: float, latency_s: float, workers: int,
               op_overhead_s: float) -> tuple[CostModel, CostModel]:
    """The alpha-beta costs of a ring reduce-scatter and all-gather among ``workers``:
    ``a = (n-1) latency + op_overhead_s``, ``b = (n-1)/n * 8 / bandwidth`` seconds per byte of
    the full buffer."""
    if bandwidth_bits_per_s <= 0 or latency_s < 0 or op_overhead_s < 0 or workers < 1:
        raise ValueError("link_costs: need bandwidth > 0, latency and overhead >= 0, workers >= 1")
    n = workers
    half = CostModel(a=(n - 1) * latency_s + op_overhead_s, b=(n - 1) / n * 8.0 / bandwidth_bits_per_s)
    return half, half


def shard_update_times(profile: Profile, workers: int) -> tuple[float, ...]:
    """Each unit's update on a shard: ``t_u(l) / n`` (elementwise optimizers do ``1/n`` of the work)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return tuple(t / workers for t in profile.t_u) if profile.t_u else ()


def make_halves(name: str, policy: Policy, scatter_cost: CostModel, gather_cost: CostModel,
                units: Profile, workers: int) -> Halves:
    """The two halves for ``policy`` on ``units``: DeAR's (``AFTER_STEP``) or the sharded mode."""
    if name in AFTER_STEP:
        return Halves(scatter_cost, gather_cost, policy.gather_rule(), after_step=True,
                      update_in_forward=True)
    gather = policy.gather_rule()
    if policy.gathers_in_forward_order():
        gather = InForwardOrder(gather)
    # The runtime's step() waits for every reduce-scatter, updates the shards, then releases
    # the all-gathers (runtime/gathers.py): after_step, the updates in between.
    return Halves(scatter_cost, gather_cost, gather, after_step=True,
                  update_in_forward=False, shard_update_s=shard_update_times(units, workers))


def dependencies(profile: Profile, scatter_cost: CostModel, gather_cost: CostModel,
                 update_s: Sequence[float]) -> list[float]:
    """Per tensor: ``r_l + T_rs(M_l) + update + T_ag(M_l) + forward of layers l..L-1``."""
    ready = profile.ready_times()
    update = tuple(update_s) or (0.0,) * profile.num_tensors
    ends, tail = [0.0] * profile.num_tensors, 0.0
    for l in range(profile.num_tensors - 1, -1, -1):
        tail += profile.t_f[l]
        x = profile.nbytes[l]
        ends[l] = ready[l] + scatter_cost.time(x) + update[l] + gather_cost.time(x) + tail
    return ends


def lower_bound(profile: Profile, scatter_cost: CostModel, gather_cost: CostModel,
                workers: int = 1, sharded: bool = False) -> float:
    """``max(compute, T_rs(total) + T_ag(total), dependencies)``: the limit of one iteration
    whose all-reduces are split in halves.  Sharded, the update is ``t_u / n`` per tensor."""
    update = shard_update_times(profile, workers) if sharded else profile.t_u
    compute = profile.forward_time + profile.backward_time + sum(update)
    link = scatter_cost.time(profile.total_bytes) + gather_cost.time(profile.total_bytes)
    return max(compute, link, max(dependencies(profile, scatter_cost, gather_cost, update), default=0.0))
