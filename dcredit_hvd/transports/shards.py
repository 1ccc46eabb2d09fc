"""Which slice of a flat vector each rank owns: the one rule both halves of an all-reduce use.

A reduce-scatter leaves each rank the reduced values of its own slice, and the all-gather that
follows puts every rank's slice back together, so the two must agree on the slices, on every rank
and on every transport.  Collective libraries do not agree among themselves: Horovod's
``reducescatter`` gives the first ``n mod size`` ranks one extra element, ``torch.distributed``'s
``reduce_scatter_tensor`` refuses a length that is not a multiple of the group's size.  So the
transports pad the vector themselves, with zeros, up to a multiple of the size, and hand each rank
an equal chunk of the padded vector; both libraries then split it the same way, and the padding
(at the end, on the highest ranks) is stripped from what they return.

``shard_bounds`` is that rule, pure (no torch, no library), so that a caller can slice its own
parameters or optimizer state the same way the transports slice gradients; ``flat_length`` and
``check_shard`` are the checks both transports make of their inputs, with one message each.
"""
from __future__ import annotations


def chunk(numel: int, size: int) -> int:
    """Elements of the padded vector each of ``size`` ranks receives: ``ceil(numel / size)``."""
    _check(numel, size)
    return -(-numel // size)


def padded(numel: int, size: int) -> int:
    """``numel`` rounded up to a multiple of ``size`` (what goes on the wire)."""
    return chunk(numel, size) * size


def shard_bounds(numel: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)``: the slice of an ``numel``-element vector that rank ``rank`` of
    ``size`` owns, ``[rank * c, min((rank + 1) * c, numel))`` with ``c = chunk(numel, size)``.

    Every element belongs to exactly one rank, in rank order.  A rank whose chunk lies wholly in
    the padding owns an empty slice (``start == stop``): the high ranks when ``numel < size``,
    every rank when ``numel == 0``; ``start`` is then clamped to ``numel``, so that the slice
    ``vector[start:stop]`` is always valid.
    """
    _check(numel, size)
    if not 0 <= rank < size:
        raise ValueError(f"dcredit_hvd: shards: rank {rank} is not a rank of a group of {size}")
    width = chunk(numel, size)
    stop = min((rank + 1) * width, numel)
    return min(rank * width, stop), stop


def flat_length(shape: tuple[int, ...], what: str) -> int:
    """The length of a vector of ``shape`` handed to ``what``; a vector must be 1-D."""
    if len(shape) != 1:
        raise ValueError(f"dcredit_hvd: {what} takes a 1-D tensor, got shape {tuple(shape)}: "
                         "pass tensor.reshape(-1)")
    return shape[0]


def check_shard(length: int, numel: int, size: int, rank: int, name: str) -> None:
    """An all-gather's input: rank ``rank``'s shard of an ``numel``-element vector must have
    ``shard_bounds``' length (checked before anything is sent, so no rank waits for it)."""
    start, stop = shard_bounds(numel, size, rank)
    if length != stop - start:
        raise ValueError(f"dcredit_hvd: all_gather {name!r}: rank {rank} of {size} owns "
                         f"elements [{start}, {stop}) of {numel}, so its shard has "
                         f"{stop - start} elements, not {length} (shards.shard_bounds)")


def _check(numel: int, size: int) -> None:
    if size < 1:
        raise ValueError(f"dcredit_hvd: shards over a group of {size} ranks: a group has at "
                         "least one")
    if numel < 0:
        raise ValueError(f"dcredit_hvd: shards of a vector of {numel} elements: a length is "
                         ">= 0")
