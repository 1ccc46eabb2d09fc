"""Window rules, one module each.  ``make_policy`` builds the one a configuration names."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .base import Immediate, Policy
from .bytescheduler import ByteScheduler
from .dcredit import DCredit
from .dear import DeAR
from .wfbp import WFBP

if TYPE_CHECKING:
    from ..planning.planner import Plan

#: Policies a user may name.
POLICIES = ("dcredit", "bytescheduler", "wfbp", "dear")
#: What each of ``POLICIES`` does, one line each: the one text every ``--help`` lists.
DESCRIBE = {
    "dcredit": "D-Credit (the runtime's default): measured first, then its planned partition "
               "and dynamic windows",
    "bytescheduler": "ByteScheduler: blocks of partition_bytes in priority order, at most "
                     "credit_bytes in flight",
    "wfbp": "wait-free back-propagation: each gradient whole, as soon as it is ready",
    "dear": "DeAR: 25 MiB buffers reduce-scattered, then all-gathered in forward order "
            "(saves no memory)",
}


def make_policy(name: str, credit_bytes: int, plan: Optional[Plan] = None, *,
                overlap_forward: bool = False, buffer_bytes: Optional[int] = None) -> Policy:
    """The policy object ``name`` names (``config.SchedulerConfig.policy``, validated).

    ``dcredit`` needs a plan; until one exists (while the job is profiled) it runs under
    ``bytescheduler`` rules with the configured credit.  ``overlap_forward``: the runtime
    overlaps the next forward pass (phase-2 windows per tensor) or not (phase 2 drains).
    ``buffer_bytes``: DeAR's buffer size (``group_bytes`` given; None: DeAR's default).
    """
    if name == "wfbp":
        return WFBP()
    if name == "dear":
        return DeAR() if not buffer_bytes else DeAR(buffer_bytes)
    if name == "bytescheduler" or (name == "dcredit" and plan is None):
        return ByteScheduler(credit_bytes)
    if name == "dcredit":
        return DCredit(plan, overlap_forward=overlap_forward)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = ["DESCRIBE", "POLICIES", "ByteScheduler", "DCredit", "DeAR", "Immediate", "Policy", "WFBP",
           "make_policy"]
