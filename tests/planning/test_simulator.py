"""The simulator: hand-worked iterations, the policy contract it drives, and properties.

Hand-worked cases use round numbers (a = 1 s, b = 1 ms/B, cycles of 1 s or 0) so every event
time below can be checked with pencil and paper; they are simulated times, not wall clock.
"""
from __future__ import annotations

import collections
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcredit_hvd.__main__ import main, parse_rate, parse_size, parse_time
from dcredit_hvd.bench import zoo
from dcredit_hvd.planning import halves
from dcredit_hvd.planning import simulator as sim
from dcredit_hvd.planning.blocks import Block
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.planner import Plan, plan
from dcredit_hvd.planning.profile import Profile
from dcredit_hvd.policies.base import Policy
from dcredit_hvd.policies.dcredit import DCredit

COST = CostModel(a=1.0, b=0.001)   # 1 s per all-reduce + 1 ms per byte


def prof(nbytes, t_f, t_b, t_u=(), esize=4) -> Profile:
    names = [f"t{i}" for i in range(len(nbytes))]
    return Profile.from_lists(names, nbytes, [esize] * len(nbytes), t_f, t_b, t_u)


def keys(result):
    return [(op.start, op.end, op.nbytes, op.blocks) for op in result.trace]


# ---- hand-worked iterations --------------------------------------------------------------------

def test_wfbp_waits_for_the_next_horovod_cycle_and_sends_tensors_one_by_one():
    # Forward 1.5 s.  Backward starts at 1.5: gradient 1 ready at +3 (4.5), gradient 0 at +5.
    # Cycles of 1 s from t=0: gradient 1 goes at 5 (a + 2000 b = 3 s, until 8); gradient 0 waits
    # for the link and goes at the cycle after, 8 -> 10.  Step at 10, next backward at 11.5.
    # Steady state repeats every 10 s: 1.5 forward + 3.5 waiting for the cycle and link + ...
    p = prof([1000, 2000], [0.75, 0.75], [2.0, 3.0])
    r = sim.simulate(p, COST, "wfbp", cycle_s=1.0)
    assert r.iteration_s == pytest.approx(10.0)
    assert r.compute_s == pytest.approx(6.5)
    assert r.exposed_comm_s == pytest.approx(3.5)
    assert r.link_busy_s == pytest.approx(5.0)
    assert r.ops_per_iteration == 2
    # Times are from the start of backward (11.5 in the measured iteration: cycle at 15 = +3.5).
    assert keys(r) == [(pytest.approx(3.5), pytest.approx(6.5), 2000, ((1, 0),)),
                       (pytest.approx(6.5), pytest.approx(8.5), 1000, ((0, 0),))]


def test_horovod_fuses_gradients_ready_in_the_same_cycle_into_one_allreduce():
    # Both gradients are ready before the cycle at 5 (4.5 and 4.7): one fused all-reduce of
    # 3000 B (1 + 3 = 4 s, 5 -> 9); step at 9; iteration 1.5 + 3.5 + 4 = 9 s.
    p = prof([1000, 2000], [0.75, 0.75], [0.2, 3.0])
    r = sim.simulate(p, COST, "horovod", cycle_s=1.0)
    assert r.iteration_s == pytest.approx(9.0)
    assert r.ops_per_iteration == 1
    assert r.trace[0].nbytes == 3000
    assert sorted(r.trace[0].blocks) == [(0, 0), (1, 0)]
    # wfbp sends the same gradients unfused: two startups, one more second.
    assert sim.simulate(p, COST, "wfbp", cycle_s=1.0).iteration_s == pytest.approx(10.0)


def test_horovod_never_overlaps_the_next_forward():
    p = prof([1000, 2000], [0.75, 0.75], [0.2, 3.0])
    plain = sim.simulate(p, COST, "horovod", cycle_s=1.0, overlap_forward=False)
    asked = sim.simulate(p, COST, "horovod", cycle_s=1.0, overlap_forward=True)
    assert asked.overlap_forward is False
    assert asked.iteration_s == plain.iteration_s


