"""The Horovod transport: the only module that imports Horovod.

``HorovodTransport`` implements ``transport.Transport`` over one Horovod process set; the
module-level functions below are what it calls (tests replace them, e.g. ``collect``, so the
transport looks them up at each call).  Everything the scheduler sends goes through
``submit``/``poll``/``collect``; the few collectives used at set-up (object broadcast and
all-gather) are here too.  Public ``horovod.torch`` API only: Horovod is never patched.

The factory's defaults (``hvd.DistributedOptimizer``'s signature) come from here too:
``COMPRESSION_NONE``, ``AVERAGE``, ``ADASUM`` and ``GLOBAL_PROCESS_SET``.

The two halves of an all-reduce are ``hvd.reducescatter_async`` and ``hvd.allgather_async`` on
the transport's process set, their vectors zero-padded to a multiple of the set's size first
(``shards``: Horovod would otherwise give the first ``n mod size`` ranks one more element).
Horovod's coordinator matches them by name, as it does all-reduces, so ranks may submit them in
any order.  Measured on this project's CPU build (both ``mpirun`` and ``horovodrun --gloo``):
Average (the mean) and Sum, float32, float64 and float16; no bfloat16 (Horovod 0.28.1's torch
binding has no bfloat16 CPU ops, for the all-reduce either).
"""
from __future__ import annotations

import itertools
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import horovod.torch as hvd
import torch
from horovod import __version__ as HOROVOD_VERSION

from ..liveness import handshake, interfaces
from ..liveness import heartbeat as liveness
from ..liveness.channels import Channels, Lease
from ..planning.engine import Execution
from ..planning.simulator import horovod_execution
from ..runtime.scheduler import PeerLostError
from .shards import check_shard, chunk, flat_length, shard_bounds

#: The reduction ops, re-exported so no other module needs Horovod for them.
AVERAGE = hvd.Average
SUM = hvd.Sum
#: Refused by the factory (it reduces optimizer deltas, not gradients).
ADASUM = hvd.Adasum
#: ``hvd.DistributedOptimizer``'s defaults, for the factory's signature.
COMPRESSION_NONE = hvd.Compression.none
GLOBAL_PROCESS_SET = hvd.global_process_set
#: Horovod's error for a failed collective (a peer died, Horovod shut down); elastic recovers it.
HorovodInternalError = hvd.HorovodInternalError


def check_op(op: Any) -> None:
    """Horovod's own rules apply (``arguments``; Adasum is refused before the transport)."""


def default_group() -> Any:
    """``process_set=None``: Horovod's default, every rank."""
    return GLOBAL_PROCESS_SET


def rank() -> int:
    return hvd.rank()


def size() -> int:
    return hvd.size()


def is_initialized() -> bool:
    """False after ``hvd.shutdown()``: every handle is gone and nothing can be sent."""
    return hvd.is_initialized()


def execution() -> Execution:
    """Horovod's cycle and fusion threshold as this process's Horovod read them at ``init``
    (``simulator.horovod_execution``: the environment, else Horovod's defaults)."""
    return horovod_execution(os.environ)


def gpu_operations_built() -> bool:
    """Whether Horovod reduces CUDA tensors on the GPU (built with NCCL, or RCCL on ROCm).

    Not ``hvd.cuda_built()``: a Horovod compiled against a CUDA torch reports CUDA even without
    GPU operations, and then copies CUDA tensors to the host itself.  (A build with
    ``HOROVOD_GPU_OPERATIONS=MPI`` is not detectable here: pass ``cuda_staging=False``.)
    """
    return bool(hvd.nccl_built())


