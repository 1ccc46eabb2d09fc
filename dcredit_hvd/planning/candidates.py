"""The plan space the race runs in: every schedule ``dcredit``'s runtime can install, the
baselines' among them, each priced by the simulator with the same policy object it runs with.

A ``Schedule`` is plain data (rank 0 makes the list, every rank receives it with the plan):
a policy name, the plan when it is D-Credit's, and the geometry the runtime cuts blocks with.
The baselines, as the runtime can express them (``docs/algorithm.md`` §10):

=================  ==========================================================================
``bytescheduler``  priority order under a fixed credit, blocks of the configured partition
``wfbp``           one collective per tensor, as soon as it is ready (backward order); under
                   Horovod its fusion threshold and cycle fuse what one cycle took, which is
                   ``hvd.DistributedOptimizer``'s schedule (the process's
                   ``HOROVOD_FUSION_THRESHOLD``/``HOROVOD_CYCLE_TIME`` are Horovod's own:
                   there is no public API to change them per step), and the simulator prices
                   it so (``transports.base.Execution``)
``ddp``            DDP's 25 MiB buckets in backward order (``policies/ddp.py``)
=================  ==========================================================================

With ``shard=True`` the partition is fixed for the job (a rank's slices are ranges of blocks):
the sharded counterparts are ``bytescheduler`` at that partition and ``immediate`` (every
block at once: Horovod's or a ZeRO-style bucket-less schedule); ``wfbp`` and ``ddp`` change
the blocks and are not in a sharded race.  DeAR needs the two halves from construction
(``config.split``) and is not in a ``dcredit`` race either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..policies import WFBP, ByteScheduler, DCredit, Immediate, Policy
from ..policies.ddp import DDP_BUCKET_BYTES, DDPBuckets
from . import simulator
from .costmodel import CostModel
from .plan import Plan
from .profile import Profile

#: The D-Credit plans a race takes from the simulator's ranking (its pick and runners-up).
TOP_PLANS = 3


@dataclass(frozen=True)
class Schedule:
    """One candidate of the race: what the runtime installs to run it."""

    label: str
    policy: str                       # dcredit | bytescheduler | wfbp | ddp | immediate
    plan: Optional[Plan] = None       # dcredit only
    partition_bytes: Optional[int] = None
    credit_bytes: int = 0
    bucket_bytes: int = DDP_BUCKET_BYTES   # ddp only
    #: The simulator's steady-state iteration, and its all-reduces per iteration.
    predicted_s: Optional[float] = None
    ops_per_iteration: float = 0.0

    def policy_object(self, overlap_forward: bool) -> Policy:
        """A fresh policy object of this schedule (the gate rank's rule)."""
        if self.policy == "dcredit":
            if self.plan is None:
                raise ValueError(f"schedule {self.label!r}: dcredit needs a plan")
            return DCredit(self.plan, overlap_forward=overlap_forward)
        if self.policy == "bytescheduler":
            return ByteScheduler(self.credit_bytes)
        if self.policy == "wfbp":
            return WFBP()
        if self.policy == "ddp":
            return DDPBuckets(self.bucket_bytes)
        if self.policy == "immediate":
            return Immediate()
        raise ValueError(f"schedule {self.label!r}: unknown policy {self.policy!r}")

    @property
    def groups(self) -> tuple[int, ...]:
        """The units a dcredit plan forms (the other policies' own come from their object)."""
        return tuple(self.plan.groups) if self.plan is not None else ()

    def key(self) -> tuple:
        """What ranks compare to agree on a candidate list (``runtime/race.py``)."""
        plan = self.plan
        return (self.label, self.policy, self.partition_bytes, self.credit_bytes, self.bucket_bytes,
                None if plan is None else (plan.partition_bytes, plan.windows, plan.groups,
                                           plan.phase2_group, plan.phase2_depth,
                                           plan.gather_order))


def schedules(ranked: tuple[Any, ...], profile: Profile, cost: CostModel, *,
              overlap_forward: bool, partition_bytes: int, credit_bytes: int, shard: bool,
              sim: dict, byte_scale: float = 1.0) -> list[Schedule]:
    """The race's candidates: the simulator's ``TOP_PLANS`` best D-Credit plans (``ranked``:
    ``SimResult``s, best first; the first is the incumbent), then every baseline the runtime
    can express here, each simulated with ``sim`` (``simulator.simulate``'s keywords: the
    overlap, the transport's cycle and fusion, block overhead, shard, workers, the halves'
    costs), as the plans were.  The baselines'
    byte settings are divided by ``byte_scale`` (``config.tune_byte_scale``: an emulated
    cluster's 1/S gradients), except a sharded job's partition, which is the job's."""
    out = []
    for k, result in enumerate(ranked[:TOP_PLANS]):
        plan = result.plan
        out.append(Schedule(label=f"dcredit #{k + 1} ({_plan_label(plan)})", policy="dcredit",
                            plan=plan, partition_bytes=plan.partition_bytes,
                            predicted_s=result.iteration_s,
                            ops_per_iteration=result.ops_per_iteration))
    def scaled(nbytes: int) -> int:
        return max(1, round(nbytes / byte_scale))

    baselines = [Schedule("bytescheduler", "bytescheduler",
                          partition_bytes=partition_bytes if shard else scaled(partition_bytes),
                          credit_bytes=scaled(credit_bytes))]
    if shard:
        baselines.append(Schedule("immediate", "immediate", partition_bytes=partition_bytes))
    else:
        baselines += [Schedule("wfbp/horovod", "wfbp"),
                      Schedule("ddp", "ddp", bucket_bytes=scaled(DDP_BUCKET_BYTES))]
    for s in baselines:
        result = simulator.simulate(profile, cost, s.policy_object(overlap_forward),
                                    partition_bytes=s.partition_bytes, **sim)
        out.append(replace(s, predicted_s=result.iteration_s,
                           ops_per_iteration=result.ops_per_iteration))
    return out


def _plan_label(plan: Plan) -> str:
    text = f"{plan.label}, {_size(plan.partition_bytes)}"
    if plan.groups and plan.group_bytes:
        text += f", groups <= {_size(plan.group_bytes)}"
    if plan.gather_order != "forward":
        text += f", gathers {plan.gather_order}"
    return text


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20} MiB"
    if nbytes >= 1 << 10 and nbytes % (1 << 10) == 0:
        return f"{nbytes >> 10} KiB"
    return f"{nbytes} B" if nbytes < 1e6 else f"{nbytes / 1e6:g} MB"


def corrected(cost: CostModel, d_op: float) -> CostModel:
    """``cost`` with the race's per-all-reduce correction (``race.refit_offset``): every
    all-reduce costs ``d_op`` more, ``T'(x) = T(x) + d_op``, so both the start-up and the floor
    move by it; neither goes below zero (an over-fitted start-up is taken off, not reversed).
    The next plan starts from it."""
    if not math.isfinite(d_op) or d_op == 0:
        return cost
    floor = max(0.0, cost.floor + d_op) if cost.floor else 0.0
    return replace(cost, a=max(0.0, cost.a + d_op), floor=floor)
