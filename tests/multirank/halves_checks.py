"""The checks of the two halves of an all-reduce that hold on every transport, without Horovod.

``tests/multirank/test_collective_halves.py`` (Horovod) and
``tests/torchrun/test_collective_halves.py`` (torch.distributed) run them on their own
transport, rank and verdict function (``assert_all_ranks``); each file keeps what is its
library's own (dtypes, refusals, the issue order)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from dcredit_hvd.transports.shards import chunk, shard_bounds


def sizes_around(size: int) -> list[int]:
    """Empty, one element, one fewer and one more than the ranks, even and uneven large."""
    return sorted({0, 1, max(size - 1, 0), size + 1, 1000, 1001})


class HalvesChecks:
    """One transport (``link``) of ``size`` ranks, seen from ``rank``; ``check(ok, message)``
    fails on every rank, ``gather(obj)`` returns every rank's ``obj``; ``low_rtol`` is the
    relative tolerance of 16-bit results."""

    def __init__(self, link: Any, rank: int, size: int, ops: dict[str, Any],
                 check: Callable[[bool, str], None], gather: Callable[[Any], list],
                 low_rtol: float) -> None:
        self.link, self.rank, self.size, self.ops = link, rank, size, ops
        self.check, self.gather, self.low_rtol = check, gather, low_rtol
        self.sizes = sizes_around(size)

    def vector(self, n: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
        """This rank's ``n`` values: small integers, so sums and means by 2 are exact in 16 bits."""
        generator = torch.Generator().manual_seed(1000 * self.rank + 7 * n + salt)
        return torch.randint(-50, 50, (n,), generator=generator).to(dtype)

    def all_reduced(self, flat: torch.Tensor, name: str, op: Any) -> torch.Tensor:
        """The reference: the transport's own all-reduce of a copy."""
        return self.link.wait(self.link.submit(flat.clone(), f"{name}.reference", op))

    def close(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        low = a.dtype in (torch.float16, torch.bfloat16)
        return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(
            a.double(), b.double(), rtol=self.low_rtol if low else 1e-6)

    def round_trip(self, n: int, op: str) -> None:
        """A reduce-scatter leaves exactly this rank's slice of the all-reduce, alone, and the
        all-gather of the slices is the all-reduce; the input is left as it was."""
        link, check, name = self.link, self.check, f"halves.one.{n}.{op}"
        flat = self.vector(n)
        start, stop = shard_bounds(n, self.size, self.rank)
        shard = link.wait(link.reduce_scatter(flat, name, self.ops[op]))
        whole = link.wait(link.all_gather(shard, name, n))
        reference = self.all_reduced(flat, name, self.ops[op])
        check(shard.shape == (stop - start,),
              f"shard of {tuple(shard.shape)}, this rank owns [{start}, {stop})")
        check(self.close(shard, reference[start:stop]), f"shard != all-reduce[{start}:{stop}]")
        check(self.close(whole, reference), f"all-gather of the shards != all-reduce ({n})")
        check(torch.equal(flat, self.vector(n)), "reduce_scatter changed its input")
        held = shard.untyped_storage().nbytes() // shard.element_size()
        check(held <= chunk(n, self.size), f"the shard holds {held} elements, a chunk is "
              f"{chunk(n, self.size)}: it keeps more than its share alive")

    def average_is_the_mean(self) -> None:
        flat = torch.full((2 * self.size + 1,), float(self.rank + 1))
        start, stop = shard_bounds(flat.numel(), self.size, self.rank)
        mean = sum(range(1, self.size + 1)) / self.size
        shard = self.link.wait(self.link.reduce_scatter(flat, "halves.mean", self.ops["average"]))
        total = self.link.wait(self.link.reduce_scatter(flat, "halves.total", self.ops["sum"]))
        self.check(torch.equal(shard, torch.full((stop - start,), mean)), f"{shard} != {mean}")
        self.check(torch.equal(total, torch.full((stop - start,), mean * self.size)), f"{total}")

    def against_all_reduces(self, flats: dict, shards: dict, wholes: dict) -> None:
        """Each ``(n, op)`` case's shard and all-gather against the all-reduce of its input."""
        for n, op in flats:
            reference = self.all_reduced(flats[n, op], f"halves.many.{n}.{op}", self.ops[op])
            start, stop = shard_bounds(n, self.size, self.rank)
            self.check(self.close(shards[n, op], reference[start:stop]), f"shard of {n} ({op})")
            self.check(self.close(wholes[n, op], reference), f"all-gather of {n} ({op})")

    def gathered_alike(self) -> None:
        """The all-gather is the ranks' shards in rank order, alike on every rank."""
        n = 1001
        start, stop = shard_bounds(n, self.size, self.rank)
        shard = self.vector(n)[start:stop]
        whole = self.link.wait(self.link.all_gather(shard, "halves.alike", n))
        everyone = self.gather(whole.tolist())
        self.check(all(other == everyone[0] for other in everyone), "ranks gathered differently")
        self.check(everyone[0] == sum(self.gather(shard.tolist()), []),
                   "not the ranks' shards in rank order")

    def each_dtype(self, dtype: torch.dtype) -> None:
        n = self.size + 1
        flat = self.vector(n, dtype)
        name = f"halves.dtype.{dtype}"
        shard = self.link.wait(self.link.reduce_scatter(flat, name, self.ops["average"]))
        whole = self.link.wait(self.link.all_gather(shard, name, n))
        reference = self.all_reduced(flat, name, self.ops["average"])
        self.check(shard.dtype == dtype and self.close(whole, reference), f"{dtype}: {whole}")
