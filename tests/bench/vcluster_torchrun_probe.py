"""Run by ``tests/bench/test_vcluster.py`` on each host of ``scripts/vcluster.sh`` under
``scripts/torchrun_cluster.sh`` (2 ranks, one ``torchrun`` per host): prints one JSON line per
rank saying where the rank runs, which interfaces a Gloo all-reduce went through, and whether a
``dcredit_hvd`` optimizer on ``transport="torch.distributed"`` trained both ranks to the same
parameters as one process training on both ranks' batches (the mean gradient, as DDP).

Every rank builds the same model (seed 0) and trains it on its own batch (seed 100 + rank); the
reference is the same model trained here on both batches at once, so a gradient that was not
averaged, or averaged with the wrong peer, shows as a difference from it.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vcluster_probe import counters  # noqa: E402  (the same interface counters)

import dcredit_hvd  # noqa: E402

ALLREDUCE_BYTES = 8 << 20
STEPS = 5                   # profiling (1 + 2), then planned steps under the dcredit policy
BATCH = 8


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(BATCH, 8, generator=generator),
            torch.randn(BATCH, 4, generator=generator))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_distributed(rank: int) -> tuple[torch.Tensor, str]:
    """STEPS steps of the dcredit policy over torch.distributed, with model= (overlap)."""
    model = build()
    opt = dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), model=model, transport="torch.distributed",
        policy="dcredit", profile_warmup=1, profile_steps=2)
    x, y = batch(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.apply_pending_updates()
    return flat(model), type(opt._state.transport).__name__


def train_reference(size: int) -> torch.Tensor:
    """The same steps in one process on every rank's batch: the mean of their gradients."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [batch(r) for r in range(size)]
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches) / size
        loss.backward()
        opt.step()
    return flat(model)


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "hostname": socket.gethostname(),
           "netns": os.readlink("/proc/self/ns/net"),
           "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    before = counters()
    dist.all_reduce(torch.ones(ALLREDUCE_BYTES // 4))
    after = counters()
    out.update({k: after[k] - before[k] for k in after}, allreduce_bytes=ALLREDUCE_BYTES)
    params, transport = train_distributed(rank)
    everyone = [torch.zeros_like(params) for _ in range(size)]
    dist.all_gather(everyone, params)
    reference = train_reference(size)
    out.update(transport=transport,
               max_diff_ranks=max(float((p - params).abs().max()) for p in everyone),
               max_diff_reference=float((params - reference).abs().max()),
               moved=float((params - flat(build())).abs().max()))
    print("PROBE " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
