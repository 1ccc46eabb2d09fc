"""Callbacks that do not keep their object alive.

A model outlives its optimizers (a user switches optimizer, or rebuilds one after a restore),
and the liveness channel outlives every scheduler; hooks and subscriptions that held their
optimizer strongly would keep it, and its hooks, alive for ever (horovod/horovod#2017).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method) called through a weak reference to its object; once the
    object is collected the callable does nothing and returns None."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call
