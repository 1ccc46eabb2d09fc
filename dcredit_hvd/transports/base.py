"""What the runtime needs from a collective library: one small, typed interface.

The optimizer, the scheduler's submit/poll/collect, the set-up collectives (agreement, plan
broadcast, cost-model timing) and the liveness channel reach the wire through a ``Transport``
only.  ``transports/horovod.py`` implements it for Horovod; a second library (torch.distributed)
is one more module under ``transports/`` with ``accepts(group)`` and ``transport(group)``
(``transports.select`` finds it), and its tests: no other runtime module changes.

A transport is bound to one group of ranks (Horovod: a process set).  Handles are whatever
``submit`` (or ``reduce_scatter``/``all_gather``) returns; the scheduler only hands them back to
``poll`` and ``collect``.

Besides the all-reduce, its two halves (issue 29): ``reduce_scatter`` leaves each rank its shard
of the reduced vector and ``all_gather`` assembles the shards again; the shards are
``shards.shard_bounds``' on every transport.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch

from ..liveness.channels import Lease
from ..liveness.heartbeat import Settings
from ..planning.engine import Execution

#: A pending collective, as ``submit`` returns it.
Handle = Any


@runtime_checkable
class Transport(Protocol):
    """One group of ranks and the collectives over it."""

    #: The error a failed collective raises (a peer died, the library shut down); elastic
    #: recovery catches it, and the scheduler lets it through unwrapped.
    failure: type[BaseException]
    #: The reduction ops ``submit`` takes: the mean (with pre/post scaling) and the sum.
    average: Any
    sum: Any
    #: Ranks come and go (elastic training): no construction collective, no liveness channel.
    elastic: bool

    def rank(self) -> int:
        """This process's rank within the group."""

    def size(self) -> int:
        """Ranks in the group."""

    def included(self) -> bool:
        """Whether this process is a member of the group."""

    def group_id(self) -> Any:
        """An identifier of the group, alike on every rank (it names collectives)."""

    def job_rank(self) -> int:
        """This process's rank in the whole job (rank 0 logs)."""

    def job_size(self) -> int:
        """Ranks in the whole job."""

    def is_up(self) -> bool:
        """False once the library was shut down: every handle is gone, nothing can be sent."""

    def gpu_operations(self) -> bool:
        """Whether the library reduces CUDA tensors itself (else they are staged on the host)."""

    def execution(self) -> Execution:
        """How the collectives run once submitted (cycle, fusion), for the simulator."""

    def submit(self, tensor: torch.Tensor, name: str, op: Any, prescale: float = 1.0,
               postscale: float = 1.0) -> Handle:
        """Start an in-place all-reduce of ``tensor`` under ``name`` (alike on every rank)."""

    def reduce_scatter(self, flat: torch.Tensor, name: str, op: Any) -> Handle:
        """Start the first half of an all-reduce: ``flat`` (1-D, alike in length and dtype on
        every rank) reduced with ``op`` (``average``: the mean over ranks, or ``sum``); its
        ``collect`` is this rank's shard, ``flat[start:stop]`` of the reduced vector with
        ``(start, stop) = shards.shard_bounds(flat.numel(), size(), rank())`` (possibly empty).
        ``flat`` must not change until then.  ``name`` (alike on every rank) need only be unique
        among the reduce-scatters in flight."""

    def all_gather(self, shard: torch.Tensor, name: str, numel: int) -> Handle:
        """Start the second half: every rank passes its shard of an ``numel``-element vector
        (``shards.shard_bounds``' slice, alike in dtype); its ``collect`` is the whole vector,
        alike on every rank.  ``name`` need only be unique among the all-gathers in flight."""

    def poll(self, handle: Handle) -> bool:
        """True once the collective behind ``handle`` has finished (successfully or not)."""

    def collect(self, handle: Handle) -> torch.Tensor:
        """The result of a finished collective; raises ``failure`` if it failed."""

    def wait(self, handle: Handle, poll_seconds: float = 0.0002) -> torch.Tensor:
        """``collect`` after polling with short sleeps (set-up collectives)."""

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        """``obj`` from ``root`` (a rank of the group) on every rank."""

    def allgather_object(self, obj: Any, name: str) -> list:
        """Every rank's ``obj``, in rank order."""

    def watch_peers(self, settings: Optional[Settings] = None) -> Optional[Lease]:
        """A lease on the liveness channel among the group's ranks (collective: the ranks agree
        to reuse the one they all hold, else open one), whose losses the scheduler subscribes
        to; None when there is none.  The channel ends with the last lease on this rank."""

    def close(self) -> None:
        """The optimizer is closed: give back what it holds of the library (torch.distributed:
        its lease on the group's issue order, whose last one ends a follower's thread)."""
