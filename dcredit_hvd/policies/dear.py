"""DeAR's rules: fused buffers reduce-scattered during backward, all-gathered one ahead in forward.

Zhang, Shi, Chu, Wang, Li and Liu, "DeAR: Accelerating Distributed Deep Learning with
Fine-Grained All-Reduce Pipelining", ICDCS 2023 (arXiv 2302.12445); the authors' code is
``lzhangbv/dear_pytorch`` (``dear/dopt_rsag.py``), read, not copied.  The baseline the D-Credit
paper reports 1.21x over (spec §7).

* Buffers (``dear_groups``): tensors are fused in forward order into buffers; a tensor joins
  the open buffer while the buffer is empty or stays under the threshold, 25 MiB by default
  (``THRESHOLD = 25`` MB of float32, counted as ``numel * 4 / 1024 / 1024``)::

      join(l)  <=>  bytes(buffer) == 0  or  bytes(buffer) + M_l < threshold

  (the authors group whole modules; a profile knows tensors, so tensors are grouped here).
* Reduce-scatter (``DeAR``): a buffer goes as soon as every gradient in it is ready, whole,
  with no window: ``admit`` is always True.
* All-gather (``DeARGather``): ``step()`` waits for every reduce-scatter, then starts buffer 0's
  all-gather; the forward pre-hook of each buffer's first module waits for its all-gather and
  starts the next buffer's.  One buffer is in flight at a time, in forward order::

      admit(head)  <=>  no all-gather in flight

  The authors start buffer ``g+1`` when the forward REACHES buffer ``g``; releasing it as soon as
  ``g`` completes is never later, so the simulator's DeAR is, if anything, optimistic.
* Updates: every rank all-gathers the reduced gradient (not parameters) and updates the whole
  tensor in the forward pre-hook: DeAR saves no memory.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from ..planning.blocks import Block
from .base import Policy

#: DeAR's default buffer: ``THRESHOLD = 25`` (MiB of float32 gradients).
DEAR_BUFFER_BYTES = 25 * 1024 * 1024


def dear_groups(nbytes: Sequence[int], threshold_bytes: int = DEAR_BUFFER_BYTES,
                kinds: Sequence[object] = ()) -> tuple[int, ...]:
    """Member counts of DeAR's buffers over tensors in forward order (module docstring's rule).
    ``kinds`` (``Profile.group_kinds``): a buffer holds one kind (dtype) only, and a tensor of
    kind None (never grouped: CUDA) is a buffer of its own."""
    if threshold_bytes <= 0:
        raise ValueError(f"dear: the buffer threshold must be > 0 bytes, got {threshold_bytes}")
    kinds = tuple(kinds) or (0,) * len(nbytes)
    counts: list[int] = []
    total = 0
    for i, size in enumerate(nbytes):
        same = i > 0 and kinds[i] is not None and kinds[i] == kinds[i - 1]
        if counts and same and (total == 0 or total + size < threshold_bytes):
            counts[-1] += 1
            total += size
        else:
            counts.append(1)
            total = size
    return tuple(counts)


class DeAR(Policy):
    """The reduce-scatter half: each fused buffer goes whole as soon as it is complete."""

    name = "dear"

    def __init__(self, buffer_bytes: int = DEAR_BUFFER_BYTES) -> None:
        super().__init__()
        if buffer_bytes <= 0:
            raise ValueError(f"dear: buffer_bytes must be > 0, got {buffer_bytes}")
        self.buffer_bytes = int(buffer_bytes)

    def partition_bytes(self, configured: Optional[int]) -> Optional[int]:
        return None  # a buffer is never cut

    def groups(self, nbytes: Sequence[int], kinds: Sequence[object]) -> tuple[int, ...]:
        return dear_groups(nbytes, self.buffer_bytes, kinds)

    def admit(self, block: Block) -> bool:
        return True

    def gather_rule(self) -> Policy:
        return DeARGather()

    def describe(self) -> str:
        return f"dear(buffers <= {self.buffer_bytes} B)"


class DeARGather(Policy):
    """The all-gather half: one buffer in flight, in forward order."""

    name = "dear-gather"

    def __init__(self) -> None:
        super().__init__()
        self.inflight: Optional[tuple[int, int]] = None

    def start_iteration(self) -> None:
        self.inflight = None

    def admit(self, block: Block) -> bool:
        if self.inflight is not None:
            return False
        self.inflight = block.key
        return True

    def on_complete(self, block: Block) -> None:
        if block.key == self.inflight:
            self.inflight = None
