"""``DistributedOptimizer``: the drop-in replacement for ``horovod.torch.DistributedOptimizer``.

Same factory contract as Horovod 0.28.1 (``horovod/torch/optimizer.py``): it returns an instance
of a new class with the user's optimizer class name that subclasses it, built from the
optimizer's ``param_groups``; ``synchronize()``, ``skip_synchronize()``, ``step()``,
``zero_grad()``, ``load_state_dict()`` and the error texts behave as Horovod's.  What differs is
how gradients travel: each one is cut into blocks (``blocks``), queued by priority and released
to Horovod by a policy (``scheduler``, ``policies``) instead of being submitted whole at once.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import horovod.torch as hvd
import torch

from . import agreement, comm, instances, planning, timeline
from .amplifier import RaceAmplifier
from .blocks import TensorLayout, build_layout
from .config import SchedulerConfig
from .device import CudaTransfer, Ticket, follow
from .drift import DriftDetector
from .policies import Immediate, make_policy
from .profiler import StepProfiler, measure_cost_model
from .readguard import ReadGuard
from .scheduler import BlockScheduler, Item, SchedulerError
from .updates import ParameterUpdater
from .weak import weakly

log = logging.getLogger("dcredit_hvd")

_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_CLOSED = (
    "this DistributedOptimizer was closed{why}: its hooks are removed and it schedules nothing "
    "any more. Build a new dcredit_hvd.DistributedOptimizer over the parameters (its state can "
    "come from this one's state_dict()), or keep using this one and do not close it."
)
_DETACHED = (
    "dcredit_hvd: a new DistributedOptimizer was built over {count} parameter(s) that an older "
    "one still hooks ({names}); the older one is closed now (its owed updates were applied and "
    "its hooks removed), so no gradient is counted twice, and using it again raises an error. "
    "Call close() on an optimizer before building its replacement to silence this warning."
)
_CLOSE_MID_ITERATION = (
    "dcredit_hvd: the optimizer was closed (or a new one built over its parameters) after "
    "loss.backward() and before step() or synchronize(): that backward's gradients are being "
    "all-reduced with the other ranks. Call step() (or synchronize()) first, then close it."
)
_DOUBLE_SYNC = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time, not at creation: a test runner that
    captured and closed an earlier stderr must not turn the exit-time report into a logging
    traceback."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass

_SHUTDOWN_IN_FLIGHT = (
    "dcredit_hvd: hvd.shutdown() was called while the last step()'s gradients were still being "
    "all-reduced, so their updates are lost. With model= given, step() returns before its "
    "updates are applied (they overlap the next forward): call opt.apply_pending_updates() "
    "before hvd.shutdown(), or leave model= out for a step() that waits."
)


def _setup_logging() -> None:
    if not log.handlers:
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("[dcredit_hvd] %(message)s"))
        log.addHandler(handler)
        log.setLevel(os.environ.get("DCREDIT_LOG_LEVEL", "INFO").upper())
        log.propagate = False


def _apply_at_exit(ref) -> None:
    """A script that ends right after its last step() still ends with every update applied."""
    opt = ref()
    if opt is not None and opt._step_in_flight:
        try:
            opt.apply_pending_updates()
        except Exception as exc:  # the interpreter is exiting: report, do not mask the exit
            log.error("dcredit_hvd: the last step's updates could not be applied at exit: %s", exc)


def _amplified(amplify: RaceAmplifier, call):
    """``call`` behind a race-amplifier sleep (completion thread: polls and collects)."""
    def amplified(*args, **kwargs):
        amplify()
        return call(*args, **kwargs)
    return amplified


def _collected(hooks: _Hooks) -> None:
    """Finalizer of a collected optimizer (nothing was in flight: in-flight blocks and owed
    updates keep it alive): its hooks go; its idle completion thread ends by itself.  Nothing
    here takes a lock: a finalizer may run in any thread, inside any critical section."""
    hooks.remove()


def _compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs code compiled by ``torch.compile``: it is (or holds) the module
    ``torch.compile(m)`` returns, or a module compiled in place (``m.compile()``).  Read from
    the attributes those set (``_orig_mod``, ``_compiled_call_impl``): torch has no public test."""
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


