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

    def groups(self, nbytes: Sequence[int], kinds: Sequence[object]) -> tuple[int, ...]:
        """The units this rule sends: member counts of runs of consecutive tensors that share
        one buffer (``blocks.build_layout``); ``()``: every tensor is its own unit."""
        return ()

    def gather_rule(self) -> Policy:
        """A fresh instance of this rule for the all-gathers, when each all-reduce is split into
        a reduce-scatter during backward and an all-gather during the next forward (the driver
        calls its ``on_backward_end`` before the first all-gather: it runs as phase 2)."""
        return type(self)()

    def scatter_rule(self) -> Policy:
        """This rule for the reduce-scatters when each all-reduce is split in two: ``step()``
        waits for every one of them before the all-gathers start, so nothing is gained by
        holding the rest back at the end of backward (``DCredit``: phase 2 drains)."""
        return self

    def gathers_in_forward_order(self) -> bool:
        """Whether the sharded mode holds each all-gather until every earlier one has gone
        (``InForwardOrder``); the next forward needs layer 0's parameters first."""
        return True

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


class InForwardOrder(Policy):
    """Another rule, restricted to blocks in strict priority (forward) order.

    The all-gathers of the sharded mode become ready in the order their reduce-scatters and
    shard updates finish, which is backward order: the last layers first.  The next forward
    needs layer 0 first, so a block may go only when every block before it has gone::

        admit(head)  <=>  head == next block in (tensor, index) order  and  inner.admit(head)

    Liveness: every block becomes ready eventually, so ``next`` does, and it is then the head.
    """

    name = "in-forward-order"

    def __init__(self, inner: Policy) -> None:
        super().__init__()
        self.inner = inner
        self._next = (0, 0)

    def bind(self, layouts: Sequence[TensorLayout]) -> None:
        super().bind(layouts)
        self.inner.bind(layouts)

    def start_iteration(self) -> None:
        self._next = (0, 0)
        self.inner.start_iteration()

    def on_ready(self, tensor: int) -> None:
        self.inner.on_ready(tensor)

    def on_backward_end(self) -> None:
        self.inner.on_backward_end()

    def on_complete(self, block: Block) -> None:
        self.inner.on_complete(block)

    def admit(self, block: Block) -> bool:
        if block.key != self._next or not self.inner.admit(block):
            return False
        t, i = block.key
        self._next = (t, i + 1) if i + 1 < len(self.layouts[t].blocks) else (t + 1, 0)
        return True

    def describe(self) -> str:
        return f"{self.inner.describe()} in forward order"
