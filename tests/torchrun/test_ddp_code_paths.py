"""Ranks that take different code paths, several optimizers, and optimizers replaced mid-run,
on the torch.distributed transport (the Horovod suite's ``test_code_paths.py`` under torchrun).

Every policy, with and without ``model=``, race amplifier on, ends with the parameters of the
reference, on every rank: ``DistributedDataParallel`` plus the local optimizer where DDP can
express the case, else (``manual``) an ``all_reduce`` of every gradient, zeros where this rank
computed none, divided by the size, then the local optimizer: what Horovod and dcredit_hvd do
for a parameter that no rank used in a step (LayerDrop, experts nobody routed to), where DDP
leaves ``grad`` None and the optimizer skips the parameter.

Without ``model=`` a follower submits each gradient as its backward produces it, so a
rank-dependent forward makes the ranks submit in different orders: the issue order (rank 0's)
must still pair every collective.  Parameters are read straight after the last ``step()``.
The cases and the mechanism checks are ``tests/multirank/code_path_cases.py``, shared with the
Horovod suite.
"""
from __future__ import annotations

import functools

import pytest
import torch

import code_path_cases as shared
from conftest import ManualAllreduce, assert_all_ranks, ddp, gather, rank, same_on_every_rank
from grids import alternating_model_grid

#: DDP leaves ``grad`` None for a parameter no rank used in a step (a dropped layer, an expert
#: nobody routed to), where Horovod and dcredit_hvd send zeros: those cases are checked
#: against the manual all-reduce.
CASES = shared.case_table(manual={"layerdrop", "moe_routing"})


def _local(opt: torch.optim.Optimizer, named: list, model: torch.nn.Module) -> torch.optim.Optimizer:
    return opt


def _manual(opt: torch.optim.Optimizer, named: list, model: torch.nn.Module) -> ManualAllreduce:
    return ManualAllreduce(opt)


@functools.cache
def reference(name: str) -> list[torch.Tensor]:
    """``name``'s parameters under DDP (or the manual all-reduce), once per job."""
    case = CASES[name]
    run = shared.Runner(_manual, rank()) if case.manual else shared.Runner(_local, rank(), ddp)
    return shared.run_quietly(case, run)


@pytest.mark.parametrize("name, policy, with_model",
                         alternating_model_grid(list(CASES), list(shared.POLICIES)))
def test_code_path_matches_the_reference_on_every_rank(name: str, policy: str,
                                                       with_model: bool) -> None:
    run = shared.Runner(shared.dcredit_wrap(policy, with_model, transport="torch.distributed"),
                        rank())
    got, problem = shared.train_and_compare(CASES[name], reference(name), run)
    assert_all_ranks(not problem, f"{name}/{policy}/{'model' if with_model else 'no-model'}: "
                                  f"{problem}")
    assert_all_ranks(same_on_every_rank(got), f"{name}: ranks ended with different parameters")


# -- the mechanisms, one by one (their bodies in code_path_cases) ---------------------------------
def test_unagreed_orders_are_named_on_every_rank_before_anything_is_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the order broadcast taken out (each rank keeps its own first reads), the layout
    check stops the job on every rank, naming the first unit, before a wrong pairing."""
    shared.check_unagreed_orders_are_named(assert_all_ranks, monkeypatch, rank())


def test_each_optimizer_names_its_collectives_under_its_own_prefix_alike_on_every_rank() -> None:
    shared.check_each_optimizer_has_its_own_prefix(assert_all_ranks, gather)


def test_close_removes_the_hooks_and_gives_the_parameters_their_classes_back() -> None:
    shared.check_close_gives_everything_back(assert_all_ranks)


def test_an_optimizer_nobody_references_is_collected_with_its_hooks() -> None:
    shared.check_unreferenced_optimizer_is_collected(assert_all_ranks)


def test_a_new_optimizer_over_held_parameters_closes_the_old_one_with_a_warning() -> None:
    shared.check_new_optimizer_closes_the_old(assert_all_ranks)


def test_closing_between_backward_and_step_is_refused() -> None:
    shared.check_close_mid_step_is_refused(assert_all_ranks)
