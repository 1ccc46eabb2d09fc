"""The step of the Lightning strategies: the wrapped optimizer's ``step(closure)``, reducing
gradients before a reader between backward and step, clipping, the buffer broadcast, and
naming a lost peer.  Written against ``LightningKit``, the few objects each Lightning package
(``lightning.pytorch``, ``pytorch_lightning``) supplies, so one body serves both.
"""
from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from dcredit_hvd.errors import PeerLostError

#: On a wrapper: ``synchronize()`` ran for this step.
SYNCED = "_dcredit_lightning_synced"


@dataclass(frozen=True)
class LightningKit:
    """What the shared strategy needs from one Lightning package (never mixed in one run)."""

    package: str                     # "lightning.pytorch" or "pytorch_lightning"
    Callback: type
    LightningOptimizer: type
    TrainerFn: Any
    is_overridden: Callable[..., bool]
    reset_seed: Callable[[], None]
    HorovodEnvironment: type

    def raw(self, optimizer: Any) -> Any:
        """The optimizer a ``LightningOptimizer`` holds (or ``optimizer`` itself)."""
        return optimizer.optimizer if isinstance(optimizer, self.LightningOptimizer) else optimizer


def torch_broadcast(tensors: list[Tensor]) -> None:
    """Rank 0's values into ``tensors``, in place: one broadcast per dtype on the default
    group, as DDP's buffer sync does (the scheduler's own collectives use groups of theirs)."""
    for dtype in sorted({t.dtype for t in tensors}, key=str):   # same order on every rank
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        torch.distributed.broadcast(flat, src=0)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def unique_tensors(module: torch.nn.Module) -> list[Tensor]:
    """Every parameter's and buffer's data once (tied weights once), in the module's order."""
    seen: set[int] = set()
    out = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen and tensor.numel() > 0:
            seen.add(id(tensor))
            out.append(tensor.data)
    return out


def grads_read_before_step(kit: LightningKit, module: Any, trainer: Any, plugin: Any) -> bool:
    """Whether anything reads ``.grad`` between backward and step in automatic
    optimization: clipping, ``on_before_optimizer_step`` (module or callback), fp16's
    ``GradScaler`` (``unscale_``).  DDP gives them reduced gradients; so must we."""
    if module is None or not module.automatic_optimization:
        return False
    return bool(
        (trainer.gradient_clip_val or 0) > 0
        or kit.is_overridden("configure_gradient_clipping", module)
        or kit.is_overridden("on_before_optimizer_step", module)
        or any(kit.is_overridden("on_before_optimizer_step", cb, parent=kit.Callback)
               for cb in trainer.callbacks)
        or getattr(plugin, "scaler", None) is not None)


SHARD_CLIP_VALUE = (
    "dcredit_hvd.lightning: gradient_clip_algorithm='value' with shard=True: each rank holds the "
    "reduced gradient of its own slices only, so Lightning's clipping of the parameters' "
    "gradients would clip nothing that is applied. Clip by norm (gradient_clip_algorithm='norm' "
    "clips by the global norm of every rank's slices), or use shard=False."
)


def sharded(raw: Any) -> bool:
    """A wrapper in the sharded mode (``DistributedOptimizer.sharded``)."""
    return bool(getattr(raw, "sharded", False))


def by_value(algorithm: Any) -> bool:
    """Lightning's ``gradient_clip_algorithm`` (a string or its enum) is ``"value"``."""
    return str(getattr(algorithm, "value", algorithm)).lower() == "value"


def intercept_clipping(kit: LightningKit, plugin: Any) -> Callable[..., None]:
    """``clip_gradients`` (automatic clipping, and ``self.clip_gradients`` in manual
    optimization) sees reduced gradients: the optimizer is synchronized first.  With
    ``shard=True`` clipping by norm is the wrapper's (the global norm of every rank's slices,
    what the unsharded run clips by).  Set on the plugin instance (its public method),
    removed at teardown."""
    original = type(plugin).clip_gradients.__get__(plugin)

    def clip_gradients(optimizer: Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: Any = None) -> None:
        raw = kit.raw(optimizer)
        if clip_val and clip_val > 0:
            reduce_now(raw)
            if sharded(raw):
                if by_value(gradient_clip_algorithm):
                    raise ValueError(SHARD_CLIP_VALUE)
                raw.clip_grad_norm_(float(clip_val))
                return None
        if gradient_clip_algorithm is None:
            return original(optimizer, clip_val)
        return original(optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients
    return clip_gradients


def communication_error(exc: BaseException) -> bool:
    """An error of the collective library (Gloo's and NCCL's are plain ``RuntimeError``s)."""
    if isinstance(exc, PeerLostError):
        return False
    module = type(exc).__module__
    text = str(exc).lower()
    return (module.startswith(("torch.distributed", "horovod"))
            or any(word in text for word in ("gloo", "nccl", "connection", "horovod", "peer")))


def peer_lost(wrapped: list[Optimizer], wait: float) -> Optional[PeerLostError]:
    """The ``PeerLostError`` a wrapper's scheduler holds or receives within ``wait`` s."""
    deadline = time.monotonic() + wait
    while wrapped:
        for opt in wrapped:
            try:
                opt.raise_if_failed()
            except PeerLostError as lost:
                return lost
            except Exception:          # another failure of the same job: not a verdict
                pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return None


def closure_first(wrapper: Optimizer) -> None:
    """``wrapper.step(closure)`` runs the closure, then the scheduler's ``step()`` (Horovod's
    would synchronize first); under ``skip_synchronize()`` when ``reduce_now`` already
    synchronized."""
    scheduler_step = type(wrapper).step

    def step(self: Optimizer, closure: Optional[Callable[[], Any]] = None,
             **kwargs: Any) -> Any:
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        if getattr(self, SYNCED, False):
            setattr(self, SYNCED, False)
            with self.skip_synchronize():
                scheduler_step(self, **kwargs)
        else:
            scheduler_step(self, **kwargs)
        return result

    wrapper.step = types.MethodType(step, wrapper)     # type: ignore[method-assign]
    setattr(wrapper, SYNCED, False)


def reduce_now(raw: Any) -> None:
    """Reduce the gradients of a wrapper now (once per step), for a reader before ``step``."""
    if hasattr(raw, SYNCED) and not getattr(raw, SYNCED):
        raw.synchronize()
        setattr(raw, SYNCED, True)


def repoint(scheduler: Any, original: Optimizer, wrapper: Optimizer) -> None:
    """A scheduler built on ``original`` now names ``wrapper`` (its public ``optimizer``), so
    Lightning and ``LearningRateMonitor`` read the wrapper.  The learning rates need no
    re-pointing: the wrapper holds ``original``'s param-group dicts themselves and keeps them
    through ``load_state_dict``, so schedulers nested in a ``SequentialLR`` or
    ``ChainedScheduler`` drive the wrapper too."""
    if getattr(scheduler, "optimizer", None) is original:
        scheduler.optimizer = wrapper
