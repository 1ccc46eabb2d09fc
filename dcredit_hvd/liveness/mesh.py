"""The liveness channel's connections: one proved TCP connection to every other rank.

Apart from the heartbeat (``liveness.py``), which drives this from its thread, enforces the
deadlines and decides what a closed or silent peer means for the job.  Here:

* the listener and the dialling: rank ``i`` dials every rank above it, trying each address the
  table gives, dialling the same one again (``REDIALS``) when it hung up before the handshake
  ended, and accepts the ranks below;
* the handshake on both sides (``handshake``): only the job's ranks, which know its secret, get
  in, and a rank that is connected is never replaced by a second hello;
* the connections that have not proved themselves yet (``Lobby``): each is challenged at once,
  at most ``PENDING_SPARE`` more than there are ranks wait (the oldest goes), and refusals are
  logged sparingly;
* the lines read off the proved connections, handed to ``on_line``; a proved connection that
  closes is handed to ``on_closed``.

Nothing here runs a thread or enforces a deadline: one thread calls ``select`` and ``handle``,
and ``liveness.Liveness`` applies the deadlines (``Lobby.expire``, ``redial``, ``forget``).
"""
from __future__ import annotations

import errno
import logging
import selectors
import socket
import time
from typing import Callable, Optional

from . import handshake

log = logging.getLogger("dcredit_hvd")

#: Connections not proved yet that are kept beyond one per rank; past that the oldest is closed.
PENDING_SPARE = 16
#: Times a connecting rank dials the same address again after it hung up before the handshake
#: ended (it timed the connection out, or closed it to make room).
REDIALS = 3


class Peer:
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


class Lobby:
    """Accepted connections until they prove themselves (``handshake.Challenge``).

    Each is challenged at once and waits, oldest first, in ``waiting``; at most ``limit`` wait
    (past that the oldest goes), so idle connections cannot exhaust file descriptors.  A refusal
    closes the connection; the 1st, 10th, 100th ... of each kind is logged (a flood must not
    flood the log too).
    """

    def __init__(self, rank: int, secret: bytes, listener: socket.socket, limit: int,
                 selector: selectors.BaseSelector) -> None:
        self.rank, self._secret, self.listener, self.limit = rank, secret, listener, limit
        self._selector = selector
        self.waiting: dict[socket.socket, handshake.Challenge] = {}
        self._refused: dict[str, int] = {}

    def accept(self) -> None:
        """Take what the listener holds; each connection is challenged at once and has until
        ``expire`` to answer.  Past ``limit``, the oldest waiting one goes."""
        for _ in range(64):
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.setblocking(False)
            _no_delay(conn)
            if len(self.waiting) >= self.limit:
                self.refuse(next(iter(self.waiting)), "crowd", "too many connections were "
                            "waiting to prove themselves (the oldest was closed)")
            challenge = handshake.Challenge(self._secret, self.rank, time.monotonic())
            try:
                conn.send(challenge.greeting())     # a short line fits in a new socket
            except OSError:
                conn.close()
                continue
            self.waiting[conn] = challenge
            self._selector.register(conn, selectors.EVENT_READ, "unknown")

    def hello(self, conn: socket.socket) -> Optional[tuple[int, str, bytes, handshake.Challenge]]:
        """Read from ``conn``: ``(rank, its nonce, what followed the hello, the challenge)``
        once its hello proves a rank; None while the hello is incomplete, or when it failed
        (then ``conn`` is refused)."""
        challenge = self.waiting[conn]
        try:
            chunk = conn.recv(handshake.MAX_LINE)
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        challenge.buffer += chunk
        if chunk and b"\n" not in challenge.buffer and len(challenge.buffer) < handshake.MAX_LINE:
            return None
        line, _, rest = challenge.buffer.partition(b"\n")
        proved = challenge.verify(handshake.parse(line, "hello")) if b"\n" in challenge.buffer \
            else None
        if proved is None:
            self.refuse(conn, "proof", "it did not prove that it knows the job's secret"
                        if chunk else "it hung up before its hello")
            return None
        rank, theirs = proved
        return rank, theirs, rest, challenge

    def let_in(self, conn: socket.socket) -> None:
        """``conn`` proved itself and is adopted as a peer: it waits no longer."""
        self.waiting.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass

    def refuse(self, conn: socket.socket, kind: str, reason: str) -> None:
        """Close a connection that did not prove itself (``kind`` counts it, ``reason`` is
        logged)."""
        try:
            origin = "{}:{}".format(*conn.getpeername()[:2])
        except OSError:
            origin = "an unknown address"
        self.let_in(conn)
        conn.close()
        count = self._refused[kind] = self._refused.get(kind, 0) + 1
        if count == 10 ** (len(str(count)) - 1):
            log.warning("dcredit_hvd: the liveness channel of rank %d refused a connection from "
                        "%s: %s (%d such so far). Only the job's own ranks, which know its "
                        "secret, get in; watching the peers goes on", self.rank, origin, reason,
                        count)

    def expire(self, now: float, seconds: float) -> None:
        """Refuse the connections that have not proved themselves within ``seconds``."""
        for conn, challenge in list(self.waiting.items()):
            if now - challenge.opened > seconds:
                self.refuse(conn, "slow", f"it sent no hello within {seconds:g} s")

    def postpone(self, seconds: float) -> None:
        """Move every waiting connection's clock on by ``seconds`` (see ``Mesh.postpone``)."""
        for challenge in self.waiting.values():
            challenge.opened += seconds


