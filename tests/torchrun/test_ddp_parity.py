"""On plain models, parameters after N steps equal ``DistributedDataParallel``'s (plus the same
local optimizer), under every policy, with and without ``model=``, with SGD-momentum and Adam,
on every rank: the torch.distributed transport averages as DDP does (the Horovod suites'
``test_parity.py``, against DDP, with its tolerance)."""
from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from small_models import OPTIMIZERS, POLICIES, PROFILE, SMALL, make_model, max_rel_diff, params_close
from small_models import batches as small_batches
from torch.nn.parallel import DistributedDataParallel

import dcredit_hvd

from conftest import assert_all_ranks, ddp, rank, same_on_every_rank

VOCAB, SEQ = 50, 6


class TiedNet(nn.Module):
    """An embedding whose weight the output layer reuses (read twice), a layer norm, and a bare
    root parameter read last: every parameter used on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.hidden = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.norm(self.embed(ids))))
        return (h @ self.embed.weight.T) * self.scale


def _tied(seed: int = 7) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


#: name -> (builder, batches(steps, passes)); SmallNet's ``extra`` is used on rank 0 only.
NETS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, int], list]]] = {
    "small": (lambda: make_model(rank=rank()),
              lambda steps, passes: small_batches(steps, passes, rank=rank())),
    "tied": (_tied, lambda steps, passes: _token_batches(steps, passes)),
}


def _token_batches(steps: int, passes: int) -> list:
    gen = torch.Generator().manual_seed(2000 + rank())
    return [[(torch.randint(0, VOCAB, (4, SEQ), generator=gen),
              torch.randint(0, VOCAB, (4, SEQ), generator=gen)) for _ in range(passes)]
            for _ in range(steps)]


def _train(net: str, model: nn.Module, opt: Any, forward: Optional[nn.Module] = None,
           steps: int = 5, passes: int = 1,
           before_step: Optional[Callable[[Any], None]] = None) -> list[torch.Tensor]:
    """``steps`` iterations of ``passes`` micro-batches through ``forward`` (default ``model``;
    under DDP every micro-batch but the last runs in ``no_sync()``, DDP's accumulation)."""
    run = model if forward is None else forward
    for micro in NETS[net][1](steps, passes):
        opt.zero_grad()
        for i, (x, y) in enumerate(micro):
            local = isinstance(run, DistributedDataParallel) and i < len(micro) - 1
            with run.no_sync() if local else nullcontext():
                out = run(x)
                F.cross_entropy(out.flatten(0, -2), y.flatten()).backward()
        if before_step is not None:
            before_step(opt)
        else:
            opt.step()
    # Through state_dict(), as a checkpoint reads them: it must see every update applied (and
    # each rank's own batch-norm statistics).
    return [v.detach().clone() for v in model.state_dict().values()]


def reference(net: str, make_opt: Callable, steps: int = 5, passes: int = 1,
              before_step: Optional[Callable[[Any], None]] = None,
              hook: Optional[Callable] = None) -> list[torch.Tensor]:
    """DDP plus the local optimizer; ``hook``: a DDP communication hook (the sum)."""
    model = NETS[net][0]()
    wrapped = ddp(model)
    if hook is not None:
        wrapped.register_comm_hook(None, hook)
    return _train(net, model, make_opt(model.parameters()), wrapped, steps, passes, before_step)


def ours(net: str, make_opt: Callable, steps: int = 5, passes: int = 1, with_model: bool = True,
         before_step: Optional[Callable[[Any], None]] = None,
         **kwargs: Any) -> tuple[list[torch.Tensor], Any]:
    model = NETS[net][0]()
    opt = dcredit_hvd.DistributedOptimizer(make_opt(model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           model=model if with_model else None,
                                           backward_passes_per_step=passes, **kwargs)
    return _train(net, model, opt, None, steps, passes, before_step), opt


def _sum_hook(state, bucket):  # annotated below
    """DDP reducing by the sum, not the mean."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the hook's annotations as objects (this module's are strings, PEP 563).
_sum_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("net", sorted(NETS))
def test_parameters_match_ddp_after_five_steps(net: str, policy: str, opt_name: str,
                                               with_model: bool) -> None:
    make_opt = OPTIMIZERS[opt_name]
    expected = reference(net, make_opt)
    got, opt = ours(net, make_opt, with_model=with_model, policy=policy, **SMALL,
                    **(PROFILE if policy == "dcredit" else {}))
    assert_all_ranks(policy != "dcredit" or opt.plan is not None, "the plan never took over")
    blocks = {t.name: len(t.blocks) for t in opt.layouts}
    split = policy == "wfbp" or any(n > 1 for n in blocks.values())
    assert_all_ranks(split, f"large tensors were not split: {blocks}")
    assert_all_ranks(params_close(got, expected),
                     f"{net}/{policy}/{opt_name}: max relative difference "
                     f"{max_rel_diff(got, expected)}")
    trained = [p for group in opt.param_groups for p in group["params"]]
    assert_all_ranks(same_on_every_rank(trained), "ranks ended with different parameters")
    opt.close()


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_backward_passes_per_step_accumulates_like_ddp_no_sync(with_model: bool) -> None:
    make_opt = OPTIMIZERS["adam"]
    expected = reference("small", make_opt, passes=2)
    got, opt = ours("small", make_opt, passes=2, with_model=with_model, **SMALL)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    opt.close()


@pytest.mark.parametrize("kwargs,hook", [(dict(gradient_predivide_factor=2.0), None),
                                         (dict(op=dist.ReduceOp.SUM), _sum_hook),
                                         (dict(op=dist.ReduceOp.AVG), None)],
                         ids=["predivide", "sum", "avg"])
def test_reduction_options_match_ddp(kwargs: dict, hook: Optional[Callable]) -> None:
    """The pre-divided mean and ``ReduceOp.AVG`` are DDP's mean; ``ReduceOp.SUM`` is DDP with
    a summing communication hook."""
    make_opt = OPTIMIZERS["sgd_momentum"]
    expected = reference("small", make_opt, hook=hook)
    got, opt = ours("small", make_opt, **kwargs, **SMALL)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    opt.close()


def _clip_then_step(opt: Any) -> None:
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, 0.05)
    if hasattr(opt, "skip_synchronize"):
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_synchronize_clip_skip_synchronize_pattern_matches_ddp(with_model: bool) -> None:
    make_opt = OPTIMIZERS["sgd_momentum"]
    expected = reference("small", make_opt, before_step=_clip_then_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no double-synchronize warning in this pattern
        got, opt = ours("small", make_opt, with_model=with_model, before_step=_clip_then_step,
                        **SMALL)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    opt.close()
