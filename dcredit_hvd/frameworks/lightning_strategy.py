"""The body of ``strategy="dcredit"``, shared by both Lightning packages.

``DCreditStrategyBody`` is mixed in before a package's ``DDPStrategy``
(``frameworks/pytorch_lightning.py``, ``frameworks/lightning.py``); everything it needs from
the package comes through the class's ``kit`` (``lightning_steps.LightningKit``), so a
``lightning`` type never meets a ``pytorch_lightning`` one in a run.  It is ``StrategyCore``
(here: the wrap, the optimizers, the step, the end), ``lightning_buffers.RankZeroState``
(rank 0's parameters and buffers, DDP's buffer rule) and ``horovod_env.HorovodCollectives``
(the process group and Lightning's collectives under Horovod).

Subclassing ``DDPStrategy`` rather than ``ParallelStrategy``: the launch (``torchrun``,
Lightning's own subprocess launcher, SLURM...), process-group set-up, rank bookkeeping, the
distributed sampler, ``is_distributed`` and the collectives used by logging and checkpointing
are DDP's and stay right without a line here; only the wrap, the optimizers and the step
differ (``docs/frameworks-lightning.md``).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, ClassVar, Optional

import torch
from torch.optim import Optimizer

import dcredit_hvd

from . import horovod_env
from .horovod_env import HorovodCollectives
from .lightning_buffers import RankZeroState
from .lightning_steps import (
    SHARD_CLIP_VALUE,
    SYNCED,
    LightningKit,
    by_value,
    closure_first,
    communication_error,
    grads_read_before_step,
    intercept_clipping,
    peer_lost,
    reduce_now,
    repoint,
    sharded,
)

NAME = "dcredit"

#: ``DistributedOptimizer`` arguments the strategy sets itself.
_OWN = ("optimizer", "named_parameters", "model")
#: ``DistributedOptimizer`` arguments a user may pass through ``DCreditStrategy(**kwargs)``.
PASSED = tuple(name for name in inspect.signature(dcredit_hvd.DistributedOptimizer).parameters
               if name not in _OWN)
#: How long a collective library's error waits for the liveness channel to name a lost peer.
PEER_NAME_WAIT_S = 3.0

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
#: The registered names and their ``start_method``, as ``ddp``, ``ddp_spawn``... are DDP's.
START_METHODS = {NAME: "popen", f"{NAME}_spawn": "spawn", f"{NAME}_fork": "fork",
                 f"{NAME}_notebook": "fork"}
SPAWN_ON_HOROVOD = (
    "dcredit_hvd.lightning: DCreditStrategy(start_method={method!r}) starts its own processes, "
    "but this job runs on Horovod, whose launcher (horovodrun or mpirun) already started them: "
    "use strategy='dcredit', or launch with python or torchrun for the torch.distributed "
    "transport."
)
DESCRIPTION = ("data-parallel training with dcredit_hvd's scheduled gradient all-reduces "
               "(torch.distributed or Horovod)")


class StrategyCore:
    """The wrap, the optimizers and the step of ``DCreditStrategyBody``."""

    strategy_name = NAME
    kit: ClassVar[LightningKit]
    #: ``DDPStrategy``'s launch arguments (no wrapping option: there is no DDP wrap).
    LAUNCH = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
              "precision_plugin", "process_group_backend", "timeout", "start_method")

    def __init__(self, policy: Optional[str] = None, model_overlap: bool = True,
                 transport: Optional[str] = None, broadcast_buffers: bool = True,
                 **kwargs: Any) -> None:
        launch = {k: kwargs.pop(k) for k in self.LAUNCH if k in kwargs}
        unknown = sorted(set(kwargs) - set(PASSED))
        if unknown:
            raise TypeError(
                f"DCreditStrategy got unexpected argument(s) {', '.join(unknown)}: it takes "
                "policy, model_overlap, transport, broadcast_buffers, DDPStrategy's launch "
                f"arguments, and DistributedOptimizer's: {', '.join(PASSED)} (DDP's own "
                "options such as find_unused_parameters do not apply: there is no DDP wrap)")
        if transport not in (None, "horovod", "torch.distributed"):
            raise ValueError(f"DCreditStrategy(transport={transport!r}): use 'horovod', "
                             "'torch.distributed' or leave it out")
        self.horovod = transport == "horovod" or (transport is None and horovod_env.detect())
        if self.horovod and launch.get("start_method", "popen") != "popen":
            raise ValueError(SPAWN_ON_HOROVOD.format(method=launch["start_method"]))
        if self.horovod and launch.get("cluster_environment") is None:
            launch["cluster_environment"] = self.kit.HorovodEnvironment()
        super().__init__(**launch)                                   # type: ignore[call-arg]
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

    # -- setup: no DDP wrap, state from rank 0, wrapped optimizers ---------------------------
    def setup(self, trainer: Any) -> None:
        """``DDPStrategy.setup`` itself (layer sync, precision, device, optimizers); its
        ``configure_ddp`` step is ours: rank 0's state is broadcast instead of a DDP wrap."""
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == self.kit.TrainerFn.FITTING
        super().setup(trainer)                                       # type: ignore[misc]
        if fitting and self.horovod and any(isinstance(m, torch.nn.SyncBatchNorm)
                                            for m in self.model.modules()):
            raise RuntimeError(SYNC_BN_ON_HOROVOD)
        if fitting:
            self._reduce_before_step = grads_read_before_step(
                self.kit, self.lightning_module, trainer, self.precision_plugin)
            self._clip = intercept_clipping(self.kit, self.precision_plugin)

    def configure_ddp(self) -> None:
        """Where ``DDPStrategy.setup`` wraps the model: no wrap; rank 0's parameters and
        buffers on every rank (the optimizers are wrapped next, in ``setup_optimizers``)."""
        self.broadcast_rank0_state()
        self._failed = None

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's optimizers and schedulers, then each optimizer wrapped (before any
        checkpoint restore, which loads into the wrapper) and its schedulers pointed at it."""
        super().setup_optimizers(trainer)                            # type: ignore[misc]
        module = self.lightning_module
        assert module is not None
        wrapped = [self._wrap(opt, module, trainer) for opt in self.optimizers]
        for original, wrapper in zip(self.optimizers, wrapped):
            for config in self.lr_scheduler_configs:
                repoint(config.scheduler, original, wrapper)
        self.optimizers = wrapped
        self._wrapped = list(wrapped)

    def _wrap(self, optimizer: Optimizer, module: Any, trainer: Any) -> Optimizer:
        optimizer = self.kit.raw(optimizer)
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
        if (settings.get("shard") and trainer.gradient_clip_val
                and by_value(trainer.gradient_clip_algorithm)):
            raise ValueError(SHARD_CLIP_VALUE)
        if optimizer.state:                    # the user loaded a state into it already
            wrapper.load_state_dict(optimizer.state_dict())
        closure_first(wrapper)
        return wrapper

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        """What a checkpoint saves: with ``shard=True`` the full state (every rank's slices,
        collected on every rank: Lightning dumps a checkpoint on all of them), loadable by a
        plain torch optimizer; ``load_state_dict`` takes it back into the slices."""
        raw = self.kit.raw(optimizer)
        if sharded(raw):
            return raw.full_state_dict()
        return super().optimizer_state(optimizer)                   # type: ignore[misc]

    # -- the step ----------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        """The precision plugin's step, whose closure is followed by ``synchronize()`` when
        something reads the gradients before the step (``grads_read_before_step``)."""
        raw = self.kit.raw(optimizer)
        if self._reduce_before_step or self._reads_grads_manually(raw):
            def closure_then_reduce() -> Any:
                result = closure()
                reduce_now(raw)
                return result
            step_closure: Callable[[], Any] = closure_then_reduce
        else:
            step_closure = closure
        try:
            return super().optimizer_step(optimizer, step_closure, model,  # type: ignore[misc]
                                          **kwargs)
        finally:
            if hasattr(raw, SYNCED):
                setattr(raw, SYNCED, False)    # a GradScaler may have skipped the step

    def _reads_grads_manually(self, optimizer: Optimizer) -> bool:
        """Manual optimization: ``on_before_optimizer_step`` runs inside ``step()``."""
        module = self.lightning_module
        return bool(module is not None and not module.automatic_optimization
                    and optimizer in self._wrapped
                    and self.kit.is_overridden("on_before_optimizer_step", module))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow ``accumulate_grad_batches`` if a callback changed it (a window starts at an
        epoch's first batch, and every window ends with a step, so nothing is half-counted)."""
        module = self.lightning_module
        if module is None or not module.automatic_optimization:
            return
        try:
            accumulate = module.trainer.accumulate_grad_batches
        except RuntimeError:                  # not attached to a Trainer
            return
        if batch_idx % accumulate:
            return
        for opt in self._wrapped:
            if opt.backward_passes_per_step != accumulate:
                opt.set_backward_passes_per_step(accumulate)

    # -- end ---------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._failed = exception
        super().on_exception(exception)                              # type: ignore[misc]

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
        super().teardown()                                           # type: ignore[misc]
        if failed is not None and communication_error(failed):
            lost = peer_lost(wrapped, PEER_NAME_WAIT_S)
            if lost is not None:
                raise lost from failed

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"dcredit"`` and, as DDP's names do, its start methods: ``"dcredit_spawn"``,
        ``"dcredit_fork"`` and ``"dcredit_notebook"`` (fork, for Jupyter)."""
        for name, start_method in START_METHODS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"{DESCRIPTION}; start "
                                           f"method {start_method!r}", start_method=start_method)


class DCreditStrategyBody(StrategyCore, RankZeroState, HorovodCollectives):
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
            ``backward_passes_per_step`` in manual optimization only; and ``DDPStrategy``'s
            launch arguments (``process_group_backend``, ``timeout``, ``cluster_environment``...).
    """
