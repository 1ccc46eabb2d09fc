"""The Lightning cases of ``tests/frameworks/test_lightning.py``: real ``Trainer.fit`` runs on
two ranks, ``strategy="dcredit"`` beside Lightning's own ``strategy="ddp"``.

``torchrun --standalone --nproc-per-node 2 lightning_cases.py GROUP OUT`` (GROUP ``main``,
``resume``), or ``horovodrun -np 2 -H localhost:2 --gloo python lightning_cases.py horovod OUT``.
Many fits run in one launch (the process group is set up once): each case fits a reference and
the dcredit variants on the same data from the same initial weights, and every rank writes
``OUT/<group>.rank<r>.json``: per case the largest absolute difference of every parameter and
buffer from the reference on this rank, whether they are within Horovod's tolerance, and the
logged values (losses, validation losses, learning rates) of both.  The test asserts on it.

* ``main`` (torchrun): the parity matrix (a small CNN with batch norm, a tiny GPT-2, a tiny BERT;
  every policy, with and without overlapped updates), the features (accumulation, clipping,
  bf16, a GAN in manual optimization, validation between steps, an LR scheduler with
  ``LearningRateMonitor``), the refusals, and the first half of the resume case: an
  uninterrupted fit whose ``ModelCheckpoint`` wrote the checkpoint of step ``RESUME_AT``.  It also
  saves the DDP references of the ``horovod`` cases (``OUT/ref-<case>.rank<r>.pt``).
* ``resume`` (torchrun, a new launch): ``fit(ckpt_path=...)`` from that checkpoint, compared
  with the uninterrupted fit; then rank 1 dies mid-fit (``os._exit``, hidden from torchrun by
  ``test_lightning.py``'s worker wrapper) and rank 0 must raise ``PeerLostError`` naming it.
* ``horovod``: a subset on the Horovod transport, compared with ``main``'s DDP references.
* ``unified`` (torchrun): a part of the matrix and the features on the unified ``lightning``
  package (``lightning.pytorch``), against its own ``strategy="ddp"``; ``pytorch_lightning`` is
  never imported in that launch.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dcredit_hvd

#: Group ``unified`` runs on the unified ``lightning`` package (``lightning.pytorch``) and never
#: imports ``pytorch_lightning``; every other group runs on ``pytorch_lightning``.
UNIFIED = len(sys.argv) > 1 and sys.argv[1] == "unified"
pl: Any = importlib.import_module("lightning.pytorch" if UNIFIED else "pytorch_lightning")
Callback, LearningRateMonitor, ModelCheckpoint = (
    pl.callbacks.Callback, pl.callbacks.LearningRateMonitor, pl.callbacks.ModelCheckpoint)
Logger = pl.loggers.Logger
#: Importing the entry point registers strategy="dcredit" in that package's registry.
DCreditStrategy = importlib.import_module(
    "dcredit_hvd.frameworks." + ("lightning" if UNIFIED else "pytorch_lightning")).DCreditStrategy

#: The case group and the output folder (``main``'s arguments).
GROUP, OUT = "", Path(".")
RTOL, ATOL = 1e-5, 1e-6          # Horovod's tests' float32 tolerance
BATCH, STEPS = 4, 6              # per rank; optimizer steps per fit
RESUME_AT, RESUME_STEPS = 4, 8   # checkpoint at step 4 of an 8-step fit (2 epochs of 4)
POLICIES = ("dcredit", "bytescheduler", "wfbp")
#: The features run again under ``horovodrun`` (against ``main``'s DDP references).
HOROVOD_CASES = ("accumulate", "clip-norm", "validation", "lr-scheduler", "gan")
#: ``dcredit`` plans after 1 + 2 steps here, so the plan runs for the rest of each fit.
DCREDIT = dict(profile_warmup=1, profile_steps=2, partition_bytes=2048)

torch.set_num_threads(1)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*is deprecated.*")


def rank() -> int:
    return int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))


# -- models -----------------------------------------------------------------------------------
class CNN(nn.Module):
    """Two convolutions with batch norm (buffers: DDP broadcasts rank 0's), a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.head = nn.Conv2d(8, 16, 3, padding=1), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(F.max_pool2d(x, 2)))
        return self.head(x.mean(dim=(2, 3)))


def gpt2() -> nn.Module:
    import transformers as tf
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def bert() -> nn.Module:
    import transformers as tf
    return tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def images(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=gen),
                         torch.randint(0, 5, (n,), generator=gen))


