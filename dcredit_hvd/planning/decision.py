"""The gate rank's decision: from the measured profile and cost model to the plan, and its report.

Plain data one way (profile -> cost model -> plan): ``decide`` runs on the gate rank only, whose
result the optimizer broadcasts so that every rank adopts the same plan at the same step; the
optimizer keeps the collectives (timing the link, the broadcast) and the switch itself.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Optional

from ..config import SchedulerConfig
from ..policies import DCredit
from . import candidates, planner, simulator
from .blocks import group_runs
from .costmodel import CostModel
from .engine import Execution
from .profile import Profile

#: ``group_bytes`` limits the search tries (``blocks.group_runs``; 0: no grouping).
GROUP_CANDIDATES: tuple[int, ...] = (0, 64 << 10, 256 << 10, 1 << 20, 4 << 20)

#: CPU seconds the runtime spends per block (hook, gate, submission, completion, the update
#: call under overlap), charged by the simulator to the backward pass so that the search sees
#: what extra blocks cost (``simulator.with_block_overhead``).  Measured with
#: ``scripts/bench_overhead.py`` (1 rank, no network, 1,000 small tensors one block each) on
#: this project's 2-core CPU machines; ``docs/benchmarks.md`` has the table.
BLOCK_OVERHEAD_S = {False: 25e-6, True: 60e-6}


#: Horovod's cycle and fusion defaults, for a decision made without a transport (the tests).
HOROVOD_DEFAULTS = Execution(simulator.DEFAULT_CYCLE_S, simulator.DEFAULT_FUSION_BYTES)


def decide(profile: Profile, cost: CostModel, config: SchedulerConfig, *,
           overlap_forward: bool, workers: int = 1,
           halves: Optional[tuple[CostModel, CostModel]] = None,
           collectives: Execution = HOROVOD_DEFAULTS) -> tuple[Any, Profile, tuple]:
    """``(plan, profile, search)``: D-Credit's windows, grouping and partition.

    The partition and the ``group_bytes`` limit the user set are kept; whichever was left
    unset is chosen by the simulator (``simulator.best_dcredit``: every planner rule, partition
    and grouping candidate, the per-block cost charged).  With the partition set and grouping
    left to choose, no grouping: spec §3's greedy at the user's partition, as before.
    ``search`` lists the ``(partition, seconds)`` rows tried for the winning rule and grouping.
    Sharded (``shard=True``, ``workers`` ranks), at the fixed partition and without grouping,
    the simulator still picks the planner rule, phase 2's windows (which the all-gathers
    spend) and the all-gathers' order, on the sharded schedule (``best_dcredit(shard=True)``),
    priced with ``halves``: the reduce-scatter's and the all-gather's costs fitted live.
    Every simulation runs the collectives as ``collectives`` says the transport does.
    """
    sim = _sim_keywords(config, overlap_forward, workers, halves, collectives)
    plan, search, _ = _search(profile, cost, config, sim)
    return plan, profile, search


def decide_race(profile: Profile, cost: CostModel, config: SchedulerConfig, *,
                overlap_forward: bool, workers: int = 1,
                halves: Optional[tuple[CostModel, CostModel]] = None,
                collectives: Execution = HOROVOD_DEFAULTS
                ) -> tuple[Any, Profile, tuple, list[candidates.Schedule]]:
    """``decide``, plus the race's candidates (``candidates.schedules``): the simulator's
    pick first (the incumbent), its runners-up, then every baseline the runtime can express,
    each priced by the same simulation."""
    sim = _sim_keywords(config, overlap_forward, workers, halves, collectives)
    plan, search, ranked = _search(profile, cost, config, sim)
    if not ranked:                      # the partition was given: the one plan, simulated
        ranked = (simulator.simulate(profile, cost, DCredit(plan, overlap_forward=overlap_forward),
                                     **sim),)
    found = candidates.schedules(ranked, profile, cost, overlap_forward=overlap_forward,
                                 partition_bytes=config.partition_bytes,
                                 credit_bytes=config.credit_bytes, shard=config.shard, sim=sim,
                                 byte_scale=config.tune_byte_scale)
    return plan, profile, search, found


def _sim_keywords(config: SchedulerConfig, overlap_forward: bool, workers: int,
                  halves: Optional[tuple[CostModel, CostModel]], collectives: Execution) -> dict:
    """What every simulation of this job is told besides the policy: whether the next forward
    overlaps, the transport's cycle and fusion (for every policy: under Horovod a ``wfbp``
    schedule is fused like any other), the runtime's cost per block, and the sharded mode's
    halves."""
    sim = {"overlap_forward": overlap_forward, "cycle_s": collectives.cycle_s,
           "fusion_bytes": collectives.fusion_bytes,
           "block_overhead_s": BLOCK_OVERHEAD_S[overlap_forward]}
    if config.shard:
        sim.update(shard=True, workers=workers, scatter_cost=halves[0] if halves else None,
                   gather_cost=halves[1] if halves else None)
    return sim


def _search(profile: Profile, cost: CostModel, config: SchedulerConfig, sim: dict
            ) -> tuple[Any, tuple, tuple]:
    """``(plan, search, ranked)``: ``decide``'s plan, its table, and the simulator's ranking of
    the plans it tried (empty when the partition was given and nothing was searched); ``sim``:
    ``_sim_keywords``."""
    limits = (config.group_bytes,) if config.explicit("group_bytes") else GROUP_CANDIDATES
    if config.shard:
        best = simulator.best_dcredit(profile, cost, group_limits=(0,),
                                      candidates=(config.partition_bytes,), **sim)
        return best.plan, best.search, best.ranked
    if config.explicit("partition_bytes"):
        limit = config.group_bytes if config.explicit("group_bytes") else 0
        groups = group_runs(profile.nbytes, profile.group_kinds(), limit)
        made = planner.plan(profile.grouped(groups), cost, config.partition_bytes)
        if len(groups) != profile.num_tensors:
            made = dataclasses.replace(made, groups=groups, group_bytes=limit)
        return made, (), ()
    best = simulator.best_dcredit(profile, cost, group_limits=limits, **sim)
    return best.plan, best.search, best.ranked


def log(logger: logging.Logger, cost: CostModel, samples, profile: Profile, plan, search,
        seconds: float) -> None:
    """The fitted link, the profile and the plan, once, on rank 0."""
    logger.info("cost model: T(bytes) = max(%.3g s, %.3g s + %.3g s/B * bytes) (%.2f Gbit/s), "
                "relative residual %s; from %s", cost.floor, cost.a, cost.b,
                8e-9 / cost.b if cost.b else float("inf"),
                f"{cost.residual:.3f}" if cost.residual is not None else "n/a",
                ", ".join(f"{s} B: {t * 1e3:.2f} ms" for s, t in samples))
    logger.info("profile: %d tensors, %.1f MB, forward %.1f ms, backward %.1f ms",
                profile.num_tensors, profile.total_bytes / 1e6, profile.forward_time * 1e3,
                profile.backward_time * 1e3)
    if search:
        logger.info("partition search (predicted iteration): %s",
                    ", ".join(f"{s} B: {t * 1e3:.1f} ms" for s, t in search))
    logger.info("plan: %s; phase-1 windows %s; planned in %.2f s", plan.describe(),
                [w for w in plan.phase1_windows if w], seconds)


def write(path: str, cost: CostModel, samples, profile: Profile, plan, search) -> None:
    """``profile_out``: what ``python -m dcredit_hvd plan --profile`` reads back."""
    record = {"cost": dataclasses.asdict(cost), "samples": samples,
              "profile": dataclasses.asdict(profile),
              "plan": {"partition_bytes": plan.partition_bytes, "windows": list(plan.windows)},
              "search": [list(row) for row in search]}
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)


def read(path: str) -> dict:
    """The record ``write`` left at ``path`` (for ``plan --profile`` and the replay), or a
    ``ValueError`` saying why it cannot be read."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read profile {path!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {path!r} is not JSON: {exc}") from None
