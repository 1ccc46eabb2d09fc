"""The gate rank's decision: from the measured profile and cost model to the plan, and its report.

Plain data one way (profile -> cost model -> plan): ``decide`` runs on the gate rank only, whose
result the optimizer broadcasts so that every rank adopts the same plan at the same step; the
optimizer keeps the collectives (timing the link, the broadcast) and the switch itself.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from . import planner, simulator
from .config import SchedulerConfig
from .costmodel import CostModel
from .profile import Profile


def horovod_cycle_seconds() -> float:
    """Horovod's background cycle (``HOROVOD_CYCLE_TIME``, ms, default 1), for the simulator."""
    try:
        return float(os.environ.get("HOROVOD_CYCLE_TIME", "1")) / 1000.0
    except ValueError:
        return 0.001


def decide(profile: Profile, cost: CostModel, config: SchedulerConfig, *,
           overlap_forward: bool) -> tuple[Any, Profile, tuple]:
    """``(plan, profile, search)``: D-Credit's windows for the partition the user set, or for
    the partition the simulator predicts fastest (``search`` lists what it tried)."""
    if config.explicit("partition_bytes"):
        return planner.plan(profile, cost, config.partition_bytes), profile, ()
    best = simulator.best_dcredit(profile, cost, overlap_forward=overlap_forward,
                                  cycle_s=horovod_cycle_seconds())
    return best.plan, profile, best.search


def log(logger: logging.Logger, cost: CostModel, samples, profile: Profile, plan, search,
        seconds: float) -> None:
    """The fitted link, the profile and the plan, once, on rank 0."""
    logger.info("cost model: T(bytes) = %.3g s + %.3g s/B * bytes (%.2f Gbit/s), relative "
                "residual %s; from %s", cost.a, cost.b,
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
