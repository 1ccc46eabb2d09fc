"""The all-gather half: each unit's shards all-gathered under the policy's gather rule.

When each all-reduce is split into its two halves (``docs/algorithm.md`` §9), the
reduce-scatters run during backward under the policy's windows, like any block, and
``step()`` waits for them.  What comes back to every rank afterwards is the all-gather of each
block's shards: the updated parameters (``shard=True``: each rank updated its own slice) or
the reduced gradient (``dear``: every rank then updates the whole tensor).  Those all-gathers
go here, through a ``BlockScheduler`` of their own, gated on rank 0 by the rule the simulator
drives for the same half (``Policy.gather_rule``, in strict forward order when the policy asks
for it: ``InForwardOrder``), so the runtime and the simulator share one implementation of it::

    gather rule  =  InForwardOrder(policy.gather_rule())   if policy.gathers_in_forward_order()
                    policy.gather_rule()                   otherwise

The rule runs as phase 2 from the start (``on_backward_end`` before the first block): the
next forward is what the all-gathers overlap.  With ``model=``, the parameters a unit's
all-gathers write stay held by the read guard (``readguard.py``) until the last of them lands;
any read of one waits for exactly its own unit, so layer 0 can run while the last layers'
parameters are still on the wire.  They are held for their values only: ``.grad`` is reached
at once, so the loop's ``zero_grad()`` before the next forward does not wait for every
all-gather (it did, and cost the sharded mode its overlap).  Without ``model=``, ``drain``
waits for them all in ``step()`` (or ``synchronize()``).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..planning.blocks import Block
from ..policies import Immediate, Policy
from ..policies.base import InForwardOrder
from .scheduler import BlockScheduler, Item
from .state import OptimizerState


@dataclass(eq=False)
class Gather:
    """One block's all-gather: this rank's ``shard`` of it, and where the whole vector goes."""

    block: Block
    shard: torch.Tensor
    land: Callable[[torch.Tensor], None]       # called with the gathered ``block.numel`` values


def check_split(state: OptimizerState) -> None:
    """What the two halves cannot do yet, refused with the way out (``shard=True`` or
    ``policy='dear'``)."""
    mode, fix = (("shard=True", "leave shard unset") if state.config.shard
                 else (f"policy={state.config.policy!r}", "choose another policy"))
    refused = [
        (state.elastic, "elastic training (a slice belongs to a rank of a fixed world)"),
        (getattr(state.compression, "__name__", type(state.compression).__name__)
         not in ("NoneCompressor", "NoCompression"),
         "compression (the halves carry the uncompressed values)"),
        (state.predivide != 1.0, "gradient_predivide_factor != 1"),
        (any(p.is_cuda for p in state.requires_update),
         "CUDA parameters (not verified on a GPU yet)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"{mode} does not support {what}: {fix} for it.")


def gather_rule(policy: Policy, is_gate: bool, layouts: Sequence[Any]) -> Policy:
    """The rule this rank's all-gathers are released by (module docstring), bound to
    ``layouts``; non-gate ranks release every all-gather at once, as they do every block."""
    if not is_gate:
        rule: Policy = Immediate()
    else:
        rule = policy.gather_rule()
        if policy.gathers_in_forward_order():
            rule = InForwardOrder(rule)
    rule.bind(layouts)
    return rule


class Gathers:
    """The all-gathers of one optimizer: released under the gather rule, landed by a
    completion thread, waited for by readers (``wait``) or by ``step()`` (``drain``)."""

    def __init__(self, state: OptimizerState, poll: Callable[[Any], bool],
                 collect: Callable[[Any], torch.Tensor]) -> None:
        self._state = state
        config, main = state.config, state.scheduler
        assert main is not None, "the reduce-scatters' scheduler is built first"
        self.scheduler = BlockScheduler(
            Immediate(), submit=self._submit, poll=poll, collect=collect,
            poll_seconds=config.poll_seconds, stall_seconds=config.stall_seconds,
            stall_abort_seconds=config.stall_abort_seconds, timeline=main.timeline,
            passthrough=(state.transport.failure,), liveness=main.liveness)
        self._cond = threading.Condition(threading.RLock())
        self._held: dict[int, torch.Tensor] = {}   # id -> parameter whose unit is not landed
        self._scattered: dict[tuple[int, int], tuple[torch.Tensor, Callable]] = {}

    # -- DeAR: the reduce-scatters' results, kept until step() ---------------------------------
    def scattered(self, block: Block, shard: torch.Tensor, *, land: Callable) -> None:
        """Completion thread: this rank's reduced shard of ``block``; ``land`` takes the whole
        reduced block once gathered."""
        with self._cond:
            self._scattered[block.key] = (shard, land)

    def scattered_units(self) -> list[tuple[int, list[Gather], list[torch.Tensor]]]:
        """Every unit's all-gathers from the kept shards, in priority order (nothing held)."""
        units = []
        with self._cond:
            for layout in self._state.layouts:
                gathers = []
                for block in layout.blocks:
                    kept = self._scattered.pop(block.key, None)
                    if kept is None:
                        raise AssertionError(f"dcredit_hvd: no reduce-scatter result for "
                                             f"block {block.name}")
                    gathers.append(Gather(block, *kept))
                units.append((layout.index, gathers, []))
        return units

    def gather_now(self) -> None:
        """DeAR without ``model=`` (``synchronize()``): every reduced gradient all-gathered
        under the gather rule and written back, before any update."""
        self.start(self.scattered_units())
        self.drain()

    # -- training thread --------------------------------------------------------------------
    def start(self, units: Iterable[tuple[int, list[Gather], list[torch.Tensor]]]) -> list:
        """Queue every unit's all-gathers (``(unit, gathers, params to hold)``, in priority
        order) and release what the gather rule admits.  With the read guard, each unit's
        params are held until its last all-gather lands; returns the params the guard cannot
        hold (the caller waits for them before returning to the user)."""
        state, units = self._state, list(units)
        guard, refused = state.guard, []
        self.scheduler.policy = gather_rule(state.policy, state.is_gate, state.layouts)
        with self._cond:
            for _, _, params in units:
                if guard is not None and params:
                    refused += guard.hold(params, values_only=True)
                    self._held.update((id(p), p) for p in params)
        self.scheduler.start_iteration()
        self.scheduler.end_backward()              # phase 2 from the first all-gather
        for index, gathers, params in units:
            left = [len(gathers)]
            held = params if guard is not None else []
            self.scheduler.enqueue(index, [
                Item(g.block.key, 0, g.block, g.shard, self._landing(g.land, left, held))
                for g in gathers])
        return refused

    def wait(self, params: Iterable[torch.Tensor]) -> None:
        """Block until none of ``params`` waits for an all-gather (the read guard's wait)."""
        keys = [id(p) for p in params]
        with self._cond:
            while any(k in self._held for k in keys):
                self._cond.wait(timeout=0.05)
                self.scheduler.check()

    def drain(self) -> None:
        """Block until every all-gather has landed (completion-thread errors re-raised)."""
        if self.scheduler.iteration_open:
            self.scheduler.wait_all()
        with self._cond:
            assert not self._held, "every unit landed, yet parameters are still held"

    def reset(self) -> None:
        """Forget what is in flight (elastic reset, a load over a failed transport)."""
        self.scheduler.reset()
        with self._cond:
            if self._state.guard is not None:
                self._state.guard.release(self._held.values())
            self._held.clear()
            self._scattered.clear()
            self._cond.notify_all()

    def close(self) -> None:
        self.scheduler.close()

    # -- the transport's side ------------------------------------------------------------------
    def _submit(self, item: Item) -> Any:
        self._state.amplify()
        return self._state.transport.all_gather(item.payload, f"{item.block.name}.ag",
                                                item.block.numel)

    def _landing(self, land: Callable, left: list, held: list) -> Callable[[torch.Tensor], None]:
        """Completion of one all-gather: ``land`` it; after the unit's last, release its held
        parameters (the reads waiting for them go on)."""
        state = self._state

        def finish(output: torch.Tensor) -> None:
            state.amplify()
            applying = state.guard.applying() if state.guard is not None else nullcontext()
            with applying, torch.no_grad():
                land(output)
            left[0] -= 1
            if left[0] == 0 and held:
                with self._cond:
                    for p in held:
                        self._held.pop(id(p), None)
                    state.guard.release(held)
                    state.amplify()
                    self._cond.notify_all()
        return finish


__all__ = ["Gather", "Gathers", "gather_rule"]
