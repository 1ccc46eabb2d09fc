"""The Accelerate cases of ``test_accelerate.py``, run on every rank of ONE 2-rank launch
(``torchrun`` or ``accelerate launch --cpu``; Gloo, CPU): many short loops in one process.

    python accelerate_cases.py OUT_DIR first    # parity with accelerate.Accelerator (DDP);
                                                # resume runs save_state at step 2 of 4
    python accelerate_cases.py OUT_DIR second   # a NEW job: load_state those checkpoints and
                                                # continue, then the parity cases again
    python accelerate_cases.py OUT_DIR bf16     # a few parity cases under bf16 autocast
    python accelerate_cases.py OUT_DIR refuse NAME,...   # one process: refused setups

Each case runs the same plain Accelerate loop (``accumulate``, ``backward``, ``clip_grad_norm_``
on ``sync_gradients``, ``step``, ``zero_grad``) on a tiny GPT-2 (tied embeddings) with
``DCreditAccelerator`` and with ``accelerate.Accelerator`` (DDP); every rank starts from its
own random weights.  Each rank writes ``OUT_DIR/<phase>.rank<r>.json``: per case this rank's
largest weight difference to the same rank of the reference, both runs' losses and gradient
norms, and what the model and optimizer were wrapped in.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import transformers as tf
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ, BATCH = 64, 12, 4
#: The ``bf16`` phase's autocast; Accelerate fixes it for the whole process.
MIXED = "bf16" if len(sys.argv) > 2 and sys.argv[2] == "bf16" else "no"
RTOL, ATOL = 1e-5, 1e-6
#: Small blocks (several per tensor); ``dcredit``'s plan installed after 3 steps.
SCHED = {"partition_bytes": 4096, "credit_bytes": 16384, "profile_warmup": 1,
         "profile_steps": 2}


class Tokens(Dataset):
    """``n`` random token sequences, the same on every rank (seeded by index)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": ids, "labels": ids.clone()}


def gpt2() -> torch.nn.Module:
    """Each rank its own initial weights: rank 0's must reach every rank (the broadcast)."""
    torch.manual_seed(100 + dist.get_rank())
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


class BatchNormTokens(torch.nn.Module):
    """A model with buffers that training changes (batch-norm statistics): DDP broadcasts
    rank 0's before the first forward of each accumulation window."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(100 + dist.get_rank())
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(self.norm(self.embed(input_ids).mean(1)))
        return tf.modeling_outputs.ModelOutput(
            loss=torch.nn.functional.cross_entropy(logits, labels[:, 0]))


MODELS = {"gpt2": gpt2, "batchnorm": BatchNormTokens}


@dataclass(frozen=True)
class Run:
    """One loop.  ``policy`` None: the plain ``Accelerator`` (DDP).  ``samples``: 40 is 5
    micro-batches per rank, a partial accumulation window at each epoch's end."""

    policy: Optional[str] = None
    accum: int = 1
    clip: float = 0.0
    adam: bool = False            # AdamW and a LambdaLR scheduler, else SGD with momentum
    shard: bool = False
    samples: int = 40
    epochs: int = 1
    save_at: Optional[int] = None  # save_state after this many optimizer steps
    partition_bytes: int = SCHED["partition_bytes"]
    model: str = "gpt2"
    sync_each_batch: bool = False  # GradientAccumulationPlugin(sync_each_batch=True)

    def accumulation(self) -> dict:
        """The accelerator's accumulation keyword."""
        if self.sync_each_batch:
            return {"gradient_accumulation_plugin": GradientAccumulationPlugin(
                num_steps=self.accum, sync_each_batch=True)}
        return {"gradient_accumulation_steps": self.accum}

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def train(run: Run, out: Path, resume: Optional[Path] = None) -> dict:
    """Run the loop; returns this rank's final weights, losses, clip norms, learning rates."""
    if run.policy is None:
        acc: Accelerator = Accelerator(**run.accumulation(), cpu=True, mixed_precision=MIXED)
    else:
        from dcredit_hvd.frameworks.accelerate import DCreditAccelerator
        acc = DCreditAccelerator(**run.accumulation(), cpu=True, mixed_precision=MIXED,
                                 dcredit_policy=run.policy,
                                 dcredit={**SCHED, "shard": run.shard,
                                          "partition_bytes": run.partition_bytes})
    model = MODELS[run.model]()
    initial = _cross_rank(torch.cat([p.detach().flatten() for p in model.parameters()]))
    if run.adam:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
        sched: Any = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = None
    loader = DataLoader(Tokens(run.samples), batch_size=BATCH, shuffle=False)
    if sched is None:
        model, opt, loader = acc.prepare(model, opt, loader)
    else:
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    steps, losses, norms, lrs = 0, [], [], []
    skip = 0
    if resume is not None:
        acc.load_state(str(resume))
        steps = run.save_at or 0
        skip = steps * run.accum
    started = time.time()
    for _ in range(run.epochs):
        batches = acc.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                if run.clip and acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), run.clip)))
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()
            losses.append(float(loss.detach()))
            if acc.sync_gradients:
                steps += 1
                lrs.append(opt.param_groups[0]["lr"])
                if steps == run.save_at and resume is None:
                    acc.save_state(str(out / "checkpoint"))
    acc.wait_for_everyone()
    seconds = time.time() - started
    plain = acc.unwrap_model(model)
    weights = {k: v.detach().clone().float() for k, v in plain.state_dict().items()}
    result = {"weights": weights, "losses": losses, "norms": norms, "lrs": lrs, "steps": steps,
              "seconds": seconds, "initial_cross_rank": initial,
              "cross_rank": _cross_rank(torch.cat([w.flatten() for w in weights.values()])),
              "model": type(model).__name__, "optimizer": type(opt.optimizer).__name__,
              "distributed": callable(getattr(opt.optimizer, "synchronize", None))}
    for wrapper in getattr(acc, "dcredit_optimizers", []):
        result["plan"] = wrapper.plan is not None
        result["inner_lr"] = [g["lr"] for g in opt.optimizer.param_groups]
        wrapper.close()
    del acc, model, opt
    gc.collect()
    return result


