"""``lightning.Fabric(strategy="dcredit")``: Fabric's data parallelism with the gradients
all-reduced by ``dcredit_hvd``'s scheduler instead of a ``DistributedDataParallel`` wrap.

    import dcredit_hvd.frameworks.fabric        # registers "dcredit" in Fabric's registry
    fabric = lightning.Fabric(strategy="dcredit", accelerator="cpu", devices=2)

On ``ParallelStrategy``, not ``DDPStrategy``, whose backward-sync control raises for a module
that is not DDP-wrapped (only a private attribute could swap it).  Without one, Fabric's
documented contract makes ``fabric.no_backward_sync`` a no-op with a ``PossibleUserWarning``:
harmless, as the wrapper holds the gradients back until the last of
``DCreditFabricStrategy(backward_passes_per_step=N)`` passes (one too many raises).  Only
public ``Strategy`` methods are overridden; no private attribute of torch or Lightning is read
or written (``docs/frameworks-fabric.md``).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import lightning
import torch
import torch.distributed as dist
from lightning.fabric.strategies import STRATEGY_REGISTRY, ParallelStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

import dcredit_hvd
from dcredit_hvd.runtime.gradients import TOO_MANY_PASSES

from .fabric_launch import ScriptLauncher, init_processes
from .lightning_steps import torch_broadcast, unique_tensors
from .lightning_strategy import NAME, PASSED
from .versions import require

__all__ = ["NAME", "DCreditFabricStrategy"]

require("lightning", lightning.__version__)

ALREADY_WRAPPED = (
    "dcredit_hvd.frameworks.fabric: fabric.setup() got an optimizer that is already a "
    "dcredit_hvd.DistributedOptimizer (or Horovod's); with strategy='dcredit' pass the plain "
    "torch optimizer: the strategy wraps it (settings go to DCreditFabricStrategy(...)).")
NO_MODULE = (
    "dcredit_hvd.frameworks.fabric: the optimizer's parameters belong to no module set up "
    "with this strategy; call fabric.setup(model, optimizer) (or fabric.setup_module(model) "
    "first): the wrapper needs the model for its parameter names and forward order.")
MORE_PASSES = (
    "dcredit_hvd.frameworks.fabric: backward pass {done} before optimizer.step(), more than "
    "the wrapper's backward_passes_per_step: with strategy='dcredit', fabric.no_backward_sync "
    "does not hold gradients back (it is a no-op); set "
    "DCreditFabricStrategy(backward_passes_per_step=N), N micro-batches per step.")
DESCRIPTION = "data-parallel Fabric training with dcredit_hvd's scheduled gradient all-reduces"


class DCreditFabricStrategy(ParallelStrategy):
    """Data parallelism on torch.distributed, gradients reduced by ``dcredit_hvd``.

    Args:
        policy: ``"dcredit"`` (default), ``"bytescheduler"`` or ``"wfbp"``.
        model_overlap: pass ``model=`` to the wrapper: ``step()`` returns at once and each
            parameter is updated as soon as its gradient is reduced.
        broadcast_buffers: rank 0's buffers before a forward, when DDP would broadcast them.
        backward_passes_per_step: micro-batches per ``optimizer.step()`` (gradient
            accumulation; ``fabric.no_backward_sync`` is then a no-op, see the module's doc).
        **kwargs: the other ``dcredit_hvd.DistributedOptimizer`` keywords (``shard``,
            ``partition_bytes``, ``credit_bytes``...), and ``process_group_backend``/``timeout``.
    """

    strategy_name = NAME

    def __init__(self, policy: Optional[str] = None, model_overlap: bool = True,
                 broadcast_buffers: bool = True, accelerator: Any = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision: Any = None, process_group_backend: Optional[str] = None,
                 timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(PASSED))
        if unknown:
            raise TypeError(
                f"DCreditFabricStrategy got unexpected argument(s) {', '.join(unknown)}: it "
                "takes policy, model_overlap, broadcast_buffers, process_group_backend, timeout "
                f"and DistributedOptimizer's: {', '.join(PASSED)}")
        if kwargs.get("transport", "torch.distributed") != "torch.distributed":
            raise ValueError("DCreditFabricStrategy runs on torch.distributed only "
                             f"(transport={kwargs['transport']!r})")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision)
        self.settings = dict(kwargs, transport="torch.distributed")
        if policy is not None:
            self.settings["policy"] = policy
        self.model_overlap, self.broadcast_buffers = model_overlap, broadcast_buffers
        self.backend, self.timeout = process_group_backend, timeout
        self.wrappers: dict[int, tuple[Optimizer, Module]] = {}   # id(wrapper) -> it, model
        self.modules: list[Module] = []
        self.synced: set[int] = set()          # wrappers synchronize()d for the coming step
        self.backwards = 0                     # backward passes since the last step
        self.buffers_next: dict[int, bool] = {}
        self.hooks: list[Any] = []
        self._num_nodes = 1

    # -- processes -------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_nodes(self) -> int:
        """``Fabric(num_nodes=...)``: Fabric's connector sets it, as on DDP's strategy."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def devices_world_size(self) -> int:
        """The world DDP counts, devices x nodes: known before ``launch()``; the launcher's
        world is never taken smaller (``init_processes``)."""
        return self.num_nodes * self.num_processes

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """DDP's: the devices' world, or the launcher's where it says more."""
        return {"num_replicas": max(self.world_size, self.devices_world_size),
                "rank": self.global_rank}

    @property
    def launcher(self) -> Optional[ScriptLauncher]:
        """Fabric's own ``launch()`` from a plain ``python script.py`` (one node); nothing to
        start under torchrun, SLURM or another launcher that creates the processes."""
        env = self.cluster_environment
        if env is None or env.creates_processes_externally or self.num_processes < 2:
            return None
        return ScriptLauncher(env, self.num_processes)

    def setup_environment(self) -> None:
        """The device, the ranks and the default torch.distributed group, as DDP's."""
        super().setup_environment()
        init_processes(self)

    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    # -- setup: no DDP wrap, rank 0's state, wrapped optimizers --------------------------------
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[Module, list[Optimizer], Any]:
        module = self.setup_module(module)
        return module, [self.wrap(opt, module) for opt in optimizers], scheduler

    def setup_module(self, module: Module) -> Module:
        """Rank 0's parameters and buffers everywhere (DDP does it when it wraps); the
        buffer-broadcast hooks; the module itself is returned, not wrapped."""
        if self.world_size > 1:
            with torch.no_grad():
                torch_broadcast(unique_tensors(module))
        self.modules.append(module)
        if self.broadcast_buffers and self.world_size > 1:
            self.buffers_next[id(module)] = False       # just broadcast with the parameters
            self.hooks += [module.register_forward_pre_hook(self.before_forward),
                           module.register_forward_hook(self.after_forward)]
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in reversed(self.modules):
            if owned <= {id(p) for p in module.parameters()}:
                return self.wrap(optimizer, module)
        raise TypeError(NO_MODULE)

    def wrap(self, optimizer: Optimizer, module: Module) -> Optimizer:
        if hasattr(optimizer, "synchronize") and hasattr(optimizer, "skip_synchronize"):
            raise TypeError(ALREADY_WRAPPED)
        settings = dict(self.settings)
        passes = settings.pop("backward_passes_per_step", None) or 1
        wrapper = dcredit_hvd.DistributedOptimizer(
            optimizer, named_parameters=list(module.named_parameters()),
            backward_passes_per_step=passes, model=module if self.model_overlap else None,
            **settings)
        if optimizer.state:                           # a state loaded before setup
            wrapper.load_state_dict(optimizer.state_dict())
        self.wrappers[id(wrapper)] = (wrapper, module)
        return wrapper

    def is_sharded(self, wrapper: Optimizer) -> bool:
        return bool(wrapper.sharded)                                  # type: ignore[attr-defined]

    # -- buffers, by DDP's rule ------------------------------------------------------------
    def before_forward(self, module: Module, args: Any) -> None:
        buffers = [b.data for b in module.buffers() if b.numel()]
        if self.buffers_next.get(id(module)) and buffers:
            with torch.no_grad():
                torch_broadcast(buffers)

    def after_forward(self, module: Module, args: Any, output: Any) -> None:
        """DDP broadcasts before a forward that follows one with gradients and sync on; the
        sync is on for the last micro-batch of a step (``backward_passes_per_step``)."""
        passes = max((w.backward_passes_per_step for w, m in self.wrappers.values()
                      if m is module), default=1)
        self.buffers_next[id(module)] = (torch.is_grad_enabled()
                                         and (self.backwards + 1) % passes == 0)

    # -- backward, clipping, step ----------------------------------------------------------
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any,
                 **kwargs: Any) -> None:
        try:
            super().backward(tensor, module, *args, **kwargs)
        except AssertionError as exc:
            if str(exc) != TOO_MANY_PASSES:
                raise
            raise RuntimeError(MORE_PASSES.format(done=self.backwards + 1)) from exc
        self.backwards += 1

    def reduce_now(self, optimizer: Optimizer) -> bool:
        """``synchronize()`` once before something reads the gradients ahead of ``step()``."""
        if id(optimizer) not in self.wrappers:
            return False
        if id(optimizer) not in self.synced:
            optimizer.synchronize()                     # type: ignore[attr-defined]
            self.synced.add(id(optimizer))
        return True

    def clip_gradients_norm(self, module: Module, optimizer: Optimizer,
                            max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
                            error_if_nonfinite: bool = True) -> Tensor:
        """Clip by the global norm of the reduced gradients (of every rank's slices with
        ``shard=True``); the step then runs under ``skip_synchronize()``."""
        if not self.reduce_now(optimizer) or not self.is_sharded(optimizer):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type,
                                               error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        norm = optimizer.clip_grad_norm_(max_norm, norm_type)   # type: ignore[attr-defined]
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               "non-finite, so it cannot be clipped (error_if_nonfinite=True)")
        return norm

    def clip_gradients_value(self, module: Module, optimizer: Optimizer,
                             clip_val: Union[float, int]) -> None:
        """By value, on the reduced gradients; refused with ``shard=True``, where each rank's
        step reads its slices' gradients, not ``p.grad``."""
        if id(optimizer) in self.wrappers and self.is_sharded(optimizer):
            raise NotImplementedError("strategy='dcredit' with shard=True clips by norm only: "
                                      "fabric.clip_gradients(model, optimizer, max_norm=...)")
        self.reduce_now(optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The precision's step; under ``skip_synchronize()`` when the gradients were reduced
        already (clipping, or a ``GradScaler`` that unscales them inside the step)."""
        self.backwards = 0
        if getattr(self.precision, "scaler", None) is not None:
            self.reduce_now(optimizer)
        if id(optimizer) not in self.synced:
            return super().optimizer_step(optimizer, **kwargs)
        self.synced.discard(id(optimizer))
        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, **kwargs)

    # -- state, collectives, end -----------------------------------------------------------
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``shard=True``: every rank's slices in ``torch.optim``'s form (a collective; Fabric
        gathers the state on every rank and rank 0 writes it); it loads back on any job size."""
        if id(optimizer) in self.wrappers and self.is_sharded(optimizer):
            return optimizer.full_state_dict()              # type: ignore[attr-defined]
        return super().get_optimizer_state(optimizer)

    def all_reduce(self, tensor: Any, group: Optional[Any] = None,
                   reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return tensor
        name = reduce_op.lower() if isinstance(reduce_op, str) else None
        mean = name in ("mean", "avg")            # a sum then a division, in place, as DDP's
        op = (dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, name.upper()) if name
              else reduce_op)
        dist.all_reduce(tensor, op=op, group=group)
        if not mean:
            return tensor
        size = dist.get_world_size(group)
        return tensor.div_(size) if tensor.is_floating_point() else tensor.copy_(tensor / size)

    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src)
        return box[0]

    def teardown(self) -> None:
        """Each wrapper closed (owed updates applied, its hooks off the model), our hooks off."""
        for wrapper, _ in self.wrappers.values():
            wrapper.close()                                 # type: ignore[attr-defined]
        for hook in self.hooks:
            hook.remove()
        self.wrappers, self.hooks, self.modules = {}, [], []
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if NAME not in strategy_registry:
            strategy_registry.register(NAME, cls, description=DESCRIPTION)




DCreditFabricStrategy.register_strategies(STRATEGY_REGISTRY)
