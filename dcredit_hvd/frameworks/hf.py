"""``DCreditTrainer``: the Hugging Face ``transformers.Trainer`` with ``dcredit_hvd`` scheduling
its gradient all-reduces instead of DDP.

    from dcredit_hvd.frameworks.hf import DCreditTrainer    # also: dcredit_hvd.hf (0.2.0's name)
    trainer = DCreditTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)
    trainer.train()

Launched as the plain ``Trainer`` is (``torchrun``, ``accelerate launch``).  What it changes,
all through the Trainer's own extension points (``docs/frameworks-hf.md``):

* ``create_optimizer``: the model is prepared by Accelerate for evaluation only (device,
  autocast), so Accelerate's ``prepare`` leaves it unwrapped (no DDP); the initial parameters
  and buffers are broadcast from rank 0; the optimizer (built by the Trainer or passed in
  ``optimizers=``) is wrapped by ``dcredit_hvd.DistributedOptimizer`` with
  ``backward_passes_per_step=gradient_accumulation_steps``.  The LR scheduler is built on the
  wrapper (one passed in ``optimizers=`` is re-pointed at it).
* ``training_step``: after the last micro-batch's backward, ``synchronize()``: the Trainer reads
  every gradient between backward and ``step()`` (clipping with ``max_grad_norm``, and the
  logged ``grad_norm``), so they must be reduced by then; the following ``step()`` runs in
  ``skip_synchronize()`` (Horovod's clipping pattern).
* ``dcredit_overlap=True`` (needs ``max_grad_norm=0``): ``step()`` returns at once and each
  parameter is updated as its gradient arrives, overlapping the next forward pass.  The Trainer
  then holds a thin module around the model whose ``zero_grad`` goes through the optimizer
  (``model.zero_grad()`` would otherwise wait for every update), and ``grad_norm`` is not
  logged (the reduced gradients are not known when the Trainer would read them).
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any, Optional

import accelerate
import torch
import transformers
from torch import nn
from transformers import Trainer, TrainerCallback

import dcredit_hvd
from dcredit_hvd.config import SchedulerConfig

from .accelerate_setup import sync_each_batch
from .hf_setup import active, refuse_unsupported
from .hf_setup import settings as _settings
from .hf_shards import FullOptimizerState, clip_by_global_norm
from .rank0 import broadcast_from_rank0
from .versions import require

require("transformers", transformers.__version__)
require("accelerate", accelerate.__version__)


class DCreditTrainer(Trainer):
    """``transformers.Trainer`` whose gradients are all-reduced by ``dcredit_hvd``, not DDP.

    Takes every ``Trainer`` argument, plus (keyword only):

    * ``dcredit_policy``: ``"dcredit"`` (default), ``"bytescheduler"`` or ``"wfbp"``.
    * ``dcredit_overlap``: apply each parameter's update as soon as its gradient is reduced,
      overlapping the next forward pass (D-Credit's phase 2).  Needs ``max_grad_norm=0`` (and
      no fp16 loss scaling): clipping needs every reduced gradient before any update.  Default
      False: gradients are reduced before clipping, parameters updated at ``step()``.
    * ``dcredit_model``: pass the model to the optimizer (``model=``; default True): priority
      in the order forward reads the parameters, per-layer forward times for ``dcredit``'s plan.
    * ``dcredit``: other ``dcredit_hvd.DistributedOptimizer`` keywords (``partition_bytes``,
      ``credit_bytes``, ``profile_steps``, ``liveness_timeout`` ...), as a mapping or a
      ``dcredit_hvd.config.SchedulerConfig``.
    """

    def __init__(self, *args: Any, dcredit_policy: Optional[str] = None,
                 dcredit_overlap: bool = False, dcredit_model: bool = True,
                 dcredit: Optional[Mapping[str, Any] | SchedulerConfig] = None,
                 **kwargs: Any) -> None:
        self._dcredit_settings = _settings(dcredit, dcredit_policy)
        self._dcredit_overlap = bool(dcredit_overlap)
        self._dcredit_model = bool(dcredit_model) or self._dcredit_overlap
        self._dcredit_opt: Optional[torch.optim.Optimizer] = None
        self._dcredit_skip = ExitStack()
        self._dcredit_window_open = False
        super().__init__(*args, **kwargs)
        self.add_callback(_StepBoundary(self))
        self.add_callback(FullOptimizerState(lambda: self._dcredit_opt))
        if self._dcredit_active():
            self._dcredit_refuse_unsupported()

    # -- the wrapped optimizer ------------------------------------------------------------------
    @property
    def dcredit_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The ``dcredit_hvd.DistributedOptimizer`` (None before ``train()`` or in one process):
        its ``plan``, ``measured``, ``replans`` and ``close()``."""
        return self._dcredit_opt

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (or the one passed in ``optimizers=``), wrapped."""
        if not self._dcredit_active():
            return super().create_optimizer(model)
        if model is not None and model is not self.model:
            raise RuntimeError("dcredit_hvd.hf: the Trainer asked for an optimizer over an "
                               "already wrapped model (delayed optimizer creation: FSDP, "
                               "SageMaker); DCreditTrainer does not support that setup")
        # Prepared for evaluation: device placement and autocast, and marked prepared, so the
        # Trainer's accelerator.prepare(model, optimizer) returns it as it is, without DDP.
        prepared = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        if prepared is not self.model:
            raise RuntimeError("dcredit_hvd.hf: Accelerate replaced the model while preparing it "
                               f"({type(prepared).__name__}); DCreditTrainer needs the model itself")
        broadcast_from_rank0(self.model)
        inner = super().create_optimizer(model)
        inner = getattr(inner, "optimizer", inner) if _is_accelerated(inner) else inner
        if self._dcredit_opt is not None and inner is self._dcredit_opt:
            self.optimizer = inner                      # a second train(): keep the wrapper
            return inner
        if hasattr(inner, "synchronize") and hasattr(inner, "skip_synchronize"):
            raise ValueError("dcredit_hvd.hf: the optimizer passed in optimizers= is already a "
                             "distributed optimizer; pass the plain torch optimizer: "
                             "DCreditTrainer wraps it")
        # With sync_each_batch every backward reduces (``training_step``), as DDP's does then.
        passes = 1 if sync_each_batch(self.accelerator) else self.args.gradient_accumulation_steps
        wrapped = dcredit_hvd.DistributedOptimizer(
            inner, named_parameters=self.model.named_parameters(),
            backward_passes_per_step=passes,
            model=self.model if self._dcredit_model else None, **self._dcredit_settings)
        scheduler = self.lr_scheduler          # passed in optimizers=, built on ``inner``
        if scheduler is not None and getattr(scheduler, "optimizer", None) is inner:
            _follow(scheduler, wrapped)
        self._dcredit_opt = self.optimizer = wrapped
        return wrapped

    # -- the step boundary ------------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward and backward; after the last micro-batch of an optimizer step, wait for the
        reduced gradients (the Trainer clips and measures them before ``step()``).  Under
        ``accelerator_config``'s ``sync_each_batch`` every other micro-batch is reduced too, as
        under DDP (which then skips ``no_sync``): the next backward adds its own gradients to
        the mean, and the mean of those sums is DDP's."""
        opt = self._dcredit_opt
        if (opt is not None and not self._dcredit_window_open
                and self.args.ddp_broadcast_buffers is not False):
            # DDP's broadcast_buffers: rank 0's buffers (batch-norm statistics) before the
            # first forward of each accumulation window (DDP skips it in no_sync windows).
            broadcast_from_rank0(self.model, parameters=False)
        self._dcredit_window_open = True
        loss = super().training_step(model, inputs, num_items_in_batch)
        if opt is not None and self.accelerator.sync_gradients:
            self._dcredit_window_open = False
            if not self._dcredit_overlap:
                opt.synchronize()
                clip_by_global_norm(opt, self.args.max_grad_norm)     # shard=True only
                self._dcredit_skip.close()
                self._dcredit_skip.enter_context(opt.skip_synchronize())
        elif opt is not None and sync_each_batch(self.accelerator):
            opt.synchronize()
        return loss

    def _dcredit_end_of_step(self) -> None:
        """After ``optimizer.step()``: leave ``skip_synchronize()``."""
        self._dcredit_skip.close()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; the updates the last ``step()`` owes are applied before it
        returns, so the model is complete for whatever follows."""
        try:
            result = super().train(*args, **kwargs)
        finally:
            self._dcredit_skip.close()
        if self._dcredit_opt is not None:
            self._dcredit_opt.apply_pending_updates()
        return result

    # -- overlapped updates: two Trainer internals, checked at construction -------------------
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None
                    ) -> nn.Module:
        model = super()._wrap_model(model, training, dataloader)
        if (training and self._dcredit_overlap and self._dcredit_active()
                and model is self.model):
            return _UpdatesInFlight(model, self)
        return model

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self._dcredit_overlap and self._dcredit_opt is not None:
            return None      # the reduced gradients are not all there yet: nothing to log
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # -- what cannot work -------------------------------------------------------------------------
    def _dcredit_active(self) -> bool:
        """Several processes on torch.distributed; one process trains as the plain Trainer."""
        return active(self)

    def _dcredit_refuse_unsupported(self) -> None:
        """The setups that cannot work, refused at construction (``hf_setup``)."""
        refuse_unsupported(self, self._dcredit_settings, self._dcredit_overlap)


class _StepBoundary(TrainerCallback):
    """Ends ``skip_synchronize()`` right after ``optimizer.step()``, and applies owed updates
    before a checkpoint or an evaluation."""

    def __init__(self, trainer: DCreditTrainer) -> None:
        self._trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer._dcredit_end_of_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer._dcredit_end_of_step()
        opt = self._trainer.dcredit_optimizer
        if opt is not None and (control.should_save or control.should_evaluate):
            opt.apply_pending_updates()


class _UpdatesInFlight(nn.Module):
    """What the Trainer's loop holds with ``dcredit_overlap=True``: the model itself does the
    work; ``zero_grad`` goes through the optimizer, which zeroes each gradient after its owed
    update instead of waiting for all of them (``Module.zero_grad`` reads every ``.grad``)."""

    def __init__(self, module: nn.Module, trainer: DCreditTrainer) -> None:
        super().__init__()
        self.module = module
        self._trainer = trainer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        opt = self._trainer.dcredit_optimizer
        if opt is None:
            self.module.zero_grad(set_to_none=set_to_none)
        else:
            opt.zero_grad(set_to_none=set_to_none)




def _follow(scheduler: Any, wrapped: torch.optim.Optimizer) -> None:
    """Point an LR scheduler built on the optimizer at its wrapper: the Trainer's Accelerate
    prepare replaces the wrapper's parameter groups (``load_state_dict``), so the scheduler
    must name the wrapper (its public ``optimizer``).  torch then warns once, at the
    scheduler's first ``step()``, that ``optimizer.step()`` was overridden after the scheduler
    was built: true, and harmless (the learning rates follow the wrapper).  A scheduler the
    Trainer builds (``create_scheduler``) is built on the wrapper and does not warn."""
    scheduler.optimizer = wrapped


def _is_accelerated(opt: Any) -> bool:
    """An ``accelerate.optimizer.AcceleratedOptimizer`` (a second ``train()`` finds one)."""
    return type(opt).__name__ == "AcceleratedOptimizer" and hasattr(opt, "optimizer")
