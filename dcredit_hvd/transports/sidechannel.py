"""Rank 0's lines to every other rank of a group: one authenticated TCP connection each.

The ``torch.distributed`` transport publishes rank 0's issue order here (``ordering.py``).  Why
not a collective on a side process group: a follower must wait for the next message at any
moment, and a thread blocked inside a Gloo collective when the user calls
``torch.distributed.destroy_process_group()`` aborts the process (``terminate called without an
active exception``, measured).  A socket is ours to close.

Set-up (``Star``): rank 0 listens on one address (``interfaces.listen_address``), the address
and a fresh secret reach the followers over the job's collective library, each follower
connects and both sides prove the secret (``handshake``: an outsider's connection is refused,
and the listener is closed once every follower joined).  Then rank 0 ``send``s lines; each
follower's ``receive`` returns them in order, or None once rank 0 closed.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Optional

from ..liveness import handshake

#: Seconds the set-up waits for every follower (or for rank 0) before it fails.
SETUP_SECONDS = 60.0
#: Seconds a connection has to prove itself during the set-up.
PROOF_SECONDS = 5.0


class SideChannelError(ConnectionError):
    """The side channel could not be set up or broke."""


class _Lines:
    """Reads newline-terminated lines from a blocking socket."""

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self.sock, self.limit, self.buffer = sock, limit, b""

    def read(self) -> Optional[bytes]:
        """The next line without its newline, or None at EOF."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > self.limit:
                raise SideChannelError(f"a line of more than {self.limit} bytes")
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line


class Star:
    """Rank 0 connected to each follower of a group of ``size`` ranks."""

    def __init__(self, rank: int, size: int, secret: bytes, bind: str = "127.0.0.1") -> None:
        self.rank, self.size = rank, size
        self._secret = handshake.check_secret(secret)
        self._followers: list[socket.socket] = []
        self._to_root: Optional[socket.socket] = None
        self._lines: Optional[_Lines] = None
        self._send_lock = threading.Lock()
        self._listener: Optional[socket.socket] = None
        if rank == 0 and size > 1:
            family = socket.AF_INET6 if ":" in bind else socket.AF_INET
            self._listener = socket.socket(family, socket.SOCK_STREAM)
            self._listener.bind((bind, 0))
            self._listener.listen(size + 16)

    def address(self) -> tuple[str, int]:
        """Where followers connect (rank 0)."""
        assert self._listener is not None, "only rank 0 of a group of 2 or more listens"
        host, port = self._listener.getsockname()[:2]
        return host, port

    # -- set-up --------------------------------------------------------------------------------
    def accept_followers(self, timeout: float = SETUP_SECONDS) -> None:
        """Rank 0: accept until every follower proved the secret; outsiders are dropped."""
        deadline = time.monotonic() + timeout
        joined: set[int] = set()
        try:
            while len(joined) < self.size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.size)) - joined)
                    raise SideChannelError(
                        f"dcredit_hvd: rank(s) {missing} did not join rank 0's order channel "
                        f"within {timeout:.0f} s (a firewall between the hosts, or those ranks "
                        "never built the optimizer)")
                self._listener.settimeout(left)
                try:
                    sock, _ = self._listener.accept()
                except socket.timeout:
                    continue
                rank = self._prove_acceptor(sock)
                if rank is None or rank in joined or not 0 < rank < self.size:
                    sock.close()
                    continue
                joined.add(rank)
                self._followers.append(sock)
        finally:
            self._listener.close()
            self._listener = None

    def _prove_acceptor(self, sock: socket.socket) -> Optional[int]:
        challenge = handshake.Challenge(self._secret, 0, time.monotonic())
        try:
            sock.settimeout(PROOF_SECONDS)
            sock.sendall(challenge.greeting())
            hello = _Lines(sock, handshake.MAX_LINE).read()
            verified = challenge.verify(handshake.parse(hello or b"", "hello"))
            if verified is None:
                return None
            rank, theirs = verified
            sock.sendall(challenge.welcome(rank, theirs))
        except OSError:
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return rank

    def join(self, address: tuple[str, int], timeout: float = SETUP_SECONDS) -> None:
        """A follower: connect to rank 0 and prove the secret both ways."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection(address, timeout=PROOF_SECONDS)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise SideChannelError(f"dcredit_hvd: cannot reach rank 0's order channel at "
                                           f"{address[0]}:{address[1]}: {exc}") from exc
                time.sleep(0.05)
        answer = handshake.Answer(self._secret, self.rank, 0)
        lines = _Lines(sock, handshake.MAX_LINE)
        hello = answer.hello(handshake.parse(lines.read() or b"", "challenge"))
        if hello is None:
            sock.close()
            raise SideChannelError("dcredit_hvd: rank 0's order channel sent no valid challenge")
        sock.sendall(hello)
        if not answer.accepts(handshake.parse(lines.read() or b"", "welcome")):
            sock.close()
            raise SideChannelError(f"dcredit_hvd: the listener at {address[0]}:{address[1]} did "
                                   "not prove the job's secret: not rank 0")
        sock.settimeout(None)
        self._to_root, self._lines = sock, _Lines(sock, 1 << 30)
        self._lines.buffer = lines.buffer

    # -- traffic -------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Rank 0: ``data`` (whole lines) to every follower, in the order of the calls.  A
        follower that closed its end is dropped; the others still get every line."""
        with self._send_lock:
            gone = []
            for sock in self._followers:
                try:
                    sock.sendall(data)
                except OSError:
                    gone.append(sock)
            for sock in gone:           # (``close`` may have emptied the list meanwhile)
                if sock in self._followers:
                    self._followers.remove(sock)
                sock.close()

    def follower_socket(self) -> socket.socket:
        """A follower: its connection to rank 0 (to ``select`` on)."""
        assert self._to_root is not None, "only a follower that joined has one"
        return self._to_root

    def line_buffered(self) -> bool:
        """A follower: whether a whole line is read already (``receive`` will not block)."""
        return self._lines is not None and b"\n" in self._lines.buffer

    def receive(self) -> Optional[bytes]:
        """A follower: rank 0's next line, or None once rank 0 closed (or ``close`` here)."""
        try:
            return self._lines.read()
        except OSError:
            return None

    def close(self) -> None:
        """Ends the connections (a follower blocked in ``receive`` gets None)."""
        for sock in [*self._followers, *([self._to_root] if self._to_root else [])]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._followers = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
