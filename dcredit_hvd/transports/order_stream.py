"""Rank 0's issue order on one rank of a group, its wire, and how long it lives.

``ordering.IssueOrder`` is the rule (every rank issues in rank 0's order); this is what carries
it: rank 0 publishes each entry over ``sidechannel.Star``, and on every other rank (a follower)
a thread, ``dcredit-order``, reads rank 0's entries into the order.

Why leased: the thread and the sockets should live while an optimizer on this rank issues over
the group, not for the rest of the process (a framework tears down after ``fit``, and
Lightning's own tests fail a test that leaves a thread behind; a notebook builds one trainer
after another).  So each ``TorchTransport`` (one per optimizer) takes a lease, with the
agreement on reuse that the liveness channel uses (``liveness/channels.py``: every rank
all-gathers the token of the stream it holds, over the group's ``objects`` group, which lives
as long as the group); the last lease given back here ends the stream on this rank:

* rank 0 closes its connections: each follower reads every entry already sent, then the end.
  Rank 0 ends only after its last ``wait_all``, when every collective it issued has completed,
  so every follower has issued them all; a follower still holding a lease then fails its next
  submission ("rank 0's order ended") rather than wait for ever.
* a follower closes its connection and its thread ends (joined, unless a finalizer gave the
  lease back: it then wakes the thread, which ends by itself).  Rank 0 drops a connection it
  can no longer write to, and keeps publishing to the others.

A finalizer may run in any thread inside any lock, so ``release(wait=False)`` only queues the
token and wakes the follower's thread; the thread, or the next ``hold``, takes it.
"""
from __future__ import annotations

import atexit
import hashlib
import selectors
import socket
import threading
from typing import Any, Callable, Optional

from ..liveness import handshake
from ..liveness.holders import Holders
from ..liveness.threads import Stoppable
from .ordering import Entry, IssueOrder, Submission
from .sidechannel import Star

#: What a follower's submissions fail with once rank 0's order ended.
ORDER_ENDED = ("dcredit_hvd: rank 0's order of collectives ended (rank 0 closed its optimizers "
               "over this group, exited, or died): nothing more can be reduced")


class OrderStream:
    """One group's issue order on this rank, with its side channel (collective to build: every
    rank of the group, through ``broadcast``)."""

    def __init__(self, rank: int, size: int, issue: Callable[[Submission], Any],
                 broadcast: Callable[[Any], Any], bind: str, timeout: float,
                 failure: type[BaseException]) -> None:
        self.rank = rank
        self.order = IssueOrder(rank == 0, issue, self._post, timeout)
        self._failure = failure
        secret = broadcast(handshake.new_secret() if rank == 0 else None)
        #: Equal on every rank that holds this stream (the agreement compares it).
        self.token = hashlib.sha256(b"dcredit-order-token" + secret).hexdigest()[:16]
        #: None in a group of one: nobody follows.
        self.star: Optional[Star] = None
        if size > 1:
            self.star = Star(rank, size, secret, bind)
            address = broadcast(self.star.address() if rank == 0 else None)
            if rank == 0:
                self.star.accept_followers()
            else:
                self.star.join(tuple(address))
        self._lock = threading.Lock()
        self._holders = Holders()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread: Optional[Stoppable] = None
        if self.star is not None and rank != 0:
            self._thread = Stoppable(self._receive, "dcredit-order", self.close)
            self._thread.start()
        atexit.register(self.close)

    # -- leases (liveness/channels.py) ---------------------------------------------------------
    def hold(self) -> Optional[object]:
        """A lease (a token for ``release``), or None once the stream is ending."""
        with self._lock:
            # a lease a finalizer gave back, and no thread to take it (rank 0): taken here
            last = self._holders.queued and self._holders.last_gone()
            token = self._holders.take()
        if last:
            self.close()
        return token

    def release(self, token: object, wait: bool = True) -> None:
        """Give a lease back; the last one ends the stream.  ``wait=False`` from a finalizer:
        queued, and the follower's thread woken (nothing here blocks or takes a lock)."""
        if not wait:
            self._holders.queue(token)
            self._wake()
            return
        with self._lock:
            last = self._holders.last_gone(token)
        if last:
            self.close()

    @property
    def ended(self) -> bool:
        return self._closed or self._holders.ending

    @property
    def lost(self) -> list:
        """The liveness channel names lost peers; this stream only fails its order."""
        return []

    # -- the wire ------------------------------------------------------------------------------
    def _post(self, entry: Entry) -> None:
        """Rank 0: publish what it just issued (the order's lock is held, so lines go out in
        the issue order)."""
        if self.star is not None:
            self.star.send(entry.encode().encode() + b"\n")

    def _receive(self) -> None:
        """A follower's thread: rank 0's entries, in order, into the issue order, until the
        stream ends here or rank 0's does."""
        selector = selectors.DefaultSelector()      # not select(): a process may hold >1024 fds
        try:
            selector.register(self.star.follower_socket(), selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            self._follow(selector)
        except (OSError, ValueError):               # closed under the selector: ended here
            pass
        finally:
            selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _follow(self, selector: selectors.BaseSelector) -> None:
        while True:
            if not self.star.line_buffered():
                if self._closed:
                    return
                ready = [key.fileobj for key, _ in selector.select()]
                if self._wake_r in ready:
                    self._drain_wakes()
                    with self._lock:
                        last = self._holders.last_gone()
                    if last or self._closed:
                        self._end()
                        return
                if self.star.follower_socket() not in ready:
                    continue
            line = self.star.receive()
            if line is None:
                if not self._closed:
                    self.order.fail(self._failure(ORDER_ENDED))
                return
            self.order.follow([Entry.decode(line.decode())])

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass            # full: a wake is pending already; closed: the stream ended

    def _drain_wakes(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        """End the stream here (the last lease, or the process's exit); a follower's thread
        is joined unless this is it."""
        self._end()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _end(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = self._holders.ending = True
        atexit.unregister(self.close)
        if self.star is not None:
            self.star.close()
        if self._thread is None:            # rank 0: no thread to close the wake pair
            self._wake_r.close()
            self._wake_w.close()
        else:
            self._wake()
