"""The Hugging Face Trainer cases of ``test_hf.py``, run on every rank of ONE launch of
``torchrun --standalone --nproc-per-node 2`` (Gloo, CPU): many short trainings in one process, so
that the process group, torch and transformers are set up once.

    python hf_cases.py OUT_DIR main     # parity with transformers.Trainer (DDP); full runs
                                        # that save a checkpoint at step 4
    python hf_cases.py OUT_DIR resume   # a NEW launch: resume those checkpoints; then a rank
                                        # dies (``$FAILURE_PID_DIR``, ``unnoticed.sh``)

Each case trains a tiny model built in code (GPT-2, BERT, a CNN returning ``{"loss": ...}``)
on random tensors for a few steps with ``DCreditTrainer`` and with the reference it is compared
with: the plain ``transformers.Trainer`` (DDP) with the same arguments, or the run that never
stopped.  Rank 0 writes ``OUT_DIR/<phase>.json``: per case the largest weight difference, the
logged losses (and eval losses, grad norms) of both runs, and whether the ranks' weights agree.
"""
from __future__ import annotations

import copy
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn
from torch.utils.data import Dataset

from dcredit_hvd.frameworks.hf import DCreditTrainer

VOCAB, SEQ, BATCH, IMAGE = 96, 12, 4, 16
RTOL, ATOL = 1e-5, 1e-6
#: Scheduler settings every case uses: small blocks (several per tensor), ``dcredit``'s plan
#: installed at step 3 so the plan, not only its profiling, runs in 6 steps.
SCHED = {"partition_bytes": 4096, "credit_bytes": 16384, "profile_warmup": 1,
         "profile_steps": 2}


# -- data and models --------------------------------------------------------------------------
class RandomSamples(Dataset):
    """``n`` samples of random tensors, the same on every rank (seeded by index)."""

    def __init__(self, n: int, make: Callable[[torch.Generator], dict]) -> None:
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.make(torch.Generator().manual_seed(1000 + i))


def _tokens(gen: torch.Generator) -> dict:
    ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _classified(gen: torch.Generator) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=gen),
            "labels": torch.randint(0, 3, (), generator=gen)}


def _images(gen: torch.Generator) -> dict:
    return {"pixel_values": torch.randn(3, IMAGE, IMAGE, generator=gen),
            "labels": torch.randint(0, 5, (), generator=gen)}


class SmallCNN(nn.Module):
    """A plain torch module for the Trainer: ``forward(**batch)`` returns ``{"loss", "logits"}``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(64, 5)

    def forward(self, pixel_values: torch.Tensor, labels: Optional[torch.Tensor] = None) -> dict:
        logits = self.head(self.features(pixel_values).flatten(1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def gpt2() -> nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0))


def bert() -> nn.Module:
    return tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], dict]]] = {
    "gpt2": (gpt2, _tokens), "bert": (bert, _classified), "cnn": (SmallCNN, _images)}


# -- one training ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One ``train()``: the model, the ``TrainingArguments`` beyond the common ones, the trainer
    class and its dcredit keywords.  ``samples``: dataset length (40: 5 micro-batches per rank
    per epoch, so accumulation over 2 leaves a partial window at each epoch's end)."""

    model: str
    args: dict = field(default_factory=dict)
    dcredit: Optional[dict] = None          # None: transformers.Trainer (DDP)
    samples: int = 48
    user_optimizer: bool = False            # optimizers=(SGD, StepLR) passed in

    def key(self) -> str:
        return json.dumps([self.model, self.args, self.dcredit, self.samples,
                           self.user_optimizer], sort_keys=True)


def _arguments(out: Path, extra: dict) -> tf.TrainingArguments:
    base = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=BATCH,
                per_device_eval_batch_size=BATCH, learning_rate=5e-3, logging_steps=1,
                report_to=[], use_cpu=True, dataloader_num_workers=0, save_strategy="no",
                seed=0, disable_tqdm=True, log_level="error", log_level_replica="error")
    base.update(copy.deepcopy(extra))     # the Trainer writes into accelerator_config's dicts
    return tf.TrainingArguments(**base)


