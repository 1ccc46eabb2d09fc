"""The cases of the two code-path suites, without Horovod: ranks that take different code paths,
several optimizers, optimizers replaced mid-run, and the optimizer's life-cycle mechanisms.

``test_code_paths.py`` (Horovod: ``mpirun`` / ``horovodrun``) and
``tests/torchrun/test_ddp_code_paths.py`` (torch.distributed) both run these, so that both
launchers train the same models on the same batches down the same per-rank paths and hold them
to the same tolerance.  Each suite passes what differs: its rank, its reference (plain Horovod or
DDP, else a manual all-reduce of every gradient) and its dcredit_hvd wrapper, as a ``Runner``;
and its own ``assert_all_ranks`` / gather to the mechanism checks.
"""
from __future__ import annotations

import gc
import time
import warnings
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers as tf

import dcredit_hvd

STEPS = 6
POLICIES = ["wfbp", "bytescheduler", "dcredit"]
#: As in the real-architecture suites: small blocks, dcredit's plan installed mid-run (from the
#: fourth iteration on), runs of small gradients grouped.
SCHEDULE = dict(partition_bytes=4096, credit_bytes=16384, profile_warmup=1, profile_steps=2,
                group_bytes=16384)
AMPLIFIER = dict(race_amplifier=0.0005)
VOCAB, SEQ, BATCH = 96, 12, 4
RTOL = 1e-5

#: wrap(optimizer, named_parameters, model) -> the optimizer the training loop steps
Wrap = Callable[[torch.optim.Optimizer, list, torch.nn.Module], Any]
#: loss(forward, step): the loss of ``step``'s batch through ``forward``
Loss = Callable[[torch.nn.Module, int], torch.Tensor]
#: The suite's ``assert_all_ranks(ok, message)``: every rank reaches the same verdict.
AssertAllRanks = Callable[[bool, str], None]


def _as_is(model: torch.nn.Module) -> torch.nn.Module:
    return model


@dataclass(frozen=True)
class Runner:
    """How a case trains on this rank: ``wrap(optimizer, named_parameters, model)`` gives the
    optimizer the loop steps, ``forward(model)`` the module the batches go through (DDP's
    wrapper, or the model itself), ``rank`` the rank whose data and branches it takes."""

    wrap: Wrap
    rank: int
    forward: Callable[[torch.nn.Module], torch.nn.Module] = _as_is


def gpt2(seed: int = 0, **config: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0, **config))
    return model.train()


def tokens(step: int, rank: int) -> dict:
    """``step``'s language-model batch, other tokens on each rank."""
    gen = torch.Generator().manual_seed(700 + 31 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)


def single(model: torch.nn.Module, run: Runner, loss: Loss) -> list[torch.Tensor]:
    """One AdamW over the trainable parameters of ``model``; ``loss(forward, step)``."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = run.wrap(adamw([p for _, p in trainable]), trainable, model)
    forward = run.forward(model)
    per_rank_draws(run.rank)
    for step in range(STEPS):
        opt.zero_grad()
        loss(forward, step).backward()
        opt.step()
    return read(model, opt)


def per_rank_draws(rank: int) -> None:
    """Models are built from one seed on every rank; dropout and LayerDrop then draw from a
    seed per rank (the same in the reference run and the scheduled one), so that ranks drop
    different layers, as in a real job."""
    torch.manual_seed(1000 + rank)


def read(model: torch.nn.Module, *opts: Any) -> list[torch.Tensor]:
    """The parameters straight after the last ``step()``, as a user reads them; each
    optimizer's pending updates are applied only then, to end its work."""
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
        gen = torch.Generator().manual_seed(900 + 31 * step + run.rank)
        return forward(input_values=torch.randn(BATCH, 400, generator=gen),
                       labels=torch.randint(0, 3, (BATCH,), generator=gen)).loss
    return single(model, run, loss)


