"""The alpha-beta cost of one all-reduce, and its least-squares fit from measurements.

D-Credit (Gao et al., "A Dynamic Sliding Window Based Tensor Communication Scheduling Framework
for Distributed Deep Learning", IEEE TNSE 12(2), 2025) charges a window of blocks sent together
one startup plus a per-byte cost::

    T(bytes) = a + b * bytes            a: startup seconds, b: seconds per byte

``b`` already includes the ring factor ``2(n-1)/n`` because it is fitted from all-reduces measured
on the live communicator.  The authors hard-coded ``a`` and ``b`` and mixed per-element with
per-byte units (spec §6, defect 4); here both are fitted, always in BYTES and SECONDS.

A real all-reduce also has a FLOOR: the least time any all-reduce takes, however small (the
latency of the ring's ``2(n-1)`` steps, the collective library's and Horovod's per-operation
work).  Once the bytes take longer than that, the latency hides behind the transfer instead of
adding to it: measured on the virtual cluster (8 hosts, Gloo), 4 KiB and 64 KiB all-reduces took
27-29 ms where 333 kB, 1.3 MB and 4 MB took 1-3 ms more than their bytes need (docs/algorithm.md
§1, "The floor").  A single line through all of those charges every block tens of milliseconds it does not
cost, and steers the planner away from small partitions.  So the model is::

    T(bytes) = max(floor, a + b * bytes)

with ``floor = 0`` for the plain alpha-beta model.  ``fit_floored`` fits all three.

This module only fits numbers; taking the measurements needs Horovod and lives elsewhere.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """``T(bytes) = max(floor, a + b * bytes)``: the time of one all-reduce of ``bytes`` bytes."""

    #: Startup seconds per all-reduce (alpha).
    a: float
    #: Seconds per byte (beta), ring factor included.
    b: float
    #: Relative RMS residual of the fit, ``sqrt(mean(((T(x_i) - y_i) / y_i)^2))``; None if not fitted.
    residual: float | None = None
    #: Coefficient of determination of the fit on the seconds; None if not fitted or undefined.
    r2: float | None = None
    #: Least seconds of any all-reduce (0: the plain alpha-beta model); ``fit_floored``.
    floor: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "floor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}")

    def time(self, nbytes: float) -> float:
        """Seconds to all-reduce ``nbytes`` bytes in one operation: ``max(floor, a + b * nbytes)``."""
        return max(self.floor, self.a + self.b * nbytes)

    @property
    def bandwidth(self) -> float:
        """Effective all-reduce bandwidth ``1 / b`` in bytes per second (inf when ``b == 0``)."""
        return math.inf if self.b == 0 else 1.0 / self.b

    def describe(self) -> str:
        text = f"a={self.a * 1e3:.3f} ms, b={self.b:.4g} s/B ({self.bandwidth / 1e9:.3g} GB/s)"
        if self.floor:
            text += f", floor {self.floor * 1e3:.3f} ms"
        if self.residual is not None:
            text += f", relative RMS residual {self.residual:.2%}"
        if self.r2 is not None:
            text += f", R^2 {self.r2:.4f}"
        return text


def _weighted_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Unconstrained weighted least squares of ``y ~ a + b x`` (centred for conditioning)."""
    sw = w.sum()
    xm = float((w * x).sum() / sw)
    ym = float((w * y).sum() / sw)
    dx = x - xm
    sxx = float((w * dx * dx).sum())
    b = float((w * dx * (y - ym)).sum() / sxx)
    return ym - b * xm, b


