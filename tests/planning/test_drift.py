"""The drift detector (``drift.py``): quiet on noise, fires on a lasting change, once."""
from __future__ import annotations

import random

import pytest

from dcredit_hvd.planning.drift import DriftDetector, DriftSettings

S = DriftSettings(settle=2, reference=6, window=5, patience=4, time_threshold=0.2,
                  link_threshold=0.35, seconds=0.0)


def _feed(detector, samples):
    """Index (1-based) of the sample on which the detector fired, or None."""
    for i, (t, b) in enumerate(samples, 1):
        if detector.observe(t, b) is not None:
            return i
    return None


def test_steady_noisy_iterations_never_fire():
    rng = random.Random(0)
    # 10,000 iterations of +-15% uniform noise and one outlier in every 50 (a checkpoint, GC).
    samples = [(0.3 * (1 + rng.uniform(-0.15, 0.15)) * (3 if i % 50 == 49 else 1),
                8e-9 * (1 + rng.uniform(-0.25, 0.25))) for i in range(10_000)]
    assert _feed(DriftDetector(S), samples) is None


def test_a_slower_link_fires_after_the_median_and_patience_have_seen_it():
    steady = [(0.30, 8e-9)] * 20
    slow = [(0.31, 32e-9)] * 20                  # the link 4x slower, the iteration hardly
    fired_at = _feed(DriftDetector(S), steady + slow)
    # The median of 5 turns at the 3rd slow sample; 4 off medians in a row: the 6th.
    assert fired_at == 20 + 3 + S.patience - 1


def test_a_longer_iteration_fires_without_link_samples():
    detector = DriftDetector(S)
    assert _feed(detector, [(0.30, None)] * 20 + [(0.60, None)] * 20) == 26
    assert detector.fired.iteration_s == pytest.approx(0.60)
    assert detector.fired.reference_iteration_s == pytest.approx(0.30)
    assert "600.0 ms against 300.0 ms" in detector.fired.describe()


def test_one_in_range_median_resets_the_count():
    # Off, off, off, back, off, off, off: never patience (4) off medians in a row.
    pattern = [0.3] * 20 + ([0.6] * 3 + [0.3] * 5) * 6
    assert _feed(DriftDetector(S), [(t, None) for t in pattern]) is None


def test_it_fires_once_then_waits_for_a_reset_and_a_new_reference():
    detector = DriftDetector(S)
    assert _feed(detector, [(0.3, None)] * 10 + [(0.9, None)] * 10) is not None
    assert _feed(detector, [(0.9, None)] * 50) is None      # fired: silent until reset
    detector.reset()
    # The new reference is the new normal: the same slow iterations do not fire again.
    assert _feed(detector, [(0.9, None)] * 50) is None
    assert detector.reference[0] == pytest.approx(0.9)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="window"):
        DriftSettings(window=0)
    with pytest.raises(ValueError, match="thresholds"):
        DriftSettings(time_threshold=0)


def test_a_burst_of_short_slow_iterations_does_not_fire_unless_it_lasts_the_seconds():
    settings = DriftSettings(settle=2, reference=6, window=5, patience=4, seconds=2.0)
    # 12 iterations of 75 ms after 50 ms ones: 10 off medians in a row, but 0.75 s < 2 s.
    assert _feed(DriftDetector(settings), [(0.05, None)] * 20 + [(0.075, None)] * 12
                 + [(0.05, None)] * 20) is None
    # The same change lasting 40 iterations (3 s off) fires.
    assert _feed(DriftDetector(settings), [(0.05, None)] * 20 + [(0.075, None)] * 40) is not None
