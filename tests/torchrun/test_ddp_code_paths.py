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
"""
from __future__ import annotations

import gc
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers as tf

import dcredit_hvd

from conftest import ManualAllreduce, assert_all_ranks, ddp, gather, rank, same_on_every_rank

STEPS = 6
POLICIES = ["wfbp", "bytescheduler", "dcredit"]
#: As in the real-architecture suite: small blocks, dcredit's plan installed mid-run (iteration
#: 4), runs of small gradients grouped.
SCHEDULE = dict(partition_bytes=4096, credit_bytes=16384, profile_warmup=1, profile_steps=2,
                group_bytes=16384)
AMPLIFIER = dict(race_amplifier=0.0005)
VOCAB, SEQ, BATCH = 96, 12, 4
RTOL = 1e-5


@dataclass(frozen=True)
class Runner:
    """How a case trains: ``wrap(optimizer, named_parameters, model)`` gives the optimizer the
    loop steps, ``forward(model)`` the module the batches go through."""

    wrap: Callable[[torch.optim.Optimizer, list, torch.nn.Module], Any]
    forward: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model


def _gpt2(seed: int = 0, **config: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0, **config))
    return model.train()


def _tokens(step: int) -> dict:
    gen = torch.Generator().manual_seed(700 + 31 * step + rank())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)


Loss = Callable[[torch.nn.Module, int], torch.Tensor]


def _single(model: torch.nn.Module, run: Runner, loss: Loss) -> list[torch.Tensor]:
    """One AdamW over the trainable parameters of ``model``; ``loss(forward, step)``."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = run.wrap(_adamw([p for _, p in trainable]), trainable, model)
    forward = run.forward(model)
    _per_rank_draws()
    for step in range(STEPS):
        opt.zero_grad()
        loss(forward, step).backward()
        opt.step()
    return _read(model, opt)


def _per_rank_draws() -> None:
    """Models are built from one seed on every rank; dropout and LayerDrop then draw from a
    seed per rank (the same in the reference run and the scheduled one)."""
    torch.manual_seed(1000 + rank())


def _read(model: torch.nn.Module, *opts: Any) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in model.parameters()]
    for opt in opts:
        if hasattr(opt, "apply_pending_updates"):
            opt.apply_pending_updates()
    return params


