"""``DistributedOptimizer``: the drop-in replacement for ``horovod.torch.DistributedOptimizer``.

Same factory contract as Horovod 0.28.1 (``horovod/torch/optimizer.py``): it returns an instance
of a new class with the user's optimizer class name that subclasses it, built from the
optimizer's ``param_groups``; ``synchronize()``, ``skip_synchronize()``, ``step()``,
``zero_grad()``, ``load_state_dict()`` and the error texts behave as Horovod's.  This module is
that contract only; the work is done by parts that act on one state object (``state.py``):
``gradients`` (hook to wire and back), ``lifecycle`` (profile, plan, re-plan, elastic),
``overlap`` (owed updates), ``instrument``, ``lifetime`` (close), assembled by ``runtime``.

The signature is Horovod's; ``None`` defaults are the chosen transport's (Horovod's
``Compression.none``, ``Average`` and global process set, or torch.distributed's default group
and mean).  The transport is ``transport=`` / ``DCREDIT_TRANSPORT``, else the library of the
group passed (``process_set`` or ``process_group``), else Horovod when it is initialised, else
torch.distributed (``transports.select``).  Horovod is imported only when it is the transport.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any, Optional

import torch

from . import arguments, transports
from .config import SchedulerConfig
from .planning.blocks import TensorLayout
from .runtime import lifetime, loading, shards
from .runtime.assembly import Parts, assemble
from .runtime.device import follow
from .runtime.instrument import log
from .runtime.state import OptimizerState

_ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_DOUBLE_SYNC = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)
_CLOSED = (
    "this DistributedOptimizer was closed{why}: its hooks are removed and it schedules nothing "
    "any more. Build a new dcredit_hvd.DistributedOptimizer over the parameters (its state can "
    "come from this one's state_dict()), or keep using this one and do not close it."
)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the generated subclass of the user's optimizer class."""

    def __init__(self, params, named, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, transport, model, config):
        # ``named``: the factory's checked named_parameters (``arguments.before_transport``).
        self._dcredit_base.__init__(self, params)
        state = self._state = OptimizerState(
            config=config, transport=transport, compression=compression, op=op,
            predivide=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
            passes=backward_passes_per_step, names={p: name for name, p in named},
            requires_update=[p for group in self.param_groups for p in group["params"]
                             if p.requires_grad])
        state.delay = {p: backward_passes_per_step for p in state.requires_update}
        state.elastic = transport.elastic
        state.enabled = transport.included() and (transport.job_size() > 1 or state.elastic)
        # With the model known, step() returns at once and each parameter is updated when its
        # gradient is reduced; every read of a parameter waits for its own update (read guard).
        state.overlap = model is not None and state.enabled
        self._parts: Optional[Parts] = (assemble(self, self._dcredit_base, state, model)
                                        if state.enabled else None)

    # -- Horovod's user-visible contract --------------------------------------------------
    @property
    def backward_passes_per_step(self) -> int:
        return self._state.passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self._state.passes = passes

    def set_backward_passes_per_step(self, passes: int) -> None:
        self._state.passes = passes
        self._state.reset_delays()

    state = shards.OPTIMIZER_STATE   # torch's; shard=True: a view of this rank's slices

    def synchronize(self) -> None:
        """Send whatever is left (zeros for gradients this rank never computed) and wait until
        every block is reduced and written back into ``p.grad``."""
        self._check_open()
        state = self._state
        if not state.enabled:
            state.synchronized = True
            return
        self._parts.gradients.send_rest()
        state.scheduler.wait_all()
        follow(state.cuda_stream)          # write-backs were queued on the producer stream
        state.updater.reset()              # the gradients are reduced; step() updates at once
        if state.sharded is not None:      # shards.py: each slice's gradient is in
            state.sharded.attach()
        elif state.gathers is not None:    # dear: the reduced gradients, all-gathered
            state.gathers.gather_now()
        state.synchronized = True
        self._parts.lifecycle.end_iteration()

    def apply_pending_updates(self) -> None:
        """Block until every update owed by the last ``step()`` is applied.

        Called automatically before the next backward sends anything, by
        ``state_dict()``/``load_state_dict()`` of the model and the optimizer, and at
        interpreter exit.  A single read of a parameter needs no call: the read guard makes it
        wait for that parameter's own update (``readguard.py``).
        """
        if self._parts is not None:
            self._parts.overlap.apply_pending_updates()

    def close(self) -> None:
        """Stop scheduling for good: apply what the last ``step()`` owes, remove every hook
        this optimizer put on the parameters and the model, and give the parameters their own
        classes back (read guard).  A new ``DistributedOptimizer`` can then be built over the
        same parameters (switching optimizers, re-creating one after a restore).  Runs no
        collective, so ranks may close at different moments.  Idempotent; afterwards
        ``step()`` and ``synchronize()`` raise, ``state_dict()`` still works."""
        self._close("")

    def _close(self, why: str) -> None:
        lifetime.close(self._state, self._parts and self._parts.overlap, self, why)

    def _check_open(self) -> None:
        if self._state.closed is not None:
            raise RuntimeError(_CLOSED.format(why=self._state.closed))

    @contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); clip...; with skip_synchronize(): step()`` (Horovod's pattern)."""
        self._state.should_synchronize = False
        try:
            yield
        finally:
            self._state.should_synchronize = True

    def step(self, closure=None):
        """Update the parameters from the reduced gradients.

        With ``model=`` given, returns as soon as everything is sent: each parameter is updated
        by this optimizer's own ``step`` as soon as its gradient is reduced, and any read of it
        waits for that update (the read guard).  Otherwise (and after ``synchronize()``, with a
        closure, or while ``dcredit`` profiles) it waits for every gradient, as Horovod does.
        """
        self._check_open()
        state = self._state
        if state.should_synchronize and state.synchronized:
            warnings.warn(_DOUBLE_SYNC, stacklevel=2)
        if self._can_overlap(closure):
            self._parts.gradients.send_rest()
            state.synchronized = False
            state.step_in_flight = True
            self._parts.overlap.start_step()
            return None
        if state.should_synchronize:
            self.synchronize()
        elif state.overlap and not state.fallback_logged and state.transport.job_rank() == 0:
            state.fallback_logged = True
            log.info("step() after synchronize(): parameters are updated at step() for such "
                     "iterations (no overlap with the next forward pass)")
        state.synchronized = False
        if state.sharded is not None:
            return state.sharded.step(closure)
        return self._dcredit_base.step(self, closure)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """shard=True: clip by the norm of every rank's slices (after ``synchronize()``)."""
        return shards.of(self._state, "clip_grad_norm_").clip_grad_norm_(max_norm, norm_type)

    def full_state_dict(self) -> dict:
        """shard=True: every rank's state in ``torch.optim``'s form (call on every rank)."""
        self.apply_pending_updates()
        saved = self._dcredit_base.state_dict(self)
        return shards.of(self._state, "full_state_dict").full_state_dict(saved)

    def _can_overlap(self, closure) -> bool:
        state = self._state
        return (state.overlap and state.should_synchronize and not state.synchronized
                and closure is None and state.profiler is None)

    def zero_grad(self, *args, **kwargs):
        state = self._state
        if state.enabled and state.pending:
            raise AssertionError(_ZERO_GRAD_RACE)
        if state.enabled and state.step_in_flight:
            return state.updater.zero_grad(args, kwargs)
        return self._dcredit_base.zero_grad(self, *args, **kwargs)

    def state_dict(self, *args, **kwargs):
        self.apply_pending_updates()
        saved = self._dcredit_base.state_dict(self, *args, **kwargs)
        sharded = self._state.sharded
        return saved if sharded is None else sharded.state_dict(saved["param_groups"])

    def load_state_dict(self, *args, **kwargs):
        """Restore optimizer state; anything still in flight is drained first, then all
        scheduler state is reset (elastic ``restore()`` relies on this; ``loading.py``)."""
        return loading.load_state_dict(self, self._dcredit_base, self._state, self._parts,
                                       args, kwargs)

    def raise_if_failed(self) -> None:
        """Raise a background thread's error (``PeerLostError``, ``StallError``...), if any."""
        if self._parts is not None:
            self._state.scheduler.check()

    # -- what the scheduler did, for the user and the tests ------------------------------------
    @property
    def plan(self):
        """The D-Credit plan in force (identical on every rank), or None before/without one."""
        return self._state.plan if self._state.enabled else None

    @property
    def measured(self):
        """``(Profile, CostModel)`` that ``dcredit`` planned from (rank 0's, on every rank)."""
        return self._state.measured if self._state.enabled else None

    @property
    def races(self) -> list[dict]:
        """Each finished race's table, winner, iterations, cost and refit (``runtime/race.py``)."""
        return list(self._state.races)

    @property
    def replans(self) -> list[dict]:
        """Online re-plans so far (``drift.py``): iteration, time, reason and the new plan."""
        return self._state.replans

    @property
    def sharded(self) -> bool:
        """``shard=True`` in force on several ranks: state, clipping and checkpoints by slice."""
        return self._state.sharded is not None

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self._state.config

    @property
    def layouts(self) -> list[TensorLayout]:
        """Tensor layouts in priority (forward) order; empty when the wrapper passes through."""
        return list(self._state.layouts) if self._state.enabled else []

    @property
    def last_submission_order(self) -> list[str]:
        """Block names this rank handed to the transport in the last iteration, in order."""
        return list(self._state.scheduler.submitted_names) if self._state.enabled else []

    # The state's machinery under the names tests and scripts read (soak, reliability).
    _scheduler = property(lambda self: self._state.scheduler)
    _updater = property(lambda self: self._state.updater)
    _queued = property(lambda self: self._state.queued)
    # Horovod's name for the parameter -> name map (its tests read it).
    _parameter_names = property(lambda self: self._state.names)

    _step_in_flight = property(lambda self: self._state.step_in_flight,
                               lambda self, value: setattr(self._state, "step_in_flight", value))


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression: Any = None,
                         backward_passes_per_step: int = 1,
                         op: Any = None,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: Any = None,
                         *,
                         model: Optional[torch.nn.Module] = None,
                         transport: Optional[str] = None,
                         process_group: Any = None,
                         policy: Optional[str] = None,
                         partition_bytes: Any = None,
                         group_bytes: Any = None,
                         shard: Optional[bool] = None,
                         credit_bytes: Any = None,
                         poll_seconds: Optional[float] = None,
                         stall_seconds: Optional[float] = None,
                         stall_abort_seconds: Optional[float] = None,
                         profile_warmup: Optional[int] = None,
                         profile_steps: Optional[int] = None,
                         profile_out: Optional[str] = None,
                         replan: Optional[bool] = None,
                         replan_time_threshold: Optional[float] = None,
                         replan_link_threshold: Optional[float] = None,
                         replan_patience: Optional[int] = None,
                         replan_seconds: Optional[float] = None,
                         tune: Optional[bool] = None,
                         tune_rounds: Any = None,
                         tune_drop: Optional[int] = None,
                         tune_margin: Optional[float] = None,
                         tune_force: Optional[str] = None, tune_byte_scale: Optional[float] = None,
                         cuda_staging: Optional[bool] = None,
                         race_amplifier: Optional[float] = None,
                         liveness: Optional[bool] = None,
                         liveness_interval: Optional[float] = None,
                         liveness_timeout: Optional[float] = None,
                         liveness_exit_seconds: Optional[float] = None):
    """Wrap ``optimizer`` so its gradients are all-reduced by the scheduler.

    Arguments up to ``process_set`` are ``hvd.DistributedOptimizer``'s, with the same meaning;
    ``None`` is the transport's default (no compression, the mean, every rank).  Keyword-only
    extras (each also settable by a ``DCREDIT_*`` variable; README "Configuration"):

    * ``model``: the ``torch.nn.Module`` being trained; lets the scheduler learn the order in
      which forward uses parameters (priority: nearest the input first).
    * ``transport``: ``"horovod"`` or ``"torch.distributed"`` (default: Horovod if initialised,
      else torch.distributed); ``process_group``: a torch.distributed group (``process_set``'s
      counterpart).  ``DCREDIT_TRANSPORT``.
    * ``policy``: ``"dcredit"`` (default), ``"bytescheduler"`` or ``"wfbp"``.  ``DCREDIT_POLICY``.
    * ``partition_bytes``, ``credit_bytes``: largest block (as sent), bytes in flight.
    * ``group_bytes``: ``dcredit`` sends runs of consecutive gradients smaller than this from
      one flat buffer (0: never); chosen by the planner unless given.
    * ``shard``: reduce-scatter instead of all-reduce; each rank updates, and keeps optimizer
      state for, its ``1/N`` of every block (``state[p]``: a read-only view of this rank's
      slice); the parameters are all-gathered, during the next forward with ``model=``
      (``runtime/shards.py``; ``clip_grad_norm_()``, ``full_state_dict()``).  ``DCREDIT_SHARD``.
    * the rest (polling, stalls, profiling, re-planning, the race (``tune``), CUDA staging,
      the race amplifier, the liveness channel) are ``SchedulerConfig``'s fields of the same
      names.
    """
    given = locals()      # the keyword extras are SchedulerConfig's fields, by name
    config = SchedulerConfig.resolve(**{name: given[name] for name in SchedulerConfig.ENV
                                        if name in given})
    # Arguments first, as Horovod: a bad one gets its own error even before hvd.init().
    named = arguments.before_transport(optimizer, named_parameters, num_groups, groups,
                                       backward_passes_per_step, op, model)
    library, group = transports.for_optimizer(config.transport, process_set, process_group)
    op, compression = (library.AVERAGE if op is None else op,
                       library.COMPRESSION_NONE if compression is None else compression)
    arguments.with_transport(op, gradient_predivide_factor, library)
    cls = _generated_class(optimizer.__class__, library)
    return cls(optimizer.param_groups, named, compression, backward_passes_per_step, op,
               gradient_predivide_factor, sparse_as_dense, library.transport(group), model, config)


def _generated_class(base: type, library: Any) -> type:
    """A subclass of the user's optimizer class with ``_DistributedOptimizer``'s methods."""
    namespace = dict(_DistributedOptimizer.__dict__)
    namespace["_dcredit_base"] = base
    # Horovod's broadcast_optimizer_state runs the *local* step() of optimizers whose module is
    # horovod.torch.optimizer, and the distributed one (a collective) otherwise; a local step is
    # what it needs, so the generated class declares that module, as Horovod's own does.
    namespace["__module__"] = library.local_step_module()
    return type(base.__name__, (base,), namespace)