class _HorovodReferences:
    """Keeps a C++ reference to every tensor Horovod holds for an unfinished collective.

    Why: Horovod 0.28 can deadlock when it shuts down (a peer raised and its exit handler
    called ``hvd.shutdown()``).  Its background thread finalizes the queue while holding the
    process-set table's mutex, and destroying a queued entry drops the last C++ reference to a
    tensor that Python owns, which needs the GIL.  Meanwhile the training thread is inside the
    next ``allreduce_async_`` enqueue, which holds the GIL and waits for that mutex.  Measured
    under load, ``tests/jobs/failure/peer_failure.py raise`` hung in 2 runs of 12 before this class
    and in none of 16 after it. Native stacks show exactly those two waits, and
    ``tests/jobs/failure/enqueue_during_shutdown.py horovod`` hangs plain Horovod 6 times in 6.

    torch takes the GIL only when a tensor's C++ use count falls to 1 (the Python object alone),
    so a second C++ reference held here, taken before the enqueue and dropped in a Python
    thread, means Horovod's thread never needs the GIL for our tensors.  The reference is an
    alias whose ``.grad`` is the tensor (autograd stores ``.grad`` in C++).  It is dropped once
    the collective finished successfully; after a failure it is kept until Horovod was shut down
    and initialised again (handle numbers restart then, and the old background thread has been
    joined), since Horovod may still be finalizing the entry.
    """

    def __init__(self) -> None:
        self._held: dict[int, list[torch.Tensor]] = {}
        self._last_handle = 0
        self._lock = threading.Lock()

    def enqueue(self, tensors: list[torch.Tensor], start: Callable[[], int]) -> int:
        """``start()``: one Horovod enqueue that references ``tensors``; returns its handle.

        The references are taken before the enqueue (Horovod may finalize the entry as soon as
        it is queued), and the lock keeps handles in enqueue order across threads, so that a
        smaller handle than the last one can only mean that Horovod restarted its numbering.
        """
        anchors = []
        for tensor in tensors:
            alias = tensor.detach()
            alias.grad = tensor
            anchors.append(alias)
        with self._lock:
            handle = start()
            if handle <= self._last_handle:
                # Horovod was shut down (its background thread joined) and initialised again:
                # nothing references the old collectives' tensors any more.
                self._held.clear()
            self._last_handle = handle
            self._held[handle] = anchors
        return handle

    def finished(self, handle: int) -> None:
        self._held.pop(handle, None)

    def __len__(self) -> int:
        return len(self._held)


_references = _HorovodReferences()


def submit(tensor: torch.Tensor, name: str, op: Any, prescale: float, postscale: float,
           process_set: Any) -> int:
    """Start an in-place all-reduce of ``tensor`` under ``name``; returns Horovod's handle."""
    return _references.enqueue([tensor], lambda: hvd.allreduce_async_(
        tensor, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
        process_set=process_set))


@dataclass(frozen=True)
class Half:
    """A reduce-scatter's or all-gather's handle: Horovod's, and how many leading elements of
    its output are kept (the rest is the padding)."""

    handle: int
    keep: int


def reduce_scatter(flat: torch.Tensor, name: str, op: Any, process_set: Any) -> Half:
    """Start a reduce-scatter of the 1-D ``flat``; collected, this rank's shard of it reduced.

    ``hvd.reducescatter_async`` of ``flat`` zero-padded to a multiple of the set's size (``flat``
    itself when it is one already: Horovod does not modify its input).  Its Average divides by
    the set's size in Horovod (measured: the mean).  Only the input is held as
    ``_HorovodReferences`` says: Horovod allocates the output itself (``tensor.new()``), where
    no public API can reach it before it is finished.
    """
    # Horovod's ops are plain ints; torch's ReduceOp.SUM compares equal to hvd.Average (0)
    if type(op) is not int or op not in (AVERAGE, SUM):
        raise ValueError(f"dcredit_hvd: op={op!r} for reduce_scatter: {_backend()} reduce-scatters "
                         "with hvd.Average (the mean) or hvd.Sum only (torch.distributed's "
                         "ReduceOp is the torch.distributed transport's)")
    numel, size = flat_length(flat.shape, "reduce_scatter"), process_set.size()
    start, stop = shard_bounds(numel, size, process_set.rank())
    wire = _padded(flat, chunk(numel, size) * size)
    handle = _enqueue_half(wire, "reduce_scatter", lambda: hvd.reducescatter_async(
        wire, name=f"{name}.reduce_scatter", op=op, process_set=process_set))
    return Half(handle, stop - start)


