"""``DCreditAccelerator``: an ``accelerate.Accelerator`` whose gradient all-reduces are scheduled
by ``dcredit_hvd`` instead of DDP; the user's loop does not change.

    from dcredit_hvd.frameworks.accelerate import DCreditAccelerator
    accelerator = DCreditAccelerator(gradient_accumulation_steps=2)     # was: Accelerator(...)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Only public ``Accelerator`` methods are overridden (``docs/frameworks-accelerate.md``):

* ``prepare_model``: prepared for evaluation (device, autocast; no DDP), rank 0's parameters
  and buffers broadcast, as DDP's constructor does (buffers again at each window's first
  forward, as DDP's ``broadcast_buffers``).
* ``prepare_optimizer``: Accelerate's ``AcceleratedOptimizer`` then holds a
  ``dcredit_hvd.DistributedOptimizer`` over the user's optimizer, with
  ``backward_passes_per_step=gradient_accumulation_steps`` (``accumulate()`` skips ``step()``
  and ``zero_grad()`` on the same micro-batches the wrapper does not reduce on).  The wrapper
  shares the user's optimizer's parameter-group dicts (also through ``load_state_dict``), so
  a scheduler built on it sets the rates.
* ``clip_grad_norm_``: ``synchronize()`` first (clipping reads reduced gradients), the next
  ``step()`` in ``skip_synchronize()``; ``shard=True`` clips by the norm of every rank's slices.
* ``backward``/``no_sync``/``trigger_sync_in_backward``: gradients no prepared optimizer owns
  (a model prepared without one) are all-reduced in backward as DDP does
  (``accelerate_unowned.py``).
* ``save_state``/``load_state``: owed updates applied first; ``shard=True`` saves the full
  optimizer state (``full_state_dict()``), which loads into a job of any size.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import OPTIMIZER_NAME, save
from torch import nn

import dcredit_hvd
from dcredit_hvd.config import SchedulerConfig

from .accelerate_setup import check as _check
from .accelerate_setup import settings as _settings
from .accelerate_setup import sync_each_batch as _sync_each_batch
from .accelerate_unowned import UnownedGradients
from .rank0 import broadcast_from_rank0
from .versions import require

require("accelerate", accelerate.__version__)


@dataclass
class Wrapped:
    """One prepared optimizer: Accelerate's, and the scheduler's wrapper inside it."""

    accelerated: Any
    wrapper: torch.optim.Optimizer
    index: int                                     # Accelerate's checkpoint file number
    skip: ExitStack = field(default_factory=ExitStack)
    synchronized: bool = False


@dataclass
class DCreditState:
    """What the accelerator adds: settings, the prepared models and optimizers."""

    settings: dict[str, Any]
    active: bool = False
    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[Wrapped] = field(default_factory=list)
    pending: list[nn.Module] = field(default_factory=list)   # modules of the prepare() running
    prepared_optimizers: int = 0
    unowned: list[UnownedGradients] = field(default_factory=list)   # one per prepared model

    def owned(self) -> set[int]:
        """The parameters the prepared optimizers reduce (ids)."""
        return {id(p) for e in self.optimizers for g in e.wrapper.param_groups
                for p in g["params"]}

    def tracker(self, model: nn.Module) -> Optional[UnownedGradients]:
        return next((t for t in self.unowned if t.model is model), None)


class DCreditAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` with ``dcredit_hvd`` in place of DDP.

    Takes every ``Accelerator`` argument, plus ``dcredit_policy`` (``"dcredit"``,
    ``"bytescheduler"``, ``"wfbp"``) and ``dcredit``: other ``DistributedOptimizer`` keywords
    (``shard``, ``partition_bytes`` ...) as a mapping or a ``SchedulerConfig``.  One process
    (nothing to reduce) trains as the plain ``Accelerator``.
    """

    def __init__(self, *args: Any, dcredit: Optional[Mapping[str, Any] | SchedulerConfig] = None,
                 dcredit_policy: Optional[str] = None, **kwargs: Any) -> None:
        self.dcredit = DCreditState(settings=_settings(dcredit, dcredit_policy))
        super().__init__(*args, **kwargs)
        self.dcredit.active = _check(self, shard=bool(self.dcredit.settings.get("shard")))

    @property
    def dcredit_optimizers(self) -> list[torch.optim.Optimizer]:
        """The ``DistributedOptimizer``s (``plan``, ``measured``, ``close()``), prepare order."""
        return [w.wrapper for w in self.dcredit.optimizers]

    # -- preparation ---------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Optional[list] = None) -> Any:
        """``Accelerator.prepare``; its modules are known, so an optimizer passed before its
        model still finds it."""
        self.dcredit.pending = [a for a in args if isinstance(a, nn.Module)]
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self.dcredit.pending = []

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Device and autocast only (no DDP: the optimizer reduces), rank 0's weights."""
        if not self.dcredit.active or evaluation_mode:
            return super().prepare_model(model, device_placement, evaluation_mode)
        if any(model is m for m in self.dcredit.models):
            return model
        prepared = super().prepare_model(model, device_placement, evaluation_mode=True)
        if prepared is not model:
            raise RuntimeError("dcredit_hvd.frameworks.accelerate: Accelerate replaced the model "
                               f"while preparing it ({type(prepared).__name__}); "
                               "DCreditAccelerator needs the model itself")
        broadcast_from_rank0(model)
        self.dcredit.models.append(model)
        tracker = UnownedGradients(model)
        tracker.refresh(self.dcredit.owned())
        self.dcredit.unowned.append(tracker)
        handler = self.ddp_handler
        if any(True for _ in model.buffers()) and (handler is None or handler.broadcast_buffers):
            _BufferSync(self).install(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: Optional[bool] = None) -> Any:
        """Accelerate's optimizer around ``dcredit_hvd.DistributedOptimizer(optimizer)``."""
        if not self.dcredit.active or isinstance(optimizer, AcceleratedOptimizer):
            return super().prepare_optimizer(optimizer, device_placement)
        if callable(getattr(optimizer, "synchronize", None)):
            raise ValueError("dcredit_hvd.frameworks.accelerate: the optimizer is already a "
                             "distributed optimizer; pass the plain torch optimizer: "
                             "DCreditAccelerator wraps it")
        model = _model_of(self, optimizer)
        # Accelerate first: it reloads the optimizer's state onto the device, which replaces
        # its parameter groups; the wrapper is then built on (and shares) the new groups.
        accelerated = super().prepare_optimizer(optimizer, device_placement)
        # With sync_each_batch every backward reduces (``backward``), as DDP's does then.
        passes = 1 if _sync_each_batch(self) else self.gradient_accumulation_steps
        wrapper = dcredit_hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), model=model,
            backward_passes_per_step=passes, **self.dcredit.settings)
        accelerated.optimizer = wrapper
        entry = Wrapped(accelerated, wrapper, self.dcredit.prepared_optimizers)
        self.dcredit.prepared_optimizers += 1
        wrapper.register_step_post_hook(lambda *_: _end_window(entry))
        self.dcredit.optimizers.append(entry)
        owned = self.dcredit.owned()
        for tracker in self.dcredit.unowned:
            tracker.refresh(owned)
        return accelerated

    # -- the step boundary ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward``; a window left open (clip without a step) is closed.  With
        ``GradientAccumulationPlugin(sync_each_batch=True)`` a micro-batch that does not step
        ends with its gradients all-reduced, as under DDP (which then skips ``no_sync``): the
        next backward adds its own to the mean, and the mean of those sums is DDP's."""
        for entry in self.dcredit.optimizers:
            _end_window(entry)
        super().backward(loss, **kwargs)
        for tracker in self.dcredit.unowned:
            tracker.finish()
        if self.dcredit.active and not self.sync_gradients and _sync_each_batch(self):
            for entry in self.dcredit.optimizers:
                entry.wrapper.synchronize()

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """``Accelerator.no_sync``: also holds back DDP's reduction of the gradients no
        prepared optimizer owns (``accelerate_unowned.py``)."""
        tracker = self.dcredit.tracker(model)
        with ExitStack() as stack:
            if tracker is not None:
                stack.enter_context(tracker.no_sync())
            stack.enter_context(super().no_sync(model))
            yield

    @contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:  # type: ignore[override]
        """``Accelerator.trigger_sync_in_backward``: the next backward reduces after forwards
        under ``no_sync``, for the gradients no prepared optimizer owns as DDP does."""
        tracker = self.dcredit.tracker(model)
        with ExitStack() as stack:
            if tracker is not None:
                stack.enter_context(tracker.sync_in_backward())
            stack.enter_context(accelerate.Accelerator.trigger_sync_in_backward(model))
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Clip by the norm of the REDUCED gradients: on the micro-batch that steps, wait for
        them (``synchronize()``) and let the next ``step()`` skip its own wait."""
        if not self.dcredit.active or not self.sync_gradients:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        params = list(parameters)
        ids = {id(p) for p in params}
        owners = [e for e in self.dcredit.optimizers
                  if ids & {id(p) for g in e.wrapper.param_groups for p in g["params"]}]
        for entry in owners:
            if not entry.synchronized:
                entry.wrapper.synchronize()
                entry.skip.enter_context(entry.wrapper.skip_synchronize())
                entry.synchronized = True
        if self.dcredit.settings.get("shard"):
            mine = {id(p) for e in owners for g in e.wrapper.param_groups for p in g["params"]}
            if len(owners) != 1 or ids != mine:
                raise ValueError("dcredit_hvd.frameworks.accelerate: with shard=True, "
                                 "clip_grad_norm_ takes exactly one optimizer's parameters "
                                 "(model.parameters()): each rank holds slices of them")
            return owners[0].wrapper.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(params, max_norm, norm_type)

    # -- checkpoints and the end ------------------------------------------------------------------
    def settle(self) -> None:
        """Apply every update the last ``step()`` owes (before reading all weights at once)."""
        for entry in self.dcredit.optimizers:
            entry.wrapper.apply_pending_updates()

    def wait_for_everyone(self) -> None:
        self.settle()
        super().wait_for_everyone()

    def end_training(self) -> None:
        self.settle()
        super().end_training()

    def free_memory(self, *objects: Any) -> Any:
        """``Accelerator.free_memory`` forgets what was prepared; so does the scheduler side."""
        self.settle()
        for tracker in self.dcredit.unowned:
            tracker.close()
        self.dcredit.models, self.dcredit.optimizers, self.dcredit.unowned = [], [], []
        self.dcredit.prepared_optimizers = 0
        return super().free_memory(*objects)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """``Accelerator.save_state`` of the complete model and optimizer state; with
        ``shard=True`` each optimizer file holds every rank's slices (``full_state_dict()``)."""
        self.settle()
        location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        if self.dcredit.active and self.dcredit.settings.get("shard"):
            for entry in self.dcredit.optimizers:
                full = entry.wrapper.full_state_dict()          # a collective: every rank
                name = f"{OPTIMIZER_NAME}.bin" if entry.index == 0 else \
                    f"{OPTIMIZER_NAME}_{entry.index}.bin"
                save(full, os.path.join(location, name), safe_serialization=False,
                     save_on_each_node=self.project_configuration.save_on_each_node)
            super().wait_for_everyone()
        return location

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
                   **load_model_func_kwargs: Any) -> None:
        """``Accelerator.load_state``; the wrappers drain what is in flight before loading."""
        self.settle()
        super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)



