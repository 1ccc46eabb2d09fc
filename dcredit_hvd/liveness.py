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

A rank that leaves on purpose says goodbye first (``goodbye``, run at interpreter exit): a
normal exit is not a loss; an exit by an uncaught exception is one, and the goodbye carries the
exception for the survivors' message.  Nothing here calls Horovod: ``comm`` hands over the job's
secret, exchanges the addresses (``Liveness.address`` then ``start(table)``) and decides what a
loss means for the job.  The wire format is lines: an empty line is a heartbeat, the others carry
JSON (``challenge``/``hello``/``welcome``, ``bye``).

Only the job's ranks get in.  A connection counts once both ends proved that they know the
secret (``handshake``: challenge-response, so a recorded hello is worth nothing); a rank that is
connected is never replaced by a second hello; a connection that has not proved itself within
``HANDSHAKE_SECONDS`` is closed, and at most ``PENDING_SPARE`` more of them than there are
ranks are kept at once (the oldest goes).  The listener is on one address (``interfaces``).
"""
from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import handshake, interfaces
from .liveness_settings import CONFIG_FIELD, ENV, Settings, check, settings, validate  # noqa: F401

log = logging.getLogger("dcredit_hvd")

#: Exit status of a rank that ended because a peer was lost.
EXIT_STATUS = 1
#: Seconds a connection attempt to one address may take at start-up.
CONNECT_SECONDS = 5.0
#: Seconds an accepted connection has to prove itself (its hello) before it is closed.
HANDSHAKE_SECONDS = 5.0
#: Connections not proved yet that are kept beyond one per rank; past that the oldest is closed.
PENDING_SPARE = 16
#: Times a connecting rank dials the same address again after it hung up before the handshake
#: ended (it timed the connection out, or closed it to make room).
REDIALS = 3
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


class _Peer:
    """One connection and what is known about the rank behind it."""

    def __init__(self, entry: dict) -> None:
        self.rank: int = entry["rank"]
        self.host: str = entry["host"]
        self.pid: int = entry["pid"]
        self.candidates: list[tuple[str, int]] = [(a, entry["port"]) for a in entry["addrs"]]
        self.sock: Optional[socket.socket] = None
        self.connected = False           # both proofs held (``handshake``)
        self.connecting = False          # TCP connect in progress (a rank above this one)
        self.answer: Optional[handshake.Answer] = None    # the handshake this rank dials
        self.address: Optional[tuple[str, int]] = None    # the address dialled
        self.redials = 0
        self.buffer = b""
        self.last_seen = time.monotonic()
        self.gone = False                # lost or departed: no longer watched
        self.departed = False            # said goodbye after a normal exit


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
        self._secret = handshake.check_secret(_PROCESS_SECRET if secret is None else secret)
        self._listener = interfaces.listener(bind, advertise, config.bind, max(8, size))
        self._listener.setblocking(False)
        self._bound, self._port = self._listener.getsockname()[:2]
        self._advertise = advertise if advertise is not None else [self._bound]
        self._peers: dict[int, _Peer] = {}
        #: Accepted connections that have not proved themselves, oldest first.
        self._unknown: dict[socket.socket, handshake.Challenge] = {}
        self._pending_limit = PENDING_SPARE + size
        self._refused: dict[str, int] = {}
        self._lock = threading.Lock()
        self._lost: list[PeerEvent] = []
        self._lost_event = threading.Event()
        self._subscribers: list[Callable[[list[PeerEvent]], None]] = []
        self._said_goodbye = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
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
        for entry in table:
            if entry["rank"] != self.rank:
                self._peers[entry["rank"]] = _Peer(entry)
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        for peer in self._peers.values():
            if peer.rank > self.rank:
                self._connect(peer)
        if self.exit_on_loss:
            atexit.register(self._at_exit)
        self._thread = threading.Thread(target=self._run, name="dcredit-liveness", daemon=True)
        self._thread.start()

    def _connect(self, peer: _Peer) -> None:
        """Non-blocking connect to the next candidate address of ``peer``."""
        while peer.candidates:
            address = peer.candidates.pop(0)
            try:
                sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
            except OSError:
                continue
            sock.setblocking(False)
            try:
                code = sock.connect_ex(address)
            except OSError:        # a name that does not resolve
                code = -1
            if code in (0, errno.EINPROGRESS, errno.EAGAIN):
                peer.sock, peer.connecting, peer.last_seen = sock, True, time.monotonic()
                peer.address, peer.answer = address, None
                self._selector.register(sock, selectors.EVENT_WRITE, peer)
                return
            sock.close()
        self._unreachable(peer)

    def _unreachable(self, peer: _Peer) -> None:
        peer.gone = True
        log.warning("dcredit_hvd: the liveness channel could not connect to rank %d (host %s): "
                    "that rank's death will only be noticed by Horovod or the stall limits "
                    "(DCREDIT_STALL_ABORT_SECONDS). Let the ranks reach each other over TCP "
                    "(any port), or set DCREDIT_LIVENESS=0 to silence this", peer.rank, peer.host)

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
        return sorted(p.rank for p in list(self._peers.values()) if p.connected and not p.gone)

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.connected()) == len(self._peers):
                return True
            time.sleep(0.01)
        return False

    def goodbye(self, reason: Optional[str] = None) -> None:
        """Tell every peer this rank leaves on purpose (``reason``: an uncaught exception, which
        the peers count as a loss; None: a normal exit, which they do not)."""
        with self._lock:
            if self._said_goodbye:
                return
            self._said_goodbye = True
        line = b"bye " + json.dumps({"error": reason}).encode() + b"\n"
        for peer in list(self._peers.values()):
            sock = peer.sock
            if sock is not None and peer.connected and not peer.gone:
                try:
                    sock.send(line)     # a short line fits unless the peer stopped reading
                except OSError:
                    pass

    def close(self) -> None:
        """Stop the thread and close every socket (peers see a closed connection)."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for sock in [self._listener, self._wake_r, self._wake_w, *self._unknown,
                     *(p.sock for p in self._peers.values() if p.sock is not None)]:
            try:
                sock.close()
            except OSError:
                pass

    # -- the heartbeat thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:    # never silently: the peers would take this rank for dead
            log.exception("dcredit_hvd: the liveness channel failed; peers will declare this "
                          "rank lost")
            raise

    def _loop(self) -> None:
        interval = self.config.interval
        next_beat = time.monotonic()
        while not self._stop.is_set():
            timeout = max(0.0, next_beat - time.monotonic())
            before = time.monotonic()
            events = self._selector.select(timeout=timeout)
            now = time.monotonic()
            overslept = now - before - timeout
            if overslept > interval:
                # This thread itself could not run (a loaded host, a suspended process): the
                # silence it would see is its own, so it does not count against the peers.
                for peer in self._peers.values():
                    peer.last_seen += overslept
                for challenge in self._unknown.values():
                    challenge.opened += overslept
            for key, mask in events:
                if self._stop.is_set():
                    return
                self._handle(key.data, key.fileobj, mask)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + interval
                self._beat(now)

    def _handle(self, data: Any, sock: Any, mask: int) -> None:
        if data == "wake":
            return
        if data == "listen":
            self._accept()
            return
        if data == "unknown":
            if sock in self._unknown:           # (not closed by this very batch)
                self._read_hello(sock)
            return
        peer: _Peer = data
        if sock is not peer.sock:               # closed by this very batch
            return
        if peer.connecting and mask & selectors.EVENT_WRITE:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            self._selector.unregister(sock)
            if code:
                sock.close()
                peer.sock, peer.connecting = None, False
                self._connect(peer)
                return
            peer.connecting = False        # the acceptor speaks first: its challenge
            peer.answer = handshake.Answer(self._secret, self.rank, peer.rank)
            self._selector.register(sock, selectors.EVENT_READ, peer)
            return
        self._read(peer)

    def _accept(self) -> None:
        """Take what the listener holds; each connection is challenged at once and has
        ``HANDSHAKE_SECONDS`` to answer.  Past the limit, the oldest waiting one goes."""
        for _ in range(64):
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setblocking(False)
            if len(self._unknown) >= self._pending_limit:
                self._refuse(next(iter(self._unknown)), "crowd", "too many connections were "
                             "waiting to prove themselves (the oldest was closed)")
            challenge = handshake.Challenge(self._secret, self.rank, time.monotonic())
            try:
                conn.send(challenge.greeting())     # a short line fits in a new socket
            except OSError:
                conn.close()
                continue
            self._unknown[conn] = challenge
            self._selector.register(conn, selectors.EVENT_READ, "unknown")

    def _read_hello(self, conn: socket.socket) -> None:
        """An accepted connection: adopt it as the peer its hello proves, or refuse it."""
        challenge = self._unknown[conn]
        try:
            chunk = conn.recv(handshake.MAX_LINE)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        challenge.buffer += chunk
        if chunk and b"\n" not in challenge.buffer and len(challenge.buffer) < handshake.MAX_LINE:
            return
        line, _, rest = challenge.buffer.partition(b"\n")
        proved = challenge.verify(handshake.parse(line, "hello")) if b"\n" in challenge.buffer \
            else None
        if proved is None:
            self._refuse(conn, "proof", "it did not prove that it knows the job's secret"
                         if chunk else "it hung up before its hello")
            return
        rank, theirs = proved
        peer = self._peers.get(rank)
        if peer is None or peer.rank > self.rank:
            self._refuse(conn, "rank", f"its hello, with a valid proof, names rank {rank}, "
                         f"which does not connect to rank {self.rank}")
            return
        if peer.connected or peer.gone:
            self._refuse(conn, "second", f"rank {rank} is {'lost' if peer.gone else 'connected'}"
                         " already: a second hello for it is never let in")
            return
        self._forget_pending(conn)
        peer.sock, peer.connected, peer.buffer = conn, True, rest
        peer.last_seen = time.monotonic()
        self._send(peer, challenge.welcome(rank, theirs))
        self._selector.register(conn, selectors.EVENT_READ, peer)
        self._lines(peer)

    def _forget_pending(self, conn: socket.socket) -> None:
        self._unknown.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass

    def _refuse(self, conn: socket.socket, kind: str, reason: str) -> None:
        """Close a connection that did not prove itself; log the 1st, 10th, 100th ... refusal
        of each ``kind`` (a flood must not flood the log too)."""
        try:
            origin = "{}:{}".format(*conn.getpeername()[:2])
        except OSError:
            origin = "an unknown address"
        self._forget_pending(conn)
        conn.close()
        count = self._refused[kind] = self._refused.get(kind, 0) + 1
        if count == 10 ** (len(str(count)) - 1):
            log.warning("dcredit_hvd: the liveness channel of rank %d refused a connection from "
                        "%s: %s (%d such so far). Only the job's own ranks, which know its "
                        "secret, get in; watching the peers goes on", self.rank, origin, reason,
                        count)

    def _read(self, peer: _Peer) -> None:
        sock = peer.sock
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            self._closed(peer, exc.strerror or type(exc).__name__)
            return
        if not chunk:
            self._lines(peer)
            if peer.sock is sock:           # (a failed handshake may have dialled again)
                self._closed(peer, "end of stream")
            return
        peer.last_seen = time.monotonic()
        peer.buffer += chunk
        self._lines(peer)

    def _lines(self, peer: _Peer) -> None:
        while b"\n" in peer.buffer and not peer.gone and peer.sock is not None:
            line, _, peer.buffer = peer.buffer.partition(b"\n")
            if not peer.connected:
                self._handshake(peer, line)
            elif line.startswith(b"bye "):
                try:
                    reason = json.loads(line[4:]).get("error")
                except ValueError:
                    reason = "an unreadable goodbye"
                self._forget(peer)
                if reason:
                    self._declare(peer, "failed", reason)
                else:
                    peer.departed = True
        if not peer.connected and len(peer.buffer) >= handshake.MAX_LINE:
            self._hang_up(peer, "it sent a line longer than any handshake")

    def _handshake(self, peer: _Peer, line: bytes) -> None:
        """The dialling side (a rank above this one): answer its challenge, check its welcome."""
        answer = peer.answer
        if not answer.answered:
            hello = answer.hello(handshake.parse(line, "challenge"))
            if hello is not None:
                self._send(peer, hello)
                return
            self._hang_up(peer, f"its first line was no challenge from rank {peer.rank}")
        elif answer.accepts(handshake.parse(line, "welcome")):
            peer.connected, peer.last_seen = True, time.monotonic()
        else:
            self._hang_up(peer, "its welcome did not prove that it knows the job's secret")

    def _hang_up(self, peer: _Peer, reason: str) -> None:
        """What listens at ``peer``'s address is not that rank: try its next address."""
        log.warning("dcredit_hvd: the liveness channel of rank %d hung up on %s, given as the "
                    "address of rank %d (host %s): %s; trying its next address", self.rank,
                    "{}:{}".format(*peer.address[:2]), peer.rank, peer.host, reason)
        self._drop_socket(peer)
        self._connect(peer)

    def _closed(self, peer: _Peer, detail: str) -> None:
        if peer.gone:
            return
        if not peer.connected:
            # Never established: the listener timed this connection out or made room (dial
            # it again, a few times), or a wrong address (try the next): not a death.
            dialled = peer.address if peer.answer is not None else None
            self._drop_socket(peer)
            if peer.rank > self.rank:
                if dialled is not None and peer.redials < REDIALS:
                    peer.redials += 1
                    peer.candidates.insert(0, dialled)
                self._connect(peer)
            return
        self._forget(peer)
        self._declare(peer, "closed", detail)

    def _forget(self, peer: _Peer) -> None:
        peer.gone = True
        self._drop_socket(peer)

    def _drop_socket(self, peer: _Peer) -> None:
        if peer.sock is not None:
            try:
                self._selector.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
            peer.sock.close()
            peer.sock, peer.connecting, peer.answer, peer.buffer = None, False, None, b""

    def _beat(self, now: float) -> None:
        for conn, challenge in list(self._unknown.items()):
            if now - challenge.opened > HANDSHAKE_SECONDS:
                self._refuse(conn, "slow", f"it sent no hello within {HANDSHAKE_SECONDS:g} s")
        for peer in list(self._peers.values()):
            if peer.gone:
                continue
            silent = now - peer.last_seen
            if peer.connecting and silent > CONNECT_SECONDS:
                self._drop_socket(peer)          # that address does not answer: try the next
                self._connect(peer)
                continue
            if silent > self.config.timeout:
                if not peer.connected:
                    self._forget(peer)
                    self._unreachable(peer)
                    continue
                self._forget(peer)
                self._declare(peer, "silent", f"{silent:.1f} s")
                continue
            if peer.connected:
                self._send(peer, b"\n")

    def _send(self, peer: _Peer, data: bytes) -> None:
        try:
            peer.sock.send(data)
        except BlockingIOError:
            pass     # the peer is not reading: its silence is detected, not our send
        except OSError as exc:
            self._closed(peer, exc.strerror or type(exc).__name__)

    def _declare(self, peer: _Peer, what: str, detail: str) -> None:
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
