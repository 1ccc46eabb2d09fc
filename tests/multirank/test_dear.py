"""The ``dear`` policy under Horovod (DeAR, ICDCS 2023, as its authors ran it): fused buffers
reduce-scattered during backward, their reduced gradients all-gathered one buffer at a time in
forward order (in ``step()``, or with ``model=`` during the next forward, each parameter
updated as soon as its own buffer lands).  The weights after k steps match plain
``hvd.DistributedOptimizer``'s on every rank.

Run on every rank under ``mpirun -np 2`` and ``horovodrun -np 2 --gloo`` (``make test``).
"""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch

import dcredit_hvd

from conftest import assert_all_ranks
from models import make_model, max_rel_diff, params_close, train

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def reference(make_opt, steps=5, **kwargs):
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), **kwargs)
    return train(model, opt, steps)


@pytest.mark.parametrize("opt_name, with_model", [("sgd_momentum", True), ("adam", False)])
def test_dear_weights_match_plain_horovod(opt_name, with_model):
    expected = reference(OPTIMIZERS[opt_name])
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(
        OPTIMIZERS[opt_name](model.parameters()), named_parameters=model.named_parameters(),
        policy="dear", model=model if with_model else None, race_amplifier=0.0005)
    got = train(model, opt, 5)
    assert_all_ranks(params_close(got, expected),
                     f"dear/{opt_name}: max relative difference {max_rel_diff(got, expected)}")


def test_dear_fuses_tensors_into_buffers_and_sends_each_as_one_reduce_scatter():
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           policy="dear")
    train(model, opt, 2)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    # SmallNet is far below DeAR's 25 MiB: one buffer, one block, one reduce-scatter.
    assert_all_ranks(len(opt.layouts) == 1 and len(opt.layouts[0].members) == tensors,
                     f"{[len(t.members) for t in opt.layouts]} buffers for {tensors} tensors")
    assert_all_ranks(len(opt.last_submission_order) == 1, f"{opt.last_submission_order}")


def test_dear_refuses_compression_and_shards():
    model = make_model()
    with pytest.raises(ValueError, match="compression"):
        dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         policy="dear", compression=hvd.Compression.fp16)
    with pytest.raises(ValueError, match="dear"):
        dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         policy="dear", shard=True)
