"""The liveness channel lives while an optimizer on this rank leases it
(``dcredit_hvd/liveness/channels.py``): it ends with the last one (closed or collected), the
ranks agree whether to reuse it when the next one is built, and ranks that close at different
moments open a new one together instead of hanging.  Each test builds its optimizers over a
group of its own (``new_group``), so no other test's optimizer holds its channel."""
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


def _build(group: Any) -> Any:
    model = make_model(rank=rank())
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           process_group=group)
    assert_all_ranks(opt._state.peers is not None, "no liveness channel (DCREDIT_LIVENESS=0?)")
    train(model, opt, steps=2, rank=rank())
    return opt


def _channel(opt: Any) -> Any:
    return opt._state.peers.channel


def _others() -> list[int]:
    return [r for r in range(size()) if r != rank()]


def _assert_one_new_channel(new: Any, old: Any) -> None:
    """``new`` is not ``old``, and every rank holds the same one (the same token)."""
    tokens = gather(new.token)
    assert_all_ranks(new is not old and len(set(tokens)) == 1,
                     f"not one new channel on every rank: tokens {tokens}")


def _ended_soon(channel: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (channel.ended and not channel._thread.is_alive()):
        time.sleep(0.02)
    return channel.ended and not channel._thread.is_alive()


def test_the_channel_ends_with_the_last_optimizer_over_its_group_and_no_peer_mourns() -> None:
    group = _group()
    first, second = _build(group), _build(group)
    channel = _channel(first)
    assert_all_ranks(_channel(second) is channel, "the second optimizer opened a second channel")
    first.close()
    assert_all_ranks(not channel.ended and channel.connected() == _others(),
                     f"ended with a lease still held: connected {channel.connected()}")
    second.close()
    assert_all_ranks(channel.ended and not channel._thread.is_alive(),
                     "the channel outlived its last optimizer")
    third = _build(group)
    _assert_one_new_channel(_channel(third), channel)
    time.sleep(2.5 * _channel(third).config.interval)
    assert_all_ranks(channel.lost == [] and _channel(third).lost == [],
                     f"a goodbye was taken for a loss: {channel.lost + _channel(third).lost}")
    third.close()


def test_ranks_that_close_at_different_moments_open_a_new_channel_together() -> None:
    group = _group()
    first = _build(group)
    old = _channel(first)
    if rank() == 0:
        first.close()          # rank 0 leaves the channel; rank 1 still holds it
    second = _build(group)     # would hang if rank 1 reused what rank 0 no longer has
    new = _channel(second)
    _assert_one_new_channel(new, old)
    kept = rank() == 0 or not old.ended
    if rank() != 0:
        first.close()
    assert_all_ranks(kept, "a channel still leased here ended")
    assert_all_ranks(_ended_soon(old), "the old channel outlived its optimizers")
    assert_all_ranks(new.connected() == _others() and new.lost == [],
                     f"the new channel lost its peers: {new.connected()}, {new.lost}")
    second.close()


def test_an_optimizer_dropped_without_close_gives_its_lease_back_from_the_finalizer() -> None:
    group = _group()
    opt = _build(group)
    channel = _channel(opt)
    del opt
    gc.collect()
    assert_all_ranks(_ended_soon(channel), "a collected optimizer's channel lives on")