def _cross_rank(flat: torch.Tensor) -> float:
    """Largest |this rank's values - rank 0's|, the max over the ranks."""
    root = flat.clone()
    dist.broadcast(root, src=0)
    found = (flat - root).abs().max().reshape(1).double()
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return float(found.item())


def compare(mine: dict, reference: dict) -> dict:
    """This rank's weights against the same rank's reference (Horovod's tolerance)."""
    max_abs, excess, worst = 0.0, -float("inf"), ""
    for name, ref in reference["weights"].items():
        diff = (mine["weights"][name] - ref).abs()
        over = (diff - RTOL * ref.abs() - ATOL).max().item()
        max_abs = max(max_abs, diff.max().item())
        if over > excess:
            excess, worst = over, name
    found = {k: v for k, v in mine.items() if k != "weights"}
    found.update(max_abs=max_abs, within_tolerance=excess <= 0, worst_tensor=worst,
                 reference={k: v for k, v in reference.items() if k != "weights"})
    return found


# -- the cases --------------------------------------------------------------------------------
ACCUM = dict(accum=2, epochs=2)                        # 5 micro-batches: a partial window
CLIP = dict(accum=2, epochs=2, clip=0.05, adam=True)   # every step clips (norms > 0.05)


def parity_cases() -> dict[str, tuple[Run, Run]]:
    """Case name -> (DCreditAccelerator run, Accelerator run)."""
    cases: dict[str, tuple[Run, Run]] = {}
    for policy in ("dcredit", "bytescheduler"):
        cases[f"plain-{policy}"] = (Run(policy), Run())
        cases[f"accumulate-{policy}"] = (Run(policy, **ACCUM), Run(**ACCUM))
        cases[f"clip-{policy}"] = (Run(policy, **CLIP), Run(**CLIP))
    cases["adam-scheduler-overlap-dcredit"] = (Run("dcredit", adam=True, epochs=2),
                                               Run(adam=True, epochs=2))
    cases["batchnorm-accumulate-dcredit"] = (Run("dcredit", model="batchnorm", **ACCUM),
                                             Run(model="batchnorm", **ACCUM))
    cases["clip-noaccum-dcredit"] = (Run("dcredit", clip=0.05, epochs=2),
                                     Run(clip=0.05, epochs=2))
    cases["shard-clip-dcredit"] = (Run("dcredit", shard=True, **CLIP), Run(**CLIP))
    # Every micro-batch reduced (DDP skips no_sync): the mean of the running sums is DDP's.
    cases["sync-each-batch-clip-dcredit"] = (Run("dcredit", sync_each_batch=True, **CLIP),
                                             Run(sync_each_batch=True, **CLIP))
    return cases


