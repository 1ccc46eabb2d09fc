"""An outsider of the liveness channel: it knows the job's whole address table, not its secret.

    python tests/liveness/liveness_outsider.py ACTION < table.json

The table (one line of JSON, as ``comm.watch_peers`` all-gathers it) gives every rank's host,
pid, addresses and port: everything a local user of a shared node can read with ``ps`` and
``ss -ltn``.  ACTION, against every rank:

* ``token``: the hello that used to admit a peer, with the token computed from the table
  (``sha256(json.dumps(table))[:16]``), and a proof keyed with that token, for each rank below;
* ``bye``: ``bye {"error": ...}``, the line that made every survivor exit, first thing;
* ``replay LINE``: the given line (a hello recorded on the wire) after the challenge;
* ``flood N SECONDS``: N idle connections per rank, all held for SECONDS (raising its own file
  limit as far as allowed), then closed.

Prints one JSON object per rank: ``{"rank": r, "refused": bool, ...}``, where refused means
the rank closed the connection without letting it in (no ``welcome`` line came back).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import resource
import selectors
import socket
import sys
import time


def _token(table: list[dict]) -> str:
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]


def _dial(entry: dict, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection((entry["addrs"][0], entry["port"]), timeout=timeout)


def _refused(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Read until the rank closes; True unless it said ``welcome`` (let the connection in)."""
    sock.settimeout(timeout)
    received = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
    except OSError:          # still open after the timeout: not closed, so not refused
        return False
    return b"welcome" not in received


def _say(entry: dict, lines: list[bytes]) -> bool:
    with _dial(entry) as sock:
        sock.settimeout(10.0)
        sock.recv(4096)                 # the challenge
        for line in lines:
            sock.sendall(line)
        return _refused(sock)


def forged_hellos(table: list[dict], entry: dict) -> list[bytes]:
    """What an outsider can make from the table: the old token, a proof keyed with it."""
    token = _token(table)
    claimed = max(0, entry["rank"] - 1)
    proof = hmac.new(token.encode(), str(claimed).encode(), hashlib.sha256).hexdigest()
    return [b"hello " + json.dumps({"token": token, "rank": claimed}).encode() + b"\n",
            b"hello " + json.dumps({"rank": claimed, "nonce": "00" * 16,
                                    "proof": proof}).encode() + b"\n"]


def flood(table: list[dict], count: int, seconds: float) -> list[dict]:
    """``count`` connections to each rank, dialled all at once (non-blocking: a dropped SYN
    costs its retry, not the whole flood's), held ``seconds`` once all are through (or after
    30 s), never written to."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = count * len(table) + 64
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    poller = selectors.DefaultSelector()
    held: list[socket.socket] = []
    started = time.monotonic()
    for entry in table:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET6 if ":" in entry["addrs"][0] else socket.AF_INET)
            sock.setblocking(False)
            sock.connect_ex((entry["addrs"][0], entry["port"]))
            poller.register(sock, selectors.EVENT_WRITE, entry["rank"])
            held.append(sock)
    opened = {entry["rank"]: 0 for entry in table}
    waiting = len(held)
    while waiting and time.monotonic() - started < 30.0:
        for key, _ in poller.select(timeout=1.0):
            poller.unregister(key.fileobj)
            waiting -= 1
            if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                opened[key.data] += 1
    took = time.monotonic() - started
    time.sleep(seconds)
    for sock in held:
        sock.close()
    return [{"rank": r, "opened": n, "seconds": round(took, 2)} for r, n in opened.items()]


def main() -> None:
    table = json.loads(sys.stdin.readline())
    action = sys.argv[1]
    if action == "flood":
        results = flood(table, int(sys.argv[2]), float(sys.argv[3]))
    else:
        results = []
        for entry in table:
            if action == "token":
                refused = all(_say(entry, [hello]) for hello in forged_hellos(table, entry))
            elif action == "bye":
                refused = _say(entry, [b'bye {"error": "forged by an outsider"}\n'])
            else:
                refused = _say(entry, [sys.argv[2].encode() + b"\n"])
            results.append({"rank": entry["rank"], "refused": refused})
    for result in results:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
