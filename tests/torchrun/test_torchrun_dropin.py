"""The drop-in API under torchrun: which transport the factory picks, the errors that say what
to do, ``process_group=``, and Horovod's ``step()`` / ``synchronize()`` /
``skip_synchronize()`` / ``zero_grad()`` contract on the torch.distributed transport; and the
torch counterpart of ``tests/multirank/test_dropin_swap.py``: a resume from a checkpoint that
rank 0 loads and broadcasts ends where DDP's resume ends."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from small_models import batches, make_model, max_rel_diff, params_close, train

import dcredit_hvd

from conftest import assert_all_ranks, ddp, rank

#: Every tensor over 512 bytes in several blocks.
SMALL = dict(partition_bytes=512, credit_bytes=2048)
_groups: dict[str, Any] = {}


def _raised(call: Any) -> tuple[Optional[type], str]:
    """``(type, message)`` of what ``call()`` raised, ``(None, "")`` if nothing."""
    try:
        built = call()
    except Exception as exc:
        return type(exc), str(exc)
    if hasattr(built, "close"):
        built.close()
    return None, ""


def _build(net: torch.nn.Module, **kwargs: Any) -> Any:
    return dcredit_hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                            named_parameters=net.named_parameters(), **kwargs)


def _group() -> Any:
    """A second group over every rank (``new_group`` is collective: built once, by all)."""
    if "pair" not in _groups:
        _groups["pair"] = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    return _groups["pair"]


# -- choosing the transport ---------------------------------------------------------------------
def test_default_transport_is_torch_distributed_when_horovod_is_not_initialised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCREDIT_TRANSPORT", raising=False)
    model = make_model(rank=rank())
    opt = _build(model)
    kind = type(opt._state.transport).__name__
    assert_all_ranks(kind == "TorchTransport", f"chose {kind}")
    assert_all_ranks(isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD",
                     f"{type(opt).__mro__}")
    assert_all_ranks(type(opt).__module__ == "dcredit_hvd.optimizer", type(opt).__module__)
    assert_all_ranks(opt._state.transport.group is dist.group.WORLD, "not the default group")
    opt.close()


@pytest.mark.parametrize("how", ["keyword", "variable"])
def test_transport_named_by_keyword_or_variable_is_torch_distributed(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "variable":
        monkeypatch.setenv("DCREDIT_TRANSPORT", "torch.distributed")
    model = make_model(rank=rank())
    opt = _build(model, **({"transport": "torch.distributed"} if how == "keyword" else {}))
    kind = type(opt._state.transport).__name__
    assert_all_ranks(kind == "TorchTransport" and opt.scheduler_config.transport
                     == "torch.distributed", f"chose {kind}")
    train(model, opt, steps=2, rank=rank())
    opt.close()


def test_transport_horovod_without_hvd_init_says_to_call_it_or_install_it() -> None:
    model = make_model(rank=rank())
    kind, message = _raised(lambda: _build(model, transport="horovod"))
    assert_all_ranks(kind is not None and ("hvd.init()" in message or "not installed" in message),
                     f"got {kind}: {message!r}")


def test_a_misspelled_transport_is_refused_naming_the_choices() -> None:
    model = make_model(rank=rank())
    kind, message = _raised(lambda: _build(model, transport="nccl"))
    assert_all_ranks(kind is ValueError and "'torch.distributed'" in message,
                     f"got {kind}: {message!r}")


def test_an_op_torch_distributed_cannot_average_with_is_refused_at_construction() -> None:
    model = make_model(rank=rank())
    kind, message = _raised(lambda: _build(model, op=dist.ReduceOp.MAX))
    assert_all_ranks(kind is ValueError and "not supported on torch.distributed" in message,
                     f"got {kind}: {message!r}")
    opt = _build(model, **SMALL)           # the refusal left the group's order usable
    train(model, opt, steps=1, rank=rank())
    opt.close()


def _horovod_ops() -> dict[str, Any]:
    """Horovod's ``Average`` and ``Sum`` (0 and 1 in horovod.torch 0.28.1, when not installed)."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return {"Average": 0, "Sum": 1}
    return {"Average": hvd.Average, "Sum": hvd.Sum}