# -- rank-dependent forwards --------------------------------------------------------------------
def layerdrop(run: Runner) -> list[torch.Tensor]:
    """Each rank drops other encoder layers (``layerdrop=0.3``, per-rank random draws)."""
    torch.manual_seed(0)
    model = tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=37,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, layerdrop=0.3, num_labels=3, mask_time_prob=0.0,
        hidden_dropout=0.1, do_stable_layer_norm=True)).train()

    def loss(forward: torch.nn.Module, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(900 + 31 * step + rank())
        return forward(input_values=torch.randn(BATCH, 400, generator=gen),
                       labels=torch.randint(0, 3, (BATCH,), generator=gen)).loss
    return _single(model, run, loss)


class _Branchy(torch.nn.Module):
    """GPT-2 with an extra block that only rank 1 runs in the first iteration (every rank runs
    it afterwards): the first forward reads other parameters on each rank."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = _gpt2().transformer
        self.extra = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
        self.head = torch.nn.Linear(32, VOCAB)
        self.step = 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.gpt(input_ids=input_ids).last_hidden_state
        if self.step > 0 or rank() == 1:
            hidden = hidden + self.extra(hidden)
        logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def rank1_branch(run: Runner) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Branchy().train()

    def loss(forward: torch.nn.Module, step: int) -> torch.Tensor:
        model.step = step
        return forward(**_tokens(step))
    return _single(model, run, loss)


def moe(run: Runner) -> list[torch.Tensor]:
    """Top-1 routing over 8 experts, per-rank data: ranks run other experts, in other orders."""
    torch.manual_seed(0)
    model = tf.SwitchTransformersForConditionalGeneration(tf.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=2, num_experts=8, expert_capacity=8, encoder_sparse_step=1,
        decoder_sparse_step=1, decoder_start_token_id=0, pad_token_id=0,
        dropout_rate=0.1)).train()

    def loss(forward: torch.nn.Module, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(800 + 31 * step + rank())
        return forward(input_ids=torch.randint(2, VOCAB, (2, 6), generator=gen),
                       labels=torch.randint(2, VOCAB, (2, 3), generator=gen)).loss
    return _single(model, run, loss)


# -- several optimizers ---------------------------------------------------------------------------
def two_models(run: Runner) -> list[torch.Tensor]:
    """A GAN-like loop: two GPT-2s with identical parameter names, one optimizer each, the
    second model trained on the first one's (detached) predictions."""
    gen_model, disc_model = _gpt2(0), _gpt2(1)
    opt_g = run.wrap(_adamw(gen_model.parameters()), list(gen_model.named_parameters()),
                     gen_model)
    opt_d = run.wrap(_sgd(disc_model.parameters()), list(disc_model.named_parameters()),
                     disc_model)
    gen_fwd, disc_fwd = run.forward(gen_model), run.forward(disc_model)
    _per_rank_draws()
    for step in range(STEPS):
        batch = _tokens(step)
        opt_g.zero_grad()
        out = gen_fwd(**batch)
        out.loss.backward()
        opt_g.step()
        fake = out.logits.detach().argmax(-1)
        opt_d.zero_grad()
        disc_fwd(input_ids=fake, labels=batch["labels"]).loss.backward()
        opt_d.step()
    return _read(gen_model, opt_g) + _read(disc_model, opt_d)


def disjoint_groups(run: Runner) -> list[torch.Tensor]:
    """Two optimizers over disjoint parameter groups of one model (embeddings and first block
    with AdamW, the rest with SGD), both stepped after each backward."""
    model = _gpt2()
    named = list(model.named_parameters())
    first = [(n, p) for n, p in named if n.startswith(("transformer.wte", "transformer.wpe",
                                                       "transformer.h.0."))]
    rest = [(n, p) for n, p in named if (n, p) not in first]
    opt_a = run.wrap(_adamw([p for _, p in first]), first, model)
    opt_b = run.wrap(_sgd([p for _, p in rest]), rest, model)
    forward = run.forward(model)
    _per_rank_draws()
    for step in range(STEPS):
        opt_a.zero_grad()
        opt_b.zero_grad()
        forward(**_tokens(step)).loss.backward()
        opt_a.step()
        opt_b.step()
    return _read(model, opt_a, opt_b)


# -- an optimizer replaced mid-training -----------------------------------------------------------
def replaced(how: str) -> Callable[[Runner], list[torch.Tensor]]:
    """AdamW for half the steps, then a new SGD optimizer on the same model: the first closed
    (``close``), rebound without closing (``rebind``), or deleted (``del``)."""
    def run_case(run: Runner) -> list[torch.Tensor]:
        model = _gpt2()
        opt = run.wrap(_adamw(model.parameters()), list(model.named_parameters()), model)
        forward = run.forward(model)
        _per_rank_draws()
        for step in range(STEPS):
            if step == STEPS // 2:
                if how == "close" and hasattr(opt, "close"):
                    opt.close()
                elif how == "del":
                    del opt
                    gc.collect()
                opt = run.wrap(_sgd(model.parameters()), list(model.named_parameters()), model)
            opt.zero_grad()
            forward(**_tokens(step)).loss.backward()
            opt.step()
        return _read(model, opt)
    return run_case


# -- training patterns ----------------------------------------------------------------------------
def checkpointing(run: Runner) -> list[torch.Tensor]:
    model = _gpt2(use_cache=False)
    model.gradient_checkpointing_enable()
    return _single(model, run, lambda forward, step: forward(**_tokens(step)).loss)


def lora(run: Runner) -> list[torch.Tensor]:
    peft = pytest.importorskip("peft")
    base = _gpt2()
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                       target_modules=["c_attn", "c_proj"],
                                                       fan_in_fan_out=True))
    return _single(model, run, lambda forward, step: forward(**_tokens(step)).loss)


