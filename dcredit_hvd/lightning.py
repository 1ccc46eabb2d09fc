"""PyTorch Lightning: ``Trainer(strategy="dcredit")``, gradients all-reduced by the scheduler.

    import dcredit_hvd.lightning          # registers "dcredit" in Lightning's StrategyRegistry
    trainer = Trainer(strategy="dcredit", accelerator="cpu", devices=2)
    trainer = Trainer(strategy=DCreditStrategy(policy="bytescheduler", model_overlap=False))

Launched as ``strategy="ddp"`` is (``torchrun``, Lightning's own process launch, a cluster
manager) on torch.distributed, or with ``horovodrun`` on Horovod (found from its variables,
``HOROVOD_RANK``; ``transport="horovod"`` forces it, e.g. under ``mpirun``).

What the strategy does, and why (``docs/frameworks-lightning.md``):

* **No DDP wrap.**  Rank 0's parameters and buffers are broadcast once at setup (what DDP does
  at its construction), and, like DDP's default ``broadcast_buffers``, rank 0's buffers before a
  forward that follows a training forward (BatchNorm statistics agree across ranks).
* **The optimizers ``configure_optimizers`` returned are wrapped** in
  ``dcredit_hvd.DistributedOptimizer`` after Lightning built them (``setup_optimizers``, before
  the checkpoint restore, so a restore loads into the wrapper); each LR scheduler's
  ``optimizer`` is pointed at the wrapper (``LearningRateMonitor`` reads it).
* **``step(closure)`` runs the closure first.**  Lightning's precision plugins call
  ``optimizer.step(closure)`` where the closure runs forward, ``zero_grad``, backward, the
  ``on_before_optimizer_step`` hooks and clipping; Horovod's ``step`` would synchronize before
  it.  Each wrapper's ``step`` runs the closure, then the scheduler's ``step()``: with
  ``model_overlap`` it returns once everything is sent and each parameter is updated when its
  gradient is reduced (the read guard makes the next forward wait for exactly that).
* **Reduced gradients where something reads them.**  Gradient clipping
  (``gradient_clip_val``, ``configure_gradient_clipping``), ``on_before_optimizer_step`` of the
  module or a callback, and the fp16 ``GradScaler`` read ``.grad`` between backward and step;
  DDP gives them reduced gradients.  For such a fit the strategy calls ``synchronize()`` right
  after the closure's backward and steps under ``skip_synchronize()`` (Horovod's pattern): the
  gradients' all-reduce still overlaps backward, the update does not overlap the next forward.
  ``self.clip_gradients`` in manual optimization does the same.
* **Accumulation** (``accumulate_grad_batches``) is the scheduler's
  ``backward_passes_per_step``: non-stepping micro-batches send nothing; the stepping one (or an
  epoch's shorter last window) sends the sum.

Subclasses ``DDPStrategy`` rather than ``ParallelStrategy``: the launch (``torchrun``, Lightning's
own subprocess launcher, SLURM...), process-group set-up, rank bookkeeping, the distributed
sampler, ``is_distributed`` and the collectives used by logging and checkpointing are DDP's and
stay right without a line here; only the wrap, the optimizers and the step differ.
"""
from __future__ import annotations

import inspect
import os
import time
import types
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.overrides.distributed import _sync_module_states
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

import dcredit_hvd
from dcredit_hvd.errors import PeerLostError

NAME = "dcredit"

#: ``DistributedOptimizer`` arguments the strategy sets itself.
_OWN = ("optimizer", "named_parameters", "model")
#: ``DistributedOptimizer`` arguments a user may pass through ``DCreditStrategy(**kwargs)``.
_PASSED = tuple(name for name in inspect.signature(dcredit_hvd.DistributedOptimizer).parameters
                if name not in _OWN)

_SYNCED = "_dcredit_lightning_synced"
#: How long a collective library's error waits for the liveness channel to name a lost peer.
PEER_NAME_WAIT_S = 3.0      # on a wrapper: synchronize() ran for this step