def test_bytescheduler_credit_lets_an_urgent_block_jump_the_queue_and_overlap_forward():
    # Tensor 0: one 1000 B block; tensor 1: three.  Credit 1000 B = one block in flight; no cycle.
    # Backward starts at 2: (1,0) at 3->5; gradient 0 ready at 4 jumps (1,1) and (1,2):
    # (0,0) 5->7, (1,1) 7->9, (1,2) 9->11.
    p = prof([1000, 3000], [1.0, 1.0], [1.0, 1.0])
    kw = {"partition_bytes": 1000, "credit_bytes": 1000, "cycle_s": 0.0}
    r = sim.simulate(p, COST, "bytescheduler", **kw)
    assert [op.blocks for op in r.trace] == [((1, 0),), ((0, 0),), ((1, 1),), ((1, 2),)]
    assert keys(r)[1][:2] == (pytest.approx(3.0), pytest.approx(5.0))
    # No overlap: 2 forward + 9 (last all-reduce ends 9 s after backward starts) = 11 s.
    assert r.iteration_s == pytest.approx(11.0)
    # Overlap: forward of tensor 0 runs at 7..8 (after its all-reduce), tensor 1 at 11..12:
    # the next backward starts 10 s after this one.
    assert sim.simulate(p, COST, "bytescheduler", overlap_forward=True, **kw).iteration_s \
        == pytest.approx(10.0)


def test_dcredit_spends_phase1_budget_then_sends_phase2_windows_in_forward_order():
    # Plan by hand: when gradient 1 is ready, release 2 blocks (one fused all-reduce of 2000 B,
    # 3 -> 6); tensor 0 then goes alone in phase 2 (6 -> 8), and tensor 1's last block only
    # after tensor 0's window completed (8 -> 10).
    p = prof([1000, 3000], [1.0, 1.0], [1.0, 1.0])
    hand = Plan(partition_bytes=1000, windows=(2, 1, 1), blocks_per_tensor=(1, 3),
                last_fraction=(1.0, 1.0))
    r = sim.simulate(p, COST, DCredit(hand, overlap_forward=True), cycle_s=0.0)
    assert [op.blocks for op in r.trace] == [((1, 0), (1, 1)), ((0, 0),), ((1, 2),)]
    assert [op.start for op in r.trace] == pytest.approx([1.0, 4.0, 6.0])
    assert r.iteration_s == pytest.approx(10.0)       # 2 forward + 8
    r2 = sim.simulate(p, COST, DCredit(hand, overlap_forward=True), cycle_s=0.0, overlap_forward=True)
    assert r2.iteration_s == pytest.approx(9.0)        # forward of tensor 0 overlaps (1,2)
    assert r2.plan is hand


def test_dcredit_without_overlap_releases_phase_two_at_once_into_one_fused_allreduce():
    # Same plan, spent as the runtime spends it today: at backward end (+2) tensor 0 and the
    # last block of tensor 1 are both released; the link frees at +4 and one fused all-reduce
    # of 2000 B runs 4 -> 7.  Iteration 2 forward + 7 = 9 s, one second (a startup) less than
    # the per-tensor chain above, which the next forward cannot use without overlap.
    p = prof([1000, 3000], [1.0, 1.0], [1.0, 1.0])
    hand = Plan(partition_bytes=1000, windows=(2, 1, 1), blocks_per_tensor=(1, 3),
                last_fraction=(1.0, 1.0))
    r = sim.simulate(p, COST, DCredit(hand), cycle_s=0.0)
    assert [op.blocks for op in r.trace] == [((1, 0), (1, 1)), ((0, 0), (1, 2))]
    assert [op.start for op in r.trace] == pytest.approx([1.0, 4.0])
    assert r.iteration_s == pytest.approx(9.0)


