"""The live race on Horovod (``runtime/race.py``): parameters after every switch, mid-race
checkpoints and the sharded mode included, match plain ``hvd.DistributedOptimizer`` on every
rank, and every rank switches to the same winner (``race_cases.py`` has the cases)."""
from __future__ import annotations

import dataclasses

import horovod.torch as hvd
import pytest
import torch
from race_cases import CASES, RACE, Case, dcredit_clip, dcredit_wrap, identical, mismatch, switched, train

import dcredit_hvd
from dcredit_hvd.errors import SchedulerError

from conftest import assert_all_ranks


def _reference(case: Case) -> list[torch.Tensor]:
    """Plain Horovod, uninterrupted (no checkpoint)."""
    case = dataclasses.replace(case, checkpoint_at=None)

    def wrap(opt, model):
        return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        backward_passes_per_step=case.passes)

    def clip(model, opt):
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        with opt.skip_synchronize():
            opt.step()
    return train(case, wrap, hvd.rank(), clip=clip)[0]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parameters_match_plain_horovod_through_every_switch_of_the_race(case):
    expected = _reference(case)
    got, used = train(case, dcredit_wrap(case), hvd.rank(), clip=dcredit_clip(case))
    assert_all_ranks(not switched(case, used), switched(case, used))
    winners = hvd.allgather_object([opt.races[0]["winner"] for opt in used if opt.races])
    assert_all_ranks(all(w == winners[0] for w in winners), f"ranks chose differently: {winners}")
    bad = mismatch(got, expected)
    assert_all_ranks(not bad, f"{case.name}: {bad} after the race's switches")
    unraced, _ = train(case, dcredit_wrap(case, tune=False), hvd.rank(), clip=dcredit_clip(case))
    bad = identical(got, unraced)
    assert_all_ranks(not bad, f"{case.name}: the race changed the values: {bad}")


def test_ranks_that_disagree_on_the_candidates_get_an_error_naming_it(monkeypatch):
    from dcredit_hvd.planning import candidates

    if hvd.rank() == 1:                          # rank 1 runs "another version"
        original = candidates.Schedule.key
        monkeypatch.setattr(candidates.Schedule, "key", lambda self: (*original(self), "v2"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **RACE)
    error = ""
    try:
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    except SchedulerError as exc:
        error = str(exc)
    finally:
        opt.close()
    assert_all_ranks("disagree on the race's candidates" in error and "rank 1" in error,
                     f"no clear error: {error!r}")
