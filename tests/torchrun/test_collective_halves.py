"""The two halves of an all-reduce on the torch.distributed transport (real Gloo, every rank,
under ``torchrun --nproc-per-node 2``): ``reduce_scatter`` leaves each rank exactly its
``shard_bounds`` slice of the reduced vector, ``all_gather`` of those slices is the all-reduce,
for lengths around the world size, both ops, every dtype Gloo takes, several handles in flight,
and ranks that submit halves and all-reduces in different orders: like ``submit``'s all-reduces,
the halves are issued in rank 0's published order, so the ranks' issue logs stay identical."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dcredit_hvd.transports import torch_distributed
from dcredit_hvd.transports.shards import chunk, shard_bounds

from conftest import assert_all_ranks, gather, rank, size

N = size()
#: Empty, one element, one fewer and one more than the ranks, even and uneven large.
SIZES = sorted({0, 1, max(N - 1, 0), N + 1, 1000, 1001})
OPS = {"average": torch_distributed.AVERAGE, "sum": torch_distributed.SUM}
#: What the Gloo back-end of torch 2.13 reduce-scatters and all-gathers (measured).
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def link() -> torch_distributed.TorchTransport:
    """The transport over the default group (its channel: a collective, every rank here)."""
    return torch_distributed.transport(dist.group.WORLD)


def vector(n: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    """This rank's ``n`` values: small integers, so sums and means by 2 are exact in 16 bits."""
    generator = torch.Generator().manual_seed(1000 * rank() + 7 * n + salt)
    return torch.randint(-50, 50, (n,), generator=generator).to(dtype)


def all_reduced(link, flat: torch.Tensor, name: str, op) -> torch.Tensor:
    """The reference: the transport's own all-reduce of a copy."""
    return link.wait(link.submit(flat.clone(), f"{name}.reference", op))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    low = a.dtype in (torch.float16, torch.bfloat16)
    return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(
        a.double(), b.double(), rtol=1e-2 if low else 1e-6)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter_then_all_gather_is_the_all_reduce(link, n: int, op: str) -> None:
    name = f"halves.one.{n}.{op}"
    flat = vector(n)
    start, stop = shard_bounds(n, N, rank())
    shard = link.wait(link.reduce_scatter(flat, name, OPS[op]))
    whole = link.wait(link.all_gather(shard, name, n))
    reference = all_reduced(link, flat, name, OPS[op])
    assert_all_ranks(shard.shape == (stop - start,),
                     f"shard of {tuple(shard.shape)}, this rank owns [{start}, {stop})")
    assert_all_ranks(close(shard, reference[start:stop]), f"shard != all-reduce[{start}:{stop}]")
    assert_all_ranks(close(whole, reference), f"all-gather of the shards != all-reduce ({n})")
    assert_all_ranks(torch.equal(flat, vector(n)), "reduce_scatter changed its input")
    held = shard.untyped_storage().nbytes() // shard.element_size()
    assert_all_ranks(held <= chunk(n, N), f"the shard holds {held} elements, a chunk is "
                     f"{chunk(n, N)}: it keeps more than its share alive")


def test_average_is_the_mean_over_ranks(link) -> None:
    flat = torch.full((2 * N + 1,), float(rank() + 1))
    start, stop = shard_bounds(flat.numel(), N, rank())
    mean = sum(range(1, N + 1)) / N
    shard = link.wait(link.reduce_scatter(flat, "halves.mean", torch_distributed.AVERAGE))
    total = link.wait(link.reduce_scatter(flat, "halves.total", torch_distributed.SUM))
    assert_all_ranks(torch.equal(shard, torch.full((stop - start,), mean)), f"{shard} != {mean}")
    assert_all_ranks(torch.equal(total, torch.full((stop - start,), mean * N)), f"{total}")


