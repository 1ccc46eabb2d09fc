"""The race's decision logic (``planning/race.py``) and its plan space (``planning/candidates.py``),
on numbers and modelled profiles: no ranks, no clocks."""
from __future__ import annotations

import math
import random

import pytest

from dcredit_hvd.config import SchedulerConfig
from dcredit_hvd.planning import decision, simulator
from dcredit_hvd.planning.candidates import Schedule, corrected
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.engine import Execution
from dcredit_hvd.planning.profile import Profile
from dcredit_hvd.planning.race import Entry, Race, RaceSettings, format_table, refit_offset
from dcredit_hvd.policies.ddp import DDPBuckets

SETTINGS = RaceSettings(rounds=(4, 8, 16), drop=1, margin=0.03)


def _run(race: Race, speed: dict[int, float], noise: float = 0.0, seed: int = 0) -> list[int]:
    """Drive ``race`` to its end with each candidate's iterations at ``speed`` seconds (and
    relative noise); returns the candidates in the order they ran."""
    rng = random.Random(seed)
    ran = []
    while not race.done:
        i = race.current
        ran.append(i)
        race.block_done([speed[i] * (1 + rng.uniform(-noise, noise))
                         for _ in range(race.block_length)])
    return ran


def _entries(n: int) -> list[Entry]:
    return [Entry(f"c{i}", 0.01) for i in range(n)]


def test_successive_halving_drops_the_slower_half_each_round_and_keeps_the_incumbent():
    race = Race(_entries(6), SETTINGS)
    speeds = {0: 0.050, 1: 0.010, 2: 0.020, 3: 0.030, 4: 0.040, 5: 0.060}
    ran = _run(race, speeds)
    assert ran[:6] == [0, 1, 2, 3, 4, 5]                 # round 1: everyone, incumbent first
    assert race.winner == 1
    verdicts = {e.label: e.verdict for e in race.entries}
    assert verdicts["c5"] == "dropped in round 1" and verdicts["c4"] == "dropped in round 1"
    assert verdicts["c0"] == "kept (incumbent)"          # never dropped, however slow
    assert verdicts["c1"] == "won"


def test_a_challenger_within_the_margin_never_replaces_the_incumbent():
    race = Race(_entries(3), SETTINGS)
    _run(race, {0: 0.0100, 1: 0.0099, 2: 0.0120})        # 1% faster: below the 3% margin
    assert race.winner == 0


def test_a_challenger_within_two_standard_errors_never_replaces_the_incumbent():
    race = Race(_entries(2), RaceSettings(rounds=(4, 4), drop=0, margin=0.0))
    _run(race, {0: 0.0100, 1: 0.0095}, noise=0.5, seed=3)   # 5% faster under 50% noise
    c0, c1 = race.entries
    gain = c0.median - c1.median
    assert race.winner == (1 if gain > 2 * math.hypot(c0.standard_error, c1.standard_error) else 0)
    quiet = Race(_entries(2), RaceSettings(rounds=(4, 4), drop=0, margin=0.0))
    _run(quiet, {0: 0.0100, 1: 0.0095}, noise=0.001)
    assert quiet.winner == 1                              # the same gain, measured cleanly


def test_the_dropped_iterations_after_each_switch_are_not_counted():
    race = Race(_entries(2), RaceSettings(rounds=(3, 3), drop=2))
    race.block_done([9.0, 9.0, 1.0, 1.0, 1.0])            # the first two: settling
    assert race.entries[0].samples == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="5 iterations"):
        race.block_done([1.0])


def test_the_same_times_give_the_same_decision_on_every_rank():
    speeds = {0: 0.03, 1: 0.02, 2: 0.025, 3: 0.04}
    verdicts = []
    for _ in range(2):                                     # two "ranks", the same numbers
        race = Race(_entries(4), SETTINGS)
        ran = _run(race, speeds, noise=0.2, seed=11)
        verdicts.append((ran, race.winner, [e.verdict for e in race.entries]))
    assert verdicts[0] == verdicts[1]


def test_the_forced_label_wins_so_that_tests_exercise_a_switch():
    race = Race(_entries(3), RaceSettings(rounds=(2, 2), drop=0, force="c2"))
    _run(race, {0: 0.01, 1: 0.02, 2: 0.05})
    assert race.winner == 2


def test_a_failed_candidate_is_dropped_and_the_race_goes_on():
    race = Race(_entries(3), RaceSettings(rounds=(2, 2), drop=0))
    race.block_done([0.02, 0.02])
    assert race.current == 1
    race.fail("sharded plan refused")
    assert race.entries[1].verdict == "failed: sharded plan refused"
    _run(race, {0: 0.02, 2: 0.01})
    assert race.winner == 2
    with pytest.raises(ValueError, match="incumbent"):
        Race(_entries(2), SETTINGS).fail("broken")


