"""The sharded mode (``shard=True``) under Horovod: the weights after k steps match plain
``hvd.DistributedOptimizer``'s, the optimizer state per rank is about ``1/N`` of it, clipping
uses the global norm, and a sharded checkpoint resumes as if the run never stopped.

Run on every rank under ``mpirun -np 2`` and ``horovodrun -np 2 --gloo`` (``make test``).
"""
from __future__ import annotations

import copy

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from small_models import POLICIES, PROFILE
from state_view_checks import (
    OPTIMIZERS,
    check_live_and_read_only,
    check_one_block_concatenates,
    check_view,
    params_of,
    zero_moments,
)

import dcredit_hvd

from conftest import assert_all_ranks
from models import batches, make_model, max_rel_diff, params_close, train

#: Blocks of 500 bytes (125 float32): 125 is odd, so every block of a tensor is split unevenly
#: between 2 ranks, and the 10-element biases are smaller than one block.
UNEVEN = dict(partition_bytes=500, credit_bytes=2048)
SHARDABLE = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def reference(make_opt, steps=5, **kwargs):
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), **kwargs)
    return train(model, opt, steps), opt


def sharded(make_opt, steps=5, policy="bytescheduler", hooks=None, **kwargs):
    """``hooks(model, opt)``: ``train``'s ``before_step`` / ``after_step`` for this run."""
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(make_opt(model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           shard=True, policy=policy, **UNEVEN,
                                           **(PROFILE if policy == "dcredit" else {}), **kwargs)
    return train(model, opt, steps, **(hooks(model, opt) if hooks else {})), opt, model


def state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v))


@pytest.mark.parametrize("opt_name", sorted(SHARDABLE))
@pytest.mark.parametrize("policy", POLICIES)
def test_sharded_weights_match_plain_horovod(policy, opt_name):
    expected, _ = reference(SHARDABLE[opt_name])
    got, opt, _ = sharded(SHARDABLE[opt_name], policy=policy)
    assert_all_ranks(params_close(got, expected),
                     f"{policy}/{opt_name}: max relative difference {max_rel_diff(got, expected)}")


@pytest.mark.parametrize("policy, opt_name", [("wfbp", "adam"), ("bytescheduler", "adamw"),
                                             ("dcredit", "sgd_momentum")])
def test_sharded_all_gathers_overlapping_the_next_forward_match_plain_horovod(policy, opt_name):
    """With ``model=``, step() returns with the all-gathers in flight (race amplifier on): the
    next forward's reads wait for each parameter's own all-gathers, and the weights still match."""
    expected, _ = reference(SHARDABLE[opt_name], steps=6)
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(
        SHARDABLE[opt_name](model.parameters()), named_parameters=model.named_parameters(),
        shard=True, policy=policy, model=model, race_amplifier=0.0005, **UNEVEN,
        **(PROFILE if policy == "dcredit" else {}))
    in_flight = []
    got = train(model, opt, 6, after_step=lambda: in_flight.append(opt._step_in_flight))
    assert_all_ranks(params_close(got, expected),
                     f"{policy}/{opt_name}: max relative difference {max_rel_diff(got, expected)}")
    assert_all_ranks(in_flight[-1], f"step() waited for its all-gathers: {in_flight}")
    if policy == "dcredit":      # the plan was priced on both halves, fitted live
        fitted = opt._state.halves_cost
        assert_all_ranks(fitted is not None and all(c.time(1 << 16) > 0 for c in fitted),
                         f"reduce-scatter and all-gather costs not fitted: {fitted}")


def test_a_read_outside_the_forward_sees_the_gathered_parameters():
    """``state_dict()`` and a plain read of a parameter right after an overlapped step()."""
    expected, _ = reference(SHARDABLE["adam"], steps=1)
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(
        SHARDABLE["adam"](model.parameters()), named_parameters=model.named_parameters(),
        shard=True, policy="bytescheduler", model=model, race_amplifier=0.002, **UNEVEN)
    (x, y), = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    name, last = list(model.named_parameters())[-1]
    read = last.detach().clone()              # waits for this parameter's all-gathers only
    want = expected[list(make_model().state_dict()).index(name)]
    assert_all_ranks(torch.allclose(read, want, rtol=1e-5, atol=1e-6),
                     "a read right after step() saw the parameter before its all-gather")
    got = [v.detach().clone() for v in model.state_dict().values()]
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    assert_all_ranks(not opt._step_in_flight, "state_dict() must wait for every all-gather")