class _Hooks:
    """Every hook handle an optimizer registered; ``remove`` takes them all off (``close()``,
    or the finalizer of a collected optimizer: it must not reference the optimizer itself)."""

    def __init__(self) -> None:
        self.handles: list = []          # parameter and model hooks, for the optimizer's life
        self.layers: list = []           # per-layer forward hooks, only while they are read

    def remove(self) -> None:
        for handle in self.handles + self.layers:
            handle.remove()
        self.handles.clear()
        self.layers.clear()


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the generated subclass of the user's optimizer class."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, process_set, model, config):
        self._dcredit_base.__init__(self, params)
        self._compression = compression
        self._op = op
        self._gradient_predivide_factor = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._config: SchedulerConfig = config
        self.backward_passes_per_step = backward_passes_per_step

        named = self._check_named_parameters(named_parameters)
        self._parameter_names = {p: name for name, p in named}
        self._requires_update = [p for group in self.param_groups for p in group["params"]
                                 if p.requires_grad]
        self._allreduce_delay = {p: backward_passes_per_step for p in self._requires_update}
        if model is not None:
            self._check_model(model)
        self._pending: set = set()      # fired at least once since the last synchronize
        self._queued: set = set()       # blocks handed to the scheduler this iteration
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = _Hooks()
        self._closed: Optional[str] = None   # why it was closed (close(), or a newer optimizer)
        self._forward_order_applied = False
        self._step_in_flight = False       # an overlapped step() whose updates may be owed
        self._layer_started: dict = {}     # module -> forward start (timeline)
        self._compiled: Optional[bool] = None   # model= holds torch.compile'd code (first forward)
        self._cuda: Optional[CudaTransfer] = None   # CUDA gradients only (device.py)
        self._cuda_stream = None           # the stream that produced the last CUDA gradients
        self._fallback_logged = False
        #: Online re-plans so far (``drift.py``): iteration, time, reason and the new plan.
        self.replans: list[dict] = []

        #: Under ``horovodrun --min-np/--max-np`` ranks come and go (see ``_follow_membership``).
        self._elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._enabled = process_set.included() and (comm.size() > 1 or self._elastic)
        if not self._enabled:
            return
        self._take_over(self._requires_update)
        # Every collective this optimizer issues is named under its own prefix (instances.py).
        self._initial = self._initial_order()
        self._prefix = instances.prefix_for(
            getattr(process_set, "process_set_id", None),
            [(self._parameter_names[p], tuple(p.shape)) for p in self._initial])
        self._membership = self._current_membership()
        self._membership_lost = False       # a failed collective: elastic will re-initialise
        # With the model known, step() returns at once and each parameter is updated when its
        # gradient is reduced; every read of a parameter waits for its own update (read guard,
        # docs/design.md, "Overlap").
        self._overlap = model is not None
        self._amplify = RaceAmplifier(config.race_amplifier)
        # Every read of a parameter whose update is owed waits for it (readguard.py); the same
        # guard observes the order in which the first forward reads the parameters.
        self._guard = ReadGuard(self._wait_for_reads) if self._overlap else None
        self._order = list(self._initial)
        # dcredit re-plans when the job drifts from what its plan was made for (drift.py);
        # elastic jobs get a new profile and plan at every membership change instead.
        self._drift = (DriftDetector(config.drift_settings())
                       if config.policy == "dcredit" and config.replan and not self._elastic
                       else None)
        self._control: Optional[int] = None   # this iteration's control word (its handle)
        self._last_end: Optional[float] = None
        self._iteration = 0
        self._replan_reason: Any = None       # set when a re-plan was agreed
        gate_policy = self._start_schedule()
        if self._elastic:
            # A worker that joins constructs its optimizer while the others are in
            # hvd.elastic's sync(): a collective here would never be matched.
            if comm.rank() == 0:
                _setup_logging()
                log.info("elastic job: the cross-rank agreement check is skipped; elastic's "
                         "sync() broadcasts rank 0's state to every new worker instead")
        else:
            self._check_agreement(backward_passes_per_step, model is not None)
            self._check_layouts("at construction")
        poll, collect = comm.poll, comm.collect
        if self._amplify:
            poll, collect = _amplified(self._amplify, poll), _amplified(self._amplify, collect)
        self._scheduler = BlockScheduler(
            gate_policy, submit=weakly(self._submit_item), poll=poll, collect=collect,
            poll_seconds=config.poll_seconds, stall_seconds=config.stall_seconds,
            stall_abort_seconds=config.stall_abort_seconds,
            timeline=timeline.from_env(comm.rank()),
            passthrough=(comm.HorovodInternalError,),
            # A dead peer raises PeerLostError in seconds (liveness.py); elastic jobs rely on
            # Horovod's own failure detection and reset instead.
            liveness=None if self._elastic else comm.watch_peers(self._process_set,
                                                                   config.liveness_settings()))
        self._timeline = self._scheduler.timeline
        self._last_ready = None             # for the backward track of the timeline
        self._updater = ParameterUpdater(self, self._dcredit_base, self._scheduler.check,
                                         guard=self._guard, jitter=self._amplify)
        self._register_hooks(model)
        instances.register(self, self._prefix, self._requires_update)
        weakref.finalize(self, _collected, self._hooks)
        if self._overlap:
            atexit.register(_apply_at_exit, weakref.ref(self))
        if comm.rank() == 0:
            _setup_logging()
            blocks = sum(len(t.blocks) for t in self._layouts)
            log.info("%s; policy %s; %d tensors, %d blocks, %d bytes per iteration",
                     config.summary(), self._policy.describe(), len(self._layouts), blocks,
                     sum(t.nbytes for t in self._layouts))

    # -- construction -------------------------------------------------------------------
    def _check_named_parameters(self, named_parameters):
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. "
                             f"Found duplicates: {', '.join(dups)}")
        all_params = {id(v) for _, v in named_parameters}
        unnamed = [id(p) for group in self.param_groups for p in group["params"]
                   if id(p) not in all_params]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             "were not named. Python object ids: "
                             f"{', '.join(str(i) for i in unnamed)}")
        # Several names for one tensor (tied weights): keep the first, as model.named_parameters().
        seen, unique = set(), []
        for name, p in named_parameters:
            if p not in seen:
                seen.add(p)
                unique.append((name, p))
        return unique

    def _check_agreement(self, backward_passes_per_step: int, overlap: bool) -> None:
        """Every rank must send the same blocks under the same names, or Horovod waits for ever
        for names some rank never submits.  One all-gather of each rank's description at
        construction turns that hang into an error, on every rank, naming the first difference.
        (Its collective's name is not under the prefix: the prefix is one of the things checked.)
        """
        mine = {
            "parameters": [(self._parameter_names[p], tuple(p.shape), str(p.dtype))
                           for p in self._order],
            "model": overlap,
            "policy": self._config.policy,
            "partition_bytes": self._config.partition_bytes,
            "group_bytes": self._config.group_bytes,
            "replan": self._config.replan,
            "backward_passes_per_step": backward_passes_per_step,
            "op": str(self._op),
            "compression": getattr(self._compression, "__name__", type(self._compression).__name__),
            # Last: it differs whenever the parameters do; alone, ranks built different numbers
            # of optimizers over these parameters before (instances.py).
            "prefix": self._prefix,
        }
        agreement.check_construction(mine, self._allgather, "dcredit.agreement")

    def _allgather(self, obj: Any, name: str) -> list:
        return comm.allgather_object(obj, process_set=self._process_set, name=name)

    def _broadcast(self, obj: Any, name: str) -> Any:
        return comm.broadcast_object(obj, root_rank=0, process_set=self._process_set, name=name)

    def _check_layouts(self, when: str) -> None:
        """Before blocks of a new layout go out, every rank's layout must be rank 0's
        (``agreement.check_layouts``: unit names, members, shapes, dtypes, order, blocks)."""
        members = [[(self._parameter_names[p], tuple(p.shape), str(p.dtype)) for p in params]
                   for params in self._members]
        agreement.check_layouts(agreement.describe_layouts(self._layouts, members),
                                self._allgather, f"{self._prefix}.layout", when)

    def _take_over(self, params: list) -> None:
        """Close every live optimizer that still hooks any of ``params`` (``instances.py``):
        after a collection, the survivors are really in use elsewhere, so say so."""
        older = instances.holders(params)
        if older:
            gc.collect()                 # a dropped optimizer may only wait for the collector
            older = instances.holders(params)
        for opt in older:
            shared = [p for p in params if p in set(opt._requires_update)]
            names = [self._parameter_names[p] for p in shared]
            warnings.warn(_DETACHED.format(count=len(shared), names=", ".join(names[:3])
                                           + (", ..." if len(names) > 3 else "")), stacklevel=4)
            opt._close("when a newer DistributedOptimizer was built over its parameters")

    def _initial_order(self) -> list:
        """Tensor order before forward was observed: the order parameters were named in."""
        position = {p: i for i, p in enumerate(self._parameter_names)}
        return sorted(self._requires_update, key=position.__getitem__)

    def _check_model(self, model: torch.nn.Module) -> None:
        """With ``model=``, priority follows the order in which ``model``'s forward reads the
        parameters, and the overlapped step is only safe for the model given: every parameter
        this optimizer updates must belong to ``model`` (a different model is a mistake)."""
        owned = set(model.parameters())
        orphans = [p for p in self._requires_update if p not in owned]
        if not orphans:
            return
        if len(orphans) == len(self._requires_update):
            raise ValueError(
                f"model= was given a {type(model).__name__} none of whose parameters are "
                "updated by this optimizer: pass the model whose parameters the optimizer "
                "updates (the one named_parameters comes from), or leave model= out")
        names = [self._parameter_names[p] for p in orphans]
        raise ValueError(
            f"dcredit_hvd: model= ({type(model).__name__}) does not contain {len(names)} "
            f"parameter(s) that this optimizer updates: {', '.join(names[:8])}"
            f"{', ...' if len(names) > 8 else ''}. With model=, step() returns before its "
            "updates are applied and the priority order comes from model's forward, so every "
            "parameter the optimizer updates must be part of model: register them in a "
            "module of model (or pass one nn.Module holding the model and them), or leave "
            "model= out so that step() waits like hvd.DistributedOptimizer")

    def _element_size(self, p: torch.Tensor) -> int:
        """Bytes per element as sent, after compression (fp16 compression halves float32)."""
        sample, _ = self._compression.compress(torch.zeros(1, dtype=p.dtype, device=p.device))
        return sample.element_size()

    def _build_layouts(self, partition_bytes: Optional[int],
                       groups: tuple[int, ...] = ()) -> list[TensorLayout]:
        """The units of ``self._order`` (``groups``: runs sharing a flat buffer, from the plan)
        and, per parameter, its unit and its offset in the unit's buffer."""
        layouts = build_layout([self._parameter_names[p] for p in self._order],
                               [p.numel() for p in self._order],
                               [self._element_size(p) for p in self._order],
                               partition_bytes, prefix=self._prefix, groups=groups)
        self._index, self._offset, self._members = {}, {}, []
        for layout in layouts:
            params = [self._order[i] for i in layout.members]
            offset = 0
            for p, numel in zip(params, layout.member_numels):
                self._index[p], self._offset[p] = layout.index, offset
                offset += numel
            self._members.append(params)
        self._buffers: dict[int, torch.Tensor] = {}    # grouped unit -> its flat buffer
        self._slots: dict = {}                         # member -> its view of the buffer
        self._arrived: dict[int, list] = {}            # grouped unit -> gradients copied in
        return layouts

    def _kind(self, p: torch.Tensor) -> str:
        """``Profile.kinds``: tensors of one dtype on the CPU may share a flat buffer; CUDA
        gradients are never grouped (their staging path, ``device.py``, is per tensor)."""
        return "" if p.device.type != "cpu" else f"{p.dtype}"

    def _register_hooks(self, model: Optional[torch.nn.Module]) -> None:
        """Hooks hold the optimizer weakly (``weak.py``): a model outlives its optimizers."""
        for p in self._requires_update:
            self._hooks.handles.append(
                p.register_post_accumulate_grad_hook(weakly(self._grad_ready)))
        if model is None:
            return
        owned = set(self._requires_update)
        self._module_names = {m: n or type(m).__name__ for n, m in model.named_modules()}
        self._guard.observe(self._requires_update)
        self._layer_params = {module: params for module in model.modules()
                              if (params := [p for p in module.parameters(recurse=False)
                                             if p in owned])}
        self._hooks.handles += [
            model.register_forward_pre_hook(weakly(self._model_forward_start)),
            model.register_forward_hook(weakly(self._model_forward_end), always_call=True),
            # Readers of parameters between iterations see every update applied.
            model.register_state_dict_pre_hook(weakly(self._before_state_dict)),
            model.register_load_state_dict_pre_hook(weakly(self._before_load)),
        ]
        self._time_layers(self._profiler is not None or self._timeline is not None)

    def _before_state_dict(self, *args) -> None:
        self.apply_pending_updates()

    def _before_load(self, *args) -> None:
        self._settle_for_load()

    def _time_layers(self, on: bool) -> None:
        """Per-layer forward hooks exist only while something reads them (the profiler, the
        timeline): two Python hooks per layer cost every forward a few microseconds per layer."""
        layers = self._hooks.layers
        if not on:
            for handle in layers:
                handle.remove()
            layers.clear()
        elif not layers:
            start, end = weakly(self._layer_start), weakly(self._layer_end)
            for module in self._layer_params:
                layers.append(module.register_forward_pre_hook(start))
                layers.append(module.register_forward_hook(end))

    def _layer_start(self, module, inputs) -> None:
        # No wait here: the read guard makes each read of a parameter wait for its update.
        if self._profiler is not None:
            self._profiler.layer_start(module)
        if self._timeline is not None:
            self._layer_started[module] = time.perf_counter()

    def _layer_end(self, module, inputs, output) -> None:
        if self._profiler is not None:
            self._profiler.layer_end(module, self._layer_params[module])
        if self._timeline is not None and module in self._layer_started:
            self._timeline.layer("forward", self._module_names[module],
                                 self._layer_started.pop(module), time.perf_counter())

    def _model_forward_start(self, module, inputs):
        self._scheduler.check()             # a completion-thread error surfaces in forward
        if self._compiled is None:
            self._compiled = _compiled(module)
        if self._compiled:
            # Code compiled by torch.compile reads parameters where the read guard cannot
            # wait (dynamo traces the guard once, then its graph never waits): no parameter
            # may be held or observed when it runs.  The first forward's order is not observed
            # (construction order stays), and each forward starts once every update is applied.
            self._guard.stop_observing()
            self._wait_for_reads(self._requires_update)
        self._guard.forward_started()

    def _model_forward_end(self, module, inputs, output):
        self._guard.forward_ended()
        if self._profiler is not None:
            self._profiler.forward_end()
        if self._timeline is not None:
            self._last_ready = time.perf_counter()

    def _apply_forward_order(self) -> None:
        """Re-index tensors in the order rank 0's first forward read them (spec §2), once,
        between iterations, on every rank at the same step; parameters that forward never read
        keep their relative order, after the others.  The order is rank 0's, broadcast: each
        rank's own forward may read other parameters (LayerDrop, MoE routing, a branch taken by
        one rank), and units cut from different orders would not match on the wire
        (``agreement.py``).  Tensors are compared by identity, never by value."""
        if self._forward_order_applied or self._guard is None:
            return
        self._forward_order_applied = True
        position = {id(p): i for i, p in enumerate(self._initial)}
        first_reads = [position[id(p)] for p in self._guard.stop_observing() if id(p) in position]
        chosen = agreement.agree_order(first_reads, len(self._initial), self._is_gate,
                                       self._broadcast, f"{self._prefix}.order")
        order = [self._initial[i] for i in chosen]
        if [id(p) for p in order] != [id(p) for p in self._order]:
            self._order = order
            self._layouts = self._build_layouts(self._layouts_partition(),
                                                self._plan.groups if self._plan else ())
            self._scheduler.policy.bind(self._layouts)
        self._check_layouts("after the forward order was agreed")

    def _layouts_partition(self) -> Optional[int]:
        if self._plan is not None:
            return self._plan.partition_bytes
        return self._policy.partition_bytes(self._config.partition_bytes)

    def _install_plan(self) -> None:
        """Measure the link, plan on rank 0, broadcast, and switch every rank to the plan.

        Called at the same step on every rank (the end of ``synchronize`` once the profiler has
        seen ``profile_warmup + profile_steps`` iterations): it runs collectives.
        """
        profiler, self._profiler = self._profiler, None
        total = sum(t.nbytes for t in self._layouts)
        started = time.perf_counter()
        # Time the path the blocks take: CUDA tensors when Horovod reduces them itself.
        device = (self._order[0].device if self._cuda is not None and self._cuda.direct
                  else torch.device("cpu"))
        cost, samples = measure_cost_model(total, self._process_set, device=device,
                                           prefix=f"{self._prefix}.costmodel")
        payload = None
        if self._is_gate:
            sizes = [self._element_size(p) for p in self._order]
            profile = profiler.profile(self._order, [self._parameter_names[p] for p in self._order],
                                       [p.numel() * e for p, e in zip(self._order, sizes)],
                                       sizes, [self._kind(p) for p in self._order])
            payload = planning.decide(profile, cost, self._config, overlap_forward=self._overlap)
        plan, profile, search = self._broadcast(payload, f"{self._prefix}.plan")
        self._plan = plan
        self._measured = (profile, cost)
        if self._overlap:
            self._time_layers(self._timeline is not None)
        self._policy = make_policy(self._config, plan, overlap_forward=self._overlap)
        self._layouts = self._build_layouts(plan.partition_bytes, plan.groups)
        policy = self._policy if self._is_gate else Immediate()
        policy.bind(self._layouts)
        self._scheduler.policy = policy
        self._check_layouts("when the plan was installed")
        if self._drift is not None:
            self._drift.reset()
            self._last_end = None
            if self._replan_reason is not None:
                reason, self._replan_reason = self._replan_reason, None
                reason = reason if isinstance(reason, str) else reason.describe()
                self.replans.append({"iteration": self._iteration, "time": time.time(),
                                     "reason": reason, "plan": plan.describe(),
                                     "link": cost.describe()})
                if self._timeline is not None:
                    self._timeline.mark("re-plan", iteration=self._iteration, reason=reason)
                if comm.rank() == 0:
                    log.info("re-planned at iteration %d (%s)", self._iteration, reason)
        if self._timeline is not None:
            self._timeline.mark("plan installed", partition_bytes=plan.partition_bytes,
                                units=plan.num_tensors, tensors=plan.num_parameters,
                                group_bytes=plan.group_bytes)
        if comm.rank() == 0:
            _setup_logging()
            planning.log(log, cost, samples, profile, plan, search, time.perf_counter() - started)
            if self._config.profile_out:
                planning.write(self._config.profile_out, cost, samples, profile, plan, search)

    # -- hooks and submission -------------------------------------------------------------
    def _grad_ready(self, p) -> None:
        """Post-accumulate-grad hook of ``p`` (Horovod's ``_make_hook`` contract)."""
        self._scheduler.check()
        if p in self._queued and self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        assert not p.grad.requires_grad
        assert self._allreduce_delay[p] > 0
        self._pending.add(p)
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] == 0:
            if self._profiler is not None:
                self._profiler.ready(p)
            if self._timeline is not None:
                self._trace_backward(p)
            self._enqueue(p)

    def _trace_backward(self, p) -> None:
        """Backward track: each gradient spans from the previous gradient's readiness (or the
        end of forward) to its own, the time autograd spent producing it."""
        now = time.perf_counter()
        start = self._last_ready if self._last_ready is not None else now
        self._timeline.layer("backward", self._parameter_names[p], start, now)
        self._last_ready = now

    def _start_schedule(self):
        """The schedule every optimizer starts from (at construction, and again after an
        elastic reset): the gate on rank 0, the configured policy and layout, no plan.  Returns
        the policy this rank's gate runs (non-gate ranks release every block at once)."""
        self._is_gate = self._process_set.rank() == 0
        self._policy = make_policy(self._config, overlap_forward=self._overlap)
        self._plan = self._measured = None
        # dcredit profiles the live job first (under bytescheduler rules), then plans.
        self._profiler = (StepProfiler(self._config.profile_warmup, self._config.profile_steps)
                          if self._config.policy == "dcredit" else None)
        self._layouts = self._build_layouts(self._policy.partition_bytes(self._config.partition_bytes))
        gate_policy = self._policy if self._is_gate else Immediate()
        gate_policy.bind(self._layouts)
        return gate_policy

    # -- elastic membership ----------------------------------------------------------------
    def _current_membership(self) -> tuple:
        return (self._process_set.size(), self._process_set.rank())

    def _follow_membership(self) -> None:
        """Under ``hvd.elastic`` a worker that joins starts from a fresh optimizer while the
        others keep theirs; both must send the same blocks from the next iteration on.  When
        Horovod was re-initialised (another size or rank, or a failed collective that elastic's
        ``restore()`` reported), drop whatever is in flight (its handles are gone) and start
        over as at construction: default layout, and for ``dcredit`` a new profile and plan,
        counted from the same iteration on every rank (the first after elastic's ``sync()``).
        """
        if not self._elastic:
            return
        membership = self._current_membership()
        if membership == self._membership and not self._membership_lost:
            return
        if self._step_in_flight and comm.rank() == 0:
            log.warning("Horovod was re-initialised while the last step's updates were in "
                        "flight; they are dropped (elastic's sync() restores rank 0's state)")
        self._membership, self._membership_lost = membership, False
        self._discard_in_flight()
        # A joining worker starts from the construction order: all agree on rank 0's again.
        self._order = list(self._initial)
        if self._guard is not None:
            self._forward_order_applied = False
            self._guard.observe(self._requires_update)
        self._scheduler.policy = self._start_schedule()
        if self._overlap:
            self._time_layers(self._profiler is not None or self._timeline is not None)
        if comm.rank() == 0:
            _setup_logging()
            log.info("elastic: %d ranks now; scheduling restarts%s", membership[0],
                     " with a new profile" if self._profiler is not None else "")

    def _discard_in_flight(self) -> None:
        """Forget queued and in-flight blocks and owed updates: Horovod was re-initialised and
        their handles are gone; the state that is loaded or broadcast next replaces them."""
        self._scheduler.reset()
        self._updater.reset()
        self._control = None
        self._step_in_flight = False
        self._pending.clear()
        self._queued.clear()
        self._arrived.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def _settle_for_load(self) -> None:
        """Before a state is loaded: apply what the last step owes; if Horovod failed under it
        (elastic ``restore()``), drop it instead: the loaded state replaces it."""
        if not self._enabled:
            return
        try:
            self.apply_pending_updates()
            if self._scheduler.iteration_open:
                self._scheduler.end_backward()
                self._scheduler.wait_all()
        except comm.HorovodInternalError:
            self._discard_in_flight()
            self._membership_lost = True

    def _enqueue(self, p) -> None:
        if not self._scheduler.iteration_open:
            self._follow_membership()
        if self._step_in_flight:
            self.apply_pending_updates()
        if not self._scheduler.iteration_open:
            self._scheduler.start_iteration()
        grad = p.grad
        if grad is None:
            # Another rank may have computed it: every rank must submit every name.
            grad = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if grad.is_sparse:
            if not self._sparse_as_dense:
                raise ValueError(
                    f"parameter {self._parameter_names.get(p)!r} has a sparse gradient; "
                    "dcredit_hvd sends dense blocks only: pass sparse_as_dense=True, or use "
                    "hvd.DistributedOptimizer for sparse gradients")
            grad = p.grad = grad.to_dense()
        if not grad.is_contiguous():
            grad = p.grad = grad.contiguous()
        layout = self._layouts[self._index[p]]
        self._queued.add(p)
        if layout.grouped:
            flat = self._gather(layout, p, grad)
            if flat is None:                   # other gradients of the unit are still to come
                return
            members = self._arrived.pop(layout.index)
        else:
            flat, members = grad.view(-1), [(p, grad)]
        left = [len(layout.blocks)]            # blocks of the unit not yet reduced
        unit_done = self._unit_done(layout, flat, members)
        cuda = self._cuda_transfer() if grad.is_cuda else None
        items = []
        for block in layout.blocks:
            view = flat[block.start:block.stop]
            payload, ctx = self._compression.compress(view)
            write_back = payload is not view
            ticket = cuda.prepare(block.name, payload) if cuda is not None else None
            if ticket is not None:
                self._cuda_stream = ticket.stream
            finish = self._block_done(unit_done, view, ctx, write_back, left, ticket) \
                if (write_back or unit_done is not None or ticket is not None
                    or self._amplify) else None
            items.append(Item(block.key, 0, block, payload if ticket is None else ticket.sendable,
                              finish, context=ticket))
        self._scheduler.enqueue(layout.index, items)

    def _gather(self, layout: TensorLayout, p, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Copy ``p``'s gradient into its unit's flat buffer (allocated once, then reused);
        the buffer once every member's gradient is in, else None (``docs/algorithm.md`` §1b)."""
        buffer = self._buffers.get(layout.index)
        if buffer is None or buffer.dtype != grad.dtype:
            buffer = self._buffers[layout.index] = torch.empty(layout.numel, dtype=grad.dtype)
            for member in self._members[layout.index]:       # each member's place, shaped
                offset = self._offset[member]
                self._slots[member] = buffer[offset:offset + member.numel()].view(member.shape)
        self._slots[p].copy_(grad)
        arrived = self._arrived.setdefault(layout.index, [])
        arrived.append((p, grad))
        return buffer if len(arrived) == len(layout.members) else None

    def _unit_done(self, layout: TensorLayout, flat: torch.Tensor, members: list):
        """What follows the last block of a unit (completion thread): a grouped unit's reduced
        buffer is copied back into each member's gradient, then (overlap) one update call
        applies every member's update.  None when there is nothing to do."""
        if not layout.grouped and not self._overlap:
            return None

        def done() -> None:
            if layout.grouped:
                for p, grad in members:
                    grad.copy_(self._slots[p])
            if self._overlap:
                self._updater.reduced([p for p, _ in members])
        return done

    def _cuda_transfer(self) -> CudaTransfer:
        """Created at the first CUDA gradient: direct when Horovod can reduce CUDA tensors and
        staging was not asked for (``cuda_staging``), else through pinned host buffers."""
        if self._cuda is None:
            staging = self._config.cuda_staging
            direct = comm.gpu_operations_built() if staging is None else not staging
            self._cuda = CudaTransfer(direct=direct)
            if comm.rank() == 0:
                log.info("CUDA gradients: %s", "handed to Horovod as CUDA tensors (GPU "
                         "operations)" if direct else "staged through pinned host memory "
                         "(Horovod CPU operations)")
        return self._cuda

    def _block_done(self, unit_done, view: torch.Tensor, ctx: Any, write_back: bool, left: list,
                    ticket: Optional[Ticket] = None):
        """Completion of one block: write back (compressed, or staged on the host), and once
        every block of the unit is reduced, run ``unit_done`` (``_unit_done``).  CUDA work is
        queued on the stream that produced the gradient (``device.py``, rule 2)."""
        def finish(output: torch.Tensor) -> None:
            self._amplify()
            with (nullcontext(output) if ticket is None
                  else CudaTransfer.receiving(ticket, output)) as result:
                if write_back:
                    view.copy_(self._compression.decompress(result, ctx))
                elif result is not view:          # staged: landed in the payload, not p.grad
                    view.copy_(result)
                left[0] -= 1
                if left[0] == 0 and unit_done is not None:
                    unit_done()
        return finish

    def _submit_item(self, item: Item) -> int:
        self._amplify()
        if self._op == hvd.Average:
            prescale = 1.0 / self._gradient_predivide_factor
            postscale = self._gradient_predivide_factor
        else:
            prescale = postscale = 1.0
        with (nullcontext(item.payload) if item.context is None
              else CudaTransfer.submitting(item.context)) as tensor:
            return comm.submit(tensor, item.block.name, self._op, prescale, postscale,
                               self._process_set)

    # -- Horovod's user-visible contract --------------------------------------------------
    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def synchronize(self) -> None:
        """Send whatever is left (zeros for gradients this rank never computed) and wait until
        every block is reduced and written back into ``p.grad``."""
        self._check_open()
        if not self._enabled:
            self._synchronized = True
            return
        self._send_rest()
        self._scheduler.wait_all()
        follow(self._cuda_stream)          # write-backs were queued on the producer stream
        self._updater.reset()              # the gradients are reduced; step() updates at once
        self._synchronized = True
        self._end_iteration()

    def _send_rest(self) -> None:
        """End of backward: queue every gradient not sent yet (zeros for those this rank never
        computed: another rank may have) and let the policy drain the queue."""
        self._scheduler.check()
        if not self._scheduler.iteration_open:
            self._follow_membership()
        if self._step_in_flight:
            self.apply_pending_updates()
        if not self._scheduler.iteration_open:
            self._scheduler.start_iteration()
        for p in self._order:
            if p not in self._queued:
                self._enqueue(p)
        if self._watching():
            self._submit_control()
        self._scheduler.end_backward()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._pending.clear()
        self._queued.clear()

    def _end_iteration(self) -> None:
        """Between iterations, nothing in flight: adopt the forward order, watch for drift,
        advance profiling."""
        self._apply_forward_order()
        self._iteration += 1
        self._watch_drift()
        if self._profiler is not None:
            self._profiler.end_iteration()
            if self._profiler.done:
                self._install_plan()

    # -- online re-planning (drift.py, docs/algorithm.md §8) ---------------------------------
    def _watching(self) -> bool:
        """A plan is in force and may be replaced: every rank sends the control word."""
        return self._drift is not None and self._plan is not None and self._profiler is None

    def _submit_control(self) -> None:
        """One float, all-reduced beside the iteration's last blocks (Horovod fuses it with
        them: no extra round trip): 1 from the gate rank when its detector fired, 0 otherwise.
        Every rank reads the sum at the same iteration end, so all start the new profile at
        the same step without any other message."""
        fired = self._is_gate and self._drift.fired is not None
        self._control = comm.submit(torch.tensor([1.0 if fired else 0.0]),
                                    f"{self._prefix}.control", hvd.Sum, 1.0, 1.0,
                                    self._process_set)

    def _watch_drift(self) -> None:
        if self._control is not None:
            handle, self._control = self._control, None
            if float(comm.wait(handle, self._config.poll_seconds)[0]) > 0.5:
                self._start_replan()
                return
        if self._drift is None or not self._is_gate:
            return
        now = time.perf_counter()
        last, self._last_end = self._last_end, now
        nbytes, busy = self._scheduler.link_sample()
        if last is None or not self._watching():
            return
        drift = self._drift.observe(now - last, busy / nbytes if nbytes else None)
        if drift is not None and comm.rank() == 0:
            log.info("drift at iteration %d: %s; every rank profiles again and re-plans",
                     self._iteration, drift.describe())

    def _start_replan(self) -> None:
        """Every rank, at the same iteration end: profile again (the plan in force keeps
        scheduling meanwhile); ``_install_plan`` then switches all of them at the same step."""
        self._replan_reason = self._drift.fired if self._is_gate else "drift seen by rank 0"
        self._profiler = StepProfiler(0, self._config.profile_steps)
        if self._overlap:
            self._time_layers(True)
        if self._timeline is not None:
            self._timeline.mark("re-plan: profiling", iteration=self._iteration)

    @contextmanager
    def _lost_to_shutdown_reported(self):
        """A wait for owed updates that fails because ``hvd.shutdown()`` dropped their
        all-reduces raises ``_SHUTDOWN_IN_FLIGHT`` (what happened and the fix), not Horovod's
        handle error."""
        try:
            yield
        except (SchedulerError, comm.HorovodInternalError) as exc:
            if self._elastic or comm.is_initialized():
                raise
            raise SchedulerError(_SHUTDOWN_IN_FLIGHT) from exc

    def _wait_for_reads(self, params: list) -> None:
        """The read guard's wait: ``params`` are about to be read while their update is owed.
        With a timeline, a wait that blocked shows on the forward track (exposed communication)."""
        started = time.perf_counter() if self._timeline is not None else 0.0
        with self._lost_to_shutdown_reported():
            self._updater.wait(params)
            follow(self._cuda_stream)
        if self._timeline is not None and time.perf_counter() - started > 20e-6:
            names = [self._parameter_names.get(p, "?") for p in params]
            self._timeline.layer("forward", f"wait for update: {', '.join(names[:3])}"
                                 f"{' ...' if len(names) > 3 else ''}", started,
                                 time.perf_counter(), parameters=names)

    def apply_pending_updates(self) -> None:
        """Block until every update owed by the last ``step()`` is applied.

        Called automatically before the next backward sends anything, by
        ``state_dict()``/``load_state_dict()`` of the model and the optimizer, and at
        interpreter exit.  A single read of a parameter needs no call: the read guard makes it
        wait for that parameter's own update (``readguard.py``).
        """
        if not (self._enabled and self._step_in_flight):
            return
        self._follow_membership()
        if not self._step_in_flight:
            return
        with self._lost_to_shutdown_reported():
            self._scheduler.wait_all()
            self._updater.drain()
            follow(self._cuda_stream)
        self._step_in_flight = False
        self._end_iteration()

    def close(self) -> None:
        """Stop scheduling for good: apply what the last ``step()`` owes, remove every hook
        this optimizer put on the parameters and the model, and give the parameters their own
        classes back (read guard).  A new ``DistributedOptimizer`` can then be built over the
        same parameters (switching optimizers, re-creating one after a restore).  Runs no
        collective, so ranks may close at different moments.  Idempotent; afterwards
        ``step()`` and ``synchronize()`` raise, ``state_dict()`` still works."""
        self._close("")

    def _close(self, why: str) -> None:
        if self._closed is not None:
            return
        if self._enabled:
            if self._pending:
                raise RuntimeError(_CLOSE_MID_ITERATION)
            if self._step_in_flight:
                with self._lost_to_shutdown_reported():
                    self._scheduler.wait_all()
                    self._updater.drain()
                    follow(self._cuda_stream)
                self._step_in_flight = False
            self._hooks.remove()
            if self._guard is not None:
                self._guard.stop_observing()
                self._guard.release_all()
            self._scheduler.close()
            instances.unregister(self)
        self._closed = f" {why}" if why else ""

    def _check_open(self) -> None:
        if self._closed is not None:
            raise RuntimeError(_CLOSED.format(why=self._closed))

    @contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); clip...; with skip_synchronize(): step()`` (Horovod's pattern)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Update the parameters from the reduced gradients.

        With ``model=`` given, returns as soon as everything is sent: each parameter is updated
        by this optimizer's own ``step`` as soon as its gradient is reduced, and any read of it
        waits for that update (the read guard).  Otherwise (and after ``synchronize()``, with a
        closure, or while ``dcredit`` profiles) it waits for every gradient, as Horovod does.
        """
        self._check_open()
        if self._should_synchronize and self._synchronized:
            warnings.warn(_DOUBLE_SYNC, stacklevel=2)
        if self._can_overlap(closure):
            self._send_rest()
            self._synchronized = False
            self._step_in_flight = True
            unguarded = self._updater.step(self._requires_update)
            if unguarded:                   # no read guard for their class: update them now
                self._wait_for_reads(unguarded)
            return None
        if self._should_synchronize:
            self.synchronize()
        elif self._enabled and self._overlap and not self._fallback_logged and comm.rank() == 0:
            self._fallback_logged = True
            log.info("step() after synchronize(): parameters are updated at step() for such "
                     "iterations (no overlap with the next forward pass)")
        self._synchronized = False
        return self._dcredit_base.step(self, closure)

    def _can_overlap(self, closure) -> bool:
        return (self._enabled and self._overlap and self._should_synchronize
                and not self._synchronized and closure is None and self._profiler is None)

    def zero_grad(self, *args, **kwargs):
        if self._enabled and self._pending:
            raise AssertionError(_ZERO_GRAD_RACE)
        if self._enabled and self._step_in_flight:
            return self._updater.zero_grad(args, kwargs)
        return self._dcredit_base.zero_grad(self, *args, **kwargs)

    def state_dict(self, *args, **kwargs):
        self.apply_pending_updates()
        return self._dcredit_base.state_dict(self, *args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        """Restore optimizer state; anything still in flight is drained first, then all
        scheduler state is reset (elastic ``restore()`` relies on this)."""
        if self._enabled:
            self._settle_for_load()
            self._discard_in_flight()
        self._synchronized = False
        self._should_synchronize = True
        return self._dcredit_base.load_state_dict(self, *args, **kwargs)

    @property
    def plan(self):
        """The D-Credit plan in force (identical on every rank), or None before/without one."""
        return self._plan if self._enabled else None

    @property
    def measured(self):
        """``(Profile, CostModel)`` that ``dcredit`` planned from (rank 0's, on every rank)."""
        return self._measured if self._enabled else None

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self._config

    @property
    def layouts(self) -> list[TensorLayout]:
        """Tensor layouts in priority (forward) order; empty when the wrapper passes through."""
        return list(self._layouts) if self._enabled else []

    @property
    def last_submission_order(self) -> list[str]:
        """Block names this rank handed to Horovod in the last iteration, in order."""
        return list(self._scheduler.submitted_names) if self._enabled else []


def _horovod_local_step_module() -> str:
    """The ``__module__`` for which ``hvd.broadcast_optimizer_state`` runs a local ``step()``.

    Horovod compares the optimizer's ``__module__`` with that of the ``DistributedOptimizer``
    it imports from ``horovod.torch.optimizer`` at call time.  Reading ``hvd.DistributedOptimizer``
    instead would break the drop-in swap ``hvd.DistributedOptimizer = dcredit_hvd.DistributedOptimizer``
    (ours would then name our own module, Horovod would run our collective ``step()`` on the
    ranks with empty state only, and the job would deadlock).
    """
    import horovod.torch.optimizer as horovod_optimizer
    return horovod_optimizer.DistributedOptimizer.__module__


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression: Any = hvd.Compression.none,
                         backward_passes_per_step: int = 1,
                         op: Any = hvd.Average,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: Any = hvd.global_process_set,
                         *,
                         model: Optional[torch.nn.Module] = None,
                         policy: Optional[str] = None,
                         partition_bytes: Any = None,
                         group_bytes: Any = None,
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
                         cuda_staging: Optional[bool] = None,
                         race_amplifier: Optional[float] = None,
                         liveness: Optional[bool] = None,
                         liveness_interval: Optional[float] = None,
                         liveness_timeout: Optional[float] = None,
                         liveness_exit_seconds: Optional[float] = None):
    """Wrap ``optimizer`` so its gradients are all-reduced by the scheduler.

    Arguments up to ``process_set`` are ``hvd.DistributedOptimizer``'s, with the same defaults
    and meaning.  Keyword-only extras (each also settable by a ``DCREDIT_*`` variable):

    * ``model``: the ``torch.nn.Module`` being trained; lets the scheduler learn the order in
      which forward uses parameters (priority: nearest the input first).
    * ``policy``: ``"dcredit"`` (default), ``"bytescheduler"`` or ``"wfbp"``.  ``DCREDIT_POLICY``.
    * ``partition_bytes``: largest block in bytes as sent (``"4MiB"`` accepted).
    * ``group_bytes``: ``dcredit`` sends runs of consecutive gradients smaller than this from
      one flat buffer (0: never); chosen by the planner unless given.
    * ``credit_bytes``: bytes in flight under ``bytescheduler``.
    * ``poll_seconds``: completion polling interval.
    * ``stall_seconds``, ``stall_abort_seconds``: log blocks that have not completed after the
      first, raise ``StallError`` after the second (0: wait for ever).
    * ``profile_warmup``, ``profile_steps``: ``dcredit`` runs this many iterations under
      ``bytescheduler`` rules, then averages this many into the profile it plans from.
    * ``profile_out``: ``dcredit`` writes the measured profile and plan to this JSON file.
    * ``replan``, ``replan_time_threshold``, ``replan_link_threshold``, ``replan_patience``,
      ``replan_seconds``:
      ``dcredit`` profiles again and switches every rank to a new plan when the iteration time
      or the link's speed stays off what they were under the plan (``drift.py``).
    * ``cuda_staging``: CUDA gradients go through pinned host memory and Horovod's CPU
      operations (True), or to Horovod as CUDA tensors (False); default: staged only when
      Horovod has no GPU operations.  ``DCREDIT_CUDA_STAGING``.
    * ``race_amplifier``: seconds; for tests, random sleeps up to this long in the background
      thread and the overlapped updates, so that ordering bugs show (``amplifier.py``).
      ``DCREDIT_RACE_AMPLIFIER``.
    * ``liveness``, ``liveness_interval``, ``liveness_timeout``, ``liveness_exit_seconds``: the
      heartbeat channel that turns a dead peer into ``PeerLostError`` within seconds
      (``liveness.py``); read by the first optimizer of a process set.  ``DCREDIT_LIVENESS*``.
    """
    if gradient_predivide_factor != 1.0:
        if op != hvd.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None:
        raise NotImplementedError(
            "groups/num_groups is not supported by dcredit_hvd: the scheduler forms its own "
            "blocks and Horovod fuses what is released together. Remove groups= (and "
            "num_groups=), or use hvd.DistributedOptimizer.")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == hvd.Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not supported by dcredit_hvd (Adasum reduces optimizer deltas, "
            "not gradients); use hvd.DistributedOptimizer(op=hvd.Adasum)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = SchedulerConfig.resolve(policy=policy, partition_bytes=partition_bytes,
                                     group_bytes=group_bytes,
                                     credit_bytes=credit_bytes, poll_seconds=poll_seconds,
                                     stall_seconds=stall_seconds,
                                     stall_abort_seconds=stall_abort_seconds,
                                     profile_warmup=profile_warmup, profile_steps=profile_steps,
                                     profile_out=profile_out, replan=replan,
                                     replan_time_threshold=replan_time_threshold,
                                     replan_link_threshold=replan_link_threshold,
                                     replan_patience=replan_patience,
                                     replan_seconds=replan_seconds, cuda_staging=cuda_staging,
                                     race_amplifier=race_amplifier, liveness=liveness,
                                     liveness_interval=liveness_interval,
                                     liveness_timeout=liveness_timeout,
                                     liveness_exit_seconds=liveness_exit_seconds)
    base = optimizer.__class__
    namespace = dict(_DistributedOptimizer.__dict__)
    namespace["_dcredit_base"] = base
    # Horovod's broadcast_optimizer_state runs the *local* step() of optimizers whose module is
    # horovod.torch.optimizer, and the distributed one (a collective) otherwise; a local step is
    # what it needs, so the generated class declares that module, as Horovod's own does.
    namespace["__module__"] = _horovod_local_step_module()
    cls = type(base.__name__, (base,), namespace)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, sparse_as_dense, process_set, model, config)
