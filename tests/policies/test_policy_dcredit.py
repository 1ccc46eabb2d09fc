"""The D-Credit runtime rule driven like the real driver: a priority queue asked head-first."""
from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_hvd.planning.blocks import Block, TensorLayout, build_layout
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.planner import Plan, plan
from dcredit_hvd.planning.profile import Profile
from dcredit_hvd.policies.dcredit import DCredit


def layouts_for(blocks: Sequence[int], partition_bytes: int = 4) -> list[TensorLayout]:
    """Tensors of ``blocks[l]`` full blocks of one 4-byte element each (partition 4 B)."""
    return build_layout([f"t{l}" for l in range(len(blocks))], list(blocks), [4] * len(blocks),
                        partition_bytes)


class Driver:
    """What the runtime does: queue ready blocks, ask ``admit`` for the head after every event."""

    def __init__(self, policy: DCredit, layouts: Sequence[TensorLayout]) -> None:
        self.policy = policy
        self.layouts = layouts
        self.queue: list[Block] = []
        self.inflight: list[Block] = []
        self.released: list[Block] = []
        policy.bind(layouts)

    def start(self) -> None:
        self.released = []
        self.policy.start_iteration()

    def pump(self) -> None:
        while self.queue and self.policy.admit(self.queue[0]):
            block = heapq.heappop(self.queue)
            self.released.append(block)
            self.inflight.append(block)

    def queue_blocks(self, tensor: int) -> None:
        for block in self.layouts[tensor].blocks:
            heapq.heappush(self.queue, block)

    def ready(self, tensor: int) -> None:
        self.queue_blocks(tensor)
        self.policy.on_ready(tensor)
        self.pump()

    def backward_end(self) -> None:
        self.policy.on_backward_end()
        self.pump()

    def complete(self, block: Block) -> None:
        self.inflight.remove(block)
        self.policy.on_complete(block)
        self.pump()

    def keys(self) -> list[tuple[int, int]]:
        return [b.key for b in self.released]


def test_phase_one_releases_each_budget_when_its_gradient_is_ready() -> None:
    # windows (0, 2, 0 | 1, 1, 0, 0): gradient 3 adds windows[0] = 0, gradient 2 adds windows[1]
    # = 2 (the gap before gradient 1), gradient 1 adds windows[2] = 0.
    policy = DCredit(Plan(partition_bytes=4, windows=(0, 2, 0, 1, 1, 0, 0), blocks_per_tensor=(1, 1, 1, 1)))
    driver = Driver(policy, layouts_for([1, 1, 1, 1]))
    driver.start()
    driver.ready(3)
    assert driver.keys() == []
    driver.ready(2)
    assert driver.keys() == [(2, 0), (3, 0)]
    driver.ready(1)
    driver.ready(0)
    assert driver.keys() == [(2, 0), (3, 0)]
    assert policy.released == [2, 0]


def test_phase_two_sends_one_tensor_at_a_time_after_the_previous_window_completes() -> None:
    policy = DCredit(Plan(partition_bytes=4, windows=(0, 3, 2), blocks_per_tensor=(3, 2)),
                     overlap_forward=True)
    driver = Driver(policy, layouts_for([3, 2]))
    driver.start()
    driver.ready(1)
    driver.ready(0)
    assert driver.keys() == []
    driver.backward_end()
    assert driver.keys() == [(0, 0), (0, 1), (0, 2)]     # tensor 0's whole window at once
    driver.complete(driver.inflight[0])
    driver.complete(driver.inflight[0])
    assert len(driver.released) == 3                      # tensor 1 waits for the last one
    driver.complete(driver.inflight[0])
    assert driver.keys()[3:] == [(1, 0), (1, 1)]


@pytest.mark.parametrize("overlap", [False, True])
def test_phase_one_blocks_in_flight_do_not_hold_back_phase_two(overlap: bool) -> None:
    policy = DCredit(Plan(partition_bytes=4, windows=(1, 1, 0), blocks_per_tensor=(1, 1)),
                     overlap_forward=overlap)
    driver = Driver(policy, layouts_for([1, 1]))
    driver.start()
    driver.ready(1)
    assert driver.keys() == [(1, 0)]
    driver.ready(0)
    driver.backward_end()
    assert driver.keys() == [(1, 0), (0, 0)]               # (1, 0) has not completed