#: Resume cases: 8 micro-batches per rank, accumulation over 2 (4 steps), state saved after 2.
RESUME = dict(accum=2, clip=0.05, adam=True, samples=64, save_at=2)
RESUMED = {"resume-dcredit": Run("dcredit", **RESUME),
           "resume-shard-bytescheduler": Run("bytescheduler", shard=True, **RESUME)}


def phase_parity(out: Path) -> dict:
    results, references = {}, {}
    only = [n for n in os.environ.get("ACCELERATE_CASES", "").split(",") if n]
    for name, (mine, ref) in parity_cases().items():
        if only and name not in only:
            continue
        try:
            if ref.key() not in references:
                references[ref.key()] = train(ref, out / f"ref-{len(references)}")
            results[name] = compare(train(mine, out / name), references[ref.key()])
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def prepare_refusals() -> dict:
    """What ``prepare`` raised for an optimizer it cannot wrap (2 ranks)."""
    import dcredit_hvd
    from dcredit_hvd.frameworks.accelerate import DCreditAccelerator

    found = {}
    for name in ("already-distributed", "optimizer-without-model"):
        acc, model = DCreditAccelerator(cpu=True), gpt2()
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.1)
        if name == "already-distributed":
            opt = dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                   transport="torch.distributed")
        try:
            acc.prepare(model, opt) if name == "already-distributed" else acc.prepare(opt)
            found[name] = {"raised": None}
        except Exception as exc:                   # noqa: BLE001 - recorded for the test
            found[name] = {"raised": type(exc).__name__, "message": str(exc)}
        if name == "already-distributed":
            opt.close()
    return found


class _Forked(torch.nn.Module):
    """``side`` joins the output on rank 0 only; ``never`` is used by no rank."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.side, self.never = torch.nn.Linear(6, 3), torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.second(torch.relu(self.first(x)))
        return y + self.side(x) if dist.get_rank() == 0 else y


def _unowned_grads(dcredit: bool) -> list[list[Optional[list[float]]]]:
    """Each parameter's gradient after each of three backwards (synced, under ``no_sync``,
    synced), of a model prepared with an optimizer over its first layer only: its other
    layers are owned by no optimizer.  ``side`` is used on rank 0 only, ``never`` by no rank."""
    from accelerate.utils import DistributedDataParallelKwargs

    from dcredit_hvd.frameworks.accelerate import DCreditAccelerator

    torch.manual_seed(0)
    model = _Forked()
    kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    # Three backwards before the one step (the optimizer's own layer is compared elsewhere).
    acc = (DCreditAccelerator if dcredit else Accelerator)(
        cpu=True, kwargs_handlers=[kwargs], gradient_accumulation_steps=3)
    wrapped, opt = acc.prepare(model, torch.optim.SGD(model.first.parameters(), lr=0.1))
    rank, found = dist.get_rank(), []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        with acc.no_sync(wrapped) if step == 1 else contextlib.nullcontext():
            acc.backward(wrapped(x).square().mean())
        found.append([None if p.grad is None else p.grad.reshape(-1).tolist()
                      for p in list(model.parameters())[2:]])
    opt.step()
    opt.zero_grad()
    acc.free_memory()
    return found


def unowned_gradients() -> dict:
    """``DCreditAccelerator``'s gradients of parameters no optimizer owns against DDP's."""
    mine, ref = _unowned_grads(True), _unowned_grads(False)
    gaps = [max((abs(a - b) for a, b in zip(m, r)), default=0.0)
            if m is not None and r is not None else (0.0 if m is r else float("inf"))
            for ms, rs in zip(mine, ref) for m, r in zip(ms, rs)]
    nones = [[g is None for g in step] for step in mine]
    return {"max_gap": max(gaps), "none": nones, "ref_none": [[g is None for g in s] for s in ref]}


def phase_first(out: Path) -> dict:
    """Parity, and the resume cases' uninterrupted runs (checkpoint after step 2)."""
    results = phase_parity(out)
    results["refusals"] = prepare_refusals()
    try:
        results["unowned"] = unowned_gradients()
    except Exception:
        results["unowned"] = {"error": traceback.format_exc()}
    rank = dist.get_rank()
    for name, run in RESUMED.items():
        try:
            ref = train(Run(**{**asdict(run), "policy": None, "shard": False, "save_at": None}), out / "none")
            got = train(run, out / name)
            torch.save(got["weights"], out / f"{name}.full{rank}.pt")
            results[name + "-full"] = compare(got, ref)
            results[name + "-full"]["checkpoint"] = (out / name / "checkpoint").is_dir()
        except Exception:
            results[name + "-full"] = {"error": traceback.format_exc()}
    return results


