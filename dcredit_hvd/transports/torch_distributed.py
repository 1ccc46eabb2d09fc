"""The ``torch.distributed`` transport: Gloo for CPU tensors, NCCL for CUDA ones; no Horovod.

``TorchTransport`` implements ``transport.Transport`` over one process group (``torchrun``
users' groups; ``None`` is the default group).  ``torch.distributed`` matches collectives by the
order they are issued in, so every collective the scheduler submits goes through the group's
``Channel``: rank 0 issues at once and publishes each entry over a side group; every other rank
issues in that published order (``ordering.IssueOrder``, ``docs/design.md`` "One order without a
coordinator").  One channel per group, shared by every optimizer over it; its issue order and
side channel are an ``order_stream.OrderStream``, which lives while a transport here leases it.

Two groups of its own per channel, over the user's group's ranks (made by those ranks only), so
that no two threads, and none of the user's own collectives, interleave on one group:
* ``wire`` (the user's group's backend) carries every submitted all-reduce, issued under the
  order's lock in rank 0's order;
* ``objects`` (Gloo): the training thread's object collectives (plan broadcast, agreement
  checks, the liveness exchange), in program order on every rank.
Rank 0's order reaches the followers over ``sidechannel.Star`` (one TCP connection each).

Averaging is DDP's: the sum divided by the group's size (Gloo has no average op).  Public
``torch.distributed`` API only.

The two halves of an all-reduce (``reduce_scatter``, ``all_gather``) are collectives on the same
``wire`` group and go through the same issue order as ``submit``'s all-reduces: each is one more
entry of rank 0's published sequence (its ``Entry.kind`` says which collective), so a follower
issues it when rank 0 did, whatever order this rank submitted in, and a rank that reduce-scatters
where rank 0 all-gathers, or with another length or dtype, gets ``OrderMismatchError`` as a
diverging all-reduce does.

On NCCL the halves are ``reduce_scatter_single`` and ``all_gather_single`` (formerly
``reduce_scatter_tensor``/``all_gather_into_tensor``).  On Gloo the all-gather is too, but the
reduce-scatter is an all-reduce of a zero-padded copy, of which each rank keeps its slice: that
is what torch's own Gloo reduce-scatter does (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``,
pytorch #118911, an all-reduce of a clone and a copy of the rank's chunk), and its work cannot be
polled: it is a ``LambdaWork`` whose ``is_completed()`` stays False until ``wait()`` is called
(measured on torch 2.13), so the scheduler's ``poll`` would never see it finish.  Either way a
Gloo reduce-scatter moves an all-reduce's bytes: on Gloo the halves are a check of correctness
and order, never of bandwidth.  Gloo takes float32, float64, float16 and bfloat16 for both.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..liveness import handshake, interfaces
from ..liveness import heartbeat as liveness
from ..liveness.channels import Channels, Lease
from ..planning.engine import Execution
from ..runtime.scheduler import PeerLostError
from .order_stream import OrderStream
from .ordering import Entry, IssueOrder, OrderMismatchError, Submission
from .shards import check_shard, chunk, flat_length, shard_bounds

#: The reduction ops users pass as ``op`` (``None`` is the average, as in DDP).
AVERAGE = dist.ReduceOp.AVG
SUM = dist.ReduceOp.SUM
#: No Adasum here (the factory refuses Horovod's only).
ADASUM = object()
#: ``torch.distributed``'s errors for a failed collective (a peer died, the group was destroyed).
FAILURE = getattr(dist, "DistError", RuntimeError)
#: The objects group's collectives wait this long (set-up only; the training thread's).
SIDE_TIMEOUT = timedelta(minutes=30)
#: ``DCREDIT_ORDER_TIMEOUT``: seconds of divergence evidence before ``OrderMismatchError``.
ORDER_TIMEOUT_ENV = "DCREDIT_ORDER_TIMEOUT"
#: The halves' single-tensor collectives: torch 2.13 renamed ``reduce_scatter_tensor`` and
#: ``all_gather_into_tensor`` (the old names warn), older torch has the old names only.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class NoCompression:
    """``compression=None`` on this transport: the gradient as it is (Horovod's
    ``Compression.none``, which users without Horovod cannot import)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