def test_the_cost_is_the_time_lost_against_the_winner_and_the_table_has_every_row():
    race = Race(_entries(2), RaceSettings(rounds=(2, 2), drop=0))
    _run(race, {0: 0.02, 1: 0.01})
    assert race.winner == 1
    assert race.cost_s() == pytest.approx(4 * 0.01)        # 4 iterations of c0, 10 ms each lost
    rows = race.table()
    assert [r["candidate"] for r in rows] == ["c0", "c1"]
    assert rows[1]["measured_ms"] == pytest.approx(10.0) and rows[1]["verdict"] == "won"
    assert "predicted ms" in format_table(rows) and "c1" in format_table(rows)


def test_the_refit_finds_a_per_allreduce_cost_the_model_missed():
    # Three candidates whose measured time exceeds the prediction by 0.2 ms per all-reduce
    # plus 1 ms per iteration.
    rows = [(0.010, 0.010 + 2e-4 * k + 1e-3, k) for k in (4, 10, 40)]
    d_op, d_fixed = refit_offset(rows)
    assert d_op == pytest.approx(2e-4) and d_fixed == pytest.approx(1e-3)
    assert refit_offset([(0.01, 0.012, 5), (0.01, 0.014, 5)]) == (0.0, pytest.approx(0.003))
    cost = CostModel(a=1e-4, b=1e-9)
    assert corrected(cost, 2e-4).a == pytest.approx(3e-4) and corrected(cost, 0.0) is cost


def test_a_start_up_fitted_too_high_is_taken_off_by_the_refit_down_to_zero():
    # Candidates with more all-reduces ran 5 ms each FASTER than predicted (the start-up was
    # fitted on a busy moment): the refit says so, and the corrected model charges less.
    rows = [(0.5, 0.5 - 5e-3 * k, k) for k in (10, 30, 120)]
    d_op, d_fixed = refit_offset(rows)
    assert d_op == pytest.approx(-5e-3) and d_fixed == pytest.approx(0.0, abs=1e-12)
    cost = CostModel(a=8e-3, b=1e-9, floor=20e-3)
    fixed = corrected(cost, d_op)
    assert fixed.a == pytest.approx(3e-3) and fixed.floor == pytest.approx(15e-3)
    assert fixed.time(1e6) == pytest.approx(cost.time(1e6) - 5e-3)
    clamped = corrected(cost, -0.05)
    assert clamped.a == 0.0 and clamped.floor == 0.0 and clamped.b == cost.b
    # Positive, every all-reduce costs more, the small ones under the floor too.
    assert corrected(cost, 1e-3).time(1.0) == pytest.approx(cost.time(1.0) + 1e-3)


def test_race_settings_refuse_bad_rounds_and_margins():
    with pytest.raises(ValueError, match="rounds"):
        RaceSettings(rounds=(1,))
    with pytest.raises(ValueError, match="margin"):
        RaceSettings(margin=1.5)
    with pytest.raises(ValueError, match="DCREDIT_TUNE_MARGIN"):
        SchedulerConfig.resolve({"DCREDIT_TUNE_MARGIN": "2"})
    assert SchedulerConfig.resolve({"DCREDIT_TUNE": "0"}).tune is False
    assert SchedulerConfig.resolve(tune_rounds="4, 8").race_settings().rounds == (4, 8)


# -- the plan space ------------------------------------------------------------------------
PROFILE = Profile(names=tuple(f"t{i}" for i in range(8)),
                  nbytes=(4 << 20, 64 << 10, 8 << 20, 64 << 10, 16 << 20, 256 << 10, 30 << 20, 4096),
                  element_size=(4,) * 8, t_f=(2e-3,) * 8, t_b=(4e-3,) * 8, t_u=(5e-4,) * 8)
COST = CostModel(a=2e-4, b=8e-10)


def test_the_candidates_hold_the_top_plans_first_then_every_expressible_baseline():
    config = SchedulerConfig.resolve()
    plan, _, _, found = decision.decide_race(PROFILE, COST, config, overlap_forward=True)
    labels = [s.label for s in found]
    assert found[0].plan == plan                           # the incumbent is the simulator's pick
    assert [s.policy for s in found[:3]] == ["dcredit"] * 3
    assert labels[3:] == ["bytescheduler", "wfbp/horovod", "ddp"]
    assert all(s.predicted_s and s.predicted_s > 0 for s in found)
    assert found[0].predicted_s <= min(s.predicted_s for s in found[:3])


