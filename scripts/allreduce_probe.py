#!/usr/bin/env python3
"""What one large ``hvd.allreduce`` takes on the virtual cluster, beside what the link needs.

    scripts/vcluster.sh 2 1gbit -- mpirun -np 2 -H h0,h1 [--mca ...] python scripts/allreduce_probe.py

With P hosts, each NIC full duplex at RATE, an all-reduce of N bytes needs at least
2 (P-1)/P x N / RATE (a ring or Rabenseifner: every host sends and receives that much);
recursive doubling needs log2(P) x N / RATE. Rank 0 prints the measured median and both.
With ``--halves`` it also times the two halves of the same all-reduce, ``hvd.reducescatter``
and ``hvd.allgather`` (each needs (P-1)/P x N / RATE on a ring), the collectives the sharded
mode and DeAR send instead.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time


def rate_bytes(rate: str) -> float:
    """tc's bit units ("1gbit", "500mbit") in bytes per second."""
    m = re.fullmatch(r"([0-9.]+)(bit|kbit|mbit|gbit)", rate.lower())
    if not m:
        raise SystemExit(f"allreduce_probe.py: --rate {rate!r}: expected e.g. 1gbit or 500mbit")
    return float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)] / 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=24.0, help="all-reduce size (MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--halves", action="store_true",
                        help="also time reducescatter and allgather of the same bytes")
    parser.add_argument("--rate", default=os.environ.get("VCLUSTER_RATE"),
                        help="link rate (default: $VCLUSTER_RATE, set by scripts/vcluster.sh)")
    args = parser.parse_args()
    if not args.rate:
        raise SystemExit("allreduce_probe.py: no --rate and no VCLUSTER_RATE: run it under "
                         "scripts/vcluster.sh or pass --rate")
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    x = torch.ones(int(args.mib * 2**20) // 4)
    hvd.allreduce(x, name="probe.warm")
    seconds = []
    for i in range(args.repeats):
        t = time.perf_counter()
        hvd.allreduce(x, name=f"probe.{i}")
        seconds.append(time.perf_counter() - t)
    p, nbytes, rate = hvd.size(), x.numel() * 4, rate_bytes(args.rate)
    ring = 2 * (p - 1) / p * nbytes / rate
    doubling = math.log2(p) * nbytes / rate if p & (p - 1) == 0 else float("nan")
    if hvd.rank() == 0:
        median = statistics.median(seconds)
        algorithm = os.environ.get("OMPI_MCA_coll_tuned_allreduce_algorithm", "default")
        print(f"allreduce {args.mib:g} MiB on {p} hosts at {args.rate} (Open MPI algorithm "
              f"{algorithm}, CPU ops {os.environ.get('HOROVOD_CPU_OPERATIONS', 'default')}): "
              f"median {median * 1e3:.0f} ms of {args.repeats} "
              f"(min {min(seconds) * 1e3:.0f}); link needs {ring * 1e3:.0f} ms for ring/"
              f"Rabenseifner ({median / ring:.2f}x), {doubling * 1e3:.0f} ms for recursive "
              f"doubling", flush=True)
    if args.halves:
        halves = {"reducescatter": lambda i: hvd.reducescatter(x, name=f"probe.rs.{i}"),
                  "allgather": lambda i: hvd.allgather(x[:x.numel() // p], name=f"probe.ag.{i}")}
        for what, run in halves.items():
            run("warm")
            took = []
            for i in range(args.repeats):
                t = time.perf_counter()
                run(i)
                took.append(time.perf_counter() - t)
            if hvd.rank() == 0:
                median = statistics.median(took)
                print(f"{what} of {args.mib:g} MiB: median {median * 1e3:.0f} ms of "
                      f"{args.repeats}; link needs {ring / 2 * 1e3:.0f} ms on a ring "
                      f"({median / (ring / 2):.2f}x)", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
