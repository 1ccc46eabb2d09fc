"""An optimizer's hold on its parameters: taking them over from an older optimizer, closing,
and the finalizer of one that nobody references any more (``docs/design.md``, "Several
optimizers").  No collective runs here, so ranks may close at different moments.
"""
from __future__ import annotations

import gc
import logging
import warnings
from typing import Any

from . import instances
from .overlap import apply_at_exit
from .state import Hooks, OptimizerState

log = logging.getLogger("dcredit_hvd")

#: How long the exit waits for the collectives still in flight: in all, and without one of
#: them finishing (a peer that took another path will never issue the rest).
EXIT_SETTLE_SECONDS = 10.0
EXIT_PATIENCE_SECONDS = 2.0

DETACHED = (
    "dcredit_hvd: a new DistributedOptimizer was built over {count} parameter(s) that an older "
    "one still hooks ({names}); the older one is closed now (its owed updates were applied and "
    "its hooks removed), so no gradient is counted twice, and using it again raises an error. "
    "Call close() on an optimizer before building its replacement to silence this warning."
)
CLOSE_MID_ITERATION = (
    "dcredit_hvd: the optimizer was closed (or a new one built over its parameters) after "
    "loss.backward() and before step() or synchronize(): that backward's gradients are being "
    "all-reduced with the other ranks. Call step() (or synchronize()) first, then close it."
)


def collected(hooks: Hooks, peers: Any) -> None:
    """Finalizer of a collected optimizer (nothing was in flight: in-flight blocks and owed
    updates keep it alive): its hooks go, its lease on the liveness channel is queued back;
    its idle completion thread ends by itself.  Nothing here takes a lock: a finalizer may run
    in any thread, inside any critical section."""
    hooks.remove()
    if peers is not None:
        peers.release(wait=False)


def at_exit(ref: Any) -> None:
    """The interpreter is exiting (``atexit``, registered for every optimizer; it runs before
    the process group is destroyed): apply what the last step owes (``model=``), let the
    collectives in flight finish (``EXIT_SETTLE_SECONDS``, ``EXIT_PATIENCE_SECONDS``), then end the completion
    threads.  A script that raised between ``backward()`` and ``step()`` leaves blocks in flight
    and a completion thread polling them inside torch; Python 3.11 ends such a daemon thread at
    finalization with ``pthread_exit``, which aborts the process in C++ (``terminate called
    without an active exception``, SIGABRT) instead of exiting with the script's traceback."""
    opt = ref()
    if opt is None:
        return
    state = opt._state
    if not state.enabled or state.closed is not None:
        return
    if state.overlap and state.step_in_flight:
        apply_at_exit(opt)
    schedulers = [state.scheduler] + ([state.gathers.scheduler] if state.gathers else [])
    left = sum(s.settle(EXIT_SETTLE_SECONDS, EXIT_PATIENCE_SECONDS) for s in schedulers)
    if left:
        log.warning("dcredit_hvd: %d collective(s) still in flight at exit, abandoned (the "
                    "other ranks did not issue them: the last iteration did not end)", left)
    for scheduler in schedulers:
        scheduler.close()


def take_over(state: OptimizerState, stacklevel: int) -> None:
    """Close every live optimizer that still hooks any of ``state.requires_update``
    (``instances.py``): after a collection, the survivors are really in use elsewhere, so say
    so."""
    params = state.requires_update
    older = instances.holders(params)
    if older:
        gc.collect()                 # a dropped optimizer may only wait for the collector
        older = instances.holders(params)
    for opt in older:
        held = set(opt._state.requires_update)
        shared = [p for p in params if p in held]
        names = [state.names[p] for p in shared]
        warnings.warn(DETACHED.format(count=len(shared), names=", ".join(names[:3])
                                      + (", ..." if len(names) > 3 else "")),
                      stacklevel=stacklevel + 1)
        opt._close("when a newer DistributedOptimizer was built over its parameters")


def close(state: OptimizerState, overlap: Any, owner: Any, why: str) -> None:
    """Apply what the last step owes, remove every hook, give the parameters their own classes
    back (read guard), end the completion thread, forget ``owner`` (``instances``)."""
    if state.closed is not None:
        return
    if state.enabled:
        if state.pending:
            raise RuntimeError(CLOSE_MID_ITERATION)
        if state.step_in_flight:
            overlap.drain()
        state.hooks.remove()
        if state.guard is not None:
            state.guard.stop_observing()
            state.guard.release_all()
        state.scheduler.close()
        if state.gathers is not None:
            state.gathers.close()
        if state.peers is not None:
            state.peers.release()      # the last optimizer here ends the channel (a goodbye)
        state.transport.close()        # torch.distributed: the issue order's lease likewise
        instances.unregister(owner)
    state.closed = f" {why}" if why else ""
