"""DeAR's two rules (buffers reduce-scattered whole, all-gathers one ahead) and the
forward-order restriction of the sharded mode's all-gathers."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_hvd.config import SchedulerConfig
from dcredit_hvd.planning.blocks import build_layout
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.planner import Plan, plan
from dcredit_hvd.planning.profile import Profile
from dcredit_hvd.policies.base import Immediate, InForwardOrder
from dcredit_hvd.policies.bytescheduler import ByteScheduler
from dcredit_hvd.policies.dcredit import DCredit
from dcredit_hvd.policies.dear import DEAR_BUFFER_BYTES, DeAR, DeARGather, dear_groups
from dcredit_hvd.policies.wfbp import WFBP

MiB = 1 << 20


def test_dear_buffer_is_the_authors_25_mib():
    assert DEAR_BUFFER_BYTES == 25 * MiB
    assert DeAR().partition_bytes(4_000_000) is None


def test_dear_groups_close_a_buffer_before_it_would_reach_the_threshold():
    # The authors' rule: join while the buffer is empty or stays strictly under the threshold.
    assert dear_groups([10 * MiB, 10 * MiB, 5 * MiB, 1], 25 * MiB) == (2, 2)
    assert dear_groups([10 * MiB, 14 * MiB, 1 * MiB], 25 * MiB) == (2, 1)
    assert dear_groups([30 * MiB, 1, 1], 25 * MiB) == (1, 2)       # a big tensor goes alone
    assert dear_groups([1, 30 * MiB, 1], 25 * MiB) == (1, 1, 1)
    assert dear_groups([0, 0, 30 * MiB], 25 * MiB) == (3,)         # an empty buffer takes anything
    assert dear_groups([], 25 * MiB) == ()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40 * MiB), max_size=30), st.integers(1, 64 * MiB))
def test_dear_groups_cover_every_tensor_in_order_and_stay_under_the_threshold(sizes, limit):
    groups = dear_groups(sizes, limit)
    assert sum(groups) == len(sizes) and all(g >= 1 for g in groups)
    first = 0
    for g in groups:
        members = sizes[first:first + g]
        first += g
        if g > 1:   # a buffer of several tensors stays under the threshold
            assert sum(members) - members[-1] < limit
            assert sum(members) < limit or sum(members[:-1]) == 0


def test_dear_refuses_a_non_positive_buffer():
    with pytest.raises(ValueError, match="buffer"):
        DeAR(0)
    with pytest.raises(ValueError, match="threshold"):
        dear_groups([1], 0)


def _layouts(count: int, blocks: int = 1):
    return build_layout([f"t{i}" for i in range(count)], [blocks] * count, [4] * count, 4)


def test_dear_gather_keeps_one_buffer_in_flight_in_the_order_asked():
    rule = DeARGather()
    layouts = _layouts(3)
    rule.bind(layouts)
    rule.start_iteration()
    b0, b1 = layouts[0].blocks[0], layouts[1].blocks[0]
    assert rule.admit(b0)
    assert not rule.admit(b1)          # the next buffer waits for the first to finish
    rule.on_complete(b0)
    assert rule.admit(b1)
    rule.start_iteration()             # a new iteration forgets what was in flight
    assert rule.admit(b0)


def test_each_policy_gives_a_fresh_rule_of_its_own_kind_for_the_gathers():
    assert isinstance(WFBP().gather_rule(), WFBP)
    assert isinstance(Immediate().gather_rule(), Immediate)
    assert ByteScheduler(123).gather_rule().credit_bytes == 123
    assert isinstance(DeAR().gather_rule(), DeARGather)
    p = Profile.from_lists(["a", "b"], [8, 8], [4, 4], [0.001] * 2, [0.002] * 2)
    made = plan(p, CostModel(1e-4, 1e-9), 4)
    for overlap in (True, False):        # the next forward overlaps the gathers, or step() waits
        rule = DCredit(made, overlap_forward=overlap).gather_rule()
        assert isinstance(rule, DCredit) and rule.overlap_forward == overlap and rule.plan is made


def test_the_reduce_scatters_drain_phase_2_because_step_waits_for_them():
    p = Profile.from_lists(["a", "b"], [8, 8], [4, 4], [0.001] * 2, [0.002] * 2)
    made = plan(p, CostModel(1e-4, 1e-9), 4)
    assert not DCredit(made, overlap_forward=True).scatter_rule().overlap_forward
    plain = DCredit(made)
    assert plain.scatter_rule() is plain
    wfbp = WFBP()
    assert wfbp.scatter_rule() is wfbp


def test_dcredit_gathers_in_the_order_its_plan_chose():
    p = Profile.from_lists(["a", "b"], [8, 8], [4, 4], [0.001] * 2, [0.002] * 2)
    made = plan(p, CostModel(1e-4, 1e-9), 4)
    assert DCredit(made).gathers_in_forward_order()
    from dataclasses import replace
    assert not DCredit(replace(made, gather_order="ready")).gathers_in_forward_order()
    with pytest.raises(ValueError, match="gather_order"):
        replace(made, gather_order="backward")
    assert isinstance(made, Plan)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_in_forward_order_releases_every_block_in_priority_order_whatever_order_they_arrive(
        blocks, rnd: random.Random):
    layouts = build_layout([f"t{i}" for i in range(len(blocks))], blocks, [4] * len(blocks), 4)
    rule = InForwardOrder(Immediate())
    rule.bind(layouts)
    rule.start_iteration()
    arrivals = list(range(len(blocks)))
    rnd.shuffle(arrivals)
    queue, released = [], []
    for unit in arrivals:
        queue.extend(layouts[unit].blocks)
        queue.sort()
        rule.on_ready(unit)
        while queue and rule.admit(queue[0]):
            released.append(queue.pop(0))
    assert not queue
    assert released == sorted(b for layout in layouts for b in layout.blocks)


def test_the_runtime_accepts_dear_and_refuses_it_with_shards():
    assert SchedulerConfig.resolve(environ={"DCREDIT_POLICY": "DeAR"}).policy == "dear"
    assert SchedulerConfig.resolve(environ={}, policy="dear").split
    with pytest.raises(ValueError, match="shard=True with policy='dear'"):
        SchedulerConfig.resolve(environ={}, policy="dear", shard=True)


def test_dear_buffers_hold_one_kind_only():
    # Three float32 tensors, then a float16 one, then a tensor never grouped (CUDA): the
    # dtype change and the ungroupable tensor each start a buffer of their own.
    kinds = [("cpu", 4), ("cpu", 4), ("cpu", 4), ("cpu", 2), None, ("cpu", 2)]
    assert dear_groups([100] * 6, 1 << 20, kinds) == (3, 1, 1, 1)


def test_group_bytes_sets_dears_buffer_size():
    from dcredit_hvd.policies import make_policy
    assert make_policy("dear", 1).buffer_bytes == DEAR_BUFFER_BYTES
    assert make_policy("dear", 1, buffer_bytes=1 << 20).buffer_bytes == 1 << 20
