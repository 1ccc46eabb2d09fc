"""A daemon thread that can be asked, from outside, to end what it serves.

Why: a thread of ours (the liveness channel's heartbeat, a follower's issue order) ends with the
last optimizer that uses it, given back by ``close()`` at once or by the optimizer's finalizer
later.  A script that neither closes its optimizer nor lets it be collected before it checks its
threads (Fabric's own tests do, right after the last step: Fabric has no teardown) still sees
them.  The convention such checks follow (Lightning's ``conftest.py``: a daemon thread with a
callable ``stop`` is stopped, then must be gone) is a ``stop()`` on the thread: here it ends
the channel as its last lease would (a goodbye, the sockets closed) and returns once the thread
is gone.  An optimizer that still holds the channel then watches no peers (the next optimizer
built opens a new one).
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable


class Stoppable(threading.Thread):
    """``threading.Thread(target=..., name=..., daemon=True)`` with ``stop()``: ``end`` (a
    method of the owner, held weakly so the thread keeps nothing alive), then joined."""

    def __init__(self, target: Callable[[], None], name: str, end: Callable[[], None]) -> None:
        super().__init__(target=target, name=name, daemon=True)
        self._end = weakref.WeakMethod(end)          # type: ignore[arg-type]

    def stop(self) -> None:
        end = self._end()
        if end is not None:
            end()
        if self is not threading.current_thread():
            self.join(timeout=5.0)
