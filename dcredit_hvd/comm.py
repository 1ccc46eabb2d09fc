"""The only module that calls Horovod's collectives.

Everything the scheduler sends goes through ``submit``/``poll``/``collect``; the few collectives
used at set-up (object broadcast and all-gather) are here too, so replacing the transport means
editing this file only.  Public ``horovod.torch`` API only: Horovod is never patched.
"""
from __future__ import annotations

import pickle
import time
from typing import Any, Optional

import horovod.torch as hvd
import torch

#: The reduction ops, re-exported so no other module needs Horovod for them.
AVERAGE = hvd.Average
SUM = hvd.Sum
#: Horovod's error for a failed collective (a peer died, Horovod shut down); elastic recovers it.
HorovodInternalError = hvd.HorovodInternalError


def rank() -> int:
    return hvd.rank()


def size() -> int:
    return hvd.size()


def is_initialized() -> bool:
    """False after ``hvd.shutdown()``: every handle is gone and nothing can be sent."""
    return hvd.is_initialized()


def gpu_operations_built() -> bool:
    """Whether Horovod reduces CUDA tensors on the GPU (built with NCCL, or RCCL on ROCm).

    Not ``hvd.cuda_built()``: a Horovod compiled against a CUDA torch reports CUDA even without
    GPU operations, and then copies CUDA tensors to the host itself.  (A build with
    ``HOROVOD_GPU_OPERATIONS=MPI`` is not detectable here: pass ``cuda_staging=False``.)
    """
    return bool(hvd.nccl_built())


def submit(tensor: torch.Tensor, name: str, op: Any, prescale: float, postscale: float,
           process_set: Any) -> int:
    """Start an in-place all-reduce of ``tensor`` under ``name``; returns Horovod's handle."""
    return hvd.allreduce_async_(tensor, name=name, op=op, prescale_factor=prescale,
                                postscale_factor=postscale, process_set=process_set)


def poll(handle: int) -> bool:
    """True when the all-reduce behind ``handle`` has finished (successfully or not)."""
    return hvd.poll(handle)


def collect(handle: int) -> torch.Tensor:
    """The result of a finished all-reduce; raises ``HorovodInternalError`` if it failed."""
    return hvd.synchronize(handle)


def wait(handle: int, poll_seconds: float = 0.0002) -> torch.Tensor:
    """``collect`` after polling with short sleeps.

    ``hvd.synchronize`` busy-waits (yielding); on a machine with as many busy processes as cores
    that starves Horovod's own background thread: a 4 KiB all-reduce measured 30-50 ms that way
    against 1-5 ms when polled (2 ranks on 2 cores).
    """
    while not poll(handle):
        time.sleep(poll_seconds)
    return collect(handle)


def broadcast_object(obj: Any, root_rank: int = 0, process_set: Any = None,
                     name: Optional[str] = None) -> Any:
    kwargs = {"process_set": process_set} if process_set is not None else {}
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name, **kwargs)


def allgather_object(obj: Any, process_set: Any = None, name: Optional[str] = None) -> list:
    """Every rank's ``obj``, in rank order, over ``process_set``.

    ``hvd.allgather_object`` has no process-set argument in 0.28.1, so objects travel as pickled
    bytes through ``hvd.allgather`` (which concatenates rows of different lengths).
    """
    process_set = hvd.global_process_set if process_set is None else process_set
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    prefix = name or "dcredit.allgather_object"
    sizes = hvd.allgather(torch.tensor([payload.numel()]), name=f"{prefix}.sizes",
                          process_set=process_set)
    data = hvd.allgather(payload, name=f"{prefix}.data", process_set=process_set)
    out, offset = [], 0
    for size in sizes.tolist():
        out.append(pickle.loads(data[offset:offset + size].numpy().tobytes()))
        offset += size
    return out
