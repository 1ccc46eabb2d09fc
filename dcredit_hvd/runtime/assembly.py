"""Assembly: the state and the parts of one enabled ``DistributedOptimizer``, built in the
order their collectives must run on every rank (agreement check, then the liveness channel),
and the hooks that connect them to the parameters and the model.
"""
from __future__ import annotations

import atexit
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..planning.drift import DriftDetector
from . import checks, instances, lifetime, shards, timeline
from .amplifier import RaceAmplifier
from .gathers import Gathers, check_split
from .gradients import GradientPath
from .instrument import Instrumentation, log, setup_logging
from .lifecycle import PlanLifecycle
from .overlap import Overlap
from .readguard import ReadGuard
from .scheduler import BlockScheduler
from .state import OptimizerState
from .updates import ParameterUpdater
from .weak import weakly


@dataclass(eq=False)
class Parts:
    """The code that acts on one optimizer's state, one concern each."""

    instrument: Instrumentation
    lifecycle: PlanLifecycle
    overlap: Overlap
    gradients: GradientPath


def _amplified(amplify: RaceAmplifier, call):
    """``call`` behind a race-amplifier sleep (completion thread: polls and collects)."""
    def amplified(*args, **kwargs):
        amplify()
        return call(*args, **kwargs)
    return amplified


def initial_order(state: OptimizerState) -> list:
    """Tensor order before forward was observed: the order parameters were named in."""
    position = {p: i for i, p in enumerate(state.names)}
    return sorted(state.requires_update, key=position.__getitem__)


def assemble(opt: torch.optim.Optimizer, base: type, state: OptimizerState,
             model: Optional[torch.nn.Module]) -> Parts:
    """Everything an enabled optimizer needs; collective over the transport's group (unless
    elastic)."""
    config, transport = state.config, state.transport
    if config.shard:
        shards.check_optimizer(base)
    if config.split:
        check_split(state)
    lifetime.take_over(state, stacklevel=4)
    # Every collective this optimizer issues is named under its own prefix (instances.py).
    state.initial = initial_order(state)
    # The count in it is agreed over the ranks (none in an elastic job: a construction there
    # runs no collective, so it is this process's own).
    agree = None if state.elastic else (
        lambda count: transport.allgather_object(count, "dcredit.prefix"))
    prefix = instances.prefix_for(transport.group_id(),
                                  [(state.names[p], tuple(p.shape)) for p in state.initial], agree)
    state.prefix = prefix.name
    instrument = Instrumentation(state)
    lifecycle = PlanLifecycle(state, instrument)
    overlap = Overlap(state, lifecycle, instrument)
    gradients = GradientPath(state, instrument, lifecycle, overlap)
    state.membership = lifecycle.membership()
    state.amplify = RaceAmplifier(config.race_amplifier)
    # Every read of a parameter whose update is owed waits for it (readguard.py); the same
    # guard observes the order in which the first forward reads the parameters.
    state.guard = ReadGuard(overlap.wait_for_reads) if state.overlap else None
    state.order = list(state.initial)
    # dcredit re-plans when the job drifts from what its plan was made for (drift.py);
    # elastic jobs get a new profile and plan at every membership change instead.
    state.drift = (DriftDetector(config.drift_settings())
                   if config.policy == "dcredit" and config.replan and not state.elastic
                   else None)
    gate_policy = lifecycle.start_schedule()
    if state.elastic:
        # A worker that joins constructs its optimizer while the others are in
        # hvd.elastic's sync(): a collective here would never be matched.
        if instrument.on_rank0() is not None:
            log.info("elastic job: the cross-rank agreement check is skipped; elastic's "
                     "sync() broadcasts rank 0's state to every new worker instead")
    else:
        checks.check_construction(state)
        checks.check_layouts(state, "at construction")
    # A dead peer raises PeerLostError in seconds (liveness.py); elastic jobs rely on the
    # transport's own failure detection and reset instead.
    state.peers = None if state.elastic else transport.watch_peers(config.liveness_settings())
    poll, collect = transport.poll, transport.collect
    if state.amplify:
        poll, collect = _amplified(state.amplify, poll), _amplified(state.amplify, collect)
    state.scheduler = BlockScheduler(
        gate_policy, submit=weakly(gradients.submit_item), poll=poll, collect=collect,
        poll_seconds=config.poll_seconds, stall_seconds=config.stall_seconds,
        stall_abort_seconds=config.stall_abort_seconds,
        timeline=timeline.from_env(transport.job_rank()),
        passthrough=(transport.failure,),
        liveness=None if state.peers is None else state.peers.channel)
    state.timeline = state.scheduler.timeline
    state.updater = ParameterUpdater(opt, base, state.scheduler.check, guard=state.guard,
                                     jitter=state.amplify)
    if config.shard:
        state.sharded = shards.ShardedUpdate(opt, base, state)
    if config.split:          # the all-gather half: its own scheduler, the same poll/collect
        state.gathers = Gathers(state, poll, collect)
    parts = Parts(instrument, lifecycle, overlap, gradients)
    _register_hooks(state, parts, model)
    instances.register(opt, prefix, state.requires_update)
    weakref.finalize(opt, lifetime.collected, state.hooks, state.peers)
    atexit.register(lifetime.at_exit, weakref.ref(opt))
    if instrument.on_rank0() is not None:
        blocks = sum(len(t.blocks) for t in state.layouts)
        log.info("%s; policy %s; %d tensors, %d blocks, %d bytes per iteration",
                 config.summary(), state.policy.describe(), len(state.layouts), blocks,
                 sum(t.nbytes for t in state.layouts))
    return parts


def _register_hooks(state: OptimizerState, parts: Parts, model: Any) -> None:
    """Hooks hold their part weakly (``weak.py``): a model outlives its optimizers."""
    hooks = state.hooks.handles
    for p in state.requires_update:
        hooks.append(p.register_post_accumulate_grad_hook(weakly(parts.gradients.grad_ready)))
    if model is None:
        return
    overlap = parts.overlap
    parts.instrument.watch_layers(model)
    state.guard.observe(state.requires_update)
    hooks += [
        model.register_forward_pre_hook(weakly(overlap.forward_start)),
        model.register_forward_hook(weakly(overlap.forward_end), always_call=True),
        model.register_state_dict_pre_hook(weakly(overlap.before_state_dict)),
        model.register_load_state_dict_pre_hook(weakly(overlap.before_load)),
    ]
    parts.instrument.time_layers(parts.instrument.wanted())


__all__ = ["Parts", "assemble", "initial_order", "setup_logging"]
