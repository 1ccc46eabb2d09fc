"""The plan: D-Credit's windows for one iteration, as the runtime installs them (``Plan``), the
names of the rules that compute them, and the block geometry they are counted in.

Plain data, checked on construction: a plan received from another rank is checked too.  The
planner (``planner``, ``phase1``, ``phase2``) computes it; the policy ``DCredit`` spends it.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from .blocks import partition
from .profile import Profile

#: ``short_gap`` values: what phase 1 does when the idle gap is no longer than one startup.
SHORT_GAP_ONE_BLOCK = "one_block"   # spec §3: send one block of the most urgent pending tensor
SHORT_GAP_DEFER = "defer"           # send nothing; the blocks join the next window
SHORT_GAP_RULES = (SHORT_GAP_ONE_BLOCK, SHORT_GAP_DEFER)
#: ``phase1`` values: how the phase-1 windows are computed.
PHASE1_GREEDY = "greedy"            # spec §3: fill each backward gap, most urgent blocks first
PHASE1_BATCHED = "batched"          # exact optimum over windows that release every ready block
PHASE1_RULES = (PHASE1_GREEDY, PHASE1_BATCHED)
#: ``phase2`` values: how the blocks left after backward are windowed when the next forward
#: overlaps them (``DCredit(plan, overlap_forward=True)``; without overlap phase 2 drains at once
#: whatever the rule).  See ``docs/algorithm.md`` §4b.
PHASE2_PER_TENSOR = "per_tensor"            # spec §4: one window per tensor, each after the last completes
PHASE2_PIPELINED = "pipelined"              # one window per tensor, the next goes out while one is in flight
PHASE2_GROUPED = "grouped"                  # runs of consecutive tensors share a window (model optimum)
PHASE2_GROUPED_PIPELINED = "grouped_pipelined"  # both
PHASE2_RULES = (PHASE2_PER_TENSOR, PHASE2_PIPELINED, PHASE2_GROUPED, PHASE2_GROUPED_PIPELINED)
#: Orders of the sharded mode's all-gathers (``Plan.gather_order``).
GATHER_FORWARD = "forward"                  # strict forward order: layer 0's first
GATHER_READY = "ready"                      # each as soon as its shard is updated
GATHER_ORDERS = (GATHER_FORWARD, GATHER_READY)


@dataclass(frozen=True)
class Plan:
    """The window sizes of one iteration, in blocks of ``partition_bytes`` bytes.

    ``windows`` has ``2L-1`` entries: ``windows[0..L-2]`` are phase-1 send budgets (see the
    module docstring for when each is released), ``windows[L-1+l]`` is tensor ``l``'s phase-2
    window.  Invariants (checked on construction, so a plan received from another rank is checked
    too): every window ``>= 0``; ``sum(windows) == sum(blocks_per_tensor)``; a phase-2 window
    never exceeds its tensor's blocks; no phase-1 budget exceeds the blocks ready by its release.
    """

    partition_bytes: int
    windows: tuple[int, ...]
    #: ``m_l``, from ``blocks.partition`` (a zero-byte tensor is one empty block).
    blocks_per_tensor: tuple[int, ...]
    #: ``last_l``: the last block's bytes over a full block's bytes, in (0, 1] (0 for an empty
    #: tensor).  A single small block has ``last_l = M_l / S_p``, not 1 (spec §2).
    last_fraction: tuple[float, ...] = ()
    #: Model time (seconds from the start of backward) when the link finishes the phase-1 windows.
    predicted_phase1_end: float | None = None
    #: Model iteration period: backward start to the end of the next forward (spec §4 timeline).
    predicted_iteration: float | None = None
    #: How the windows were computed (``plan``'s options), for logs; not used by the runtime.
    rule: str = "greedy"
    #: Phase-2 rule when the next forward overlaps (``plan(phase2=...)``), for logs; the runtime
    #: spends ``phase2_group`` and ``phase2_depth``, which encode it.
    phase2: str = "per_tensor"
    #: Phase-2 window of each tensor under ``DCredit(plan, overlap_forward=True)``: consecutive
    #: tensors with the same number are released together as one window (one fused all-reduce).
    #: Empty: one window per tensor (spec §4).  Non-decreasing, starting at 0, steps of 0 or 1.
    phase2_group: tuple[int, ...] = ()
    #: Phase-2 windows that may be in flight at once under overlap: 1 is spec §4's barrier (the
    #: next window waits for the previous one to complete); 2 lets window ``g+1`` go out while
    #: ``g`` is still in flight, so the link does not drain between windows.
    phase2_depth: int = 1
    #: How the job's tensors form the units this plan counts (``blocks.group_runs``): member
    #: counts per unit, consecutive in forward order; empty: one unit per tensor.  Chosen by
    #: ``planning.decide`` together with ``partition_bytes`` (``docs/algorithm.md`` §1b).
    groups: tuple[int, ...] = ()
    #: The ``group_runs`` limit ``groups`` came from, for logs (0: none).
    group_bytes: int = 0
    #: Sharded mode only (``docs/algorithm.md`` §9): the all-gathers go in strict forward order
    #: (``"forward"``: layer 0's first, what the next forward needs first) or as soon as their
    #: shards are updated (``"ready"``: late layers' during backward, using its idle link).
    gather_order: str = "forward"

    def __post_init__(self) -> None:
        m = self.blocks_per_tensor
        L = len(m)
        w = self.windows
        if not (isinstance(self.partition_bytes, numbers.Integral) and self.partition_bytes > 0):
            raise ValueError(f"Plan.partition_bytes must be a positive int, got {self.partition_bytes!r}")
        if L == 0:
            raise ValueError("Plan: a plan needs at least one tensor")
        if any(not isinstance(x, numbers.Integral) or x < 1 for x in m):
            raise ValueError("Plan invariant violated: every tensor has >= 1 block")
        if len(w) != 2 * L - 1:
            raise ValueError(f"Plan invariant violated: {len(w)} windows for {L} tensors, "
                             f"need 2L-1 = {2 * L - 1}")
        if any(not isinstance(x, numbers.Integral) or x < 0 for x in w):
            raise ValueError("Plan invariant violated: every window must be an int >= 0")
        if sum(w) != sum(m):
            raise ValueError(f"Plan invariant violated: sum(windows) = {sum(w)} != {sum(m)} blocks "
                             f"(spec §6 defect 3)")
        if any(w[L - 1 + l] > m[l] for l in range(L)):
            raise ValueError("Plan invariant violated: a phase-2 window exceeds its tensor's blocks")
        released = ready = 0
        for k in range(L - 1):  # budget k is released when gradient L-1-k is ready
            released += w[k]
            ready += m[L - 1 - k]
            if released > ready:
                raise ValueError(f"Plan invariant violated: phase-1 budgets 0..{k} release {released} "
                                 f"blocks but only {ready} are ready by then")
        if self.last_fraction and len(self.last_fraction) != L:
            raise ValueError("Plan: last_fraction needs one entry per tensor")
        g = self.phase2_group
        if g:
            if len(g) != L or any(not isinstance(x, numbers.Integral) for x in g):
                raise ValueError("Plan: phase2_group needs one int per tensor")
            if g[0] != 0 or any(y - x not in (0, 1) for x, y in zip(g, g[1:])):
                raise ValueError("Plan invariant violated: phase2_group must start at 0 and grow "
                                 "by 0 or 1 from one tensor to the next (consecutive windows)")
        if (isinstance(self.phase2_depth, bool) or not isinstance(self.phase2_depth, numbers.Integral)
                or self.phase2_depth < 1):
            raise ValueError(f"Plan: phase2_depth must be an int >= 1, got {self.phase2_depth!r}")
        if self.gather_order not in GATHER_ORDERS:
            raise ValueError(f"Plan: gather_order must be one of {GATHER_ORDERS}, "
                             f"got {self.gather_order!r}")
        if self.groups and (len(self.groups) != L or any(
                not isinstance(x, numbers.Integral) or x < 1 for x in self.groups)):
            raise ValueError(f"Plan: groups needs one member count >= 1 per unit ({L} units), "
                             f"got {self.groups!r}")

    @property
    def num_parameters(self) -> int:
        """Tensors of the job (units unfold into their members)."""
        return sum(self.groups) if self.groups else self.num_tensors

    def phase2_window_of(self, tensor: int) -> int:
        """The phase-2 window (under overlap) that tensor ``tensor``'s remaining blocks belong to."""
        return self.phase2_group[tensor] if self.phase2_group else tensor

    @property
    def num_tensors(self) -> int:
        return len(self.blocks_per_tensor)

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks_per_tensor)

    @property
    def label(self) -> str:
        """``rule``, plus the phase-2 rule when it is not spec §4's (as search tables print it)."""
        return self.rule if self.phase2 == PHASE2_PER_TENSOR else f"{self.rule} + {self.phase2}"

    @property
    def phase1_windows(self) -> tuple[int, ...]:
        """``windows[0..L-2]``; ``windows[k]`` is released when gradient ``L-1-k`` is ready."""
        return self.windows[: self.num_tensors - 1]

    @property
    def phase2_windows(self) -> tuple[int, ...]:
        """``windows[L-1+l]``: tensor ``l``'s blocks left for the next forward pass."""
        return self.windows[self.num_tensors - 1:]

    def phase1_budget(self, ready_tensor: int) -> int:
        """Blocks of send budget added when gradient ``ready_tensor`` becomes ready.

        ``windows[L-1-j]`` for ``j = L-1..1``; 0 for ``j = 0`` (tensor 0's window is phase 2).
        """
        L = self.num_tensors
        if not 0 <= ready_tensor < L:
            raise IndexError(f"tensor {ready_tensor} out of range for a plan of {L} tensors")
        return 0 if ready_tensor == 0 else self.windows[L - 1 - ready_tensor]

    def describe(self) -> str:
        p1 = sum(self.phase1_windows)
        text = (f"D-Credit plan: S_p={self.partition_bytes} B, L={self.num_tensors}, "
                f"{self.total_blocks} blocks ({p1} in phase 1 over "
                f"{sum(1 for x in self.phase1_windows if x)} windows, {self.total_blocks - p1} in phase 2)")
        if self.predicted_iteration is not None:
            text += f", model iteration {self.predicted_iteration * 1e3:.3f} ms"
        text += f", rule {self.rule}"
        if self.groups and len(self.groups) != self.num_parameters:
            text += (f", {self.num_parameters} tensors in {self.num_tensors} units (runs of "
                     f"small tensors up to {self.group_bytes} B share a buffer)")
        if self.phase2 != PHASE2_PER_TENSOR or self.phase2_depth != 1:
            groups = len({self.phase2_window_of(l) for l, p in enumerate(self.phase2_windows) if p})
            text += (f", phase 2 (overlap) {self.phase2}: {groups} windows, "
                     f"up to {self.phase2_depth} in flight")
        return text


@dataclass(frozen=True)
class _Shape:
    """Per-tensor block geometry derived from ``blocks.partition`` (one source of truth)."""

    blocks: tuple[int, ...]      # m_l
    full_bytes: tuple[int, ...]  # bytes of a full block of tensor l (S_p when S_p % esize == 0)
    last_bytes: tuple[int, ...]  # bytes of tensor l's last block


def _shape(profile: Profile, partition_bytes: int) -> _Shape:
    blocks, full, last = [], [], []
    for l, (nbytes, esize) in enumerate(zip(profile.nbytes, profile.element_size)):
        if nbytes % esize:
            raise ValueError(f"tensor {l} ({profile.names[l]}): {nbytes} bytes is not a whole number "
                             f"of {esize}-byte elements")
        ranges = partition(nbytes // esize, esize, partition_bytes)
        nominal = esize * max(1, partition_bytes // esize)
        if len(ranges) > 1 and (ranges[0][1] - ranges[0][0]) * esize != nominal:
            raise AssertionError("blocks.partition changed its block size rule; update plan._shape")
        blocks.append(len(ranges))
        full.append(nominal)
        last.append((ranges[-1][1] - ranges[-1][0]) * esize)
    return _Shape(tuple(blocks), tuple(full), tuple(last))
