"""Drift detection: when the job no longer behaves as it did when its plan was made.

D-Credit plans once from a measured profile and link (Gao et al., IEEE TNSE 12(2), 2025); on a
shared cluster the bandwidth a job gets, and its computation, change during training.  The
gate rank feeds this detector one sample per iteration, measured from what the job does anyway
(no extra collective): the iteration's wall time, and the link's effective seconds per byte
(the time at least one block was in flight over the bytes sent, ``scheduler.LinkSample``).

The rule (``docs/algorithm.md`` §8), with hysteresis so that noise never re-plans:

* after a plan is installed, ``settle`` iterations are ignored (caches, the first overlapped
  step), then the medians of the next ``reference`` iterations are the reference ``T_ref`` and
  ``beta_ref``;
* from then on, each iteration's value is the median of the last ``window`` samples; it is
  *off* when ``|T / T_ref - 1| > time_threshold`` or ``|beta / beta_ref - 1| >
  link_threshold``;
* ``patience`` off iterations in a row that also last ``seconds`` of wall time trigger a
  re-plan; one iteration back within the thresholds resets both counts.  After a trigger the
  detector waits for the next plan (``reset``) and starts over.

A median of ``window`` samples moves only when more than half of them move, so a single slow
iteration (a checkpoint, a garbage collection) never counts; firing needs a change that lasts
``window // 2 + patience`` iterations and ``seconds`` or more, so a load spike of a shared
machine (many short iterations, seldom seconds) does not re-plan, a change of the network
(minutes) does.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class DriftSettings:
    """Thresholds of the detector (``SchedulerConfig.replan_*``)."""

    settle: int = 3
    reference: int = 12
    window: int = 7
    patience: int = 5
    #: Relative change of the iteration time that counts as off.
    time_threshold: float = 0.25
    #: Relative change of the link's effective seconds per byte that counts as off.
    link_threshold: float = 0.5
    #: Wall seconds the off iterations must also add up to: a load spike on a shared machine
    #: lasts many short iterations but seldom seconds; a change of the network lasts minutes.
    seconds: float = 4.0

    def __post_init__(self) -> None:
        for name in ("reference", "window", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"DriftSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.settle < 0:
            raise ValueError(f"DriftSettings.settle must be >= 0, got {self.settle}")
        if not (self.time_threshold > 0 and self.link_threshold > 0):
            raise ValueError("DriftSettings thresholds must be > 0")
        if self.seconds < 0:
            raise ValueError(f"DriftSettings.seconds must be >= 0, got {self.seconds}")


@dataclass(frozen=True)
class Drift:
    """Why the detector fired: the reference and the median that departed from it."""

    iteration_s: float
    reference_iteration_s: float
    link_s_per_byte: Optional[float]
    reference_link_s_per_byte: Optional[float]

    def describe(self) -> str:
        text = (f"iteration {self.iteration_s * 1e3:.1f} ms against "
                f"{self.reference_iteration_s * 1e3:.1f} ms when planned")
        if self.link_s_per_byte and self.reference_link_s_per_byte:
            text += (f", link {8e-6 / self.link_s_per_byte:.0f} Mbit/s effective against "
                     f"{8e-6 / self.reference_link_s_per_byte:.0f} Mbit/s")
        return text


@dataclass
class DriftDetector:
    """One per gate rank; ``observe`` once per iteration, ``reset`` when a plan is installed."""

    settings: DriftSettings = field(default_factory=DriftSettings)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        s = self.settings
        self._seen = 0
        self._ref_times: list[float] = []
        self._ref_links: list[float] = []
        self.reference: Optional[tuple[float, Optional[float]]] = None
        self._times: deque[float] = deque(maxlen=s.window)
        self._links: deque[float] = deque(maxlen=s.window)
        self._off = 0
        self._off_seconds = 0.0
        self.fired: Optional[Drift] = None

    def observe(self, iteration_s: float, link_s_per_byte: Optional[float] = None) -> Optional[Drift]:
        """One iteration's sample; returns the ``Drift`` on the iteration that triggers, once."""
        if self.fired is not None:
            return None
        s = self.settings
        self._seen += 1
        if self._seen <= s.settle:
            return None
        if self.reference is None:
            self._ref_times.append(iteration_s)
            if link_s_per_byte:
                self._ref_links.append(link_s_per_byte)
            if len(self._ref_times) == s.reference:
                link = statistics.median(self._ref_links) if self._ref_links else None
                self.reference = (statistics.median(self._ref_times), link)
            return None
        self._times.append(iteration_s)
        if link_s_per_byte:
            self._links.append(link_s_per_byte)
        if len(self._times) < s.window:
            return None
        t = statistics.median(self._times)
        t_ref, b_ref = self.reference
        b = statistics.median(self._links) if self._links else None
        off = abs(t / t_ref - 1) > s.time_threshold
        if b is not None and b_ref:
            off = off or abs(b / b_ref - 1) > s.link_threshold
        self._off = self._off + 1 if off else 0
        self._off_seconds = self._off_seconds + iteration_s if off else 0.0
        if self._off >= s.patience and self._off_seconds >= s.seconds:
            self.fired = Drift(t, t_ref, b, b_ref)
            return self.fired
        return None