def all_gather(shard: torch.Tensor, name: str, numel: int, process_set: Any) -> Half:
    """Start an all-gather of this rank's ``shard`` (``shards.shard_bounds``' slice of an
    ``numel``-element vector); collected, the whole vector.  ``hvd.allgather_async`` of the
    shard zero-padded to one chunk, so every rank sends as many elements."""
    size = process_set.size()
    check_shard(flat_length(shard.shape, "all_gather"), numel, size, process_set.rank(), name)
    wire = _padded(shard, chunk(numel, size))
    handle = _enqueue_half(wire, "all_gather", lambda: hvd.allgather_async(
        wire, name=f"{name}.all_gather", process_set=process_set))
    return Half(handle, numel)


def _enqueue_half(wire: torch.Tensor, what: str, start: Callable[[], int]) -> int:
    """``start()`` as ``_HorovodReferences.enqueue`` does, Horovod's refusal of a dtype made
    into an error that says what to do."""
    try:
        return _references.enqueue([wire], start)
    except ValueError as exc:           # "Tensor type torch.BFloat16Tensor is not supported."
        if "not supported" not in str(exc):
            raise
        raise TypeError(f"dcredit_hvd: {_backend()} cannot {what.replace('_', '-')} "
                        f"{wire.dtype} tensors on {wire.device} ({exc}): cast the vector to "
                        "float32 (float64 and float16 work too; CUDA tensors need a Horovod built "
                        "with NCCL), or use transport='torch.distributed' under torchrun, whose "
                        "Gloo back-end takes bfloat16") from exc


def _padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    """``flat`` zero-padded to ``length`` elements (``flat`` itself when it has them)."""
    if flat.numel() == length and flat.is_contiguous():
        return flat
    out = flat.new_zeros(length)
    out[:flat.numel()] = flat
    return out


def _backend() -> str:
    """Horovod and its controller, for messages."""
    controller = "Gloo" if hvd.gloo_enabled() else "MPI" if hvd.mpi_enabled() else "unknown"
    return f"Horovod {HOROVOD_VERSION} ({controller} controller)"


def poll(handle: Union[int, Half]) -> bool:
    """True when the collective behind ``handle`` has finished (successfully or not)."""
    return hvd.poll(handle.handle if isinstance(handle, Half) else handle)


def collect(handle: Union[int, Half]) -> torch.Tensor:
    """The result of a finished collective; raises ``HorovodInternalError`` if it failed.  A
    reduce-scatter's or all-gather's padding is stripped."""
    if isinstance(handle, Half):
        output = hvd.synchronize(handle.handle)
        _references.finished(handle.handle)
        return output[:handle.keep]
    output = hvd.synchronize(handle)
    _references.finished(handle)
    return output


def wait(handle: Union[int, Half], poll_seconds: float = 0.0002) -> torch.Tensor:
    """``collect`` after polling with short sleeps.

    ``hvd.synchronize`` busy-waits (yielding); on a machine with as many busy processes as cores
    that starves Horovod's own background thread: a 4 KiB all-reduce measured 30-50 ms that way
    against 1-5 ms when polled (2 ranks on 2 cores).
    """
    while not poll(handle):
        time.sleep(poll_seconds)
        if _channels:
            raise_if_peer_lost()
    return collect(handle)


def held_references() -> int:
    """How many collectives' tensors are still referenced for Horovod (for soak checks)."""
    return len(_references)


def _sum(tensor: torch.Tensor, name: str, process_set: Any) -> torch.Tensor:
    return wait(submit(tensor, name, SUM, 1.0, 1.0, process_set))