def autocast(run: Runner) -> list[torch.Tensor]:
    model = _gpt2()

    def loss(forward: torch.nn.Module, step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(**_tokens(step)).loss
    return _single(model, run, loss)


@dataclass(frozen=True)
class Case:
    run: Callable[[Runner], list[torch.Tensor]]
    #: The reference is the manual all-reduce (a parameter no rank used gets zeros), not DDP.
    manual: bool = False
    atol: float = 1e-7


CASES = {
    "layerdrop": Case(layerdrop, manual=True),
    "rank1_branch": Case(rank1_branch),
    "moe_routing": Case(moe, manual=True),
    "two_models": Case(two_models),
    "disjoint_groups": Case(disjoint_groups),
    "replaced_close": Case(replaced("close")),
    "replaced_rebind": Case(replaced("rebind")),
    "replaced_del": Case(replaced("del")),
    "checkpointing": Case(checkpointing),
    "lora": Case(lora),
    "autocast_bf16": Case(autocast),
}

DDP = Runner(lambda opt, named, model: opt, ddp)
MANUAL = Runner(lambda opt, named, model: ManualAllreduce(opt))


def _dcredit(policy: str, with_model: bool) -> Runner:
    extra = SCHEDULE if policy == "dcredit" else {
        k: v for k, v in SCHEDULE.items() if not k.startswith(("profile", "group"))}

    def wrap(opt: torch.optim.Optimizer, named: list, model: torch.nn.Module) -> Any:
        return dcredit_hvd.DistributedOptimizer(opt, named_parameters=named,
                                                model=model if with_model else None,
                                                transport="torch.distributed",
                                                policy=policy, **extra, **AMPLIFIER)
    return Runner(wrap)


_reference: dict[str, list[torch.Tensor]] = {}


def _run(case: Case, run: Runner) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return case.run(run)


def reference(name: str) -> list[torch.Tensor]:
    if name not in _reference:
        case = CASES[name]
        _reference[name] = _run(case, MANUAL if case.manual else DDP)
    return _reference[name]


def _mismatch(got: list[torch.Tensor], expected: list[torch.Tensor], atol: float) -> str:
    if len(got) != len(expected):
        return f"{len(got)} parameters against {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected)):
        if not torch.allclose(a, b, rtol=RTOL, atol=atol):
            return f"parameter #{i} {tuple(a.shape)}: max |diff| {float((a - b).abs().max()):.3g}"
    return ""


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(CASES))
def test_code_path_matches_the_reference_on_every_rank(name: str, policy: str,
                                                       with_model: bool) -> None:
    expected = reference(name)
    try:
        got = _run(CASES[name], _dcredit(policy, with_model))
        problem = _mismatch(got, expected, CASES[name].atol)
    except Exception as exc:             # every rank must reach the verdict below
        got, problem = expected, f"raised {type(exc).__name__}: {exc}"
    assert_all_ranks(not problem, f"{name}/{policy}/{'model' if with_model else 'no-model'}: "
                                  f"{problem}")
    assert_all_ranks(same_on_every_rank(got), f"{name}: ranks ended with different parameters")


# -- the mechanisms, one by one -------------------------------------------------------------------
def _small(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _wrapped(net: torch.nn.Module, **kwargs: Any) -> Any:
    return dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
        **{"policy": "bytescheduler", "partition_bytes": 64, **kwargs})


