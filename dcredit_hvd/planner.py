"""D-Credit's two-phase window plan (spec §3-§4), with the reference code's defects fixed.

Gao et al., "A Dynamic Sliding Window Based Tensor Communication Scheduling Framework for
Distributed Deep Learning", IEEE TNSE 12(2), 2025.  Notation (spec §2, ``docs/algorithm.md``):
tensors ``l = 0..L-1`` in forward order, ``m_l`` blocks each, ``r_l = sum_{k>=l} t_b(k)`` the time
gradient ``l`` is ready after backward starts, ``T(bytes) = a + b * bytes`` per window.

Phase-1 release mapping (the one place it is defined; ``Plan.phase1_budget`` encodes it):

* greedy step ``l`` (``l = L-2 .. 0``) computes ``windows[L-2-l]``; it plans the idle link time
  ``(tau, r_l]`` that ends when gradient ``l`` becomes ready, and is RELEASED when gradient
  ``l+1`` becomes ready (at ``r_{l+1} <= tau``), so it may only hold blocks of tensors ``>= l+1``;
* equivalently, when gradient ``j`` becomes ready (``j = L-1 .. 1``) the runtime adds a send
  budget of ``windows[L-1-j]`` blocks; gradient ``0`` adds nothing (no gap follows it);
* ``windows[L-1+l]`` (``l = 0..L-1``) is phase 2: what is left of tensor ``l`` when backward ends,
  sent in forward order during the next forward pass.

This agrees with the authors' runtime (``credit += S_c[L-1-p]`` when tensor ``p`` becomes ready)
and with spec §3 ("a window is released when gradient l+1 is ready").
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .blocks import partition
from .costmodel import CostModel
from .profile import Profile

if TYPE_CHECKING:
    import numpy


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
            raise AssertionError("blocks.partition changed its block size rule; update planner._shape")
        blocks.append(len(ranges))
        full.append(nominal)
        last.append((ranges[-1][1] - ranges[-1][0]) * esize)
    return _Shape(tuple(blocks), tuple(full), tuple(last))


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
#: Windows in flight at once under each pipelined rule.
PIPELINE_DEPTH = 2
#: ``phase1="batched"`` under overlap tries every last phase-1 release up to this many tensors,
#: and about this many of them, then the best one's neighbourhood, above it.
BATCHED_GRID = 48


def plan(profile: Profile, cost: CostModel, partition_bytes: int, *, cycle_s: float = 0.0,
         short_gap: str = SHORT_GAP_ONE_BLOCK, overlap_forward: bool = True,
         phase1: str = PHASE1_GREEDY, phase2: str = PHASE2_PER_TENSOR) -> Plan:
    """Compute D-Credit's windows for ``profile`` under ``cost`` with blocks of ``partition_bytes``.

    Phase 1, ``phase1="greedy"`` (spec §3, the greedy of Gao et al. with defects 1-3 fixed): for
    ``l = L-2 .. 0``, ``dt = r_l - tau - a`` is the idle link time before gradient ``l`` is ready,
    less one startup; pending blocks are taken highest priority (lowest ``l'``) first:

    * ``dt <= -a``: the link is still busy, take nothing;
    * ``-a < dt <= 0``: ``short_gap="one_block"`` (spec) takes one block (charged ``last_l'`` if it
      is the tensor's last); ``short_gap="defer"`` takes nothing, the block joins a later window
      (a window whose startup does not fit in the idle gap costs more link time than it saves);
    * ``(pending_l' - 1) * b * S_p >= dt``: ``l'`` alone fills the gap, take ``ceil(dt / (b S_p))``;
    * else take all of ``l'`` and ``dt -= (k - 1 + last_l') * b * S_p`` with ``k`` the count taken
      BEFORE zeroing it (defect 1), ``last_l`` in (0, 1] (defect 2), and continue.

    Every take ADDS to the window (defect 3), then ``tau = max(tau + (W > 0) T(window bytes), r_l)``
    and tensor ``l`` joins the pending set.  Phase 2 (spec §4): ``windows[L-1+l] = pending_l``.

    ``phase1="batched"``: the exact optimum, under the same cost model, over plans whose windows
    release every ready block (``_batched``).

    ``phase2`` (only spent under ``DCredit(plan, overlap_forward=True)``) decides how the blocks
    left after backward are windowed, recorded in ``Plan.phase2_group`` / ``Plan.phase2_depth``:
    ``"per_tensor"`` (spec §4: one window per tensor, each released when the previous completed),
    ``"pipelined"`` (one window per tensor, the next released while one is still in flight),
    ``"grouped"`` (runs of consecutive tensors share one window, the runs chosen to minimise the
    model timeline, ``_phase2_layout``), ``"grouped_pipelined"`` (both).  The windows'
    sizes (``windows[L-1+l]``) and the phase-1 windows of the greedy do not depend on it; the
    batched rule's choice of what to leave to phase 2 does (it minimises the timeline).

    ``cycle_s`` is Horovod's cycle (``HOROVOD_CYCLE_TIME``): a window released on an idle link
    waits for the next cycle, and a phase-2 window released on a completion misses the cycle that
    starts at that completion.  It enters the model timeline (``predicted_iteration``) and the
    batched optimum; the greedy's decisions do not depend on it (shifting every start by one cycle
    shifts every deadline ``r_l`` the same way).  ``overlap_forward`` selects the timeline: True
    models spec §4's phase 2 (one window per tensor, the next forward overlapping), False the
    runtime's drain (everything left released at once at the end of backward, the next forward
    after the last all-reduce).  The defaults (``cycle_s=0``, ``short_gap="one_block"``,
    ``overlap_forward=True``, ``phase1="greedy"``, ``phase2="per_tensor"``) are spec §3-§4
    literally; ``docs/algorithm.md`` argues each deviation from the cost model.

    ``b * S_p`` is the time of one full block; blocks are cut exactly as ``blocks.partition``
    cuts them, so a full block holds ``max(1, S_p // element_size)`` elements (``S_p`` bytes
    whenever ``S_p`` is a multiple of the element size).  Pending tensors form a stack (the newest
    is always the most urgent), so the greedy runs in O(L) amortised time.
    """
    _check_options(partition_bytes, cycle_s, short_gap, phase1, phase2)
    partition_bytes = int(partition_bytes)
    cycle_s = float(cycle_s)
    if profile.num_tensors == 0:
        raise ValueError("plan: the profile has no tensors; nothing to schedule")
    shape = _shape(profile, partition_bytes)
    last = [lb / f for lb, f in zip(shape.last_bytes, shape.full_bytes)]
    if phase1 == PHASE1_BATCHED:
        return _batched(profile, cost, partition_bytes, shape, last, cycle_s, overlap_forward, phase2)
    return _greedy(profile, cost, partition_bytes, shape, last, cycle_s, short_gap, overlap_forward, phase2)


def _check_options(partition_bytes: object, cycle_s: object, short_gap: str, phase1: str,
                   phase2: str) -> None:
    """``plan``'s options, refused before any work with a message naming the option."""
    if (isinstance(partition_bytes, bool) or not isinstance(partition_bytes, numbers.Integral)
            or partition_bytes <= 0):
        raise ValueError(f"plan: partition_bytes must be a positive int, got {partition_bytes!r}")
    if not (isinstance(cycle_s, numbers.Real) and math.isfinite(cycle_s) and cycle_s >= 0):
        raise ValueError(f"plan: cycle_s must be a finite number of seconds >= 0, got {cycle_s!r}")
    if phase1 not in PHASE1_RULES:
        raise ValueError(f"plan: phase1 must be one of {', '.join(PHASE1_RULES)}, got {phase1!r}")
    if short_gap not in SHORT_GAP_RULES:
        raise ValueError(f"plan: short_gap must be one of {', '.join(SHORT_GAP_RULES)}, "
                         f"got {short_gap!r}")
    if phase2 not in PHASE2_RULES:
        raise ValueError(f"plan: phase2 must be one of {', '.join(PHASE2_RULES)}, got {phase2!r}")