def test_completions_do_not_return_budget_in_phase_one() -> None:
    policy = DCredit(Plan(partition_bytes=4, windows=(1, 0, 1, 1, 0), blocks_per_tensor=(1, 1, 1)))
    driver = Driver(policy, layouts_for([1, 1, 1]))
    driver.start()
    driver.ready(2)
    assert driver.keys() == [(2, 0)]
    driver.ready(1)                                        # budget windows[1] = 0
    driver.complete(driver.inflight[0])
    assert driver.keys() == [(2, 0)]


def test_every_ready_tensor_is_credited_once_whatever_the_order() -> None:
    # Gradient 1 announced before 2, and 2 twice: budget windows[1] + windows[0] = 2 + 1 = 3.
    # Crediting only a new minimum (the authors' runtime) gives 2; counting the repeat gives 4.
    plan_ = Plan(partition_bytes=4, windows=(1, 2, 1, 0, 0), blocks_per_tensor=(1, 2, 1))
    policy = DCredit(plan_)
    driver = Driver(policy, layouts_for([1, 2, 1]))
    driver.start()
    for tensor in (0, 1, 2):
        driver.queue_blocks(tensor)
    policy.on_ready(1)
    policy.on_ready(2)
    policy.on_ready(2)
    driver.pump()
    assert driver.keys() == [(0, 0), (1, 0), (1, 1)]


def test_gradient_zero_adds_no_phase_one_budget() -> None:
    policy = DCredit(Plan(partition_bytes=4, windows=(0, 1, 1), blocks_per_tensor=(1, 1)))
    driver = Driver(policy, layouts_for([1, 1]))
    driver.start()
    driver.ready(1)
    driver.ready(0)
    assert driver.keys() == []


def test_unused_tensor_without_ready_event_still_drains_after_backward_ends() -> None:
    policy = DCredit(Plan(partition_bytes=4, windows=(2, 0, 1, 1, 0), blocks_per_tensor=(1, 1, 2)))
    driver = Driver(policy, layouts_for([1, 1, 2]))
    driver.start()
    driver.ready(2)
    driver.ready(0)
    driver.queue_blocks(1)                                  # tensor 1 got no gradient: force-queued
    driver.backward_end()
    while driver.inflight:
        driver.complete(driver.inflight[0])
    assert sorted(driver.keys()) == [(0, 0), (1, 0), (2, 0), (2, 1)]
    assert not driver.queue


def test_start_iteration_discards_budget_left_from_the_previous_iteration() -> None:
    policy = DCredit(Plan(partition_bytes=4, windows=(2, 0, 1, 1, 0), blocks_per_tensor=(1, 1, 2)))
    driver = Driver(policy, layouts_for([1, 1, 2]))
    policy.start_iteration()
    policy.on_ready(2)                                       # 2 of budget, nothing queued
    driver.start()
    driver.queue_blocks(1)
    policy.on_ready(1)
    driver.pump()
    assert driver.keys() == []


def test_bind_refuses_a_layout_cut_with_another_partition() -> None:
    policy = DCredit(Plan(partition_bytes=8, windows=(0, 1, 1), blocks_per_tensor=(1, 1)))
    with pytest.raises(ValueError, match="partition_bytes=8"):
        policy.bind(layouts_for([2, 1], partition_bytes=4))     # 2 blocks where the plan has 1
    with pytest.raises(ValueError, match="2 tensors"):
        policy.bind(layouts_for([1], partition_bytes=8))


def test_partition_is_the_plans_whatever_is_configured() -> None:
    policy = DCredit(Plan(partition_bytes=8, windows=(1,), blocks_per_tensor=(1,)))
    assert policy.partition_bytes(4_000_000) == 8
    assert policy.partition_bytes(None) == 8
    assert "S_p=8" in policy.describe()


def test_ready_event_for_an_unknown_tensor_is_an_error() -> None:
    policy = DCredit(Plan(partition_bytes=8, windows=(1,), blocks_per_tensor=(1,)))
    with pytest.raises(IndexError):
        policy.on_ready(1)


# --- properties --------------------------------------------------------------------------------

