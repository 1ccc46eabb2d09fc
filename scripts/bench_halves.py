#!/usr/bin/env python3
"""The simulator's grid of the two halves: DeAR beside every policy, with and without shards.

    scripts/bench_halves.py                       # the 3 shipped profiles, 4/8/16 hosts, 10/25 Gbit/s
    scripts/bench_halves.py --latency 20us --out docs/halves-grid.md

PREDICTIONS, not measurements (the emulated cluster's measured cells are in
``docs/halves.md``).  The sharded rows are the runtime's schedule: ``step()`` waits for every
reduce-scatter, updates the shards, then all-gathers, during the next forward (``model=``) or
in ``step()``.  Each cell simulates the
shipped profile on the TARGET cluster's ring (``simulator.link_cost``; each half is
``halves.split_cost`` of it: ``(n-1)/n`` of the bytes in ``n-1`` steps of ``--latency``, half the
per-operation overhead), Horovod's 1 ms cycle and 128 MiB
fusion (none for wfbp and dear), every policy but horovod overlapping the next forward.
``dcredit`` is ``best_dcredit`` (partition, planner rule, phase-2 rule, and sharded, the order
of the all-gathers, chosen by simulation).  The optimizer state is Adam's: 8 bytes per float32
parameter, divided by the host count when sharded.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dcredit_hvd.__main__ import parse_time  # noqa: E402
from dcredit_hvd.bench import replay  # noqa: E402
from dcredit_hvd.planning import halves  # noqa: E402
from dcredit_hvd.planning import simulator as sim  # noqa: E402

BASELINES = ("horovod", "wfbp", "bytescheduler", "dear")


def cell(model: str, hosts: int, rate: float, latency: float) -> dict:
    """Every row of one cell, in ms, and the figures the issue's targets read."""
    profile, _ = replay.load(replay.shipped(model))
    cost = sim.link_cost(rate, latency, hosts)
    rs, ag = halves.split_cost(cost)
    ms = {}
    for name in BASELINES:
        ms[name] = sim.simulate(profile, cost, name,
                                overlap_forward=name != "horovod").iteration_s * 1e3
    ms["dcredit"] = sim.best_dcredit(profile, cost, overlap_forward=True).iteration_s * 1e3
    for name in ("wfbp", "bytescheduler"):
        ms[f"{name} sharded"] = sim.simulate(profile, cost, name, overlap_forward=True, shard=True,
                                             workers=hosts).iteration_s * 1e3
    ms["dcredit sharded"] = sim.best_dcredit(profile, cost, overlap_forward=True, shard=True,
                                             workers=hosts).iteration_s * 1e3
    # shard=True without model=: the all-gathers run in step(), before the next forward.
    ms["dcredit sharded in step"] = sim.best_dcredit(profile, cost, overlap_forward=False,
                                                     shard=True, workers=hosts).iteration_s * 1e3
    bound = sim.lower_bound(profile, cost) * 1e3
    bound_halves = halves.lower_bound(profile, rs, ag, hosts, sharded=True) * 1e3
    params = sum(n // e for n, e in zip(profile.nbytes, profile.element_size))
    return {"model": model, "hosts": hosts, "rate": rate, "ms": ms, "bound": bound,
            "bound_halves": bound_halves, "adam_mib": 8 * params / 2**20,
            "compute": (profile.forward_time + profile.backward_time) * 1e3,
            "link": cost.time(profile.total_bytes) * 1e3}


def table(cells: list[dict]) -> str:
    rows = ["| model | hosts | Gbit/s | compute / link ms | bound (AR / halves) | horovod | wfbp | "
            "bytescheduler | dear | dcredit | wfbp sh. | bytescheduler sh. | dcredit sh. | "
            "dcredit sh. in step() (no model=) | "
            "dcredit over dear | dcredit over best baseline | dcredit sh. / dcredit | Adam state "
            "per rank MiB (sharded) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        ms = c["ms"]
        best = min(ms[b] for b in BASELINES)
        cols = " | ".join(f"{ms[k]:.0f} ({ms[k] / _bound_of(c, k):.2f}x)"
                          for k in ("horovod", "wfbp", "bytescheduler", "dear", "dcredit",
                                    "wfbp sharded", "bytescheduler sharded", "dcredit sharded",
                                    "dcredit sharded in step"))
        rows.append(f"| {c['model']} | {c['hosts']} | {c['rate'] / 1e9:g} | {c['compute']:.0f} / "
                    f"{c['link']:.0f} | {c['bound']:.0f} / {c['bound_halves']:.0f} | {cols} | "
                    f"{ms['dear'] / ms['dcredit']:.2f}x | {best / ms['dcredit']:.2f}x | "
                    f"{ms['dcredit sharded'] / ms['dcredit']:.3f} | {c['adam_mib']:.0f} "
                    f"({c['adam_mib'] / c['hosts']:.0f}) |")
    return "\n".join(rows) + "\n"


def _bound_of(c: dict, row: str) -> float:
    """The bound a row is measured against: the halves' for dear and the sharded rows."""
    return c["bound_halves"] if "sharded" in row or row == "dear" else c["bound"]


def targets(cells: list[dict]) -> str:
    """The issue's targets, cell by cell: dcredit >= 1.1x dear where communication is about
    equal to compute (link within 0.7-1.5x of compute), sharded within 5% of unsharded."""
    lines = []
    for c in cells:
        ms = c["ms"]
        balanced = 0.7 <= c["link"] / c["compute"] <= 1.5
        over_dear = ms["dear"] / ms["dcredit"]
        shard = ms["dcredit sharded"] / ms["dcredit"]
        in_step = ms["dcredit sharded in step"] / ms["dcredit"]
        lines.append(f"- {c['model']} {c['hosts']} hosts {c['rate'] / 1e9:g} Gbit/s: "
                     f"link/compute {c['link'] / c['compute']:.2f}"
                     + (f", dcredit over dear {over_dear:.2f}x "
                        f"({'met' if over_dear >= 1.1 else 'MISSED'} >= 1.1x)" if balanced else "")
                     + f", sharded/unsharded {shard:.3f} ({'met' if shard <= 1.05 else 'MISSED'} <= 1.05)"
                     + f"; without model= (all-gathers in step()) {in_step:.3f} "
                       f"({'met' if in_step <= 1.05 else 'MISSED'})")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet50,vgg16,gpt2_small")
    parser.add_argument("--hosts", default="4,8,16")
    parser.add_argument("--targets", default="10,25", help="Gbit/s, comma-separated")
    parser.add_argument("--latency", type=parse_time, default=0.0,
                        help="per ring step (default 0: the bytes only; try 20us for TCP)")
    parser.add_argument("--out", type=Path, help="also write the Markdown here")
    args = parser.parse_args()
    cells = [cell(m, int(h), float(t) * 1e9, args.latency)
             for m in args.models.split(",") for h in args.hosts.split(",")
             for t in args.targets.split(",")]
    text = (f"Simulated, latency {args.latency * 1e6:g} us per ring step; ms per iteration "
            f"(x its bound: all-reduce's for unsharded rows, the halves' for dear and sharded)\n\n"
            + table(cells) + "\nTargets:\n\n" + targets(cells))
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
