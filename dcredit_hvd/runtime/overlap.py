"""The overlapped step (``model=``): what the model's forward waits for, and the updates the
last ``step()`` still owes: applied before the next backward, before a state is read or
loaded, at exit, or reported when the transport's shutdown dropped them.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .device import follow
from .instrument import Instrumentation
from .scheduler import SchedulerError
from .state import OptimizerState

log = logging.getLogger("dcredit_hvd")

SHUTDOWN_IN_FLIGHT = (
    "dcredit_hvd: hvd.shutdown() was called while the last step()'s gradients were still being "
    "all-reduced, so their updates are lost. With model= given, step() returns before its "
    "updates are applied (they overlap the next forward): call opt.apply_pending_updates() "
    "before hvd.shutdown(), or leave model= out for a step() that waits."
)


def compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs code compiled by ``torch.compile``: it is (or holds) the module
    ``torch.compile(m)`` returns, or a module compiled in place (``m.compile()``).  Read from
    the attributes those set (``_orig_mod``, ``_compiled_call_impl``): torch has no public test."""
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def apply_at_exit(opt: Any) -> None:
    """A script that ends right after its last step() still ends with every update applied."""
    try:
        opt.apply_pending_updates()
    except Exception as exc:  # the interpreter is exiting: report, do not mask the exit
        log.error("dcredit_hvd: the last step's updates could not be applied at exit: %s", exc)


class Overlap:
    """Acts on ``state``; ``lifecycle`` ends the iteration once its updates are applied."""

    def __init__(self, state: OptimizerState, lifecycle: Any, instrument: Instrumentation) -> None:
        self.state = state
        self.lifecycle = lifecycle
        self.instrument = instrument

    # -- the model's hooks -----------------------------------------------------------------
    def forward_start(self, module, inputs) -> None:
        state = self.state
        state.scheduler.check()             # a completion-thread error surfaces in forward
        if state.compiled is None:
            state.compiled = compiled(module)
        if state.compiled:
            # Code compiled by torch.compile reads parameters where the read guard cannot
            # wait (dynamo traces the guard once, then its graph never waits): no parameter
            # may be held or observed when it runs.  The first forward's order is not observed
            # (construction order stays), and each forward starts once every update is applied.
            state.guard.stop_observing()
            self.wait_for_reads(state.requires_update)
        state.guard.forward_started()

    def forward_end(self, module, inputs, output) -> None:
        self.state.guard.forward_ended()
        self.instrument.forward_ended()

    def before_state_dict(self, *args) -> None:
        """Readers of parameters between iterations see every update applied."""
        self.apply_pending_updates()

    def before_load(self, *args) -> None:
        self.settle_for_load()

    # -- waiting for owed updates ------------------------------------------------------------
    @contextmanager
    def lost_to_shutdown_reported(self) -> Iterator[None]:
        """A wait for owed updates that fails because ``hvd.shutdown()`` dropped their
        all-reduces raises ``SHUTDOWN_IN_FLIGHT`` (what happened and the fix), not the
        transport's handle error."""
        try:
            yield
        except (SchedulerError, self.state.transport.failure) as exc:
            if self.state.elastic or self.state.transport.is_up():
                raise
            raise SchedulerError(SHUTDOWN_IN_FLIGHT) from exc

    def wait_for_reads(self, params: list) -> None:
        """The read guard's wait: ``params`` are about to be read while their update is owed.
        With a timeline, a wait that blocked shows on the forward track (exposed communication)."""
        started = self.instrument.wait_started()
        with self.lost_to_shutdown_reported():
            self.state.updater.wait(params)
            if self.state.gathers is not None:
                self.state.gathers.wait(params)
            follow(self.state.cuda_stream)
        self.instrument.waited(params, started)

    def start_step(self) -> None:
        """``step()`` with ``model=``, once everything is sent: owe every update and return.
        Unsplit, each parameter is updated as soon as its gradient is reduced (``updates.py``).
        Split, every reduce-scatter is waited for, then the all-gathers overlap the next
        forward (``gathers.py``): of this rank's updated slices (``shard=True``), or of the
        reduced gradients, each parameter updated as soon as its own land (``dear``)."""
        state = self.state
        if state.gathers is not None:
            with self.lost_to_shutdown_reported():
                state.scheduler.wait_all()
        if state.sharded is not None:
            state.updater.reset()
            state.sharded.attach()
            unguarded = state.sharded.step(None, overlap=True)
        else:
            unguarded = state.updater.step(state.requires_update)
            if state.gathers is not None:       # dear: each update once its gradient lands
                unguarded += state.gathers.start(state.gathers.scattered_units())
        if unguarded:                   # no read guard for their class: wait for them now
            self.wait_for_reads(unguarded)

    def drain(self) -> None:
        """Wait for every block and apply every owed update (the last step is done)."""
        state = self.state
        with self.lost_to_shutdown_reported():
            state.scheduler.wait_all()
            if state.gathers is not None:
                state.gathers.drain()
            state.updater.drain()
            follow(state.cuda_stream)
        state.step_in_flight = False

    def apply_pending_updates(self) -> None:
        """Block until every update owed by the last ``step()`` is applied, then end its
        iteration (``lifecycle.end_iteration``: forward order, drift, profiling)."""
        state = self.state
        if not (state.enabled and state.step_in_flight):
            return
        self.lifecycle.follow_membership()
        if not state.step_in_flight:
            return
        self.drain()
        self.lifecycle.end_iteration()

    def settle_for_load(self) -> None:
        """Before a state is loaded: apply what the last step owes; if the transport failed
        under it (elastic ``restore()``), drop it instead: the loaded state replaces it."""
        state = self.state
        if not state.enabled:
            return
        try:
            self.apply_pending_updates()
            if state.scheduler.iteration_open:
                state.scheduler.end_backward()
                state.scheduler.wait_all()
        except state.transport.failure:
            self.lifecycle.discard_in_flight()
            state.membership_lost = True
