"""The race on the running job: each candidate installed in turn, its iterations timed, each
block's times made the same on every rank (their maximum, one small collective per block), the
decision taken by ``planning.race.Race`` from those numbers alone.

Runs in the training thread at iteration ends (``lifecycle.end_iteration``), when nothing is in
flight, so a switch is a layout and policy change between two iterations, at the same step on
every rank: the blocks of one iteration are always cut and gated by one schedule.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from ..errors import SchedulerError
from ..planning import race as racing
from ..planning.candidates import Schedule, corrected
from .instrument import Instrumentation
from .state import OptimizerState

DISAGREE = ("dcredit_hvd: the ranks disagree on the race's candidates ({detail}); every rank "
            "must run the same dcredit_hvd and get the same plan from rank 0. Check that all "
            "ranks run one version, or turn the race off with tune=False / DCREDIT_TUNE=0.")


class LiveRace:
    """One race, from the plan's installation to the winner's."""

    def __init__(self, state: OptimizerState, instrument: Instrumentation,
                 install: Callable[[Schedule], None], schedules: Sequence[Schedule],
                 cost: Any) -> None:
        self.state, self.instrument, self._install = state, instrument, install
        self.cost = cost
        self._check_agreement(schedules)
        entries = [racing.Entry(s.label, s.predicted_s, s) for s in schedules]
        self.race = racing.Race(entries, state.config.race_settings())
        self.times: list[float] = []
        self.last: Optional[float] = time.perf_counter()    # the incumbent runs from here
        self.blocks = 0
        self.started = time.perf_counter()
        self.refit: tuple[float, float] = (0.0, 0.0)
        self._running = 0
        instrument.mark("race: start", candidates=len(entries))
        if self.race.done:
            self._conclude()

    def _check_agreement(self, schedules: Sequence[Schedule]) -> None:
        """Every rank holds rank 0's list (it came with the plan); a rank whose list differs
        (another version, a corrupted message) is named instead of racing out of step."""
        state = self.state
        keys = state.transport.allgather_object([s.key() for s in schedules],
                                                f"{state.prefix}.race.candidates")
        for rank, theirs in enumerate(keys):
            if theirs != keys[0]:
                mine = {k[0] for k in keys[0]}
                other = {k[0] for k in theirs}
                detail = (f"rank {rank} has {len(theirs)} candidates, rank 0 {len(keys[0])}"
                          + (f"; only on rank {rank}: {sorted(other - mine)}" if other - mine else "")
                          + (f"; only on rank 0: {sorted(mine - other)}" if mine - other else ""))
                raise SchedulerError(DISAGREE.format(detail=detail))

    @property
    def done(self) -> bool:
        return self.race.done

    def end_iteration(self) -> None:
        """One iteration ended (every rank, the same step): time it; at a block's end, agree
        on the block's times and let the race move on."""
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now
        if len(self.times) < self.race.block_length:
            return
        state = self.state
        every = state.transport.allgather_object(self.times, f"{state.prefix}.race.{self.blocks}")
        self.blocks += 1
        times = [max(column) for column in zip(*every)]
        self.times = []
        self.race.block_done(times)
        self._next()

    def _next(self) -> None:
        """Install what runs next; a candidate that cannot be installed is dropped and logged
        (every rank fails alike: the schedule and the layouts are the same everywhere)."""
        while not self.race.done:
            index = self.race.current
            if index == self._running:
                break
            try:
                self._install(self.race.entries[index].schedule)
            except (ValueError, TypeError, RuntimeError) as exc:
                log = self.instrument.on_rank0()
                if log is not None:
                    log.warning("race: candidate %s cannot run (%s); dropped",
                                self.race.entries[index].label, exc)
                self.race.fail(str(exc))
                continue
            self._running = index
            self.last = time.perf_counter()
            self.instrument.mark("race: switch", candidate=self.race.entries[index].label)
            return
        if self.race.done:
            self._conclude()

    def _conclude(self) -> None:
        winner = self.race.winner
        if winner != self._running:
            self._install(self.race.entries[winner].schedule)
            self._running = winner
        rows = [(e.predicted_s, e.median if e.samples else None,
                 e.schedule.ops_per_iteration) for e in self.race.entries]
        self.refit = racing.refit_offset(rows)
        self.instrument.mark("race: winner", candidate=self.race.entries[winner].label)
        log = self.instrument.on_rank0()
        table = self.race.table()
        if log is not None:
            log.info("race over after %d iterations (%.1f s; %.1f ms lost against the winner "
                     "from the start): %s\n%s\nsimulator refit from the residuals: %+.3g s per "
                     "all-reduce, %+.3g s per iteration", self.race.iterations,
                     time.perf_counter() - self.started, self.race.cost_s() * 1e3,
                     self.race.entries[winner].label, racing.format_table(table),
                     self.refit[0], self.refit[1])
            if self.state.config.profile_out:
                _record(self.state.config.profile_out, table, self.race, self.refit)

    def corrected_cost(self, cost: Any) -> Any:
        """``cost`` with this race's refit, for the next plan (after drift)."""
        return corrected(cost, self.refit[0])

    def summary(self) -> dict:
        """What ``optimizer.races`` holds for each race: the table, the winner, the cost, the refit."""
        return {"table": self.race.table(), "done": self.race.done,
                "winner": None if self.race.winner is None
                else self.race.entries[self.race.winner].label,
                "iterations": self.race.iterations,
                "cost_s": self.race.cost_s() if self.race.done else None,
                "refit": {"per_allreduce_s": self.refit[0], "per_iteration_s": self.refit[1]}}


def _record(path: str, table: list[dict], race: racing.Race, refit: tuple[float, float]) -> None:
    """The race beside the plan in ``profile_out`` (``decision.write`` made the file)."""
    try:
        with open(path) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        record = {}
    record.setdefault("races", []).append({
        "table": table, "winner": race.entries[race.winner].label,
        "iterations": race.iterations, "cost_s": race.cost_s(),
        "settings": dataclasses.asdict(race.settings),
        "refit": {"per_allreduce_s": refit[0], "per_iteration_s": refit[1]}})
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)
