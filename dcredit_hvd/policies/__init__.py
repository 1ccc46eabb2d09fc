"""Window rules, one module each.  ``make_policy`` builds the one a config names."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Immediate, Policy
from .bytescheduler import ByteScheduler
from .wfbp import WFBP

if TYPE_CHECKING:
    from ..config import SchedulerConfig

#: Policies a user may name.
POLICIES = ("wfbp", "bytescheduler")


def make_policy(config: "SchedulerConfig") -> Policy:
    """The policy object ``config.policy`` names (the config has been validated)."""
    if config.policy == "wfbp":
        return WFBP()
    if config.policy == "bytescheduler":
        return ByteScheduler(config.credit_bytes)
    raise ValueError(f"unknown policy {config.policy!r}; choose one of {', '.join(POLICIES)}")


__all__ = ["POLICIES", "ByteScheduler", "Immediate", "Policy", "WFBP", "make_policy"]