class Branchy(torch.nn.Module):
    """GPT-2 with an extra block that only rank 1 runs in the first iteration (every rank runs
    it afterwards): the first forward reads other parameters on each rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.gpt = gpt2().transformer
        self.extra = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
        self.head = torch.nn.Linear(32, VOCAB)
        self.step = 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.gpt(input_ids=input_ids).last_hidden_state
        if self.step > 0 or self.rank == 1:
            hidden = hidden + self.extra(hidden)
        logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def rank1_branch(run: Runner) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Branchy(run.rank).train()

    def loss(forward: torch.nn.Module, step: int) -> torch.Tensor:
        model.step = step
        return forward(**tokens(step, run.rank))
    return single(model, run, loss)


def moe(run: Runner) -> list[torch.Tensor]:
    """Top-1 routing over 8 experts, per-rank data: ranks run other experts, in other orders."""
    torch.manual_seed(0)
    model = tf.SwitchTransformersForConditionalGeneration(tf.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=2, num_experts=8, expert_capacity=8, encoder_sparse_step=1,
        decoder_sparse_step=1, decoder_start_token_id=0, pad_token_id=0,
        dropout_rate=0.1)).train()

    def loss(forward: torch.nn.Module, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(800 + 31 * step + run.rank)
        return forward(input_ids=torch.randint(2, VOCAB, (2, 6), generator=gen),
                       labels=torch.randint(2, VOCAB, (2, 3), generator=gen)).loss
    return single(model, run, loss)


# -- several optimizers ---------------------------------------------------------------------------
def two_models(run: Runner) -> list[torch.Tensor]:
    """A GAN-like loop: two GPT-2s with identical parameter names, one optimizer each, the
    second model trained on the first one's (detached) predictions."""
    gen_model, disc_model = gpt2(0), gpt2(1)
    opt_g = run.wrap(adamw(gen_model.parameters()), list(gen_model.named_parameters()),
                     gen_model)
    opt_d = run.wrap(sgd(disc_model.parameters()), list(disc_model.named_parameters()),
                     disc_model)
    gen_fwd, disc_fwd = run.forward(gen_model), run.forward(disc_model)
    per_rank_draws(run.rank)
    for step in range(STEPS):
        batch = tokens(step, run.rank)
        opt_g.zero_grad()
        out = gen_fwd(**batch)
        out.loss.backward()
        opt_g.step()
        fake = out.logits.detach().argmax(-1)
        opt_d.zero_grad()
        disc_fwd(input_ids=fake, labels=batch["labels"]).loss.backward()
        opt_d.step()
    return read(gen_model, opt_g) + read(disc_model, opt_d)


def disjoint_groups(run: Runner) -> list[torch.Tensor]:
    """Two optimizers over disjoint parameter groups of one model (embeddings and first block
    with AdamW, the rest with SGD), both stepped after each backward."""
    model = gpt2()
    named = list(model.named_parameters())
    first = [(n, p) for n, p in named if n.startswith(("transformer.wte", "transformer.wpe",
                                                       "transformer.h.0."))]
    rest = [(n, p) for n, p in named if (n, p) not in first]
    opt_a = run.wrap(adamw([p for _, p in first]), first, model)
    opt_b = run.wrap(sgd([p for _, p in rest]), rest, model)
    forward = run.forward(model)
    per_rank_draws(run.rank)
    for step in range(STEPS):
        opt_a.zero_grad()
        opt_b.zero_grad()
        forward(**tokens(step, run.rank)).loss.backward()
        opt_a.step()
        opt_b.step()
    return read(model, opt_a, opt_b)


# -- an optimizer replaced mid-training -----------------------------------------------------------
def replaced(how: str) -> Callable[[Runner], list[torch.Tensor]]:
    """AdamW for half the steps, then a new SGD optimizer on the same model: the first closed
    (``close``), rebound without closing (``rebind``), or deleted (``del``)."""
    def run_case(run: Runner) -> list[torch.Tensor]:
        model = gpt2()
        opt = run.wrap(adamw(model.parameters()), list(model.named_parameters()), model)
        forward = run.forward(model)
        per_rank_draws(run.rank)
        for step in range(STEPS):
            if step == STEPS // 2:
                if how == "close" and hasattr(opt, "close"):
                    opt.close()
                elif how == "del":
                    del opt
                    gc.collect()
                opt = run.wrap(sgd(model.parameters()), list(model.named_parameters()), model)
            opt.zero_grad()
            forward(**tokens(step, run.rank)).loss.backward()
            opt.step()
        return read(model, opt)
    return run_case


