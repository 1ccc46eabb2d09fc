"""Soak: many iterations of a small model; memory, pending handles and names must not grow, and
the parameters must still equal plain Horovod's.

    mpirun -np 2 python scripts/soak.py --steps 2000            # the long version
    horovodrun -np 2 -H localhost:2 --gloo python scripts/soak.py --steps 2000

Each iteration trains two copies of the same model on the same batch, one with
``hvd.DistributedOptimizer`` and one with ``dcredit_hvd.DistributedOptimizer(model=...)``.  After
``--warmup`` iterations (time for ``dcredit`` to profile and plan and for the allocator to settle)
the figures are taken, and again at the end.  Rank 0 prints them; the exit status is 1 when a
limit is broken.  ``tests/multirank/test_reliability.py`` imports ``run_soak`` for a short version.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from dataclasses import asdict, dataclass

import horovod.torch as hvd
import horovod.torch.mpi_ops as mpi_ops
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcredit_hvd
from dcredit_hvd.transports import horovod as comm

#: Limits (the issue's): resident memory growth after warm-up, growth of pending handles/names.
RSS_GROWTH_LIMIT_PCT = 5.0


class SoakNet(nn.Module):
    """Convolution + linear layers, one frozen parameter, tensors of several blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.frozen = nn.Linear(8 * 8 * 8, 48)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        return self.head(F.relu(self.frozen(x.flatten(1))))


@dataclass
class SoakReport:
    steps: int
    warmup: int
    policy: str
    rss_warm_mib: float
    rss_end_mib: float
    rss_growth_pct: float
    #: Horovod handles not yet synchronized (``horovod.torch.mpi_ops._handle_map``).
    handles_warm: int
    handles_end: int
    #: Collectives whose tensors dcredit_hvd still references for Horovod (``comm``).
    held_warm: int
    held_end: int
    #: Blocks queued or in flight in the scheduler, and updates still owed, between iterations.
    outstanding_end: int
    owed_end: int
    #: Distinct block names handed to Horovod so far.
    names_warm: int
    names_end: int
    max_abs_diff: float
    seconds_per_step: float

    @property
    def parity(self) -> bool:
        return self.max_abs_diff <= 1e-5

    def failures(self, rss_limit_pct: float = RSS_GROWTH_LIMIT_PCT) -> list[str]:
        out = []
        if self.rss_growth_pct >= rss_limit_pct:
            out.append(f"resident memory grew {self.rss_growth_pct:.2f}% (limit {rss_limit_pct}%)")
        if self.handles_end > self.handles_warm:
            out.append(f"pending Horovod handles grew {self.handles_warm} -> {self.handles_end}")
        if self.held_end > self.held_warm:
            out.append(f"tensors held for Horovod grew {self.held_warm} -> {self.held_end}")
        if self.names_end > self.names_warm:
            out.append(f"distinct block names grew {self.names_warm} -> {self.names_end}")
        if self.outstanding_end or self.owed_end:
            out.append(f"{self.outstanding_end} blocks outstanding, {self.owed_end} updates owed "
                       "between iterations")
        if not self.parity:
            out.append(f"parameters differ from plain Horovod by {self.max_abs_diff:.3g}")
        return out


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _settled_rss() -> float:
    gc.collect()
    return rss_mib()


def run_soak(steps: int = 2000, warmup: int = 200, policy: str = "dcredit",
             prefix: str = "soak", **scheduler: object) -> SoakReport:
    """Train ``steps`` iterations (needs ``hvd.init()`` and 2+ ranks); figures after ``warmup``,
    which must cover dcredit's race (``scheduler``: more ``DistributedOptimizer`` keywords)."""
    import time

    torch.manual_seed(3)
    ours_model = SoakNet()
    torch.manual_seed(3)
    ref_model = SoakNet()
    ref = hvd.DistributedOptimizer(
        torch.optim.SGD(ref_model.parameters(), lr=0.02, momentum=0.9),
        named_parameters=[(f"{prefix}.ref.{n}", p) for n, p in ref_model.named_parameters()])
    opt = dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(ours_model.parameters(), lr=0.02, momentum=0.9),
        named_parameters=[(f"{prefix}.{n}", p) for n, p in ours_model.named_parameters()],
        model=ours_model, policy=policy, partition_bytes=1024 if policy != "dcredit" else None,
        profile_warmup=1, profile_steps=2, **scheduler)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    names: set[str] = set()
    warm = None
    started = time.perf_counter()
    for step in range(steps):
        x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        for model, optimizer in ((ref_model, ref), (ours_model, opt)):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        names.update(opt.last_submission_order)
        if step + 1 == warmup:
            opt.apply_pending_updates()
            warm = (_settled_rss(), len(mpi_ops._handle_map), len(names), comm.held_references())
    seconds = (time.perf_counter() - started) / max(steps, 1)
    opt.apply_pending_updates()
    names.update(opt.last_submission_order)
    if warm is None:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup})")
    rss_end = _settled_rss()
    diff = max(float((a - b).abs().max()) for a, b in
               zip(ours_model.state_dict().values(), ref_model.state_dict().values()))
    report = SoakReport(
        steps=steps, warmup=warmup, policy=policy, rss_warm_mib=warm[0], rss_end_mib=rss_end,
        rss_growth_pct=100.0 * (rss_end - warm[0]) / warm[0], handles_warm=warm[1],
        handles_end=len(mpi_ops._handle_map), held_warm=warm[3],
        held_end=comm.held_references(), outstanding_end=opt._scheduler.outstanding,
        owed_end=opt._updater.owed, names_warm=warm[2], names_end=len(names),
        max_abs_diff=diff, seconds_per_step=seconds)
    opt._scheduler.close()
    return report


def main(argv: list[str] | None = None) -> int:
    from dcredit_hvd.bench.report import describe_lines
    from dcredit_hvd.policies import DESCRIBE, POLICIES

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--policy names:\n" + describe_lines({name: DESCRIBE[name] for name in POLICIES}))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--policy", default="dcredit", help="the policy soaked, listed below "
                        "(default dcredit)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    report = run_soak(args.steps, args.warmup, args.policy)
    problems = report.failures()
    verdicts = hvd.allgather_object((hvd.rank(), problems))
    if hvd.rank() == 0:
        if args.json:
            print(json.dumps({**asdict(report), "parity": report.parity}, indent=1))
        else:
            print(f"soak: {report.steps} steps ({report.warmup} warm-up), policy {report.policy}, "
                  f"{report.seconds_per_step * 1e3:.1f} ms/step (both models)")
            print(f"  resident memory  {report.rss_warm_mib:.1f} MiB -> {report.rss_end_mib:.1f} MiB "
                  f"({report.rss_growth_pct:+.2f}%, limit {RSS_GROWTH_LIMIT_PCT}%)")
            print(f"  pending handles  {report.handles_warm} -> {report.handles_end}")
            print(f"  block names      {report.names_warm} -> {report.names_end}")
            print(f"  tensors held     {report.held_warm} -> {report.held_end}")
            print(f"  between iterations: {report.outstanding_end} blocks outstanding, "
                  f"{report.owed_end} updates owed")
            print(f"  parity with plain Horovod: max |diff| {report.max_abs_diff:.3g} "
                  f"({'ok' if report.parity else 'DIFFERENT'})")
        for rank, rank_problems in verdicts:
            for problem in rank_problems:
                print(f"  FAIL rank {rank}: {problem}")
    return 1 if any(p for _, p in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