@st.composite
def planned_jobs(draw: st.DrawFn) -> tuple[Plan, list[TensorLayout]]:
    L = draw(st.integers(1, 12))
    numels = [draw(st.integers(0, 40)) for _ in range(L)]
    S_p = draw(st.sampled_from([4, 8, 20, 64]))
    times = st.floats(0, 0.01)
    prof = Profile.from_lists([f"t{l}" for l in range(L)], [4 * n for n in numels], [4] * L,
                              [draw(times) for _ in range(L)], [draw(times) for _ in range(L)])
    cost = CostModel(draw(st.floats(0, 1e-3)), draw(st.floats(0, 1e-4)))
    result = plan(prof, cost, S_p)
    return result, build_layout(prof.names, numels, prof.element_size, S_p)


@settings(max_examples=300, deadline=None)
@given(planned_jobs(), st.randoms(use_true_random=False), st.booleans())
def test_random_event_order_releases_every_block_exactly_once_and_never_deadlocks(
        job: tuple[Plan, list[TensorLayout]], rng: random.Random, overlap: bool) -> None:
    plan_, layouts = job
    L = plan_.num_tensors
    policy = DCredit(plan_, overlap_forward=overlap)
    driver = Driver(policy, layouts)
    all_keys = sorted(b.key for t in layouts for b in t.blocks)
    for _ in range(2):
        driver.start()
        order = list(range(L - 1, -1, -1))
        for _ in range(rng.randint(0, L)):                  # ready events out of order
            i, j = rng.randrange(L), rng.randrange(L)
            order[i], order[j] = order[j], order[i]
        unused = {t for t in order if rng.random() < 0.15}
        events = [t for t in order if t not in unused]
        while events:
            if driver.inflight and rng.random() < 0.4:
                driver.complete(rng.choice(driver.inflight))
            else:
                driver.ready(events.pop(0))
        for t in sorted(unused):
            driver.queue_blocks(t)
        driver.backward_end()
        while driver.queue or driver.inflight:
            assert driver.inflight, "deadlock: blocks queued, nothing in flight, admit refuses"
            driver.complete(rng.choice(driver.inflight))
        assert sorted(driver.keys()) == all_keys


@settings(max_examples=200, deadline=None)
@given(planned_jobs())
def test_in_order_events_spend_exactly_the_planned_phase_one_windows(
        job: tuple[Plan, list[TensorLayout]]) -> None:
    # Ready events in backward order, no completions during backward: the runtime's phase-1
    # releases per tensor are exactly what the planner took from that tensor.
    plan_, layouts = job
    L = plan_.num_tensors
    policy = DCredit(plan_)
    driver = Driver(policy, layouts)
    driver.start()
    for j in range(L - 1, -1, -1):
        driver.ready(j)
        budget_so_far = sum(plan_.windows[: L - j]) if j else sum(plan_.phase1_windows)
        assert len(driver.released) == budget_so_far
    driver.backward_end()
    assert policy.unused_budget == 0
    sent_in_phase1 = [0] * L
    for block in driver.released[: policy.released[0]]:
        sent_in_phase1[block.tensor] += 1
    assert sent_in_phase1 == [m - w for m, w in zip(plan_.blocks_per_tensor, plan_.phase2_windows)]


@settings(max_examples=200, deadline=None)
@given(planned_jobs(), st.randoms(use_true_random=False))
def test_phase_two_with_overlap_never_has_two_tensors_in_flight(
        job: tuple[Plan, list[TensorLayout]], rng: random.Random) -> None:
    plan_, layouts = job
    policy = DCredit(plan_, overlap_forward=True)
    driver = Driver(policy, layouts)
    driver.start()
    for j in range(plan_.num_tensors - 1, -1, -1):
        driver.ready(j)
    phase1 = set(driver.released)
    driver.backward_end()
    while driver.queue or driver.inflight:
        phase2_inflight = {b.tensor for b in driver.inflight if b not in phase1}
        assert len(phase2_inflight) <= 1
        driver.complete(rng.choice(driver.inflight))


