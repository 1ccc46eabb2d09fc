"""Cross-rank agreement: every rank must put the same blocks on the wire under the same names.

Horovod matches all-reduces by name and sums whatever each rank sent under it: a rank that cut
its gradients differently (other units, another order, another partition) makes Horovod fail
with a shape error, or worse, sum unrelated bytes of the same size silently.  Rank-dependent
forwards (LayerDrop, MoE routing, a branch one rank takes) give each rank a different view of
the model, so every decision that shapes the wire is rank 0's, broadcast (``agree_order``,
``planning``), and each layout that goes into service is checked (``check_layouts``): one
all-gather of a digest, and only when the digests differ a second one that names the first
differing unit, on every rank at once (every rank sees every digest, so all take the same
branch and nobody is left waiting in a collective).

The functions take the transport's ``allgather(obj, name) -> list`` and
``broadcast(obj, name) -> obj`` so that this module knows no collective library.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Callable

from ..errors import LayoutMismatchError
from ..planning.blocks import TensorLayout

AllGather = Callable[[Any, str], list]
Broadcast = Callable[[Any, str], Any]


def first_difference(ref: dict, other: dict, other_rank: int) -> str:
    """The first field of the construction-time description in which ``other`` differs."""
    for key in ref:
        if ref[key] == other.get(key):
            continue
        if key != "parameters":
            return f"{key} is {ref[key]!r} on rank 0 but {other.get(key)!r} on rank {other_rank}"
        for i, (a, b) in enumerate(zip(ref[key], other[key])):
            if a != b:
                return (f"trainable parameter #{i} is {a} (name, shape, dtype) on rank 0 but {b} "
                        f"on rank {other_rank}")
        return (f"rank 0 has {len(ref[key])} trainable parameters but rank {other_rank} has "
                f"{len(other[key])}")
    return f"rank {other_rank} differs from rank 0"


def check_construction(mine: dict, allgather: AllGather, name: str) -> None:
    """Raise ``ValueError`` on every rank when any rank's ``mine`` differs from rank 0's."""
    everyone = allgather(mine, name)
    for other_rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ValueError(
                "dcredit_hvd: ranks disagree on what to all-reduce: "
                f"{first_difference(everyone[0], theirs, other_rank)}. Every rank must build "
                "the same model (same parameters, shapes, dtypes and requires_grad) and pass "
                "the same DistributedOptimizer arguments and DCREDIT_* variables.")


def describe_layouts(layouts: Sequence[TensorLayout], members: Sequence[Sequence[tuple]]) -> list:
    """What a layout puts on the wire, unit by unit in priority order: the unit's name, its
    members as ``(name, shape, dtype)`` in buffer order, and its blocks as ``(name, bytes)``."""
    return [(layout.name, tuple(members[layout.index]),
             tuple((b.name, b.nbytes) for b in layout.blocks)) for layout in layouts]


def digest(description: list) -> str:
    return hashlib.sha256(repr(description).encode()).hexdigest()


def first_differing_unit(ref: list, other: list, other_rank: int) -> str:
    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return (f"unit #{i} is {_unit(a)} on rank 0 but {_unit(b)} on rank {other_rank}")
    return f"rank 0 has {len(ref)} units but rank {other_rank} has {len(other)}"


def _unit(entry: tuple) -> str:
    name, members, blocks = entry
    shown = ", ".join(f"{n} {list(s)} {d}" for n, s, d in members[:4])
    more = f", ... ({len(members)} tensors)" if len(members) > 4 else ""
    return f"{name!r} [{shown}{more}] in {len(blocks)} block(s) of {sum(n for _, n in blocks)} bytes"


def check_layouts(description: list, allgather: AllGather, name: str, when: str) -> None:
    """Raise ``LayoutMismatchError`` on every rank when the ranks' layouts differ."""
    digests = allgather(digest(description), f"{name}.digest")
    if all(d == digests[0] for d in digests):
        return
    everyone = allgather(description, f"{name}.units")
    other_rank = next(r for r, d in enumerate(digests) if d != digests[0])
    raise LayoutMismatchError(
        f"dcredit_hvd: ranks disagree on the blocks to all-reduce {when}: "
        f"{first_differing_unit(everyone[0], everyone[other_rank], other_rank)}. Nothing was "
        "sent. The order, grouping and partition are rank 0's and broadcast, so this is a bug "
        "in dcredit_hvd or ranks that built different models: please report it with this "
        "message.")


def agree_order(first_reads: Sequence[int], count: int, is_root: bool, broadcast: Broadcast,
                name: str) -> list[int]:
    """Rank 0's forward order as positions ``0..count-1`` of the construction order: the
    tensors rank 0's first forward read, in that order, then the others in construction order.

    Every rank calls it at the same step and gets the same list, whatever its own forward read
    (a rank-dependent forward reads other parameters, or in another order).
    """
    chosen = broadcast(list(first_reads) if is_root else None, name)
    seen = set(chosen)
    if len(seen) != len(chosen) or any(not 0 <= i < count for i in chosen):
        raise ValueError(f"agree_order: {chosen!r} is not a set of positions below {count}")
    return list(chosen) + [i for i in range(count) if i not in seen]
