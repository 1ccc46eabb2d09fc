"""The race's correctness cases, for both launchers (Horovod-free: ``tests/multirank/test_race.py``
runs them under ``mpirun``, ``tests/torchrun/test_race.py`` under ``torchrun``).

Each case trains a real ``transformers`` model (tiny config) with ``dcredit`` while its race
runs, one challenger forced to win (``tune_force``) so that every rank switches schedules at
least twice mid-run (each candidate in turn, then the winner), with gradient accumulation,
clipping, the sharded mode, or a checkpoint taken in the middle of the race and resumed into a
fresh model and optimizer.  The reference is the plain data-parallel run of the same steps.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from hf_models import batches, build

#: Short rounds so the race (profiled at iterations 1-3) ends mid-run: 2 kept iterations per
#: candidate and round, none dropped, the race amplifier on.
RACE = dict(profile_warmup=1, profile_steps=2, partition_bytes=4096, credit_bytes=16384,
            tune_rounds=(2, 2), tune_drop=0, race_amplifier=0.0003)
STEPS = 30


@dataclass(frozen=True)
class Case:
    name: str
    arch: str
    force: str                          # the challenger that wins
    model_overlap: bool = True
    passes: int = 1
    clip: Optional[float] = None
    shard: bool = False
    checkpoint_at: Optional[int] = None  # steps before the checkpoint and resume
    sgd: bool = False                    # SGD with momentum instead of AdamW
    extra: dict = field(default_factory=dict)


CASES = [
    # The baselines at an emulated cluster's byte settings (tune_byte_scale; every other case
    # races them unscaled): DDP's 25 MiB buckets / 1024 = 25 KiB, several buckets in a tiny
    # model instead of one, ByteScheduler at 4 MiB / 1024 (RACE's 4096 B / 1024 would be one
    # float a block); ByteScheduler's partition and credit / 4.
    Case("gpt2-ddp-buckets-scaled", "gpt2", "ddp", extra=dict(
        tune_byte_scale=1024.0, partition_bytes=4 << 20, credit_bytes=16 << 20)),
    Case("t5-bytescheduler-no-model-scaled", "t5", "bytescheduler", model_overlap=False,
         extra=dict(tune_byte_scale=4.0)),
    Case("bert-accumulation-and-clipping", "bert", "wfbp", passes=2, clip=0.5),
    Case("gpt2-checkpoint-mid-race", "gpt2", "ddp", checkpoint_at=9),
    Case("gpt2-sharded-immediate", "gpt2", "immediate", shard=True),
    # SGD: the sharded global norm sums its slices in another order than clip_grad_norm_, and
    # AdamW's normalisation makes that last-bit difference visible on ViT's small LayerNorms.
    Case("vit-sharded-clipping", "vit", "bytescheduler", shard=True, clip=0.5, model_overlap=False,
         sgd=True),
    Case("llama-sharded-checkpoint-mid-race", "llama", "immediate", shard=True, checkpoint_at=9),
]

Wrap = Callable[[torch.optim.Optimizer, torch.nn.Module], torch.optim.Optimizer]


def optimizer(case: Case, model: torch.nn.Module) -> torch.optim.Optimizer:
    if case.sgd:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def dcredit_wrap(case: Case, tune: bool = True) -> Wrap:
    """``dcredit`` with the race (its forced winner), or without it (``tune=False``)."""
    import dcredit_hvd

    def wrap(opt: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
        return dcredit_hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), backward_passes_per_step=case.passes,
            model=model if case.model_overlap else None, shard=case.shard or None,
            tune=tune, tune_force=case.force, **{**RACE, **case.extra})
    return wrap


def train(case: Case, wrap: Wrap, rank: int, *, forward: Callable = lambda m: m,
          clip: Optional[Callable] = None, no_sync: Optional[Callable] = None
          ) -> tuple[list[torch.Tensor], list]:
    """``STEPS`` optimizer steps of ``case.passes`` micro-batches each; returns the parameters
    and every optimizer used (two when a checkpoint was resumed).  ``clip(model, opt)`` runs
    between the last backward and the step (it owns the step); ``no_sync(model)`` is the
    reference's context for micro-batches that do not step (DDP's ``no_sync``)."""
    model = build(case.arch)
    opt = wrap(optimizer(case, model), model)
    used = [opt]
    data = batches(case.arch, STEPS * case.passes, rank)
    torch.manual_seed(1000 + rank)                 # the same dropout masks in every run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(STEPS):
            if case.checkpoint_at is not None and step == case.checkpoint_at:
                model, opt = _resume(case, wrap, model, opt)
                used.append(opt)
            opt.zero_grad()
            for k in range(case.passes):
                batch = data[step * case.passes + k]
                last = k == case.passes - 1
                with (no_sync(model) if no_sync is not None and not last else _nothing()):
                    (forward(model)(**batch).loss / case.passes).backward()
            if clip is not None and case.clip:
                clip(model, opt)
            else:
                opt.step()
        if hasattr(opt, "apply_pending_updates"):
            opt.apply_pending_updates()
    return [p.detach().clone() for p in model.parameters()], used


def _resume(case: Case, wrap: Wrap, model: torch.nn.Module, opt: torch.optim.Optimizer):
    """What a job killed after this step and restarted does: save, build anew, load."""
    if hasattr(opt, "apply_pending_updates"):
        opt.apply_pending_updates()
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if hasattr(opt, "close"):
        opt.close()
    rng = torch.get_rng_state()                     # build() seeds; the dropout stream goes on
    fresh = build(case.arch)
    torch.set_rng_state(rng)
    fresh.load_state_dict(saved["model"])
    new_opt = wrap(optimizer(case, fresh), fresh)
    new_opt.load_state_dict(saved["optimizer"])
    return fresh, new_opt


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def dcredit_clip(case: Case) -> Callable:
    """Horovod's pattern: reduce, clip the reduced gradients (the sharded optimizer's own
    global norm), step without reducing again."""
    def clip(model: torch.nn.Module, opt) -> None:
        opt.synchronize()
        if case.shard:
            opt.clip_grad_norm_(case.clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        with opt.skip_synchronize():
            opt.step()
    return clip


def identical(got: list[torch.Tensor], expected: list[torch.Tensor]) -> str:
    """Empty when bitwise equal: a schedule changes when values travel, never what they are."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if not torch.equal(a, b):
            return f"parameter #{i} {tuple(a.shape)}: max |diff| {float((a - b).abs().max()):.3g}"
    return ""


def mismatch(got: list[torch.Tensor], expected: list[torch.Tensor]) -> str:
    for i, (a, b) in enumerate(zip(got, expected)):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            return f"parameter #{i} {tuple(a.shape)}: max |diff| {float((a - b).abs().max()):.3g}"
    return "" if len(got) == len(expected) else "parameter count differs"


def switched(case: Case, used: list) -> str:
    """Empty when the last optimizer's race was won by the forced challenger (an earlier one,
    checkpointed mid-race, switched at least once before it stopped); else why not."""
    for opt in used[-1:]:
        races = opt.races
        if not races:
            return "no race finished"
        winner = races[0]["winner"]
        if not winner.startswith(case.force):
            return f"the race was won by {winner!r}, not the forced {case.force!r}"
        if len(races[0]["table"]) < 3:
            return f"only {len(races[0]['table'])} candidates raced"
    return ""