def _greedy(profile: Profile, cost: CostModel, partition_bytes: int, shape: _Shape, last: list[float],
            cycle_s: float, short_gap: str, overlap_forward: bool, phase2: str) -> Plan:
    """``phase1="greedy"`` (spec §3, as :func:`plan`'s docstring states it): one window per
    backward gap (``_fill_gap``); what is left when backward ends is phase 2."""
    L = profile.num_tensors
    m = shape.blocks
    a = cost.a
    unit = [cost.b * f for f in shape.full_bytes]                  # seconds of one full block
    r = profile.ready_times()
    # Below this dt the window is left empty: -a (spec: the link is still busy) or 0 (defer a
    # window whose startup would not fit in the idle gap).
    busy_below = -a if short_gap == SHORT_GAP_ONE_BLOCK else 0.0

    pending = [0] * L
    pending[L - 1] = m[L - 1]
    stack = [L - 1]            # tensors with pending blocks; top = lowest index = most urgent
    windows = [0] * (2 * L - 1)
    tau = r[L - 1]             # when the link becomes free
    for l in range(L - 2, -1, -1):
        taken, busy = _fill_gap(r[l] - tau - a, pending, stack, unit, last, busy_below)
        windows[L - 2 - l] = taken
        if taken:
            tau += a + busy
        tau = max(tau, r[l])
        pending[l] += m[l]
        stack.append(l)
    windows[L - 1:] = pending
    group, depth = _phase2_layout(profile, cost, shape, pending, phase2, cycle_s, tau)
    predicted = _phase2_timeline(profile, cost, shape, pending, tau, cycle_s, overlap_forward, group, depth)
    return Plan(partition_bytes=partition_bytes, windows=tuple(windows), blocks_per_tensor=m,
                last_fraction=tuple(last), predicted_phase1_end=tau,
                predicted_iteration=predicted, rule=f"{PHASE1_GREEDY}/{short_gap}",
                phase2=phase2, phase2_group=group, phase2_depth=depth)