def tokens(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(8)
    return TensorDataset(torch.randint(0, 64, (n, 12), generator=gen),
                         torch.randint(0, 3, (n,), generator=gen))


def cnn_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(net(x), y)


def gpt2_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    ids, _ = batch
    return net(input_ids=ids, labels=ids).loss


def bert_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    ids, labels = batch
    return net(input_ids=ids, labels=labels).loss


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], TensorDataset], Callable]] = {
    "cnn": (CNN, images, cnn_loss), "gpt2": (gpt2, tokens, gpt2_loss),
    "bert": (bert, tokens, bert_loss)}


class Module(pl.LightningModule):
    """One network, its loss, an optimizer (SGD with momentum, or AdamW), optionally an LR
    scheduler stepping every step; logs ``train_loss`` (and ``val_loss``, synced)."""

    def __init__(self, model: str, optimizer: str = "sgd", scheduler: bool = False) -> None:
        super().__init__()
        build, _, self.loss_fn = MODELS[model]
        torch.manual_seed(100 + rank())       # other weights on each rank: rank 0's must win
        self.net = build()
        self.optimizer, self.scheduler = optimizer, scheduler

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss_fn(self.net, batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss_fn(self.net, batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=0.01,
                                                           weight_decay=0.01)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GAN(pl.LightningModule):
    """Manual optimization, two optimizers (Lightning's GAN pattern with ``toggle_optimizer``),
    the discriminator's gradients clipped by hand (``self.clip_gradients``)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(100 + rank())
        self.gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3 * 8 * 8))
        self.disc = nn.Sequential(nn.Linear(3 * 8 * 8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real = batch[0].flatten(1)
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 8, generator=torch.Generator().manual_seed(batch_idx))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.disc(self.gen(z)), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        fake = self.gen(z).detach()
        d_loss = (F.binary_cross_entropy_with_logits(self.disc(real), ones)
                  + F.binary_cross_entropy_with_logits(self.disc(fake), zeros)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log("train_loss", d_loss + g_loss)

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.gen.parameters(), lr=0.01),
                torch.optim.SGD(self.disc.parameters(), lr=0.05, momentum=0.9))


class ManualAccumulation(Module):
    """Manual optimization accumulating 2 micro-batches per ``step()``
    (``DCreditStrategy(backward_passes_per_step=2)``)."""

    def __init__(self) -> None:
        super().__init__("cnn")
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        loss = self.loss_fn(self.net, batch)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss)


# -- one fit ----------------------------------------------------------------------------------
class Memory(Logger):
    """Keeps what ``LearningRateMonitor`` logs (it logs to loggers, not to callback_metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[str, list[float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        for name, value in metrics.items():
            if name.startswith("lr-"):
                self.logged.setdefault(name, []).append(float(value))


class Record(Callback):
    """What was logged after each training step and each validation."""

    def __init__(self) -> None:
        self.logged: dict[str, list[float]] = {}

    def _take(self, trainer: pl.Trainer, names: tuple[str, ...]) -> None:
        for name, value in trainer.callback_metrics.items():
            if name.startswith(names):
                self.logged.setdefault(name, []).append(float(value))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._take(trainer, ("train_loss", "lr-"))

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._take(trainer, ("val_loss",))


def fit(module_fn: Callable[[], pl.LightningModule], strategy: Any, model: str = "cnn",
        steps: int = STEPS, batches: Optional[int] = None, callbacks: tuple = (),
        ckpt_path: Optional[str] = None, **trainer_kwargs: Any) -> tuple[dict, dict]:
    """One ``Trainer.fit`` on 2 ranks: the final state (parameters and buffers) on this rank,
    and what was logged.  ``batches`` per rank per epoch (default: one epoch of ``steps``)."""
    pl.seed_everything(1234, verbose=False)
    module = module_fn()
    record = Record()
    data = MODELS[model][1](2 * BATCH * (batches or steps))
    val = MODELS[model][1](2 * BATCH * 2)
    settings = dict(accelerator="cpu", devices=2, max_steps=steps, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                    deterministic=True)
    trainer = pl.Trainer(strategy=strategy, callbacks=[record, *callbacks],
                         **{**settings, **trainer_kwargs})
    trainer.fit(module, DataLoader(data, batch_size=BATCH),
                DataLoader(val, batch_size=BATCH), ckpt_path=ckpt_path)
    state = {k: v.detach().clone().float() for k, v in module.state_dict().items()}
    if isinstance(trainer.logger, Memory):
        record.logged.update(trainer.logger.logged)
    return state, record.logged


def compare(state: dict, ref: dict, logged: dict, ref_logged: dict) -> dict:
    """Largest differences from the reference, and whether all are within tolerance."""
    weights = max((v - ref[k]).abs().max().item() for k, v in state.items())
    close = all(torch.allclose(v, ref[k], rtol=RTOL, atol=ATOL) for k, v in state.items())
    keys_match = set(logged) == set(ref_logged) and all(
        len(logged[k]) == len(ref_logged[k]) for k in logged)
    logs = max((abs(a - b) for k in logged if k in ref_logged
                for a, b in zip(logged[k], ref_logged[k])), default=0.0)
    logs_close = keys_match and all(
        math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)
        for k in logged for a, b in zip(logged[k], ref_logged[k]))
    return {"max_abs_diff": weights, "weights_close": close, "log_max_abs_diff": logs,
            "logs_close": logs_close, "logged": logged, "ref_logged": ref_logged,
            "names_match": set(state) == set(ref)}


RESULTS: dict[str, Any] = {}


def save() -> None:
    path = OUT / f"{GROUP}.rank{rank()}.json"
    path.write_text(json.dumps(RESULTS, indent=1, default=str))


def case(name: str, run: Callable[[], dict]) -> None:
    """Run one case; its result (or the error) goes to the JSON at once."""
    started = time.monotonic()
    try:
        result = run()
    except Exception as exc:                          # recorded: the test names it
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    result["seconds"] = round(time.monotonic() - started, 2)
    RESULTS[name] = result
    save()


def dcredit(policy: str = "dcredit", overlap: bool = True, **kwargs: Any) -> DCreditStrategy:
    extra = dict(DCREDIT) if policy == "dcredit" else {}
    return DCreditStrategy(policy=policy, model_overlap=overlap, **extra, **kwargs)


def against(ref: tuple[dict, dict], *args: Any, **kwargs: Any) -> dict:
    state, logged = fit(*args, **kwargs)
    return compare(state, ref[0], logged, ref[1])


# -- the groups -------------------------------------------------------------------------------
def parity_matrix(models: tuple[tuple[str, str], ...] = (
        ("cnn", "sgd"), ("gpt2", "adamw"), ("bert", "adamw"))) -> None:
    """Every model x policy x overlap against DDP."""
    for model, optimizer in models:
        def module(model: str = model, optimizer: str = optimizer) -> pl.LightningModule:
            return Module(model, optimizer)
        ref = fit(module, "ddp", model)
        for policy in POLICIES:
            for overlap in (True, False):
                label = f"{model}-{policy}-{'overlap' if overlap else 'sync'}"
                case(label, lambda p=policy, o=overlap, m=module, mo=model, r=ref:
                     against(r, m, dcredit(p, o), mo))


FEATURES: dict[str, dict] = {
    # accumulation over 2 micro-batches, 5 per epoch (each epoch's last window is 1 batch)
    "accumulate": dict(batches=5, steps=6, accumulate_grad_batches=2),
    "clip-norm": dict(gradient_clip_val=0.05),
    "clip-value": dict(gradient_clip_val=0.002, gradient_clip_algorithm="value"),
    "bf16": dict(precision="bf16-mixed"),
    "validation": dict(val_check_interval=2, limit_val_batches=2),
}


def features(strategy: Callable[..., Any] = lambda **kw: dcredit("dcredit", True, **kw),
             names: tuple[str, ...] = tuple(FEATURES), prefix: str = "",
             refs: Optional[dict] = None) -> None:
    """Each feature against its DDP fit (``refs``: references loaded from ``main``)."""
    for name in (n for n in names if n in FEATURES):
        kwargs = FEATURES[name]

        def run(kwargs: dict = kwargs, name: str = name) -> dict:
            ref = refs[name] if refs is not None else fit(lambda: Module("cnn"), "ddp", **kwargs)
            if refs is None and GROUP == "main":
                keep_reference(name, ref)
            return against(ref, lambda: Module("cnn"), strategy(), **kwargs)
        case(prefix + name, run)
    special: dict[str, tuple[Callable, str, dict]] = {   # module, DDP reference, settings
        "lr-scheduler": (lambda: Module("cnn", "sgd", scheduler=True), "ddp", {}),
        # DDP needs find_unused_parameters with toggle_optimizer; we do not
        "gan": (GAN, "ddp_find_unused_parameters_true", {}),
        "manual-accumulate": (ManualAccumulation, "ddp", {"backward_passes_per_step": 2})}
    for name, (module, reference, settings) in special.items():
        if name not in names:
            continue

        def run_special(module: Callable = module, name: str = name, reference: str = reference,
                        settings: dict = settings) -> dict:
            def extra() -> dict:
                if name != "lr-scheduler":
                    return {}
                return dict(callbacks=(LearningRateMonitor("step"),), logger=Memory(),
                            log_every_n_steps=1)
            ref = refs[name] if refs is not None else fit(module, reference, **extra())
            if refs is None and GROUP == "main":
                keep_reference(name, ref)
            return against(ref, module, strategy(**settings), **extra())
        case(prefix + name, run_special)


def keep_reference(name: str, ref: tuple[dict, dict]) -> None:
    torch.save(ref, OUT / f"ref-{name}.rank{rank()}.pt")


def refusals() -> None:
    """What cannot work is refused with an error that says what to do."""
    def wrapped_by_user() -> dict:
        class Wrapped(Module):
            def configure_optimizers(self) -> Any:
                return dcredit_hvd.DistributedOptimizer(
                    torch.optim.SGD(self.parameters(), lr=0.1),
                    named_parameters=self.named_parameters())
        try:
            fit(lambda: Wrapped("cnn"), dcredit(), steps=1)
        except TypeError as exc:
            return {"raised": str(exc)}
        return {"raised": None}

    def unknown_argument() -> dict:
        try:
            DCreditStrategy(find_unused_parameters=True)
        except TypeError as exc:
            return {"raised": str(exc)}
        return {"raised": None}
    def passes_in_automatic() -> dict:
        try:
            fit(lambda: Module("cnn"), dcredit(backward_passes_per_step=2), steps=1)
        except ValueError as exc:
            return {"raised": str(exc)}
        return {"raised": None}
    case("refuse-wrapped-optimizer", wrapped_by_user)
    case("refuse-passes-without-accumulation", passes_in_automatic)
    case("refuse-ddp-argument", unknown_argument)


def resume_first_half() -> None:
    """Uninterrupted 8-step fit (overlapped updates, AdamW, an LR scheduler) that wrote the
    checkpoint of step 4, and its DDP reference."""
    ckpt_dir = OUT / "checkpoints"

    def module() -> pl.LightningModule:
        return Module("cnn", "adamw", scheduler=True)

    def run() -> dict:
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=RESUME_AT,
                                     save_top_k=-1, filename="{step}")
        state, logged = fit(module, dcredit(), steps=RESUME_STEPS, batches=4,
                            callbacks=(checkpoint,), enable_checkpointing=True)
        ref = fit(module, "ddp", steps=RESUME_STEPS, batches=4)
        torch.save((state, logged), OUT / f"uninterrupted.rank{rank()}.pt")
        result = compare(state, ref[0], logged, ref[1])
        result["checkpoints"] = sorted(p.name for p in ckpt_dir.glob("*.ckpt"))
        return result
    case("resume-uninterrupted", run)


def resume_second_half() -> None:
    def run() -> dict:
        ckpt = OUT / "checkpoints" / f"step={RESUME_AT}.ckpt"
        ref = torch.load(OUT / f"uninterrupted.rank{rank()}.pt")
        state, logged = fit(lambda: Module("cnn", "adamw", scheduler=True), dcredit(),
                            steps=RESUME_STEPS, batches=4, ckpt_path=str(ckpt),
                            enable_checkpointing=False)
        # the resumed fit logs steps 5..8 only: compare them with the last 4 of the reference
        tail = {k: v[-len(logged.get(k, [])):] if logged.get(k) else v
                for k, v in ref[1].items()}
        return compare(state, ref[0], logged, tail)
    case("resume-new-launch", run)


def sharded_resume() -> None:
    """``shard=True`` (AdamW, an LR scheduler; clipping is ``shard-clip-norm``'s, with SGD: the
    CNN's conv biases before batch norm have gradients of rounding noise, which AdamW turns into
    full steps, so a one-ulp clipping difference shows): an 8-step fit whose
    ``ModelCheckpoint`` wrote step 4, then a new ``Trainer`` resumed from that file; both end on
    DDP's weights, and the file holds the full optimizer state (every parameter's, torch's
    form), so a plain ``torch.optim.AdamW`` loads it."""
    ckpt_dir = OUT / "checkpoints-shard"

    def module() -> pl.LightningModule:
        return Module("cnn", "adamw", scheduler=True)

    def strategy() -> DCreditStrategy:
        return dcredit(shard=True)

    clip: dict = {}
    refs: list[tuple[dict, dict]] = []

    def uninterrupted() -> dict:
        refs.append(fit(module, "ddp", steps=RESUME_STEPS, batches=4, **clip))
        ref = refs[0]
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=RESUME_AT,
                                     save_top_k=-1, filename="{step}")
        state, logged = fit(module, strategy(), steps=RESUME_STEPS, batches=4,
                            callbacks=(checkpoint,), enable_checkpointing=True, **clip)
        result = compare(state, ref[0], logged, ref[1])
        saved = torch.load(ckpt_dir / f"step={RESUME_AT}.ckpt", weights_only=False)
        opt_state = saved["optimizer_states"][0]
        plain = torch.optim.AdamW(module().parameters())
        plain.load_state_dict(opt_state)
        result["full_state"] = (len(opt_state["state"]) == len(list(module().parameters()))
                                and "dcredit_shard" not in opt_state)
        return result
    case("shard-resume-uninterrupted", uninterrupted)

    def resumed() -> dict:
        state, logged = fit(module, strategy(), steps=RESUME_STEPS, batches=4,
                            ckpt_path=str(ckpt_dir / f"step={RESUME_AT}.ckpt"),
                            enable_checkpointing=False, **clip)
        ref = refs[0]
        tail = {k: v[-len(logged.get(k, [])):] if logged.get(k) else v
                for k, v in ref[1].items()}
        return compare(state, ref[0], logged, tail)
    case("shard-resume-new-trainer", resumed)


def dead_worker() -> None:
    """Rank 1 dies at step 3 of a long fit; rank 0 must end with ``PeerLostError``."""
    pid_dir = Path(os.environ["FAILURE_PID_DIR"])
    (pid_dir / f"rank{rank()}.pid").write_text(str(os.getpid()))

    class Die(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if rank() == 1 and trainer.global_step == 3:
                (pid_dir / "failed_at").write_text(repr(time.time()))
                os._exit(1)
    try:
        fit(lambda: Module("cnn"), dcredit("bytescheduler"), steps=100000, batches=100000,
            callbacks=(Die(),))
    except BaseException as exc:
        (pid_dir / f"raised{rank()}").write_text(f"{time.time()!r} {type(exc).__name__} {exc}")
        raise
    print(f"rank {rank()} finished a fit whose peer died", flush=True)


def main() -> None:
    global GROUP, OUT
    GROUP, OUT = sys.argv[1], Path(sys.argv[2])
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if GROUP == "main":
        parity_matrix()
        features(names=(*FEATURES, "lr-scheduler", "gan", "manual-accumulate"))
        refusals()
        resume_first_half()
    elif GROUP == "unified":
        parity_matrix(models=(("cnn", "sgd"), ("gpt2", "adamw")))
        features(names=("accumulate", "clip-norm", "gan"))
        features(lambda **kw: dcredit("dcredit", True, shard=True, **kw),
                 names=("accumulate", "clip-norm"), prefix="shard-")
        sharded_resume()
        RESULTS["packages"] = sorted({m.split(".")[0] for m in sys.modules
                                      if "lightning" in m.split(".")[0]})
        RESULTS["registered"] = pl.strategies.StrategyRegistry["dcredit"]["strategy"].__module__
    elif GROUP == "resume":
        resume_second_half()
    elif GROUP == "horovod":
        import horovod.torch as hvd
        refs = {name: torch.load(OUT / f"ref-{name}.rank{rank()}.pt")
                for name in HOROVOD_CASES}
        features(lambda **kw: dcredit("dcredit", True, **kw), names=tuple(refs),
                 prefix="horovod-", refs=refs)
        features(lambda **kw: dcredit("wfbp", False, **kw), names=("clip-norm",),
                 prefix="horovod-sync-", refs=refs)
        RESULTS["transport"] = "horovod" if hvd.is_initialized() else "none"
    RESULTS["total_seconds"] = round(time.monotonic() - started, 1)
    save()
    if GROUP == "resume":
        dead_worker()


if __name__ == "__main__":
    main()