@pytest.mark.parametrize("name", ["Average", "Sum"])
def test_horovods_op_constants_are_refused_under_torchrun(name: str) -> None:
    """``hvd.Average`` and ``hvd.Sum`` are ints (0 and 1) that ``ReduceOp.SUM`` and
    ``ReduceOp.AVG`` compare equal to: taken as ops they would swap the mean and the sum."""
    model = make_model(rank=rank())
    kind, message = _raised(lambda: _build(model, op=_horovod_ops()[name]))
    assert_all_ranks(kind is ValueError and "not supported on torch.distributed" in message,
                     f"op=hvd.{name}: got {kind}: {message!r}")


# -- process_group= -----------------------------------------------------------------------------
@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_a_process_group_given_carries_the_collectives_and_matches_ddp_over_it(
        with_model: bool) -> None:
    group = _group()
    model = make_model(rank=rank())
    expected = train(model, torch.optim.Adam(model.parameters(), lr=0.01), rank=rank(),
                     forward=ddp(model, process_group=group))
    model = make_model(rank=rank())
    opt: Any = dcredit_hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
        model=model if with_model else None, process_group=group, **SMALL)
    log = opt._state.transport.issue_log
    before = len(log())
    got = train(model, opt, rank=rank())
    assert_all_ranks(opt._state.transport.group is group, "not the group given")
    assert_all_ranks(len(log()) > before, "nothing was issued on the group given")
    assert_all_ranks(params_close(got, expected), f"max rel diff {max_rel_diff(got, expected)}")
    opt.close()


def test_process_set_and_process_group_together_are_refused() -> None:
    model = make_model(rank=rank())
    kind, message = _raised(lambda: _build(model, process_set=_group(), process_group=_group()))
    assert_all_ranks(kind is ValueError and "not both" in message, f"got {kind}: {message!r}")


def test_a_process_group_that_is_no_group_is_refused() -> None:
    model = make_model(rank=rank())
    kind, message = _raised(lambda: _build(model, process_group="world"))
    assert_all_ranks(kind is TypeError and "str" in message, f"got {kind}: {message!r}")


# -- Horovod's contract on this transport -------------------------------------------------------
def test_zero_grad_between_backward_and_step_raises_horovods_error() -> None:
    model = make_model(rank=rank())
    opt = _build(model, **SMALL)
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    kind, message = _raised(opt.zero_grad)
    opt.synchronize()           # drain what the backward pass released, on every rank
    assert_all_ranks(kind is AssertionError and "before optimizer.step() or "
                     "optimizer.synchronize()" in message, f"got {kind}: {message!r}")
    opt.close()


def test_more_backward_passes_than_declared_raises_horovods_error() -> None:
    model = make_model(rank=rank())
    opt = _build(model, **SMALL)
    x = torch.randn(4, 3, 8, 8)
    model(x).sum().backward()
    kind, message = _raised(lambda: model(x).sum().backward())
    opt.synchronize()
    assert_all_ranks(kind is AssertionError and "more than backward_passes_per_step" in message,
                     f"got {kind}: {message!r}")
    opt.close()


def test_step_after_synchronize_without_skip_warns_like_horovod() -> None:
    model = make_model(rank=rank())
    opt = _build(model, **SMALL)
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert_all_ranks(any("skip_synchronize" in str(w.message) for w in caught),
                     "expected the double-synchronize warning")
    opt.close()


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_zero_grad_with_set_to_none_false_keeps_gradients_allocated(with_model: bool) -> None:
    model = make_model(rank=rank())
    opt = _build(model, model=model if with_model else None, **SMALL)
    train(model, opt, steps=2, rank=rank())
    trained = [p for p in model.parameters() if p.requires_grad]
    opt.zero_grad(set_to_none=False)
    opt.apply_pending_updates()
    zeroed = all(p.grad is not None and not p.grad.any() for p in trained)
    assert_all_ranks(zeroed, "zero_grad(set_to_none=False) must zero, not drop, gradients")
    opt.close()


