"""A group's issue order (rank 0's side channel and each follower's ``dcredit-order`` thread)
lives while a transport on this rank leases it (``dcredit_hvd/transports/order_stream.py``): it
ends with the last optimizer over the group (closed or collected), the ranks agree whether to
reuse it when the next one is built, and the next optimizer's collectives go through a new one
in rank 0's order.  Each test builds its optimizers over a group of its own (``new_group``), so
no other test's optimizer holds its stream."""
from __future__ import annotations

import gc
import time
from typing import Any

import torch
import torch.distributed as dist
from small_models import make_model, train

import dcredit_hvd

from conftest import assert_all_ranks, gather, rank, size


def _group() -> Any:
    return dist.new_group(list(range(size())), backend="gloo")


def _build(group: Any) -> tuple[Any, Any]:
    model = make_model(rank=rank())
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           process_group=group)
    train(model, opt, steps=2, rank=rank())
    return model, opt


def _stream(opt: Any) -> Any:
    return opt._state.transport._stream.channel


def _gone(stream: Any, seconds: float = 5.0) -> bool:
    """Ended here, and no thread of it left (rank 0 has none)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not _over(stream):
        time.sleep(0.02)
    return _over(stream)


def _over(stream: Any) -> bool:
    return stream.ended and (stream._thread is None or not stream._thread.is_alive())


def _same_parameters(model: Any) -> bool:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return all(torch.equal(flat, other) for other in gather(flat))


def _assert_one_new_stream(new: Any, old: Any) -> None:
    tokens = gather(new.token)
    assert_all_ranks(new is not old and len(set(tokens)) == 1,
                     f"not one new issue order on every rank: tokens {tokens}")


def test_the_issue_order_ends_with_the_last_optimizer_over_its_group_and_a_new_one_follows():
    group = _group()
    (_, first), (_, second) = _build(group), _build(group)
    stream = _stream(first)
    assert_all_ranks(_stream(second) is stream, "the second optimizer opened a second order")
    follower = rank() != 0
    assert_all_ranks(not follower or stream._thread.is_alive(), "a follower has no thread")
    first.close()
    assert_all_ranks(not stream.ended, "the order ended with a lease still held")
    second.close()
    assert_all_ranks(_over(stream), "the order (or a follower's thread) outlived its optimizers")
    model, third = _build(group)
    _assert_one_new_stream(_stream(third), stream)
    assert_all_ranks(_same_parameters(model), "the new order's all-reduces differ across ranks")
    third.close()


def test_ranks_that_close_at_different_moments_follow_a_new_order_together():
    group = _group()
    _, first = _build(group)
    old = _stream(first)
    if rank() == 0:
        first.close()          # rank 0 leaves the order; the followers still hold it
    model, second = _build(group)   # would hang if a follower kept waiting on the old one
    _assert_one_new_stream(_stream(second), old)
    if rank() != 0:
        first.close()
    assert_all_ranks(_gone(old), "the old order outlived its optimizers")
    assert_all_ranks(_same_parameters(model), "the new order's all-reduces differ across ranks")
    second.close()


def test_an_optimizer_dropped_without_close_gives_its_hold_back_from_the_finalizer():
    group = _group()
    _, opt = _build(group)
    stream = _stream(opt)
    del opt
    gc.collect()
    # A follower's thread takes the finalizer's lease and ends; rank 0 has no thread, and
    # takes it at the next construction, which every rank then agrees makes a new order.
    assert_all_ranks(rank() == 0 or _gone(stream), "a collected optimizer's follower lives on")
    model, again = _build(group)
    _assert_one_new_stream(_stream(again), stream)
    assert_all_ranks(_over(stream), "rank 0 kept the collected optimizer's order")
    assert_all_ranks(_same_parameters(model), "the new order's all-reduces differ across ranks")
    again.close()


def test_a_harness_that_stops_our_daemon_threads_ends_them_and_the_next_optimizer_starts_anew():
    """Lightning's test harness stops every daemon thread a test left that has a ``stop()``, then
    fails the test if it is still alive (``liveness/threads.py``): both of ours end there, the
    optimizer still closes, and the next one opens a new channel and a new order."""
    group = _group()
    _, opt = _build(group)
    stream, peers = _stream(opt), opt._state.peers.channel
    threads = [t for t in (peers._thread, stream._thread) if t is not None]
    assert_all_ranks(all(t.daemon and callable(getattr(t, "stop", None)) for t in threads),
                     f"a thread without stop(): {threads}")
    for thread in threads:
        thread.stop()
    served = peers.ended and (stream.ended or stream._thread is None)   # rank 0: no thread
    assert_all_ranks(not any(t.is_alive() for t in threads) and served,
                     "a stopped thread (or what it served) lives on")
    opt.close()
    model, again = _build(group)
    _assert_one_new_stream(_stream(again), stream)
    assert_all_ranks(again._state.peers.channel is not peers, "the stopped channel was reused")
    assert_all_ranks(_same_parameters(model), "the new order's all-reduces differ across ranks")
    again.close()
