"""Phase 2 of the planner: the blocks left when backward ends, windowed during the next forward
(spec §4, ``docs/algorithm.md`` §4b): how consecutive tensors share windows (``layout``) and the
model end of the next forward under them (``timeline``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from .costmodel import CostModel
from .plan import (
    PHASE2_GROUPED_PIPELINED,
    PHASE2_PER_TENSOR,
    PHASE2_PIPELINED,
    _Shape,
)
from .profile import Profile

#: Windows in flight at once under each pipelined rule.
PIPELINE_DEPTH = 2


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
