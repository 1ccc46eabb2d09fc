"""Phase 1 of the planner: the windows released during backward (spec §3).

``greedy`` fills each idle gap of the link before the next gradient is ready, most urgent blocks
first (the greedy of Gao et al. with the reference code's defects fixed); ``batched`` is the
exact optimum, under the same cost model, over windows that release every ready block.  Both
leave what backward did not send to phase 2 (``phase2``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .costmodel import CostModel
from .phase2 import _phase2_layout, _phase2_timeline
from .plan import PHASE1_BATCHED, PHASE1_GREEDY, PHASE2_PER_TENSOR, SHORT_GAP_ONE_BLOCK, Plan, _Shape
from .profile import Profile

if TYPE_CHECKING:
    import numpy

#: ``phase1="batched"`` under overlap tries every last phase-1 release up to this many tensors,
#: and about this many of them, then the best one's neighbourhood, above it.
BATCHED_GRID = 48


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
