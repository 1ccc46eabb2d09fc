"""Small models and a training loop shared by the multi-rank tests (Horovod's rank bound in;
the model and the loop themselves are ``small_models.py``, shared with ``tests/torchrun``)."""
from __future__ import annotations

from typing import Callable

import horovod.torch as hvd
import small_models
import torch
from small_models import SmallNet, max_rel_diff, params_close

__all__ = ["SmallNet", "batches", "make_model", "max_rel_diff", "params_close", "train"]


def make_model(seed: int = 7) -> SmallNet:
    return small_models.make_model(seed, rank=hvd.rank())


def batches(steps: int, passes: int = 1, batch: int = 4) -> small_models.Batches:
    return small_models.batches(steps, passes, batch, rank=hvd.rank())


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 5, passes: int = 1,
          before_step: Callable[[torch.optim.Optimizer], None] | None = None,
          after_step: Callable[[], None] | None = None) -> list[torch.Tensor]:
    return small_models.train(model, opt, steps, passes, before_step, after_step,
                              rank=hvd.rank())
