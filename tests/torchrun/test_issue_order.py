"""The ordering proof on real Gloo: with random per-rank delays (the race amplifier in the
background threads, and sleeps of the training loop itself) and ranks that submit in different
orders (SmallNet's ``extra`` has a gradient on rank 0 only, so rank 1 submits it last, as
zeros), every policy, with and without ``model=``, the ranks' issue logs are identical, entry
for entry, over several iterations.

torch.distributed pairs collectives by the order they are issued in: a rank that issued in its
own submission order would sum other tensors under one collective, or hang.  The diverging
ranks (``OrderMismatchError``) run in jobs of their own: ``tests/jobs/test_torchrun_jobs.py``.
"""
from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from small_models import batches, make_model

import dcredit_hvd

from conftest import assert_all_ranks, gather, rank, same_on_every_rank

POLICIES = ["wfbp", "bytescheduler", "dcredit"]
STEPS = 8
#: Blocks of at most 512 bytes, at most 2 KiB in flight: the gate rank reorders (its policy),
#: a follower submits as its backward produces gradients.
SCHEDULE = dict(partition_bytes=512, credit_bytes=2048)
PROFILE = dict(profile_warmup=1, profile_steps=2)
#: The brief's amplifier: random sleeps of up to 2 ms at each submission, poll and update.
AMPLIFIER = 0.002


def _jitter(rng: random.Random) -> None:
    """A random per-rank delay of the training thread (up to 3 ms)."""
    time.sleep(rng.uniform(0.0, 0.003))


def _first_difference(a: list[str], b: list[str]) -> str:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"issue logs differ ({len(a)} and {len(b)} entries), first at #{first}: "
            f"{a[first:first + 1]} on rank 0, {b[first:first + 1]} on rank 1")


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
@pytest.mark.parametrize("policy", POLICIES)
def test_issue_logs_are_identical_on_every_rank_under_random_per_rank_delays(
        policy: str, with_model: bool) -> None:
    model = make_model(rank=rank())
    opt: Any = dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), model=model if with_model else None,
        transport="torch.distributed", policy=policy, race_amplifier=AMPLIFIER, **SCHEDULE,
        **(PROFILE if policy == "dcredit" else {}))
    transport = opt._state.transport
    start = len(transport.issue_log())
    rng = random.Random(rank() * 7919 + time.monotonic_ns())
    submitted = []
    for micro in batches(STEPS, rank=rank()):
        x, y = micro[0]
        _jitter(rng)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        _jitter(rng)
        opt.step()
        submitted.append(opt.last_submission_order)
    opt.apply_pending_updates()
    log = transport.issue_log()[start:]
    logs, orders = gather(log), gather(submitted)
    blocks = sum(len(t.blocks) for t in opt.layouts)
    assert_all_ranks(len(log) >= blocks * STEPS,
                     f"{len(log)} collectives issued for {blocks} blocks x {STEPS} steps")
    assert_all_ranks(any(a != b for a, b in zip(orders[0], orders[1])),
                     "the ranks submitted in the same order every iteration: nothing was proved")
    assert_all_ranks(logs[0] == logs[1], _first_difference(logs[0], logs[1]))
    trained = [p for group in opt.param_groups for p in group["params"]]
    assert_all_ranks(same_on_every_rank(trained), "ranks ended with different parameters")
    opt.close()


def test_every_optimizer_over_a_group_shares_its_issue_order() -> None:
    """Two optimizers stepped alternately: one channel per group, so one log holds both, in
    one order on every rank."""
    models = [make_model(seed, rank=rank()) for seed in (1, 2)]
    opts: list[Any] = [dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.05), named_parameters=m.named_parameters(),
        transport="torch.distributed", policy="bytescheduler", race_amplifier=AMPLIFIER,
        **SCHEDULE) for m in models]
    transport = opts[0]._state.transport
    assert_all_ranks(transport.channel is opts[1]._state.transport.channel,
                     "two channels over one group")
    start = len(transport.issue_log())
    for micro in batches(3, rank=rank()):
        for model, opt in zip(models, opts):
            x, y = micro[0]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    log = transport.issue_log()[start:]
    logs = gather(log)
    assert_all_ranks(logs[0] == logs[1], _first_difference(logs[0], logs[1]))
    names = [{b.name for t in opt.layouts for b in t.blocks} for opt in opts]
    assert_all_ranks(all(own <= set(log) for own in names),
                     f"not every block of both optimizers was issued: {log[:4]}...")
    for opt in opts:
        opt.close()
