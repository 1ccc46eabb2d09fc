#!/usr/bin/env python3
"""What one all-reduce's startup costs on the virtual cluster, in the three ways a scheduler
issues all-reduces, so that the cost model can be checked against each:

* ``chain``: submit, poll until done, submit the next (how ``measure_cost_model`` times the link,
  and how a window that waits for the previous one's completion runs);
* ``isolated``: the same with an idle gap of a random 0-2 Horovod cycles before each (the same
  gap on every rank), so the link and Horovod's loop are idle when it arrives;
* ``burst``: ``--burst`` all-reduces submitted at once with ``HOROVOD_FUSION_THRESHOLD`` equal to
  their size, so one Horovod cycle runs them back to back as separate operations.

    scripts/vcluster.sh --mtu 9000 --no-slow-start-after-idle 8 100mbit -- horovodrun -np 8 \\
        -H h0:1,...,h7:1 --gloo python scripts/startup_probe.py --cycle-ms 8.33 --poll-ms 4.17

Rank 0 prints, per mode and size, the median seconds per all-reduce and what the link needs
for a ring (2 (P-1)/P x bytes / rate); the difference is the per-operation cost that mode sees.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4096,65536,333333,1333333,4000000",
                   help="bytes per all-reduce, comma-separated")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--burst", type=int, default=6)
    p.add_argument("--cycle-ms", type=float, default=1.0, help="HOROVOD_CYCLE_TIME to set")
    p.add_argument("--poll-ms", type=float, default=0.5, help="poll interval while waiting")
    p.add_argument("--rate", default=os.environ.get("VCLUSTER_RATE"))
    args = p.parse_args()
    if not args.rate:
        raise SystemExit("startup_probe.py: no --rate and no VCLUSTER_RATE: run it under "
                         "scripts/vcluster.sh")
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ["HOROVOD_CYCLE_TIME"] = str(args.cycle_ms)
    os.environ["HOROVOD_FUSION_THRESHOLD"] = str(min(sizes))   # every size is alone in a buffer
    import horovod.torch as hvd
    import torch

    from dcredit_hvd.bench.replay import parse_rate
    from dcredit_hvd.transports.horovod import wait

    hvd.init()
    torch.set_num_threads(1)
    poll = args.poll_ms / 1e3
    rng = random.Random(7)
    rows = []
    for size in sizes:
        x = [torch.zeros(size // 4) for _ in range(args.burst)]
        wait(hvd.allreduce_async_(x[0], name=f"warm.{size}"), poll)
        chain, isolated, burst = [], [], []
        for i in range(args.reps):
            t = time.perf_counter()
            wait(hvd.allreduce_async_(x[0], name=f"chain.{size}.{i}"), poll)
            chain.append(time.perf_counter() - t)
        for i in range(args.reps):
            time.sleep(rng.uniform(0, 2) * args.cycle_ms / 1e3)
            t = time.perf_counter()
            wait(hvd.allreduce_async_(x[0], name=f"iso.{size}.{i}"), poll)
            isolated.append(time.perf_counter() - t)
        for i in range(max(2, args.reps // 2)):
            t = time.perf_counter()
            handles = [hvd.allreduce_async_(g, name=f"burst.{size}.{i}.{j}")
                       for j, g in enumerate(x)]
            for h in handles:
                wait(h, poll)
            burst.append((time.perf_counter() - t) / args.burst)
        need = 2 * (hvd.size() - 1) / hvd.size() * size * 8 / parse_rate(args.rate)
        rows.append((size, need, statistics.median(chain), statistics.median(isolated),
                     statistics.median(burst)))
    if hvd.rank() == 0:
        print(f"{hvd.size()} hosts at {args.rate}, cycle {args.cycle_ms} ms, poll {args.poll_ms} ms;"
              f" wall ms per all-reduce (median), and over the link's need:")
        print(f"bytes | link needs | chain | isolated | burst of {args.burst}")
        for size, need, c, i, b in rows:
            print(f"{size} | {need * 1e3:.1f} | {c * 1e3:.1f} (+{(c - need) * 1e3:.1f}) | "
                  f"{i * 1e3:.1f} (+{(i - need) * 1e3:.1f}) | {b * 1e3:.1f} (+{(b - need) * 1e3:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
