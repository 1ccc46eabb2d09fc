"""The factory's arguments checked, with Horovod's error texts where Horovod has one."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch


def named_parameters(param_groups: list, named: Optional[Any]) -> list:
    """``named_parameters`` as Horovod checks it (tuples, unique names, every parameter named),
    unnamed ones named ``allreduce.noname.<group>.<index>``; one entry per tensor (tied weights
    keep their first name, as ``model.named_parameters()`` does)."""
    if named is not None:
        named = list(named)
    else:
        named = [(f"allreduce.noname.{i}.{j}", v)
                 for i, group in enumerate(param_groups) for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in named]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    all_params = {id(v) for _, v in named}
    unnamed = [id(p) for group in param_groups for p in group["params"]
               if id(p) not in all_params]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         "were not named. Python object ids: "
                         f"{', '.join(str(i) for i in unnamed)}")
    seen, unique = set(), []
    for name, p in named:
        if p not in seen:
            seen.add(p)
            unique.append((name, p))
    return unique


def model_owns(model: torch.nn.Module, updated: list, names: dict) -> None:
    """With ``model=``, priority follows the order in which ``model``'s forward reads the
    parameters, and the overlapped step is only safe for the model given: every parameter
    the optimizer updates must belong to ``model`` (a different model is a mistake)."""
    owned = set(model.parameters())
    orphans = [p for p in updated if p not in owned]
    if not orphans:
        return
    if len(orphans) == len(updated):
        raise ValueError(
            f"model= was given a {type(model).__name__} none of whose parameters are "
            "updated by this optimizer: pass the model whose parameters the optimizer "
            "updates (the one named_parameters comes from), or leave model= out")
    orphan_names = [names[p] for p in orphans]
    raise ValueError(
        f"dcredit_hvd: model= ({type(model).__name__}) does not contain {len(orphan_names)} "
        f"parameter(s) that this optimizer updates: {', '.join(orphan_names[:8])}"
        f"{', ...' if len(orphan_names) > 8 else ''}. With model=, step() returns before its "
        "updates are applied and the priority order comes from model's forward, so every "
        "parameter the optimizer updates must be part of model: register them in a "
        "module of model (or pass one nn.Module holding the model and them), or leave "
        "model= out so that step() waits like hvd.DistributedOptimizer")


def factory(op: Any, predivide: float, num_groups: int, groups: Any, passes: int,
            optimizer: Any, model: Any, library: Any) -> None:
    """The factory's own checks, in Horovod's order and with its texts; then the transport
    module's (``library.check_op``)."""
    if predivide != 1.0 and op != library.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None:
        raise NotImplementedError(
            "groups/num_groups is not supported by dcredit_hvd: the scheduler forms its own "
            "blocks and Horovod fuses what is released together. Remove groups= (and "
            "num_groups=), or use hvd.DistributedOptimizer.")
    if passes <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == library.ADASUM:
        raise NotImplementedError(
            "op=hvd.Adasum is not supported by dcredit_hvd (Adasum reduces optimizer deltas, "
            "not gradients); use hvd.DistributedOptimizer(op=hvd.Adasum)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    library.check_op(op)