COMPRESSION_NONE = NoCompression


def order_timeout() -> float:
    raw = os.environ.get(ORDER_TIMEOUT_ENV, "60")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ORDER_TIMEOUT_ENV}={raw!r} must be a number of seconds > 0 (how long "
                         "a follower waits for evidence of diverged collectives), e.g. 60")
    return value


def check_op(op: Any) -> None:
    """The factory's check (at construction, before any gradient): the mean or the sum."""
    # ReduceOp compares equal to ints, and Horovod's constants are ints (hvd.Average is 0,
    # ReduceOp.SUM's value): only torch.distributed's own ops are taken
    if not isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)) or op not in (AVERAGE, SUM):
        raise ValueError(f"dcredit_hvd: op={op!r} is not supported on torch.distributed: pass "
                         "op=None or torch.distributed.ReduceOp.AVG (the mean, as DDP) or "
                         "torch.distributed.ReduceOp.SUM (Horovod's hvd.Average/hvd.Sum are "
                         "Horovod's)")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_group() -> Any:
    if not is_initialized():
        raise RuntimeError(NOT_INITIALIZED)
    return dist.group.WORLD


NOT_INITIALIZED = (
    "dcredit_hvd: transport='torch.distributed' needs torch.distributed initialised: call "
    "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (CUDA) before building the "
    "optimizer, and launch with torchrun (e.g. torchrun --nproc-per-node 2 train.py)")


class Channel:
    """One group's own process groups and host layout (one per group, in every process, for
    the group's life); its issue order is an ``OrderStream``, leased by each transport."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.size = len(self.ranks)
        backend = dist.get_backend(group)
        self.nccl = backend == "nccl"
        # Groups of our own, made by the members only (local synchronization: ranks outside
        # the group call nothing), so that the user's own collectives on ``group`` (a loss
        # all-reduce for logging) never interleave with ours, which other threads issue.
        self.wire = dist.new_group(self.ranks, backend=backend, use_local_synchronization=True)
        self.objects = dist.new_group(self.ranks, backend="gloo", timeout=SIDE_TIMEOUT,
                                      use_local_synchronization=True)
        #: Every rank of the group on this host (the side channel and liveness listen on
        #: loopback then).
        self.single_host = self.size < 2 or len(set(self.allgather(socket.gethostname()))) == 1

    def open_stream(self) -> OrderStream:
        """A new issue order over the group, with its side channel (collective)."""
        bind = interfaces.listen_address(liveness.settings().bind, single_host=self.single_host)
        return OrderStream(self.rank, self.size, self.issue, self.broadcast, bind,
                           order_timeout(), FAILURE)

    # -- the objects group (the training thread's collectives) --------------------------------
    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """``obj`` from the group's rank ``root`` on every rank."""
        box = [obj if self.rank == root else None]
        dist.broadcast_object_list(box, src=self.ranks[root], group=self.objects)
        return box[0]

    def allgather(self, obj: Any) -> list:
        """Every rank's ``obj``, in the group's rank order."""
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.objects)
        return out

    def issue(self, sub: Submission) -> Any:
        """Start one collective on the gradients' group (the order's lock is held)."""
        if sub.entry.kind == "reduce_scatter" and self.nccl:
            return _REDUCE_SCATTER(sub.payload["out"], sub.payload["wire"], op=dist.ReduceOp.SUM,
                                   group=self.wire, async_op=True)
        if sub.entry.kind == "reduce_scatter":    # Gloo: the module's docstring says why
            return dist.all_reduce(sub.payload["wire"], op=dist.ReduceOp.SUM, group=self.wire,
                                   async_op=True)
        if sub.entry.kind == "all_gather":
            return _ALL_GATHER(sub.payload["out"], sub.payload["wire"], group=self.wire,
                               async_op=True)
        tensor, op, prescale = sub.payload["wire"], sub.payload["op"], sub.payload["prescale"]
        if prescale != 1.0:
            tensor.mul_(prescale)
        reduce = dist.ReduceOp.SUM if op == AVERAGE else op
        return dist.all_reduce(tensor, op=reduce, group=self.wire, async_op=True)


