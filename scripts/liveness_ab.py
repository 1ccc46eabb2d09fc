"""A/B: iteration time with the liveness channel (``dcredit_hvd/liveness/heartbeat.py``) on and off.

    mpirun -np 2 python scripts/liveness_ab.py --rounds 10 --steps 200
    horovodrun -np 2 -H localhost:2 --gloo python scripts/liveness_ab.py

One launch, alternating rounds (on, off, on, off, ...) of ``--steps`` timed iterations of the
same training, so that drift in the machine's load falls on both sides alike; the figure is the
median over adjacent (on, off) pairs of their ratio.  Because iteration times on a shared
machine are noisy, it also reads the channel thread's own CPU time (``/proc``'s ``schedstat``,
nanoseconds): what the channel takes from the training, free of that noise.  Between rounds
the channel is closed or started again (``comm.watch_peers``: an address all-gather); the
optimizer itself is built with ``DCREDIT_LIVENESS=0`` so that only this script decides.  Rank 0
prints each round's mean iteration time, then both medians and their difference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["DCREDIT_LIVENESS"] = "0"      # the optimizer's own channel: off (see above)

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dcredit_hvd  # noqa: E402
from dcredit_hvd.liveness import heartbeat as liveness  # noqa: E402
from dcredit_hvd.transports import horovod as comm  # noqa: E402


def _thread_cpu_ns(native_id: int) -> int:
    """CPU time a thread of this process has used, in ns (0 where /proc lacks schedstat)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds, half of them with it on")
    parser.add_argument("--steps", type=int, default=200, help="timed iterations per round")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat seconds")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    opt = dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
        model=model, policy="bytescheduler")
    gen = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen)

    def train(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        opt.apply_pending_updates()
        return (time.perf_counter() - started) / steps

    train(args.warmup)
    config = liveness.Settings(interval=args.interval, timeout=max(10.0, 2 * args.interval))
    times: dict[bool, list[float]] = {True: [], False: []}
    thread_cpu_ns, on_seconds = 0, 0.0
    for round_ in range(args.rounds):
        on = round_ % 2 == 0
        lease = comm.watch_peers(config=config) if on else None
        channel = None if lease is None else lease.channel
        if on:
            assert channel is not None and channel.wait_connected(10.0), "channel not up"
        started = time.perf_counter()
        mean = train(args.steps)
        times[on].append(mean)
        if channel is not None:
            on_seconds += time.perf_counter() - started
            thread_cpu_ns += _thread_cpu_ns(channel._thread.native_id)
            lease.release()            # the last lease: a goodbye, then the channel ends
            hvd.allreduce(torch.zeros(1), name=f"ab.barrier.{round_}")
        if hvd.rank() == 0:
            print(f"round {round_}: liveness {'on ' if on else 'off'} {mean * 1e3:.3f} ms/iter",
                  flush=True)
    if hvd.rank() == 0:
        on_ms = statistics.median(times[True]) * 1e3
        off_ms = statistics.median(times[False]) * 1e3
        spread = statistics.pstdev(times[False]) / statistics.mean(times[False]) * 100
        ratios = [a / b for a, b in zip(times[True], times[False])]
        print(f"median ms/iter: on {on_ms:.3f}, off {off_ms:.3f}; median on/off ratio of "
              f"adjacent rounds {statistics.median(ratios):.4f} (spread of the off rounds: "
              f"{spread:.1f} %; {hvd.size()} ranks, heartbeat every {args.interval:g} s)",
              flush=True)
        print(f"liveness thread CPU on rank 0: {thread_cpu_ns / 1e6:.2f} ms in {on_seconds:.1f} s "
              f"of training = {thread_cpu_ns / 1e9 / on_seconds * 100:.4f} % of one core",
              flush=True)
    opt.apply_pending_updates()


if __name__ == "__main__":
    main()