def _fill_gap(dt: float, pending: list[int], stack: list[int], unit: Sequence[float],
              last: Sequence[float], busy_below: float) -> tuple[int, float]:
    """One greedy window: blocks taken, most urgent first (top of ``stack``, emptied tensors
    popped, ``pending`` reduced in place), into an idle gap ``dt`` by :func:`plan`'s cases.
    Returns ``(blocks taken, their transfer seconds, startup excluded)``."""
    taken = 0
    busy = 0.0
    while stack:
        top = stack[-1]
        p = pending[top]
        if dt <= busy_below:
            break
        if dt <= 0:
            pending[top] = p - 1
            taken += 1
            busy += (last[top] if p == 1 else 1.0) * unit[top]
            if p == 1:
                stack.pop()
            break
        if (p - 1) * unit[top] >= dt:
            k = min(p - 1, max(1, math.ceil(dt / unit[top])))  # clamp float rounding
            pending[top] = p - k
            taken += k
            busy += k * unit[top]
            break
        rest = (p - 1 + last[top]) * unit[top]                 # uses k = p, before zeroing
        taken += p
        busy += rest
        dt -= rest
        pending[top] = 0
        stack.pop()
    return taken, busy


def _batched(profile: Profile, cost: CostModel, partition_bytes: int, shape: _Shape,
             last: list[float], cycle_s: float, overlap_forward: bool,
             phase2: str = PHASE2_PER_TENSOR) -> Plan:
    """``phase1="batched"``: the best plan, under the planner's model, among plans whose every
    non-empty phase-1 window releases ALL blocks ready and not yet sent (see ``docs/algorithm.md``).

    A window released when gradient ``j`` is ready then holds tensors ``j..k-1`` whole, ``k`` the
    previous release; it starts at ``max(E_k, r_j + cycle_s)`` (link free, or the next Horovod
    cycle) and ends ``a + b * bytes(j..k-1)`` later.  ``E_j = min over k > j`` of that end is an
    exact dynamic programme (each term grows with ``E_k``, so the best ``E_k`` is the only one
    worth keeping), O(L^2) vectorised.

    * ``overlap_forward=False``: the last release is at the end of backward (phase 2, everything
      left at once): minimise ``E_0``, the end of the last all-reduce, which ``step()`` waits for.
    * ``overlap_forward=True``: choose the last phase-1 release ``k`` (``k = L``: none); tensors
      ``0..k-1`` go in phase-2 windows (laid out by ``phase2``, ``_phase2_layout``) after
      ``E_k``; minimise the ``_phase2_timeline`` of that choice.  Every ``k`` when
      ``L <= BATCHED_GRID``; beyond, every ``L // BATCHED_GRID``-th ``k`` (``k = L`` included),
      then every ``k`` between the best one's neighbours on that grid (exact when the
      timeline is unimodal in ``k``, a local optimum otherwise).

    The family contains "release every gradient as soon as it is ready" (what Horovod does), so
    under the model the result is never worse than that.
    """
    L = profile.num_tensors
    m = shape.blocks
    r = profile.ready_times()
    E, prev = _release_chain(profile, cost, r, cycle_s)
    if not overlap_forward:
        windows, pending = _chain_windows(m, prev, 0, prev[0])
        link_free = float(E[prev[0]]) if prev[0] < L else r[0]
        group, depth = _phase2_layout(profile, cost, shape, pending, phase2, cycle_s, link_free)
        link_free = max(link_free, r[0])
        predicted = max(float(E[0]), r[0]) + sum(profile.t_u) + profile.forward_time
    else:
        best_k, predicted, link_free, group, depth = _last_release(profile, cost, shape, E, r[0], phase2,
                                                                   cycle_s)
        windows, pending = _chain_windows(m, prev, best_k, best_k)
    return Plan(partition_bytes=partition_bytes, windows=tuple(windows), blocks_per_tensor=m,
                last_fraction=tuple(last), predicted_phase1_end=link_free,
                predicted_iteration=predicted, rule=PHASE1_BATCHED, phase2=phase2,
                phase2_group=group, phase2_depth=depth)


