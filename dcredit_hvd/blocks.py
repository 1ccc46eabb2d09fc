"""Partitioning of gradients into contiguous flat blocks.

Every gradient tensor ``l`` (indexed in forward order, 0 = nearest the input) is viewed as a flat
vector of ``numel`` elements and cut into ``m_l = ceil(M_l / S_p)`` blocks of at most ``S_p``
bytes *as sent* (after compression).  The blocks are half-open element ranges ``[start, stop)``
that cover ``0..numel`` exactly once, in order (spec §2; the authors' row slicing that dropped
trailing rows, defect 7, cannot happen with flat ranges).

A block is identified by ``(tensor, index)``; that pair is also its priority: lower sorts first
(spec §5).  Tuples compare lexicographically, so no tensor can leak into another's range
(defect 8 of the reference code, ``index * 1000 + block``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, order=True)
class Block:
    """One contiguous piece of one gradient, the unit the scheduler sends."""

    tensor: int
    index: int
    start: int
    stop: int
    nbytes: int
    name: str

    @property
    def key(self) -> tuple[int, int]:
        """Priority key: lower is more urgent."""
        return (self.tensor, self.index)

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorLayout:
    """How one gradient is cut: its forward-order index, name, size and blocks."""

    index: int
    name: str
    numel: int
    element_size: int
    blocks: tuple[Block, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    @property
    def last_fraction(self) -> float:
        """``last_l``: the last block's share of a full block, in (0, 1] (spec §2, defect 2)."""
        if len(self.blocks) == 1:
            return 1.0
        full = self.blocks[0].nbytes
        return self.blocks[-1].nbytes / full


def partition(numel: int, element_size: int, partition_bytes: Optional[int]) -> list[tuple[int, int]]:
    """Cut ``numel`` elements into ranges of at most ``partition_bytes`` bytes.

    ``partition_bytes=None`` keeps the tensor whole.  A partition smaller than one element still
    sends one element per block, so every tensor makes progress.
    """
    if numel < 0 or element_size <= 0:
        raise ValueError(f"partition: need numel >= 0 and element_size > 0, got {numel}, {element_size}")
    if numel == 0:
        return [(0, 0)]
    if partition_bytes is None:
        return [(0, numel)]
    if partition_bytes <= 0:
        raise ValueError(f"partition_bytes must be > 0, got {partition_bytes}")
    per_block = max(1, partition_bytes // element_size)
    count = math.ceil(numel / per_block)
    return [(i * per_block, min(numel, (i + 1) * per_block)) for i in range(count)]


def block_name(prefix: str, tensor_name: str, index: int, count: int) -> str:
    """The name given to Horovod: identical on every rank, unique among in-flight blocks."""
    return f"{prefix}.{tensor_name}.{index}of{count}"


def build_layout(
    names: Sequence[str],
    numels: Sequence[int],
    element_sizes: Sequence[int],
    partition_bytes: Optional[int],
    prefix: str = "dcredit",
) -> list[TensorLayout]:
    """Layouts for tensors given in forward order (their position is their index ``l``)."""
    if not (len(names) == len(numels) == len(element_sizes)):
        raise ValueError("build_layout: names, numels and element_sizes must have equal lengths")
    layouts = []
    for l, (name, numel, esize) in enumerate(zip(names, numels, element_sizes)):
        ranges = partition(numel, esize, partition_bytes)
        blocks = tuple(
            Block(l, j, a, b, (b - a) * esize, block_name(prefix, name, j, len(ranges)))
            for j, (a, b) in enumerate(ranges)
        )
        layouts.append(TensorLayout(l, name, numel, esize, blocks))
    return layouts
