"""The sharded mode (``shard=True``) on torch.distributed: the weights after k steps match
DDP's (plus the same local optimizer) and the unsharded mode's, on the plain net and the tied
one (an embedding read twice, a bare root parameter), with accumulation and global-norm
clipping; the optimizer state per rank is about ``1/N``."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from small_models import POLICIES, PROFILE, batches, make_model, max_rel_diff, params_close
from state_view_checks import (
    OPTIMIZERS,
    check_live_and_read_only,
    check_one_block_concatenates,
    check_view,
    params_of,
)
from test_ddp_parity import NETS, ours, reference

import dcredit_hvd

from conftest import assert_all_ranks, gather, rank, same_on_every_rank, size

UNEVEN = dict(partition_bytes=500, credit_bytes=2048)   # 125 float32: odd, split unevenly
SHARDABLE = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _sharded(net: str, make_opt: Any, policy: str = "bytescheduler", **kwargs: Any):
    return ours(net, make_opt, with_model=False, shard=True, policy=policy, **UNEVEN,
                **(PROFILE if policy == "dcredit" else {}), **kwargs)


@pytest.mark.parametrize("opt_name", sorted(SHARDABLE))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("net", sorted(NETS))
def test_sharded_weights_match_ddp_and_the_unsharded_mode(net: str, policy: str, opt_name: str):
    make_opt = SHARDABLE[opt_name]
    expected = reference(net, make_opt)
    unsharded, plain = ours(net, make_opt, with_model=False, policy=policy, **UNEVEN,
                            **(PROFILE if policy == "dcredit" else {}))
    plain.close()
    got, opt = _sharded(net, make_opt, policy)
    assert_all_ranks(params_close(got, expected),
                     f"{net}/{policy}/{opt_name}: against DDP {max_rel_diff(got, expected)}")
    assert_all_ranks(params_close(got, unsharded),
                     f"{net}/{policy}/{opt_name}: against unsharded {max_rel_diff(got, unsharded)}")
    trained = [p for group in opt.param_groups for p in group["params"]]
    assert_all_ranks(same_on_every_rank(trained), "ranks ended with different parameters")
    opt.close()


@pytest.mark.parametrize("policy, opt_name", [("wfbp", "sgd_momentum"), ("bytescheduler", "adam"),
                                             ("dcredit", "adamw")])
def test_sharded_all_gathers_overlapping_the_next_forward_match_ddp(policy: str, opt_name: str):
    """``model=``: step() returns with the all-gathers in flight, issued in rank 0's order;
    each read of the tied net's parameters (an embedding read twice, a bare root parameter)
    waits for its own, with the race amplifier on."""
    make_opt = SHARDABLE[opt_name]
    expected = reference("tied", make_opt)
    got, opt = ours("tied", make_opt, with_model=True, shard=True, policy=policy,
                    race_amplifier=0.0005, **UNEVEN, **(PROFILE if policy == "dcredit" else {}))
    assert_all_ranks(params_close(got, expected),
                     f"{policy}/{opt_name}: against DDP {max_rel_diff(got, expected)}")
    opt.close()


def test_sharded_accumulation_matches_ddp():
    expected = reference("small", SHARDABLE["adam"], passes=2)
    got, opt = _sharded("small", SHARDABLE["adam"], passes=2)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    opt.close()


def test_sharded_clipping_matches_ddp_clipping_by_the_global_norm():
    def clip_ddp(opt):
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.05)
        opt.step()

    def clip_sharded(opt):
        opt.synchronize()
        norm = opt.clip_grad_norm_(0.05)
        assert float(norm) > 0.05                      # the clip binds
        with opt.skip_synchronize():
            opt.step()

    expected = reference("tied", SHARDABLE["sgd_momentum"], steps=4, before_step=clip_ddp)
    got, opt = _sharded("tied", SHARDABLE["sgd_momentum"], steps=4, before_step=clip_sharded)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    opt.close()


def test_sharded_adam_state_is_about_one_nth_of_the_unsharded_state_per_rank():
    _, plain = ours("tied", SHARDABLE["adam"], with_model=False, policy="bytescheduler", **UNEVEN)
    full = sum(v.numel() * v.element_size() for s in plain.state.values() for v in s.values()
               if torch.is_tensor(v))
    plain.close()
    _, opt = _sharded("tied", SHARDABLE["adam"])
    mine = opt._state.sharded.state_bytes()
    print(f"rank {rank()} of {size()}: Adam state {mine} B sharded, {full} B unsharded, "
          f"share {mine / full:.4f} (1/N = {1 / size():.4f})")
    assert_all_ranks(abs(mine / full * size() - 1) < 0.2, f"{mine} of {full} bytes")
    opt.close()


def _state_close(a: dict, b: dict) -> bool:
    """Two torch.optim state dicts hold the same state, tensor by tensor."""
    if sorted(a["state"]) != sorted(b["state"]):
        return False
    for index, entry in a["state"].items():
        other = b["state"][index]
        if sorted(entry) != sorted(other):
            return False
        for k, v in entry.items():
            w = other[k]
            if torch.is_tensor(v) and not torch.allclose(v.float(), w.float(), rtol=1e-5, atol=1e-7):
                return False
    return True


def test_the_full_form_equals_the_unsharded_state_and_loads_into_plain_torch():
    _, plain = ours("tied", SHARDABLE["adam"], steps=3, with_model=False, policy="wfbp", **UNEVEN)
    unsharded = plain.state_dict()
    plain.close()
    _, opt = _sharded("tied", SHARDABLE["adam"], steps=3, policy="wfbp")
    full = opt.full_state_dict()
    assert_all_ranks(_state_close(full, unsharded), "the gathered state differs from the "
                                                    "unsharded optimizer's")
    model = NETS["tied"][0]()
    local = torch.optim.Adam(model.parameters(), lr=0.01)     # no library, one process's view
    local.load_state_dict(full)
    assert_all_ranks(_state_close(local.state_dict(), unsharded), "plain Adam did not load it")
    opt.close()


@pytest.mark.parametrize("policy", ["wfbp", "bytescheduler"])
def test_a_full_form_resumes_a_sharded_run_like_one_that_never_stopped(policy):
    """``bytescheduler`` cuts a parameter into several 500-byte blocks, so a rank holds several
    pieces of it: each must get its own copy of Adam's ``step`` (shared, it counted k-fold)."""
    expected, whole = _sharded("small", SHARDABLE["adam"], steps=6, policy=policy)
    whole.close()
    data = batches(6, rank=rank())

    def run(model, opt, micro_batches):
        for micro in micro_batches:
            opt.zero_grad()
            for x, y in micro:
                F.cross_entropy(model(x), y).backward()
            opt.step()

    model = make_model(rank=rank())
    opt = dcredit_hvd.DistributedOptimizer(SHARDABLE["adam"](model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           shard=True, policy=policy, **UNEVEN)
    run(model, opt, data[:3])
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    full = opt.full_state_dict()
    opt.close()
    model = make_model(seed=99, rank=rank())
    model.load_state_dict(saved_model)
    opt = dcredit_hvd.DistributedOptimizer(SHARDABLE["adam"](model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           shard=True, policy=policy, **UNEVEN)
    opt.load_state_dict(full)
    run(model, opt, data[3:])
    got = [v.detach().clone() for v in model.state_dict().values()]
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    opt.close()


def _scaled_run(make_step, opt, model, inner, steps: int = 5) -> list[torch.Tensor]:
    """``steps`` iterations under a ``GradScaler``; at step 2 one element of rank 0's head
    gradient is infinite: after a reduce-scatter only the rank owning that element holds it,
    and every rank must still skip that step, as after DDP's all-reduce."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    step = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if step[0] == 2 and rank() == 0:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    handle = inner.head.weight.register_hook(poison)
    for i, micro in enumerate(batches(steps, rank=rank())):
        step[0] = i
        opt.zero_grad()
        for x, y in micro:
            scaler.scale(F.cross_entropy(model(x), y)).backward()
        make_step(opt, scaler)
        scaler.update()
    handle.remove()
    assert scaler.get_scale() == 512.0          # one skip halved it, on this rank
    return [v.detach().clone() for v in inner.state_dict().values()]


def test_sharded_amp_grad_scaler_skips_an_overflowing_step_on_every_rank_like_ddp():
    from conftest import ddp

    def ddp_step(opt, scaler):
        scaler.step(opt)

    def sharded_step(opt, scaler):
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)

    model = make_model(rank=rank())
    expected = _scaled_run(ddp_step, SHARDABLE["adam"](model.parameters()), ddp(model), model)
    model = make_model(rank=rank())
    opt = dcredit_hvd.DistributedOptimizer(SHARDABLE["adam"](model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           shard=True, policy="bytescheduler", **UNEVEN)
    got = _scaled_run(sharded_step, opt, model, model)
    assert_all_ranks(all(torch.isfinite(v).all() for v in got), "a NaN reached the weights")
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    opt.close()


def test_two_sharded_optimizers_over_parts_of_one_model_match_ddp():
    """Two optimizers (AdamW on the embedding and the norm, SGD on the rest), both sharded,
    stepped one after the other after each backward, on the tied net (every parameter used on
    every rank: see the note on per-rank unused parameters in docs/troubleshooting.md)."""
    from conftest import ddp

    def split(model):
        first = [p for n, p in model.named_parameters() if n.startswith(("embed", "norm"))]
        rest = [p for n, p in model.named_parameters() if not n.startswith(("embed", "norm"))]
        return (torch.optim.AdamW(first, lr=0.01, weight_decay=0.1),
                torch.optim.SGD(rest, lr=0.05, momentum=0.9))

    def run(model, forward, opts):
        for micro in NETS["tied"][1](5, 1):
            for opt in opts:
                opt.zero_grad()
            for x, y in micro:
                F.cross_entropy(forward(x).flatten(0, -2), y.flatten()).backward()
            for opt in opts:
                opt.step()
        return [v.detach().clone() for v in model.state_dict().values()]

    model = NETS["tied"][0]()
    expected = run(model, ddp(model), split(model))
    model = NETS["tied"][0]()
    names = {p: n for n, p in model.named_parameters()}
    opts = [dcredit_hvd.DistributedOptimizer(
        o, named_parameters=[(names[p], p) for g in o.param_groups for p in g["params"]],
        shard=True, policy="bytescheduler", **UNEVEN) for o in split(model)]
    got = run(model, model, opts)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    for opt in opts:
        opt.close()


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("net", sorted(NETS))
def test_optimizer_state_shows_each_parameters_slice_with_torchs_keys(net: str, opt_name: str):
    """``opt.state[p]`` under shard=True on torch.distributed: torch's keys, this rank's
    elements of ``p`` (the unsharded run's there), every rank's slices together the whole."""
    _, plain = ours(net, OPTIMIZERS[opt_name], steps=3, with_model=False, policy="wfbp",
                    **UNEVEN)
    plain_state = [dict(plain.state[p]) for p in params_of(plain)]
    plain.close()
    _, opt = _sharded(net, OPTIMIZERS[opt_name], steps=3, policy="wfbp")
    problems = check_view(opt, plain_state, rank(), size(), gather)
    problems += check_one_block_concatenates(opt, plain_state, size(), gather)
    problems += check_live_and_read_only(opt)
    assert_all_ranks(not problems, "; ".join(problems))
    opt.close()