@pytest.mark.parametrize("overlap", [False, True])
def test_simulated_dcredit_by_name_spends_phase_two_in_the_simulated_mode(overlap):
    p = prof([4000, 8000, 4000], [0.1] * 3, [0.1] * 3)
    policy = sim.make_policy("dcredit", p, COST, partition_bytes=1000, overlap_forward=overlap)
    assert policy.overlap_forward is overlap
    r = sim.simulate(p, COST, "dcredit", partition_bytes=1000, overlap_forward=overlap)
    assert ("per-tensor windows" in r.description) is overlap


def test_blocks_released_by_a_completion_miss_the_cycle_that_starts_at_that_completion():
    # Credit of one block, cycle 1 s: the all-reduce of (1,0) ends at 5+2 = 7 > 6, so Horovod's
    # next cycle starts at 7 and finds nothing (the gate learns of the completion by polling);
    # (1,1) goes in the cycle after, at 8.
    p = prof([4, 2000], [0.75, 0.75], [0.0, 3.0])
    r = sim.simulate(p, COST, "bytescheduler", partition_bytes=1000, credit_bytes=1000,
                     cycle_s=1.0)
    starts = [op.start for op in r.trace]
    assert starts[1] - r.trace[0].end == pytest.approx(1.0)


def test_a_cost_floor_charges_a_small_allreduce_the_floor_and_a_large_one_its_line():
    p = prof([8, 5000], [0.0] * 2, [1.0, 1.0])
    r = sim.simulate(p, CostModel(a=1.0, b=0.001, floor=4.0), "wfbp", cycle_s=0.0)
    assert [op.end - op.start for op in r.trace] == pytest.approx([6.0, 4.0])


def test_fusion_threshold_splits_one_cycle_into_back_to_back_allreduces():
    p = prof([1000, 1000, 1000], [0.0] * 3, [0.0, 0.0, 1.0])
    r = sim.simulate(p, COST, "horovod", cycle_s=1.0, fusion_bytes=2000)
    assert [op.nbytes for op in r.trace] == [2000, 1000]
    assert r.trace[0].end == pytest.approx(r.trace[1].start)


def test_updates_are_charged_after_all_allreduces_or_per_tensor_when_overlapping():
    p = prof([1000, 2000], [0.75, 0.75], [2.0, 3.0], t_u=[0.25, 0.25])
    # Iteration 0 as in the first wfbp case: last all-reduce ends at 10, 0.5 s of updates, next
    # backward at 12.  Gradient 1 is then ready at 15, ON a cycle start: the updates took
    # exactly the 0.5 s it used to wait for a cycle, so the steady period stays 3+5+0.5+1.5 = 10.
    r = sim.simulate(p, COST, "wfbp", cycle_s=1.0)
    assert r.compute_s == pytest.approx(7.0)
    assert r.iteration_s == pytest.approx(10.0)
    assert sim.simulate(p, COST, "wfbp", cycle_s=1.0, warmup=0, iterations=1).iteration_s \
        == pytest.approx(10.5)
    # Overlapping: tensor 0 (reduced at +8) is updated and runs forward at +8..+9, tensor 1
    # (reduced at +6) at +9..+10: the same period here.
    r = sim.simulate(p, COST, "wfbp", cycle_s=1.0, overlap_forward=True)
    assert r.iteration_s == pytest.approx(10.0)


# ---- the policy contract -----------------------------------------------------------------------

class Spy(Policy):
    """Admits everything; records what the driver told it."""

    name = "spy"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def bind(self, layouts):
        self.calls.append(("bind", len(layouts)))
        super().bind(layouts)

    def start_iteration(self):
        self.calls.append(("start",))

    def on_ready(self, tensor):
        self.calls.append(("ready", tensor))

    def on_backward_end(self):
        self.calls.append(("end",))

    def on_complete(self, block):
        self.calls.append(("complete", block.key))

    def admit(self, block: Block) -> bool:
        self.calls.append(("admit", block.key))
        return True


