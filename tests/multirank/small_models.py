"""The small model and training loop of the multi-rank suites, without Horovod.

``models.py`` (Horovod: ``mpirun`` / ``horovodrun``) and ``tests/torchrun`` (torch.distributed)
both build on this module, so both launchers train the same network on the same batches; each
passes its own rank, the one thing the library knows.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

#: What the parity suites (``test_parity.py``, ``tests/torchrun/test_ddp_parity.py``) train
#: SmallNet under, the same for both launchers.
POLICIES = ["wfbp", "bytescheduler", "dcredit"]
#: dcredit profiles 1 + 2 iterations under bytescheduler rules, then plans: steps 4 and 5 run it.
PROFILE = dict(profile_warmup=1, profile_steps=2)
#: Small enough that every tensor over 512 bytes is cut into several blocks (the 64x512 frozen
#: projection is not sent; the 10x64 heads become 5 blocks, the conv weight 2).
SMALL = dict(partition_bytes=512, credit_bytes=2048)
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


class SmallNet(nn.Module):
    """Convolution, batch norm, linear layers; one frozen parameter; one parameter (``extra``)
    used on rank 0 only, so rank 1 never computes its gradient."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.proj = nn.Linear(8 * 8 * 8, 64)
        self.proj.weight.requires_grad_(False)      # frozen
        self.head = nn.Linear(64, 10)
        self.extra = nn.Linear(64, 10)              # unused on rank 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = F.relu(self.proj(x.flatten(1)))
        out = self.head(x)
        if self.rank == 0:
            out = out + self.extra(x)
        return out


def make_model(seed: int = 7, rank: int = 0) -> SmallNet:
    torch.manual_seed(seed)
    return SmallNet(rank)


Batches = list[list[tuple[torch.Tensor, torch.Tensor]]]


def batches(steps: int, passes: int = 1, batch: int = 4, rank: int = 0) -> Batches:
    """``steps`` lists of ``passes`` micro-batches, other data on each rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [[(torch.randn(batch, 3, 8, 8, generator=gen),
              torch.randint(0, 10, (batch,), generator=gen)) for _ in range(passes)]
            for _ in range(steps)]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 5, passes: int = 1,
          before_step: Optional[Callable[[torch.optim.Optimizer], None]] = None,
          after_step: Optional[Callable[[], None]] = None, rank: int = 0,
          forward: Optional[nn.Module] = None) -> list[torch.Tensor]:
    """``steps`` iterations; ``forward`` (default ``model``) is what the batches go through,
    e.g. a ``DistributedDataParallel`` wrapper of ``model``.  Returns ``model.state_dict()``'s
    tensors."""
    run = model if forward is None else forward
    for micro in batches(steps, passes, rank=rank):
        opt.zero_grad()      # Horovod's zero_grad takes no arguments (horovod#3405)
        for x, y in micro:
            F.cross_entropy(run(x), y).backward()
        if before_step is not None:
            before_step(opt)
        else:
            opt.step()
        if after_step is not None:
            after_step()
    # Through state_dict(), as a checkpoint reads them: it must see every update applied.
    return [v.detach().clone() for v in model.state_dict().values()]


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float(((x - y).abs() / (y.abs() + 1e-12)).max()) for x, y in zip(a, b))


def params_close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-5,
                 atol: float = 1e-7) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))
