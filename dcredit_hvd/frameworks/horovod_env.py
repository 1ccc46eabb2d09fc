"""Horovod for the Lightning strategies: the ranks ``horovodrun`` gave (``HorovodRanks``, the
body of each Lightning package's ``ClusterEnvironment``) and the collectives Lightning itself
uses (logging's ``sync_dist``, ``ModelCheckpoint``'s broadcast, barriers) on Horovod, and the
strategies' side of them (``HorovodCollectives``).

Lightning-free, so both packages (``lightning`` and ``pytorch_lightning``) build their own
environment class on it and no class of one package meets the other's in a run.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from torch import Tensor


def horovod() -> Any:
    """``horovod.torch``, initialised on first use."""
    import horovod.torch as hvd
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def detect() -> bool:
    """Started by ``horovodrun`` (``HOROVOD_RANK`` set; torchrun's ``LOCAL_RANK`` wins)."""
    return "HOROVOD_RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ


class HorovodRanks:
    """Ranks from Horovod: ``horovodrun`` started every process (``creates_processes_
    externally``), so Lightning must not launch more; the ranks are Horovod's, read from
    ``horovodrun``'s variables, else from ``hvd`` itself (``mpirun``), initialised on demand.
    Mixed in before a package's ``ClusterEnvironment``."""

    VARIABLES = {"world_size": "HOROVOD_SIZE", "global_rank": "HOROVOD_RANK",
                 "local_rank": "HOROVOD_LOCAL_RANK", "node_rank": "HOROVOD_CROSS_RANK"}

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return detect()

    def _read(self, what: str) -> int:
        value = os.environ.get(self.VARIABLES[what])
        if value is not None:
            return int(value)
        hvd = horovod()
        return {"world_size": hvd.size, "global_rank": hvd.rank, "local_rank": hvd.local_rank,
                "node_rank": hvd.cross_rank}[what]()

    def world_size(self) -> int:
        return self._read("world_size")

    def set_world_size(self, size: int) -> None:
        """Horovod's, not Lightning's."""

    def global_rank(self) -> int:
        return self._read("global_rank")

    def set_global_rank(self, rank: int) -> None:
        """Horovod's, not Lightning's."""

    def local_rank(self) -> int:
        return self._read("local_rank")

    def node_rank(self) -> int:
        return self._read("node_rank")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self.world_size():
            raise ValueError(
                f"dcredit_hvd.lightning: the Horovod job has {self.world_size()} processes but "
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) asks for "
                f"{num_devices * num_nodes}: pass devices=<processes per host> and "
                "num_nodes=<hosts> as given to horovodrun.")


def reduce(tensor: Any, reduce_op: Any) -> Any:
    """``Strategy.reduce`` with Horovod's all-reduce (logging's ``sync_dist``, decisions)."""
    if not isinstance(tensor, Tensor):
        return tensor
    hvd = horovod()
    op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
    ops = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
           "min": hvd.Min, "product": hvd.Product}
    if op not in ops:
        raise ValueError(f"dcredit_hvd.lightning: reduce_op {reduce_op!r} is not one of "
                         f"{', '.join(ops)} under Horovod")
    return hvd.allreduce(tensor, op=ops[op])


def broadcast(tensors: list[Tensor]) -> None:
    """Rank 0's values into ``tensors``, in place, over Horovod."""
    hvd = horovod()
    handles = [hvd.broadcast_async_(t, root_rank=0, name=f"dcredit.lightning.buffer{i}")
               for i, t in enumerate(tensors)]
    for handle in handles:
        hvd.synchronize(handle)


class HorovodCollectives:
    """The process group and the collectives Lightning uses (logging, checkpoints): DDP's,
    Horovod's under Horovod (``self.horovod``); mixed into ``DCreditStrategyBody``."""

    def setup_distributed(self) -> None:
        """torch.distributed as ``DDPStrategy`` sets it up; under Horovod, ``hvd.init()``."""
        if not self.horovod:
            super().setup_distributed()                              # type: ignore[misc]
            return
        self.kit.reset_seed()
        self.set_world_ranks()
        horovod()
        assert self.cluster_environment is not None
        self.cluster_environment.validate_settings(self.num_processes, self.num_nodes)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.horovod:
            return super().barrier(*args, **kwargs)                  # type: ignore[misc]
        horovod().barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.horovod:
            return super().broadcast(obj, src)                       # type: ignore[misc]
        return horovod().broadcast_object(obj, root_rank=src)

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Any] = "mean") -> Any:
        if not self.horovod:
            return super().reduce(tensor, group=group,               # type: ignore[misc]
                                  reduce_op=reduce_op)
        return reduce(tensor, reduce_op)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None,
                   sync_grads: bool = False) -> Tensor:
        if not self.horovod:
            return super().all_gather(tensor, group=group,           # type: ignore[misc]
                                      sync_grads=sync_grads)
        return horovod().allgather(tensor.unsqueeze(0))