def test_without_overlap_every_remaining_block_is_admitted_at_backward_end() -> None:
    # windows (0, 3, 2): nothing in phase 1; at backward end all five blocks go at once, in
    # priority order, with nothing completed (no per-tensor barrier: step() waits for all).
    policy = DCredit(Plan(partition_bytes=4, windows=(0, 3, 2), blocks_per_tensor=(3, 2)))
    assert policy.overlap_forward is False
    driver = Driver(policy, layouts_for([3, 2]))
    driver.start()
    driver.ready(1)
    driver.ready(0)
    assert driver.keys() == []
    driver.backward_end()
    assert driver.keys() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert policy.released == [0, 5]
    assert "released at once" in policy.describe()


def test_overlap_flag_is_keyword_only_and_plan_alone_still_constructs() -> None:
    plan_ = Plan(partition_bytes=4, windows=(1,), blocks_per_tensor=(1,))
    assert DCredit(plan_).overlap_forward is False
    assert DCredit(plan_, overlap_forward=True).overlap_forward is True
    with pytest.raises(TypeError):
        DCredit(plan_, True)  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(planned_jobs(), st.randoms(use_true_random=False))
def test_without_overlap_the_queue_is_empty_right_after_backward_end(
        job: tuple[Plan, list[TensorLayout]], rng: random.Random) -> None:
    # Whatever the ready order and completions during backward, on_backward_end admits every
    # queued block at once; the phase-1 releases are still exactly the planned budgets.
    plan_, layouts = job
    L = plan_.num_tensors
    policy = DCredit(plan_, overlap_forward=False)
    driver = Driver(policy, layouts)
    driver.start()
    for j in range(L - 1, -1, -1):
        driver.ready(j)
        if driver.inflight and rng.random() < 0.5:
            driver.complete(rng.choice(driver.inflight))
    assert policy.released[0] == sum(plan_.phase1_windows)
    driver.backward_end()
    assert not driver.queue
    assert policy.released == [sum(plan_.phase1_windows), sum(plan_.phase2_windows)]
    assert sorted(driver.keys()) == sorted(b.key for t in layouts for b in t.blocks)


@settings(max_examples=100, deadline=None)
@given(planned_jobs())
def test_from_profile_plans_with_the_options_and_spends_in_the_given_mode(
        job: tuple[Plan, list[TensorLayout]]) -> None:
    plan_, layouts = job
    L = plan_.num_tensors
    prof = Profile.from_lists([t.name for t in layouts], [t.nbytes for t in layouts], [4] * L,
                              [0.001] * L, [0.001] * L)
    cost = CostModel(1e-4, 1e-6)
    policy = DCredit.from_profile(prof, cost, plan_.partition_bytes, overlap_forward=True,
                                  phase1="batched")
    assert policy.overlap_forward is True
    assert policy.plan == plan(prof, cost, plan_.partition_bytes, overlap_forward=True,
                               phase1="batched")


# --- phase-2 options under overlap: windows of several tensors, pipelining -----------------------

def test_grouped_phase_two_releases_consecutive_tensors_of_one_window_together() -> None:
    # Tensors 0 and 1 share window 0, tensor 2 is window 1; depth 1 (barrier between windows).
    p = Plan(partition_bytes=4, windows=(0, 0, 1, 2, 1), blocks_per_tensor=(1, 2, 1),
             phase2="grouped", phase2_group=(0, 0, 1))
    policy = DCredit(p, overlap_forward=True)
    driver = Driver(policy, layouts_for([1, 2, 1]))
    driver.start()
    for j in (2, 1, 0):
        driver.ready(j)
    driver.backward_end()
    assert driver.keys() == [(0, 0), (1, 0), (1, 1)]       # one window, three blocks
    for _ in range(2):
        driver.complete(driver.inflight[0])
    assert len(driver.released) == 3                       # tensor 2 waits for the window
    driver.complete(driver.inflight[0])
    assert driver.keys()[3:] == [(2, 0)]


