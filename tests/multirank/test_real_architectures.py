"""On real architectures (``transformers``, tiny configs), every policy, with and without
``model=``, with the race amplifier on, ends with the parameters plain ``hvd.DistributedOptimizer``
ends with, on every rank, and identical across ranks.

The parameters are read straight after the last ``step()``, as an EMA of the weights or
``parameters_to_vector`` would read them, without ``apply_pending_updates()``: with ``model=``
that read races the overlapped updates, and only the read guard makes it safe.
"""
from __future__ import annotations

import warnings

import horovod.torch as hvd
import pytest
import torch

import dcredit_hvd

from conftest import assert_all_ranks
from grids import alternating_model_grid
from hf_models import ARCHITECTURES, batches, build

STEPS = 8
POLICIES = ["wfbp", "bytescheduler", "dcredit"]
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}
#: Small blocks, so that embeddings and projections are cut into several; dcredit profiles
#: iterations 1-3 and runs its plan from iteration 4 on (installed mid-run), with runs of
#: gradients under 16 KiB sharing flat buffers that are themselves cut into 4 KiB blocks.
SCHEDULE = dict(partition_bytes=4096, credit_bytes=16384, profile_warmup=1, profile_steps=2,
                group_bytes=16384)
#: Random sleeps of up to 0.5 ms in the completion thread, at each submission and each update.
AMPLIFIER = dict(race_amplifier=0.0005)

_reference: dict[tuple[str, str], list[torch.Tensor]] = {}


def _train(name: str, opt_name: str, wrap) -> tuple[list[torch.Tensor], object]:
    model = build(name)
    opt = wrap(OPTIMIZERS[opt_name](model.parameters()), model)
    torch.manual_seed(1000 + hvd.rank())           # the same dropout masks in both runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in batches(name, STEPS, hvd.rank()):
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
        # A direct read right after the last step(): no apply_pending_updates(), no state_dict().
        params = [p.detach().clone() for p in model.parameters()]
    if hasattr(opt, "apply_pending_updates"):
        opt.apply_pending_updates()
    return params, opt


def reference(name: str, opt_name: str) -> list[torch.Tensor]:
    key = (name, opt_name)
    if key not in _reference:
        _reference[key], _ = _train(name, opt_name, lambda opt, model: hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters()))
    return _reference[key]


def _mismatch(got: list[torch.Tensor], expected: list[torch.Tensor]) -> str:
    for i, (a, b) in enumerate(zip(got, expected)):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-7):
            return (f"parameter #{i} {tuple(a.shape)}: max |diff| "
                    f"{float((a - b).abs().max()):.3g}")
    return "" if len(got) == len(expected) else "parameter count differs"


def _same_on_every_rank(params: list[torch.Tensor]) -> bool:
    flat = torch.cat([p.reshape(-1) for p in params])
    gathered = hvd.allgather(flat.unsqueeze(0), name="test.real.identical")
    return bool((gathered == gathered[0]).all())


@pytest.mark.parametrize("name, policy, opt_name, with_model", alternating_model_grid(
    sorted(ARCHITECTURES), POLICIES, (sorted(OPTIMIZERS),)))
def test_real_architecture_matches_plain_horovod_on_every_rank(name, policy, opt_name,
                                                               with_model):
    expected = reference(name, opt_name)
    extra = SCHEDULE if policy == "dcredit" else {
        k: v for k, v in SCHEDULE.items() if not k.startswith(("profile", "group"))}
    got, opt = _train(name, opt_name, lambda o, model: dcredit_hvd.DistributedOptimizer(
        o, named_parameters=model.named_parameters(), model=model if with_model else None,
        policy=policy, **extra, **AMPLIFIER))
    assert_all_ranks(policy != "dcredit" or opt.plan is not None, "the plan never took over")
    assert_all_ranks(policy != "dcredit" or any(u.grouped for u in opt.layouts),
                     "the plan grouped no small gradients")
    problem = _mismatch(got, expected)
    assert_all_ranks(not problem, f"{name}/{policy}/{opt_name}: {problem}")
    assert_all_ranks(_same_on_every_rank(got), f"{name}: ranks ended with different parameters")


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_real_architecture_runs_the_benchmarks_dcredit_policy_with_model(name):
    """The benchmark's configuration: dcredit with its default partition search and profile
    (2 warm-up + 3 profiled iterations), overlapped with the next forward."""
    expected = reference(name, "adamw")
    got, opt = _train(name, "adamw", lambda o, model: dcredit_hvd.DistributedOptimizer(
        o, named_parameters=model.named_parameters(), model=model, policy="dcredit"))
    assert_all_ranks(opt.plan is not None, "the plan never took over")
    problem = _mismatch(got, expected)
    assert_all_ranks(not problem, f"{name}/dcredit (bench settings): {problem}")


#: Each architecture with one optimizer, alternating (the references are cached already), and
#: with or without ``model=`` (all-gathers overlapping the next forward, or in step()), so that
#: every optimizer meets both.
SHARDED = [(name, sorted(OPTIMIZERS)[i % 2], (i // 2) % 2 == 0)
           for i, name in enumerate(sorted(ARCHITECTURES))]


@pytest.mark.parametrize("name, opt_name, with_model", SHARDED)
def test_real_architecture_sharded_matches_plain_horovod_on_every_rank(name, opt_name,
                                                                       with_model):
    """shard=True under dcredit (blocks reduce-scattered, each rank's slices updated,
    parameters all-gathered in step(), or with model= during the next forward) ends where
    hvd.DistributedOptimizer does, read right after the last step()."""
    expected = reference(name, opt_name)
    extra = {k: v for k, v in SCHEDULE.items() if k != "group_bytes"}
    got, opt = _train(name, opt_name, lambda o, model: dcredit_hvd.DistributedOptimizer(
        o, named_parameters=model.named_parameters(), policy="dcredit", shard=True, **extra,
        model=model if with_model else None, **AMPLIFIER))
    assert_all_ranks(opt.plan is not None, "the plan never took over")
    problem = _mismatch(got, expected)
    assert_all_ranks(not problem, f"{name}/shard/{opt_name}: {problem}")
    assert_all_ranks(_same_on_every_rank(got), f"{name}: ranks ended with different parameters")
