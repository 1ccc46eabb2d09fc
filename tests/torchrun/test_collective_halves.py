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
from halves_checks import HalvesChecks, sizes_around

from dcredit_hvd.transports import torch_distributed
from dcredit_hvd.transports.shards import shard_bounds

from conftest import assert_all_ranks, gather, rank, size

N = size()
OPS = {"average": torch_distributed.AVERAGE, "sum": torch_distributed.SUM}
#: What the Gloo back-end of torch 2.13 reduce-scatters and all-gathers (measured).
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def halves() -> HalvesChecks:
    """The transport over the default group (its channel: a collective, every rank here);
    outside torchrun, a skip like every test of this folder (conftest's ``_two_ranks`` runs
    after module fixtures)."""
    if not dist.is_initialized():
        pytest.skip("multi-rank test: run under torchrun --nproc-per-node 2")
    return HalvesChecks(torch_distributed.transport(dist.group.WORLD), rank(), N, OPS,
                        assert_all_ranks, gather, low_rtol=1e-2)


@pytest.fixture(scope="module")
def link(halves: HalvesChecks) -> torch_distributed.TorchTransport:
    return halves.link


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("n", sizes_around(N))
def test_reduce_scatter_then_all_gather_is_the_all_reduce(halves, n: int, op: str) -> None:
    halves.round_trip(n, op)


def test_average_is_the_mean_over_ranks(halves) -> None:
    halves.average_is_the_mean()


def test_several_handles_in_flight_submitted_in_different_orders_on_each_rank(halves) -> None:
    """Every size and op at once, with an all-reduce among them, rank 1 submitting in the
    reverse order (a rank issuing in its own order would pair different collectives: wrong sums,
    or a hang), collected in yet another order; then every all-gather at once the same way.
    The issue logs are rank 0's on every rank."""
    link = halves.link
    before = len(link.issue_log())
    cases = [(n, op) for n in halves.sizes for op in sorted(OPS)]
    flats = {case: halves.vector(case[0], salt=3) for case in cases}
    extra = halves.vector(33, salt=5)
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
    reference = halves.all_reduced(extra, "halves.many.extra", OPS["sum"])
    assert_all_ranks(torch.equal(done["reduce", None], reference), "the all-reduce among them")
    halves.against_all_reduces(flats, shards, wholes)


def test_one_name_for_both_halves_is_matched_by_kind(halves) -> None:
    """A bucket's reduce-scatter and all-gather may share its name; the order tells them apart
    (``Entry.kind``), as do the issue logs' positions."""
    link, flat = halves.link, halves.vector(1001, salt=9)
    shard = link.wait(link.reduce_scatter(flat, "halves.bucket", OPS["sum"]))
    whole = link.wait(link.all_gather(shard, "halves.bucket", 1001))
    reference = halves.all_reduced(flat, "halves.bucket", OPS["sum"])
    assert_all_ranks(halves.close(whole, reference), "bucket")


def test_the_gathered_vector_is_alike_on_every_rank(halves) -> None:
    halves.gathered_alike()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_gloo_reduces(halves, dtype: torch.dtype) -> None:
    halves.each_dtype(dtype)


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
