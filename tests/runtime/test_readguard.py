"""The read guard (``readguard``): a read of a parameter whose update is owed waits for it,
wherever the read happens; the first forward's read order is observed.  No Horovod here."""
from __future__ import annotations

import copy
import pickle
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dcredit_hvd.runtime.readguard import ReadGuard
from dcredit_hvd.runtime.updates import ParameterUpdater


class _Gate:
    """A ``wait`` for the guard that blocks until ``open()``, and counts its calls."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.calls: list[list[torch.Tensor]] = []

    def __call__(self, params: list[torch.Tensor]) -> None:
        self.calls.append(list(params))
        if not self.opened.wait(timeout=10):
            raise TimeoutError("the gate never opened")


def _later(seconds: float, action) -> threading.Thread:
    def run():
        time.sleep(seconds)
        action()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_read_of_a_held_parameter_waits_until_it_is_updated_and_released():
    p = nn.Parameter(torch.zeros(3))
    gate = _Gate()
    guard = ReadGuard(gate)
    guard.hold([p])

    def update():
        with guard.applying(), torch.no_grad():
            p.add_(1.0)             # the updater's own reads and writes do not wait
        guard.release([p])
        gate.opened.set()

    thread = _later(0.2, update)
    started = time.perf_counter()
    seen = (p * 2).tolist()         # waits
    thread.join()
    assert time.perf_counter() - started >= 0.15
    assert seen == [2.0, 2.0, 2.0]
    assert type(p) is nn.Parameter and not guard.held(p)


class _TiedParent(nn.Module):
    """A parent that reads a child's weight itself, before and after the child runs, and a
    bare root parameter read first: reads an owner's pre-hook never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.embed = nn.Embedding(5, 4)
        self.body = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.scale * F.embedding(ids, self.embed.weight)
        return F.linear(self.body(x), self.embed.weight)       # tied output projection


def test_forward_reads_outside_the_owning_module_wait_for_the_update():
    model = _TiedParent()
    gate = _Gate()
    guard = ReadGuard(gate)
    guard.hold(list(model.parameters()))
    _later(0.1, gate.opened.set)
    model(torch.tensor([[0, 1]]))
    waited_for = {id(p) for call in gate.calls for p in call}
    assert waited_for >= {id(model.scale), id(model.embed.weight)}


def test_metadata_reads_do_not_wait():
    p = nn.Parameter(torch.zeros(2, 3))
    guard = ReadGuard(lambda params: pytest.fail("metadata read waited"))
    guard.hold([p])
    assert p.shape == (2, 3) and p.dtype == torch.float32 and p.size(1) == 3
    assert p.numel() == 6 and p.dim() == 2 and p.requires_grad and p.is_leaf
    assert p.device.type == "cpu" and p.is_contiguous()
    assert p in {p}                 # hashing is by identity, never a read


def test_a_failed_wait_makes_every_read_raise_and_keeps_the_parameter_held():
    p = nn.Parameter(torch.zeros(2))

    def failing(params):
        raise RuntimeError("update failed")

    guard = ReadGuard(failing)
    guard.hold([p])
    for read in (lambda: p + 1, lambda: p.data, lambda: p.detach(), lambda: p.tolist()):
        with pytest.raises(RuntimeError, match="update failed"):
            read()
    assert guard.held(p)
    guard.release_all()
    assert type(p) is nn.Parameter and (p + 1).tolist() == [1.0, 1.0]


def test_copies_of_a_held_parameter_are_of_the_users_class():
    p = nn.Parameter(torch.arange(3.0))
    gate = _Gate()
    gate.opened.set()
    guard = ReadGuard(gate)
    guard.hold([p])
    assert isinstance(p, nn.Parameter)
    assert type(copy.deepcopy(p)) is nn.Parameter
    assert type(pickle.loads(pickle.dumps(p))) is nn.Parameter
    assert type(p + 1) is torch.Tensor          # results are plain tensors, as for Parameter
    guard.release([p])
    assert type(p) is nn.Parameter


def test_a_parameter_class_with_its_own_torch_function_is_refused():
    class Custom(nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    plain, custom = nn.Parameter(torch.zeros(1)), Custom(torch.zeros(1))
    guard = ReadGuard(lambda params: None)
    assert guard.hold([plain, custom]) == [custom]
    assert guard.held(plain) and not guard.held(custom) and type(custom) is Custom


def test_the_first_forward_read_order_is_observed_and_reads_outside_forward_do_not_count():
    model = _TiedParent()
    guard = ReadGuard(lambda params: None)
    guard.observe(list(model.parameters()))
    model.state_dict()                            # outside forward: reads in registration order
    _ = model.body.weight.sum()
    guard.forward_started()
    model(torch.tensor([[0, 1]]))
    guard.forward_ended()
    order = guard.stop_observing()
    # F.embedding runs before the multiplication by scale: the order of reads, not of code.
    assert [id(p) for p in order] == [id(model.embed.weight), id(model.scale),
                                      id(model.body.weight), id(model.body.bias)]
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_the_updater_holds_parameters_from_step_until_their_update():
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))]
    opt = torch.optim.SGD(params, lr=0.5)
    updater: ParameterUpdater

    def wait(ps):
        updater.wait(ps)

    guard = ReadGuard(wait)
    updater = ParameterUpdater(opt, type(opt), check=lambda: None, guard=guard)
    for p in params:
        p.grad = torch.ones(2)
    updater.reduced([params[0]])                     # reduced before step(): applied at step()
    assert updater.step(params) == []
    assert not guard.held(params[0]) and guard.held(params[1])
    _later(0.1, lambda: updater.reduced([params[1]]))
    assert (params[1] * 1).tolist() == [0.5, 0.5]  # the read waited for the update
    assert params[0].tolist() == [0.5, 0.5]
    assert not guard.held(params[1]) and updater.owed == 0


def test_a_parameter_held_for_its_values_only_reaches_its_gradient_without_waiting():
    # The sharded all-gathers hold parameters for their values: zero_grad() (or any .grad
    # access) before the next forward must not wait for every all-gather to land.
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    gate = _Gate()
    guard = ReadGuard(gate)
    guard.hold([p], values_only=True)
    assert p.grad.tolist() == [1.0, 1.0]
    p.grad = None
    p.grad = torch.full((2,), 3.0)
    del p.grad
    torch.optim.SGD([p], lr=0.1).zero_grad()
    assert gate.calls == [] and guard.held(p)
    gate.opened.set()
    assert (p + 1).tolist() == [1.0, 1.0]            # a read of its values still waits
    assert len(gate.calls) == 1


def test_an_owed_update_still_makes_gradient_access_wait():
    # Held for its update (the update reads p.grad): zeroing the gradient first would lose it.
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    gate = _Gate()
    gate.opened.set()
    guard = ReadGuard(gate)
    guard.hold([p], values_only=True)
    guard.hold([p])                                  # a full hold supersedes values_only
    assert p.grad.tolist() == [1.0, 1.0]
    assert len(gate.calls) == 1