SYNC_BN_ON_HOROVOD = (
    "dcredit_hvd.lightning: Trainer(sync_batchnorm=True) converts BatchNorm layers to "
    "torch.nn.SyncBatchNorm, which all-reduces through torch.distributed; this job runs on "
    "Horovod, where torch.distributed is not initialised. Use horovod.torch.SyncBatchNorm in "
    "the model instead, or launch with torchrun."
)
ALREADY_WRAPPED = (
    "dcredit_hvd.lightning: configure_optimizers returned an optimizer that is already a "
    "dcredit_hvd.DistributedOptimizer (or Horovod's); with strategy='dcredit' return the plain "
    "torch optimizer: the strategy wraps it (settings go to DCreditStrategy(...))."
)
PASSES_IN_AUTOMATIC = (
    "dcredit_hvd.lightning: DCreditStrategy(backward_passes_per_step={passes}) in automatic "
    "optimization: set Trainer(accumulate_grad_batches=...) instead; the strategy follows it "
    "(it is {accumulate} here)."
)


class HorovodEnvironment(ClusterEnvironment):
    """Ranks from Horovod: ``horovodrun`` started every process (``creates_processes_
    externally``), so Lightning must not launch more; the ranks are Horovod's, read from
    ``horovodrun``'s variables, else from ``hvd`` itself (``mpirun``), initialised on demand."""

    _VARIABLES = {"world_size": "HOROVOD_SIZE", "global_rank": "HOROVOD_RANK",
                  "local_rank": "HOROVOD_LOCAL_RANK", "node_rank": "HOROVOD_CROSS_RANK"}

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        """Started by ``horovodrun`` (``HOROVOD_RANK`` set; torchrun's ``LOCAL_RANK`` wins)."""
        return "HOROVOD_RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ

    def _read(self, what: str) -> int:
        value = os.environ.get(self._VARIABLES[what])
        if value is not None:
            return int(value)
        hvd = _horovod()
        return {"world_size": hvd.size, "global_rank": hvd.rank, "local_rank": hvd.local_rank,
                "node_rank": hvd.cross_rank}[what]()

    def world_size(self) -> int:
        return self._read("world_size")

    def set_world_size(self, size: int) -> None:
        pass                                   # Horovod's, not Lightning's

    def global_rank(self) -> int:
        return self._read("global_rank")

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._read("local_rank")

    def node_rank(self) -> int:
        return self._read("node_rank")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self.world_size():
            raise ValueError(
                f"dcredit_hvd.lightning: the Horovod job has {self.world_size()} processes but "
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) asks for "
                f"{num_devices * num_nodes}: pass devices=<processes per host> and "
                "num_nodes=<hosts> as given to horovodrun.")


def _horovod() -> Any:
    import horovod.torch as hvd
    if not hvd.is_initialized():
        hvd.init()
    return hvd


