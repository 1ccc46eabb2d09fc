"""With ``model=``, step() returns at once and each parameter is updated when its gradient is
reduced; results still equal plain ``hvd.DistributedOptimizer`` (run under mpirun / horovodrun)."""
from __future__ import annotations

import copy

import horovod.torch as hvd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcredit_hvd

from conftest import assert_all_ranks
from models import batches, make_model, max_rel_diff, params_close, train

# bytescheduler overlaps from the first step (dcredit profiles its first steps synchronously;
# its own tests below give it the steps it needs).
SMALL = dict(partition_bytes=512, credit_bytes=2048, policy="bytescheduler")
OPTIMIZERS = {
    "SGD": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "Adam": dict(lr=0.01),
    "AdamW": dict(lr=0.01, amsgrad=True),
    "RMSprop": dict(lr=0.01, momentum=0.5),
    "Adagrad": dict(lr=0.05),
    "Adadelta": dict(lr=1.0),
    "Adamax": dict(lr=0.01),
    "NAdam": dict(lr=0.01),
    "RAdam": dict(lr=0.01),
    "ASGD": dict(lr=0.01),
    "Rprop": dict(lr=0.01),
}


def two_groups(cls_name, model):
    """Two param groups with different hyper-parameters."""
    kwargs = OPTIMIZERS[cls_name]
    head = [p for n, p in model.named_parameters() if n.startswith(("head", "extra"))]
    rest = [p for n, p in model.named_parameters() if not n.startswith(("head", "extra"))]
    return getattr(torch.optim, cls_name)(
        [{"params": rest}, {"params": head, "lr": kwargs["lr"] * 0.5}], **kwargs)


def wrap_reference(opt, model, **kwargs):
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def wrap_ours(opt, model, **kwargs):
    kwargs = {**SMALL, **kwargs}
    return dcredit_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            model=model, **kwargs)