def test_simulator_drives_the_policy_through_the_runtime_contract():
    p = prof([1000, 2000, 3000], [0.1] * 3, [0.1] * 3)
    spy = Spy()
    sim.simulate(p, COST, spy, partition_bytes=1000, cycle_s=0.0, warmup=1, iterations=1)
    calls = spy.calls
    assert calls[0] == ("bind", 3)
    assert calls.count(("start",)) == 2
    first = calls[1:calls.index(("start",), 2)]
    assert [c[1] for c in first if c[0] == "ready"] == [2, 1, 0]      # backward order
    assert first.index(("end",)) > first.index(("ready", 0))
    admitted = [c[1] for c in first if c[0] == "admit"]
    completed = [c[1] for c in first if c[0] == "complete"]
    assert sorted(admitted) == sorted(completed) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    # Every block is offered only when it is the head of the queue: releases of one ready event
    # come out in priority order.
    assert admitted[:3] == [(2, 0), (2, 1), (2, 2)]


class Never(Policy):
    name = "never"

    def admit(self, block: Block) -> bool:
        return False


def test_a_policy_that_never_admits_is_reported_as_stalled_not_hung():
    with pytest.raises(sim.SimulationStalled, match="never"):
        sim.simulate(prof([1000], [0.1], [0.1]), COST, Never())


def test_simulate_uses_the_policy_partition_wfbp_keeps_tensors_whole():
    p = prof([10_000, 20_000], [0.1] * 2, [0.1] * 2)
    assert sim.simulate(p, COST, "wfbp", partition_bytes=1000).blocks_per_iteration == 2
    assert sim.simulate(p, COST, "bytescheduler", partition_bytes=1000).blocks_per_iteration == 30
    d = sim.simulate(p, COST, "dcredit", partition_bytes=4000)
    assert d.partition_bytes == 4000 and d.blocks_per_iteration == 8


def test_unknown_policy_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy"):
        sim.simulate(prof([1000], [0.1], [0.1]), COST, "fifo")


# ---- link model, lower bound, compare ----------------------------------------------------------

def test_link_cost_is_a_ring_allreduce():
    c = sim.link_cost(10e9, 50e-6, 16, op_overhead_s=0.0)
    assert c.b == pytest.approx(2 * 15 / 16 * 8 / 10e9)
    assert c.a == pytest.approx(30 * 50e-6)
    assert sim.link_cost(10e9, 50e-6, 16).a == pytest.approx(30 * 50e-6 + sim.DEFAULT_OP_OVERHEAD_S)
    one = sim.link_cost(1e9, 1e-3, 1, op_overhead_s=0.0)
    assert one.a == 0 and one.b == 0
    with pytest.raises(ValueError):
        sim.link_cost(0, 1e-6, 2)


def test_lower_bound_is_max_of_compute_one_fused_allreduce_and_each_tensors_dependency():
    # Compute 6.5; one fused all-reduce 1 + 3 = 4; tensor 1 (ready at 3): 3 + T(2000) = 6 plus
    # the forward of layer 1 (0.75) = 6.75; tensor 0 (ready at 5, read first, as a tied
    # embedding): 5 + T(1000) = 7 plus the whole forward (1.5) = 8.5, which binds.
    p = prof([1000, 2000], [0.75, 0.75], [2.0, 3.0])
    assert sim.dependency_bound(p, COST) == pytest.approx(8.5)
    assert sim.lower_bound(p, COST) == pytest.approx(8.5)
    # A tiny tensor 0: its dependency (5 + 1.01 + 1.5) no longer exceeds compute + 0.
    small = prof([10, 2000], [0.75, 0.75], [2.0, 3.0])
    assert sim.lower_bound(small, COST) == pytest.approx(max(6.5, 1 + 2.01, 5 + 1.01 + 1.5))
    assert sim.lower_bound(p, CostModel(a=1, b=0.01)) == pytest.approx(1 + 30)


def test_no_overlap_bound_adds_forward_to_the_communication_span():
    # r_1 = 3, r_0 = 5: max(3 + T(3000) = 7, 5 + T(1000) = 7) = 7, plus 1.5 of forward.
    p = prof([1000, 2000], [0.75, 0.75], [2.0, 3.0])
    assert sim.no_overlap_bound(p, COST) == pytest.approx(8.5)
    # The wfbp hand case above (10 s) pays 1.5 s more: 0.5 s waiting for a cycle, one startup.
    assert sim.simulate(p, COST, "wfbp", cycle_s=1.0).iteration_s >= 8.5