def fit(sizes_bytes: Sequence[float], seconds: Sequence[float], *, relative: bool = True) -> CostModel:
    """Fit ``T = a + b * bytes`` to measured all-reduce times, with ``a >= 0`` and ``b >= 0``.

    ``relative=True`` (default) minimises the squared RELATIVE error ``sum(((T(x)-y)/y)^2)``:
    measurements are usually log-spaced from kilobytes to tens of megabytes, and an absolute fit
    lets the largest sizes decide everything, losing the startup ``a`` that dominates the small
    windows D-Credit sends.  ``relative=False`` is the ordinary (absolute) least-squares fit.

    Negative coefficients are physically meaningless (noise, or a nearly flat curve).  The fit is
    the exact constrained optimum: the objective is a convex quadratic, so when the unconstrained
    optimum leaves the quadrant the best feasible point lies on ``a = 0`` or ``b = 0``; both
    boundary optima are computed and the better one is kept.

    Repeated sizes are allowed (repeated measurements); at least two distinct sizes are needed.
    """
    x = np.asarray(sizes_bytes, dtype=np.float64).reshape(-1)
    y = np.asarray(seconds, dtype=np.float64).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"fit: {x.size} sizes but {y.size} times; pass one time per size")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("fit: sizes and times must be finite numbers")
    if np.any(x < 0):
        raise ValueError("fit: sizes must be >= 0 bytes")
    if np.any(y <= 0):
        raise ValueError("fit: measured times must be > 0 seconds (an all-reduce cannot take no time)")
    distinct = np.unique(x).size
    if distinct < 2:
        raise ValueError(f"fit: need measurements at >= 2 distinct sizes to separate a from b, "
                         f"got {distinct} distinct size(s) in {x.size} measurement(s); "
                         f"measure e.g. 4 KiB and 16 MiB")

    w = 1.0 / (y * y) if relative else np.ones_like(y)
    scale = float(x.max())          # > 0: two distinct sizes >= 0; fit on x / scale for conditioning
    xs = x / scale

    def sse(a: float, bs: float) -> float:
        r = a + bs * xs - y
        return float((w * r * r).sum())

    a, bs = _weighted_line(xs, y, w)
    if a < 0 or bs < 0:
        # Boundary optima: a = 0 (line through the origin) and b = 0 (constant).
        b0 = max(0.0, float((w * xs * y).sum() / (w * xs * xs).sum()))
        a0 = float((w * y).sum() / w.sum())  # > 0 because every y > 0
        a, bs = (0.0, b0) if sse(0.0, b0) < sse(a0, 0.0) else (a0, 0.0)
    return _scored(CostModel(a=float(a), b=float(bs / scale)), x, y)


def _scored(model: CostModel, x: np.ndarray, y: np.ndarray) -> CostModel:
    """``model`` with its relative RMS residual and ``r2`` on the measurements ``(x, y)``."""
    pred = np.maximum(model.floor, model.a + model.b * x)
    sst = float(((y - y.mean()) ** 2).sum())
    return replace(model, residual=float(np.sqrt(np.mean(((pred - y) / y) ** 2))),
                   r2=None if sst == 0 else 1.0 - float(((pred - y) ** 2).sum()) / sst)


def fit_floored(sizes_bytes: Sequence[float], seconds: Sequence[float], *,
                relative: bool = True) -> CostModel:
    """Fit ``T = max(floor, a + b * bytes)``: a line through the larger sizes and a floor under
    the smaller ones (module docstring).

    Every split of the distinct sizes into a lower part (the floor: the weighted mean of its
    times, the optimum of the same squared error ``fit`` minimises) and an upper part of at
    least two sizes (the line: ``fit``) is tried, and no split at all (``floor = 0``, plain
    ``fit``); the least squared error of the whole model over every measurement wins, ties going
    to the fewer parameters.  A floor is kept only where it lies above the line at its sizes
    (else it says nothing the line does not).  Same input rules and errors as ``fit``.
    """
    best = fit(sizes_bytes, seconds, relative=relative)
    x = np.asarray(sizes_bytes, dtype=np.float64).reshape(-1)
    y = np.asarray(seconds, dtype=np.float64).reshape(-1)
    w = 1.0 / (y * y) if relative else np.ones_like(y)

    def error(model: CostModel) -> float:
        r = np.maximum(model.floor, model.a + model.b * x) - y
        return float((w * r * r).sum())

    best_error = error(best)
    distinct = np.unique(x)
    for k in range(1, distinct.size - 1):
        low = x < distinct[k]
        line = fit(x[~low], y[~low], relative=relative)
        floor = float((w[low] * y[low]).sum() / w[low].sum())
        if floor <= line.a + line.b * float(x[low].max()):
            continue
        model = CostModel(a=line.a, b=line.b, floor=floor)
        model_error = error(model)
        if model_error < best_error * (1 - 1e-9):
            best, best_error = model, model_error
    return _scored(best, x, y) if best.floor else best
