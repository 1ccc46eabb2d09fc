"""Shared set-up for the tests that run on every rank under ``torchrun --nproc-per-node 2``
(``make test-torchrun``): the torch.distributed transport on real Gloo, no Horovod.

Every rank runs the same tests in the same order.  Assertions go through ``assert_all_ranks`` so
that every rank reaches the same verdict: a failure on one rank fails the test on all of them
instead of leaving the others waiting in the next collective.  Outside ``torchrun`` (``pytest
tests``, which collects this folder too) nothing is initialised and every test skips.

The Horovod-free modules of ``tests/multirank`` (the model builders ``small_models`` and
``hf_models``, the code-path cases ``code_path_cases``) are imported from there (appended to
``sys.path``: this folder's modules come first).
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.append(str(Path(__file__).resolve().parent.parent / "multirank"))

#: Set by torchrun for every worker; without them there is no job to join.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
UNDER_TORCHRUN = all(name in os.environ for name in TORCHRUN_ENV)

if UNDER_TORCHRUN and not dist.is_initialized():
    dist.init_process_group("gloo")
torch.set_num_threads(1)
_started = time.monotonic()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def assert_all_ranks(ok: bool, message: str = "") -> None:
    """Fail on every rank when ``ok`` is false on any, with the first failing rank's message."""
    verdicts: list = [None] * size()
    dist.all_gather_object(verdicts, (rank(), bool(ok), message if not ok else ""))
    failed = [(r, m) for r, good, m in verdicts if not good]
    assert not failed, f"failed on rank(s) {[r for r, _ in failed]}: {failed[0][1]}"


def gather(obj: object) -> list:
    """``obj`` from every rank, in rank order."""
    out: list = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def same_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    """Whether every rank holds bitwise the same ``tensors``."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(other, everyone[0]) for other in everyone)


def ddp(model: torch.nn.Module, **kwargs: object) -> DistributedDataParallel:
    """The reference: ``model`` under DDP with per-rank unused parameters found (a parameter
    used on some ranks only) and no buffer broadcast (Horovod and dcredit_hvd leave each rank's
    batch-norm statistics its own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)      # broadcast_buffers' deprecation
        return DistributedDataParallel(model, find_unused_parameters=True,
                                       broadcast_buffers=False, **kwargs)


class ManualAllreduce:
    """The reference where DDP cannot express a case (a parameter unused on every rank gets
    zeros, as Horovod and dcredit_hvd send, where DDP leaves ``grad`` None): after backward,
    every gradient of the optimizer (zeros where this rank computed none) is summed by
    ``all_reduce`` and divided by the group's size, then the local optimizer steps."""

    def __init__(self, opt: torch.optim.Optimizer, op: object = None) -> None:
        self.opt = opt
        self.average = op is None

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                if self.average:
                    p.grad.div_(size())
        self.opt.step()


@pytest.fixture(autouse=True)
def _two_ranks() -> Iterator[None]:
    if size() < 2:
        pytest.skip("multi-rank test: run under torchrun --nproc-per-node 2 (make test-torchrun)")
    yield
    dist.barrier()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if UNDER_TORCHRUN:
        terminalreporter.write_line(f"torchrun suite: rank {rank()} of {size()}, "
                                    f"{time.monotonic() - _started:.0f} s")
