#!/usr/bin/env python3
"""What the scheduler itself costs: microseconds per block and per iteration, beside Horovod's.

One rank, no network (issue 13's microbenchmark): a chain of ``N`` small linear layers (one
1 KiB weight each, so ``N`` gradients) trained with SGD; for N = 10, 100 and 1,000, one after
another in this process, compute alone (the plain optimizer), then ``hvd.DistributedOptimizer``
and dcredit_hvd's policies.  What each adds over compute alone is pure scheduling cost: hooks,
queue, gate, submission, Horovod's own cycle, completions and (with ``model=``) the overlapped
update calls.  Figures are medians over several repetitions; the machine is shared, so read the
ratios, not single digits.

At one rank both Horovod and dcredit_hvd pass every gradient through untouched (no hooks: there
is nothing to send), so this script sets ``HOROVOD_ELASTIC=1`` before importing Horovod; that is
Horovod's own switch that makes both register their hooks and all-reduce at size 1, as they do
at size > 1.  Run:

    .venv/bin/python scripts/bench_overhead.py [--tensors 10,100,1000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HOROVOD_ELASTIC", "1")
os.environ.setdefault("DCREDIT_LOG_LEVEL", "WARNING")

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import dcredit_hvd  # noqa: E402

#: label -> (policy or None for the baselines, with model=, extra keywords)
CASES = {
    "compute": (None, False, {}),
    "horovod": (None, False, {}),
    "wfbp": ("wfbp", False, {}),
    "dcredit-sync": ("dcredit", False, {}),
    "dcredit-sync ungrouped": ("dcredit", False, {"group_bytes": 0}),
    "dcredit": ("dcredit", True, {}),
    "dcredit ungrouped": ("dcredit", True, {"group_bytes": 0}),
}


def build(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(n)])


def measure(label: str, n: int, iters: int, reps: int) -> dict:
    policy, with_model, extra = CASES[label]
    model = build(n)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if label == "horovod":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    elif policy is not None:
        opt = dcredit_hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), policy=policy,
            model=model if with_model else None, **extra)
    x = torch.randn(4, 16)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    planned = time.perf_counter()
    for _ in range(8):                        # dcredit profiles 5 iterations, then plans
        step()
    planned = time.perf_counter() - planned
    seconds = []
    for _ in range(reps):
        started = time.perf_counter()
        for _ in range(iters):
            step()
        seconds.append((time.perf_counter() - started) / iters)
    if hasattr(opt, "apply_pending_updates"):
        opt.apply_pending_updates()
    layouts = getattr(opt, "layouts", None)
    blocks = sum(len(u.blocks) for u in layouts) if layouts else n
    return {"label": label, "tensors": n, "seconds": statistics.median(seconds),
            "blocks": blocks, "units": len(layouts) if layouts else n,
            "warmup_s": planned}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", default="10,100,1000")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    rows = []
    for n in (int(t) for t in args.tensors.split(",")):
        iters = max(5, 2000 // n)
        base = None
        for label in CASES:
            row = measure(label, n, iters, args.reps)
            if label == "compute":
                base = row["seconds"]
            row["overhead_s"] = row["seconds"] - base
            rows.append(row)
            print(f"N={n:5d} {label:24s} {row['seconds'] * 1e3:8.3f} ms/iter  "
                  f"+{row['overhead_s'] * 1e3:7.3f} ms over compute "
                  f"({100 * row['overhead_s'] / base:+6.1f}%)  "
                  f"{row['units']:5d} units {row['blocks']:5d} blocks  "
                  + (f"{row['overhead_s'] / row['blocks'] * 1e6:6.1f} us/block  "
                     f"{row['overhead_s'] / n * 1e6:6.1f} us/tensor" if label != "compute"
                     else ""), flush=True)
    print("\n| tensors | policy | ms / iteration | over compute | units | blocks "
          "| us per block | us per tensor |\n|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["label"] == "compute":
            print(f"| {r['tensors']} | compute alone | {r['seconds'] * 1e3:.3f} | - | - | - | - | - |")
            continue
        print(f"| {r['tensors']} | {r['label']} | {r['seconds'] * 1e3:.3f} | "
              f"+{r['overhead_s'] * 1e3:.3f} ms | {r['units']} | {r['blocks']} | "
              f"{r['overhead_s'] / r['blocks'] * 1e6:.1f} | {r['overhead_s'] / r['tensors'] * 1e6:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