def _as_words(obj: Any) -> torch.Tensor:
    """``obj`` pickled into int32 words (zero-padded); a sum with zeros leaves it intact."""
    data = pickle.dumps(obj)
    data += bytes(-len(data) % 4)
    return torch.frombuffer(bytearray(data), dtype=torch.int32)


def _from_words(words: torch.Tensor) -> Any:
    return pickle.loads(words.numpy().tobytes())   # pickle ignores the padding after STOP


def broadcast_object(obj: Any, root_rank: int = 0, process_set: Any = None,
                     name: Optional[str] = None) -> Any:
    """``obj`` from ``root_rank`` (a rank within ``process_set``) on every rank of the set.

    ``allgather_object`` with only the root's object (the others send ``None``), not
    ``hvd.broadcast_object``, so that its tensors are held as ``_HorovodReferences`` says.
    """
    process_set = hvd.global_process_set if process_set is None else process_set
    root = process_set.rank() == root_rank
    gathered = allgather_object(obj if root else None, process_set,
                                name or "dcredit.broadcast_object")
    return obj if root else gathered[root_rank]


def allgather_object(obj: Any, process_set: Any = None, name: Optional[str] = None) -> list:
    """Every rank's ``obj``, in rank order, over ``process_set``.

    ``hvd.allgather_object`` has no process-set argument in 0.28.1, and its output tensor is
    made inside Horovod where it cannot be held as ``_HorovodReferences`` says; so each rank
    writes its pickled object into its own slice of a zero buffer, and the buffers are summed.
    """
    process_set = hvd.global_process_set if process_set is None else process_set
    prefix = name or "dcredit.allgather_object"
    me, ranks = process_set.rank(), process_set.size()
    mine = _as_words(obj)
    counts = torch.zeros(ranks, dtype=torch.int64)
    counts[me] = mine.numel()
    counts = _sum(counts, f"{prefix}.counts", process_set).tolist()
    offsets = [0, *itertools.accumulate(counts)]
    words = torch.zeros(offsets[-1], dtype=torch.int32)
    words[offsets[me]:offsets[me + 1]] = mine
    words = _sum(words, f"{prefix}.data", process_set)
    return [_from_words(words[offsets[r]:offsets[r + 1]]) for r in range(ranks)]


#: The liveness channel of each process set, while an optimizer on this rank leases it.
_channels = Channels()


def watch_peers(process_set: Any = None, config: Any = None) -> Optional[Lease]:
    """A lease on the ``liveness.Liveness`` channel among the ranks of ``process_set``
    (collective over the set: the ranks agree whether they all hold the same one, else open a
    new one: rank 0's secret is broadcast, each rank's address is all-gathered;
    ``liveness/channels.py``); None when it is off (``DCREDIT_LIVENESS=0``), for a single rank,
    or in an elastic job.  The channel ends when the last lease on this rank is released.

    The secret, drawn by rank 0 and carried by Horovod (the job's trusted channel), never
    travels on the liveness sockets: a connection that cannot prove it knows it is refused
    (``handshake``).  The channel listens on one address (``interfaces.listen_address``):
    loopback when every rank is on this host, else the collective library's interface.

    Elastic jobs get none: a worker that joins constructs while the others are inside
    elastic's ``sync()``, so an address exchange would never be matched; there Horovod's own
    failure detection raises ``HorovodInternalError`` and ``hvd.elastic.run`` resets.  A loss
    ends the process (``Liveness.exit_on_loss``): outside elastic, Horovod cannot go on
    without a rank, and its shutdown would wait for the dead one for ever.
    """
    config = liveness.settings() if config is None else config
    process_set = hvd.global_process_set if process_set is None else process_set
    if (not config.enabled or os.environ.get("HOROVOD_ELASTIC") == "1"
            or process_set.size() < 2 or not process_set.included()):
        return None

    def open_channel() -> liveness.Liveness:
        secret = broadcast_object(handshake.new_secret() if process_set.rank() == 0 else None,
                                  0, process_set, "dcredit.liveness.secret")
        bind = interfaces.listen_address(config.bind, single_host=hvd.local_size() == hvd.size())
        channel = liveness.Liveness(process_set.rank(), process_set.size(), config,
                                    secret=secret, bind=bind, exit_on_loss=True,
                                    needed=hvd.is_initialized)
        channel.start(allgather_object(channel.address(), process_set, "dcredit.liveness"))
        return channel

    key = (getattr(process_set, "process_set_id", None), process_set.size(), process_set.rank())
    return _channels.lease(
        key, lambda token: allgather_object(token, process_set, "dcredit.liveness.token"),
        open_channel)


