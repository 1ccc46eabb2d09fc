"""The contract between a window rule and whoever drives it (runtime gate or simulator).

A policy never touches tensors, threads or Horovod.  The driver keeps a priority queue of ready
blocks (lowest ``(tensor, index)`` first) and tells the policy what happens:

* ``bind(layouts)`` once, when the block layout of the job is known;
* ``start_iteration()`` before the first gradient of an iteration;
* ``on_ready(tensor)`` when gradient ``tensor`` is ready and its blocks are queued;
* ``on_backward_end()`` when no more gradients will become ready this iteration;
* ``on_complete(block)`` when a released block's all-reduce has finished.

After every event the driver asks ``admit(head)`` for the head of the queue, releasing it while
the answer is True.  Releases are therefore always a prefix of the priority order: a more urgent
block is never overtaken by a less urgent one that is queued beside it (spec §5).

The runtime and ``simulator`` drive the same objects, so there is one implementation of each rule.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Optional

from ..planning.blocks import Block, TensorLayout


class Policy(ABC):
    """Base class of window rules.  Subclasses hold their state; one instance per job."""

    #: Registry name, as given to ``DistributedOptimizer(policy=...)`` and ``DCREDIT_POLICY``.
    name: ClassVar[str]

    def __init__(self) -> None:
        self.layouts: Sequence[TensorLayout] = ()

    def partition_bytes(self, configured: Optional[int]) -> Optional[int]:
        """Block size this rule sends with; ``None`` keeps tensors whole."""
        return configured

    def bind(self, layouts: Sequence[TensorLayout]) -> None:
        self.layouts = layouts

    def start_iteration(self) -> None:
        """Reset per-iteration state."""

    def on_ready(self, tensor: int) -> None:
        """Gradient ``tensor`` is ready; its blocks are now in the queue."""

    def on_backward_end(self) -> None:
        """Backward is over (or the user synchronised): the rest of the queue may drain."""

    def on_complete(self, block: Block) -> None:
        """``block``'s all-reduce finished."""

    @abstractmethod
    def admit(self, block: Block) -> bool:
        """May ``block``, the most urgent queued block, be released now?

        A True answer commits the release: the policy accounts for it before returning.
        """

    def describe(self) -> str:
        return self.name


class Immediate(Policy):
    """Release every block as soon as it is ready.

    Used by every rank except the gate rank: Horovod starts an all-reduce only when all ranks
    have submitted its name, so when non-gate ranks submit at once, the gate rank's order is the
    global order and no rank ever waits for another's window (spec §5, ``docs/design.md``).
    """

    name = "immediate"

    def admit(self, block: Block) -> bool:
        return True
