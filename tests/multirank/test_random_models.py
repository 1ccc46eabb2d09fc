"""Randomised equivalence with plain Horovod: hypothesis draws small models (layer widths, frozen
and unused parameters, a parameter used on rank 0 only), a partition size, a policy and an
optimizer; after a few steps dcredit_hvd's parameters must equal ``hvd.DistributedOptimizer``'s.

Runs on every rank under ``mpirun -np 2`` / ``horovodrun --gloo``.  Every rank must draw the same
examples in the same order (each one runs collectives), hence ``derandomize=True`` and no example
database; verdicts go through ``assert_all_ranks`` so shrinking also proceeds identically.
"""
from __future__ import annotations

import itertools

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcredit_hvd

from conftest import assert_all_ranks
from models import max_rel_diff, params_close

STEPS = 3
_example = itertools.count()


class RandomNet(nn.Module):
    """A chain of linear layers of the drawn widths; some frozen, some never used, and at most one
    used on rank 0 only (rank 1 never computes its gradient)."""

    def __init__(self, widths, frozen, unused, rank0_only):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        for layer, (freeze_weight, freeze_bias) in zip(self.layers, frozen):
            layer.weight.requires_grad_(not freeze_weight)
            layer.bias.requires_grad_(not freeze_bias)
        self.unused = nn.ModuleList(nn.Linear(widths[-1], w) for w in unused)
        self.side = nn.Linear(widths[-1], widths[-1]) if rank0_only else None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        if self.side is not None and hvd.rank() == 0:
            x = x + self.side(x)
        return x


@st.composite
def cases(draw):
    depth = draw(st.integers(1, 4))
    widths = draw(st.lists(st.integers(1, 40), min_size=depth + 1, max_size=depth + 1))
    frozen = draw(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=depth, max_size=depth))
    frozen[0] = (False, frozen[0][1])          # something always trains
    return dict(
        widths=widths, frozen=frozen,
        unused=draw(st.lists(st.integers(1, 8), max_size=2)),
        rank0_only=draw(st.booleans()),
        partition=draw(st.sampled_from([16, 60, 256, 1000, 4096, 1 << 20])),
        policy=draw(st.sampled_from(["wfbp", "bytescheduler", "dcredit"])),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        with_model=draw(st.booleans()),
    )


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def train(case, wrap):
    torch.manual_seed(5)
    model = RandomNet(case["widths"], case["frozen"], case["unused"], case["rank0_only"])
    opt = wrap(make_optimizer(case["optimizer"], model.parameters()), model)
    gen = torch.Generator().manual_seed(77 + hvd.rank())
    for _ in range(STEPS):
        x = torch.randn(4, case["widths"][0], generator=gen)
        opt.zero_grad()
        F.mse_loss(model(x), torch.zeros(4, case["widths"][-1])).backward()
        opt.step()
    return [v.detach().clone() for v in model.state_dict().values()]


@settings(derandomize=True, database=None, max_examples=8, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(cases())
def test_random_models_match_plain_horovod(case):
    tag = next(_example)        # fresh names per example: nothing can clash with an earlier one

    def reference(opt, model):
        named = [(f"rnd{tag}.ref.{n}", p) for n, p in model.named_parameters()]
        return hvd.DistributedOptimizer(opt, named_parameters=named)

    def ours(opt, model):
        named = [(f"rnd{tag}.{n}", p) for n, p in model.named_parameters()]
        return dcredit_hvd.DistributedOptimizer(
            opt, named_parameters=named, model=model if case["with_model"] else None,
            policy=case["policy"], partition_bytes=case["partition"], credit_bytes=case["partition"] * 3,
            profile_warmup=0, profile_steps=1)

    expected = train(case, reference)
    got = train(case, ours)
    assert_all_ranks(params_close(got, expected),
                     f"{case}: max relative difference {max_rel_diff(got, expected)}")
