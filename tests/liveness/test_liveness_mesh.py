"""The liveness channel's connections (``dcredit_hvd/liveness/mesh.py``) alone: no heartbeat
thread and no deadlines, the test drives ``select``/``handle`` itself, so each step is seen in
order.  Meshes and hand-made sockets (an outsider, an impostor listener) over 127.0.0.1.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from dcredit_hvd.liveness import handshake
from dcredit_hvd.liveness import mesh as liveness_mesh
from dcredit_hvd.liveness.mesh import REDIALS, Mesh

SECRET = bytes(range(32))
#: Another job's secret.
OTHER = bytes(32)


class _Node:
    """A mesh on its own listener, and what its callbacks were handed."""

    def __init__(self, rank: int, size: int, secret: bytes = SECRET, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.lines: list[tuple[int, bytes]] = []
        self.closed: list[tuple[int, str]] = []
        listener = socket.create_server((host, port))
        self.port = listener.getsockname()[1]
        self.rank, self.host = rank, host
        self.mesh = Mesh(rank, size, secret, listener,
                         lambda peer, line: self.lines.append((peer.rank, line)),
                         lambda peer, detail: self.closed.append((peer.rank, detail)))

    def entry(self) -> dict:
        return _entry(self.rank, [self.host], self.port)


def _entry(rank: int, addrs: list[str], port: int) -> dict:
    return {"rank": rank, "host": "localhost", "pid": 1000 + rank, "addrs": addrs, "port": port}


def _drive(meshes: list[Mesh], until: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Run the meshes' events until ``until()`` holds (True) or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if until():
            return True
        for mesh in meshes:
            for key, mask in mesh.select(0.005):
                mesh.handle(key, mask)
    return until()


@pytest.fixture
def made():
    """Closes what a test opened: meshes and sockets."""
    things: list = []
    yield things
    for thing in things:
        (thing.mesh if isinstance(thing, _Node) else thing).close()


def _line(sock: socket.socket) -> bytes:
    """One line from a blocking socket (b"" when it closed first)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            return data
        data += chunk
    return data[:-1]


def _outsider(node: _Node, made: list) -> socket.socket:
    """A connection to ``node``, accepted and challenged (its challenge not read yet)."""
    sock = socket.create_connection(("127.0.0.1", node.port), timeout=10.0)
    made.append(sock)
    name = sock.getsockname()
    assert _drive([node.mesh], lambda: name in _waiting(node.mesh))
    return sock


def _waiting(mesh: Mesh) -> set:
    return {conn.getpeername() for conn in mesh.lobby.waiting}


def _say_hello(sock: socket.socket, rank: int, acceptor: int,
               secret: bytes = SECRET) -> handshake.Answer:
    """Answer the challenge on ``sock`` as rank ``rank`` would, knowing ``secret``."""
    answer = handshake.Answer(secret, rank, acceptor)
    hello = answer.hello(handshake.parse(_line(sock), "challenge"))
    assert hello is not None
    sock.sendall(hello)
    return answer


def test_ranks_that_know_the_secret_connect_and_their_lines_are_handed_over(made):
    nodes = [_Node(r, 3) for r in range(3)]
    made.extend(nodes)
    table = [n.entry() for n in nodes]
    for n in nodes:
        n.mesh.start(table)
    meshes = [n.mesh for n in nodes]
    assert _drive(meshes, lambda: all(len(m.connected()) == 2 for m in meshes))
    assert [m.connected() for m in meshes] == [[1, 2], [0, 2], [0, 1]]
    assert all(n.lines == [] for n in nodes)          # the handshake is not handed over
    nodes[0].mesh.send(nodes[0].mesh.peers[2], b"ping\n\n")
    assert _drive(meshes, lambda: len(nodes[2].lines) == 2)
    assert nodes[2].lines == [(0, b"ping"), (0, b"")]
    assert nodes[1].lines == [] and all(n.closed == [] for n in nodes)


