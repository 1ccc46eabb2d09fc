"""The optimizer's parts, each on its own, over a fake transport (no Horovod, one process):
``transport``/``transports``, ``state``, ``units``, ``checks``, ``gradients``, ``lifecycle``,
``overlap``, ``instrument``, ``lifetime``, ``arguments``, ``runtime``."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dcredit_hvd import arguments, transports
from dcredit_hvd.config import SchedulerConfig
from dcredit_hvd.planning.engine import Execution
from dcredit_hvd.policies import Immediate
from dcredit_hvd.runtime import assembly as runtime
from dcredit_hvd.runtime import checks, lifetime, units
from dcredit_hvd.runtime.gradients import TOO_MANY_PASSES, GradientPath
from dcredit_hvd.runtime.instrument import Instrumentation
from dcredit_hvd.runtime.lifecycle import PlanLifecycle
from dcredit_hvd.runtime.overlap import SHUTDOWN_IN_FLIGHT, Overlap, compiled
from dcredit_hvd.runtime.scheduler import BlockScheduler, SchedulerError
from dcredit_hvd.runtime.state import Hooks, OptimizerState
from dcredit_hvd.transports.base import Transport


class Failed(RuntimeError):
    pass


class FakeTransport:
    """One rank; an all-reduce is the identity, done at once; objects go nowhere."""

    failure = Failed
    average, sum = "average", "sum"
    elastic = False

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self._rank, self._size, self.up = rank, size, True
        self.sent: list[str] = []
        self.gathered: list[str] = []
        self.results: dict[int, torch.Tensor] = {}

    def rank(self): return self._rank
    def size(self): return self._size
    def included(self): return True
    def group_id(self): return 0
    def job_rank(self): return self._rank
    def job_size(self): return self._size
    def is_up(self): return self.up
    def gpu_operations(self): return False
    def execution(self): return Execution(cycle_s=0.0, fusion_bytes=0)

    def submit(self, tensor, name, op, prescale=1.0, postscale=1.0):
        self.sent.append(name)
        self.results[len(self.sent)] = tensor
        return len(self.sent)

    def reduce_scatter(self, flat, name, op):      # one rank: its shard is everything
        return self.submit(flat.clone(), name, op)

    def all_gather(self, shard, name, numel):
        return self.submit(shard.clone(), name, None)

    def poll(self, handle): return True
    def collect(self, handle): return self.results.pop(handle)
    def wait(self, handle, poll_seconds=0.0002): return self.collect(handle)
    def broadcast_object(self, obj, name, root=0): return obj

    def allgather_object(self, obj, name):
        self.gathered.append(name)
        return [obj]

    def watch_peers(self, settings=None): return None

    def close(self): pass


def _state(params, names=None, **config) -> OptimizerState:
    names = names or {p: f"p{i}" for i, p in enumerate(params)}
    state = OptimizerState(
        config=SchedulerConfig.resolve({}, **{"policy": "bytescheduler", **config}),
        transport=FakeTransport(), compression=_NoCompression, op="average", predivide=1.0,
        sparse_as_dense=False, passes=1, names=names, requires_update=list(params),
        enabled=True)
    state.delay = {p: 1 for p in params}
    state.order = state.initial = list(params)
    state.prefix = "t"
    return state


class _NoCompression:
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _Parts:
    """Every part over one state, with a real scheduler on the fake transport."""

    def __init__(self, state: OptimizerState) -> None:
        self.instrument = Instrumentation(state)
        self.lifecycle = PlanLifecycle(state, self.instrument)
        self.overlap = Overlap(state, self.lifecycle, self.instrument)
        self.gradients = GradientPath(state, self.instrument, self.lifecycle, self.overlap)
        policy = self.lifecycle.start_schedule()
        state.scheduler = BlockScheduler(policy, submit=self.gradients.submit_item,
                                         poll=state.transport.poll,
                                         collect=state.transport.collect, poll_seconds=1e-4)


# -- transport ---------------------------------------------------------------------------------
def test_the_fake_and_horovod_transports_satisfy_the_protocol():
    from dcredit_hvd.transports import horovod, torch_distributed
    assert isinstance(FakeTransport(), Transport)
    assert isinstance(horovod.HorovodTransport(horovod.GLOBAL_PROCESS_SET), Transport)
    # the torch.distributed transport's methods, without a process group to build one over
    assert all(callable(getattr(torch_distributed.TorchTransport, name, None))
               for name in ("reduce_scatter", "all_gather", "submit", "poll", "collect"))


def test_the_horovod_transport_looks_its_functions_up_at_each_call(monkeypatch):
    from dcredit_hvd.transports import horovod
    link = horovod.transport(horovod.GLOBAL_PROCESS_SET)
    monkeypatch.setattr(horovod, "collect", lambda handle: ("collected", handle))
    monkeypatch.setattr(horovod, "poll", lambda handle: handle == 3)
    assert link.collect(7) == ("collected", 7) and link.poll(3) and not link.poll(4)
    assert link.failure is horovod.HorovodInternalError and link.sum is horovod.SUM


def test_a_group_no_transport_accepts_is_refused():
    from dcredit_hvd.transports import horovod
    assert isinstance(transports.for_group(horovod.GLOBAL_PROCESS_SET), horovod.HorovodTransport)
    with pytest.raises(TypeError, match="process_set must be a group of one of the transports"):
        transports.for_group(object())


# -- state, units, checks --------------------------------------------------------------------
def test_hooks_remove_every_handle_once():
    removed = []

    class Handle:
        def remove(self):
            removed.append(self)
    hooks = Hooks(handles=[Handle()], layers=[Handle(), Handle()])
    hooks.remove()
    hooks.remove()
    assert len(removed) == 3 and hooks.handles == [] and hooks.layers == []


def test_units_map_each_member_to_its_unit_and_offset():
    params = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(5)]
    state = _state(params)
    layouts = units.build_layouts(state, 1 << 20, groups=(2, 1))
    assert [len(m) for m in state.members] == [2, 1]
    assert state.index[params[1]] == 0 and state.offset[params[1]] == 3
    assert state.index[params[2]] == 1 and state.offset[params[2]] == 0
    assert layouts[0].grouped and not layouts[1].grouped
    assert units.kind(params[0]) == "torch.float32" and units.element_size(state, params[0]) == 4


def test_the_construction_description_holds_what_ranks_must_share():
    params = [torch.zeros(3)]
    state = _state(params)
    described = checks.construction(state)
    assert described["parameters"] == [("p0", (3,), "torch.float32")]
    assert described["policy"] == "bytescheduler" and list(described)[-1] == "prefix"
    state.layouts = units.build_layouts(state, 1 << 20)
    checks.check_layouts(state, "now")
    assert state.transport.gathered == ["t.layout.digest"]


# -- gradient path -----------------------------------------------------------------------------
def test_a_grouped_unit_goes_out_once_its_last_gradient_is_in_and_comes_back():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    state = _state(params)
    parts = _Parts(state)
    state.layouts = units.build_layouts(state, 1 << 20, groups=(2,))
    state.scheduler.policy = Immediate()
    state.scheduler.policy.bind(state.layouts)
    for value, p in zip((1.0, 2.0), params):
        p.grad = torch.full_like(p, value)
        parts.gradients.grad_ready(p)
        assert len(state.transport.sent) == (0 if p is params[0] else 1)
    parts.gradients.send_rest()
    state.scheduler.wait_all()
    assert state.transport.sent[0].startswith("t.p0+1.")
    assert torch.equal(params[1].grad, torch.full((2,), 2.0)) and not state.pending


def test_a_second_gradient_before_step_is_horovods_error():
    p = torch.nn.Parameter(torch.zeros(2))
    state = _state([p])
    parts = _Parts(state)
    p.grad = torch.ones(2)
    parts.gradients.grad_ready(p)
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        parts.gradients.grad_ready(p)
    assert "Increase backward_passes_per_step" in TOO_MANY_PASSES


def test_a_sparse_gradient_needs_sparse_as_dense():
    p = torch.nn.Parameter(torch.zeros(4))
    state = _state([p])
    parts = _Parts(state)
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(ValueError, match="sparse_as_dense=True"):
        parts.gradients.grad_ready(p)


# -- lifecycle -----------------------------------------------------------------------------------
def test_the_start_gates_on_rank_0_only_and_profiles_for_dcredit():
    p = torch.nn.Parameter(torch.zeros(2))
    state = _state([p], policy="dcredit")
    parts = _Parts(state)
    assert state.is_gate and state.profiler is not None and state.plan is None
    state.transport._rank = 1
    assert isinstance(parts.lifecycle.start_schedule(), Immediate)


def test_membership_is_followed_only_in_elastic_jobs():
    p = torch.nn.Parameter(torch.zeros(2))
    state = _state([p])
    parts = _Parts(state)
    state.membership, state.step_in_flight = (9, 9), True
    parts.lifecycle.follow_membership()
    assert state.step_in_flight                # not elastic: nothing is dropped
    assert not parts.lifecycle.watching()      # no drift detector without dcredit's replan


# -- overlap -------------------------------------------------------------------------------------
def test_a_wait_that_fails_after_shutdown_names_the_fix():
    p = torch.nn.Parameter(torch.zeros(2))
    state = _state([p])
    parts = _Parts(state)
    with pytest.raises(Failed):
        with parts.overlap.lost_to_shutdown_reported():
            raise Failed("handle gone")          # the transport is up: its own error
    state.transport.up = False
    with pytest.raises(SchedulerError, match="apply_pending_updates"):
        with parts.overlap.lost_to_shutdown_reported():
            raise Failed("handle gone")
    assert "hvd.shutdown()" in SHUTDOWN_IN_FLIGHT


def test_a_compiled_model_is_recognised():
    model = torch.nn.Linear(2, 2)
    assert not compiled(model)
    model._compiled_call_impl = object()
    assert compiled(torch.nn.Sequential(model))


# -- instrumentation -------------------------------------------------------------------------------
def test_layer_hooks_exist_only_while_wanted():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    params = list(model.parameters())
    state = _state(params)
    part = Instrumentation(state)
    part.watch_layers(model)
    assert len(state.layer_params) == 2 and not part.wanted()
    part.time_layers(True)
    assert len(state.hooks.layers) == 4
    part.time_layers(False)
    assert state.hooks.layers == []


# -- lifetime ------------------------------------------------------------------------------------
def test_closing_mid_iteration_raises_and_closing_twice_is_once():
    p = torch.nn.Parameter(torch.zeros(2))
    state = _state([p])
    parts = _Parts(state)
    owner = Failed()                             # any object a weak reference can name
    state.pending.add(p)
    with pytest.raises(RuntimeError, match="Call step"):
        lifetime.close(state, parts.overlap, owner, "")
    state.pending.clear()
    lifetime.close(state, parts.overlap, owner, "because")
    assert state.closed == " because"
    lifetime.close(state, parts.overlap, owner, "again")
    assert state.closed == " because"


# -- arguments, runtime ------------------------------------------------------------------------------
def test_named_parameters_are_checked_as_horovod_does():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    groups = [{"params": [a, b]}]
    assert [n for n, _ in arguments.named_parameters(groups, None)] == [
        "allreduce.noname.0.0", "allreduce.noname.0.1"]
    assert arguments.named_parameters(groups, [("x", a), ("y", b), ("z", a)]) == [("x", a),
                                                                                  ("y", b)]
    with pytest.raises(ValueError, match="must be unique"):
        arguments.named_parameters(groups, [("x", a), ("x", b)])
    with pytest.raises(ValueError, match="were not named"):
        arguments.named_parameters(groups, [("x", a)])
    with pytest.raises(ValueError, match="none of whose parameters"):
        arguments.model_owns(torch.nn.Linear(1, 1), [a], {a: "x"})


def test_the_factory_checks_keep_horovods_order_then_ask_the_transport():
    a = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([a], lr=0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        arguments.before_transport(opt, [("x", a), ("x", a)], 0, [1], 0, None, None)
    with pytest.raises(ValueError, match="must be unique"):
        arguments.before_transport(opt, [("x", a), ("x", a)], 0, [1], 1, None, None)
    with pytest.raises(NotImplementedError, match="groups/num_groups"):
        arguments.before_transport(opt, [("x", a)], 0, [1], 1, None, None)
    assert arguments.before_transport(opt, iter([("x", a)]), 0, None, 1, "sum", None) == [
        ("x", a)]
    asked = []
    library = SimpleNamespace(AVERAGE="average", check_op=asked.append)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        arguments.with_transport("sum", 2.0, library)
    assert asked == []
    arguments.with_transport("sum", 1.0, library)
    assert asked == ["sum"]


def test_the_initial_order_is_the_naming_order():
    a, b = torch.zeros(1), torch.zeros(1)
    state = _state([a, b], names={b: "b", a: "a"})
    assert [id(p) for p in runtime.initial_order(state)] == [id(b), id(a)]
