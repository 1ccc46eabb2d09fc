"""Partitioning of gradients into contiguous flat blocks.

Every gradient tensor ``l`` (indexed in forward order, 0 = nearest the input) is viewed as a flat
vector of ``numel`` elements and cut into ``m_l = ceil(M_l / S_p)`` blocks of at most ``S_p``
bytes *as sent* (after compression).  The blocks are half-open element ranges ``[start, stop)``
that cover ``0..numel`` exactly once, in order (spec §2; the authors' row slicing that dropped
trailing rows, defect 7, cannot happen with flat ranges).

A block is identified by ``(tensor, index)``; that pair is also its priority: lower sorts first
(spec §5).  Tuples compare lexicographically, so no tensor can leak into another's range
(defect 8 of the reference code, ``index * 1000 + block``).

Small gradients travel together (``group_runs``): a *unit* is either one gradient or a run of
consecutive small gradients (forward order, one dtype and device) laid end to end in one flat
buffer; units are what is indexed, cut into blocks and scheduled.  Runs are consecutive, so a
unit's priority is its first member's and grouping never reorders against the priority rule.
One block of a run costs one submission, one completion and one update call instead of one per
gradient (``docs/algorithm.md`` §1b).
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
    """How one unit is cut: its forward-order index, name, size and blocks.

    A unit is one gradient, or a run of consecutive gradients sent from one flat buffer:
    ``members`` are their positions in the tensor order and ``member_numels`` their sizes, in
    buffer order (one member: the gradient itself, no buffer).
    """

    index: int
    name: str
    numel: int
    element_size: int
    blocks: tuple[Block, ...]
    members: tuple[int, ...] = ()
    member_numels: tuple[int, ...] = ()

    @property
    def grouped(self) -> bool:
        """Sent from a shared flat buffer (more than one gradient)."""
        return len(self.members) > 1

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


def group_runs(nbytes: Sequence[int], kinds: Sequence[object], limit_bytes: Optional[int]) -> tuple[int, ...]:
    """Member counts of the units that group consecutive small tensors (``docs/algorithm.md`` §1b).

    Walking the tensors in forward order, a tensor of at least ``limit_bytes`` is a unit of its
    own; a smaller one joins the open run when it has the same kind (dtype and device; ``None``:
    never grouped) and the run stays within ``limit_bytes``, else it opens a new run.  ``None``
    or 0: every tensor is its own unit.  The counts sum to ``len(nbytes)``.
    """
    if len(nbytes) != len(kinds):
        raise ValueError("group_runs: nbytes and kinds must have equal lengths")
    if not limit_bytes:
        return (1,) * len(nbytes)
    if limit_bytes < 0:
        raise ValueError(f"group_runs: limit_bytes must be >= 0, got {limit_bytes}")
    counts: list[int] = []
    run_bytes = 0
    run_kind: object = None
    open_run = False
    for size, kind in zip(nbytes, kinds):
        small = size < limit_bytes and kind is not None
        if small and open_run and kind == run_kind and run_bytes + size <= limit_bytes:
            counts[-1] += 1
            run_bytes += size
            continue
        counts.append(1)
        open_run, run_bytes, run_kind = small, size, kind
    return tuple(counts)


def unit_name(first_name: str, count: int) -> str:
    """A unit's name: its first tensor's, plus ``+k`` for the ``k`` tensors that follow it."""
    return first_name if count == 1 else f"{first_name}+{count - 1}"


def check_groups(groups: Sequence[int], count: int) -> None:
    """``groups`` (member counts per unit) must cover ``count`` tensors exactly, in order."""
    if any(not isinstance(g, int) or g < 1 for g in groups) or sum(groups) != count:
        raise ValueError(f"groups {tuple(groups)!r} must be counts >= 1 that sum to the "
                         f"{count} tensors (consecutive runs in forward order)")


def build_layout(
    names: Sequence[str],
    numels: Sequence[int],
    element_sizes: Sequence[int],
    partition_bytes: Optional[int],
    prefix: str = "dcredit",
    groups: Sequence[int] = (),
) -> list[TensorLayout]:
    """Layouts for tensors given in forward order.

    Without ``groups`` each tensor is a unit and its position is its index ``l``.  With
    ``groups`` (member counts, ``group_runs``) unit ``u`` holds the next ``groups[u]`` tensors
    end to end; it is cut like one tensor of their total size (their element sizes must agree).
    """
    if not (len(names) == len(numels) == len(element_sizes)):
        raise ValueError("build_layout: names, numels and element_sizes must have equal lengths")
    groups = tuple(groups) or (1,) * len(names)
    check_groups(groups, len(names))
    layouts = []
    first = 0
    for u, count in enumerate(groups):
        members = tuple(range(first, first + count))
        first += count
        sizes = {element_sizes[i] for i in members}
        if len(sizes) != 1:
            raise ValueError(f"build_layout: unit {u} groups tensors with element sizes "
                             f"{sorted(sizes)}; only tensors of one dtype share a buffer")
        esize = element_sizes[members[0]]
        numel = sum(numels[i] for i in members)
        name = unit_name(names[members[0]], count)
        ranges = partition(numel, esize, partition_bytes)
        blocks = tuple(
            Block(u, j, a, b, (b - a) * esize, block_name(prefix, name, j, len(ranges)))
            for j, (a, b) in enumerate(ranges)
        )
        layouts.append(TensorLayout(u, name, numel, esize, blocks, members,
                                    tuple(numels[i] for i in members)))
    return layouts