# -- training patterns ----------------------------------------------------------------------------
def checkpointing(run: Runner) -> list[torch.Tensor]:
    model = gpt2(use_cache=False)
    model.gradient_checkpointing_enable()
    return single(model, run, lambda forward, step: forward(**tokens(step, run.rank)).loss)


def lora(run: Runner) -> list[torch.Tensor]:
    peft = pytest.importorskip("peft")
    base = gpt2()
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                       target_modules=["c_attn", "c_proj"],
                                                       fan_in_fan_out=True))
    return single(model, run, lambda forward, step: forward(**tokens(step, run.rank)).loss)


def autocast(run: Runner) -> list[torch.Tensor]:
    model = gpt2()

    def loss(forward: torch.nn.Module, step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(**tokens(step, run.rank)).loss
    return single(model, run, loss)


# -- the table, the comparison ------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    run: Callable[[Runner], list[torch.Tensor]]
    #: The suite's plain reference (Horovod's optimizer, DDP) cannot run it: the reference is a
    #: manual all-reduce of every gradient, then the local optimizer.
    manual: bool = False
    #: Absolute tolerance beside ``rtol=1e-5``.  ``torch.compile`` traces another graph when
    #: the read guard has switched a parameter's class (``model=``): its fused kernels sum in
    #: another order, a few float32 ulps per step (6e-7 after 6 AdamW steps was seen).
    atol: float = 1e-7


#: Every case both suites run, by test id, in the suites' order.
RUNS: dict[str, Callable[[Runner], list[torch.Tensor]]] = {
    "layerdrop": layerdrop,
    "rank1_branch": rank1_branch,
    "moe_routing": moe,
    "two_models": two_models,
    "disjoint_groups": disjoint_groups,
    "replaced_close": replaced("close"),
    "replaced_rebind": replaced("rebind"),
    "replaced_del": replaced("del"),
    "checkpointing": checkpointing,
    "lora": lora,
    "autocast_bf16": autocast,
}


def case_table(manual: Collection[str]) -> dict[str, Case]:
    """The shared cases, those named in ``manual`` checked against the manual all-reduce (each
    suite says why its plain reference cannot run them)."""
    return {name: Case(run, manual=name in manual) for name, run in RUNS.items()}


def dcredit_wrap(policy: str, with_model: bool, **transport: Any) -> Wrap:
    """dcredit_hvd's optimizer under ``policy`` (race amplifier on), with or without
    ``model=``; ``transport`` goes to the factory as it is (e.g. ``transport=...``)."""
    extra = SCHEDULE if policy == "dcredit" else {
        k: v for k, v in SCHEDULE.items() if not k.startswith(("profile", "group"))}

    def wrap(opt: torch.optim.Optimizer, named: list, model: torch.nn.Module) -> Any:
        return dcredit_hvd.DistributedOptimizer(opt, named_parameters=named,
                                                model=model if with_model else None,
                                                **transport, policy=policy, **extra,
                                                **AMPLIFIER)
    return wrap


def run_quietly(case: Case, run: Runner) -> list[torch.Tensor]:
    """``case`` under ``run``, its libraries' warnings silenced (the same in every run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return case.run(run)


def mismatch(got: list[torch.Tensor], expected: list[torch.Tensor], atol: float) -> str:
    """What differs between ``got`` and ``expected`` (``""``: nothing beyond the tolerance)."""
    if len(got) != len(expected):
        return f"{len(got)} parameters against {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected)):
        if not torch.allclose(a, b, rtol=RTOL, atol=atol):
            return f"parameter #{i} {tuple(a.shape)}: max |diff| {float((a - b).abs().max()):.3g}"
    return ""


def train_and_compare(case: Case, expected: list[torch.Tensor],
                      run: Runner) -> tuple[list[torch.Tensor], str]:
    """The parameters ``case`` ends with under ``run`` and what is wrong with them (``""``:
    nothing).  An exception is reported, not raised, so that every rank reaches the verdict:
    a rank that raised alone would leave the others waiting in the next collective."""
    try:
        got = run_quietly(case, run)
        return got, mismatch(got, expected, case.atol)
    except Exception as exc:
        return expected, f"raised {type(exc).__name__}: {exc}"


# -- the mechanisms, one by one -------------------------------------------------------------------
def small_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def wrapped(net: torch.nn.Module, **kwargs: Any) -> Any:
    """dcredit_hvd's SGD over ``net``, on the transport the factory picks for the launcher."""
    return dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
        **{"policy": "bytescheduler", "partition_bytes": 64, **kwargs})


