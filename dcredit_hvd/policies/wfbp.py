"""Wait-free back-propagation: each gradient goes out whole as soon as it is ready.

The classic baseline (Poseidon, Zhang et al. 2017; "WFBP" in the D-Credit paper): no partition,
no window, no priority beyond readiness order.
"""
from __future__ import annotations

from typing import Optional

from ..planning.blocks import Block
from .base import Policy


class WFBP(Policy):
    name = "wfbp"

    def partition_bytes(self, configured: Optional[int]) -> Optional[int]:
        return None  # whole tensors, whatever the configured partition

    def admit(self, block: Block) -> bool:
        return True
