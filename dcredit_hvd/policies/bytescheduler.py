"""ByteScheduler's rule: priority order under a FIXED credit of bytes in flight.

Peng et al., "A Generic Communication Scheduler for Distributed DNN Training Acceleration",
SOSP 2019.  Blocks of ``S_p`` bytes leave in priority order while the bytes in flight stay within
the credit ``C``; each completion returns its bytes::

    admit(b)  <=>  inflight == 0  or  inflight + bytes(b) <= C

The ``inflight == 0`` clause lets a block larger than the credit go alone instead of stalling.
"""
from __future__ import annotations

from ..planning.blocks import Block
from .base import Policy


class ByteScheduler(Policy):
    name = "bytescheduler"

    def __init__(self, credit_bytes: int) -> None:
        super().__init__()
        if credit_bytes <= 0:
            raise ValueError(f"credit_bytes must be > 0, got {credit_bytes}")
        self.credit_bytes = int(credit_bytes)
        self.inflight_bytes = 0

    def start_iteration(self) -> None:
        # Blocks of the previous iteration have all completed by the time a new one starts.
        self.inflight_bytes = 0

    def admit(self, block: Block) -> bool:
        if self.inflight_bytes and self.inflight_bytes + block.nbytes > self.credit_bytes:
            return False
        self.inflight_bytes += block.nbytes
        return True

    def on_complete(self, block: Block) -> None:
        self.inflight_bytes -= block.nbytes

    def gather_rule(self) -> Policy:
        return ByteScheduler(self.credit_bytes)

    def describe(self) -> str:
        return f"bytescheduler(credit={self.credit_bytes} B)"