class SubstepGrads(tf.TrainerCallback):
    """The gradients' norm after each micro-batch that does not step (``on_substep_end``):
    reduced there only under ``sync_each_batch``, DDP's and ours alike."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_substep_end(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        grads = [p.grad.detach().float().flatten() for p in model.parameters()
                 if p.grad is not None]
        self.norms.append(torch.cat(grads).norm().item() if grads else 0.0)


def train(run: Run, out: Path, resume: Optional[str] = None,
          callbacks: tuple = ()) -> dict:
    """Train ``run``; returns rank 0's final weights, the log history, the seconds taken and
    the largest difference between this rank's weights and rank 0's (on every rank)."""
    make_model, make_sample = MODELS[run.model]
    torch.manual_seed(0)
    model = make_model()
    args = _arguments(out, run.args)
    substeps = SubstepGrads()
    kwargs: dict[str, Any] = dict(model=model, args=args,
                                  train_dataset=RandomSamples(run.samples, make_sample),
                                  callbacks=[*callbacks, substeps])
    if args.eval_strategy != "no":
        kwargs["eval_dataset"] = RandomSamples(16, make_sample)
    if run.user_optimizer:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        kwargs["optimizers"] = (opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    if run.dcredit is None:
        trainer: tf.Trainer = tf.Trainer(**kwargs)
    else:
        settings = dict(run.dcredit)
        trainer = DCreditTrainer(**kwargs, dcredit_policy=settings.pop("policy"),
                                 dcredit_overlap=settings.pop("overlap", False),
                                 dcredit_model=settings.pop("model", True),
                                 dcredit={**SCHED, **settings})
    started = time.time()
    trainer.train(resume_from_checkpoint=resume)
    seconds = time.time() - started
    weights = {k: v.detach().clone().float() for k, v in trainer.model.state_dict().items()}
    result = {"weights": weights, "history": trainer.state.log_history, "seconds": seconds,
              "substep_grad_norm": substeps.norms,
              "cross_rank": _cross_rank_difference(weights),
              "wrapped": type(trainer.model_wrapped).__name__,
              "optimizer": type(trainer.optimizer).__name__}
    if isinstance(trainer, DCreditTrainer) and trainer.dcredit_optimizer is not None:
        plan = trainer.dcredit_optimizer.plan
        result["plan"] = plan is not None
        result["lr_seen"] = [g["lr"] for g in trainer.dcredit_optimizer.param_groups]
        trainer.dcredit_optimizer.close()
    del trainer
    gc.collect()
    return result


def _cross_rank_difference(weights: dict) -> float:
    """Largest |this rank's weight - rank 0's| over every tensor, the max over the ranks."""
    flat = torch.cat([w.flatten() for w in weights.values()])
    root = flat.clone()
    dist.broadcast(root, src=0)
    return _max_over_ranks((flat - root).abs().max().item())


def _max_over_ranks(value: float) -> float:
    found = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return float(found.item())


def compare(mine: dict, reference: dict) -> dict:
    """Weight and log parity of ``mine`` against ``reference`` (Horovod's tolerance), each
    rank's weights against the same rank's reference, the worst over the ranks."""
    max_abs, excess, worst = 0.0, -float("inf"), ""
    for name, ref in reference["weights"].items():
        got = mine["weights"][name]
        diff = (got - ref).abs()
        over = (diff - RTOL * ref.abs() - ATOL).max().item()
        max_abs = max(max_abs, diff.max().item())
        if over > excess:
            excess, worst = over, name
    max_abs, excess = _max_over_ranks(max_abs), _max_over_ranks(excess)
    series = {}
    for key in ("loss", "eval_loss", "grad_norm", "learning_rate"):
        series[key] = ([h[key] for h in mine["history"] if key in h and "train_runtime" not in h],
                       [h[key] for h in reference["history"]
                        if key in h and "train_runtime" not in h])
    series["substep_grad_norm"] = (mine.get("substep_grad_norm", []),
                                   reference.get("substep_grad_norm", []))
    return {"max_abs": max_abs, "within_tolerance": excess <= 0, "worst_tensor": worst,
            "series": series, "cross_rank": mine["cross_rank"],
            "seconds": mine["seconds"], "reference_seconds": reference["seconds"],
            "wrapped": mine["wrapped"], "reference_wrapped": reference["wrapped"],
            "plan": mine.get("plan"), "lr_seen": mine.get("lr_seen")}


# -- the cases --------------------------------------------------------------------------------
CLIP = dict(max_grad_norm=0.05)            # small enough that every step clips
FEATURES = dict(gradient_accumulation_steps=2, max_grad_norm=0.05, eval_strategy="steps",
                eval_steps=2, lr_scheduler_type="cosine", warmup_steps=2)
NOCLIP = dict(max_grad_norm=0.0)


def main_cases() -> dict[str, tuple[Run, Run]]:
    """Case name -> (DCreditTrainer run, transformers.Trainer run)."""
    cases: dict[str, tuple[Run, Run]] = {}
    for model in ("gpt2", "bert"):
        for policy in ("dcredit", "bytescheduler", "wfbp"):
            cases[f"{model}-{policy}"] = (Run(model, {}, {"policy": policy}), Run(model))
            cases[f"{model}-{policy}-overlap"] = (
                Run(model, NOCLIP, {"policy": policy, "overlap": True}), Run(model, NOCLIP))
    cases["gpt2-wfbp-nomodel"] = (Run("gpt2", {}, {"policy": "wfbp", "model": False}),
                                  Run("gpt2"))
    cases["cnn-dcredit"] = (Run("cnn", {}, {"policy": "dcredit"}), Run("cnn"))
    cases["cnn-wfbp-overlap"] = (Run("cnn", NOCLIP, {"policy": "wfbp", "overlap": True}),
                                 Run("cnn", NOCLIP))
    cases["gpt2-clip"] = (Run("gpt2", CLIP, {"policy": "bytescheduler"}), Run("gpt2", CLIP))
    for policy in ("dcredit", "wfbp"):
        cases[f"gpt2-accum-clip-eval-cosine-{policy}"] = (
            Run("gpt2", FEATURES, {"policy": policy}, samples=40), Run("gpt2", FEATURES,
                                                                        samples=40))
    # accelerator_config's sync_each_batch: DDP reduces every micro-batch, and so do we
    synced = dict(FEATURES, accelerator_config={"gradient_accumulation_kwargs":
                                                {"sync_each_batch": True}})
    cases["gpt2-sync-each-batch-accum-clip-dcredit"] = (
        Run("gpt2", synced, {"policy": "dcredit"}, samples=40), Run("gpt2", synced, samples=40))
    cases["gpt2-bf16"] = (Run("gpt2", {"bf16": True}, {"policy": "dcredit"}),
                          Run("gpt2", {"bf16": True}))
    cases["gpt2-bf16-overlap"] = (
        Run("gpt2", {"bf16": True, **NOCLIP}, {"policy": "bytescheduler", "overlap": True}),
        Run("gpt2", {"bf16": True, **NOCLIP}))
    # shard=True: clipping by the global norm (SGD: AdamW turns the rounding noise of a zero
    # gradient into full steps, test_sharded.py), and AdamW without clipping.
    cases["cnn-shard-clip"] = (
        Run("cnn", CLIP, {"policy": "bytescheduler", "shard": True}, user_optimizer=True),
        Run("cnn", CLIP, user_optimizer=True))
    cases["gpt2-shard-dcredit"] = (Run("gpt2", NOCLIP, {"policy": "dcredit", "shard": True}),
                                   Run("gpt2", NOCLIP))
    cases["bert-user-optimizer-steplr"] = (
        Run("bert", {}, {"policy": "wfbp"}, user_optimizer=True),
        Run("bert", {}, user_optimizer=True))
    return cases


#: Resume cases: the full run (8 steps, a checkpoint at step 4, in the ``main`` launch).
RESUMED = {
    "resume-accum-clip-eval": Run("gpt2", dict(FEATURES, max_steps=8, save_strategy="steps",
                                               save_steps=4), {"policy": "dcredit"}, samples=40),
    "resume-overlap": Run("bert", dict(NOCLIP, max_steps=8, save_strategy="steps", save_steps=4),
                          {"policy": "bytescheduler", "overlap": True}),
    # shard=True: the checkpoint holds the full AdamW state (several blocks per parameter)
    "resume-shard": Run("gpt2", dict(NOCLIP, max_steps=8, save_strategy="steps", save_steps=4),
                        {"policy": "bytescheduler", "shard": True}),
}


#: Setups DCreditTrainer must refuse with a clear error: name -> (TrainingArguments extras,
#: DCreditTrainer keywords, passes a distributed optimizer in optimizers=).
REFUSED: dict[str, tuple[dict, dict, bool]] = {
    "overlap-with-clipping": ({}, {"dcredit_overlap": True}, False),
    "torch-compile": ({"torch_compile": True}, {}, False),
    "transport-horovod": ({}, {"dcredit": {"transport": "horovod"}}, False),
    "dcredit-sets-model": ({}, {"dcredit": {"model": None}}, False),
    "unknown-keyword": ({}, {"dcredit": {"partition": 1}}, False),
    "already-distributed": ({}, {}, True),
    "shard-sync-each-batch": ({"accelerator_config": {"gradient_accumulation_kwargs":
                                                      {"sync_each_batch": True}}},
                              {"dcredit": {"shard": True}}, False),
}


def refusals(out: Path) -> dict:
    """What each refused setup raised (type and message), at construction or at ``train()``."""
    import dcredit_hvd

    found = {}
    for name, (extra, keywords, distributed) in REFUSED.items():
        torch.manual_seed(0)
        model = gpt2()
        kwargs: dict[str, Any] = {}
        if distributed:
            kwargs["optimizers"] = (dcredit_hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=model.named_parameters()), None)
        try:
            trainer = DCreditTrainer(model=model, args=_arguments(out / name, extra),
                                     train_dataset=RandomSamples(16, _tokens), **kwargs,
                                     **keywords)
            trainer.train()
            found[name] = {"raised": None}
        except Exception as exc:                       # noqa: BLE001 - recorded for the test
            found[name] = {"raised": type(exc).__name__, "message": str(exc)}
        if distributed:
            kwargs["optimizers"][0].close()
        gc.collect()
    return found


def phase_main(out: Path) -> dict:
    results, references = {}, {}
    only = [n for n in os.environ.get("HF_CASES", "").split(",") if n]
    for name, (mine, ref) in main_cases().items():
        if only and name not in only:
            continue
        try:
            if ref.key() not in references:
                references[ref.key()] = train(ref, out / "runs" / f"ref-{len(references)}")
            got = train(mine, out / "runs" / name)
            results[name] = compare(got, references[ref.key()])
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    for name, run in RESUMED.items():
        if only and name not in only:
            continue
        try:
            got = train(run, out / name)
            torch.save(got["weights"], out / f"{name}.full{dist.get_rank()}.pt")
            if dist.get_rank() == 0:
                (out / f"{name}.full.json").write_text(json.dumps(got["history"]))
            results[name + "-full"] = {"seconds": got["seconds"],
                                       "checkpoint": (out / name / "checkpoint-4").is_dir()}
        except Exception:
            results[name + "-full"] = {"error": traceback.format_exc()}
    if not only or "refusals" in only:
        results["refusals"] = refusals(out / "refused")
    return results


def phase_resume(out: Path) -> dict:
    results = {}
    for name, run in RESUMED.items():
        try:
            got = train(run, out / name, resume=str(out / name / "checkpoint-4"))
            full = {"weights": torch.load(out / f"{name}.full{dist.get_rank()}.pt"),
                    "history": json.loads((out / f"{name}.full.json").read_text()),
                    "seconds": 0.0, "wrapped": ""}
            # only the steps after the checkpoint exist in the resumed run's log
            full["history"] = [h for h in full["history"] if h.get("step", 0) > 4]
            got["history"] = [h for h in got["history"] if h.get("step", 0) > 4]
            results[name] = compare(got, full)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def phase_death(out: Path, mode: str) -> None:
    """Rank 1 dies (``os._exit``/SIGKILL) at step 3 of a long training; rank 0 must raise
    ``PeerLostError`` naming rank 1 and exit within seconds (``test_hf.py`` checks)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs" / "failure"))
    from failure_worker import fail, record_pid, record_raises

    rank = dist.get_rank()
    record_pid(rank)
    record_raises(f"raised_at{rank}", with_message=True)

    class Die(tf.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if rank == 1 and state.global_step == 3:
                fail(mode, state.global_step)

    run = Run("gpt2", dict(max_steps=100_000), {"policy": "dcredit"})
    train(run, out / "death", callbacks=(Die(),))
    print(f"rank {rank} still training after its peer died", flush=True)


if __name__ == "__main__":
    OUT, PHASE = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    assert _arguments(OUT / "setup", {}).device    # Accelerate initialises the process group
    tf.logging.set_verbosity_error()
    started = time.time()
    found = phase_main(OUT) if PHASE == "main" else phase_resume(OUT)
    if dist.get_rank() == 0:
        (OUT / f"{PHASE}.json").write_text(json.dumps(
            {"cases": found, "seconds": time.time() - started}, indent=1))
    dist.barrier()
    if PHASE == "resume" and len(sys.argv) > 3:
        phase_death(OUT, sys.argv[3])
    dist.destroy_process_group()