def train_steps(model: torch.nn.Module, opt: Any, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()


def check_unagreed_orders_are_named(assert_all_ranks: AssertAllRanks,
                                    monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """With the order broadcast taken out (each rank keeps its own first reads), the layout
    check stops the job on every rank, naming the first unit."""
    def local_order(first_reads: list, count: int, *args: Any) -> list[int]:
        return list(first_reads) + [i for i in range(count) if i not in set(first_reads)]
    monkeypatch.setattr(dcredit_hvd.runtime.agreement, "agree_order", local_order)
    torch.manual_seed(0)
    model = Branchy(rank).train()
    opt = dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        model=model, policy="bytescheduler", partition_bytes=4096)
    message = ""
    try:
        for step in range(2):
            model.step = step
            opt.zero_grad()
            model(**tokens(step, rank)).backward()
            opt.step()
        opt.apply_pending_updates()
    except dcredit_hvd.runtime.agreement.LayoutMismatchError as exc:
        message = str(exc)
    assert_all_ranks("after the forward order was agreed: unit #" in message
                     and "on rank 0 but" in message and "on rank 1" in message,
                     f"got {message!r}")


def check_each_optimizer_has_its_own_prefix(assert_all_ranks: AssertAllRanks,
                                            gather: Callable[[object], list]) -> None:
    """Two optimizers over models with identical names: the second one's collectives go under
    the next prefix, the same on every rank (``gather``: an object from every rank)."""
    first, second = small_net(0), small_net(0)     # identical parameter names and shapes
    opt1, opt2 = wrapped(first), wrapped(second)
    name1, name2 = opt1.layouts[0].blocks[0].name, opt2.layouts[0].blocks[0].name
    prefix1, prefix2 = name1.rsplit(".0.weight", 1)[0], name2.rsplit(".0.weight", 1)[0]
    base, _, k = prefix1.partition(".")[2].partition(".")     # dcredit.<digest>[.<k>]
    following = f"dcredit.{base}.{int(k or 0) + 1}"
    assert_all_ranks(prefix2 == following, f"{name1} then {name2}")
    everyone = gather((name1, name2))
    assert_all_ranks(all(names == everyone[0] for names in everyone), f"{everyone}")
    opt1.close()
    opt2.close()


def check_close_gives_everything_back(assert_all_ranks: AssertAllRanks) -> None:
    """After ``close()`` no hook fires, the parameters are plain again, ``step()`` says the
    optimizer was closed and its state can still be read (to move it to a new one)."""
    model = small_net()
    opt = wrapped(model, model=model)
    train_steps(model, opt)
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


def check_unreferenced_optimizer_is_collected(assert_all_ranks: AssertAllRanks) -> None:
    """Nothing of the library keeps a dropped optimizer (or its hooks) alive."""
    model = small_net()
    opt = wrapped(model, model=model)
    train_steps(model, opt)
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


def check_new_optimizer_closes_the_old(assert_all_ranks: AssertAllRanks) -> None:
    """A second optimizer over parameters another still hooks closes the older one, says so
    once, and counts each gradient once."""
    model = small_net()
    old = wrapped(model, model=model)
    train_steps(model, old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = wrapped(model, model=model)
    said = [str(w.message) for w in caught if "still hooks" in str(w.message)]
    raised = ""
    try:
        old.step()
    except RuntimeError as exc:
        raised = str(exc)
    train_steps(model, new)                           # one hook per parameter: no double count
    assert_all_ranks(len(said) == 1 and "the older one is closed now" in said[0], f"{said}")
    assert_all_ranks("closed when a newer DistributedOptimizer was built" in raised,
                     f"got {raised!r}")
    new.close()


def check_close_mid_step_is_refused(assert_all_ranks: AssertAllRanks) -> None:
    """``close()`` between ``backward()`` and ``step()`` would drop gradients in flight."""
    model = small_net()
    opt = wrapped(model)
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
