"""Liveness of the peer processes, separate from progress: a TCP heartbeat mesh.

Why: a rank that dies while the launcher does not notice (a node lost, ``mpirun --mca
orte_abort_on_non_zero_status 0``, a scheduler that reaps only its own process) leaves the
others waiting in Horovod for ever; stall limits cannot tell a dead peer from a late one, and
Horovod's background thread, which would have to notice, may be stuck itself.  So every rank
keeps one TCP connection to every other rank, served by its own daemon thread:

* a **closed** connection (the kernel closes a process's sockets when it exits or is killed,
  SIGKILL included) is seen at once;
* a **silent** peer (no heartbeat for ``timeout`` seconds: its host is unreachable, or the
  process is frozen) is declared after the timeout;
* a peer that is alive but late (a long evaluation, uneven batches) keeps sending heartbeats
  from its own thread and is never declared dead: that is the stall limits' business.

A rank that leaves on purpose says goodbye first (``goodbye``, run at interpreter exit, or when
the last lease on the channel is given back: ``hold``/``release``, ``channels``): a normal exit
is not a loss; an exit by an uncaught exception is one, and the goodbye carries the
exception for the survivors' message.  Nothing here calls Horovod: ``comm`` hands over the job's
secret, exchanges the addresses (``Liveness.address`` then ``start(table)``) and decides what a
loss means for the job.  The wire format is lines: an empty line is a heartbeat, the others carry
JSON (``challenge``/``hello``/``welcome``, ``bye``).

Only the job's ranks get in.  A connection counts once both ends proved that they know the
secret (``handshake``: challenge-response, so a recorded hello is worth nothing); a rank that is
connected is never replaced by a second hello; a connection that has not proved itself within
``HANDSHAKE_SECONDS`` is closed, and at most ``PENDING_SPARE`` more of them than there are
ranks are kept at once (the oldest goes).  The listener is on one address (``interfaces``).
The connections themselves (listener, dialling, both sides of the handshake, refusals) are
``liveness_mesh``'s; this module is the heartbeat over them, what counts as a loss, and what a
loss does to the process.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from . import handshake, interfaces
from .holders import Holders
from .mesh import PENDING_SPARE, REDIALS, Mesh, Peer  # noqa: F401
from .settings import CONFIG_FIELD, ENV, Settings, check, settings, validate  # noqa: F401
from .threads import Stoppable

log = logging.getLogger("dcredit_hvd")

#: Exit status of a rank that ended because a peer was lost.
EXIT_STATUS = 1
#: Seconds a connection attempt to one address may take at start-up.
CONNECT_SECONDS = 5.0
#: Seconds an accepted connection has to prove itself (its hello) before it is closed.
HANDSHAKE_SECONDS = 5.0
#: Seconds a channel that ends waits for its peers to close their ends after its goodbye.
LEAVE_SECONDS = 2.0
#: This process's secret, for channels that are given none: only channels within this process
#: share it (tests); a job's ranks are given rank 0's (``comm.watch_peers``).
_PROCESS_SECRET = handshake.new_secret()


@dataclass(frozen=True)
class PeerEvent:
    """What happened to one peer, as the survivors' messages tell it."""

    rank: int
    host: str
    pid: int
    #: ``closed`` (connection closed without goodbye), ``silent`` (no heartbeat), ``failed``
    #: (said goodbye after an uncaught exception).
    what: str
    detail: str
    at: float            # time.time() of the detection

    def describe(self) -> str:
        who = f"rank {self.rank} (host {self.host}, pid {self.pid})"
        if self.what == "closed":
            return (f"{who} closed its connection without saying goodbye: the process exited "
                    f"abruptly or was killed ({self.detail})")
        if self.what == "silent":
            return (f"{who} sent no heartbeat for {self.detail}: its host is unreachable or the "
                    "process is frozen")
        return f"{who} exited with an uncaught exception: {self.detail}"