def _release_chain(profile: Profile, cost: CostModel, r: Sequence[float],
                   cycle_s: float) -> tuple[numpy.ndarray, list[int]]:
    """``_batched``'s dynamic programme: ``E[k]``, the earliest link-free time with the last
    release at ``k`` (``E[L] = -inf``), and ``prev[k]``, the release before it on that chain."""
    import numpy as np

    L = profile.num_tensors
    a, b, c = cost.a, cost.b, cycle_s
    q = [0.0] * (L + 1)                       # q[k]: bytes of tensors k..L-1
    for l in range(L - 1, -1, -1):
        q[l] = q[l + 1] + profile.nbytes[l]
    Q = np.array(q)
    E = np.full(L + 1, -math.inf)             # E[k]: best link-free time, last release at k
    prev = [L] * (L + 1)                      # the release before the one at k
    for j in range(L - 1, -1, -1):
        ks = np.arange(j + 1, L + 1)
        ends = np.maximum(E[j + 1:], r[j] + c) + a + b * (Q[j] - Q[j + 1:])
        best = int(np.argmin(ends))   # ties: the earliest release (see _batched's docstring)
        E[j] = ends[best]
        prev[j] = int(ks[best])
    return E, prev


def _chain_windows(m: Sequence[int], prev: Sequence[int], last_release: int,
                   phase2_from: int) -> tuple[list[int], list[int]]:
    """Phase-1 windows along the optimal chain ending at ``last_release``; pending blocks (of
    the tensors below ``phase2_from``), which are the phase-2 windows."""
    L = len(m)
    windows = [0] * (2 * L - 1)
    j = last_release
    while j < L:
        k = prev[j]
        if j > 0:
            windows[L - 1 - j] = sum(m[j:k])
        j = k
    pending = [m[l] if l < phase2_from else 0 for l in range(L)]
    windows[L - 1:] = pending
    return windows, pending


