"""The ``dear`` policy on torch.distributed: fused buffers reduce-scattered in backward, their
reduced gradients all-gathered in forward order (in ``step()``, or with ``model=`` during the
next forward), issued in rank 0's order; the weights match DDP's (plus the same local
optimizer) on the tied net (an embedding read twice, a bare root parameter)."""
from __future__ import annotations

import pytest
import torch
from small_models import max_rel_diff, params_close
from test_ddp_parity import ours, reference

from conftest import assert_all_ranks, same_on_every_rank

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("opt_name, with_model", [("sgd_momentum", True), ("adamw", False)])
def test_dear_weights_match_ddp(opt_name: str, with_model: bool):
    expected = reference("tied", OPTIMIZERS[opt_name])
    got, opt = ours("tied", OPTIMIZERS[opt_name], with_model=with_model, policy="dear",
                    race_amplifier=0.0005)
    assert_all_ranks(params_close(got, expected),
                     f"dear/{opt_name}: against DDP {max_rel_diff(got, expected)}")
    trained = [p for group in opt.param_groups for p in group["params"]]
    assert_all_ranks(same_on_every_rank(trained), "ranks ended with different parameters")
    opt.close()