def test_compare_runs_every_policy_and_ends_with_the_bounds():
    p = prof([40_000, 80_000, 4_000], [0.01] * 3, [0.02] * 3)
    cost = CostModel(a=1e-4, b=1e-7)
    rows = sim.compare(p, cost, candidates=(4096, 16384, 65536))
    assert [r.policy for r in rows] == ["horovod", "wfbp", "bytescheduler", "dcredit",
                                        sim.NO_OVERLAP_BOUND, sim.LOWER_BOUND]
    bound = rows[-1].iteration_s
    assert all(r.iteration_s >= bound * (1 - 1e-12) for r in rows)
    assert all(r.iteration_s >= rows[-2].iteration_s * (1 - 1e-12) for r in rows[:-1])
    overlapped = sim.compare(p, cost, candidates=(4096,), overlap_forward=True)
    assert sim.NO_OVERLAP_BOUND not in [r.policy for r in overlapped]
    d = rows[3]
    assert [s for s, _ in d.search] == [4096, 16384, 65536]
    assert d.iteration_s == pytest.approx(min(t for _, t in d.search))
    assert d.partition_bytes == d.plan.partition_bytes


@pytest.mark.parametrize("overlap", [False, True])
def test_dcredit_partition_is_chosen_by_planner_choose_partition_with_simulated_times(overlap):
    p = prof([400_000, 4, 800_000, 4], [0.001] * 4, [0.002] * 4)
    cost = CostModel(a=2e-4, b=1e-9)
    spec = ({"phase1": "greedy", "short_gap": "one_block"},)
    r = sim.best_dcredit(p, cost, candidates=(1 << 14, 1 << 16, 1 << 18), rules=spec,
                         overlap_forward=overlap, cycle_s=1e-3)
    table = dict(r.search)
    for size, seconds in table.items():
        made = plan(p, cost, size, cycle_s=1e-3, overlap_forward=overlap)
        assert seconds == pytest.approx(sim.simulate(
            p, cost, DCredit(made, overlap_forward=overlap), overlap_forward=overlap).iteration_s)
    best = min(table.values())
    assert r.iteration_s == pytest.approx(best)
    assert r.partition_bytes == max(s for s, t in table.items() if t == best)
    assert r.plan.rule == "greedy/one_block"
    assert ("per-tensor windows" in r.description) is overlap


def test_best_dcredit_keeps_the_fastest_planner_rule_and_tabulates_every_rule():
    p = zoo.profile("resnet50", 8, 5e12, 4)
    cost = sim.link_cost(10e9, 50e-6, 16)
    sizes = (1 << 20, 1 << 22)
    r = sim.best_dcredit(p, cost, candidates=sizes)
    rules = [dict(rule) for rule in sim.DEFAULT_PLAN_RULES]
    assert len(r.search_all) == len(rules) * len(sizes)
    assert r.iteration_s == pytest.approx(min(t for _, _, t in r.search_all))
    assert {rule for rule, _, _ in r.search_all} == {"greedy/one_block", "greedy/defer", "batched"}
    assert r.search == tuple((s, t) for rule, s, t in r.search_all if rule == r.plan.rule)
    with pytest.raises(ValueError, match="no planner rules"):
        sim.best_dcredit(p, cost, candidates=sizes, rules=())


@pytest.mark.parametrize("model", ["resnet50", "gpt2_small"])
def test_best_dcredit_without_overlap_is_never_slower_than_every_gradient_sent_when_ready(model):
    # The batched rule's family contains "release every gradient when it is ready", which is
    # how horovod submits; the search keeps the faster.  The sub-millisecond slack is Horovod's
    # cycle grid, whose phase the planner cannot know (docs/algorithm.md).
    p = zoo.profile(model, 8, 5e12, 4)
    cost = sim.link_cost(10e9, 50e-6, 16)
    d = sim.best_dcredit(p, cost, candidates=(1 << 20, 1 << 22), overlap_forward=False)
    h = sim.simulate(p, cost, "horovod")
    assert d.iteration_s <= h.iteration_s + sim.DEFAULT_CYCLE_S
    assert d.iteration_s >= sim.no_overlap_bound(p, cost) * (1 - 1e-9)


