"""Who may join the liveness channel: a challenge-response over the job's secret.

Rank 0 draws the secret (``new_secret``) and the collective library, the job's trusted channel,
carries it to every rank (``comm.watch_peers``); it never travels on the liveness sockets.  Each
side of a connection proves that it knows the secret with an HMAC-SHA256 over the other side's
fresh nonce, and a connection counts only once both proofs held::

    acceptor  -> connector   challenge {"rank": a, "nonce": nA}
    connector -> acceptor    hello {"rank": c, "nonce": nC, "proof": mac("hello", a, c, nA, nC)}
    acceptor  -> connector   welcome {"proof": mac("welcome", a, c, nA, nC)}

The acceptor's nonce is new for each connection, so a recorded hello proves nothing the next
time; the connector's nonce does the same for a recorded welcome; the role inside the MAC keeps
one side's proof from serving as the other's.  Nothing here does I/O: ``liveness`` sends and
reads the lines, and decides what a refusal means.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any, Optional

#: Bytes of secret rank 0 draws for a job; fewer than ``MIN_SECRET_BYTES`` is refused.
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
NONCE_BYTES = 16
#: The longest line read from a connection that has not proved itself (a hello is ~200 bytes).
MAX_LINE = 4096
_LABEL = "dcredit-liveness-1"


def new_secret() -> bytes:
    """A job's secret: drawn once, by rank 0, and broadcast over the collective library."""
    return secrets.token_bytes(SECRET_BYTES)


def check_secret(secret: Any) -> bytes:
    """``secret``, or ``ValueError`` when it is no secret worth the name."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the liveness secret must be at least {MIN_SECRET_BYTES} bytes "
                         f"(handshake.new_secret()), got {type(secret).__name__}")
    return bytes(secret)


def line(kind: str, payload: dict) -> bytes:
    """One message of the wire format: ``kind``, a space, JSON, a newline."""
    return kind.encode() + b" " + json.dumps(payload, sort_keys=True).encode() + b"\n"


def parse(raw: bytes, kind: str) -> Optional[dict]:
    """The JSON object of a ``kind`` line, or None for anything else."""
    prefix = kind.encode() + b" "
    if not raw.startswith(prefix):
        return None
    try:
        payload = json.loads(raw[len(prefix):])
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _mac(secret: bytes, role: str, acceptor: int, connector: int, acceptor_nonce: str,
         connector_nonce: str) -> str:
    message = json.dumps([_LABEL, role, acceptor, connector, acceptor_nonce, connector_nonce])
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def _holds(claimed: Any, expected: str) -> bool:
    return isinstance(claimed, str) and hmac.compare_digest(claimed.encode(), expected.encode())


def _nonce(value: Any) -> Optional[str]:
    """A nonce as received: a hex string of the right length, else None."""
    if isinstance(value, str) and len(value) == 2 * NONCE_BYTES:
        try:
            bytes.fromhex(value)
            return value
        except ValueError:
            return None
    return None


class Challenge:
    """The accepting side of one connection, from its accept to its hello."""

    def __init__(self, secret: bytes, rank: int, opened: float) -> None:
        self._secret, self.rank = secret, rank
        self.nonce = secrets.token_hex(NONCE_BYTES)
        #: When it was accepted (``time.monotonic()``): it has a few seconds to prove itself.
        self.opened = opened
        self.buffer = b""

    def greeting(self) -> bytes:
        """The first line, sent at once on accept."""
        return line("challenge", {"rank": self.rank, "nonce": self.nonce})

    def verify(self, hello: Optional[dict]) -> Optional[tuple[int, str]]:
        """``(rank, its nonce)`` of a hello whose proof holds over this challenge, else None."""
        if hello is None:
            return None
        rank, theirs = hello.get("rank"), _nonce(hello.get("nonce"))
        if not isinstance(rank, int) or isinstance(rank, bool) or theirs is None:
            return None
        expected = _mac(self._secret, "hello", self.rank, rank, self.nonce, theirs)
        return (rank, theirs) if _holds(hello.get("proof"), expected) else None

    def welcome(self, rank: int, theirs: str) -> bytes:
        """The answer to a verified hello: this side's own proof."""
        return line("welcome", {"proof": _mac(self._secret, "welcome", self.rank, rank,
                                              self.nonce, theirs)})


class Answer:
    """The connecting side of one connection: answers the challenge, checks the welcome."""

    def __init__(self, secret: bytes, rank: int, acceptor: int) -> None:
        self._secret, self.rank, self.acceptor = secret, rank, acceptor
        self.nonce = secrets.token_hex(NONCE_BYTES)
        self._theirs: Optional[str] = None

    @property
    def answered(self) -> bool:
        return self._theirs is not None

    def hello(self, challenge: Optional[dict]) -> Optional[bytes]:
        """The hello for a challenge from the expected rank, or None (then hang up)."""
        if challenge is None or challenge.get("rank") != self.acceptor:
            return None
        theirs = _nonce(challenge.get("nonce"))
        if theirs is None:
            return None
        self._theirs = theirs
        return line("hello", {"rank": self.rank, "nonce": self.nonce,
                              "proof": _mac(self._secret, "hello", self.acceptor, self.rank,
                                            theirs, self.nonce)})

    def accepts(self, welcome: Optional[dict]) -> bool:
        """Whether the welcome proves that the listener knows the secret too."""
        if welcome is None or self._theirs is None:
            return False
        return _holds(welcome.get("proof"), _mac(self._secret, "welcome", self.acceptor,
                                                 self.rank, self._theirs, self.nonce))
