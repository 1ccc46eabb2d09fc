"""The factory's arguments checked, with Horovod's error texts where Horovod has one.

Two steps, each check in one of them only.  ``before_transport`` runs every check that needs
no collective library, before the transport is chosen, so that a bad argument gets its own
error even before ``hvd.init()`` / ``init_process_group`` (Horovod checks its arguments before
anything else, and its own tests rely on it).  ``with_transport`` runs what needs the chosen
library: whether an explicit ``op`` is that library's average, and the library's own op rule.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Optional

import torch

from . import transports


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


def before_transport(optimizer: Any, named: Optional[Any], num_groups: int, groups: Any,
                     passes: int, op: Any, model: Any) -> list:
    """The checks that need no collective library, in Horovod's order (``num_groups``,
    ``backward_passes_per_step``, Adasum, ``named_parameters``, ``groups``), then ours
    (``model=``).  Returns the checked ``named_parameters``, one entry per tensor; a generator
    passed by the user is consumed here, once."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if passes <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if _is_adasum(op):
        raise NotImplementedError(
            "op=hvd.Adasum is not supported by dcredit_hvd (Adasum reduces optimizer deltas, "
            "not gradients); use hvd.DistributedOptimizer(op=hvd.Adasum)")
    checked = named_parameters(optimizer.param_groups, named)
    if groups is not None:
        raise NotImplementedError(
            "groups/num_groups is not supported by dcredit_hvd: the scheduler forms its own "
            "blocks and Horovod fuses what is released together. Remove groups= (and "
            "num_groups=), or use hvd.DistributedOptimizer.")
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        model_owns(model, [p for group in optimizer.param_groups for p in group["params"]
                           if p.requires_grad], {p: name for name, p in checked})
    return checked


def _is_adasum(op: Any) -> bool:
    """Whether ``op`` is the Adasum constant of a library (Horovod's ``hvd.Adasum``, an int,
    known without ``hvd.init()``).  Only libraries the process has imported are asked (the
    caller holds the constant, so its library is imported), and only the constant's own type
    counts: torch's ``ReduceOp`` values compare equal to Horovod's ints."""
    if op is None:
        return False
    for name in transports.names():
        if sys.modules.get(transports.LIBRARIES[name]) is None:
            continue
        library = transports.module(name)
        if library is not None and type(op) is type(library.ADASUM) and op == library.ADASUM:
            return True
    return False


def with_transport(op: Any, predivide: float, library: Any) -> None:
    """The checks that need the chosen library: ``op`` (its default already filled in) against
    the library's average for ``gradient_predivide_factor``, then ``library.check_op``.  Horovod
    checks the pre-division first of all; here it waits for the library when ``op`` is given
    (with ``op=None`` it is the average, so nothing can fail before)."""
    if predivide != 1.0 and op != library.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    library.check_op(op)
