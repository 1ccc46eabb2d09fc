"""The gradient path: from a parameter's hook firing to its blocks handed to the transport,
and from each block's result back into ``p.grad`` (then, with ``model=``, the update).

``docs/design.md``, "Data path", follows one gradient through these methods in order:
``grad_ready`` -> ``enqueue`` -> ``_gather`` (grouped units) -> ``_items`` (compress, stage)
-> ``BlockScheduler`` -> ``submit_item`` ... completion thread: ``_block_done`` ->
``_unit_done`` -> ``ParameterUpdater.reduced``.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from ..planning.blocks import TensorLayout
from .device import CudaTransfer, Ticket
from .instrument import Instrumentation
from .scheduler import Item
from .state import OptimizerState

TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)


class GradientPath:
    """Acts on ``state``; ``lifecycle`` and ``overlap`` are asked, before an iteration's first
    block, to follow a membership change and to apply what the last step still owes."""

    def __init__(self, state: OptimizerState, instrument: Instrumentation, lifecycle: Any,
                 overlap: Any) -> None:
        self.state = state
        self.instrument = instrument
        self.lifecycle = lifecycle
        self.overlap = overlap

    # -- from the hook to the scheduler ----------------------------------------------------
    def grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of ``p`` (Horovod's ``_make_hook`` contract)."""
        state = self.state
        state.scheduler.check()
        if p in state.queued and state.delay[p] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        assert not p.grad.requires_grad
        assert state.delay[p] > 0
        state.pending.add(p)
        state.delay[p] -= 1
        if state.delay[p] == 0:
            self.instrument.gradient_ready(p)
            self.enqueue(p)

    def open_iteration(self) -> None:
        """Before the iteration's first block: a new world (elastic), the last step's owed
        updates applied, then the scheduler's iteration opened."""
        scheduler = self.state.scheduler
        if not scheduler.iteration_open:
            self.lifecycle.follow_membership()
        if self.state.step_in_flight:
            self.overlap.apply_pending_updates()
        if not scheduler.iteration_open:
            scheduler.start_iteration()

    def enqueue(self, p: torch.Tensor) -> None:
        """Queue ``p``'s unit once its gradient (and, grouped, its unit's others) is in."""
        state = self.state
        self.open_iteration()
        grad = self._dense_gradient(p)
        layout = state.layouts[state.index[p]]
        state.queued.add(p)
        if layout.grouped:
            flat = self._gather(layout, p, grad)
            if flat is None:                   # other gradients of the unit are still to come
                return
            members = state.arrived.pop(layout.index)
        else:
            flat, members = grad.view(-1), [(p, grad)]
        cuda = self._cuda_transfer() if grad.is_cuda else None
        state.scheduler.enqueue(layout.index, self._items(layout, flat, members, cuda))

    def _dense_gradient(self, p: torch.Tensor) -> torch.Tensor:
        """``p.grad`` as sent: zeros when this rank computed none (another rank may have:
        every rank must submit every name), dense, contiguous."""
        grad = p.grad
        if grad is None:
            grad = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if grad.is_sparse:
            if not self.state.sparse_as_dense:
                raise ValueError(
                    f"parameter {self.state.names.get(p)!r} has a sparse gradient; "
                    "dcredit_hvd sends dense blocks only: pass sparse_as_dense=True, or use "
                    "hvd.DistributedOptimizer for sparse gradients")
            grad = p.grad = grad.to_dense()
        if not grad.is_contiguous():
            grad = p.grad = grad.contiguous()
        return grad

    def _items(self, layout: TensorLayout, flat: torch.Tensor, members: list,
               cuda: Optional[CudaTransfer]) -> list[Item]:
        """One scheduler item per block of the unit: compressed, staged (CUDA), with what its
        completion must do."""
        state = self.state
        left = [len(layout.blocks)]            # blocks of the unit not yet reduced
        unit_done = self._unit_done(layout, members)
        items = []
        if state.sharded is not None:          # a slice per block, kept by shards.py
            (p, _), keep = members[0], state.sharded.block_reduced
            return [Item(b.key, 0, b, flat[b.start:b.stop],
                         lambda out, start=b.start: keep(p, start, out)) for b in layout.blocks]
        for block in layout.blocks:
            view = flat[block.start:block.stop]
            payload, ctx = state.compression.compress(view)
            write_back = payload is not view
            ticket = cuda.prepare(block.name, payload) if cuda is not None else None
            if ticket is not None:
                state.cuda_stream = ticket.stream
            finish = self._block_done(unit_done, view, ctx, write_back, left, ticket) \
                if (write_back or unit_done is not None or ticket is not None
                    or state.amplify or state.gathers is not None) else None
            if state.gathers is not None:      # dear: the shard waits for step()'s all-gather
                finish = functools.partial(state.gathers.scattered, block, land=finish)
            items.append(Item(block.key, 0, block, payload if ticket is None else ticket.sendable,
                              finish, context=ticket))
        return items

    def _gather(self, layout: TensorLayout, p, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Copy ``p``'s gradient into its unit's flat buffer (allocated once, then reused);
        the buffer once every member's gradient is in, else None (``docs/algorithm.md`` §1b)."""
        state = self.state
        buffer = state.buffers.get(layout.index)
        if buffer is None or buffer.dtype != grad.dtype:
            buffer = state.buffers[layout.index] = torch.empty(layout.numel, dtype=grad.dtype)
            for member in state.members[layout.index]:       # each member's place, shaped
                offset = state.offset[member]
                state.slots[member] = buffer[offset:offset + member.numel()].view(member.shape)
        state.slots[p].copy_(grad)
        arrived = state.arrived.setdefault(layout.index, [])
        arrived.append((p, grad))
        return buffer if len(arrived) == len(layout.members) else None

    def _cuda_transfer(self) -> CudaTransfer:
        """Created at the first CUDA gradient: direct when the transport can reduce CUDA
        tensors and staging was not asked for (``cuda_staging``), else through pinned host
        buffers."""
        state = self.state
        if state.cuda is None:
            staging = state.config.cuda_staging
            direct = state.transport.gpu_operations() if staging is None else not staging
            state.cuda = CudaTransfer(direct=direct)
            log = self.instrument.on_rank0()
            if log is not None:
                log.info("CUDA gradients: %s", "handed to Horovod as CUDA tensors (GPU "
                         "operations)" if direct else "staged through pinned host memory "
                         "(Horovod CPU operations)")
        return state.cuda

    # -- the transport's side ----------------------------------------------------------------
    def submit_item(self, item: Item) -> Any:
        """The scheduler releases ``item``: one named all-reduce (Horovod's scaling rules)."""
        state = self.state
        state.amplify()
        if state.op == state.transport.average:
            prescale, postscale = 1.0 / state.predivide, state.predivide
        else:
            prescale = postscale = 1.0
        with (nullcontext(item.payload) if item.context is None
              else CudaTransfer.submitting(item.context)) as tensor:
            if state.gathers is not None:       # the halves (gathers.py): this rank's shard
                return state.transport.reduce_scatter(tensor, item.block.name, state.op)
            return state.transport.submit(tensor, item.block.name, state.op, prescale, postscale)

    # -- completion thread -------------------------------------------------------------------
    def _unit_done(self, layout: TensorLayout, members: list) -> Optional[Callable[[], None]]:
        """What follows the last block of a unit (completion thread): a grouped unit's reduced
        buffer is copied back into each member's gradient, then (overlap) one update call
        applies every member's update.  None when there is nothing to do."""
        state = self.state
        if not layout.grouped and not state.overlap:
            return None

        def done() -> None:
            if layout.grouped:
                for p, grad in members:
                    grad.copy_(state.slots[p])
            if state.overlap:
                state.updater.reduced([p for p, _ in members])
        return done

    def _block_done(self, unit_done, view: torch.Tensor, ctx: Any, write_back: bool, left: list,
                    ticket: Optional[Ticket] = None) -> Callable[[torch.Tensor], None]:
        """Completion of one block: write back (compressed, or staged on the host), and once
        every block of the unit is reduced, run ``unit_done`` (``_unit_done``).  CUDA work is
        queued on the stream that produced the gradient (``device.py``, rule 2)."""
        state = self.state

        def finish(output: torch.Tensor) -> None:
            state.amplify()
            with (nullcontext(output) if ticket is None
                  else CudaTransfer.receiving(ticket, output)) as result:
                if write_back:
                    view.copy_(state.compression.decompress(result, ctx))
                elif result is not view:          # staged: landed in the payload, not p.grad
                    view.copy_(result)
                left[0] -= 1
                if left[0] == 0 and unit_done is not None:
                    unit_done()
        return finish

    # -- end of backward ---------------------------------------------------------------------
    def send_rest(self) -> None:
        """End of backward: queue every gradient not sent yet (zeros for those this rank never
        computed: another rank may have) and let the policy drain the queue."""
        state = self.state
        state.scheduler.check()
        self.open_iteration()
        for p in state.order:
            if p not in state.queued:
                self.enqueue(p)
        if self.lifecycle.watching():
            self.lifecycle.submit_control()
        state.scheduler.end_backward()
        state.reset_delays()
        state.pending.clear()
        state.queued.clear()