def test_sharded_optimizer_state_is_about_one_nth_per_rank():
    _, plain = reference(SHARDABLE["adam"])
    _, opt, _ = sharded(SHARDABLE["adam"])
    full, mine = state_bytes(plain), opt._state.sharded.state_bytes()
    share = mine / full
    everyone = hvd.allgather_object(mine)
    # opt.state is this rank's slices (moments of 1/N of the elements), not the whole state.
    assert_all_ranks(abs(state_bytes(opt) / full - 1 / hvd.size()) < 0.1,
                     f"opt.state holds {state_bytes(opt)} of {full} bytes")
    assert_all_ranks(abs(share - 1 / hvd.size()) < 0.1,
                     f"rank {hvd.rank()} holds {mine} of {full} bytes ({share:.3f})")
    # Every step counter is a one-element tensor per slice: the slices add up to the whole.
    steps = sum(s["step"].numel() * 4 for s in opt._state.sharded.inner.state.values())
    assert_all_ranks(abs(sum(everyone) - full) <= steps * hvd.size(), f"{everyone} vs {full}")


def test_sharded_clipping_uses_the_global_norm():
    """SGD: its update is linear in the clipped gradient.  Adam(W) is not checked here: a
    gradient that is rounding noise (its true value 0) is normalised by Adam into a full
    ``lr`` step, so the one-ulp difference between the global norm over slices and torch's
    over whole tensors grows past the tolerance (docs/troubleshooting.md)."""
    def clip_reference(opt):
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.05)
        with opt.skip_synchronize():
            opt.step()

    def clip_sharded(opt):
        opt.synchronize()
        opt.clip_grad_norm_(0.05)
        with opt.skip_synchronize():
            opt.step()

    model = make_model()
    opt = hvd.DistributedOptimizer(SHARDABLE["sgd_momentum"](model.parameters()),
                                   named_parameters=model.named_parameters())
    expected = train(model, opt, 4, before_step=clip_reference)
    got, _, _ = sharded(SHARDABLE["sgd_momentum"], 4,
                        hooks=lambda model, opt: {"before_step": clip_sharded})
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def test_sharded_checkpoint_resumes_like_a_run_that_never_stopped():
    expected, _, _ = sharded(SHARDABLE["adam"], steps=6)
    # Three steps, save (each rank its own state), a new model and optimizer, load, three more.
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(SHARDABLE["adam"](model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           shard=True, policy="bytescheduler", **UNEVEN)
    data = batches(6)
    for micro in data[:3]:
        opt.zero_grad()
        for x, y in micro:
            F.cross_entropy(model(x), y).backward()
        opt.step()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    opt.close()
    model = make_model(seed=99)
    model.load_state_dict(saved_model)
    opt = dcredit_hvd.DistributedOptimizer(SHARDABLE["adam"](model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           shard=True, policy="bytescheduler", **UNEVEN)
    opt.load_state_dict(saved_opt)
    for micro in data[3:]:
        opt.zero_grad()
        for x, y in micro:
            F.cross_entropy(model(x), y).backward()
        opt.step()
    got = [v.detach().clone() for v in model.state_dict().values()]
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def test_a_sharded_checkpoint_refuses_another_rank():
    _, opt, _ = sharded(SHARDABLE["adam"], steps=2)
    saved = opt.state_dict()
    saved["dcredit_shard"]["rank"] = (saved["dcredit_shard"]["rank"] + 1) % hvd.size()
    with pytest.raises(ValueError, match="written by rank"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("make_opt, why", [
    (lambda ps: torch.optim.LBFGS(ps), "elementwise"),
    (lambda ps: torch.optim.Rprop(ps), "elementwise"),
])
def test_sharding_refuses_an_optimizer_it_would_update_wrongly(make_opt, why):
    model = make_model()
    with pytest.raises(ValueError, match=why):
        dcredit_hvd.DistributedOptimizer(make_opt(model.parameters()),
                                         named_parameters=model.named_parameters(), shard=True)


def test_sharding_refuses_compression():
    model = make_model()
    with pytest.raises(ValueError, match="compression"):
        dcredit_hvd.DistributedOptimizer(SHARDABLE["adam"](model.parameters()),
                                         named_parameters=model.named_parameters(), shard=True,
                                         compression=hvd.Compression.fp16)


def test_a_parameter_given_new_storage_between_steps_is_still_updated():
    """``p.data = ...`` between steps (some checkpoint loaders do it): the slices the sharded
    optimizer updates follow the parameter's new storage."""
    def rebind(model):
        for p in model.parameters():
            p.data = p.data.clone()

    expected, _ = reference(SHARDABLE["adam"], steps=4)
    got, _, _ = sharded(SHARDABLE["adam"], 4,
                        hooks=lambda model, opt: {"after_step": lambda: rebind(model)})
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


#: Beyond the two the view is checked with on both transports: per-parameter keys that are
#: not ``step`` alone (ASGD's ``eta``, ``mu``), and a state torch creates at construction (Adagrad).
MORE_ELEMENTWISE = {
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.05),
}


@pytest.mark.parametrize("opt_name", sorted({**OPTIMIZERS, **MORE_ELEMENTWISE}))
def test_optimizer_state_shows_each_parameters_slice_with_torchs_keys(opt_name):
    """``opt.state[p]`` under shard=True: torch's keys, this rank's elements of ``p`` (equal to
    the unsharded run's there), every rank's slices together the whole state."""
    make_opt = {**OPTIMIZERS, **MORE_ELEMENTWISE}[opt_name]
    _, plain = reference(make_opt, steps=3)
    plain_state = [dict(plain.state[p]) for p in params_of(plain)]
    _, opt, _ = sharded(make_opt, steps=3)
    problems = check_view(opt, plain_state, hvd.rank(), hvd.size(), hvd.allgather_object)
    problems += check_one_block_concatenates(opt, plain_state, hvd.size(), hvd.allgather_object)
    problems += check_live_and_read_only(opt)
    assert_all_ranks(not problems, "; ".join(problems))
    assert_all_ranks(opt.state_dict()["state"] == {}, "state_dict()'s own state is not empty")


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_moments_zeroed_in_place_through_the_view_reach_the_next_step(opt_name):
    """The view's moments are the state the next step uses: zeroing them after step 2 on both
    runs gives the same weights at step 5 (and different ones from a run that never zeroed)."""
    def zeroing(opt):
        calls = [0]

        def after():
            calls[0] += 1
            if calls[0] == 2:
                zero_moments(opt)
        return after

    model = make_model()
    plain = hvd.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()),
                                     named_parameters=model.named_parameters())
    expected = train(model, plain, 5, after_step=zeroing(plain))
    untouched, _, _ = sharded(OPTIMIZERS[opt_name])
    got, _, _ = sharded(OPTIMIZERS[opt_name],
                        hooks=lambda model, opt: {"after_step": zeroing(opt)})
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    assert_all_ranks(not params_close(untouched, expected), "zeroing the moments changed nothing")


def test_optimizer_state_is_empty_before_the_first_step_and_refilled_after_a_load():
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           shard=True, policy="bytescheduler", **UNEVEN)
    assert_all_ranks(len(opt.state) == 0 and not list(opt.state), "state before any step")
    p = params_of(opt)[0]
    assert_all_ranks(len(opt.state[p]) == 0 and opt.state.get(p) is None, "a missing entry")
    train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())     # torch's state_dict shares the tensors
    before = {k: v.clone() for k, v in opt.state[p].items()}
    zero_moments(opt)
    opt.load_state_dict(saved)
    after = opt.state[p]
    assert_all_ranks(all(torch.equal(after[k], v) for k, v in before.items()),
                     "load_state_dict did not bring back the state the view shows")
