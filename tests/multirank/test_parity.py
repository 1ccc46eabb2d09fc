"""Parameters after N steps equal plain ``hvd.DistributedOptimizer``'s, under every policy.

Run on every rank under ``mpirun -np 2`` and ``horovodrun -np 2 --gloo`` (``make test``).
"""
from __future__ import annotations

import warnings

import horovod.torch as hvd
import pytest
import torch
from small_models import OPTIMIZERS, POLICIES, PROFILE, SMALL

import dcredit_hvd

from conftest import assert_all_ranks
from models import make_model, max_rel_diff, params_close, train


def reference(make_opt, steps=5, passes=1, **hvd_kwargs):
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), **hvd_kwargs)
    return train(model, opt, steps, passes)


def ours(make_opt, steps=5, passes=1, with_model=True, **kwargs):
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(make_opt(model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           model=model if with_model else None, **kwargs)
    return train(model, opt, steps, passes), opt


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("policy", POLICIES)
def test_parameters_match_plain_horovod_after_five_steps(policy, opt_name):
    make_opt = OPTIMIZERS[opt_name]
    expected = reference(make_opt)
    extra = PROFILE if policy == "dcredit" else {}
    got, opt = ours(make_opt, policy=policy, **SMALL, **extra)
    assert_all_ranks(policy != "dcredit" or opt.plan is not None, "the plan never took over")
    blocks = {t.name: len(t.blocks) for t in opt.layouts}
    split = policy == "wfbp" or all(n > 1 for name, n in blocks.items() if "head.weight" in name)
    assert_all_ranks(split, f"large tensors were not split: {blocks}")
    assert_all_ranks(params_close(got, expected),
                     f"{policy}/{opt_name}: max relative difference {max_rel_diff(got, expected)}")


def test_parameters_match_without_model_argument():
    expected = reference(OPTIMIZERS["sgd_momentum"])
    got, _ = ours(OPTIMIZERS["sgd_momentum"], with_model=False, policy="bytescheduler", **SMALL)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def test_fp16_compression_matches_horovod_fp16_per_element():
    make_opt = OPTIMIZERS["sgd_momentum"]
    expected = reference(make_opt, compression=hvd.Compression.fp16)
    got, opt = ours(make_opt, compression=hvd.Compression.fp16, **SMALL)
    halved = all(t.element_size == 2 for t in opt.layouts)
    assert_all_ranks(halved, "fp16 blocks should be sized at 2 bytes per element")
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def test_backward_passes_per_step_accumulates_like_horovod():
    make_opt = OPTIMIZERS["adam"]
    expected = reference(make_opt, passes=2, backward_passes_per_step=2)
    got, _ = ours(make_opt, passes=2, backward_passes_per_step=2, **SMALL)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


@pytest.mark.parametrize("kwargs", [dict(gradient_predivide_factor=2.0), dict(op=hvd.Sum)],
                         ids=["predivide", "sum"])
def test_reduction_options_match_horovod(kwargs):
    make_opt = OPTIMIZERS["sgd_momentum"]
    expected = reference(make_opt, **kwargs)
    got, _ = ours(make_opt, **kwargs, **SMALL)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def clip_then_step(opt):
    opt.synchronize()
    params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, 0.05)
    with opt.skip_synchronize():
        opt.step()


def test_synchronize_clip_skip_synchronize_pattern_matches_horovod():
    make_opt = OPTIMIZERS["sgd_momentum"]
    model = make_model()
    ref_opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                       named_parameters=model.named_parameters())
    expected = train(model, ref_opt, before_step=clip_then_step)
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(make_opt(model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           model=model, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no double-synchronize warning in this pattern
        got = train(model, opt, before_step=clip_then_step)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def test_zero_grad_with_set_to_none_false_keeps_gradients_allocated():
    make_opt = OPTIMIZERS["sgd_momentum"]
    got, opt = ours(make_opt, **SMALL)
    model_params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    opt.zero_grad(set_to_none=False)
    zeroed = all(p.grad is not None and not p.grad.any() for p in model_params)
    assert_all_ranks(zeroed, "zero_grad(set_to_none=False) must zero, not drop, gradients")
    expected = reference(make_opt)
    assert_all_ranks(params_close(got, expected))


def test_wrapped_optimizer_is_an_instance_of_the_user_class_and_round_trips_state():
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = dcredit_hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    ok = isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    train(model, opt, steps=2)
    state = opt.state_dict()
    opt.load_state_dict(state)
    after = opt.state_dict()
    same = all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
               for a, b in zip(state["state"].values(), after["state"].values()))
    train(model, opt, steps=1)       # still trains after load_state_dict
    assert_all_ranks(ok and same, f"isinstance={ok}, state round trip={same}")


def test_zero_grad_between_backward_and_step_raises_horovods_error():
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **SMALL)
    x = torch.randn(4, 3, 8, 8)
    model(x).sum().backward()
    try:
        opt.zero_grad()
        message = ""
    except AssertionError as exc:
        message = str(exc)
    opt.synchronize()           # drain what the backward pass released, on every rank
    assert_all_ranks("before optimizer.step() or optimizer.synchronize()" in message,
                     f"got {message!r}")


