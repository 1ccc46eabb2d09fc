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
from collections.abc import Callable, Iterable

from .costmodel import CostModel
from .phase1 import _batched, _greedy
from .plan import (  # noqa: F401  (the rules' names are the planner's options)
    PHASE1_BATCHED,
    PHASE1_GREEDY,
    PHASE1_RULES,
    PHASE2_GROUPED,
    PHASE2_GROUPED_PIPELINED,
    PHASE2_PER_TENSOR,
    PHASE2_PIPELINED,
    PHASE2_RULES,
    SHORT_GAP_DEFER,
    SHORT_GAP_ONE_BLOCK,
    SHORT_GAP_RULES,
    Plan,
    _shape,
)
from .profile import Profile


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