def test_a_proved_connection_that_closes_is_handed_over_once_and_forgotten(made):
    nodes = [_Node(r, 2) for r in range(2)]
    made.extend(nodes)
    table = [n.entry() for n in nodes]
    for n in nodes:
        n.mesh.start(table)
    assert _drive([n.mesh for n in nodes], lambda: all(n.mesh.connected() for n in nodes))
    nodes[1].mesh.close()
    assert _drive([nodes[0].mesh], lambda: bool(nodes[0].closed))
    _drive([nodes[0].mesh], lambda: False, seconds=0.2)
    assert nodes[0].closed == [(1, "end of stream")]
    peer = nodes[0].mesh.peers[1]
    assert peer.gone and peer.sock is None and nodes[0].mesh.connected() == []


def test_a_hello_without_the_secret_is_refused_and_logged(made, caplog):
    node = _Node(1, 2)
    made.append(node)
    node.mesh.start([_entry(0, ["127.0.0.1"], 9), node.entry()])      # rank 0 dials here
    sock = _outsider(node, made)
    _say_hello(sock, 0, 1, secret=OTHER)
    assert _drive([node.mesh], lambda: not node.mesh.lobby.waiting)
    assert sock.recv(4096) == b""                                      # closed, no welcome
    assert "did not prove that it knows the job's secret" in caplog.text
    assert node.mesh.connected() == [] and node.lines == []


def test_a_proved_hello_is_let_in_once_and_only_for_a_rank_that_dials_here(made, caplog):
    node = _Node(1, 3)
    made.append(node)
    silent = socket.create_server(("127.0.0.1", 0))        # rank 2's address: never answers
    made.append(silent)
    node.mesh.start([_entry(0, ["127.0.0.1"], 9), node.entry(),
                     _entry(2, ["127.0.0.1"], silent.getsockname()[1])])
    rank0 = _outsider(node, made)
    answer = _say_hello(rank0, 0, 1)
    assert _drive([node.mesh], lambda: node.mesh.connected() == [0])
    assert answer.accepts(handshake.parse(_line(rank0), "welcome"))
    for rank in (0, 2, 7):
        sock = _outsider(node, made)
        _say_hello(sock, rank, 1)
        assert _drive([node.mesh], lambda: not node.mesh.lobby.waiting)
        assert sock.recv(4096) == b"", rank                   # refused, no welcome
    assert "rank 0 is connected already: a second hello for it is never let in" in caplog.text
    assert "names rank 2, which does not connect to rank 1" in caplog.text
    assert "names rank 7" not in caplog.text      # the 2nd refusal of its kind is not logged
    assert node.mesh.connected() == [0]
    rank0.sendall(b"still here\n")
    assert _drive([node.mesh], lambda: node.lines == [(0, b"still here")])


def test_past_the_limit_the_oldest_waiting_connection_is_closed(made, caplog, monkeypatch):
    monkeypatch.setattr(liveness_mesh, "PENDING_SPARE", 2)
    node = _Node(0, 1)
    made.append(node)
    node.mesh.start([node.entry()])
    assert node.mesh.lobby.limit == 3
    socks = [_outsider(node, made) for _ in range(5)]
    assert _waiting(node.mesh) == {s.getsockname() for s in socks[2:]}
    for sock in socks[:2]:
        assert _line(sock).startswith(b"challenge ") and sock.recv(4096) == b""
    assert "too many connections were waiting to prove themselves" in caplog.text
    assert "(1 such so far)" in caplog.text and "(2 such so far)" not in caplog.text


