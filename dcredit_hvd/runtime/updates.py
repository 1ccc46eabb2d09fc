"""Per-parameter updates with the user's own optimizer, as soon as each gradient is reduced.

D-Credit's phase 2 sends the rest of the gradients while the next forward pass runs (spec §4), so
a parameter must be updated as soon as its own gradient is reduced, and the forward of a layer
must wait for exactly its own parameters.  ByteScheduler and the D-Credit authors re-implemented
SGD and Adam by hand for this and silently skipped any other optimizer (spec §6, defect 10).

Here the update is the user's optimizer class's own ``step`` run on a *shadow*: an instance of
the same class that shares the optimizer's ``state``, ``defaults`` and hooks but whose
``param_groups`` hold only the parameters being updated, with the hyper-parameters each group had
when ``step()`` was called (an LR scheduler stepping meanwhile changes the next iteration only).
Every ``torch.optim`` optimizer except LBFGS updates each parameter from its own gradient and
state alone, so updating parameters one batch at a time gives the same result as one ``step()``.

From ``step()`` until its update is applied, each parameter is held by the read guard
(``readguard``): any read of it, in the forward pass or outside it, waits for the update.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from .readguard import ReadGuard


class ParameterUpdater:
    """Tracks which parameters still owe their update for the last ``step()``, applies updates
    as gradients arrive, and lets readers (forward hooks, ``state_dict``) wait for them."""

    def __init__(self, optimizer: torch.optim.Optimizer, base: type,
                 check: Callable[[], None], guard: Optional[ReadGuard] = None,
                 jitter: Callable[[], None] = lambda: None) -> None:
        self._opt = optimizer
        self._base = base
        self._check = check                      # re-raises communication-thread errors
        self._guard = guard
        self._jitter = jitter                    # the race amplifier (config.race_amplifier)
        # Re-entrant: a read guard wait may come from a thread that already holds it.
        self._cond = threading.Condition(threading.RLock())
        self._group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._snapshot: list[dict[str, Any]] = []
        self._owed: set = set()                  # stepped, not yet updated
        self._reduced: set = set()               # gradient reduced, step() not called yet
        self._stepping = False                   # step() called, updates still owed
        self._zero: Optional[tuple[tuple, dict]] = None   # deferred zero_grad(*args, **kwargs)
        self._failed: Optional[BaseException] = None      # the user's optimizer raised

    # -- called by the optimizer ------------------------------------------------------------
    def reduced(self, params: list[torch.Tensor]) -> None:
        """The gradients of ``params`` (one unit: one tensor, or a run sharing a buffer) are
        fully reduced (completion thread); those owed are updated in ONE call of the user's
        ``step``, not one per tensor (the call's fixed cost dominates small tensors)."""
        with self._cond:
            if self._failed is not None:
                return
            if self._stepping:
                owed = [p for p in params if p in self._owed]
                self._reduced.update(p for p in params if p not in self._owed)
                if owed:
                    self._apply(owed)
            else:
                self._reduced.update(params)

    def step(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``step()`` was called: ``params`` owe an update; apply those already reduced.

        Returns the parameters the read guard cannot hold (their class defines its own
        ``__torch_function__``): the caller must ``wait`` for them before returning to the user.
        """
        params = list(params)
        with self._cond:
            self._snapshot = [{k: v for k, v in g.items() if k != "params"}
                              for g in self._opt.param_groups]
            # Held before they are owed: no reader can see "not held" while an update is owed.
            unguarded = self._guard.hold(params) if self._guard is not None else []
            self._owed = set(params)
            self._stepping = True
            ready = [p for p in params if p in self._reduced]
            self._reduced.clear()
            if ready:
                self._apply(ready)
        return unguarded

    def zero_grad(self, args: tuple, kwargs: dict) -> None:
        """``zero_grad`` now for parameters already updated, after their update for the rest."""
        with self._cond:
            done = [p for g in self._opt.param_groups for p in g["params"] if p not in self._owed]
            self._base.zero_grad(self._shadow([(0, done)], plain=True), *args, **kwargs)
            self._zero = (args, kwargs) if self._owed else None

    def wait(self, params: Iterable[torch.Tensor]) -> None:
        """Block until none of ``params`` owes an update (forward pre-hooks)."""
        params = list(params)
        with self._cond:
            self._raise_if_failed()
            while any(p in self._owed for p in params):
                self._cond.wait(timeout=0.05)
                self._raise_if_failed()
                self._check()

    def drain(self) -> None:
        """Block until every owed update is applied."""
        with self._cond:
            self._raise_if_failed()
            while self._owed:
                self._cond.wait(timeout=0.05)
                self._raise_if_failed()
                self._check()
            self._stepping = False

    def reset(self) -> None:
        with self._cond:
            if self._guard is not None:
                self._guard.release_all()
            self._owed.clear()
            self._reduced.clear()
            self._stepping = False
            self._zero = None
            self._failed = None
            self._cond.notify_all()

    @property
    def owed(self) -> int:
        return len(self._owed)

    # -- internals (lock held) -----------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"dcredit_hvd: the optimizer's update failed: "
                               f"{type(self._failed).__name__}: {self._failed}") from self._failed

    def _apply(self, params: list[torch.Tensor]) -> None:
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_group.setdefault(self._group_of[p], []).append(p)
        shadow = self._shadow(sorted(by_group.items()))
        self._jitter()
        try:
            with self._applying():
                self._base.step(shadow)
                if self._zero is not None:
                    args, kwargs = self._zero
                    self._base.zero_grad(shadow, *args, **kwargs)
        except BaseException as exc:
            # Nothing owed can be applied any more: every waiter raises instead of hanging, and
            # the parameters stay owed (and held), so no later read sees them un-updated.
            self._failed = exc
            self._cond.notify_all()
            raise
        self._owed.difference_update(params)
        if self._guard is not None:
            self._guard.release(params)
        if not self._owed:
            self._zero = None
        self._jitter()
        self._cond.notify_all()

    def _applying(self):
        return self._guard.applying() if self._guard is not None else nullcontext()

    def _shadow(self, groups: list[tuple[int, list[torch.Tensor]]], plain: bool = False) -> Any:
        """An instance of the user's class sharing this optimizer's state, over ``groups``."""
        shadow = object.__new__(self._base)
        shadow.__dict__.update(self._opt.__dict__)
        if plain:
            shadow.param_groups = [{"params": ps} for _, ps in groups]
        else:
            shadow.param_groups = [dict(self._snapshot[i], params=ps) for i, ps in groups]
        return shadow
