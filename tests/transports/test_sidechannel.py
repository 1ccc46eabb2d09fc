"""``sidechannel.Star``: rank 0's lines reach every follower in order, and only the job's ranks
join (both sides prove the secret).  Real sockets on loopback, ranks as threads."""
from __future__ import annotations

import socket
import threading

import pytest

from dcredit_hvd.liveness import handshake
from dcredit_hvd.transports.sidechannel import SideChannelError, Star


def star_of(size: int, secret: bytes, outsiders: int = 0) -> tuple[Star, list[Star]]:
    root = Star(0, size, secret)
    address = root.address()
    for _ in range(outsiders):               # connect before the ranks, say nothing useful
        sock = socket.create_connection(address)
        sock.sendall(b"hello {}\n")
        sock.close()
    followers = [Star(r, size, secret) for r in range(1, size)]
    joins = [threading.Thread(target=f.join, args=(address,)) for f in followers]
    for t in joins:
        t.start()
    root.accept_followers(timeout=10)
    for t in joins:
        t.join(timeout=10)
    return root, followers


def test_lines_reach_every_follower_in_order_and_close_ends_them() -> None:
    root, followers = star_of(3, handshake.new_secret())
    root.send(b"first\n")
    root.send(b"second\nthird\n")
    for f in followers:
        assert [f.receive() for _ in range(3)] == [b"first", b"second", b"third"]
    root.close()
    assert [f.receive() for f in followers] == [None, None]
    for f in followers:
        f.close()


def test_a_follower_that_left_is_dropped_and_the_others_still_get_every_line() -> None:
    """A follower's order ends with its last optimizer (``order_stream.py``) while rank 0 may
    still publish: the first follower's broken connection must not stop the line for the
    ones after it."""
    for leaving in (0, 1):           # whichever rank 0 writes to first
        root, followers = star_of(3, handshake.new_secret())
        gone, staying = followers[leaving], followers[1 - leaving]
        gone.close()
        for i in range(200):         # enough writes for the closed end's reset to be seen
            root.send(b"line %d\n" % i)
        assert [staying.receive() for _ in range(200)] == [b"line %d" % i for i in range(200)]
        root.close()
        staying.close()


def test_an_outsider_is_refused_and_the_ranks_still_join() -> None:
    root, followers = star_of(2, handshake.new_secret(), outsiders=2)
    root.send(b"x\n")
    assert followers[0].receive() == b"x"
    root.close()
    followers[0].close()


def test_a_rank_with_another_secret_never_joins_and_rank_0_names_it() -> None:
    root = Star(0, 2, handshake.new_secret())
    impostor = Star(1, 2, handshake.new_secret())
    errors: list[BaseException] = []

    def join() -> None:
        try:
            impostor.join(root.address(), timeout=2)
        except BaseException as exc:        # the listener's welcome cannot be checked
            errors.append(exc)
    thread = threading.Thread(target=join)
    thread.start()
    with pytest.raises(SideChannelError, match=r"rank\(s\) \[1\] did not join"):
        root.accept_followers(timeout=1.5)
    thread.join(timeout=10)
    assert errors and isinstance(errors[0], (SideChannelError, OSError))


def test_a_listener_without_the_secret_is_not_trusted_by_a_follower() -> None:
    """Something else on rank 0's port (it does not know the secret) cannot feed the order."""
    listener = socket.create_server(("127.0.0.1", 0))
    fake_root = handshake.Challenge(handshake.new_secret(), 0, 0.0)

    def serve() -> None:
        sock, _ = listener.accept()
        sock.sendall(fake_root.greeting())
        sock.recv(4096)
        sock.sendall(handshake.line("welcome", {"proof": "0" * 64}))
        sock.close()
    thread = threading.Thread(target=serve)
    thread.start()
    follower = Star(1, 2, handshake.new_secret())
    with pytest.raises(SideChannelError, match="did not prove the job's secret"):
        follower.join(listener.getsockname()[:2], timeout=5)
    thread.join(timeout=10)
    listener.close()


def test_nobody_listening_is_a_clear_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SideChannelError, match="cannot reach rank 0's order channel"):
        Star(1, 2, handshake.new_secret()).join(("127.0.0.1", port), timeout=0.3)