def _train_steps(model: torch.nn.Module, opt: Any, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()


def test_unagreed_orders_are_named_on_every_rank_before_anything_is_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the order broadcast taken out (each rank keeps its own first reads), the layout
    check stops the job on every rank, naming the first unit, before a wrong pairing."""
    def local_order(first_reads: list, count: int, *args: Any) -> list[int]:
        return list(first_reads) + [i for i in range(count) if i not in set(first_reads)]
    monkeypatch.setattr(dcredit_hvd.agreement, "agree_order", local_order)
    torch.manual_seed(0)
    model = _Branchy().train()
    opt = dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        model=model, policy="bytescheduler", partition_bytes=4096)
    message = ""
    try:
        for step in range(2):
            model.step = step
            opt.zero_grad()
            model(**_tokens(step)).backward()
            opt.step()
        opt.apply_pending_updates()
    except dcredit_hvd.agreement.LayoutMismatchError as exc:
        message = str(exc)
    assert_all_ranks("after the forward order was agreed: unit #" in message
                     and "on rank 0 but" in message and "on rank 1" in message,
                     f"got {message!r}")


def test_each_optimizer_names_its_collectives_under_its_own_prefix_alike_on_every_rank() -> None:
    first, second = _small(0), _small(0)        # identical parameter names and shapes
    opt1, opt2 = _wrapped(first), _wrapped(second)
    name1, name2 = opt1.layouts[0].blocks[0].name, opt2.layouts[0].blocks[0].name
    prefix1, prefix2 = name1.rsplit(".0.weight", 1)[0], name2.rsplit(".0.weight", 1)[0]
    base, _, k = prefix1.partition(".")[2].partition(".")     # dcredit.<digest>[.<k>]
    following = f"dcredit.{base}.{int(k or 0) + 1}"
    assert_all_ranks(prefix2 == following, f"{name1} then {name2}")
    everyone = gather((name1, name2))
    assert_all_ranks(all(names == everyone[0] for names in everyone), f"{everyone}")
    opt1.close()
    opt2.close()


def test_close_removes_the_hooks_and_gives_the_parameters_their_classes_back() -> None:
    model = _small()
    opt = _wrapped(model, model=model)
    _train_steps(model, opt)
    opt.close()
    classes_back = all(type(p) is torch.nn.Parameter for p in model.parameters())
    model(torch.randn(3, 8)).sum().backward()        # no hook of the closed optimizer fires
    no_hooks = all(not p._post_accumulate_grad_hooks for p in model.parameters())
    raised = ""
    try:
        opt.step()
    except RuntimeError as exc:
        raised = str(exc)
    state = opt.state_dict()                          # still readable, to move state over
    assert_all_ranks(classes_back and no_hooks, f"classes {classes_back}, hooks gone {no_hooks}")
    assert_all_ranks("was closed" in raised and "state" in state, f"got {raised!r}")


def test_an_optimizer_nobody_references_is_collected_with_its_hooks() -> None:
    model = _small()
    opt = _wrapped(model, model=model)
    _train_steps(model, opt)
    opt.apply_pending_updates()
    ref = weakref.ref(opt)
    del opt
    # The completion thread may still be returning from the last update's callback.
    for _ in range(50):
        gc.collect()
        if ref() is None:
            break
        time.sleep(0.05)
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    assert_all_ranks(ref() is None and hooks == 0, f"alive {ref() is not None}, {hooks} hooks")


def test_a_new_optimizer_over_held_parameters_closes_the_old_one_with_a_warning() -> None:
    model = _small()
    old = _wrapped(model, model=model)
    _train_steps(model, old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = _wrapped(model, model=model)
    said = [str(w.message) for w in caught if "still hooks" in str(w.message)]
    raised = ""
    try:
        old.step()
    except RuntimeError as exc:
        raised = str(exc)
    _train_steps(model, new)                          # one hook per parameter: no double count
    assert_all_ranks(len(said) == 1 and "the older one is closed now" in said[0], f"{said}")
    assert_all_ranks("closed when a newer DistributedOptimizer was built" in raised,
                     f"got {raised!r}")
    new.close()


def test_closing_between_backward_and_step_is_refused() -> None:
    model = _small()
    opt = _wrapped(model)
    opt.zero_grad()
    model(torch.randn(3, 8)).sum().backward()
    raised = ""
    try:
        opt.close()
    except RuntimeError as exc:
        raised = str(exc)
    opt.step()
    opt.close()
    assert_all_ranks("after loss.backward() and before step()" in raised, f"got {raised!r}")
