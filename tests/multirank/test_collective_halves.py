"""The two halves of an all-reduce on the Horovod transport, on real collectives (every rank,
under ``mpirun -np 2`` and ``horovodrun --gloo -np 2``): ``reduce_scatter`` leaves each rank
exactly its ``shard_bounds`` slice of the reduced vector, ``all_gather`` of those slices is the
all-reduce, for lengths around the world size, both ops, several handles in flight and ranks that
submit in different orders (Horovod's coordinator matches by name)."""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch

from dcredit_hvd.transports import horovod as horovod_transport
from dcredit_hvd.transports.shards import chunk, shard_bounds

from conftest import assert_all_ranks

N = hvd.size()
#: Empty, one element, one fewer and one more than the ranks, even and uneven large.
SIZES = sorted({0, 1, max(N - 1, 0), N + 1, 1000, 1001})
OPS = {"average": horovod_transport.AVERAGE, "sum": horovod_transport.SUM}
#: What Horovod 0.28.1's torch binding reduce-scatters and all-gathers (no bfloat16).
DTYPES = [torch.float32, torch.float64, torch.float16]


@pytest.fixture(scope="module")
def link() -> horovod_transport.HorovodTransport:
    return horovod_transport.transport(hvd.global_process_set)


def vector(n: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    """This rank's ``n`` values: small integers, so sums and means by 2 are exact in fp16."""
    generator = torch.Generator().manual_seed(1000 * hvd.rank() + 7 * n + salt)
    return torch.randint(-50, 50, (n,), generator=generator).to(dtype)


def all_reduced(link, flat: torch.Tensor, name: str, op) -> torch.Tensor:
    """The reference: the transport's own all-reduce of a copy."""
    return link.wait(link.submit(flat.clone(), f"{name}.reference", op))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(
        a.double(), b.double(), rtol=1e-3 if a.dtype == torch.float16 else 1e-6)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter_then_all_gather_is_the_all_reduce(link, n: int, op: str) -> None:
    name = f"halves.one.{n}.{op}"
    flat = vector(n)
    start, stop = shard_bounds(n, N, hvd.rank())
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
    flat = torch.full((2 * N + 1,), float(hvd.rank() + 1))
    start, stop = shard_bounds(flat.numel(), N, hvd.rank())
    mean = sum(range(1, N + 1)) / N
    shard = link.wait(link.reduce_scatter(flat, "halves.mean", horovod_transport.AVERAGE))
    total = link.wait(link.reduce_scatter(flat, "halves.total", horovod_transport.SUM))
    assert_all_ranks(torch.equal(shard, torch.full((stop - start,), mean)), f"{shard} != {mean}")
    assert_all_ranks(torch.equal(total, torch.full((stop - start,), mean * N)), f"{total}")


def test_several_handles_in_flight_submitted_in_different_orders_on_each_rank(link) -> None:
    """Every size and op at once, rank 1 submitting in the reverse order, collected in yet
    another order; then every all-gather at once the same way."""
    cases = [(n, op) for n in SIZES for op in sorted(OPS)]
    mine = cases[::-1] if hvd.rank() % 2 else cases
    flats = {case: vector(case[0], salt=3) for case in cases}
    pending = {case: link.reduce_scatter(flats[case], f"halves.many.{case[0]}.{case[1]}",
                                         OPS[case[1]]) for case in mine}
    shards = {case: link.wait(pending[case]) for case in sorted(cases, key=lambda c: -c[0])}
    pending = {case: link.all_gather(shards[case], f"halves.many.{case[0]}.{case[1]}", case[0])
               for case in mine}
    wholes = {case: link.wait(pending[case]) for case in cases}
    for n, op in cases:
        reference = all_reduced(link, flats[n, op], f"halves.many.{n}.{op}", OPS[op])
        start, stop = shard_bounds(n, N, hvd.rank())
        assert_all_ranks(close(shards[n, op], reference[start:stop]), f"shard of {n} ({op})")
        assert_all_ranks(close(wholes[n, op], reference), f"all-gather of {n} ({op})")


def test_the_gathered_vector_is_alike_on_every_rank(link) -> None:
    n = 1001
    start, stop = shard_bounds(n, N, hvd.rank())
    shard = vector(n)[start:stop]
    whole = link.wait(link.all_gather(shard, "halves.alike", n))
    everyone = hvd.allgather_object(whole.tolist())
    assert_all_ranks(all(other == everyone[0] for other in everyone), "ranks gathered differently")
    pieces = hvd.allgather_object(shard.tolist())
    assert_all_ranks(everyone[0] == sum(pieces, []), "not the ranks' shards in rank order")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_horovod_reduces(link, dtype: torch.dtype) -> None:
    n = N + 1
    flat = vector(n, dtype)
    name = f"halves.dtype.{dtype}"
    shard = link.wait(link.reduce_scatter(flat, name, horovod_transport.AVERAGE))
    whole = link.wait(link.all_gather(shard, name, n))
    reference = all_reduced(link, flat, name, horovod_transport.AVERAGE)
    assert_all_ranks(shard.dtype == dtype and close(whole, reference), f"{dtype}: {whole}")


def test_bfloat16_is_refused_naming_horovod_and_what_to_do(link) -> None:
    try:
        link.reduce_scatter(vector(4, torch.bfloat16), "halves.bf16", horovod_transport.SUM)
        message = ""
    except TypeError as exc:
        message = str(exc)
    assert_all_ranks("Horovod 0.28.1" in message and "float32" in message
                     and "torch.distributed" in message, f"got {message!r}")


def test_an_op_horovod_does_not_reduce_scatter_with_is_refused(link) -> None:
    import torch.distributed as dist
    for op in (horovod_transport.ADASUM, dist.ReduceOp.SUM):
        with pytest.raises(ValueError, match="hvd.Average"):
            link.reduce_scatter(vector(4), "halves.badop", op)


def test_a_shard_of_the_wrong_length_is_refused_before_anything_is_sent(link) -> None:
    start, stop = shard_bounds(10, N, hvd.rank())
    with pytest.raises(ValueError, match=f"owns elements \\[{start}, {stop}\\) of 10"):
        link.all_gather(torch.zeros(stop - start + 1), "halves.wrong", 10)
    with pytest.raises(ValueError, match="1-D"):
        link.reduce_scatter(torch.zeros(2, 3), "halves.2d", horovod_transport.SUM)
