"""``hvd.DistributedOptimizer = dcredit_hvd.DistributedOptimizer``: code that builds Horovod's
optimizer itself gets ours, and Horovod's own resume pattern still works.

The pattern (Horovod's examples): rank 0 loads a checkpoint into the model and the optimizer,
then every rank calls ``hvd.broadcast_parameters`` and ``hvd.broadcast_optimizer_state``.  The
ranks without state initialise it with a *local* ``step()``, chosen by comparing the optimizer's
``__module__`` with Horovod's; a collective ``step()`` on those ranks only would deadlock.
"""
from __future__ import annotations

import copy

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F

import dcredit_hvd

from conftest import assert_all_ranks
from models import batches, make_model, max_rel_diff, params_close

BEFORE, AFTER = 3, 3


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _steps(model, opt, micro_batches):
    for (x, y), in micro_batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _resume(checkpoint, data, with_model=False, **kwargs):
    """A fresh model and optimizer built through ``hvd.DistributedOptimizer``; rank 0 loads the
    checkpoint, every rank broadcasts, then training goes on."""
    model = make_model(seed=99)                         # other weights than the checkpoint's
    if with_model:
        kwargs["model"] = model
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                   **kwargs)
    if hvd.rank() == 0:
        # A copy, as from disk: load_state_dict keeps the loaded tensors as the state.
        checkpoint = copy.deepcopy(checkpoint)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    _steps(model, opt, data)
    return [v.detach().clone() for v in model.state_dict().values()], opt


@pytest.mark.parametrize("with_model", [False, True], ids=["no-model", "model"])
def test_swapped_optimizer_resumes_from_a_checkpoint_like_horovod(with_model, monkeypatch):
    data = batches(BEFORE + AFTER)
    model = make_model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
    _steps(model, opt, data[:BEFORE])
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    expected, _ = _resume(checkpoint, data[BEFORE:])   # plain Horovod, same pattern

    monkeypatch.setattr(hvd, "DistributedOptimizer", dcredit_hvd.DistributedOptimizer)
    # A deadlock in broadcast_optimizer_state becomes a StallError on the ranks that stepped.
    got, ours = _resume(checkpoint, data[BEFORE:], with_model, stall_abort_seconds=30)
    assert_all_ranks(type(ours).__module__ == "horovod.torch.optimizer",
                     f"the swapped optimizer's class declares {type(ours).__module__}")
    assert_all_ranks(params_close(got, expected),
                     f"after resume: max rel diff {max_rel_diff(got, expected)}")
