"""Per-parameter updates with the user's own optimizer equal one whole step() (no Horovod)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from dcredit_hvd.runtime.updates import ParameterUpdater

# Every torch.optim optimizer except LBFGS (closure-driven, couples parameters) and SparseAdam.
OPTIMIZERS = {
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": dict(lr=0.01, weight_decay=0.01),
    "AdamW": dict(lr=0.01, amsgrad=True),
    "RMSprop": dict(lr=0.01, momentum=0.5, centered=True),
    "Adagrad": dict(lr=0.1, lr_decay=0.01),
    "Adadelta": dict(lr=1.0),
    "Adamax": dict(lr=0.01),
    "NAdam": dict(lr=0.01),
    "RAdam": dict(lr=0.01),
    "ASGD": dict(lr=0.01),
    "Rprop": dict(lr=0.01),
}


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen))
            for shape in [(4, 3), (3,), (5,), (2, 2)]]


def grads_for(step, params):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def groups(cls_name, params):
    kwargs = OPTIMIZERS[cls_name]
    second = {k: (v * 0.5 if k == "lr" else v) for k, v in kwargs.items()}
    return getattr(torch.optim, cls_name)(
        [{"params": params[:2]}, {"params": params[2:], **second}], **kwargs)


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("cls_name", sorted(OPTIMIZERS))
def test_updates_in_any_order_equal_one_whole_step(cls_name):
    ref_params, params = make_params(), make_params()
    ref, opt = groups(cls_name, ref_params), groups(cls_name, params)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    updater = ParameterUpdater(opt, type(opt), check=lambda: None)
    rng = random.Random(cls_name)
    for step in range(4):
        for p, g in zip(ref_params, grads_for(step, ref_params)):
            p.grad = g
        ref.step()
        ref_sched.step()
        for p, g in zip(params, grads_for(step, params)):
            p.grad = g
        order = params[:]
        rng.shuffle(order)
        early, late = order[:2], order[2:]
        for p in early:                      # reduced during backward, before step()
            updater.reduced([p])
        updater.step(params)
        sched.step()                         # the LR changes before the late updates run
        for p in late:
            updater.reduced([p])
        updater.drain()
    for a, b in zip(ref_params, params):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (cls_name, (a - b).abs().max())


def test_forward_wait_returns_once_the_parameter_is_updated():
    params = make_params()
    opt = torch.optim.SGD(params, lr=0.1)
    updater = ParameterUpdater(opt, type(opt), check=lambda: None)
    for p in params:
        p.grad = torch.ones_like(p)
    updater.step(params)
    before = params[0].detach().clone()
    released = threading.Event()

    def forward():
        updater.wait([params[0]])
        released.set()

    thread = threading.Thread(target=forward)
    thread.start()
    assert not released.wait(0.2), "forward must wait for its parameter's update"
    updater.reduced([params[1]])
    assert not released.wait(0.1), "another parameter's update must not release it"
    updater.reduced([params[0]])
    assert released.wait(5.0)
    thread.join()
    assert torch.allclose(params[0], before - 0.1)


def test_zero_grad_during_pending_updates_waits_for_each_update():
    params = make_params()
    opt = torch.optim.SGD(params, lr=0.1)
    updater = ParameterUpdater(opt, type(opt), check=lambda: None)
    for p in params:
        p.grad = torch.ones_like(p)
    updater.reduced([params[0]])
    updater.step(params)                      # params[0] updated now, the rest owed
    updater.zero_grad((), {"set_to_none": True})
    assert params[0].grad is None
    assert all(p.grad is not None for p in params[1:]), "owed updates still need their gradient"
    for p in params[1:]:
        updater.reduced([p])
    assert all(p.grad is None for p in params)
    expected = make_params()
    assert all(torch.allclose(p, e - 0.1) for p, e in zip(params, expected))


def test_errors_of_the_communication_thread_stop_a_waiting_forward():
    params = make_params()
    opt = torch.optim.SGD(params, lr=0.1)

    def failed():
        raise RuntimeError("peer failed")

    updater = ParameterUpdater(opt, type(opt), check=failed)
    for p in params:
        p.grad = torch.ones_like(p)
    updater.step(params)
    with pytest.raises(RuntimeError, match="peer failed"):
        updater.wait([params[0]])