# ---- properties --------------------------------------------------------------------------------

@st.composite
def cases(draw):
    L = draw(st.integers(1, 7))
    esize = draw(st.sampled_from([2, 4]))
    numels = draw(st.lists(st.integers(0, 200_000), min_size=L, max_size=L))
    times = st.floats(0.0, 0.02, allow_nan=False)
    t_f = draw(st.lists(times, min_size=L, max_size=L))
    t_b = draw(st.lists(times, min_size=L, max_size=L))
    t_u = draw(st.one_of(st.just([]), st.lists(st.floats(0.0, 0.002), min_size=L, max_size=L)))
    p = Profile.from_lists([f"t{i}" for i in range(L)], [n * esize for n in numels],
                           [esize] * L, t_f, t_b, t_u)
    cost = CostModel(a=draw(st.floats(0.0, 2e-3)), b=draw(st.floats(0.0, 2e-8)))
    options = {
        "partition_bytes": draw(st.integers(1 << 12, 1 << 20)),
        "credit_bytes": draw(st.integers(1, 1 << 21)),
        "overlap_forward": draw(st.booleans()),
        "cycle_s": draw(st.sampled_from([0.0, 1e-3, 2.5e-3])),
        "fusion_bytes": draw(st.sampled_from([None, 0, 1 << 16, 128 << 20])),
    }
    return p, cost, options


def _check(p: Profile, cost: CostModel, r: sim.SimResult) -> None:
    assert r.iteration_s >= r.lower_bound_s * (1 - 1e-9) - 1e-12, (r.policy, r.iteration_s)
    assert r.iteration_s >= r.compute_s * (1 - 1e-9) - 1e-12
    if r.halves:
        rs, ag = halves.split_cost(cost)
        costs = {"reduce_scatter": rs, "all_gather": ag}
        assert r.lower_bound_s == pytest.approx(halves.lower_bound(p, rs, ag, 4, sharded=r.shard))
    else:
        costs = {"allreduce": cost}
        assert r.lower_bound_s == pytest.approx(sim.lower_bound(p, cost))
    # Every block of the layout goes out exactly once per iteration, once in each half.
    sent = collections.Counter((op.kind, k) for op in r.trace for k in op.blocks)
    assert all(v == 1 for v in sent.values())
    assert len(sent) == r.blocks_per_iteration * len(costs)
    assert {kind for kind, _ in sent} == set(costs)
    assert {t for _, (t, _) in sent} == set(range(p.num_tensors)) or r.policy == "dear"
    # One collective at a time, each costing its half's a + b * bytes.
    for op in r.trace:
        assert op.end - op.start == pytest.approx(costs[op.kind].time(op.nbytes), rel=1e-9, abs=1e-12)
    for first, second in zip(r.trace, r.trace[1:]):
        assert second.start >= first.end - 1e-9
    assert r.link_busy_s >= sum(c.time(p.total_bytes) for c in costs.values()) * (1 - 1e-9) - 1e-12
    if not r.overlap_forward and not r.halves:
        assert r.iteration_s >= sim.no_overlap_bound(p, cost) * (1 - 1e-9) - 1e-12


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from(sim.POLICY_NAMES))
def test_every_policy_is_at_least_the_lower_bounds_and_sends_each_block_once(case, name):
    p, cost, options = case
    _check(p, cost, sim.simulate(p, cost, name, **options))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from([n for n in sim.POLICY_NAMES if n != "horovod"]))
