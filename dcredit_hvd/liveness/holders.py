"""Who on this rank holds a shared channel (``channels.py``): the bookkeeping of its leases,
one piece for every channel that is leased (``heartbeat.Liveness``,
``transports/order_stream.OrderStream``)."""
from __future__ import annotations

from typing import Optional


class Holders:
    """The leases held on one shared channel on this rank, and whether the last one is gone.

    Every method but ``queue`` runs under the channel's own lock.  ``queue`` is a finalizer's
    (a list append: it never blocks and takes no lock); the next ``last_gone`` takes it."""

    def __init__(self) -> None:
        self._held: set[object] = set()
        self._queued: list[object] = []
        #: The last lease is gone (or the channel was ended): no new one is given out.
        self.ending = False

    def take(self) -> Optional[object]:
        """A new lease's token, or None once the channel is ending."""
        if self.ending:
            return None
        token = object()
        self._held.add(token)
        return token

    def queue(self, token: object) -> None:
        self._queued.append(token)

    @property
    def queued(self) -> bool:
        return bool(self._queued)

    def last_gone(self, token: Optional[object] = None) -> bool:
        """Give back ``token`` (when given) and the queued leases: whether that was the last
        one; if so the channel is ending from now on."""
        if token is not None:
            self._held.discard(token)
        while self._queued:
            self._held.discard(self._queued.pop())
        if self._held or self.ending:
            return False
        self.ending = True
        return True
