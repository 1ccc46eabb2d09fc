"""DDP's reduction for the gradients that no prepared optimizer owns, under ``DCreditAccelerator``.

A model prepared by ``DCreditAccelerator`` is not wrapped in DDP: the scheduler reduces the
gradients of the optimizer prepared over it, for that optimizer's ``step()``.  Parameters that
no prepared optimizer holds (a model prepared without one, parameters left out of it) would
then never be reduced, where DDP reduces every parameter in backward.  ``UnownedGradients``
does what DDP does for them, one bucket per model:

* the backward after a forward outside ``no_sync`` (or inside ``trigger_sync_in_backward``)
  all-reduces them, averaged over ranks, as soon as the last of them has its gradient;
* a parameter without a gradient on this rank counts as zero (DDP's
  ``find_unused_parameters``); ``accelerator.backward`` completes such a bucket, and a
  parameter that no rank gave a gradient keeps ``grad=None``.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.distributed as dist
from torch import nn


class UnownedGradients:
    """The parameters of one model that no prepared optimizer owns, reduced as DDP would."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params: list[nn.Parameter] = []
        self.ready: set[int] = set()
        self.depth = {"paused": 0,     # no_sync(model)
                      "forced": 0}     # trigger_sync_in_backward(model)
        self.armed = False         # the last forward outside no_sync: its backward reduces
        self.reduced = False       # this forward's bucket is reduced
        self.handles: list = []
        self.forward_hook = model.register_forward_pre_hook(lambda *_: self._forward())

    def refresh(self, owned: set[int]) -> None:
        """The unowned parameters now that ``owned`` (optimizers' parameter ids) changed."""
        for handle in self.handles:
            handle.remove()
        # parameters() yields a shared (tied) parameter once.
        self.params = [p for p in self.model.parameters() if p.requires_grad and id(p) not in owned]
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def close(self) -> None:
        """Remove every hook (``free_memory``)."""
        self.refresh({id(p) for p in self.model.parameters()})
        self.forward_hook.remove()

    def no_sync(self) -> AbstractContextManager[None]:
        return self._within("paused")

    def sync_in_backward(self) -> AbstractContextManager[None]:
        return self._within("forced")

    @contextmanager
    def _within(self, kind: str) -> Iterator[None]:
        self.depth[kind] += 1
        try:
            yield
        finally:
            self.depth[kind] -= 1

    def finish(self) -> None:
        """End of ``accelerator.backward``: a bucket some parameter left open is reduced."""
        if self.params and self._syncing() and not self.reduced:
            self._reduce()

    # -- hooks ---------------------------------------------------------------------------------
    def _forward(self) -> None:
        if torch.is_grad_enabled():
            self.armed, self.reduced = self.depth["paused"] == 0, False
            self.ready.clear()

    def _syncing(self) -> bool:
        return self.armed or self.depth["forced"] > 0

    def _ready(self, param: torch.Tensor) -> None:
        if not self._syncing():
            return
        self.ready.add(id(param))
        if len(self.ready) == len(self.params):
            self._reduce()

    def _reduce(self) -> None:
        """Per dtype and device, one all-reduce of the unowned gradients (zero where missing)
        and of how many ranks had each one."""
        groups: dict[tuple, list[nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), params in groups.items():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            used = torch.tensor([float(p.grad is not None) for p in params], dtype=dtype,
                                device=device)
            flat = torch.cat([g.reshape(-1) for g in grads] + [used])
            flat.div_(dist.get_world_size())
            dist.all_reduce(flat)
            counts = flat[flat.numel() - len(params):]
            offset = 0
            for i, p in enumerate(params):
                piece = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(piece)
                elif counts[i] > 0:
                    p.grad = piece.clone()
        self.ready.clear()
        self.reduced = True
