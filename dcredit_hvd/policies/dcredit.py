"""D-Credit's runtime rule: dynamic send budgets during backward, per-tensor windows after it.

Gao et al., "A Dynamic Sliding Window Based Tensor Communication Scheduling Framework for
Distributed Deep Learning", IEEE TNSE 12(2), 2025; spec §5.  The windows come from
``planner.plan``; this class only spends them.

* Phase 1 (backward): when gradient ``j`` becomes ready (``j = L-1 .. 1``), the send budget grows
  by ``windows[L-1-j]`` blocks (``Plan.phase1_budget``); the head of the queue is released while
  the budget is positive, one block per unit::

      admit(head)  <=>  budget > 0            (then budget -= 1)

  Completions do not return budget: it is a cumulative allowance, not an in-flight limit.  Each
  tensor's budget is credited exactly once per iteration, whatever the order of ready events (the
  authors' runtime credited only a new minimum layer and lost budgets, research notes B11).
* Phase 2 (from ``on_backward_end``) depends on whether the next forward overlaps it:

  - ``overlap_forward=False`` (the runtime today: ``step()`` waits for every block, then
    updates, then the next forward starts): everything left is released at once, in priority
    order (``admit(head)`` is always True).  A barrier between tensors could only delay the
    step: nothing can use tensor ``l``'s gradient before the last block is reduced anyway, and
    releasing together lets Horovod fuse the rest into as few all-reduces as its fusion buffer
    allows (one startup instead of one startup plus one cycle per tensor).
  - ``overlap_forward=True`` (spec §4: forward of layer ``l`` waits only for tensor ``l``): what
    is left goes out window by window in priority (forward) order.  A window is one tensor
    (spec §4) or, under ``Plan.phase2_group``, a run of consecutive tensors released together.
    With ``Plan.phase2_depth == 1`` (spec) the head's window opens only when every block
    released by earlier phase-2 windows has completed, so window ``g+1`` never competes with
    ``g``.  With depth ``d > 1`` it may open while fewer than ``d`` windows are in flight,
    provided a completion (of any block) was seen since the last window opened: the gate learns
    of completions after Horovod's next cycle began, so the previous window has then been taken
    by a cycle and the new one lands in a later cycle instead of being fused with it::

        admit(head)  <=>  window(head) == open
                          or  no phase-2 block in flight
                          or  (windows in flight < depth  and  a completion since open changed)
                          (then open = window(head))

  Liveness: a refusal in phase 2 implies a phase-2 block in flight; its completion sets the
  completion flag and, eventually, empties the in-flight set, after which the next ``admit``
  succeeds.  Without overlap nothing is refused.  So every queued block is released once
  completions arrive, whatever blocks, tensors or ready events the driver saw (the authors'
  runtime counted dispatches against ``sum(windows)`` and could hang, spec §6 defect 9).

Blocks released in phase 1 and still in flight do not gate phase 2: they are already submitted,
and the planner's timeline already queues phase 2 behind them.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..planning.blocks import Block, TensorLayout
from ..planning.costmodel import CostModel
from ..planning.plan import GATHER_FORWARD
from ..planning.planner import Plan
from ..planning.planner import plan as make_plan
from ..planning.profile import Profile
from .base import Policy


class DCredit(Policy):
    """Spends a :class:`~dcredit_hvd.planning.planner.Plan`; one instance per job, reset every iteration."""

    name = "dcredit"

    def __init__(self, plan: Plan, *, overlap_forward: bool = False) -> None:
        super().__init__()
        self.plan = plan
        #: True: spec §4's per-tensor phase-2 windows (the next forward overlaps them).  False:
        #: phase 2 releases everything left at once (``step()`` waits for every block).
        self.overlap_forward = bool(overlap_forward)
        L = plan.num_tensors
        #: Budget added when gradient j is ready, precomputed so ``on_ready`` is O(1).
        self._budget_of = tuple(plan.phase1_budget(j) for j in range(L))
        self._credited = bytearray(L)
        self._budget = 0
        self._phase = 1
        #: Phase-2 window of each tensor, and how many windows may be in flight at once.
        self._window_of = tuple(plan.phase2_window_of(l) for l in range(L))
        self._depth = plan.phase2_depth
        self._open = -1                                  # the open phase-2 window
        self._inflight2: dict[tuple[int, int], int] = {}  # keys released in phase 2 -> window
        self._window_inflight: dict[int, int] = {}       # window -> its blocks in flight
        self._completed_since_open = False
        #: Blocks released in each phase this iteration, and budget left when backward ended.
        self.released = [0, 0]
        self.unused_budget = 0

    @classmethod
    def from_profile(cls, profile: Profile, cost: CostModel, partition_bytes: int, *,
                     overlap_forward: bool = False, **plan_options) -> DCredit:
        """Plan with ``planner.plan(profile, cost, partition_bytes, **plan_options)`` and spend it."""
        plan_options.setdefault("overlap_forward", overlap_forward)
        return cls(make_plan(profile, cost, partition_bytes, **plan_options),
                   overlap_forward=overlap_forward)

    def partition_bytes(self, configured: int | None) -> int | None:
        """The plan's ``S_p``, whatever was configured: planner and runtime must agree (defect 5)."""
        return self.plan.partition_bytes

    def groups(self, nbytes: Sequence[int], kinds: Sequence[object]) -> tuple[int, ...]:
        return tuple(self.plan.groups)

    def gather_rule(self) -> DCredit:
        """The same plan's phase 2 for the all-gathers: its windows when they overlap the next
        forward, everything at once when ``step()`` waits for them."""
        return DCredit(self.plan, overlap_forward=self.overlap_forward)

    def scatter_rule(self) -> DCredit:
        return DCredit(self.plan, overlap_forward=False) if self.overlap_forward else self

    def gathers_in_forward_order(self) -> bool:
        return self.plan.gather_order == GATHER_FORWARD

    def bind(self, layouts: Sequence[TensorLayout]) -> None:
        """Refuse a layout the plan was not made for: a count mismatch is how the authors' runtime hung."""
        m = self.plan.blocks_per_tensor
        if len(layouts) != len(m):
            raise ValueError(f"dcredit: the plan covers {len(m)} tensors but the job has {len(layouts)}; "
                             f"re-plan with the job's profile")
        S_p = self.plan.partition_bytes
        for layout, count in zip(layouts, m):
            full = layout.element_size * max(1, S_p // layout.element_size)
            if len(layout.blocks) != count or (count > 1 and layout.blocks[0].nbytes != full):
                raise ValueError(
                    f"dcredit: tensor {layout.index} ({layout.name}) is cut into {len(layout.blocks)} "
                    f"blocks of {layout.blocks[0].nbytes} B but the plan expects {count} of {full} B; "
                    f"build the layout with partition_bytes={S_p} (the policy's partition_bytes())")
        super().bind(layouts)

    def start_iteration(self) -> None:
        self._credited = bytearray(self.plan.num_tensors)
        self._budget = 0
        self._phase = 1
        self._open = -1
        self._inflight2 = {}
        self._window_inflight = {}
        self._completed_since_open = False
        self.released = [0, 0]
        self.unused_budget = 0

    def on_ready(self, tensor: int) -> None:
        """Add tensor ``tensor``'s phase-1 budget, once per iteration, in any arrival order."""
        if not 0 <= tensor < len(self._budget_of):
            raise IndexError(f"dcredit: tensor {tensor} out of range 0..{len(self._budget_of) - 1}")
        if self._phase == 1 and not self._credited[tensor]:
            self._credited[tensor] = 1
            self._budget += self._budget_of[tensor]

    def on_backward_end(self) -> None:
        if self._phase == 1:
            self.unused_budget = self._budget
        self._phase = 2
        self._budget = 0

    def on_complete(self, block: Block) -> None:
        self._completed_since_open = True
        window = self._inflight2.pop(block.key, None)
        if window is not None:
            left = self._window_inflight[window] - 1
            if left:
                self._window_inflight[window] = left
            else:
                del self._window_inflight[window]

    def admit(self, block: Block) -> bool:
        if self._phase == 1:
            if self._budget <= 0:
                return False
            self._budget -= 1
            self.released[0] += 1
            return True
        if not self.overlap_forward:
            self.released[1] += 1
            return True
        window = self._window_of[block.tensor]
        if window != self._open:
            busy = len(self._window_inflight)
            if busy and (busy >= self._depth or not self._completed_since_open):
                return False
            self._open = window
            self._completed_since_open = False
        self._inflight2[block.key] = window
        self._window_inflight[window] = self._window_inflight.get(window, 0) + 1
        self.released[1] += 1
        return True

    @property
    def phase2_windows_in_flight(self) -> int:
        """Phase-2 windows with a released block not yet completed (at most ``phase2_depth``)."""
        return len(self._window_inflight)

    def describe(self) -> str:
        p = self.plan
        p1 = sum(p.phase1_windows)
        if not self.overlap_forward:
            phase2 = "released at once"
        elif not p.phase2_group and p.phase2_depth == 1:
            phase2 = "per-tensor windows"
        else:
            phase2 = f"{p.phase2} windows, up to {p.phase2_depth} in flight"
        return (f"dcredit(S_p={p.partition_bytes} B, L={p.num_tensors}, {p.total_blocks} blocks: "
                f"{p1} in {sum(1 for w in p.phase1_windows if w)} phase-1 windows, "
                f"{p.total_blocks - p1} in phase 2, {phase2})")