def test_each_baseline_candidate_is_priced_by_the_simulator_as_the_baseline_itself():
    config = SchedulerConfig.resolve()
    horovod = Execution(cycle_s=0.002, fusion_bytes=1 << 20)
    _, _, _, found = decision.decide_race(PROFILE, COST, config, overlap_forward=False,
                                          collectives=horovod)
    sim = {"cycle_s": 0.002, "fusion_bytes": 1 << 20,
           "block_overhead_s": decision.BLOCK_OVERHEAD_S[False]}
    by = {s.label: s for s in found}
    bs = simulator.simulate(PROFILE, COST, "bytescheduler", partition_bytes=config.partition_bytes,
                            credit_bytes=config.credit_bytes, **sim)
    assert by["bytescheduler"].predicted_s == pytest.approx(bs.iteration_s)
    wfbp = simulator.simulate(PROFILE, COST, "wfbp", **sim)
    assert by["wfbp/horovod"].predicted_s == pytest.approx(wfbp.iteration_s)


def test_wfbp_is_priced_fused_under_horovod_and_one_collective_per_tensor_on_torch_distributed():
    # Under Horovod the runtime's one-collective-per-tensor schedule is fused by Horovod's own
    # cycle (hvd.DistributedOptimizer's schedule); torch.distributed runs each one alone.
    config = SchedulerConfig.resolve()
    costly = CostModel(a=2e-3, b=8e-10)                # a start-up that fusing saves
    def wfbp(collectives):
        found = decision.decide_race(PROFILE, costly, config, overlap_forward=True,
                                     collectives=collectives)[3]
        return next(s for s in found if s.label == "wfbp/horovod")
    fused = wfbp(Execution(cycle_s=0.001, fusion_bytes=128 << 20))
    alone = wfbp(Execution(cycle_s=0.0, fusion_bytes=0))
    assert alone.ops_per_iteration == PROFILE.num_tensors
    assert fused.ops_per_iteration < PROFILE.num_tensors / 2
    assert fused.predicted_s < alone.predicted_s


def test_ddp_buckets_are_cut_in_backward_order_up_to_25_mib():
    mib = 1 << 20
    sizes = [10 * mib, 10 * mib, 10 * mib, 30 * mib, 5 * mib]
    groups = DDPBuckets().groups(sizes, ["f32"] * 5)
    assert sum(groups) == 5
    # From the last: 5 MiB opens a bucket, 30 MiB is one alone, then 10 + 10 MiB, then 10 MiB.
    assert groups == (1, 2, 1, 1)
    assert DDPBuckets().partition_bytes(4_000_000) is None


def test_the_sharded_plan_space_keeps_the_partition_of_the_slices():
    config = SchedulerConfig.resolve(shard=True)
    _, _, _, found = decision.decide_race(PROFILE, COST, config, overlap_forward=True, workers=4)
    assert [s.label for s in found if s.policy != "dcredit"] == ["bytescheduler", "immediate"]
    assert {s.partition_bytes for s in found} == {config.partition_bytes}
    assert all(not s.groups for s in found)


def test_an_emulated_clusters_baselines_take_the_targets_byte_settings_scaled_like_its_gradients():
    scale = 12.0
    config = SchedulerConfig.resolve(tune_byte_scale=scale)
    _, _, _, found = decision.decide_race(PROFILE, COST, config, overlap_forward=True)
    by = {s.label: s for s in found}
    assert by["bytescheduler"].partition_bytes == round(config.partition_bytes / scale)
    assert by["bytescheduler"].credit_bytes == round(config.credit_bytes / scale)
    assert by["ddp"].policy_object(True).bucket_bytes == round((25 << 20) / scale)
    plain = {s.label: s for s in decision.decide_race(
        PROFILE, COST, SchedulerConfig.resolve(), overlap_forward=True)[3]}
    assert plain["ddp"].policy_object(True).bucket_bytes == 25 << 20
    # Sharded, the partition is the job's (its slices are ranges of its blocks): not rescaled.
    sharded = SchedulerConfig.resolve(shard=True, tune_byte_scale=scale)
    found = decision.decide_race(PROFILE, COST, sharded, overlap_forward=True, workers=4)[3]
    assert {s.partition_bytes for s in found} == {sharded.partition_bytes}
    with pytest.raises(ValueError, match="tune_byte_scale must be > "):
        SchedulerConfig.resolve(tune_byte_scale=0.5)


def test_a_schedule_names_an_unknown_policy_or_a_missing_plan():
    with pytest.raises(ValueError, match="needs a plan"):
        Schedule("x", "dcredit").policy_object(True)
    with pytest.raises(ValueError, match="unknown policy"):
        Schedule("x", "adasum").policy_object(True)
