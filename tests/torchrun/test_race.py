"""The live race on torch.distributed (``runtime/race.py``, Gloo under ``torchrun``): parameters
after every switch, mid-race checkpoints and the sharded mode included, match DDP's on every
rank and equal the same run without the race (``race_cases.py`` has the cases)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from race_cases import CASES, Case, dcredit_clip, dcredit_wrap, identical, mismatch, switched, train

from conftest import assert_all_ranks, ddp, gather, rank


def _reference(case: Case) -> list[torch.Tensor]:
    """DDP and the local optimizer, uninterrupted; accumulation under ``no_sync``."""
    case = dataclasses.replace(case, checkpoint_at=None)
    wrapped: dict[int, torch.nn.Module] = {}

    def forward(model):
        if id(model) not in wrapped:
            wrapped[id(model)] = ddp(model)
        return wrapped[id(model)]

    def clip(model, opt):
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
    return train(case, lambda opt, model: opt, rank(), forward=forward, clip=clip,
                 no_sync=lambda model: forward(model).no_sync())[0]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parameters_match_ddp_through_every_switch_of_the_race(case):
    expected = _reference(case)
    got, used = train(case, dcredit_wrap(case), rank(), clip=dcredit_clip(case))
    assert_all_ranks(not switched(case, used), switched(case, used))
    winners = gather([opt.races[0]["winner"] for opt in used if opt.races])
    assert_all_ranks(all(w == winners[0] for w in winners), f"ranks chose differently: {winners}")
    bad = mismatch(got, expected)
    assert_all_ranks(not bad, f"{case.name}: {bad} after the race's switches")
    unraced, _ = train(case, dcredit_wrap(case, tune=False), rank(), clip=dcredit_clip(case))
    bad = identical(got, unraced)
    assert_all_ranks(not bad, f"{case.name}: the race changed the values: {bad}")