class Liveness:
    """A heartbeat mesh among ``size`` ranks: construct, publish ``address()``, ``start(table)``.

    Loss callbacks (``subscribe``) run in a fresh thread, never in the heartbeat thread,
    so one that blocks cannot stop detection.  With ``exit_on_loss`` the process is ended
    ``exit_seconds`` after a loss unless it exited by itself (and at interpreter exit at once,
    which skips Horovod's shutdown: it would wait for ever for the dead peer).
    """

    def __init__(self, rank: int, size: int, config: Settings = Settings(), *,
                 secret: Optional[bytes] = None, bind: Optional[str] = None,
                 advertise: Optional[list[str]] = None, exit_on_loss: bool = False,
                 needed: Optional[Callable[[], bool]] = None) -> None:
        """``secret``: the job's (the same bytes on every rank, from a trusted channel; default
        this process's own, for channels within one process).  ``bind``: the address to listen
        on (default: the first of ``advertise`` this host has, else
        ``interfaces.listen_address(config.bind)``); ``advertise``: the addresses the peers are
        told (default: the one listened on)."""
        self.rank, self.size, self.config = rank, size, config
        self.exit_on_loss = exit_on_loss
        #: Whether the peers are still needed (``comm``: Horovod is initialised); a peer lost
        #: after the job's collectives are over (``hvd.shutdown()``) is no reason to fail.
        self._needed = needed
        secret = handshake.check_secret(_PROCESS_SECRET if secret is None else secret)
        #: The same on every rank of one channel and different for every channel: what the
        #: ranks compare to agree that they hold the same one (``channels``).
        self.token = hashlib.sha256(b"dcredit-liveness-token" + secret).hexdigest()[:16]
        listener = interfaces.listener(bind, advertise, config.bind, max(8, size))
        self._mesh = Mesh(rank, size, secret, listener, self._line, self._closed)
        self._bound, self._port = listener.getsockname()[:2]
        self._advertise = advertise if advertise is not None else [self._bound]
        self._lock = threading.Lock()
        self._lost: list[PeerEvent] = []
        self._lost_event = threading.Event()
        self._subscribers: list[Callable[[list[PeerEvent]], None]] = []
        self._said_goodbye = False
        self._stop = threading.Event()
        #: Leases (``hold``): the channel ends when the last one is released.
        self._holders = Holders()            # finalizers' leases: for the thread to take
        self._thread: Optional[threading.Thread] = None
        self.host = socket.gethostname()

    # -- set-up ---------------------------------------------------------------------------
    def address(self) -> dict:
        """This rank's entry of the table every rank needs (plain data, for an all-gather)."""
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(),
                "addrs": self._advertise, "port": self._port}

    def start(self, table: list[dict]) -> None:
        """Connect to every peer in ``table`` (one entry per rank) and start the thread.

        Rank ``i`` connects to every rank above it and accepts the ones below; both ends
        prove that they know the job's secret (``handshake``), so a stranger is refused.
        """
        self._mesh.start(table)
        if self.exit_on_loss:
            atexit.register(self._at_exit)
        self._thread = Stoppable(self._run, "dcredit-liveness", self.end)
        self._thread.start()

    # -- what callers see -------------------------------------------------------------------
    def subscribe(self, callback: Callable[[list[PeerEvent]], None]) -> None:
        """``callback(events)`` once, in its own thread, at the first loss (at once if past)."""
        with self._lock:
            self._subscribers.append(callback)
            past = list(self._lost)
        if past:
            threading.Thread(target=callback, args=(past,), daemon=True).start()

    @property
    def lost(self) -> list[PeerEvent]:
        with self._lock:
            return list(self._lost)

    def wait_lost(self, timeout: float) -> list[PeerEvent]:
        """The peers lost so far, waiting up to ``timeout`` s for a first one."""
        self._lost_event.wait(timeout)
        return self.lost

    def connected(self) -> list[int]:
        """Ranks whose connection is established and not lost."""
        return self._mesh.connected()

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.connected()) == len(self._mesh.peers):
                return True
            time.sleep(0.01)
        return False

    def goodbye(self, reason: Optional[str] = None) -> None:
        """Tell every peer this rank leaves on purpose (``reason``: an uncaught exception, which
        the peers count as a loss; None: a normal exit, which they do not)."""
        if self._first_goodbye():
            self._mesh.say(_bye(reason))

    def close(self) -> None:
        """Stop the thread and close every socket (peers see a closed connection)."""
        self._stop_thread()
        self._mesh.close()

    def _first_goodbye(self) -> bool:
        """Whether this rank has not said goodbye yet (it has now)."""
        with self._lock:
            first, self._said_goodbye = not self._said_goodbye, True
        return first

    def _stop_thread(self) -> None:
        self._stop.set()
        self._mesh.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # -- leases: the channel lives while someone on this rank needs it --------------------------
    def hold(self) -> Optional[object]:
        """A lease on the channel (a token for ``release``), or None once it is ending."""
        with self._lock:
            return None if self._stop.is_set() else self._holders.take()

    def release(self, token: object, wait: bool = True) -> None:
        """Give a lease back; the last one ends the channel (``end``).  ``wait=False`` is for
        finalizers, which may run in any thread inside any lock: the token is queued and the
        heartbeat thread takes it, so nothing here blocks or takes a lock."""
        if not wait:
            self._holders.queue(token)
            self._mesh.wake()
            return
        with self._lock:
            last = self._holders.last_gone(token)
        if last:
            self.end()

    @property
    def ended(self) -> bool:
        return self._stop.is_set()

    def end(self) -> None:
        """Leave on purpose: the thread stopped, then a goodbye to every peer, which closes
        its end on it (no loss), and the sockets closed once they have (``Mesh.leave``); the
        process's exit has nothing more to say for this channel."""
        if not self._first_goodbye():
            self.close()
            return
        if self.exit_on_loss:
            atexit.unregister(self._at_exit)
        self._stop_thread()
        self._mesh.leave(_bye(None), LEAVE_SECONDS)

    # -- the mesh's state, under the names the tests read --------------------------------------
    @property
    def _listener(self) -> socket.socket:
        return self._mesh.listener

    @property
    def _unknown(self) -> dict[socket.socket, handshake.Challenge]:
        """Accepted connections that have not proved themselves, oldest first."""
        return self._mesh.lobby.waiting

    @property
    def _pending_limit(self) -> int:
        return self._mesh.lobby.limit

    # -- the heartbeat thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:    # never silently: the peers would take this rank for dead
            log.exception("dcredit_hvd: the liveness channel failed; peers will declare this "
                          "rank lost")
            raise
        if self._holders.ending and not self._stop.is_set():
            self.end()       # the last lease went in a finalizer: end from this thread

    def _loop(self) -> None:
        interval = self.config.interval
        next_beat = time.monotonic()
        while not self._stop.is_set():
            if self._holders.queued:
                with self._lock:
                    if self._holders.last_gone():
                        return
            timeout = max(0.0, next_beat - time.monotonic())
            before = time.monotonic()
            events = self._mesh.select(timeout)
            now = time.monotonic()
            overslept = now - before - timeout
            if overslept > interval:
                # This thread itself could not run (a loaded host, a suspended process): the
                # silence it would see is its own, so it does not count against the peers.
                self._mesh.postpone(overslept)
            for key, mask in events:
                if self._stop.is_set():
                    return
                self._mesh.handle(key, mask)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + interval
                self._beat(now)

    def _line(self, peer: Peer, line: bytes) -> None:
        """A line from a proved connection: a heartbeat (empty; that it came is what counts)
        or a goodbye."""
        if not line.startswith(b"bye "):
            return
        try:
            payload = json.loads(line[4:])
        except ValueError:
            payload = None
        reason = payload.get("error") if isinstance(payload, dict) else "an unreadable goodbye"
        self._mesh.forget(peer)
        if reason:
            self._declare(peer, "failed", reason)
        else:
            peer.departed = True

    def _closed(self, peer: Peer, detail: str) -> None:
        """A proved connection closed without a goodbye: the process behind it is gone."""
        self._declare(peer, "closed", detail)

    def _beat(self, now: float) -> None:
        """Every ``interval``: the deadlines (a hello, a connection attempt, a heartbeat), then
        this rank's own heartbeat to every connected peer."""
        mesh = self._mesh
        mesh.lobby.expire(now, HANDSHAKE_SECONDS)
        for peer in list(mesh.peers.values()):
            if peer.gone:
                continue
            silent = now - peer.last_seen
            if peer.connecting and silent > CONNECT_SECONDS:
                mesh.redial(peer)          # that address does not answer: try the next
                continue
            if silent > self.config.timeout:
                if not peer.connected:
                    mesh.forget(peer)
                    mesh.unreachable(peer)
                    continue
                mesh.forget(peer)
                self._declare(peer, "silent", f"{silent:.1f} s")
                continue
            if peer.connected:
                mesh.send(peer, b"\n")

    def _declare(self, peer: Peer, what: str, detail: str) -> None:
        if self._said_goodbye:
            return    # this rank is leaving: peers close their ends on its goodbye
        if self._needed is not None and not self._needed():
            return
        event = PeerEvent(peer.rank, peer.host, peer.pid, what, detail, time.time())
        with self._lock:
            first = not self._lost
            self._lost.append(event)
            subscribers = list(self._subscribers) if first else []
        self._lost_event.set()
        log.warning("dcredit_hvd: a peer process is gone: %s", event.describe())
        for callback in subscribers:
            threading.Thread(target=callback, args=([event],), daemon=True).start()
        if first and self.exit_on_loss and self.config.exit_seconds:
            threading.Thread(target=self._exit_later, name="dcredit-liveness-exit",
                             daemon=True).start()

    # -- ending the process ------------------------------------------------------------------
    def _exit_later(self) -> None:
        """The training thread had ``exit_seconds`` to raise and exit: it is stuck (in a
        collective of the user's, or Horovod's shutdown), so end the process here."""
        time.sleep(self.config.exit_seconds)
        log.error("dcredit_hvd: ending this process (status %d) %.0f s after losing a peer, "
                  "because it did not exit by itself: %s", EXIT_STATUS,
                  self.config.exit_seconds, "; ".join(e.describe() for e in self.lost))
        _hard_exit()

    def _at_exit(self) -> None:
        """At interpreter exit: after a loss, end now (Horovod's own exit handler would wait
        for the dead peer for ever); otherwise say goodbye so the peers do not mourn."""
        if self.lost:
            _hard_exit()
        error = getattr(sys, "last_value", None)
        self.goodbye(f"{type(error).__name__}: {error}" if error is not None else None)


def _bye(reason: Optional[str]) -> bytes:
    """The goodbye line: ``reason`` an uncaught exception (a loss to the peers), None a normal
    leave."""
    return b"bye " + json.dumps({"error": reason}).encode() + b"\n"


def _hard_exit() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # a closed stream must not keep the process alive
            pass
    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except Exception:
            pass
    os._exit(EXIT_STATUS)
