"""Print how long ``planner.plan`` takes for a 1,000-tensor model (target: under 50 ms on one core).

Usage: ``python scripts/bench_planner.py [--tensors 1000] [--repeat 20]``.  Timing is reported
here rather than asserted in a test: a shared CI machine makes timing asserts flaky.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.planner import plan
from dcredit_hvd.planning.profile import Profile


def synthetic_profile(tensors: int, seed: int = 0) -> Profile:
    """Weights (log-uniform 3e3..4e6 elements) alternating with small biases, float32."""
    rng = random.Random(seed)
    nbytes = []
    for l in range(tensors):
        numel = rng.randint(64, 4096) if l % 2 else int(10 ** rng.uniform(3.5, 6.6))
        nbytes.append(4 * numel)
    t_b = [2e-6 * n / 4e3 + 1e-5 for n in nbytes]
    t_f = [t / 2 for t in t_b]
    return Profile.from_lists([f"p{l}" for l in range(tensors)], nbytes, [4] * tensors, t_f, t_b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    prof = synthetic_profile(args.tensors)
    cost = CostModel(a=1e-3, b=1e-9)   # ~1 GB/s all-reduce, 1 ms startup
    print(f"{args.tensors} tensors, {prof.total_bytes / 1e6:.1f} MB of gradients, "
          f"backward {prof.backward_time * 1e3:.1f} ms")
    for partition in (64 * 1024, 1 << 20, 4_000_000, 16 << 20):
        samples = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = plan(prof, cost, partition)
            samples.append(time.perf_counter() - start)
        print(f"S_p={partition:>10} B: {result.total_blocks:>6} blocks, plan time "
              f"median {statistics.median(samples) * 1e3:.2f} ms, max {max(samples) * 1e3:.2f} ms; "
              f"{sum(result.phase1_windows)} blocks in phase 1")


if __name__ == "__main__":
    main()
