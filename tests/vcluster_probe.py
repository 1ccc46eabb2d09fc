"""Run by ``tests/test_vcluster.py`` on each host of ``scripts/vcluster.sh`` (2 ranks, launched
by ``mpirun`` or ``horovodrun``): prints one JSON line per rank saying where the rank runs and,
with ``--bytes``, how fast raw TCP moved data between the two hosts in BOTH directions at once and
which interface counters grew.

Rank 0 listens, rank 1 connects to host ``--server``; both then send ``--bytes`` and receive as
many at the same time. A direction's rate is measured at its receiver, from the first byte to the
last, so connection set-up is excluded.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import threading
import time

PORT = 47001


def rank() -> int:
    for key in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    raise SystemExit("vcluster_probe.py: no OMPI_COMM_WORLD_RANK or HOROVOD_RANK: launch it "
                     "with mpirun or horovodrun")


def counters() -> dict[str, int]:
    """Bytes sent by this host's tbf on eth0 and through its loopback."""
    qdisc = json.loads(subprocess.run(["tc", "-s", "-j", "qdisc", "show", "dev", "eth0"],
                                      check=True, capture_output=True, text=True).stdout)
    tbf = next(q for q in qdisc if q["kind"] == "tbf")
    with open("/sys/class/net/lo/statistics/tx_bytes") as fh:
        lo = int(fh.read())
    return {"tbf_bytes": int(tbf["bytes"]), "tbf_drops": int(tbf["drops"]), "lo_bytes": lo}


def connect(server: str) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection((server, PORT), timeout=30)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def duplex(sock: socket.socket, nbytes: int) -> float:
    """Sends nbytes while receiving nbytes; returns the receive rate in bit/s."""
    chunk = b"\0" * (1 << 20)

    def send() -> None:
        left = nbytes
        while left > 0:
            left -= sock.send(chunk[:min(left, len(chunk))])
    sender = threading.Thread(target=send)
    sender.start()
    got, first, first_n, buf = 0, 0.0, 0, bytearray(1 << 20)
    while got < nbytes:
        n = sock.recv_into(buf)
        if n == 0:
            raise RuntimeError("peer closed early")
        if got == 0:                        # the clock starts at the first byte received
            first, first_n = time.perf_counter(), n
        got += n
    last = time.perf_counter()
    sender.join()
    return 8 * (got - first_n) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=0)
    parser.add_argument("--server", default="h0")
    args = parser.parse_args()
    r = rank()
    out = {"rank": r, "hostname": socket.gethostname(), "netns": os.readlink("/proc/self/ns/net")}
    if args.bytes:
        before = counters()
        if r == 0:
            with socket.create_server(("", PORT)) as listener:
                sock, _ = listener.accept()
        else:
            sock = connect(args.server)
        with sock:
            sock.sendall(b"s")                      # both ends up before the clock starts
            assert sock.recv(1) == b"s"
            out["recv_bit_s"] = duplex(sock, args.bytes)
            sock.sendall(b"e")
            sock.recv(1)
        after = counters()
        out.update({k: after[k] - before[k] for k in after})
        out["bytes"] = args.bytes
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
