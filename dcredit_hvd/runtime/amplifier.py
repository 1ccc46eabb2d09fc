"""The race amplifier: random short sleeps where an ordering bug would show.

A race between the training thread and the completion thread (a read before an update, a write
back after a reuse) usually needs an unlucky interleaving and fails once in many runs.  With
``race_amplifier=S`` (``DCREDIT_RACE_AMPLIFIER``) the completion thread's polls and callbacks,
the submission of each block and each overlapped parameter update first sleep a random time in
``[0, S]``, so that updates land late and out of order: a test that depends on an ordering the
code does not enforce then fails every run.  For tests only; it slows everything down.
"""
from __future__ import annotations

import random
import time


class RaceAmplifier:
    """Callable: sleeps ``uniform(0, max_seconds)`` when on, returns at once when off."""

    def __init__(self, max_seconds: float, seed: int | None = None) -> None:
        if max_seconds < 0:
            raise ValueError(f"race amplifier: max_seconds must be >= 0, got {max_seconds}")
        self.max_seconds = max_seconds
        self._rng = random.Random(seed)

    def __bool__(self) -> bool:
        return self.max_seconds > 0

    def __call__(self) -> None:
        if self.max_seconds > 0:
            time.sleep(self._rng.uniform(0.0, self.max_seconds))