class Mesh:
    """Rank ``rank``'s connections among ``size`` ranks: ``start(table)``, then ``select`` and
    ``handle`` from one thread; ``close`` at the end.

    ``on_line(peer, line)``: a line (without its newline) from a proved connection.
    ``on_closed(peer, detail)``: a proved connection closed; the peer is already forgotten.
    """

    def __init__(self, rank: int, size: int, secret: bytes, listener: socket.socket,
                 on_line: Callable[[Peer, bytes], None],
                 on_closed: Callable[[Peer, str], None]) -> None:
        self.rank = rank
        self._secret = secret
        self.listener = listener
        listener.setblocking(False)
        self.peers: dict[int, Peer] = {}
        self._on_line, self._on_closed = on_line, on_closed
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        #: The accepted connections that have not proved themselves yet.
        self.lobby = Lobby(rank, secret, listener, PENDING_SPARE + size, self._selector)

    def start(self, table: list[dict]) -> None:
        """Know every other rank of ``table`` (one entry per rank); dial the ones above."""
        for entry in table:
            if entry["rank"] != self.rank:
                self.peers[entry["rank"]] = Peer(entry)
        self._selector.register(self.listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        for peer in self.peers.values():
            if peer.rank > self.rank:
                self._connect(peer)

    def connected(self) -> list[int]:
        """Ranks whose connection is established and not lost."""
        return sorted(p.rank for p in list(self.peers.values()) if p.connected and not p.gone)

    # -- what the driving thread calls ---------------------------------------------------------
    def select(self, timeout: float) -> list[tuple[selectors.SelectorKey, int]]:
        return self._selector.select(timeout=timeout)

    def wake(self) -> None:
        """End a ``select`` in progress (from another thread: closing, a lease given back).
        Never blocks: a full pair means a wake is pending already."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def postpone(self, seconds: float) -> None:
        """Move every peer's and every unproved connection's clock on by ``seconds``: the
        driving thread could not run that long, so the silence it would see is its own."""
        for peer in self.peers.values():
            peer.last_seen += seconds
        self.lobby.postpone(seconds)

    def redial(self, peer: Peer) -> None:
        """The address ``peer`` is dialled at does not answer: try its next one."""
        self._drop_socket(peer)
        self._connect(peer)

    def forget(self, peer: Peer) -> None:
        """Stop watching ``peer`` (lost or departed) and close its socket."""
        peer.gone = True
        self._drop_socket(peer)

    def unreachable(self, peer: Peer) -> None:
        """No address of ``peer`` gave a proved connection: say so once, and stop trying."""
        peer.gone = True
        log.warning("dcredit_hvd: the liveness channel could not connect to rank %d (host %s): "
                    "that rank's death will only be noticed by Horovod or the stall limits "
                    "(DCREDIT_STALL_ABORT_SECONDS). Let the ranks reach each other over TCP "
                    "(any port), or set DCREDIT_LIVENESS=0 to silence this", peer.rank, peer.host)

    def send(self, peer: Peer, data: bytes) -> None:
        try:
            peer.sock.send(data)
        except BlockingIOError:
            pass     # the peer is not reading: its silence is detected, not our send
        except OSError as exc:
            self._closed(peer, exc.strerror or type(exc).__name__)

    def say(self, line: bytes) -> list[socket.socket]:
        """``line`` to every connected peer; the sockets it went out on."""
        said = []
        for peer in list(self.peers.values()):
            sock = peer.sock
            if sock is None or not peer.connected or peer.gone:
                continue
            try:
                sock.send(line)          # a short line fits unless the peer stopped reading
                said.append(sock)
            except OSError:
                pass
        return said

    def leave(self, line: bytes, seconds: float) -> None:
        """Leave on purpose (the driving thread stopped): ``line`` to every connected peer, then
        our end shut for writing, then read and discard until each peer closes its end (it
        does on the line) or ``seconds`` pass; then ``close``.  A socket closed with unread
        bytes (the peers' heartbeats) is reset, and a reset drops what was not yet sent, the
        goodbye included: the peer would see a death."""
        leaving = []
        for sock in self.say(line):
            try:
                sock.shutdown(socket.SHUT_WR)
                leaving.append(sock)
            except OSError:
                pass
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as waiting:
            for sock in leaving:
                waiting.register(sock, selectors.EVENT_READ)
            while waiting.get_map() and time.monotonic() < deadline:
                for key, _ in waiting.select(max(0.0, deadline - time.monotonic())):
                    try:
                        ended = not key.fileobj.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        ended = True
                    if ended:
                        waiting.unregister(key.fileobj)
        self.close()

    def _drain_wakes(self) -> None:
        """Read the wake bytes, or the pair stays readable and ``select`` returns at once for
        ever (a busy thread; and once the pair is full, ``wake`` could not write)."""
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:        # BlockingIOError: drained; other errors: closing
            pass

    def close(self) -> None:
        """Close every socket (the peers see a closed connection)."""
        for sock in [self.listener, self._wake_r, self._wake_w, *self.lobby.waiting,
                     *(p.sock for p in self.peers.values() if p.sock is not None)]:
            try:
                sock.close()
            except OSError:
                pass

    def handle(self, key: selectors.SelectorKey, mask: int) -> None:
        """One event of ``select``: a connection to accept, a hello, a dial done, or lines."""
        data, sock = key.data, key.fileobj
        if data == "wake":
            self._drain_wakes()
            return
        if data == "listen":
            self.lobby.accept()
            return
        if data == "unknown":
            if sock in self.lobby.waiting:       # (not closed by this very batch)
                self._read_hello(sock)
            return
        peer: Peer = data
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

    # -- dialling ------------------------------------------------------------------------------
    def _connect(self, peer: Peer) -> None:
        """Non-blocking connect to the next candidate address of ``peer``."""
        while peer.candidates:
            address = peer.candidates.pop(0)
            try:
                sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
            except OSError:
                continue
            sock.setblocking(False)
            _no_delay(sock)
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
        self.unreachable(peer)

    def _handshake(self, peer: Peer, line: bytes) -> None:
        """The dialling side (a rank above this one): answer its challenge, check its welcome."""
        answer = peer.answer
        if not answer.answered:
            hello = answer.hello(handshake.parse(line, "challenge"))
            if hello is not None:
                self.send(peer, hello)
                return
            self._hang_up(peer, f"its first line was no challenge from rank {peer.rank}")
        elif answer.accepts(handshake.parse(line, "welcome")):
            peer.connected, peer.last_seen = True, time.monotonic()
        else:
            self._hang_up(peer, "its welcome did not prove that it knows the job's secret")

    def _hang_up(self, peer: Peer, reason: str) -> None:
        """What listens at ``peer``'s address is not that rank: try its next address."""
        log.warning("dcredit_hvd: the liveness channel of rank %d hung up on %s, given as the "
                    "address of rank %d (host %s): %s; trying its next address", self.rank,
                    "{}:{}".format(*peer.address[:2]), peer.rank, peer.host, reason)
        self._drop_socket(peer)
        self._connect(peer)

    # -- accepting -----------------------------------------------------------------------------
    def _read_hello(self, conn: socket.socket) -> None:
        """An accepted connection: adopt it as the peer its hello proves, or refuse it."""
        proved = self.lobby.hello(conn)
        if proved is None:
            return
        rank, theirs, rest, challenge = proved
        peer = self.peers.get(rank)
        if peer is None or peer.rank > self.rank:
            self.lobby.refuse(conn, "rank", f"its hello, with a valid proof, names rank {rank}, "
                              f"which does not connect to rank {self.rank}")
            return
        if peer.connected or peer.gone:
            self.lobby.refuse(conn, "second", f"rank {rank} is "
                              f"{'lost' if peer.gone else 'connected'} already: a second hello "
                              "for it is never let in")
            return
        self.lobby.let_in(conn)
        peer.sock, peer.connected, peer.buffer = conn, True, rest
        peer.last_seen = time.monotonic()
        self.send(peer, challenge.welcome(rank, theirs))
        if peer.sock is not conn or conn.fileno() < 0:
            return      # the welcome failed (the peer reset): declared closed, nothing to read
        self._selector.register(conn, selectors.EVENT_READ, peer)
        self._lines(peer)

    # -- reading -------------------------------------------------------------------------------
    def _read(self, peer: Peer) -> None:
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

    def _lines(self, peer: Peer) -> None:
        while b"\n" in peer.buffer and not peer.gone and peer.sock is not None:
            line, _, peer.buffer = peer.buffer.partition(b"\n")
            if not peer.connected:
                self._handshake(peer, line)
            else:
                self._on_line(peer, line)
        if not peer.connected and len(peer.buffer) >= handshake.MAX_LINE:
            self._hang_up(peer, "it sent a line longer than any handshake")

    def _closed(self, peer: Peer, detail: str) -> None:
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
        self.forget(peer)
        self._on_closed(peer, detail)

    def _drop_socket(self, peer: Peer) -> None:
        if peer.sock is not None:
            try:
                self._selector.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
            peer.sock.close()
            peer.sock, peer.connecting, peer.answer, peer.buffer = None, False, None, b""


def _no_delay(sock: socket.socket) -> None:
    """Each line goes out at once (a heartbeat's timing is the point; without it Nagle holds
    a goodbye behind an unacknowledged heartbeat)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
