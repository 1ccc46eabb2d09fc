"""The live race: candidate schedules timed on the running job, the slower half dropped each
round, the incumbent replaced only by a challenger that is clearly faster.

Plain logic, torch-free: the runtime (``runtime/race.py``) feeds each block's iteration times,
already the maximum over ranks (one small collective per block), so every rank holds the same
numbers and reaches the same decision at the same step; nothing is broadcast.

Successive halving (Jamieson and Talwalkar, AISTATS 2016), in blocks of iterations, never of
seconds.  Round ``r`` runs every surviving candidate for ``drop + rounds[r]`` iterations, the
first ``drop`` after each switch discarded (buffers, caches and Horovod's response cache
settle); a candidate's figure is the median of its kept iterations over every round so far.
After each round the slower half is dropped, the incumbent (the simulator's pick, run first)
never: it is what the challengers must beat.  At the end the fastest survivor ``c`` replaces
the incumbent ``i`` only when (``docs/algorithm.md`` §10)::

    median_i - median_c  >  max(margin * median_i,  2 * sqrt(se_i^2 + se_c^2))
    se = 1.2533 * stdev / sqrt(n)                (the standard error of a median)

so noise cannot make a switch, and the race never leaves the job slower than its incumbent
by more than the noise it measured.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

#: The standard error of a sample median over that of a mean, for normal noise: sqrt(pi/2).
MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)


@dataclass(frozen=True)
class RaceSettings:
    """How long each round is and how much faster a challenger must be
    (``SchedulerConfig.tune_rounds``, ``tune_drop``, ``tune_margin``)."""

    rounds: tuple[int, ...] = (8, 16, 32)
    drop: int = 2
    margin: float = 0.03
    #: Tests only (``DCREDIT_TUNE_FORCE``): the candidate whose label starts with this wins
    #: every comparison, to prove a switch correct; empty: off.
    force: str = ""

    def __post_init__(self) -> None:
        if not self.rounds or any(not isinstance(n, int) or n < 2 for n in self.rounds):
            raise ValueError(f"RaceSettings.rounds must be whole numbers >= 2, got {self.rounds!r}")
        if self.drop < 0:
            raise ValueError(f"RaceSettings.drop must be >= 0, got {self.drop!r}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"RaceSettings.margin must be in [0, 1), got {self.margin!r}")


@dataclass
class Entry:
    """One candidate's side of the race: what it is, what was predicted, what was measured."""

    label: str
    predicted_s: Optional[float]
    schedule: Any = None                 # what the runtime installs (``runtime/race.py``)
    samples: list[float] = field(default_factory=list)
    verdict: str = "racing"             # racing | dropped in round r | failed: why | won | kept

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.inf

    @property
    def standard_error(self) -> float:
        n = len(self.samples)
        if n < 2:
            return math.inf
        return MEDIAN_SE_FACTOR * statistics.stdev(self.samples) / math.sqrt(n)