def raise_if_peer_lost() -> None:
    """For waits outside the scheduler (``wait``): a lost peer never answers."""
    lost = _channels.lost()
    if lost:
        raise PeerLostError.from_events(lost)


def accepts(group: Any) -> bool:
    """Horovod's groups are its process sets (``hvd.ProcessSet``)."""
    return isinstance(group, hvd.ProcessSet)


def transport(group: Any) -> HorovodTransport:
    return HorovodTransport(group)


class HorovodTransport:
    """``transport.Transport`` over one Horovod process set.

    Each method calls this module's function of the same name at call time (not a reference
    taken at construction), so that a test replacing ``collect`` here is seen by optimizers."""

    failure = HorovodInternalError
    average = AVERAGE
    sum = SUM

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set
        #: ``horovodrun --min-np/--max-np`` sets it in every worker.
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"

    def rank(self) -> int:
        return self.process_set.rank()

    def size(self) -> int:
        return self.process_set.size()

    def included(self) -> bool:
        return self.process_set.included()

    def group_id(self) -> Any:
        return getattr(self.process_set, "process_set_id", None)

    def job_rank(self) -> int:
        return rank()

    def job_size(self) -> int:
        return size()

    def is_up(self) -> bool:
        return is_initialized()

    def gpu_operations(self) -> bool:
        return gpu_operations_built()

    def execution(self) -> Execution:
        return execution()

    def submit(self, tensor: torch.Tensor, name: str, op: Any, prescale: float = 1.0,
               postscale: float = 1.0) -> int:
        return submit(tensor, name, op, prescale, postscale, self.process_set)

    def reduce_scatter(self, flat: torch.Tensor, name: str, op: Any) -> Half:
        return reduce_scatter(flat, name, op, self.process_set)

    def all_gather(self, shard: torch.Tensor, name: str, numel: int) -> Half:
        return all_gather(shard, name, numel, self.process_set)

    def poll(self, handle: Union[int, Half]) -> bool:
        return poll(handle)

    def collect(self, handle: Union[int, Half]) -> torch.Tensor:
        return collect(handle)

    def wait(self, handle: Union[int, Half], poll_seconds: float = 0.0002) -> torch.Tensor:
        return wait(handle, poll_seconds)

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        return broadcast_object(obj, root, self.process_set, name)

    def allgather_object(self, obj: Any, name: str) -> list:
        return allgather_object(obj, self.process_set, name)

    def watch_peers(self, settings: Any = None) -> Any:
        return watch_peers(self.process_set, settings)

    def close(self) -> None:
        """Nothing to give back: Horovod's background thread is Horovod's (``hvd.shutdown``)."""


def local_step_module() -> str:
    """The ``__module__`` for which ``hvd.broadcast_optimizer_state`` runs a local ``step()``.

    Horovod compares the optimizer's ``__module__`` with that of the ``DistributedOptimizer``
    it imports from ``horovod.torch.optimizer`` at call time.  Reading ``hvd.DistributedOptimizer``
    instead would break the drop-in swap ``hvd.DistributedOptimizer = dcredit_hvd.DistributedOptimizer``
    (ours would then name our own module, Horovod would run our collective ``step()`` on the
    ranks with empty state only, and the job would deadlock).
    """
    import horovod.torch.optimizer as horovod_optimizer
    return horovod_optimizer.DistributedOptimizer.__module__
