"""The liveness channel that a group's optimizers share, and how long it lives.

Why: a channel is a thread and a socket per peer.  It should live while an optimizer on this
rank needs it, not for the rest of the process: a framework tears down after ``fit`` (and
Lightning's own tests then fail on any thread left behind), a notebook builds one trainer after
another, a job destroys its process group and makes a new one.  So each optimizer takes a
``Lease``; when the last lease on this rank is given back (``close()``, or the optimizer
collected) the channel says goodbye (its peers count no loss) and ends.

Closing is local: ranks release their leases at different moments (``runtime/lifetime.py``
runs no collective).  So whether a channel can be reused is agreed each time an optimizer is
built: every rank all-gathers the token of the channel it holds for the group (None when it
holds none, or that one is ending).  All equal: it is reused.  Otherwise every rank opens a
new one (the same collectives the first one took), and an older channel still leased here
lives on until its own leases are given back.  A lease is taken before the agreement, so a
finalizer that releases the last old lease during it cannot end a channel just agreed on.

The torch.distributed transport's issue order (``transports/order_stream.py``: a follower's
thread and rank 0's connections) is shared and leased by the same rules: anything with the
``Shared`` methods.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from .heartbeat import PeerEvent


class Shared(Protocol):
    """What a leased channel offers (``heartbeat.Liveness``, ``order_stream.OrderStream``)."""

    token: Any                      # equal on the ranks that hold the same channel

    def hold(self) -> Optional[object]: ...

    def release(self, token: object, wait: bool = True) -> None: ...

    @property
    def ended(self) -> bool: ...

    @property
    def lost(self) -> list[PeerEvent]: ...


@dataclass(eq=False)
class Lease:
    """One optimizer's hold on a channel; ``release`` once (later calls do nothing)."""

    channel: Shared
    token: object
    released: bool = False

    def release(self, wait: bool = True) -> None:
        """``wait=False`` from a finalizer (``Liveness.release``)."""
        if not self.released:
            self.released = True
            self.channel.release(self.token, wait)


class Channels:
    """One process's channels for one transport: the current one per group, and the older
    ones still leased (whose losses still count)."""

    def __init__(self) -> None:
        self._current: dict[Hashable, Shared] = {}
        self._open: list[Shared] = []

    def lease(self, key: Hashable, allgather: Callable[[Any], list],
              open_channel: Callable[[], Shared]) -> Lease:
        """A lease on the group's channel: the current one if every rank holds it, else a new
        one from ``open_channel`` (collective, on every rank).  ``allgather(obj)``: every
        rank's ``obj``, in rank order."""
        current = self._current.get(key)
        token = current.hold() if current is not None else None
        tokens = allgather(None if token is None else current.token)
        if token is not None and all(t == tokens[0] for t in tokens):
            return Lease(current, token)
        if token is not None:
            current.release(token)
        channel = open_channel()
        self._current[key] = channel
        self._open = [c for c in self._open if not c.ended] + [channel]
        held = channel.hold()
        assert held is not None, "a channel just opened is not ending"
        return Lease(channel, held)

    def lost(self, key: Optional[Hashable] = None) -> list[PeerEvent]:
        """The peers lost on the open channels (of group ``key`` only, when given)."""
        if key is not None:
            channel = self._current.get(key)
            return [] if channel is None or channel.ended else channel.lost
        return [event for channel in self._open if not channel.ended for event in channel.lost]

    def __bool__(self) -> bool:
        return any(not channel.ended for channel in self._open)
