"""CUDA gradients in stream order: when a block may go to Horovod, and where its result lands.

A gradient block is produced by kernels queued on a CUDA stream (the one autograd ran the
backward on: the *producer* stream).  The scheduler hands blocks to Horovod later, often from
its completion thread, whose current stream is the device's default stream.  Three rules keep
every hand-off ordered without a device-wide synchronize (docs/design.md, "CUDA"):

1. **Send after the producer.**  With a Horovod built with GPU operations (NCCL or CUDA-aware
   MPI), a block is submitted with the producer stream made current: Horovod records its
   ready event on the current stream, so the all-reduce starts after everything already queued
   there, the block's kernels included.  Without GPU operations (or with
   ``DCREDIT_CUDA_STAGING=1``) the block is copied into a pinned host buffer on the producer
   stream, an event is recorded after the copy, and the submitting thread waits for that event
   only, then gives Horovod the host buffer (a CPU all-reduce).  Horovod's own path for CUDA
   tensors in such a build copies without recording an event; staging does not rely on it,
   and it is what lets two ranks share one GPU even when Horovod was built with NCCL.
2. **Use the result on the producer.**  Write-back, decompression and the parameter update run
   with the producer stream current (a staged result is first copied back on it), so they are
   queued after the block's own kernels and before anything the training thread queues later.
3. **Forward follows updates.**  A forward running on another stream waits for the producer
   stream (``follow``), an event wait on the device, not a host synchronize.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Ticket:
    """One CUDA block on its way to Horovod and back."""

    #: The stream whose kernels produced the block (current in the hook that enqueued it).
    stream: torch.cuda.Stream
    #: What Horovod reduces in place: the CUDA payload itself, or its pinned host copy.
    sendable: torch.Tensor
    #: Recorded after the device-to-host copy (staged tickets only).
    copied: Optional[torch.cuda.Event] = None
    #: The CUDA payload a staged result is copied back into (staged tickets only).
    payload: Optional[torch.Tensor] = None


class CudaTransfer:
    """Hands CUDA blocks to Horovod in stream order (module docstring, rules 1 and 2).

    ``direct``: Horovod was built with GPU operations and may reduce CUDA tensors itself;
    otherwise every block is staged through a pinned host buffer kept per block name (reused
    every iteration: the next copy into it is queued on the same stream after the previous
    copy back, and Horovod is done with it once its handle completed).
    """

    def __init__(self, direct: bool) -> None:
        self.direct = direct
        self._host: dict[str, torch.Tensor] = {}

    def prepare(self, name: str, payload: torch.Tensor) -> Ticket:
        """In the hook (training or autograd thread): remember the producer stream and, when
        staging, queue the copy to host behind the block's kernels."""
        stream = torch.cuda.current_stream(payload.device)
        if self.direct:
            return Ticket(stream, payload)
        host = self._host.get(name)
        if host is None or host.shape != payload.shape or host.dtype != payload.dtype:
            host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            self._host[name] = host
        host.copy_(payload, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
        return Ticket(stream, host, copied, payload)

    @staticmethod
    @contextlib.contextmanager
    def submitting(ticket: Ticket) -> Iterator[torch.Tensor]:
        """Around ``comm.submit`` (any thread): yields the tensor to give Horovod, once it may
        be read, with the producer stream current so Horovod's ready event lands on it."""
        if ticket.copied is not None:
            ticket.copied.synchronize()          # this one copy, not the device
        with torch.cuda.stream(ticket.stream):
            yield ticket.sendable

    @staticmethod
    @contextlib.contextmanager
    def receiving(ticket: Ticket, output: torch.Tensor) -> Iterator[torch.Tensor]:
        """Around the completion of a block (completion thread): the producer stream is current
        for whatever uses the result; yields the result as a CUDA tensor."""
        with torch.cuda.stream(ticket.stream):
            if ticket.payload is not None:
                ticket.payload.copy_(output, non_blocking=True)
                output = ticket.payload
            else:
                # Horovod's asynchronous completion queues its event wait on the default
                # stream; the producer must not run ahead of it.
                default = torch.cuda.default_stream(ticket.stream.device)
                if ticket.stream != default:
                    ticket.stream.wait_stream(default)
            yield output


def follow(stream: Optional[torch.cuda.Stream]) -> None:
    """Make the current stream wait for ``stream`` (rule 3); nothing if they are the same."""
    if stream is None:
        return
    current = torch.cuda.current_stream(stream.device)
    if current != stream:
        current.wait_stream(stream)

