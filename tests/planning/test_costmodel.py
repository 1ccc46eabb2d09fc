"""The alpha-beta fit: exact on clean data, constrained to a, b >= 0, clear about bad input; the
floored fit (a latency floor under the line) where small all-reduces cost more than the line says."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dcredit_hvd.planning.costmodel import CostModel, fit, fit_floored

SIZES = np.array([4e3, 6.4e4, 1e6, 1.6e7, 6.4e7])


def test_time_is_startup_plus_bytes_times_seconds_per_byte() -> None:
    model = CostModel(a=1e-3, b=2e-9)
    assert model.time(0) == 1e-3
    assert model.time(1_000_000) == pytest.approx(1e-3 + 2e-3)
    assert model.bandwidth == pytest.approx(5e8)
    assert CostModel(a=0.0, b=0.0).bandwidth == math.inf


@pytest.mark.parametrize("a, b, floor", [(-1e-3, 1e-9, 0.0), (1e-3, -1e-9, 0.0), (math.nan, 1e-9, 0.0),
                                         (1e-3, math.inf, 0.0), (1e-3, 1e-9, -1.0),
                                         (1e-3, 1e-9, math.nan)])
def test_cost_model_rejects_negative_or_non_finite_coefficients(a: float, b: float,
                                                                floor: float) -> None:
    with pytest.raises(ValueError, match="CostModel"):
        CostModel(a=a, b=b, floor=floor)


def test_time_never_goes_below_the_floor_and_follows_the_line_above_it() -> None:
    model = CostModel(a=1e-3, b=1e-9, floor=20e-3)
    assert model.time(0) == 20e-3
    assert model.time(1_000_000) == 20e-3                  # the line says 2 ms
    assert model.time(100_000_000) == pytest.approx(1e-3 + 0.1)
    assert "floor 20.000 ms" in model.describe()
    assert "floor" not in CostModel(a=1e-3, b=1e-9).describe()


#: Chained Horovod all-reduces on 8 virtual hosts at 100 Mbit/s, Gloo, 8.33 ms cycle
#: (``scripts/startup_probe.py``, 2026-12-02): bytes, median wall seconds.
PROBE = [(4096, 29.0e-3), (65536, 27.5e-3), (333333, 47.9e-3), (1333333, 189.8e-3),
         (4000000, 579.1e-3)]


def test_floored_fit_on_measured_allreduces_charges_blocks_their_bytes_not_the_small_ones_latency(
) -> None:
    x, y = [p[0] for p in PROBE], [p[1] for p in PROBE]
    line, floored = fit(x, y), fit_floored(x, y)
    assert floored.floor == pytest.approx(28.2e-3, rel=0.01)
    assert floored.a < 2e-3                       # what a 1.3 MB block costs beyond its bytes
    assert line.a > 20e-3                         # the single line charges every block 22 ms
    assert floored.residual < 0.03 < 0.15 < line.residual
    for size, seconds in PROBE:
        assert floored.time(size) == pytest.approx(seconds, rel=0.05)


def test_floored_fit_recovers_floor_and_line_from_noiseless_data() -> None:
    a, b, floor = 0.5e-3, 8e-9, 5e-3
    y = np.maximum(floor, a + b * SIZES)
    model = fit_floored(SIZES, y)
    assert (model.a, model.b, model.floor) == pytest.approx((a, b, floor), rel=1e-9)
    assert model.residual == pytest.approx(0.0, abs=1e-12)


def test_floored_fit_of_a_straight_line_keeps_no_floor() -> None:
    model = fit_floored(SIZES, 1.1e-3 + 8e-9 * SIZES)
    assert model.floor == 0.0
    assert (model.a, model.b) == pytest.approx((1.1e-3, 8e-9), rel=1e-9)


def test_floored_fit_refuses_what_fit_refuses() -> None:
    with pytest.raises(ValueError, match="distinct size"):
        fit_floored([4096, 4096], [1e-3, 2e-3])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10**8), st.floats(1e-5, 10.0)), min_size=2, max_size=10)
       .filter(lambda pts: len({x for x, _ in pts}) >= 2), st.booleans())
def test_floored_fit_is_never_worse_than_the_line(points: list[tuple[int, float]],
                                                   relative: bool) -> None:
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points])
    w = 1.0 / y**2 if relative else np.ones_like(y)

    def sse(model: CostModel) -> float:
        return float((w * (np.array([model.time(v) for v in x]) - y) ** 2).sum())

    floored = fit_floored(x, y, relative=relative)
    assert sse(floored) <= sse(fit(x, y, relative=relative)) * (1 + 1e-9) + 1e-300


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_exact_coefficients_from_noiseless_data(relative: bool) -> None:
    a, b = 1.1e-3, 8e-9
    model = fit(SIZES, a + b * SIZES, relative=relative)
    assert model.a == pytest.approx(a, rel=1e-9)
    assert model.b == pytest.approx(b, rel=1e-9)
    assert model.residual == pytest.approx(0.0, abs=1e-12)
    assert model.r2 == pytest.approx(1.0)


def test_relative_fit_keeps_the_startup_that_an_absolute_fit_loses() -> None:
    # 5% error on the largest measurement only: the absolute fit moves `a` by ~18%, the
    # relative fit keeps it within 1%, which matters for D-Credit's small windows.
    a, b = 1e-3, 1e-9
    y = a + b * SIZES
    y[-1] *= 1.05
    assert fit(SIZES, y, relative=True).a == pytest.approx(a, rel=0.01)
    assert abs(fit(SIZES, y, relative=False).a - a) > 0.1 * a


def test_fit_reports_relative_rms_residual_of_its_own_prediction() -> None:
    y = (1e-3 + 1e-9 * SIZES) * np.array([1.1, 0.9, 1.1, 0.9, 1.1])
    model = fit(SIZES, y)
    pred = np.array([model.time(x) for x in SIZES])
    assert model.residual == pytest.approx(float(np.sqrt(np.mean(((pred - y) / y) ** 2))))
    assert 0.0 < model.residual < 0.2


def test_time_decreasing_with_size_fits_a_constant_not_a_negative_slope() -> None:
    model = fit([1e3, 1e6], [2e-3, 1e-3], relative=False)
    assert model.b == 0.0
    assert model.a == pytest.approx(1.5e-3)


def test_negative_intercept_is_clamped_to_a_line_through_the_origin() -> None:
    # Unconstrained fit: y = -1e-3 + 2e-9 x.  Constrained optimum (relative=False): a = 0 and
    # b = sum(x y) / sum(x x).
    x = np.array([1e6, 2e6, 3e6])
    y = -1e-3 + 2e-9 * x
    model = fit(x, y, relative=False)
    assert model.a == 0.0
    assert model.b == pytest.approx(float((x * y).sum() / (x * x).sum()))


@pytest.mark.parametrize("sizes", [[1e6, 1e6, 1e6], [5e3]])
def test_fewer_than_two_distinct_sizes_is_a_clear_error(sizes: list[float]) -> None:
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit(sizes, [1e-3] * len(sizes))


def test_repeated_measurements_at_two_sizes_are_enough() -> None:
    model = fit([1e3, 1e3, 1e7, 1e7], [1e-3, 1.2e-3, 1.1e-2, 1.1e-2])
    assert model.a > 0 and model.b > 0


@pytest.mark.parametrize(
    "sizes, seconds, message",
    [
        ([1e3, 1e6], [1e-3], "one time per size"),
        ([-1.0, 1e6], [1e-3, 2e-3], ">= 0 bytes"),
        ([1e3, 1e6], [0.0, 2e-3], "> 0 seconds"),
        ([1e3, math.nan], [1e-3, 2e-3], "finite"),
    ],
)
def test_fit_rejects_malformed_measurements(sizes: list[float], seconds: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit(sizes, seconds)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**8), st.floats(1e-6, 10.0)), min_size=2, max_size=12)
    .filter(lambda pts: len({x for x, _ in pts}) >= 2),
    st.booleans(),
    st.lists(st.tuples(st.floats(0, 1.0), st.floats(0, 1e-7)), min_size=1, max_size=8),
)
@example([(0, 0.15625), (0, 0.15625), (1, 0.15625)], True, [(0.15625, 0.0)])   # CI, 2026-12-06
def test_fit_is_the_best_nonnegative_line(points: list[tuple[float, float]], relative: bool,
                                          rivals: list[tuple[float, float]]) -> None:
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    w = 1.0 / y**2 if relative else np.ones_like(y)
    model = fit(x, y, relative=relative)
    assert model.a >= 0 and model.b >= 0

    def sse(a: float, b: float) -> float:
        return float((w * (a + b * x - y) ** 2).sum())

    best = sse(model.a, model.b)
    # float64's rounding: a fit exact in reals leaves residuals near 1e-16 of the data
    # (measured: 9.5e-32 against a rival line through every point)
    rounding = 1e-24 * float((w * y ** 2).sum()) + 1e-300
    for a, b in [*rivals, (model.a * 1.01, model.b), (model.a, model.b * 1.01),
                 (model.a * 0.99, model.b), (model.a, model.b * 0.99)]:
        assert best <= sse(a, b) * (1 + 1e-9) + rounding