def test_more_backward_passes_than_declared_raises_horovods_error():
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **SMALL)
    x = torch.randn(4, 3, 8, 8)
    model(x).sum().backward()
    try:
        model(x).sum().backward()
        message = ""
    except AssertionError as exc:
        message = str(exc)
    opt.synchronize()
    assert_all_ranks("more than backward_passes_per_step" in message, f"got {message!r}")


def test_step_after_synchronize_without_skip_warns_like_horovod():
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **SMALL)
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert_all_ranks(any("skip_synchronize" in str(w.message) for w in caught),
                     "expected the double-synchronize warning")


def test_broadcast_optimizer_state_runs_locally_and_matches():
    model = make_model()
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                           named_parameters=model.named_parameters(), **SMALL)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)   # empty state: must not deadlock
    got = train(model, opt, steps=2)
    model2 = make_model()
    ref = hvd.DistributedOptimizer(torch.optim.Adam(model2.parameters(), lr=0.01),
                                   named_parameters=model2.named_parameters())
    hvd.broadcast_parameters(model2.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(ref, root_rank=0)
    expected = train(model2, ref, steps=2)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def test_dcredit_plan_is_identical_on_every_rank_and_logged_once_on_rank_0():
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("dcredit_hvd")
    handler = Keep()
    logger.addHandler(handler)
    try:
        # no explicit partition: the planner chooses it with the simulator
        got, opt = ours(OPTIMIZERS["adam"], policy="dcredit", **PROFILE)
    finally:
        logger.removeHandler(handler)
    plans = hvd.allgather_object((opt.plan.partition_bytes, opt.plan.windows))
    assert_all_ranks(all(p == plans[0] for p in plans), f"plans differ across ranks: {plans}")
    fits = [m for m in records if m.startswith("cost model:")]
    planned = [m for m in records if m.startswith("plan:")]
    expected = 1 if hvd.rank() == 0 else 0
    assert_all_ranks(len(fits) == expected and len(planned) == expected,
                     f"rank {hvd.rank()} logged {len(fits)} fits and {len(planned)} plans")
    assert_all_ranks(params_close(got, reference(OPTIMIZERS["adam"])))


GROUPED = dict(partition_bytes=512, group_bytes=4096, **PROFILE)


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
@pytest.mark.parametrize("case", ["fp16", "two_passes"])
def test_grouped_units_match_plain_horovod_with_compression_and_accumulation(case, with_model):
    """Runs of small gradients in shared buffers (biases, batch-norm weights, and ``extra``,
    whose gradient rank 1 never computes: zeros travel in its slot), cut into 512-byte blocks,
    with fp16 compression or two backward passes per step, equal plain Horovod's."""
    make_opt = OPTIMIZERS["adam"]
    kwargs = ({"compression": hvd.Compression.fp16} if case == "fp16"
              else {"backward_passes_per_step": 2})
    passes = 2 if case == "two_passes" else 1
    expected = reference(make_opt, steps=7, passes=passes, **kwargs)
    got, opt = ours(make_opt, steps=7, passes=passes, with_model=with_model, policy="dcredit",
                    race_amplifier=0.0003, **GROUPED, **kwargs)
    grouped = [u for u in opt.layouts if u.grouped]
    assert_all_ranks(bool(grouped) and any(len(u.blocks) > 1 for u in grouped),
                     f"no unit of several tensors cut into several blocks: "
                     f"{[(u.name, len(u.blocks)) for u in opt.layouts]}")
    assert_all_ranks(params_close(got, expected), f"{case}: max rel diff {max_rel_diff(got, expected)}")
