"""Run by ``tests/bench/test_vcluster.py`` on each host of ``scripts/vcluster.sh`` (2 ranks, launched
by ``mpirun`` or ``horovodrun``): prints one JSON line per rank saying where the rank runs and,
with ``--bytes``, how fast raw TCP moved data between the two hosts in BOTH directions at once and
which interface counters grew.

Rank 0 listens, rank 1 connects to host ``--server``; both then send ``--bytes`` and receive as
many at the same time. A direction's rate is measured at its receiver, from the first byte to the
last, so connection set-up is excluded.

With ``--phases TAIL`` (under ``--rate-schedule``) both send and receive instead until TAIL
seconds after the last scheduled change, and each receiver reports its rate in every phase of
``$VCLUSTER_RATE_LOG``, between the applied switches (less a settling margin, as a switch lands
between two packets of a queue filled at the old rate); rank 0 also reads every tbf of the
cluster in the middle of each phase and at the end (its drops).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import threading
import time
from bisect import bisect_left

PORT = 47001
SETTLE_S, MARGIN_S = 0.3, 0.1   # skipped after a switch and before the next


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


def pair(r: int, server: str) -> socket.socket:
    """The connection between the two ranks, once both ends are up (before any clock starts)."""
    if r == 0:
        with socket.create_server(("", PORT)) as listener:
            sock, _ = listener.accept()
    else:
        sock = connect(server)
    sock.sendall(b"s")
    assert sock.recv(1) == b"s"
    return sock


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


def rate_log() -> list[dict]:
    """The rates in force so far, from scripts/vcluster.sh's log: the start, then each change."""
    with open(os.environ["VCLUSTER_RATE_LOG"]) as fh:
        rows = [line.split() for line in fh if line.strip() and not line.startswith("#")]
    return [{"epoch": float(e), "rate": r, "at": float(a), "took": float(t)} for e, r, a, t in rows]


def tbfs() -> dict[str, dict]:
    """Every tbf of the cluster ("namespace/dev" -> rate in bit/s, bucket, lat, drops)."""
    prefix, n = os.environ["VCLUSTER_NAMESPACE_PREFIX"], int(os.environ["VCLUSTER_N"])
    found = {}
    for ns in [f"{prefix}h{i}" for i in range(n)] + [f"{prefix}sw"]:
        qdiscs = json.loads(subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"], check=True,
                                           capture_output=True, text=True).stdout)
        for q in qdiscs:
            if q["kind"] == "tbf":
                opt = q["options"]
                found[f"{ns}/{q['dev']}"] = {"rate_bit_s": 8 * opt["rate"], "burst": opt["burst"],
                                             "lat_us": opt["lat"], "drops": q["drops"]}
    return found


def timed_duplex(sock: socket.socket, until: float) -> tuple[list[float], list[int]]:
    """Sends and receives until time.time() reaches until (then the peer's rest); returns the
    receive clock and the bytes received by then, at every recv."""
    chunk = b"\0" * (1 << 20)

    def send() -> None:
        while time.time() < until:
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
    sender = threading.Thread(target=send)
    sender.start()
    stamps, totals, got, buf = [], [], 0, bytearray(1 << 20)
    while True:
        n = sock.recv_into(buf)
        if n == 0:
            break
        got += n
        stamps.append(time.time())
        totals.append(got)
    sender.join()
    return stamps, totals


def phase_rates(stamps: list[float], totals: list[int], log: list[dict], end: float) -> list[dict]:
    """The receive rate in each phase of the log, between its applied switches."""
    def received_by(t: float) -> float:
        i = bisect_left(stamps, t)
        if i == 0 or i == len(stamps):
            raise RuntimeError(f"no data received around {t}: the probe ran outside the phases")
        t0, t1, b0, b1 = stamps[i - 1], stamps[i], totals[i - 1], totals[i]
        return b0 + (b1 - b0) * (t - t0) / (t1 - t0)
    phases = []
    for k, row in enumerate(log):
        nxt = log[k + 1]["epoch"] - log[k + 1]["took"] if k + 1 < len(log) else end
        lo, hi = max(row["epoch"], stamps[0]) + SETTLE_S, nxt - MARGIN_S
        phases.append({"rate": row["rate"], "at": row["at"], "window_s": hi - lo,
                       "recv_bit_s": 8 * (received_by(hi) - received_by(lo)) / (hi - lo)})
    return phases


def phases(sock: socket.socket, r: int, tail: float) -> dict:
    schedule = [(entry.split("@")[0], float(entry.split("@")[1]))
                for entry in os.environ["VCLUSTER_RATE_SCHEDULE"].split(",")]
    t0 = rate_log()[0]["epoch"]
    end = t0 + schedule[-1][1] + tail
    snapshots: list[dict] = []
    if r == 0:                              # every tbf mid-phase, beside the traffic
        def snap() -> None:
            bounds = [t0 + at for _, at in schedule] + [end]
            for k in range(len(schedule)):
                time.sleep(max(0.0, (bounds[k] + bounds[k + 1]) / 2 - time.time()))
                snapshots.append({"rate": schedule[k][0], "tbf": tbfs()})
        snapper = threading.Thread(target=snap)
        snapper.start()
    stamps, totals = timed_duplex(sock, end)
    out = {"phases": phase_rates(stamps, totals, rate_log(), end)}
    if r == 0:
        snapper.join()
        out.update(snapshots=snapshots, final_tbf=tbfs(), log=rate_log())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=0)
    parser.add_argument("--server", default="h0")
    parser.add_argument("--phases", type=float, default=0.0, metavar="TAIL")
    args = parser.parse_args()
    r = rank()
    out = {"rank": r, "hostname": socket.gethostname(), "netns": os.readlink("/proc/self/ns/net")}
    if args.phases:
        with pair(r, args.server) as sock:
            out.update(phases(sock, r, args.phases))
    if args.bytes:
        before = counters()
        with pair(r, args.server) as sock:
            out["recv_bit_s"] = duplex(sock, args.bytes)
            sock.sendall(b"e")
            sock.recv(1)
        after = counters()
        out.update({k: after[k] - before[k] for k in after})
        out["bytes"] = args.bytes
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