#: One channel per group: ``id(group) -> (group, channel)`` (the group kept so its id is unique).
_channels: dict[int, tuple[Any, Channel]] = {}
_channels_lock = threading.Lock()


def channel(group: Any) -> Channel:
    with _channels_lock:
        found = _channels.get(id(group))
        if found is None or found[0] is not group:
            found = _channels[id(group)] = (group, Channel(group))
        return found[1]


#: The liveness channel of each group, while an optimizer on this rank leases it.
_peers = Channels()
#: The issue order of each group, while a transport on this rank leases it (order_stream.py).
_streams = Channels()


class TorchTransport:
    """``transport.Transport`` over one ``torch.distributed`` process group."""

    failure = FAILURE
    average = AVERAGE
    sum = SUM
    elastic = False       # torchrun restarts every worker; a group never changes its members

    def __init__(self, group: Any = None) -> None:
        self.group = default_group() if group is None else group
        self.member = not _outside(self.group)
        self.channel = channel(self.group) if self.member else None
        #: This transport's hold on the group's issue order (order_stream.py): given back by
        #: ``close()``, or by the finalizer when the transport (its optimizer) is collected.
        self._stream: Optional[Lease] = None
        if self.member:
            self._stream = _streams.lease(
                self._peers_key(), self.channel.allgather, self.channel.open_stream)
            self._release = weakref.finalize(self, self._stream.release, False)

    @property
    def order(self) -> IssueOrder:
        """The group's issue order this transport submits to."""
        return self._stream.channel.order

    def close(self) -> None:
        """Give back the hold on the group's issue order (the optimizer's ``close``); the last
        transport here ends it, and a follower's thread with it."""
        if self._stream is not None:
            self._release.detach()
            self._stream.release()

    def rank(self) -> int:
        return self.channel.rank if self.member else -1

    def size(self) -> int:
        return self.channel.size if self.member else 0

    def included(self) -> bool:
        return self.member

    def group_id(self) -> Any:
        return tuple(self.channel.ranks) if self.member else ()

    def job_rank(self) -> int:
        return dist.get_rank()

    def job_size(self) -> int:
        return dist.get_world_size()

    def is_up(self) -> bool:
        return is_initialized()

    def gpu_operations(self) -> bool:
        return self.channel.nccl

    def execution(self) -> Execution:
        """Each collective starts when it is submitted, alone: no cycle, no fusion."""
        return Execution(cycle_s=0.0, fusion_bytes=0)

    # -- collectives ---------------------------------------------------------------------------
    def submit(self, tensor: torch.Tensor, name: str, op: Any, prescale: float = 1.0,
               postscale: float = 1.0) -> Submission:
        check_op(op)
        _check_name(name)
        wire = self._device(tensor)         # set-up collectives' host tensors go to CUDA on NCCL
        scale = postscale / self.size() if op == AVERAGE else postscale
        sub = Submission(Entry(name, tensor.numel(), _dtype(tensor)),
                         {"wire": wire, "op": op, "prescale": prescale, "scale": scale,
                          "out": tensor})
        return self.order.submit(sub)

    def reduce_scatter(self, flat: torch.Tensor, name: str, op: Any) -> Submission:
        """This rank's shard of ``flat`` reduced over the group (``base.Transport``), once
        collected: a reduce-scatter of ``flat`` zero-padded to a multiple of the group's size,
        the padding stripped.  ``AVERAGE`` is the sum divided by the size, as ``submit``'s.

        Issued in rank 0's order like ``submit`` (this module's docstring); on Gloo it is an
        all-reduce of a copy, of which this rank keeps its slice (the docstring says why)."""
        check_op(op)
        _check_name(name)
        numel, size, me = flat_length(flat.shape, "reduce_scatter"), self.size(), self.rank()
        start, stop = shard_bounds(numel, size, me)
        width = chunk(numel, size)
        if self.channel.nccl:
            wire = self._padded(flat, width * size)
            out, offset = wire.new_empty(width), 0
        else:       # all-reduced in place: never the caller's tensor
            wire = self._padded(flat, width * size, copy=True)
            out, offset = wire, me * width
        sub = Submission(Entry(name, numel, _dtype(flat), "reduce_scatter"),
                         {"wire": wire, "out": out, "offset": offset, "keep": stop - start,
                          "scale": 1.0 / size if op == AVERAGE else 1.0, "device": flat.device,
                          # the shard is copied out of Gloo's whole vector, which is freed
                          "copy": not self.channel.nccl})
        return self.order.submit(sub)

    def all_gather(self, shard: torch.Tensor, name: str, numel: int) -> Submission:
        """The whole ``numel``-element vector from every rank's shard (``base.Transport``),
        once collected: an all-gather of the shards, each zero-padded to one chunk, the padding
        stripped.  Issued in rank 0's order like ``submit``."""
        _check_name(name)
        size = self.size()
        check_shard(flat_length(shard.shape, "all_gather"), numel, size, self.rank(), name)
        wire = self._padded(shard, chunk(numel, size))
        sub = Submission(Entry(name, numel, _dtype(shard), "all_gather"),
                         {"wire": wire, "out": wire.new_empty(chunk(numel, size) * size),
                          "offset": 0, "keep": numel, "scale": 1.0, "device": shard.device,
                          "copy": False})
        return self.order.submit(sub)

    def _device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where the wire group reduces: CUDA for NCCL, the host for Gloo."""
        if self.channel.nccl and not tensor.is_cuda:
            return tensor.to(torch.device("cuda", torch.cuda.current_device()))
        if not self.channel.nccl and tensor.is_cuda:
            raise ValueError("dcredit_hvd: a CUDA tensor on a Gloo group: stage it on the host "
                             "(cuda_staging=True) or use an NCCL group")
        return tensor

    def _padded(self, flat: torch.Tensor, length: int, copy: bool = False) -> torch.Tensor:
        """``flat`` on the wire's device, zero-padded to ``length`` elements (``flat`` itself
        when nothing is to be added and no ``copy`` is asked for: the caller keeps it unchanged
        until it is collected)."""
        wire = self._device(flat)
        if wire.numel() == length and wire.is_contiguous() and not (copy and wire is flat):
            return wire
        out = wire.new_zeros(length)
        out[:wire.numel()] = wire
        return out

    def poll(self, handle: Submission) -> bool:
        if handle.error is not None:
            return True
        if not handle.issued:
            self.order.check(handle)
            return handle.error is not None
        return handle.work.is_completed()

    def collect(self, handle: Submission) -> torch.Tensor:
        if handle.error is not None:
            raise handle.error
        try:
            handle.work.wait()
        except FAILURE:
            raise
        except RuntimeError as exc:   # Gloo's "Connection reset by peer" is a plain one
            if handle.entry.kind == "all_reduce":
                raise FAILURE(f"dcredit_hvd: the all-reduce {handle.entry.name!r} failed: "
                              f"{exc}") from exc
            raise FAILURE(f"dcredit_hvd: the half of an all-reduce {handle.entry.name!r} "
                          f"({handle.entry.kind}) failed: {exc}") from exc
        if handle.entry.kind != "all_reduce":
            return _half(handle)
        wire, out, scale = handle.payload["wire"], handle.payload["out"], handle.payload["scale"]
        if scale != 1.0:
            wire.mul_(scale)
        if wire is not out:
            out.copy_(wire)
        handle.payload = None
        return out

    def wait(self, handle: Submission, poll_seconds: float = 0.0002) -> torch.Tensor:
        while not self.poll(handle):
            time.sleep(poll_seconds)
            lost = _peers.lost(self._peers_key())
            if lost:
                raise PeerLostError.from_events(lost)
        return self.collect(handle)

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        return self.channel.broadcast(obj, root)

    def allgather_object(self, obj: Any, name: str) -> list:
        return self.channel.allgather(obj)

    def issue_log(self) -> list[str]:
        """The names this rank issued on the group, in order (the last ``LOG_ENTRIES``)."""
        return list(self.order.log)

    def watch_peers(self, settings: Any = None) -> Optional[Lease]:
        """A lease on the liveness channel among the group's ranks, as in
        ``transports/horovod.py``: rank 0's secret over the objects group, each rank's address
        all-gathered (whether the ranks share a host is the channel's, gathered at its set-up)."""
        config = liveness.settings() if settings is None else settings
        if not config.enabled or self.size() < 2 or not self.member:
            return None

        def open_channel() -> liveness.Liveness:
            secret = self.broadcast_object(handshake.new_secret() if self.rank() == 0 else None,
                                           "dcredit.liveness.secret")
            bind = interfaces.listen_address(config.bind, single_host=self.channel.single_host)
            peers = liveness.Liveness(self.rank(), self.size(), config, secret=secret, bind=bind,
                                      exit_on_loss=True, needed=is_initialized)
            peers.start(self.allgather_object(peers.address(), "dcredit.liveness"))
            return peers

        return _peers.lease(self._peers_key(),
                            lambda token: self.allgather_object(token, "dcredit.liveness.token"),
                            open_channel)

    def _peers_key(self) -> tuple:
        """A group's id may be a destroyed group's (``destroy_process_group``, then a new one):
        the ranks' agreement on the token decides whether the channel is still the one."""
        return (id(self.group), self.rank(), self.size())


def _half(handle: Submission) -> torch.Tensor:
    """A finished reduce-scatter's or all-gather's result: the padding stripped, the mean's
    division applied, on the caller's device."""
    payload, handle.payload = handle.payload, None
    out = payload["out"][payload["offset"]:payload["offset"] + payload["keep"]]
    if payload["copy"]:
        out = out.clone()
    if payload["scale"] != 1.0:
        out.mul_(payload["scale"])
    return out.to(payload["device"])


def _check_name(name: str) -> None:
    if "\n" in name or "\t" in name:
        raise ValueError(f"dcredit_hvd: collective name {name!r} holds a tab or newline")


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def local_step_module() -> str:
    """The generated class's ``__module__``: this package's (no Horovod to satisfy)."""
    return "dcredit_hvd.optimizer"


def _outside(group: Any) -> bool:
    """What ``new_group`` returned on a rank that is not a member (an int marker)."""
    return not isinstance(group, dist.ProcessGroup) and group == dist.GroupMember.NON_GROUP_MEMBER


def accepts(group: Any) -> bool:
    """``torch.distributed``'s groups (``ProcessGroup``, or ``new_group``'s value on a rank
    outside it, where the optimizer passes through as Horovod's does; ``None`` is not one: the
    default group is chosen by name, ``transport='torch.distributed'``)."""
    return is_initialized() and (isinstance(group, dist.ProcessGroup) or _outside(group))


def transport(group: Any) -> TorchTransport:
    return TorchTransport(group)


__all__ = ["AVERAGE", "SUM", "COMPRESSION_NONE", "FAILURE", "OrderMismatchError",
           "TorchTransport", "accepts", "transport", "default_group", "is_initialized"]
