"""Rank 0's state on every rank, by DDP's rules, for ``strategy="dcredit"`` on both Lightning
packages: its parameters and buffers where DDP would wrap the model, and its buffers (batch-norm
statistics) before a forward that follows one with gradients and sync on (``broadcast_buffers``).

Mixed into ``lightning_strategy.DCreditStrategyBody``; ``torch_broadcast`` or Horovod's broadcast
by the strategy's transport.
"""
from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from . import horovod_env
from .lightning_steps import torch_broadcast, unique_tensors


class RankZeroState:
    """Rank 0's parameters and buffers at setup, its buffers by DDP's rule; the rule's state
    (``_sync_buffers_next``, ``_no_sync``) starts in the strategy's ``__init__``."""

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: the wrappers count backward passes (``backward_passes_per_step``)
        and send only at the last one.  Remembered for DDP's buffer rule (no sync after it)."""
        self._no_sync = True
        try:
            yield None
        finally:
            self._no_sync = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        try:
            return super().training_step(*args, **kwargs)            # type: ignore[misc]
        finally:
            self._after_forward()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        try:
            return super().validation_step(*args, **kwargs)          # type: ignore[misc]
        finally:
            self._after_forward()

    def _before_forward(self) -> None:
        if self.broadcast_buffers and self._sync_buffers_next and self.world_size > 1:
            assert self.lightning_module is not None
            buffers = [b for b in self.lightning_module.buffers() if b.numel()]
            if buffers:
                self._broadcast(buffers)

    def _after_forward(self) -> None:
        # DDP syncs before a forward that follows one with gradients and sync on; in manual
        # optimization Lightning turns its sync off around the forward, so never after one.
        module = self.lightning_module
        self._sync_buffers_next = (torch.is_grad_enabled() and not self._no_sync
                                   and module is not None and module.automatic_optimization)

    def broadcast_rank0_state(self) -> None:
        """Rank 0's parameters and buffers on every rank (DDP does it when it wraps); its
        buffers again before the first forward."""
        assert self.model is not None
        self._sync_buffers_next = True
        if self.world_size <= 1:
            return
        if self.horovod:
            horovod_env.horovod().broadcast_parameters(self.model.state_dict(), root_rank=0)
        else:
            with torch.no_grad():
                torch_broadcast(unique_tensors(self.model))

    def _broadcast(self, tensors: list[Tensor]) -> None:
        with torch.no_grad():
            (horovod_env.broadcast if self.horovod else torch_broadcast)(tensors)