class Race:
    """Successive halving over ``entries``; ``entries[0]`` is the incumbent."""

    def __init__(self, entries: Sequence[Entry], settings: RaceSettings) -> None:
        if not entries:
            raise ValueError("Race: no candidates")
        self.entries = list(entries)
        self.settings = settings
        self.round = 0
        self._queue = self._alive()
        self.winner: Optional[int] = None
        self.iterations = 0                # every iteration the race ran, dropped ones too
        if len(self._queue) == 1:
            self._finish()

    # -- what runs now ---------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.winner is not None

    @property
    def current(self) -> int:
        """The candidate that runs the block in progress (the winner once done)."""
        return self.winner if self.winner is not None else self._queue[0]

    @property
    def block_length(self) -> int:
        """Iterations of the block in progress: the dropped ones, then the kept ones."""
        return self.settings.drop + self.settings.rounds[self.round]

    def _alive(self) -> list[int]:
        return [i for i, e in enumerate(self.entries) if e.verdict == "racing"]

    # -- events ----------------------------------------------------------------------------
    def block_done(self, times: Sequence[float]) -> None:
        """The block of ``current`` ended: ``times`` are its iterations (max over ranks)."""
        if self.done:
            raise RuntimeError("Race.block_done after the race ended")
        if len(times) != self.block_length:
            raise ValueError(f"Race.block_done: {len(times)} times for a block of "
                             f"{self.block_length} iterations")
        self.iterations += len(times)
        self.entries[self._queue.pop(0)].samples.extend(float(t) for t in times[self.settings.drop:])
        if not self._queue:
            self._end_round()

    def fail(self, why: str) -> None:
        """``current`` cannot run (e.g. a layout it needs is refused): dropped, logged."""
        index = self._queue.pop(0)
        if index == 0:
            raise ValueError(f"Race: the incumbent {self.entries[0].label!r} failed: {why}")
        self.entries[index].verdict = f"failed: {why}"
        if not self._queue:
            self._end_round()

    def _end_round(self) -> None:
        alive = self._alive()
        last = self.round + 1 >= len(self.settings.rounds)
        if len(alive) > 2 and not last:
            ranked = sorted(alive, key=self._speed)
            keep = set(ranked[: max(2, math.ceil(len(alive) / 2))]) | {0}
            for i in alive:
                if i not in keep:
                    self.entries[i].verdict = f"dropped in round {self.round + 1}"
            alive = [i for i in alive if i in keep]
        if last or len(alive) <= 2 and self.round > 0 or len(alive) == 1:
            self._finish()
            return
        self.round += 1
        self._queue = alive

    def _speed(self, i: int) -> tuple[float, int]:
        forced = self.settings.force and self.entries[i].label.startswith(self.settings.force)
        return (-math.inf if forced else self.entries[i].median, i)

    def _finish(self) -> None:
        alive = self._alive()
        incumbent = self.entries[0]
        best = min(alive, key=self._speed)
        if best != 0 and self.beats(self.entries[best], incumbent):
            self.winner = best
        else:
            self.winner = 0
        for i in alive:
            self.entries[i].verdict = ("won" if i == self.winner else
                                       "kept (incumbent)" if i == 0 else "lost")
        if self.winner == 0:
            incumbent.verdict = "kept (incumbent)"

    def beats(self, challenger: Entry, incumbent: Entry) -> bool:
        """The switch rule of the module docstring (the forced label always wins)."""
        if self.settings.force and challenger.label.startswith(self.settings.force):
            return True
        if self.settings.force and incumbent.label.startswith(self.settings.force):
            return False
        gain = incumbent.median - challenger.median
        noise = 2 * math.sqrt(incumbent.standard_error ** 2 + challenger.standard_error ** 2)
        return gain > max(self.settings.margin * incumbent.median, noise)

    # -- the report --------------------------------------------------------------------------
    def table(self) -> list[dict]:
        """One row per candidate: predicted and measured ms, standard error, iterations kept,
        verdict (rank 0 logs it, ``profile_out`` keeps it)."""
        rows = []
        for e in self.entries:
            se = e.standard_error
            rows.append({"candidate": e.label,
                         "predicted_ms": None if e.predicted_s is None else e.predicted_s * 1e3,
                         "measured_ms": e.median * 1e3 if e.samples else None,
                         "stderr_ms": se * 1e3 if math.isfinite(se) else None,
                         "iterations": len(e.samples), "verdict": e.verdict})
        return rows

    def cost_s(self) -> float:
        """Seconds the race lost against running the winner from its first block: for every
        kept iteration, its time minus the winner's median (dropped iterations are charged at
        the winner's median too, as settling costs whatever runs)."""
        if not self.done:
            raise RuntimeError("Race.cost_s before the race ended")
        best = self.entries[self.winner].median
        return sum(max(0.0, t - best) for e in self.entries for t in e.samples)


def format_table(rows: Sequence[dict]) -> str:
    """The race's table as text (rank 0's log)."""
    def ms(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}"

    width = max(len("candidate"), *(len(r["candidate"]) for r in rows))
    lines = [f"{'candidate':<{width}}  predicted ms  measured ms  stderr ms  iterations  verdict"]
    for r in rows:
        lines.append(f"{r['candidate']:<{width}}  {ms(r['predicted_ms']):>12}  "
                     f"{ms(r['measured_ms']):>11}  {ms(r['stderr_ms']):>9}  "
                     f"{r['iterations']:>10}  {r['verdict']}")
    return "\n".join(lines)


def refit_offset(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """The simulator's correction from the race: least squares of the residuals
    ``measured - predicted = d_op * ops + d_fixed`` over the raced candidates, given as
    ``(predicted_s, measured_s, all-reduces per iteration)``; returns ``(d_op, d_fixed)``.

    The all-reduce count is what tells the candidates apart in what the model misses (each
    window's start-up, submission and completion, on the cores that compute; a per-iteration
    error common to all is ``d_fixed``).  With fewer than two distinct counts the fit is the
    mean residual alone (``d_op = 0``).  ``d_op`` may be negative: a start-up fitted on a busy
    moment charged each all-reduce more than the race then saw it cost (``candidates.corrected``
    takes it off again, down to zero).  It is added to the correction of the cost model used
    when the next plan of this job is made (after drift); ``profile_out`` records it, but a
    later job does not read it back yet.
    """
    points = [(float(p), float(m), float(k)) for p, m, k in rows
              if p is not None and m is not None and math.isfinite(m)]
    if not points:
        return 0.0, 0.0
    residual = [m - p for p, m, _ in points]
    ops = [k for _, _, k in points]
    mean_r, mean_k = statistics.fmean(residual), statistics.fmean(ops)
    spread = sum((k - mean_k) ** 2 for k in ops)
    if len(set(ops)) < 2 or spread == 0:
        return 0.0, mean_r
    d_op = sum((k - mean_k) * (r - mean_r) for k, r in zip(ops, residual)) / spread
    return d_op, mean_r - d_op * mean_k
