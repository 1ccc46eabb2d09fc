"""Reliability under ``mpirun -np 2`` / ``horovodrun --gloo``: errors of the communication thread
surface in the training thread, nothing hangs or leaks, configuration errors that need a model and
two ranks are clear, and a short soak keeps memory, handles and names flat.

Every test gives its parameters names of its own (``prefix``): a test that fails on purpose may
leave an all-reduce half-finished in Horovod, and a later test must not reuse its name.
"""
from __future__ import annotations

import gc
import importlib.util
import sys
import threading
import time
import weakref
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from horovod.common.exceptions import HorovodInternalError

import dcredit_hvd
from dcredit_hvd.runtime import scheduler
from dcredit_hvd.transports import horovod as comm

from conftest import assert_all_ranks

ROOT = Path(__file__).resolve().parents[2]
#: An error must surface within this many seconds of being raised in the background thread.
SURFACE_LIMIT_S = 10.0


def net() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def wrap(opt, model, prefix, with_model=True, **kwargs):
    kwargs = {"policy": "wfbp", "partition_bytes": 512, **kwargs}
    return dcredit_hvd.DistributedOptimizer(
        opt, named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()],
        model=model if with_model else None, **kwargs)


def one_step(model, opt, step, pause=0.0):
    """One iteration; returns the phase that raised ("zero_grad", "forward", ...) and the error.
    ``pause``: seconds between backward and step (every block is reduced by then)."""
    gen = torch.Generator().manual_seed(step * 10 + hvd.rank())
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    phase = "zero_grad"
    try:
        opt.zero_grad()
        phase = "forward"
        loss = F.cross_entropy(model(x), y)
        phase = "backward"
        loss.backward()
        time.sleep(pause)
        phase = "step"
        opt.step()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever surfaced
        return phase, exc
    return None, None


