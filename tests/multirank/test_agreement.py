"""Ranks that disagree on what to all-reduce get an error naming the difference, not a hang."""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch

import dcredit_hvd

from conftest import assert_all_ranks


def build(out_features: int, **kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, out_features))
    return dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), **kwargs)


def raised(**kwargs) -> str:
    try:
        build(**kwargs)
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_parameter_shape_that_differs_between_ranks_is_named_on_every_rank():
    message = raised(out_features=4 if hvd.rank() == 0 else 5)
    assert_all_ranks("trainable parameter #2 is ('1.weight', (4, 8), 'torch.float32') (name, "
                     "shape, dtype) on rank 0 but ('1.weight', (5, 8), 'torch.float32') on rank 1"
                     in message,
                     f"got {message!r}")


@pytest.mark.parametrize("option", ["policy", "partition_bytes"])
def test_scheduler_options_that_differ_between_ranks_are_named(option):
    values = {"policy": ("wfbp", "bytescheduler"), "partition_bytes": (1024, 2048)}[option]
    message = raised(out_features=4, **{option: values[hvd.rank() % 2]})
    assert_all_ranks(f"{option} is" in message and "on rank 1" in message, f"got {message!r}")


def test_identical_ranks_construct_without_error():
    assert_all_ranks(raised(out_features=4) == "")
