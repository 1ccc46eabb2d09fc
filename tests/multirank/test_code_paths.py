"""Ranks that take different code paths, several optimizers, and optimizers replaced mid-run.

Every policy, with and without ``model=``, race amplifier on, ends with the parameters that
plain ``hvd.DistributedOptimizer`` ends with, on every rank (or, where Horovod itself cannot
run the pattern, a per-step manual ``hvd.allreduce`` of every gradient plus the local
optimizer):

* rank-dependent forwards: LayerDrop in ``Wav2Vec2ForSequenceClassification``, a module that
  only rank 1 runs in the first iteration, a switch MoE (``SwitchTransformers``) whose routing
  differs per rank;
* two models with two optimizers stepping in one loop (identical parameter names), and two
  optimizers over disjoint parameter groups of one model;
* an optimizer replaced mid-training: closed, rebound without ``close()``, or deleted;
* gradient checkpointing, a peft LoRA model, CPU bf16 autocast and ``torch.compile``.

Parameters are read straight after the last ``step()``, without ``apply_pending_updates()``.
The cases and the mechanism checks are ``code_path_cases.py``, shared with ``tests/torchrun``.
"""
from __future__ import annotations

import functools

import horovod.torch as hvd
import pytest
import torch

import code_path_cases as shared
from conftest import assert_all_ranks
from grids import alternating_model_grid


def compiled(run: shared.Runner) -> list[torch.Tensor]:
    """GPT-2 under ``torch.compile`` (Horovod's suite only)."""
    model = torch.compile(shared.gpt2(), backend="aot_eager")
    return shared.single(model, run,
                         lambda forward, step: forward(**shared.tokens(step, run.rank)).loss)


#: Plain Horovod cannot run an optimizer replaced mid-run (its hooks are never removed,
#: horovod/horovod#2017): those cases are checked against the manual all-reduce.
CASES = {**shared.case_table(manual={"replaced_close", "replaced_rebind", "replaced_del"}),
         "compile": shared.Case(compiled, atol=2e-6)}


class _ManualAllreduce:
    """The reference for what Horovod cannot run: after backward, every gradient (zeros where
    this rank computed none, as Horovod sends) is averaged by ``hvd.allreduce``, then the
    local optimizer steps."""

    def __init__(self, opt: torch.optim.Optimizer, named: list) -> None:
        self.opt = opt
        self.names = {p: n for n, p in named}

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        for group in self.opt.param_groups:
            for p in group["params"]:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = hvd.allreduce(grad, name=f"manual.{self.names[p]}", op=hvd.Average)
        self.opt.step()


def _plain(opt: torch.optim.Optimizer, named: list, model: torch.nn.Module) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(opt, named_parameters=named)


def _manual(opt: torch.optim.Optimizer, named: list, model: torch.nn.Module) -> _ManualAllreduce:
    return _ManualAllreduce(opt, named)


@functools.cache
def reference(name: str) -> list[torch.Tensor]:
    """``name``'s parameters under plain Horovod (or the manual all-reduce), once per job."""
    case = CASES[name]
    return shared.run_quietly(case, shared.Runner(_manual if case.manual else _plain, hvd.rank()))


def _same_on_every_rank(params: list[torch.Tensor]) -> bool:
    flat = torch.cat([p.reshape(-1) for p in params])
    gathered = hvd.allgather(flat.unsqueeze(0), name="test.code_paths.identical")
    return bool((gathered == gathered[0]).all())


@pytest.mark.parametrize("name, policy, with_model",
                         alternating_model_grid(list(CASES), list(shared.POLICIES)))
def test_code_path_matches_the_reference_on_every_rank(name: str, policy: str,
                                                       with_model: bool) -> None:
    run = shared.Runner(shared.dcredit_wrap(policy, with_model), hvd.rank())
    got, problem = shared.train_and_compare(CASES[name], reference(name), run)
    assert_all_ranks(not problem, f"{name}/{policy}/{'model' if with_model else 'no-model'}: "
                                  f"{problem}")
    assert_all_ranks(_same_on_every_rank(got), f"{name}: ranks ended with different parameters")


# -- the mechanisms, one by one (their bodies in code_path_cases) ---------------------------------
def test_unagreed_orders_are_named_on_every_rank_before_anything_is_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the order broadcast taken out (each rank keeps its own first reads), the layout
    check, not Horovod's shape error, stops the job: on every rank, naming the first unit."""
    shared.check_unagreed_orders_are_named(assert_all_ranks, monkeypatch, hvd.rank())


def test_each_optimizer_names_its_collectives_under_its_own_prefix_alike_on_every_rank() -> None:
    shared.check_each_optimizer_has_its_own_prefix(assert_all_ranks, hvd.allgather_object)


def test_close_removes_the_hooks_and_gives_the_parameters_their_classes_back() -> None:
    shared.check_close_gives_everything_back(assert_all_ranks)


def test_an_optimizer_nobody_references_is_collected_with_its_hooks() -> None:
    shared.check_unreferenced_optimizer_is_collected(assert_all_ranks)


def test_a_new_optimizer_over_held_parameters_closes_the_old_one_with_a_warning() -> None:
    shared.check_new_optimizer_closes_the_old(assert_all_ranks)


def test_closing_between_backward_and_step_is_refused() -> None:
    shared.check_close_mid_step_is_refused(assert_all_ranks)