def test_every_policy_sharded_is_at_least_its_bound_and_sends_each_block_once_per_half(case, name):
    p, cost, options = case
    _check(p, cost, sim.simulate(p, cost, name, shard=True, workers=4, **options))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_dcredit_with_partition_search_is_at_least_the_lower_bound(case):
    p, cost, options = case
    r = sim.best_dcredit(p, cost, candidates=(1 << 12, 1 << 15, 1 << 18),
                         overlap_forward=options["overlap_forward"], cycle_s=options["cycle_s"],
                         fusion_bytes=options["fusion_bytes"])
    _check(p, cost, r)


@settings(max_examples=20, deadline=None)
@given(cases())
def test_overlapping_the_next_forward_never_makes_a_scheduled_policy_slower_without_cycles(case):
    # With no Horovod cycle the only difference is that forward may start before the last
    # all-reduce ends, so the overlapped iteration can only be shorter.
    p, cost, options = case
    for name in ("wfbp", "bytescheduler"):
        kw = {"partition_bytes": options["partition_bytes"], "credit_bytes": options["credit_bytes"],
                  "cycle_s": 0.0, "fusion_bytes": options["fusion_bytes"], "warmup": 0, "iterations": 1}
        off = sim.simulate(p, cost, name, overlap_forward=False, **kw)
        on = sim.simulate(p, cost, name, overlap_forward=True, **kw)
        assert on.iteration_s <= off.iteration_s * (1 + 1e-9) + 1e-12


# ---- CLI ---------------------------------------------------------------------------------------