#: bf16 autocast: the parameters, gradients and their reduction stay float32.
BF16 = {"plain-dcredit": (Run("dcredit"), Run()),
        "accumulate-clip-bytescheduler": (Run("bytescheduler", **CLIP), Run(**CLIP)),
        "shard-adam-dcredit": (Run("dcredit", shard=True, adam=True, accum=2),
                               Run(adam=True, accum=2))}


def phase_bf16(out: Path) -> dict:
    """A few parity cases under bf16 autocast (both accelerators)."""
    results = {}
    for name, (mine, ref) in BF16.items():
        try:
            results[name] = compare(train(mine, out / name), train(ref, out / "ref"))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def phase_second(out: Path) -> dict:
    """A new job: each checkpoint loaded and trained on; then parity again."""
    results = {}
    rank = dist.get_rank()
    for name, run in RESUMED.items():
        try:
            got = train(run, out / name, resume=out / name / "checkpoint")
            full = {"weights": torch.load(out / f"{name}.full{rank}.pt")}
            results[name] = compare(got, full)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    results.update(phase_parity(out))
    return results


REFUSED = {"fp16": dict(mixed_precision="fp16"), "dynamo": dict(dynamo_backend="eager"),
           "horovodrun": {}, "transport-horovod": dict(dcredit={"transport": "horovod"}),
           "unknown-keyword": dict(dcredit={"partition": 1}),
           "sets-model": dict(dcredit={"model": None}),
           "shard-sync-each-batch": dict(
               dcredit={"shard": True},
               gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2,
                                                                       sync_each_batch=True))}


def refuse(name: str) -> dict:
    """One refused setup: what ``DCreditAccelerator(...)`` raised (one process)."""
    from dcredit_hvd.frameworks.accelerate import DCreditAccelerator

    if name == "horovodrun":
        os.environ["HOROVOD_SIZE"] = "2"           # as horovodrun sets it
    try:
        DCreditAccelerator(cpu=True, **REFUSED[name])
        return {"raised": None}
    except Exception as exc:                       # noqa: BLE001 - recorded for the test
        return {"raised": type(exc).__name__, "message": str(exc)}
    finally:
        os.environ.pop("HOROVOD_SIZE", None)


if __name__ == "__main__":
    OUT, PHASE = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    tf.logging.set_verbosity_error()
    if PHASE == "refuse":      # names in order; fp16 and dynamo each need a fresh process
        for name in sys.argv[3].split(","):
            (OUT / f"refuse-{name}.json").write_text(json.dumps(refuse(name)))
        sys.exit(0)
    setup = Accelerator(cpu=True, mixed_precision=MIXED)    # initialises the process group
    begun = time.time()
    found = {"first": phase_first, "second": phase_second, "bf16": phase_bf16}[PHASE](OUT)
    launcher = "accelerate" if "ACCELERATE_USE_CPU" in os.environ else "torchrun"
    (OUT / f"{PHASE}.rank{dist.get_rank()}.json").write_text(json.dumps(
        {"cases": found, "seconds": time.time() - begun, "launcher": launcher,
         "distributed_type": str(setup.distributed_type),
         "world": dist.get_world_size(), "mixed_precision": str(setup.mixed_precision)},
        indent=1))
    dist.barrier()
    dist.destroy_process_group()
