"""Window rules, one module each.  ``make_policy`` builds the one a config names."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .base import Immediate, Policy
from .bytescheduler import ByteScheduler
from .dcredit import DCredit
from .wfbp import WFBP

if TYPE_CHECKING:
    from ..config import SchedulerConfig
    from ..planner import Plan

#: Policies a user may name.
POLICIES = ("dcredit", "bytescheduler", "wfbp")


def make_policy(config: SchedulerConfig, plan: Optional[Plan] = None, *,
                overlap_forward: bool = False) -> Policy:
    """The policy object ``config.policy`` names (the config has been validated).

    ``dcredit`` needs a plan; until one exists (while the job is profiled) it runs under
    ``bytescheduler`` rules with the configured credit.  ``overlap_forward``: the runtime
    overlaps the next forward pass (phase-2 windows per tensor) or not (phase 2 drains).
    """
    if config.policy == "wfbp":
        return WFBP()
    if config.policy == "bytescheduler" or (config.policy == "dcredit" and plan is None):
        return ByteScheduler(config.credit_bytes)
    if config.policy == "dcredit":
        return DCredit(plan, overlap_forward=overlap_forward)
    raise ValueError(f"unknown policy {config.policy!r}; choose one of {', '.join(POLICIES)}")


__all__ = ["POLICIES", "ByteScheduler", "DCredit", "Immediate", "Policy", "WFBP", "make_policy"]