def with_scheduler(cls_name, wrap, steps=10):
    model = make_model()
    opt = wrap(two_groups(cls_name, model), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return train(model, opt, steps, after_step=sched.step)


@pytest.mark.parametrize("cls_name", sorted(OPTIMIZERS))
def test_every_optimizer_matches_horovod_after_ten_steps_with_param_groups_and_scheduler(cls_name):
    expected = with_scheduler(cls_name, wrap_reference)
    got = with_scheduler(cls_name, wrap_ours)
    assert_all_ranks(params_close(got, expected),
                     f"{cls_name}: max relative difference {max_rel_diff(got, expected)}")


@pytest.mark.parametrize("cls_name", ["Adam", "SGD"])
def test_dcredit_overlapping_the_next_forward_matches_horovod(cls_name):
    expected = with_scheduler(cls_name, wrap_reference)
    got = with_scheduler(cls_name, lambda o, m: wrap_ours(o, m, policy="dcredit", profile_warmup=1,
                                                          profile_steps=2))
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def test_state_dict_after_step_applies_every_owed_update():
    model = make_model()
    opt = wrap_ours(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for micro in batches(3):
        opt.zero_grad()
        x, y = micro[0]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        assert_all_ranks(opt._step_in_flight, "step() with model= must return before updating")
    model.state_dict()
    assert_all_ranks(opt._updater.owed == 0, "state_dict() must apply every owed update")


def test_gradient_accumulation_communicates_and_updates_once_per_k_passes():
    model = make_model()
    ref = wrap_reference(torch.optim.Adam(model.parameters(), lr=0.01), model,
                         backward_passes_per_step=3)
    expected = train(model, ref, steps=4, passes=3)
    model = make_model()
    opt = wrap_ours(torch.optim.Adam(model.parameters(), lr=0.01), model,
                    backward_passes_per_step=3)
    sent = []
    for micro in batches(4, passes=3):
        opt.zero_grad()
        for i, (x, y) in enumerate(micro):
            F.cross_entropy(model(x), y).backward()
            sent.append((i, len(opt._scheduler.submitted_names) if opt._queued else 0))
        opt.step()
    got = [v.detach().clone() for v in model.state_dict().values()]
    quiet = all(n == 0 for i, n in sent if i < 2)
    assert_all_ranks(quiet, f"blocks were sent before the k-th pass: {sent}")
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def clip_step(opt):
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.05)
    with opt.skip_synchronize():
        opt.step()


def test_clipping_pattern_falls_back_to_updating_at_step_and_matches():
    model = make_model()
    expected = train(model, wrap_reference(torch.optim.SGD(model.parameters(), lr=0.1), model),
                     before_step=clip_step)
    model = make_model()
    got = train(model, wrap_ours(torch.optim.SGD(model.parameters(), lr=0.1), model),
                before_step=clip_step)
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def scaler_loop(model, opt, poison_step=2):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    skipped = 0
    for k, micro in enumerate(batches(6)):
        opt.zero_grad()
        x, y = micro[0]
        loss = F.cross_entropy(model(x), y)
        if k == poison_step:
            loss = loss * float("inf")           # this step must be skipped on every rank
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scale = scaler.get_scale()
            scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale
    return [v.detach().clone() for v in model.state_dict().values()], skipped


def test_grad_scaler_pattern_with_a_skipped_step_matches_horovod():
    model = make_model()
    expected, ref_skipped = scaler_loop(model, wrap_reference(
        torch.optim.SGD(model.parameters(), lr=0.1), model))
    model = make_model()
    got, skipped = scaler_loop(model, wrap_ours(torch.optim.SGD(model.parameters(), lr=0.1), model))
    assert_all_ranks(skipped == ref_skipped == 1, f"skipped {skipped}, reference {ref_skipped}")
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def autocast_loop(model, opt):
    for micro in batches(5):
        opt.zero_grad()
        x, y = micro[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
    return [v.detach().clone() for v in model.state_dict().values()]


def test_autocast_bf16_matches_horovod():
    model = make_model()
    expected = autocast_loop(model, wrap_reference(torch.optim.Adam(model.parameters(), lr=0.01), model))
    model = make_model()
    got = autocast_loop(model, wrap_ours(torch.optim.Adam(model.parameters(), lr=0.01), model))
    assert_all_ranks(params_close(got, expected, rtol=1e-4, atol=1e-5),
                     f"max rel diff {max_rel_diff(got, expected)}")


class TiedReordered(nn.Module):
    """Tied embedding/output weights, modules declared in an order forward does not follow,
    a parameter owned by no submodule (``scale``), and forward run twice per iteration."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(16, 32, bias=False)      # declared first, used last
        self.mid = nn.Linear(16, 16)
        self.emb = nn.Embedding(32, 16)
        self.out.weight = self.emb.weight             # tied
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, tokens):
        h = self.emb(tokens) * self.scale
        return self.out(torch.tanh(self.mid(h)))


def tied_loop(model, opt, eval_outputs):
    gen = torch.Generator().manual_seed(5 + hvd.rank())
    probe = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(9))
    for _ in range(5):
        opt.zero_grad()
        tokens = torch.randint(0, 32, (4, 6), generator=gen)
        first = model(tokens)
        second = model(tokens.flip(1))                 # a second forward in the same iteration
        loss = F.cross_entropy(first.reshape(-1, 32), tokens.reshape(-1)) + second.pow(2).mean()
        loss.backward()
        opt.step()
        with torch.no_grad():                          # evaluation between iterations
            eval_outputs.append(model(probe).clone())
    return [v.detach().clone() for v in model.state_dict().values()]


def test_tied_weights_reordered_modules_and_second_forward_match_horovod():
    torch.manual_seed(3)
    model = TiedReordered()
    ref_eval, got_eval = [], []
    expected = tied_loop(model, wrap_reference(torch.optim.Adam(model.parameters(), lr=0.01), model),
                         ref_eval)
    torch.manual_seed(3)
    model = TiedReordered()
    opt = wrap_ours(torch.optim.Adam(model.parameters(), lr=0.01), model, partition_bytes=256)
    got = tied_loop(model, opt, got_eval)
    order = [t.name for t in opt.layouts]
    # the tied weight is named out.weight (declared first) but first used by emb
    assert_all_ranks(order.index("out.weight") < order.index("mid.weight") < order.index("mid.bias"),
                     f"tensors not in forward order: {order}")
    same_eval = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got_eval, ref_eval))
    assert_all_ranks(same_eval, "evaluation under no_grad saw parameters not yet updated")
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")


def test_resuming_from_a_checkpoint_gives_the_same_parameters_as_an_uninterrupted_run():
    model = make_model()
    opt = wrap_ours(torch.optim.Adam(model.parameters(), lr=0.01), model)
    data = batches(6)
    for x, y in (m[0] for m in data[:3]):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    checkpoint = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    for x, y in (m[0] for m in data[3:]):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    uninterrupted = [v.detach().clone() for v in model.state_dict().values()]

    resumed = make_model(seed=99)                    # different start: the checkpoint must win
    opt2 = wrap_ours(torch.optim.Adam(resumed.parameters(), lr=0.01), resumed)
    resumed.load_state_dict(checkpoint[0])
    opt2.load_state_dict(checkpoint[1])
    for x, y in (m[0] for m in data[3:]):
        opt2.zero_grad()
        F.cross_entropy(resumed(x), y).backward()
        opt2.step()
    got = [v.detach().clone() for v in resumed.state_dict().values()]
    assert_all_ranks(params_close(got, uninterrupted),
                     f"max rel diff {max_rel_diff(got, uninterrupted)}")


def _ema_run(wrap, steps=6):
    """An EMA of the weights read after every step(), between step() and the next forward."""
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=0.01), model)
    ema = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    for micro in batches(steps):
        opt.zero_grad()
        x, y = micro[0]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            ema.mul_(0.9).add_(torch.nn.utils.parameters_to_vector(model.parameters()), alpha=0.1)
    return ema


def test_an_ema_of_the_weights_read_between_step_and_forward_sees_every_update():
    expected = _ema_run(wrap_reference)
    got = _ema_run(lambda o, m: wrap_ours(o, m, race_amplifier=0.002))
    assert_all_ranks(torch.allclose(got, expected, rtol=1e-5, atol=1e-7),
                     f"EMA differs: max |diff| {float((got - expected).abs().max()):.3g}")


def test_broadcast_of_named_parameters_reaches_parameters_the_guard_observes():
    """Horovod's other broadcast form hands the parameters themselves to Horovod, while the read
    guard observes them (their class is the guard's until forward first reads them)."""
    model = make_model(seed=10 + hvd.rank())                # different weights on each rank
    wrap_ours(torch.optim.SGD(model.parameters(), lr=0.1), model)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    gathered = hvd.allgather(flat.unsqueeze(0), name="test.overlap.broadcast_named")
    assert_all_ranks(bool((gathered == gathered[0]).all()), "ranks differ after the broadcast")
