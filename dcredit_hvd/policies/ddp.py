"""PyTorch DDP's schedule: gradient buckets of about 25 MiB, filled in backward order, each
all-reduced as soon as its last gradient is in.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020
(``bucket_cap_mb=25``).  DDP forms its buckets in the reverse of the parameters' order, the
order backward produces them; here a bucket is a unit (``blocks.group_runs``, one flat
buffer), the runs cut walking the tensors from the last to the first::

    groups  =  reversed(group_runs(reversed(nbytes), reversed(kinds), bucket_bytes))
    admit(head)  =  True

so the race (``planning/race.py``) can run DDP's schedule inside ``dcredit``'s runtime and the
simulator can price it with the same object.  A tensor of at least ``bucket_bytes`` is a bucket
of its own; CUDA tensors are never grouped (``runtime/units.kind``), so on CUDA this is WFBP.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from ..planning.blocks import Block, group_runs
from .base import Policy

#: ``torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)``.
DDP_BUCKET_BYTES = 25 << 20


class DDPBuckets(Policy):
    name = "ddp"

    def __init__(self, bucket_bytes: int = DDP_BUCKET_BYTES) -> None:
        super().__init__()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.bucket_bytes = int(bucket_bytes)

    def partition_bytes(self, configured: Optional[int]) -> Optional[int]:
        return None  # a bucket goes out whole, as DDP's does

    def groups(self, nbytes: Sequence[int], kinds: Sequence[object]) -> tuple[int, ...]:
        return tuple(reversed(group_runs(list(reversed(nbytes)), list(reversed(kinds)),
                                         self.bucket_bytes)))

    def gather_rule(self) -> Policy:
        return DDPBuckets(self.bucket_bytes)

    def admit(self, block: Block) -> bool:
        return True

    def describe(self) -> str:
        return f"ddp(buckets of {self.bucket_bytes} B in backward order)"
