"""``shard=True`` under the Hugging Face Trainer: clipping by the global norm and checkpoints
that hold the whole optimizer state, through the Trainer's public extension points.

* Clipping: with ``shard=True`` each rank's ``p.grad`` holds the reduced gradient of its own
  slices only (zeros elsewhere), so the Trainer's ``accelerator.clip_grad_norm_`` would clip by
  this rank's part of the norm.  ``DCreditTrainer.training_step`` clips first, through the
  wrapper (the global norm of every rank's slices, what DDP clips by); the Trainer's own clip
  then finds every local norm below ``max_grad_norm`` and changes nothing.  What the Trainer
  logs as ``grad_norm`` is then this rank's part of the clipped gradient, not the global norm.
* Checkpoints: the Trainer saves ``optimizer.state_dict()`` on rank 0 alone (its own slices).
  ``FullOptimizerState.on_save`` runs on every rank after each save, gathers the full state
  (``full_state_dict()``, a collective) and rank 0 writes it over the Trainer's file, so the
  checkpoint loads into any run: sharded (each rank keeps its slices) or plain torch.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
from transformers import TrainerCallback
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR


def sharded(opt: Optional[torch.optim.Optimizer]) -> bool:
    """A ``dcredit_hvd.DistributedOptimizer`` in the sharded mode (its ``sharded``)."""
    return bool(getattr(opt, "sharded", False))


def clip_by_global_norm(opt: torch.optim.Optimizer, max_norm: float) -> None:
    """After ``synchronize()``: clip every rank's slices by their global norm."""
    if max_norm and max_norm > 0 and sharded(opt):
        opt.clip_grad_norm_(float(max_norm))


class FullOptimizerState(TrainerCallback):
    """Replaces the sharded optimizer file of each checkpoint by the full state."""

    def __init__(self, optimizer: Callable[[], Optional[torch.optim.Optimizer]]) -> None:
        self._optimizer = optimizer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer()
        if not sharded(opt):
            return
        full = opt.full_state_dict()                     # every rank takes part
        if args.should_save:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if os.path.isdir(folder):
                torch.save(full, os.path.join(folder, OPTIMIZER_NAME))