def test_expire_refuses_only_connections_waiting_longer_and_postpone_moves_their_clock(made,
                                                                                       caplog):
    node = _Node(1, 2)
    made.append(node)
    node.mesh.start([_entry(0, ["127.0.0.1"], 9), node.entry()])      # rank 0 dials here
    young = _outsider(node, made)
    node.mesh.postpone(100.0)           # this one's clock moves on: 100 s younger
    old = _outsider(node, made)
    peer = node.mesh.peers[0]
    seen = peer.last_seen
    now = time.monotonic()
    node.mesh.lobby.expire(now + 50.0, 60.0)         # 50 s old: within 60 s
    assert _waiting(node.mesh) == {young.getsockname(), old.getsockname()}
    node.mesh.lobby.expire(now + 50.0, 10.0)
    assert _waiting(node.mesh) == {young.getsockname()}
    assert _line(old).startswith(b"challenge ") and old.recv(4096) == b""
    assert "it sent no hello within 10 s" in caplog.text
    node.mesh.postpone(2.5)
    assert peer.last_seen == seen + 2.5


def test_a_refused_address_is_skipped_and_a_rank_with_none_left_is_unreachable(made, caplog):
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()                      # nothing listens there: the connection is refused
    nodes = [_Node(0, 3), _Node(1, 3, host="127.0.0.2")]
    made.extend(nodes)
    table = [nodes[0].entry(), _entry(1, ["127.0.0.1", "127.0.0.2"], nodes[1].port),
             _entry(2, ["127.0.0.1"], port)]
    for n in nodes:
        n.mesh.start(table)
    peers = nodes[0].mesh.peers
    assert _drive([n.mesh for n in nodes], lambda: nodes[0].mesh.connected() == [1]
                  and peers[2].gone)
    assert "could not connect to rank 2 (host localhost)" in caplog.text
    assert "could not connect to rank 1" not in caplog.text and nodes[0].closed == []


@pytest.mark.parametrize("first, reason", [
    (b'challenge {"nonce": "' + b"00" * handshake.NONCE_BYTES + b'", "rank": 5}\n',
     "its first line was no challenge from rank 1"),
    (b"x" * handshake.MAX_LINE, "it sent a line longer than any handshake"),
])
def test_a_listener_that_is_not_the_rank_is_hung_up_on_and_the_next_address_tried(
        made, caplog, first, reason):
    real = _Node(1, 2, host="127.0.0.2")
    impostor = socket.create_server(("127.0.0.1", real.port))
    impostor.settimeout(10.0)
    dialler = _Node(0, 2)
    made.extend([real, dialler, impostor])
    table = [dialler.entry(), _entry(1, ["127.0.0.1", "127.0.0.2"], real.port)]
    real.mesh.start(table)
    dialler.mesh.start(table)
    conn, _ = impostor.accept()
    made.append(conn)
    conn.sendall(first)
    meshes = [dialler.mesh, real.mesh]
    assert _drive(meshes, lambda: dialler.mesh.connected() == [1])
    assert f"hung up on 127.0.0.1:{real.port}, given as the address of rank 1" in caplog.text
    assert reason in caplog.text and dialler.closed == []


def test_a_listener_that_hangs_up_before_the_handshake_ends_is_dialled_again(made, caplog):
    flaky = socket.create_server(("127.0.0.1", 0))
    flaky.setblocking(False)
    made.append(flaky)
    node = _Node(0, 2)
    made.append(node)
    node.mesh.start([node.entry(), _entry(1, ["127.0.0.1"], flaky.getsockname()[1])])
    accepted = []

    def hang_up() -> bool:
        try:
            conn, _ = flaky.accept()
        except BlockingIOError:
            return node.mesh.peers[1].gone
        accepted.append(conn.getpeername())
        conn.close()
        return False
    assert _drive([node.mesh], hang_up)
    assert len(accepted) == 1 + REDIALS
    assert "could not connect to rank 1" in caplog.text


def test_close_closes_the_waiting_connections_too(made):
    node = _Node(0, 1)
    made.append(node)
    node.mesh.start([node.entry()])
    sock = _outsider(node, made)
    node.mesh.close()
    assert _line(sock).startswith(b"challenge ") and sock.recv(4096) == b""