def test_units_parse_as_network_people_write_them():
    assert parse_rate("10Gbit") == 10e9
    assert parse_rate("1Gbit") == 1e9
    assert parse_rate("25Gbit/s") == 25e9
    assert parse_rate("100Mbit") == 100e6
    assert parse_time("50us") == pytest.approx(50e-6)
    assert parse_time("1ms") == pytest.approx(1e-3)
    assert parse_time("0.5") == 0.5
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("4MB") == 4_000_000
    assert parse_size("0") == 0
    import argparse
    for bad in ("10GB", "fast", "-1Gbit"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rate(bad)


def test_cli_simulate_prints_every_policy_with_speedup_and_gap(capsys):
    assert main(["simulate", "--model", "resnet50", "--workers", "16", "--bandwidth", "10Gbit",
                 "--latency", "50us", "--batch-size", "8", "--device-tflops", "5",
                 "--candidates", "1MiB,4MiB"]) == 0
    out = capsys.readouterr().out
    for word in ("horovod", "wfbp", "bytescheduler", "dcredit", "lower_bound", "vs horovod",
                 "/ bound", "link busy", "exposed", "a = 1.550 ms"):
        assert word in out
    assert "1.000x" in out  # horovod against itself


def test_cli_plan_prints_partition_and_both_phases(capsys):
    assert main(["plan", "--model", "vgg16", "--bandwidth", "25Gbit", "--overlap",
                 "--candidates", "4MiB,16MiB"]) == 0
    out = capsys.readouterr().out
    assert "chosen partition S_p" in out
    assert "phase 1 (backward)" in out and "phase 2 (next forward)" in out
    assert "features.0.weight" in out  # tensor 0 is always left for phase 2


def test_cli_rejects_unknown_models_and_units():
    with pytest.raises(SystemExit):
        main(["simulate", "--model", "alexnet"])
    with pytest.raises(SystemExit):
        main(["simulate", "--model", "vgg16", "--bandwidth", "fast"])


def test_period_is_finite_for_zero_compute_and_zero_bytes():
    p = prof([0, 0], [0.0, 0.0], [0.0, 0.0])
    for name in sim.POLICY_NAMES:
        r = sim.simulate(p, COST, name)
        assert math.isfinite(r.iteration_s) and r.iteration_s >= sim.lower_bound(p, COST)


def test_best_dcredit_with_overlap_crosses_phase_two_rules_and_the_plan_carries_the_winner():
    p = zoo.profile("resnet50", 8, 5e12, 4)
    cost = sim.link_cost(10e9, 50e-6, 16)
    r = sim.best_dcredit(p, cost, candidates=(1 << 22,), overlap_forward=True)
    labels = {label for label, _, _ in r.search_all}
    assert any(label.endswith("+ grouped_pipelined") for label in labels)
    assert "greedy/one_block" in labels                 # the spec rule is still tried
    assert min(t for _, _, t in r.search_all) == r.iteration_s
    # What the runtime does with the result: DCredit(plan, overlap_forward=True) alone.
    again = sim.simulate(p, cost, DCredit(r.plan, overlap_forward=True), overlap_forward=True)
    assert again.iteration_s == pytest.approx(r.iteration_s)


def test_best_dcredit_without_overlap_tries_no_phase_two_rules():
    p = zoo.profile("resnet50", 8, 5e12, 4)
    cost = sim.link_cost(10e9, 50e-6, 16)
    r = sim.best_dcredit(p, cost, candidates=(1 << 22,), overlap_forward=False)
    assert all("+" not in label for label, _, _ in r.search_all)
    assert r.plan.phase2 == "per_tensor"


# ---- grouping small tensors -------------------------------------------------------------------

def test_grouped_profile_sums_its_members_and_keeps_ready_times_exact():
    p = prof([10, 20, 4000, 30], [0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 3.0, 4.0], t_u=[0.5] * 4)
    g = p.grouped((2, 1, 1))
    assert g.nbytes == (30, 4000, 30) and g.t_f == pytest.approx((0.3, 0.3, 0.4))
    assert g.t_b == pytest.approx((3.0, 3.0, 4.0)) and g.t_u == pytest.approx((1.0, 0.5, 0.5))
    assert g.ready_times()[0] == pytest.approx(p.ready_times()[0])
    assert g.ready_times()[1:] == pytest.approx(p.ready_times()[2:])


def test_per_block_cost_makes_the_search_group_many_small_tensors():
    # 40 small tensors; each block costs 5 ms of CPU on the backward: one unit instead of 40
    # saves 195 ms a step, which the search must find.
    p = prof([400] * 40, [0.01] * 40, [0.01] * 40)
    fast = CostModel(a=1e-4, b=1e-9)
    plain = sim.best_dcredit(p, fast, overlap_forward=True, cycle_s=0.001, block_overhead_s=5e-3)
    grouped = sim.best_dcredit(p, fast, overlap_forward=True, cycle_s=0.001,
                               block_overhead_s=5e-3, group_limits=(0, 64 << 10))
    assert plain.plan.groups == () and plain.blocks_per_iteration == 40
    assert grouped.plan.groups == (40,) and grouped.blocks_per_iteration == 1
    assert grouped.iteration_s < plain.iteration_s - 0.15
    assert any("groups <= 65536 B" in label for label, _, _ in grouped.search_all)


def test_simulating_a_grouped_plan_runs_on_its_units_and_completes_every_block():
    p = prof([100, 100, 100, 8000], [0.1] * 4, [0.2] * 4)
    from dataclasses import replace
    made = replace(plan(p.grouped((3, 1)), COST, 4000), groups=(3, 1), group_bytes=1000)
    result = sim.simulate(p, COST, DCredit(made, overlap_forward=True), overlap_forward=True,
                          cycle_s=0.0)
    assert result.blocks_per_iteration == 1 + 2
    assert sorted(k for op in result.trace for k in op.blocks) == [(0, 0), (1, 0), (1, 1)]
    assert result.lower_bound_s == sim.lower_bound(p, COST)


def test_partitions_that_cut_every_unit_alike_share_one_simulation_and_the_largest_wins():
    p = prof([400] * 6, [0.01] * 6, [0.02] * 6)          # every candidate: one block per tensor
    best = sim.best_dcredit(p, CostModel(a=1e-3, b=1e-8), overlap_forward=True, cycle_s=1e-3,
                            rules=({"phase1": "greedy", "short_gap": "one_block"},),
                            phase2_rules=("per_tensor",))
    times = {t for _, t in best.search}
    assert len(times) == 1 and best.plan.partition_bytes == max(s for s, _ in best.search)
    assert best.partition_bytes == best.plan.partition_bytes