def test_several_handles_in_flight_submitted_in_different_orders_on_each_rank(link) -> None:
    """Every size and op at once, with an all-reduce among them, rank 1 submitting in the
    reverse order (a rank issuing in its own order would pair different collectives: wrong sums,
    or a hang), collected in yet another order; then every all-gather at once the same way.
    The issue logs are rank 0's on every rank."""
    before = len(link.issue_log())
    cases = [(n, op) for n in SIZES for op in sorted(OPS)]
    flats = {case: vector(case[0], salt=3) for case in cases}
    extra = vector(33, salt=5)
    jobs = [("scatter", case) for case in cases] + [("reduce", None)]
    mine = jobs[::-1] if rank() % 2 else jobs
    pending = {}
    for kind, case in mine:
        if kind == "reduce":
            pending[kind, case] = link.submit(extra.clone(), "halves.many.extra", OPS["sum"])
        else:
            pending[kind, case] = link.reduce_scatter(
                flats[case], f"halves.many.{case[0]}.{case[1]}", OPS[case[1]])
    done = {job: link.wait(pending[job]) for job in sorted(jobs, key=str)}
    shards = {case: done["scatter", case] for case in cases}
    pending = {case: link.all_gather(shards[case], f"halves.many.{case[0]}.{case[1]}", case[0])
               for case in (cases[::-1] if rank() % 2 else cases)}
    wholes = {case: link.wait(pending[case]) for case in cases}
    log = link.issue_log()[before:]
    logs = gather(log)
    assert_all_ranks(len(log) == 2 * len(cases) + 1, f"{len(log)} collectives issued")
    assert_all_ranks(all(other == logs[0] for other in logs), "the ranks issued in other orders")
    reference = all_reduced(link, extra, "halves.many.extra", OPS["sum"])
    assert_all_ranks(torch.equal(done["reduce", None], reference), "the all-reduce among them")
    for n, op in cases:
        reference = all_reduced(link, flats[n, op], f"halves.many.{n}.{op}", OPS[op])
        start, stop = shard_bounds(n, N, rank())
        assert_all_ranks(close(shards[n, op], reference[start:stop]), f"shard of {n} ({op})")
        assert_all_ranks(close(wholes[n, op], reference), f"all-gather of {n} ({op})")


def test_one_name_for_both_halves_is_matched_by_kind(link) -> None:
    """A bucket's reduce-scatter and all-gather may share its name; the order tells them apart
    (``Entry.kind``), as do the issue logs' positions."""
    flat = vector(1001, salt=9)
    shard = link.wait(link.reduce_scatter(flat, "halves.bucket", OPS["sum"]))
    whole = link.wait(link.all_gather(shard, "halves.bucket", 1001))
    assert_all_ranks(close(whole, all_reduced(link, flat, "halves.bucket", OPS["sum"])), "bucket")


def test_the_gathered_vector_is_alike_on_every_rank(link) -> None:
    n = 1001
    start, stop = shard_bounds(n, N, rank())
    shard = vector(n)[start:stop]
    whole = link.wait(link.all_gather(shard, "halves.alike", n))
    everyone = gather(whole.tolist())
    assert_all_ranks(all(other == everyone[0] for other in everyone), "ranks gathered differently")
    assert_all_ranks(everyone[0] == sum(gather(shard.tolist()), []),
                     "not the ranks' shards in rank order")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_gloo_reduces(link, dtype: torch.dtype) -> None:
    n = N + 1
    flat = vector(n, dtype)
    name = f"halves.dtype.{dtype}"
    shard = link.wait(link.reduce_scatter(flat, name, torch_distributed.AVERAGE))
    whole = link.wait(link.all_gather(shard, name, n))
    reference = all_reduced(link, flat, name, torch_distributed.AVERAGE)
    assert_all_ranks(shard.dtype == dtype and close(whole, reference), f"{dtype}: {whole}")


def test_refusals_happen_before_anything_is_issued(link) -> None:
    before = len(link.issue_log())
    start, stop = shard_bounds(10, N, rank())
    with pytest.raises(ValueError, match=f"owns elements \\[{start}, {stop}\\) of 10"):
        link.all_gather(torch.zeros(stop - start + 1), "halves.wrong", 10)
    with pytest.raises(ValueError, match="1-D"):
        link.reduce_scatter(torch.zeros(2, 3), "halves.2d", OPS["sum"])
    with pytest.raises(ValueError, match="op=None or torch.distributed"):
        link.reduce_scatter(torch.zeros(4), "halves.max", dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="tab or newline"):
        link.all_gather(torch.zeros(stop - start), "halves\tname", 10)
    assert_all_ranks(len(link.issue_log()) == before, "a refused half was issued")