def _model_of(acc: DCreditAccelerator, optimizer: torch.optim.Optimizer) -> nn.Module:
    """The prepared model holding the optimizer's parameters (prepared now if pending)."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in acc.dcredit.models + acc.dcredit.pending:
        if params <= {id(p) for p in model.parameters()}:
            return acc.prepare_model(model)
    raise ValueError("dcredit_hvd.frameworks.accelerate: no prepared model holds every "
                     "parameter of this optimizer; prepare the model first (or in the same "
                     "accelerator.prepare call): the scheduler needs it")


class _BufferSync:
    """DDP's ``broadcast_buffers``: rank 0's buffers (batch-norm statistics) before a forward
    that follows one which synchronised (the first of each accumulation window), through the
    model's public forward hooks, as DDP's own pre- and post-forward decide."""

    def __init__(self, accelerator: DCreditAccelerator) -> None:
        self.accelerator = accelerator
        self.sync_next = True

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(lambda module, _: self.before(module))
        model.register_forward_hook(lambda *_: self.after())

    def before(self, model: nn.Module) -> None:
        if self.sync_next:
            broadcast_from_rank0(model, parameters=False)

    def after(self) -> None:
        self.sync_next = torch.is_grad_enabled() and self.accelerator.sync_gradients


def _end_window(entry: Wrapped) -> None:
    """After ``step()``: the next one waits for its gradients again."""
    entry.synchronized = False
    entry.skip.close()