class DCreditStrategy(DDPStrategy):
    """Data-parallel training whose gradient all-reduces are scheduled by ``dcredit_hvd``.

    Args:
        policy: ``"dcredit"`` (default), ``"bytescheduler"`` or ``"wfbp"`` (README "Policies").
        model_overlap: pass ``model=`` to ``DistributedOptimizer``: ``step()`` returns at once
            and each parameter is updated as soon as its gradient is reduced, overlapping the
            next forward.  ``False``: ``step()`` waits for every gradient (Horovod's step).
        transport: ``"horovod"`` or ``"torch.distributed"``; default: Horovod when launched by
            ``horovodrun``, else torch.distributed.
        broadcast_buffers: rank 0's buffers before a forward, as DDP's default does.
        **kwargs: ``dcredit_hvd.DistributedOptimizer``'s other keyword arguments
            (``partition_bytes``, ``credit_bytes``, ``compression``, ``liveness_timeout``...);
            ``backward_passes_per_step`` in manual optimization only.
        The rest are ``DDPStrategy``'s.
    """

    strategy_name = NAME

    def __init__(self, policy: Optional[str] = None, model_overlap: bool = True,
                 transport: Optional[str] = None, broadcast_buffers: bool = True,
                 accelerator: Optional[pl.accelerators.Accelerator] = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: str = "popen", **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(_PASSED))
        if unknown:
            raise TypeError(
                f"DCreditStrategy got unexpected argument(s) {', '.join(unknown)}: it takes "
                "policy, model_overlap, transport, broadcast_buffers, DDPStrategy's launch "
                f"arguments, and DistributedOptimizer's: {', '.join(_PASSED)} (DDP's own "
                "options such as find_unused_parameters do not apply: there is no DDP wrap)")
        if transport not in (None, "horovod", "torch.distributed"):
            raise ValueError(f"DCreditStrategy(transport={transport!r}): use 'horovod', "
                             "'torch.distributed' or leave it out")
        self.horovod = transport == "horovod" or (transport is None
                                                  and HorovodEnvironment.detect())
        if self.horovod and cluster_environment is None:
            cluster_environment = HorovodEnvironment()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)
        self.model_overlap = model_overlap
        self.broadcast_buffers = broadcast_buffers
        self._settings = dict(kwargs, transport="horovod" if self.horovod
                              else "torch.distributed")
        if policy is not None:
            self._settings["policy"] = policy
        self._wrapped: list[Optimizer] = []
        self._failed: Optional[BaseException] = None
        self._reduce_before_step = False
        self._sync_buffers_next = True           # DDP syncs before its first forward
        self._no_sync = False
        self._clip: Optional[Callable[..., None]] = None

    # -- launch and process group ------------------------------------------------------------
    def setup_distributed(self) -> None:
        """torch.distributed as ``DDPStrategy`` sets it up; under Horovod, ``hvd.init()``."""
        if not self.horovod:
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        _horovod()
        assert self.cluster_environment is not None
        self.cluster_environment.validate_settings(self.num_processes, self.num_nodes)

    # -- setup: no DDP wrap, state from rank 0, wrapped optimizers ---------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        """``DDPStrategy.setup`` without the DDP wrap: rank 0's state is broadcast instead."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            if self.horovod:
                raise RuntimeError(SYNC_BN_ON_HOROVOD)
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_module_state()
        self._failed = None
        self._sync_buffers_next = True
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._reduce_before_step = _grads_read_before_step(self, trainer)
            self._clip = _intercept_clipping(self.precision_plugin)

    def configure_ddp(self) -> None:
        """Never wraps (``setup`` does not call it; kept for code that does)."""

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers and schedulers, then each optimizer wrapped (before any
        checkpoint restore, which loads into the wrapper) and its schedulers pointed at it."""
        super().setup_optimizers(trainer)
        module = self.lightning_module
        assert module is not None
        wrapped = [self._wrap(opt, module, trainer) for opt in self.optimizers]
        for original, wrapper in zip(self.optimizers, wrapped):
            for config in self.lr_scheduler_configs:
                _repoint(config.scheduler, original, wrapper)
        self.optimizers = wrapped
        self._wrapped = list(wrapped)

    def _wrap(self, optimizer: Optimizer, module: pl.LightningModule,
              trainer: pl.Trainer) -> Optimizer:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if hasattr(optimizer, "synchronize") and hasattr(optimizer, "skip_synchronize"):
            raise TypeError(ALREADY_WRAPPED)
        settings = dict(self._settings)
        passes = settings.pop("backward_passes_per_step", None)
        if module.automatic_optimization:
            accumulate = trainer.accumulate_grad_batches
            if passes is not None and passes != accumulate:
                raise ValueError(PASSES_IN_AUTOMATIC.format(passes=passes, accumulate=accumulate))
            passes = accumulate
        wrapper = dcredit_hvd.DistributedOptimizer(
            optimizer, named_parameters=list(module.named_parameters()),
            backward_passes_per_step=passes or 1,
            model=module if self.model_overlap else None, **settings)
        if optimizer.state:                    # the user loaded a state into it already
            wrapper.load_state_dict(optimizer.state_dict())
        _closure_first(wrapper)
        return wrapper

    # -- the step ----------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union[pl.LightningModule, Module]] = None,
                       **kwargs: Any) -> Any:
        """The precision plugin's step, whose closure is followed by ``synchronize()`` when
        something reads the gradients before the step (``_grads_read_before_step``)."""
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._reduce_before_step or self._reads_grads_manually(raw):
            def closure_then_reduce() -> Any:
                result = closure()
                _reduce_now(raw)
                return result
            step_closure: Callable[[], Any] = closure_then_reduce
        else:
            step_closure = closure
        try:
            return super().optimizer_step(optimizer, step_closure, model, **kwargs)
        finally:
            if hasattr(raw, _SYNCED):
                setattr(raw, _SYNCED, False)    # a GradScaler may have skipped the step

    def _reads_grads_manually(self, optimizer: Optimizer) -> bool:
        """Manual optimization: ``on_before_optimizer_step`` runs inside ``step()``."""
        module = self.lightning_module
        return bool(module is not None and not module.automatic_optimization
                    and optimizer in self._wrapped
                    and is_overridden("on_before_optimizer_step", module))

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: the wrappers count backward passes (``backward_passes_per_step``)
        and send only at the last one.  Remembered for DDP's buffer rule (no sync after it)."""
        self._no_sync = True
        try:
            yield None
        finally:
            self._no_sync = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow ``accumulate_grad_batches`` if a callback changed it (a window starts at an
        epoch's first batch, and every window ends with a step, so nothing is half-counted)."""
        module = self.lightning_module
        if module is None or not module.automatic_optimization or module._trainer is None:
            return
        accumulate = module.trainer.accumulate_grad_batches
        if batch_idx % accumulate:
            return
        for opt in self._wrapped:
            if opt.backward_passes_per_step != accumulate:
                opt.set_backward_passes_per_step(accumulate)

    # -- buffers, as DDP's broadcast_buffers -------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._after_forward()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        try:
            return super().validation_step(*args, **kwargs)
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

    def _broadcast_module_state(self) -> None:
        """Rank 0's parameters and buffers on every rank (DDP does it when it wraps)."""
        assert self.model is not None
        if self.world_size <= 1:
            return
        if self.horovod:
            _horovod().broadcast_parameters(self.model.state_dict(), root_rank=0)
        else:
            _sync_module_states(self.model)

    def _broadcast(self, tensors: list[Tensor]) -> None:
        with torch.no_grad():
            (_horovod_broadcast if self.horovod else _torch_broadcast)(tensors)

    # -- collectives Lightning uses (logging, checkpoints): Horovod's under Horovod ----------
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.horovod:
            return super().barrier(*args, **kwargs)
        _horovod().barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.horovod:
            return super().broadcast(obj, src)
        return _horovod().broadcast_object(obj, root_rank=src)

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Any] = "mean") -> Any:
        if not self.horovod:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        return _horovod_reduce(tensor, reduce_op)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None,
                   sync_grads: bool = False) -> Tensor:
        if not self.horovod:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        return _horovod().allgather(tensor.unsqueeze(0))

    # -- end ---------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._failed = exception
        super().on_exception(exception)

    def teardown(self) -> None:
        """Each wrapper closed (its owed updates applied, its hooks off the model), unless the
        fit failed: then collectives may never complete, and the error surfaces as raised, or
        as ``PeerLostError`` when a collective of Lightning's (a barrier, ``sync_dist``, the
        buffer broadcast) met a dead peer before the scheduler did: the liveness channel names
        the rank, the collective library's error names an address."""
        if self._clip is not None:
            vars(self.precision_plugin).pop("clip_gradients", None)
            self._clip = None
        wrapped, failed = self._wrapped, self._failed
        if failed is None:
            for opt in wrapped:
                opt.close()
        self._wrapped = []
        super().teardown()
        if failed is not None and _communication_error(failed):
            lost = _peer_lost(wrapped, PEER_NAME_WAIT_S)
            if lost is not None:
                raise lost from failed

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if NAME not in strategy_registry:
            strategy_registry.register(
                NAME, cls, description="data-parallel training with dcredit_hvd's scheduled "
                "gradient all-reduces (torch.distributed or Horovod)")


