"""The alpha-beta fit: exact on clean data, constrained to a, b >= 0, clear about bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_hvd.costmodel import CostModel, fit

SIZES = np.array([4e3, 6.4e4, 1e6, 1.6e7, 6.4e7])


def test_time_is_startup_plus_bytes_times_seconds_per_byte() -> None:
    model = CostModel(a=1e-3, b=2e-9)
    assert model.time(0) == 1e-3
    assert model.time(1_000_000) == pytest.approx(1e-3 + 2e-3)
    assert model.bandwidth == pytest.approx(5e8)
    assert CostModel(a=0.0, b=0.0).bandwidth == math.inf


@pytest.mark.parametrize("a, b", [(-1e-3, 1e-9), (1e-3, -1e-9), (math.nan, 1e-9), (1e-3, math.inf)])
def test_cost_model_rejects_negative_or_non_finite_coefficients(a: float, b: float) -> None:
    with pytest.raises(ValueError, match="CostModel"):
        CostModel(a=a, b=b)


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
    for a, b in [*rivals, (model.a * 1.01, model.b), (model.a, model.b * 1.01),
                 (model.a * 0.99, model.b), (model.a, model.b * 0.99)]:
        assert best <= sse(a, b) * (1 + 1e-9) + 1e-300
