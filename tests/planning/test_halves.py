"""The two halves of an all-reduce in the simulator: costs, bounds, DeAR's schedule and the
sharded mode's, checked against hand-computed timelines."""
from __future__ import annotations

import pytest

from dcredit_hvd.planning import halves
from dcredit_hvd.planning import simulator as sim
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.profile import Profile


def test_halves_of_a_ring_all_reduce_add_up_to_it():
    for n in (2, 4, 16):
        rs, ag = halves.link_costs(10e9, 5e-6, n, 50e-6)
        whole = sim.link_cost(10e9, 5e-6, n, 50e-6)
        for x in (0, 1 << 20, 100 << 20):
            assert rs.time(x) + ag.time(x) == pytest.approx(whole.time(x) + 50e-6)
    rs, ag = halves.split_cost(CostModel(a=2e-3, b=4e-9, floor=5e-3))
    assert (rs.a, rs.b, rs.floor) == (1e-3, 2e-9, 5e-3)     # each half keeps the floor
    assert rs == ag


def test_link_costs_refuse_nonsense():
    with pytest.raises(ValueError):
        halves.link_costs(0, 0, 2, 0)
    with pytest.raises(ValueError):
        halves.shard_update_times(Profile.from_lists(["a"], [4], [4], [0], [0]), 0)


def _two_layers(t_u=()):
    # Forward 1 + 1 ms, backward 2 + 2 ms; 1000-byte gradients.
    return Profile.from_lists(["in", "out"], [1000, 1000], [4, 4], [1e-3, 1e-3], [2e-3, 2e-3], t_u)


def test_the_sharded_bound_divides_the_update_and_counts_both_halves():
    p = _two_layers(t_u=[4e-3, 4e-3])
    half = CostModel(a=0.0, b=1e-6)                       # 1 ms per 1000 bytes
    assert halves.lower_bound(p, half, half) == pytest.approx(14e-3)            # compute
    # Sharded, compute is 2 + 4 + 8/4 = 8 ms, but layer 0's own chain is longer: ready at
    # 4 ms, + 1 (scatter) + 1 (its shard's update) + 1 (gather) + 2 (forward of both) = 9 ms.
    assert halves.lower_bound(p, half, half, 4, sharded=True) == pytest.approx(9e-3)
    slow = CostModel(a=0.0, b=1e-5)                       # 20 ms per half of everything
    assert halves.lower_bound(p, slow, slow, 4, sharded=True) == pytest.approx(40e-3)


def test_dear_gathers_after_the_last_scatter_one_buffer_at_a_time_in_forward_order():
    p = Profile.from_lists([f"t{i}" for i in range(4)], [30 << 20] * 4, [4] * 4, [1e-3] * 4,
                           [2e-3] * 4)
    r = sim.simulate(p, CostModel(a=1e-4, b=1e-10), "dear", cycle_s=0.0)
    assert r.halves and not r.shard and r.overlap_forward and r.fusion_bytes == 0
    scatters = [op for op in r.trace if op.kind == "reduce_scatter"]
    gathers = [op for op in r.trace if op.kind == "all_gather"]
    assert len(scatters) == len(gathers) == 4                     # a 30 MiB tensor per buffer
    assert min(g.start for g in gathers) >= max(s.end for s in scatters) - 1e-12
    assert [g.blocks for g in gathers] == [((0, 0),), ((1, 0),), ((2, 0),), ((3, 0),)]
    for first, second in zip(gathers, gathers[1:]):               # one in flight
        assert second.start >= first.end - 1e-12


def test_dear_on_a_hand_computed_timeline():
    # Two 1000-byte tensors in one buffer, each half 1 ms per 1000 B, no cycle.  Backward 0..4:
    # the buffer is complete at 4 ms, reduce-scatter 4..6, all-gather 6..8, then the update
    # (0) and the forward of both layers (2 ms): the next backward starts at 10 ms.
    p = _two_layers()
    half = CostModel(a=0.0, b=1e-6)
    r = sim.simulate(p, CostModel(a=0.0, b=2e-6), "dear", cycle_s=0.0, scatter_cost=half,
                     gather_cost=half, warmup=2, iterations=3)
    assert r.iteration_s == pytest.approx(10e-3)
    assert r.lower_bound_s == pytest.approx(8e-3)                 # 6 ms compute, 4 ms + 4 ms