def _horovod_reduce(tensor: Any, reduce_op: Any) -> Any:
    """``Strategy.reduce`` with Horovod's all-reduce (logging's ``sync_dist``, decisions)."""
    if not isinstance(tensor, Tensor):
        return tensor
    hvd = _horovod()
    op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
    ops = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
           "min": hvd.Min, "product": hvd.Product}
    if op not in ops:
        raise ValueError(f"dcredit_hvd.lightning: reduce_op {reduce_op!r} is not one of "
                         f"{', '.join(ops)} under Horovod")
    return hvd.allreduce(tensor, op=ops[op])


def _horovod_broadcast(tensors: list[Tensor]) -> None:
    """Rank 0's values into ``tensors``, in place, over Horovod."""
    hvd = _horovod()
    handles = [hvd.broadcast_async_(t, root_rank=0, name=f"dcredit.lightning.buffer{i}")
               for i, t in enumerate(tensors)]
    for handle in handles:
        hvd.synchronize(handle)


def _torch_broadcast(tensors: list[Tensor]) -> None:
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


def _grads_read_before_step(strategy: DCreditStrategy, trainer: pl.Trainer) -> bool:
    """Whether anything reads ``.grad`` between backward and step in automatic
    optimization: clipping, ``on_before_optimizer_step`` (module or callback), fp16's
    ``GradScaler`` (``unscale_``).  DDP gives them reduced gradients; so must we."""
    module = strategy.lightning_module
    if module is None or not module.automatic_optimization:
        return False
    return bool(
        (trainer.gradient_clip_val or 0) > 0
        or is_overridden("configure_gradient_clipping", module)
        or is_overridden("on_before_optimizer_step", module)
        or any(is_overridden("on_before_optimizer_step", cb, parent=Callback)
               for cb in trainer.callbacks)
        or getattr(strategy.precision_plugin, "scaler", None) is not None)