def chain_text(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def train_until_error(model, opt, steps=8, arm=None, arm_at=2, pause=0.0):
    """Train; call ``arm()`` before iteration ``arm_at``; returns (phase, error, iteration,
    seconds from arming to the error)."""
    armed_at = None
    for step in range(steps):
        if step == arm_at and arm is not None:
            arm()
            armed_at = time.perf_counter()
        phase, exc = one_step(model, opt, step, pause)
        if exc is not None:
            return phase, exc, step, time.perf_counter() - (armed_at or time.perf_counter())
    return None, None, steps, None


def call_with_limit(fn, seconds: float):
    """``fn()`` in a daemon thread: ("returned"|"raised"|"hung", error)."""
    box = {}

    def target():
        try:
            fn()
            box["result"] = ("returned", None)
        except Exception as exc:  # noqa: BLE001
            box["result"] = ("raised", exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return box.get("result", ("hung", None))


def forget(opt) -> None:
    """A test that broke an optimizer on purpose: make sure its exit handler has nothing to wait
    for, so a bug under test cannot hang the interpreter's exit."""
    opt._step_in_flight = False
    opt._updater.reset()          # releases a reader stuck waiting for owed updates
    opt._scheduler.close()


# -- errors of the background thread ------------------------------------------------------------
class ArmedSGD(torch.optim.SGD):
    """SGD whose ``step`` raises once armed (the flag is shared with the per-parameter shadows
    that dcredit_hvd's updater runs in its completion thread)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.armed = {"on": False}

    def step(self, closure=None):
        if self.armed["on"]:
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


OPTIMIZER_ERROR_CASES = [
    # (with model=, pause before step): overlap updates run in the completion thread as blocks
    # arrive; after a pause every block is reduced and step() applies the updates itself.
    pytest.param(True, 0.0, id="overlap-completion-thread"),
    pytest.param(True, 0.3, id="overlap-at-step"),
    pytest.param(False, 0.0, id="sync"),
]


@pytest.mark.parametrize("with_model,pause", OPTIMIZER_ERROR_CASES)
def test_an_optimizer_exception_surfaces_in_the_training_thread(with_model, pause):
    model = net()
    base = ArmedSGD(model.parameters(), lr=0.1)
    opt = wrap(base, model, f"rel.opterr.{with_model}.{pause}", with_model=with_model)

    def arm():
        # Both ranks must fail on the same iteration's updates: with overlap, the previous
        # step's updates may still be running when the training thread arms, on one rank only.
        opt.apply_pending_updates()
        opt.armed.update(on=True)

    phase, exc, step, seconds = train_until_error(model, opt, arm=arm, pause=pause)
    text = chain_text(exc) if exc is not None else ""
    assert_all_ranks(exc is not None, "training went on after the optimizer raised")
    assert_all_ranks("injected optimizer failure" in text, f"surfaced {text!r} at {phase}")
    assert_all_ranks(step <= 3, f"surfaced only at iteration {step} ({phase})")
    assert_all_ranks(seconds < SURFACE_LIMIT_S, f"surfaced after {seconds:.1f} s")
    # The broken optimizer must not hang its next reader either: it raises (or returns).
    outcome, _ = call_with_limit(opt.state_dict, 5.0)
    forget(opt)
    assert_all_ranks(outcome != "hung", "state_dict() hung after the optimizer raised")


def test_a_rank_left_waiting_by_its_peer_warns_then_raises_a_stall_error(capfd):
    """Uneven batches: rank 0 runs one iteration more than rank 1.  Rank 0 must log which
    blocks wait (and where Horovod names the missing ranks) after ``stall_seconds``, then raise
    ``StallError`` in the training thread after ``stall_abort_seconds``, not hang."""
    model = net()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, "rel.stall", with_model=False,
               stall_seconds=0.5, stall_abort_seconds=3.0)
    steps = 3 if hvd.rank() == 0 else 2
    started = time.perf_counter()
    phase, exc, step, _ = train_until_error(model, opt, steps=steps)
    seconds = time.perf_counter() - started
    err = capfd.readouterr().err
    if hvd.rank() == 0:
        ok = (isinstance(exc, scheduler.StallError) and phase == "step" and step == 2
              and "rel.stall" in str(exc) and seconds < 3.0 + SURFACE_LIMIT_S
              and "still outstanding" in err and "rel.stall" in err
              and "HOROVOD_STALL_CHECK_TIME_SECONDS" in err)
        detail = f"{type(exc).__name__}: {exc} at {phase}/{step} after {seconds:.1f} s; log {err[-600:]!r}"
    else:
        ok, detail = exc is None, f"rank 1 raised {exc!r}"
    forget(opt)
    assert_all_ranks(ok, detail)


def collect_failing_at(when: dict):
    """``comm.collect`` that raises Horovod's error on its ``when["n"]``-th call on this rank
    once ``n`` is set (the construction's own collectives, before, are not counted).

    ``n`` is set to the number of blocks of one iteration: the failing collect is then the last
    block of the first iteration, which completed on both ranks, so both ranks have submitted
    exactly the same names when they stop and no half-submitted all-reduce is left in Horovod
    for the tests that follow (or for Horovod's shutdown) to trip over.
    """
    calls = [0]
    real = comm.collect

    def collect(handle):
        if when["n"] < 0:
            return real(handle)
        calls[0] += 1
        output = real(handle)
        if calls[0] == when["n"]:
            raise HorovodInternalError("injected Horovod failure")
        return output
    return collect


def blocks_per_iteration(opt) -> int:
    return sum(len(t.blocks) for t in opt.layouts)


@pytest.mark.parametrize("with_model", [True, False], ids=["overlap", "sync"])
def test_a_horovod_error_in_the_completion_thread_surfaces_at_the_next_call(monkeypatch, with_model):
    when = {"n": -1}
    monkeypatch.setattr(comm, "collect", collect_failing_at(when))
    model = net()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, f"rel.hvderr.{with_model}",
               with_model=with_model)
    when["n"] = blocks_per_iteration(opt)
    phase, exc, step, _ = train_until_error(model, opt)
    text = chain_text(exc) if exc is not None else ""
    forget(opt)
    assert_all_ranks(isinstance(exc, HorovodInternalError), f"expected HorovodInternalError, got {text!r}")
    assert_all_ranks("injected Horovod failure" in text and "HorovodInternalError" in text, text)
    assert_all_ranks(step <= 2, f"surfaced only at iteration {step} ({phase})")


def test_a_horovod_error_surfaces_as_horovod_internal_error_for_elastic(monkeypatch):
    when = {"n": -1}
    monkeypatch.setattr(comm, "collect", collect_failing_at(when))
    model = net()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, "rel.elasticerr")
    when["n"] = blocks_per_iteration(opt)
    _, exc, _, _ = train_until_error(model, opt)
    forget(opt)
    assert_all_ranks(isinstance(exc, HorovodInternalError), f"got {chain_text(exc)!r}")


# -- clean shutdown -----------------------------------------------------------------------------
def completion_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dcredit-completion" and t.is_alive()]


def test_no_thread_keeps_the_process_alive():
    model = net()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=0.01), model, "rel.daemon")
    train_until_error(model, opt, steps=3)
    opt.apply_pending_updates()
    others = [t.name for t in threading.enumerate()
              if t is not threading.main_thread() and not t.daemon]
    assert_all_ranks(not others, f"non-daemon threads would keep the process alive: {others}")


def test_completion_threads_end_with_their_optimizer():
    before = len(completion_threads())
    for i in range(3):
        model = net()
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, f"rel.threads.{i}")
        train_until_error(model, opt, steps=2)
        opt.apply_pending_updates()
        del model, opt
    gc.collect()             # no wait: each completion thread ended with its last iteration
    after = len(completion_threads())
    assert_all_ranks(after <= before, f"{after - before} completion thread(s) outlived their optimizer")


def test_optimizers_over_one_process_set_share_its_channel_while_any_holds_a_lease():
    """Horovod's side of ``tests/torchrun/test_liveness_leases.py`` (which has groups of its
    own, so it can also watch a channel end): the second optimizer reuses the channel every
    rank holds, and closing one leaves it to the other."""
    first_model, second_model = net(), net()
    first = wrap(torch.optim.SGD(first_model.parameters(), lr=0.1), first_model, "rel.lease.a")
    second = wrap(torch.optim.SGD(second_model.parameters(), lr=0.1), second_model, "rel.lease.b")
    channel = first._state.peers.channel
    tokens = hvd.allgather_object(channel.token, name="rel.lease.tokens")
    assert_all_ranks(second._state.peers.channel is channel and len(set(tokens)) == 1,
                     f"two channels, or the ranks disagree on one: {tokens}")
    first.close()
    train_until_error(second_model, second, steps=2)
    others = [r for r in range(hvd.size()) if r != hvd.rank()]
    assert_all_ranks(not channel.ended and channel.connected() == others and not channel.lost,
                     f"the channel ended with a lease held: {channel.connected()}, {channel.lost}")
    second.close()


def test_exit_lets_a_failed_iterations_blocks_finish_and_ends_the_completion_thread():
    """A script that raised between ``backward()`` and ``step()``: the exit
    (``lifetime.at_exit``, run by ``atexit``) waits for the blocks in flight and ends the
    completion thread, so none polls inside Horovod when the interpreter finalizes (Python
    3.11 would end it with ``pthread_exit``: SIGABRT).  The torch.distributed twin is in
    ``tests/torchrun/test_torchrun_dropin.py``."""
    from dcredit_hvd.runtime import lifetime

    model = net()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, "rel.exit", with_model=False,
               policy="bytescheduler", credit_bytes=1024, race_amplifier=0.005)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(hvd.rank()))
    F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()   # no step()
    sched = opt._state.scheduler
    in_flight = sched.in_flight
    lifetime.at_exit(weakref.ref(opt))
    alive = sched._thread is not None and sched._thread.is_alive()
    assert_all_ranks(in_flight > 0 and sched.in_flight == 0 and not alive,
                     f"in flight before the exit {in_flight}, after it {sched.in_flight}, "
                     f"completion thread alive: {alive}")


# -- configuration errors that need a model and two ranks -----------------------------------------
def construction_error(**kwargs) -> str:
    try:
        model_a, model_b = net(), net()
        opt = torch.optim.SGD(model_a.parameters(), lr=0.1)
        chosen = {"model": model_b, **kwargs}
        dcredit_hvd.DistributedOptimizer(
            opt, named_parameters=[(f"rel.cfg.{n}", p) for n, p in model_a.named_parameters()],
            **chosen)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return ""


def test_a_model_whose_parameters_are_not_the_optimizers_is_rejected():
    message = construction_error()
    assert_all_ranks("model= was given a Sequential none of whose parameters are updated by this "
                     "optimizer" in message, f"no error naming the mismatch: {message!r}")


def test_optimizer_parameters_outside_the_model_are_refused_on_every_rank_naming_them():
    # With model=, a parameter outside the model could be read before its update: an error,
    # raised on every rank before any collective, so no rank is left waiting.
    model = net()
    outside = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(list(model.parameters()) + [outside], lr=0.1)
    named = [(f"rel.cfg2.{n}", p) for n, p in model.named_parameters()] + [("rel.cfg2.outside", outside)]
    message = ""
    try:
        dcredit_hvd.DistributedOptimizer(opt, named_parameters=named, model=model)
    except ValueError as exc:
        message = str(exc)
    assert_all_ranks("does not contain 1 parameter(s) that this optimizer updates: "
                     "rel.cfg2.outside" in message, f"no error naming the parameter: {message!r}")


@pytest.mark.parametrize("kwargs,expected", [
    (dict(policy="fastest"), "not a known policy; choose one of"),
    (dict(partition_bytes=0), "partition_bytes must be > 0"),
    (dict(credit_bytes="lots"), "credit_bytes must be a number of bytes"),
    (dict(poll_seconds=-1), "poll_seconds must be > 0"),
    (dict(stall_seconds="soon"), "stall_seconds must be a number"),
    (dict(profile_steps=0), "profile_steps must be a whole number >= 1"),
])
def test_bad_options_fail_on_every_rank_before_any_collective(kwargs, expected):
    model = net()
    message = ""
    try:
        wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, "rel.bad", **kwargs)
    except ValueError as exc:
        message = str(exc)
    assert_all_ranks(expected in message, f"{kwargs}: got {message!r}")


# -- soak (short) ---------------------------------------------------------------------------------
def load_soak():
    spec = importlib.util.spec_from_file_location("dcredit_soak", ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_short_soak_keeps_memory_handles_and_names_flat():
    soak = load_soak()
    # Short race rounds: the race (which installs each candidate's layout) ends before the
    # warm-up does, so what follows is the winner's steady state.
    report = soak.run_soak(steps=90, warmup=30, policy="dcredit", prefix="rel.soak",
                           tune_rounds=(2, 2), tune_drop=0)
    # A short run measures less memory noise than the 2,000-step one: same 5% limit.
    problems = report.failures()
    assert_all_ranks(not problems, f"{problems}; {report}")