def test_the_wrapped_optimizer_round_trips_its_state_and_trains_on() -> None:
    model = make_model(rank=rank())
    opt = dcredit_hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9),
                                           named_parameters=model.named_parameters())
    train(model, opt, steps=2, rank=rank())
    state = opt.state_dict()
    opt.load_state_dict(state)
    after = opt.state_dict()
    same = all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
               for a, b in zip(state["state"].values(), after["state"].values()))
    train(model, opt, steps=1, rank=rank())       # still trains after load_state_dict
    assert_all_ranks(same, "the momentum buffers changed in a state_dict round trip")
    opt.close()


# -- resume from a checkpoint (rank 0 loads, broadcasts) ------------------------------------------
BEFORE, AFTER = 3, 3


def _steps(forward: torch.nn.Module, opt: Any, micro_batches: list) -> None:
    for (x, y), in micro_batches:
        opt.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        opt.step()


def _resume(checkpoint: dict, data: list, ours: bool,
            with_model: bool = False) -> list[torch.Tensor]:
    """A fresh model and optimizer (other weights); rank 0 loads the checkpoint, every rank
    receives it by ``broadcast_object_list`` and loads it, then training goes on."""
    model = make_model(seed=99, rank=rank())
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = (dcredit_hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                            model=model if with_model else None, **SMALL)
           if ours else base)
    box = [copy.deepcopy(checkpoint) if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model.load_state_dict(box[0]["model"])
    opt.load_state_dict(box[0]["optimizer"])
    _steps(model if ours else ddp(model), opt, data)
    if ours:
        opt.apply_pending_updates()
        opt.close()
    return [v.detach().clone() for v in model.state_dict().values()]


@pytest.mark.parametrize("with_model", [False, True], ids=["no-model", "model"])
def test_a_resume_from_a_broadcast_checkpoint_ends_where_ddps_resume_ends(
        with_model: bool) -> None:
    data = batches(BEFORE + AFTER, rank=rank())
    model = make_model(rank=rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _steps(ddp(model), opt, data[:BEFORE])
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    expected = _resume(checkpoint, data[BEFORE:], ours=False)
    got = _resume(checkpoint, data[BEFORE:], ours=True, with_model=with_model)
    assert_all_ranks(params_close(got, expected),
                     f"after resume: max rel diff {max_rel_diff(got, expected)}")


@pytest.mark.parametrize("shard", [False, True], ids=["plain", "shard"])
def test_exit_lets_a_failed_iterations_collectives_finish_and_ends_the_completion_thread(
        shard: bool) -> None:
    """A script that raises between ``backward()`` and ``step()`` leaves blocks in flight; the
    exit (``lifetime.at_exit``, what ``atexit`` runs) waits for them and ends the completion
    thread, so no thread of ours polls inside torch when the interpreter finalizes (Python
    3.11 would end it with ``pthread_exit``: SIGABRT, ``terminate called``)."""
    import weakref

    from dcredit_hvd.runtime import lifetime

    model = make_model()                  # the same code path on every rank: all can finish
    opt: Any = dcredit_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        transport="torch.distributed", policy="bytescheduler", shard=shard,
        race_amplifier=0.005, **({} if shard else SMALL))
    x, y = batches(1, rank=rank())[0][0]
    F.cross_entropy(model(x), y).backward()          # no step(): the user's script raised here
    scheduler = opt._state.scheduler
    in_flight = scheduler.in_flight
    lifetime.at_exit(weakref.ref(opt))
    thread = scheduler._thread
    assert_all_ranks(in_flight > 0 and scheduler.in_flight == 0
                     and (thread is None or not thread.is_alive()),
                     f"in flight before the exit {in_flight}, after it {scheduler.in_flight}, "
                     f"completion thread alive: {thread is not None and thread.is_alive()}")