def _intercept_clipping(plugin: Precision) -> Callable[..., None]:
    """``clip_gradients`` (automatic clipping, and ``self.clip_gradients`` in manual
    optimization) sees reduced gradients: the optimizer is synchronized first."""
    original = type(plugin).clip_gradients.__get__(plugin)

    def clip_gradients(optimizer: Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: Any = None) -> None:
        if clip_val and clip_val > 0:
            _reduce_now(optimizer)
        if gradient_clip_algorithm is None:
            return original(optimizer, clip_val)
        return original(optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients        # type: ignore[method-assign]
    return clip_gradients


def _communication_error(exc: BaseException) -> bool:
    """An error of the collective library (Gloo's and NCCL's are plain ``RuntimeError``s)."""
    if isinstance(exc, PeerLostError):
        return False
    module = type(exc).__module__
    text = str(exc).lower()
    return (module.startswith(("torch.distributed", "horovod"))
            or any(word in text for word in ("gloo", "nccl", "connection", "horovod", "peer")))


def _peer_lost(wrapped: list[Optimizer], wait: float) -> Optional[PeerLostError]:
    """The ``PeerLostError`` a wrapper's scheduler holds or receives within ``wait`` s."""
    deadline = time.monotonic() + wait
    while wrapped:
        for opt in wrapped:
            try:
                opt._scheduler.check()
            except PeerLostError as lost:
                return lost
            except Exception:          # another failure of the same job: not a verdict
                pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return None


def _closure_first(wrapper: Optimizer) -> None:
    """``wrapper.step(closure)`` runs the closure, then the scheduler's ``step()`` (Horovod's
    would synchronize first); under ``skip_synchronize()`` when ``_reduce_now`` already
    synchronized.  Marked as torch's LR schedulers mark the step they track."""
    scheduler_step = type(wrapper).step

    def step(self: Optimizer, closure: Optional[Callable[[], Any]] = None,
             **kwargs: Any) -> Any:
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._opt_called = True                 # torch's LRScheduler warning
        if getattr(self, _SYNCED, False):
            setattr(self, _SYNCED, False)
            with self.skip_synchronize():
                scheduler_step(self, **kwargs)
        else:
            scheduler_step(self, **kwargs)
        return result

    step._wrapped_by_lr_sched = True            # type: ignore[attr-defined]
    wrapper.step = types.MethodType(step, wrapper)     # type: ignore[method-assign]
    setattr(wrapper, _SYNCED, False)


def _reduce_now(optimizer: Any) -> None:
    """Reduce the gradients of a wrapper now (once per step), for a reader before ``step``."""
    raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if hasattr(raw, _SYNCED) and not getattr(raw, _SYNCED):
        raw.synchronize()
        setattr(raw, _SYNCED, True)


def _repoint(scheduler: Any, original: Optimizer, wrapper: Optimizer) -> None:
    """A scheduler (and those a ``SequentialLR``/``ChainedScheduler`` holds) built on
    ``original`` now drives ``wrapper``; both share the param-group dicts already."""
    if getattr(scheduler, "optimizer", None) is original:
        scheduler.optimizer = wrapper
    inner: Iterable[Any] = getattr(scheduler, "_schedulers", None) or ()
    for each in inner:
        _repoint(each, original, wrapper)


DCreditStrategy.register_strategies(StrategyRegistry)