def test_pipelined_phase_two_opens_the_next_window_on_a_completion_while_one_is_in_flight() -> None:
    # Phase 1 sends tensor 3; phase 2 is one window per tensor (0, 1, 2), depth 2.
    p = Plan(partition_bytes=4, windows=(1, 0, 0, 1, 1, 1, 0), blocks_per_tensor=(1, 1, 1, 1),
             phase2="pipelined", phase2_depth=2)
    policy = DCredit(p, overlap_forward=True)
    driver = Driver(policy, layouts_for([1, 1, 1, 1]))
    driver.start()
    for j in (3, 2, 1, 0):
        driver.ready(j)
    assert driver.keys() == [(3, 0)]
    driver.backward_end()
    # Window 0 opens; window 1 does not go out in the same breath (it would be fused with 0).
    assert driver.keys() == [(3, 0), (0, 0)]
    driver.complete(driver.released[0])                    # the phase-1 block completes
    assert driver.keys() == [(3, 0), (0, 0), (1, 0)]       # window 1 joins window 0 in flight
    assert policy.phase2_windows_in_flight == 2
    driver.complete(driver.released[2])                    # window 1 done, window 0 still in flight
    assert driver.keys()[3:] == [(2, 0)]
    assert policy.phase2_windows_in_flight == 2


def test_spec_phase_two_is_the_default_of_a_plan_and_of_the_planner() -> None:
    p = Plan(partition_bytes=4, windows=(0, 1, 1), blocks_per_tensor=(1, 1))
    assert (p.phase2, p.phase2_group, p.phase2_depth) == ("per_tensor", (), 1)
    prof = Profile.from_lists(["a", "b"], [4, 4], [4, 4], [0.1, 0.1], [0.1, 0.1])
    q = plan(prof, CostModel(0.01, 0.001), 4)
    assert (q.phase2, q.phase2_group, q.phase2_depth) == ("per_tensor", (), 1)
    assert "per-tensor windows" in DCredit(q, overlap_forward=True).describe()


@st.composite
def planned_jobs_any_phase2(draw: st.DrawFn) -> tuple[Plan, list[TensorLayout]]:
    L = draw(st.integers(1, 10))
    numels = [draw(st.integers(0, 30)) for _ in range(L)]
    S_p = draw(st.sampled_from([4, 8, 20, 64]))
    times = st.floats(0, 0.01)
    prof = Profile.from_lists([f"t{l}" for l in range(L)], [4 * n for n in numels], [4] * L,
                              [draw(times) for _ in range(L)], [draw(times) for _ in range(L)])
    cost = CostModel(draw(st.floats(0, 1e-3)), draw(st.floats(0, 1e-4)))
    result = plan(prof, cost, S_p, phase1=draw(st.sampled_from(["greedy", "batched"])),
                  phase2=draw(st.sampled_from(["per_tensor", "pipelined", "grouped",
                                               "grouped_pipelined"])),
                  cycle_s=draw(st.sampled_from([0.0, 1e-3])))
    return result, build_layout(prof.names, numels, prof.element_size, S_p)


@settings(max_examples=150, deadline=None)
@given(planned_jobs_any_phase2(), st.randoms(use_true_random=False))
def test_every_phase_two_rule_releases_each_block_once_never_exceeds_its_depth_and_never_deadlocks(
        job: tuple[Plan, list[TensorLayout]], rng: random.Random) -> None:
    plan_, layouts = job
    L = plan_.num_tensors
    policy = DCredit(plan_, overlap_forward=True)
    driver = Driver(policy, layouts)
    all_keys = sorted(b.key for t in layouts for b in t.blocks)
    for _ in range(2):
        driver.start()
        order = list(range(L - 1, -1, -1))
        for _ in range(rng.randint(0, L)):
            i, j = rng.randrange(L), rng.randrange(L)
            order[i], order[j] = order[j], order[i]
        for t in order:
            if driver.inflight and rng.random() < 0.4:
                driver.complete(rng.choice(driver.inflight))
            driver.ready(t)
        phase1 = set(driver.released)
        driver.backward_end()
        while driver.queue or driver.inflight:
            assert driver.inflight, "deadlock: blocks queued, nothing in flight, admit refuses"
            windows = {plan_.phase2_window_of(b.tensor) for b in driver.inflight if b not in phase1}
            assert len(windows) <= plan_.phase2_depth
            assert policy.phase2_windows_in_flight == len(windows)
            driver.complete(rng.choice(driver.inflight))
        assert sorted(driver.keys()) == all_keys
        # Releases are a prefix of the priority order within phase 2 (the driver's queue).
        phase2 = [b.key for b in driver.released if b not in phase1]
        assert phase2 == sorted(phase2)
