"""The two halves of an all-reduce on the Horovod transport, on real collectives (every rank,
under ``mpirun -np 2`` and ``horovodrun --gloo -np 2``): ``reduce_scatter`` leaves each rank
exactly its ``shard_bounds`` slice of the reduced vector, ``all_gather`` of those slices is the
all-reduce, for lengths around the world size, both ops, several handles in flight and ranks that
submit in different orders (Horovod's coordinator matches by name)."""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch
from halves_checks import HalvesChecks, sizes_around

from dcredit_hvd.transports import horovod as horovod_transport
from dcredit_hvd.transports.shards import shard_bounds

from conftest import assert_all_ranks

N = hvd.size()
OPS = {"average": horovod_transport.AVERAGE, "sum": horovod_transport.SUM}
#: What Horovod 0.28.1's torch binding reduce-scatters and all-gathers (no bfloat16).
DTYPES = [torch.float32, torch.float64, torch.float16]


@pytest.fixture(scope="module")
def halves() -> HalvesChecks:
    return HalvesChecks(horovod_transport.transport(hvd.global_process_set), hvd.rank(), N, OPS,
                        assert_all_ranks, hvd.allgather_object, low_rtol=1e-3)


@pytest.fixture(scope="module")
def link(halves: HalvesChecks) -> horovod_transport.HorovodTransport:
    return halves.link


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("n", sizes_around(N))
def test_reduce_scatter_then_all_gather_is_the_all_reduce(halves, n: int, op: str) -> None:
    halves.round_trip(n, op)


def test_average_is_the_mean_over_ranks(halves) -> None:
    halves.average_is_the_mean()


def test_several_handles_in_flight_submitted_in_different_orders_on_each_rank(halves) -> None:
    """Every size and op at once, rank 1 submitting in the reverse order, collected in yet
    another order; then every all-gather at once the same way."""
    link = halves.link
    cases = [(n, op) for n in halves.sizes for op in sorted(OPS)]
    mine = cases[::-1] if hvd.rank() % 2 else cases
    flats = {case: halves.vector(case[0], salt=3) for case in cases}
    pending = {case: link.reduce_scatter(flats[case], f"halves.many.{case[0]}.{case[1]}",
                                         OPS[case[1]]) for case in mine}
    shards = {case: link.wait(pending[case]) for case in sorted(cases, key=lambda c: -c[0])}
    pending = {case: link.all_gather(shards[case], f"halves.many.{case[0]}.{case[1]}", case[0])
               for case in mine}
    wholes = {case: link.wait(pending[case]) for case in cases}
    halves.against_all_reduces(flats, shards, wholes)


def test_the_gathered_vector_is_alike_on_every_rank(halves) -> None:
    halves.gathered_alike()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_horovod_reduces(halves, dtype: torch.dtype) -> None:
    halves.each_dtype(dtype)


def test_bfloat16_is_refused_naming_horovod_and_what_to_do(link, halves) -> None:
    try:
        link.reduce_scatter(halves.vector(4, torch.bfloat16), "halves.bf16", horovod_transport.SUM)
        message = ""
    except TypeError as exc:
        message = str(exc)
    assert_all_ranks("Horovod 0.28.1" in message and "float32" in message
                     and "torch.distributed" in message, f"got {message!r}")


def test_an_op_horovod_does_not_reduce_scatter_with_is_refused(link, halves) -> None:
    import torch.distributed as dist
    for op in (horovod_transport.ADASUM, dist.ReduceOp.SUM):
        with pytest.raises(ValueError, match="hvd.Average"):
            link.reduce_scatter(halves.vector(4), "halves.badop", op)


def test_a_shard_of_the_wrong_length_is_refused_before_anything_is_sent(link) -> None:
    start, stop = shard_bounds(10, N, hvd.rank())
    with pytest.raises(ValueError, match=f"owns elements \\[{start}, {stop}\\) of 10"):
        link.all_gather(torch.zeros(stop - start + 1), "halves.wrong", 10)
    with pytest.raises(ValueError, match="1-D"):
        link.reduce_scatter(torch.zeros(2, 3), "halves.2d", horovod_transport.SUM)