def _last_release(profile: Profile, cost: CostModel, shape: _Shape, E: numpy.ndarray, r0: float,
                  phase2: str, cycle_s: float) -> tuple[int, float, float, tuple[int, ...], int]:
    """Under overlap: the last phase-1 release ``k`` (``L``: none) with the shortest phase-2
    timeline, searched as ``_batched``'s docstring says, ties to the later one.  Returns
    ``(k, its timeline, link-free time, phase2_group, phase2_depth)``."""
    L = profile.num_tensors
    m = shape.blocks
    best_k, best_time, link_free, group, depth = L, math.inf, r0, (), 1
    tried: dict[int, float] = {}

    def consider(k: int) -> None:
        nonlocal best_k, best_time, link_free, group, depth
        if k in tried:
            return
        free = max(float(E[k]), r0) if k < L else r0
        pend = [m[l] if l < k else 0 for l in range(L)]
        grp, dep = _phase2_layout(profile, cost, shape, pend, phase2, cycle_s, free)
        t = tried[k] = _phase2_timeline(profile, cost, shape, pend, free, cycle_s, True, grp, dep)
        if t < best_time or (t == best_time and k > best_k):
            best_k, best_time, link_free, group, depth = k, t, free, grp, dep

    # Every last release k = L..1 when there are few tensors; with many, a grid of about
    # BATCHED_GRID of them, then every k between the best one's grid neighbours (each
    # candidate costs a phase-2 layout, O(L^2): all L of them made 1,000 tensors take
    # minutes to plan).
    step = max(1, L // BATCHED_GRID)
    for k in range(L, 0, -step):
        consider(k)
    for k in range(min(L, best_k + step), max(0, best_k - step), -1):
        consider(k)
    return best_k, best_time, link_free, group, depth


def _phase2_layout(profile: Profile, cost: CostModel, shape: _Shape, pending: Sequence[int],
                   phase2: str, cycle_s: float, link_free: float) -> tuple[tuple[int, ...], int]:
    """``(Plan.phase2_group, Plan.phase2_depth)`` for the ``phase2`` rule (see :func:`plan`).

    Grouping (``"grouped"``, ``"grouped_pipelined"``) is the exact optimum of the
    ``_phase2_timeline`` model over ways to cut the tensors with blocks left, in forward order,
    into runs of consecutive tensors.  Window ``g`` (the ``g``-th run, from its first tensor
    ``s_g``) completes at ``c_g = c_0' + g * alpha + b * (bytes of runs 0..g)`` with ``alpha =
    a`` when the windows run back to back (pipelined behind a busy link) and ``a + cycle_s``
    otherwise; the next forward ends at ``max_g (c_g + max over its tensors of t_u(l) + forward
    of layers l..L-1)``.  Counting windows from the END makes the startup count additive, so a
    reverse dynamic programme is exact::

        G[i] = min over e > i of max(alpha + b * B[e] + h(i, e), alpha + G[e]),   G[n] = -inf

    (``B[e]`` bytes of the first ``e`` pending tensors, ``h(i, e)`` the largest ``t_u + forward
    tail`` among pending tensors ``i..e-1``); O(n^2) vectorised.  Ties keep the longer run.
    A run therefore grows while the link, not the forward, decides when its layers can start:
    small tensors (BatchNorm and bias vectors, LayerNorms) ride with their neighbours.
    """
    import numpy as np

    depth = PIPELINE_DEPTH if phase2 in (PHASE2_PIPELINED, PHASE2_GROUPED_PIPELINED) else 1
    if phase2 in (PHASE2_PER_TENSOR, PHASE2_PIPELINED):
        return (), depth
    L = len(pending)
    idx = [l for l, p in enumerate(pending) if p]
    if not idx:
        return (0,) * L, depth
    r0 = profile.ready_times()[0]
    primed = depth > 1 and link_free > r0 + cycle_s
    alpha = cost.a + (0.0 if primed else cycle_s)
    t_u = profile.t_u or (0.0,) * L
    tail = [0.0] * (L + 1)                     # forward time of layers l..L-1
    for l in range(L - 1, -1, -1):
        tail[l] = tail[l + 1] + profile.t_f[l]
    left = np.array([(pending[l] - 1) * shape.full_bytes[l] + shape.last_bytes[l] for l in idx],
                    dtype=float)
    B = cost.b * np.cumsum(left)               # transfer seconds of pending tensors 0..j
    H = np.array([t_u[l] + tail[l] for l in idx])
    n = len(idx)
    G = np.full(n + 1, -math.inf)
    nxt = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        h = np.maximum.accumulate(H[i:n])      # h(i, e) for e = i+1..n
        cand = np.maximum(alpha + B[i:n] + h, alpha + G[i + 1:n + 1])
        j = len(cand) - 1 - int(np.argmin(cand[::-1]))  # ties: the longest run
        G[i] = cand[j]
        nxt[i] = i + 1 + j
    starts = set()
    i = 0
    while i < n:
        starts.add(idx[i])
        i = nxt[i]
    group = []
    g = -1
    for l in range(L):
        if l in starts:
            g += 1
        group.append(max(g, 0))
    return tuple(group), depth


def _phase2_timeline(profile: Profile, cost: CostModel, shape: _Shape, pending: list[int],
                     link_free: float, cycle_s: float = 0.0, overlap_forward: bool = True,
                     group: Sequence[int] = (), depth: int = 1) -> float:
    """Model end of the next forward pass, in seconds from the start of backward (spec §4).

    ``overlap_forward=True``: window ``l`` (tensor ``l``'s remaining ``p_l`` blocks, the tail
    including the last block) goes out one cycle after window ``l-1`` has completed:
    ``c_l = c_{l-1} + cycle_s + T(bytes_l)``; the first starts at ``max(link_free, r_0 + cycle_s)``
    with ``link_free`` when the link finishes phase 1 (never before backward ends).  Forward of
    layer ``l`` waits for its predecessor and for its own gradient plus update:
    ``f_l = max(f_{l-1} + t_f(l-1), c_l + t_u(l))`` with ``f_0 >= r_0``.  A tensor fully sent in
    phase 1 was reduced before the first window and imposes nothing.

    Windows (``group``, ``depth``; ``_phase2_layout``): the tensors of one window complete
    together, ``c_g = c_{g-1} + cycle_s + T(bytes of window g)``.  With ``depth > 1`` and the
    link still busy with phase 1 when backward ends, the gate sees a completion while window
    ``g`` is queued or running and releases ``g+1`` then, so the windows run back to back:
    ``c_g = c_{g-1} + T(bytes)``.  (On an idle link the only completions are the windows' own,
    so the pipeline never fills and each window still waits one cycle.)

    ``overlap_forward=False``: everything left goes out as one window at the end of backward,
    ``c = max(link_free, r_0 + cycle_s) + T(bytes left)``, then every update and the whole forward.

    This is the planner's own optimistic model (one startup per window, no fusion threshold, a
    window on an idle link waits one full cycle); the simulator gives the honest estimate.
    """
    r0 = profile.ready_times()[0]
    t_u = profile.t_u or (0.0,) * profile.num_tensors
    left = [(p - 1) * shape.full_bytes[l] + shape.last_bytes[l] if p else 0
            for l, p in enumerate(pending)]
    if not overlap_forward:
        end = max(link_free, r0)
        if any(pending):
            end = max(link_free, r0 + cycle_s) + cost.time(sum(left))
        return end + sum(t_u) + profile.forward_time
    link = max(link_free, r0)
    wait = r0 + cycle_s        # the first window is released when backward ends
    start = r0                 # earliest start of the next layer's forward
    primed = depth > 1 and link_free > r0 + cycle_s
    window_bytes: dict[int, int] = {}
    for l, p in enumerate(pending):
        if p:
            g = group[l] if group else l
            window_bytes[g] = window_bytes.get(g, 0) + left[l]
    current = None
    for l, p in enumerate(pending):
        if p:
            g = group[l] if group else l
            if g != current:
                current = g
                link = max(link, wait) + cost.time(window_bytes[g])
                # Barrier: the gate sees the completion after Horovod's next cycle began.
                wait = link if primed else link + cycle_s
            start = max(start, link + t_u[l])
        start += profile.t_f[l]
    return start


def model_iteration_time(profile: Profile, cost: CostModel, partition_bytes: int) -> float:
    """``predict`` for :func:`choose_partition` from the planner's own model (see ``_phase2_timeline``)."""
    result = plan(profile, cost, partition_bytes).predicted_iteration
    assert result is not None
    return result


Predictor = Callable[[Profile, CostModel, int], float]


def choose_partition(profile: Profile, cost: CostModel, candidates: Iterable[int],
                     predict: Predictor) -> tuple[int, tuple[tuple[int, float], ...]]:
    """Pick the partition size whose predicted iteration time is smallest.

    The paper tunes ``S_p`` by Bayesian optimisation on the live job; a model is cheap enough to
    try every candidate.  ``predict(profile, cost, partition_bytes) -> seconds`` is supplied by the
    caller (the simulator, or :func:`model_iteration_time`).  Ties go to the larger partition:
    fewer blocks, less per-block runtime overhead the model does not see.

    Returns ``(best_partition_bytes, table)`` with ``table`` the ``(partition_bytes, seconds)``
    pairs in ascending partition order.
    """
    sizes = sorted({int(c) for c in candidates})
    if not sizes:
        raise ValueError("choose_partition: no candidate partition sizes given")
    if sizes[0] <= 0:
        raise ValueError(f"choose_partition: partition sizes must be > 0 bytes, got {sizes[0]}")
    table = []
    for size in sizes:
        seconds = float(predict(profile, cost, size))
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"choose_partition: predict returned {seconds!r} for {size} B; "
                             f"need a finite time >= 0")
        table.append((size, seconds))
    best = min(table, key=lambda row: (row[1], -row[0]))[0]
    return best, tuple(table)