def test_the_sharded_mode_updates_a_shard_between_the_halves():
    # One 1000-byte tensor, update 8 ms on the whole tensor, 2 ranks: 4 ms on the shard.
    # Backward 0..2, reduce-scatter 2..3, shard update 3..7, all-gather 7..8, forward 8..9.
    p = Profile.from_lists(["w"], [1000], [4], [1e-3], [2e-3], [8e-3])
    half = CostModel(a=0.0, b=1e-6)
    r = sim.simulate(p, CostModel(a=0.0, b=2e-6), "wfbp", shard=True, workers=2, cycle_s=0.0,
                     scatter_cost=half, gather_cost=half, overlap_forward=True, warmup=2,
                     iterations=3)
    assert r.shard and r.halves
    assert r.compute_s == pytest.approx(7e-3)                     # 1 + 2 + 8 / 2
    assert r.iteration_s == pytest.approx(9e-3)
    unsharded = sim.simulate(p, CostModel(a=0.0, b=2e-6), "wfbp", cycle_s=0.0,
                             overlap_forward=True, warmup=2, iterations=3)
    assert unsharded.iteration_s == pytest.approx(13e-3)          # 2 + 2 + 8 + 1


def test_sharding_is_refused_where_it_cannot_run():
    p = _two_layers()
    with pytest.raises(ValueError, match="horovod"):
        sim.simulate(p, CostModel(0.0, 1e-9), "horovod", shard=True, workers=2)
    with pytest.raises(ValueError, match="workers"):
        sim.simulate(p, CostModel(0.0, 1e-9), "wfbp", shard=True)


def test_compare_runs_dear_beside_the_baselines_and_shards_all_but_horovod():
    p = _two_layers(t_u=[1e-3, 1e-3])
    cost = CostModel(a=1e-4, b=1e-6)
    rows = {r.policy: r for r in sim.compare(p, cost, policies=("horovod", "dear", "dcredit"),
                                             overlap_forward=True, candidates=(1 << 10,),
                                             shard=True, workers=2)}
    assert not rows["horovod"].shard and rows["dcredit"].shard and rows["dear"].shard
    rs, ag = halves.split_cost(cost)
    assert rows[sim.LOWER_BOUND].iteration_s == pytest.approx(
        halves.lower_bound(p, rs, ag, 2, sharded=True))
    assert rows["dcredit"].plan.gather_order in ("forward", "ready")


def test_the_sharded_all_gathers_wait_for_every_scatter_and_update_as_step_does():
    # The runtime's step() (runtime/gathers.py): every reduce-scatter, then the shard updates,
    # then the all-gathers.  Two 1000-byte tensors, 2 ranks, 4 ms updates (2 ms on a shard),
    # each half 1 ms.  Backward 0..4: "out" is scattered 2..3, "in" 4..5; updates 5..9;
    # all-gathers in forward order, "in" 9..10, "out" 10..11; forward 10..11 and 11..12.
    p = _two_layers(t_u=[4e-3, 4e-3])
    half = CostModel(a=0.0, b=1e-6)
    r = sim.simulate(p, CostModel(a=0.0, b=2e-6), "wfbp", shard=True, workers=2, cycle_s=0.0,
                     scatter_cost=half, gather_cost=half, overlap_forward=True, warmup=2,
                     iterations=3)
    gathers = [op for op in r.trace if op.kind == "all_gather"]
    assert [g.blocks for g in gathers] == [((0, 0),), ((1, 0),)]
    assert gathers[0].start == pytest.approx(9e-3)
    assert r.iteration_s == pytest.approx(12e-3)
