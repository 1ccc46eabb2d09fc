"""The D-Credit planner: hand-worked windows, the fixed defects, and invariants over random profiles.

Hand-worked cases use S_p = 256 B, b = 2^-8 s/B (one full block = 1 s) and a = 0.125 s: every
number is a dyadic rational, so the arithmetic below is exact in floating point.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcredit_hvd.planning.blocks import build_layout
from dcredit_hvd.planning.costmodel import CostModel
from dcredit_hvd.planning.planner import Plan, choose_partition, model_iteration_time, plan
from dcredit_hvd.planning.profile import Profile

S_P = 256
COST = CostModel(a=0.125, b=2.0**-8)


def profile(nbytes: Sequence[int], t_b: Sequence[float], t_f: Sequence[float] = (),
            element_size: int = 4) -> Profile:
    n = len(nbytes)
    return Profile.from_lists([f"t{i}" for i in range(n)], nbytes, [element_size] * n,
                              t_f or [0.0] * n, t_b)


# --- hand-worked cases -------------------------------------------------------------------------

def test_tensor_dividing_exactly_into_blocks_charges_its_last_block_in_full() -> None:
    # Step l=1: tau = r2 = 1, dt = r1 - 1 - a = 1.5 > (2-1) blocks, so all 2 blocks of tensor 2
    # go: tau = max(1 + 0.125 + 2, 2.625) = 3.125.  (Charging the last block as 0, defect 2,
    # gives tau = 2.625 and a spurious window of 1 at step 0.)  Step l=0: dt = 2.875 - 3.125 -
    # 0.125 = -0.375 <= -a: the link is busy, nothing goes.
    result = plan(profile([256, 256, 512], t_b=[0.25, 1.625, 1.0]), COST, S_P)
    assert result.blocks_per_tensor == (1, 1, 2)
    assert result.last_fraction[2] == 1.0
    assert result.windows == (2, 0, 1, 1, 0)
    assert result.predicted_phase1_end == 3.125


def test_gap_filled_by_several_whole_tensors_shrinks_the_idle_budget() -> None:
    # t_b(3) = t_b(2) = 0: no idle time at steps 3 and 2, so tensors 2, 3, 4 (one block each)
    # are pending at step l=1 with dt = 1.625 - 0.125 = 1.5.  Tensor 2 uses 1 s (dt 0.5),
    # tensor 3 uses 1 s (dt -0.5 <= -a): stop.  The window is 2, not 3 (defect 1 grew dt).
    result = plan(profile([256] * 5, t_b=[0.0, 1.625, 0.0, 0.0, 1.0]), COST, S_P)
    assert result.windows == (0, 0, 2, 0, 1, 1, 0, 0, 1)
    assert result.predicted_phase1_end == 3.125


def test_one_block_taken_after_whole_tensors_is_added_to_the_window_not_assigned() -> None:
    # Step l=1: dt = 1.0; tensor 2 (1 block) takes it to 0, then -a < dt <= 0 takes one block of
    # tensor 3.  Window 2; assigning 1 instead (defect 3) would lose a block from sum(windows).
    result = plan(profile([256] * 4, t_b=[0.0, 1.125, 0.0, 1.0]), COST, S_P)
    assert result.windows == (0, 2, 0, 1, 1, 0, 0)
    assert sum(result.windows) == 4


def test_partial_tensor_take_is_ceil_of_gap_and_last_fraction_is_charged() -> None:
    # Tensor 2: 640 B = 3 blocks, last 0.5.  Step l=1: dt = 1.5 <= (3-1) blocks: take ceil(1.5)
    # = 2, tau = 1 + 0.125 + 2 = 3.125.  Step l=0: dt = 5.25 - 3.125 - 0.125 = 2 > (2-1): all
    # of tensor 1 (2 blocks, dt 0), then one block of tensor 2, its last, charged 0.5:
    # tau = 3.125 + 0.125 + 2.5 = 5.75.
    result = plan(profile([256, 512, 640], t_b=[2.625, 1.625, 1.0]), COST, S_P)
    assert result.blocks_per_tensor == (1, 2, 3)
    assert result.last_fraction == (1.0, 1.0, 0.5)
    assert result.windows == (2, 3, 1, 0, 0)
    assert result.predicted_phase1_end == 5.75


def test_single_small_block_is_charged_its_own_bytes_not_a_full_block() -> None:
    # 64 B at S_p = 256 B: last_1 = 0.25 (spec: M/S_p - (m-1)).  dt = 0.125 > 0, tensor 1 goes:
    # tau = max(1 + 0.125 + 0.25, 1.25) = 1.375, not 2.125.
    result = plan(profile([256, 64], t_b=[0.25, 1.0]), COST, S_P)
    assert result.last_fraction == (1.0, 0.25)
    assert result.windows == (1, 1, 0)
    assert result.predicted_phase1_end == 1.375


def test_zero_byte_tensor_counts_as_one_empty_block() -> None:
    result = plan(profile([256, 0, 512], t_b=[1.0, 1.0, 1.0]), COST, S_P)
    assert result.blocks_per_tensor == (1, 1, 2)
    assert result.last_fraction[1] == 0.0
    assert sum(result.windows) == 4


def test_link_still_busy_sends_nothing_and_defers_to_phase_two() -> None:
    # Every gradient ready at once (t_b = 0 except the first): no idle time, no phase-1 window.
    result = plan(profile([256] * 3, t_b=[0.0, 0.0, 1.0]), COST, S_P)
    assert result.windows == (0, 0, 1, 1, 1)


def test_single_tensor_has_only_its_phase_two_window() -> None:
    result = plan(profile([1000], t_b=[1.0]), COST, S_P)
    assert result.windows == (4,)
    assert result.phase1_windows == ()


def test_predicted_iteration_follows_the_phase_two_timeline() -> None:
    # Continues the exact-divide case: link free at 3.125.  Tensor 0's window: 3.125 + 1.125 =
    # 4.25, forward 0 runs 4.25-4.75; tensor 1's window ends 5.375, forward 1 5.375-5.875;
    # tensor 2 was sent in phase 1, forward 2 5.875-6.375.
    result = plan(profile([256, 256, 512], t_b=[0.25, 1.625, 1.0], t_f=[0.5, 0.5, 0.5]), COST, S_P)
    assert result.predicted_iteration == 6.375


def test_forward_of_a_layer_waits_for_its_parameter_update() -> None:
    # As above with t_u = 0.25 s: forward 0 starts at 4.25 + 0.25 = 4.5 and ends 5.0; tensor 1's
    # window ends 5.375, its update 5.625, forward 1 ends 6.125; forward 2 ends 6.625.
    prof = Profile.from_lists(["t0", "t1", "t2"], [256, 256, 512], [4] * 3, [0.5] * 3,
                              [0.25, 1.625, 1.0], t_u=[0.25] * 3)
    assert plan(prof, COST, S_P).predicted_iteration == 6.625


def test_phase_one_budget_of_ready_tensor_j_is_window_l_minus_1_minus_j() -> None:
    result = plan(profile([256] * 5, t_b=[0.0, 1.625, 0.0, 0.0, 1.0]), COST, S_P)
    L = 5
    # windows[2] was planned at step l=1 (the gap ending at r_1) and goes when gradient 2 is ready.
    assert [result.phase1_budget(j) for j in range(L)] == [0, 0, 2, 0, 0]
    assert all(result.phase1_budget(j) == result.windows[L - 1 - j] for j in range(1, L))
    with pytest.raises(IndexError):
        result.phase1_budget(L)


def test_free_link_sends_everything_in_phase_one_except_tensor_zero() -> None:
    result = plan(profile([1000, 300, 2000, 8], t_b=[0.5, 0.5, 0.5, 0.5]), CostModel(0.0, 0.0), S_P)
    assert result.phase2_windows == (result.blocks_per_tensor[0], 0, 0, 0)


# --- input validation --------------------------------------------------------------------------

def test_sizes_that_are_not_whole_elements_are_rejected() -> None:
    with pytest.raises(ValueError, match="whole number"):
        plan(profile([256, 255], t_b=[1.0, 1.0]), COST, S_P)


@pytest.mark.parametrize("bad", [0, -256, 256.0, True])
def test_non_positive_or_non_integer_partition_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="partition_bytes"):
        plan(profile([256], t_b=[1.0]), COST, bad)  # type: ignore[arg-type]


def test_empty_profile_is_rejected() -> None:
    with pytest.raises(ValueError, match="no tensors"):
        plan(profile([], t_b=[]), COST, S_P)


@pytest.mark.parametrize(
    "windows, blocks, message",
    [
        ((1, 1, 1), (1, 1), "sum"),               # one block too many (assign-vs-add symptom)
        ((0, 1), (1, 1), "2L-1"),
        ((-1, 2, 1), (1, 1), ">= 0"),
        ((0, 3, 0), (1, 2), "phase-2 window exceeds"),
        ((2, 0, 0), (1, 1), "ready by then"),     # budget for tensor 1 bigger than tensor 1
    ],
)
def test_plan_refuses_windows_that_break_an_invariant(windows: tuple[int, ...], blocks: tuple[int, ...],
                                                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Plan(partition_bytes=S_P, windows=windows, blocks_per_tensor=blocks)


# --- properties over random profiles -----------------------------------------------------------

def reference_plan(nbytes: Sequence[int], t_b: Sequence[float], a: float, b: float,
                   S_p: int) -> tuple[list[int], float]:
    """Spec §3-§4 transcribed literally (dict of pending counts, ascending scan, units of S_p)."""
    L = len(nbytes)
    m = [max(1, math.ceil(M / S_p)) for M in nbytes]
    last = [(M - (k - 1) * S_p) / S_p for M, k in zip(nbytes, m)]
    r = [sum(t_b[k:]) for k in range(L)]
    pending = {L - 1: m[L - 1]}
    tau = r[L - 1]
    window = [0] * (2 * L - 1)
    for l in range(L - 2, -1, -1):
        dt = r[l] - tau - a
        W, units = 0, 0.0
        for lp in sorted(pending):
            if pending[lp] == 0:
                continue
            if dt <= -a:
                break
            if dt <= 0:
                units += last[lp] if pending[lp] == 1 else 1
                pending[lp] -= 1
                W += 1
                break
            if (pending[lp] - 1) * b * S_p >= dt:
                k = math.ceil(dt / (b * S_p))
                pending[lp] -= k
                W += k
                units += k
                break
            k = pending[lp]
            pending[lp] = 0
            W += k
            units += k - 1 + last[lp]
            dt -= (k - 1 + last[lp]) * b * S_p
        window[L - 2 - l] = W
        tau = max(tau + (W > 0) * (a + b * S_p * units), r[l])
        pending[l] = pending.get(l, 0) + m[l]
    for l in range(L):
        window[L - 1 + l] = pending.get(l, 0)
    return window, tau


@st.composite
def dyadic_cases(draw: st.DrawFn) -> tuple[list[int], list[float], float, float, int, int]:
    """Profiles whose arithmetic is exact: power-of-two S_p and b, times in 1/8 s."""
    esize = draw(st.sampled_from([1, 2, 4]))
    S_p = draw(st.sampled_from([4, 8, 16, 64]))
    L = draw(st.integers(1, 14))
    nbytes = [esize * draw(st.integers(0, 20)) for _ in range(L)]
    t_b = [draw(st.integers(0, 24)) / 8 for _ in range(L)]
    a = draw(st.integers(0, 8)) / 8
    b = 2.0 ** -draw(st.integers(0, 6))
    return nbytes, t_b, a, b, S_p, esize


@settings(max_examples=400, deadline=None)
@given(dyadic_cases())
def test_planner_matches_a_literal_transcription_of_the_spec(case: tuple) -> None:
    nbytes, t_b, a, b, S_p, esize = case
    result = plan(profile(nbytes, t_b, element_size=esize), CostModel(a, b), S_p)
    windows, tau = reference_plan(nbytes, t_b, a, b, S_p)
    assert list(result.windows) == windows
    assert result.predicted_phase1_end == tau


@st.composite
def random_cases(draw: st.DrawFn) -> tuple[Profile, CostModel, int]:
    L = draw(st.integers(1, 40))
    esizes = [draw(st.sampled_from([1, 2, 4, 8])) for _ in range(L)]
    nbytes = [e * draw(st.integers(0, 600)) for e in esizes]
    times = st.floats(0, 0.05, allow_nan=False)
    prof = Profile.from_lists([f"p{i}" for i in range(L)], nbytes, esizes,
                              [draw(times) for _ in range(L)], [draw(times) for _ in range(L)])
    cost = CostModel(draw(st.floats(0, 0.01)), draw(st.floats(0, 1e-5)))
    return prof, cost, draw(st.integers(1, 3000) | st.sampled_from([8, 64, 1024]))


@settings(max_examples=300, deadline=None)
@given(random_cases())
def test_plan_invariants_hold_on_random_profiles(case: tuple[Profile, CostModel, int]) -> None:
    prof, cost, S_p = case
    result = plan(prof, cost, S_p)
    L = prof.num_tensors
    layouts = build_layout(prof.names, [n // e for n, e in zip(prof.nbytes, prof.element_size)],
                           prof.element_size, S_p)
    assert result.blocks_per_tensor == tuple(len(t.blocks) for t in layouts)
    assert len(result.windows) == 2 * L - 1
    assert min(result.windows) >= 0
    assert sum(result.windows) == sum(len(t.blocks) for t in layouts)
    # Tensor 0 is ready last: no phase-1 window follows it, so all its blocks are in phase 2.
    assert result.phase2_windows[0] == result.blocks_per_tensor[0]
    assert all(0 <= f <= 1 for f in result.last_fraction)
    slack = 1e-9  # the profile sums times in another order
    assert result.predicted_phase1_end >= prof.backward_time - slack
    assert result.predicted_iteration >= prof.backward_time + prof.forward_time - slack


@settings(max_examples=100, deadline=None)
@given(random_cases())
def test_plan_is_deterministic(case: tuple[Profile, CostModel, int]) -> None:
    # Every rank must compute the same plan (spec §4); at minimum one rank must agree with itself.
    prof, cost, S_p = case
    assert plan(prof, cost, S_p) == plan(prof, cost, S_p)


# --- choosing the partition --------------------------------------------------------------------

def test_choose_partition_keeps_the_fastest_candidate_and_tabulates_all() -> None:
    seconds = {1000: 3.0, 2000: 1.0, 4000: 2.0}
    best, table = choose_partition(profile([256], t_b=[1.0]), COST, [4000, 1000, 2000, 2000],
                                   lambda p, c, s: seconds[s])
    assert best == 2000
    assert table == ((1000, 3.0), (2000, 1.0), (4000, 2.0))


def test_choose_partition_breaks_ties_towards_fewer_blocks() -> None:
    best, _ = choose_partition(profile([256], t_b=[1.0]), COST, [1000, 4000], lambda p, c, s: 1.0)
    assert best == 4000


@pytest.mark.parametrize("candidates, value, message", [([], 1.0, "no candidate"), ([0], 1.0, "> 0"),
                                                        ([8], math.nan, "finite")])
def test_choose_partition_rejects_bad_candidates_or_predictions(candidates: list[int], value: float,
                                                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_partition(profile([256], t_b=[1.0]), COST, candidates, lambda p, c, s: value)


def test_model_predictor_prefers_blocks_that_fit_the_gaps() -> None:
    # Two 4 KiB tensors, 1 s of backward after the last one.  With b*4 KiB = 4 s and a = 0.5 s,
    # sending tensor 1 whole during backward overruns (4.5 s > 1 s) whereas small blocks fill the
    # gap and leave less for phase 2: the model must rank a small partition first.
    prof = profile([4096, 4096], t_b=[1.0, 1.0], t_f=[1.0, 1.0])
    cost = CostModel(a=0.5, b=1 / 1024)
    best, table = choose_partition(prof, cost, [256, 1024, 4096], model_iteration_time)
    assert dict(table)[best] == min(s for _, s in table)
    assert dict(table)[1024] < dict(table)[4096]


# --- options beyond the spec: short_gap, phase1="batched", cycle_s, overlap_forward ------------
#
# Hand case: one block per tensor (1 s each), a = 0.125 s.  Gradient 2 ready at 1, gradient 1 at
# 1.0625 (a gap shorter than a startup), gradient 0 at 3.

def merge_case() -> Profile:
    return profile([256, 256, 256], t_b=[1.9375, 0.0625, 1.0])


def test_spec_sends_one_block_for_a_whole_startup_when_the_gap_is_shorter_than_a() -> None:
    # Step l=1: dt = 1.0625 - 1 - 0.125 = -0.0625: one block of tensor 2, tau = 2.125.  Step l=0:
    # dt = 3 - 2.125 - 0.125 = 0.75: tensor 1 whole, tau = 3.25.  Two startups.
    result = plan(merge_case(), COST, S_P)
    assert result.windows == (1, 1, 1, 0, 0)
    assert result.predicted_phase1_end == 3.25
    assert result.rule == "greedy/one_block"


def test_short_gap_defer_merges_the_tiny_window_into_the_next_one() -> None:
    # Step l=1 takes nothing (tau = 1.0625); step l=0: dt = 3 - 1.0625 - 0.125 = 1.8125 takes
    # tensors 1 and 2 in one window: tau = 1.0625 + 0.125 + 2 = 3.1875, one startup saved.
    result = plan(merge_case(), COST, S_P, short_gap="defer")
    assert result.windows == (0, 2, 1, 0, 0)
    assert result.predicted_phase1_end == 3.1875
    assert result.rule == "greedy/defer"


def test_batched_phase_one_minimises_the_last_allreduce_end_without_overlap() -> None:
    # Candidates (end of the phase-2 all-reduce): release at 2 then 1 then 0: 4.375; merge 2+1
    # at gradient 1: 3.1875, then tensor 0: 4.3125; hold 2 and 1 to phase 2: 3 + 0.125 + 3 =
    # 6.125.  The optimum is the merge.
    result = plan(merge_case(), COST, S_P, phase1="batched", overlap_forward=False)
    assert result.windows == (0, 2, 1, 0, 0)
    assert result.predicted_phase1_end == 3.1875
    assert result.predicted_iteration == 4.3125
    assert result.rule == "batched"


def test_cycle_is_charged_once_per_window_released_on_an_idle_link() -> None:
    # Every release waits 0.25 s for Horovod's cycle: the batched optimum is the same merge, one
    # cycle later (gradient 1 at 1.0625 + 0.25, +2.125 = 3.4375; phase 2 at 3.4375 + 1.125).
    result = plan(merge_case(), COST, S_P, phase1="batched", overlap_forward=False, cycle_s=0.25)
    assert result.windows == (0, 2, 1, 0, 0)
    assert result.predicted_iteration == 4.5625
    # Spec greedy: the decisions do not depend on the cycle; the timeline does.  Phase 2 with
    # overlap: tensor 0's window starts at max(3.25, 3 + 0.25) = 3.25 and ends 4.375.
    assert plan(merge_case(), COST, S_P, cycle_s=0.25).windows == (1, 1, 1, 0, 0)
    assert plan(merge_case(), COST, S_P, cycle_s=0.25).predicted_iteration == 4.375
    assert plan(merge_case(), COST, S_P).predicted_iteration == 4.375


def test_drain_timeline_sends_everything_left_in_one_window_then_the_whole_forward() -> None:
    # Exact-divide case (link free at 3.125, tensors 0 and 1 left): one window of 512 B from
    # 3.125 to 5.25, then forward 1.5 s: 6.75 (the per-tensor chain gives 6.375 with overlap).
    prof = profile([256, 256, 512], t_b=[0.25, 1.625, 1.0], t_f=[0.5, 0.5, 0.5])
    assert plan(prof, COST, S_P, overlap_forward=False).predicted_iteration == 6.75
    assert plan(prof, COST, S_P).predicted_iteration == 6.375


@pytest.mark.parametrize("bad, message", [({"short_gap": "skip"}, "short_gap"),
                                          ({"phase1": "optimal"}, "phase1"),
                                          ({"cycle_s": -1.0}, "cycle_s"),
                                          ({"cycle_s": math.inf}, "cycle_s")])
def test_unknown_planner_options_are_rejected(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan(merge_case(), COST, S_P, **bad)


options = st.fixed_dictionaries({
    "phase1": st.sampled_from(["greedy", "batched"]),
    "short_gap": st.sampled_from(["one_block", "defer"]),
    "cycle_s": st.sampled_from([0.0, 1e-3, 0.02]),
    "overlap_forward": st.booleans(),
})


@settings(max_examples=300, deadline=None)
@given(random_cases(), options)
def test_plan_invariants_hold_under_every_planner_option(case: tuple[Profile, CostModel, int],
                                                         opts: dict) -> None:
    prof, cost, S_p = case
    result = plan(prof, cost, S_p, **opts)   # Plan.__post_init__ checks the invariants again
    assert sum(result.windows) == result.total_blocks
    assert min(result.windows) >= 0
    assert result.phase2_windows[0] == result.blocks_per_tensor[0]
    assert result == plan(prof, cost, S_p, **opts)
    slack = 1e-9
    assert result.predicted_iteration >= prof.backward_time + prof.forward_time - slack


@settings(max_examples=200, deadline=None)
@given(random_cases(), st.sampled_from([0.0, 1e-3]))
def test_greedy_windows_do_not_depend_on_the_cycle_or_the_mode(case: tuple[Profile, CostModel, int],
                                                                cycle: float) -> None:
    prof, cost, S_p = case
    spec = plan(prof, cost, S_p)
    for overlap in (False, True):
        assert plan(prof, cost, S_p, cycle_s=cycle, overlap_forward=overlap).windows == spec.windows


@settings(max_examples=200, deadline=None)
@given(random_cases(), st.sampled_from([0.0, 1e-3]))
def test_batched_plan_is_no_worse_in_its_model_than_sending_every_gradient_when_ready(
        case: tuple[Profile, CostModel, int], cycle: float) -> None:
    prof, cost, S_p = case
    r = prof.ready_times()
    L = prof.num_tensors
    end = -math.inf                      # horovod-like: one release per gradient
    for j in range(L - 1, -1, -1):
        end = max(end, r[j] + cycle) + cost.time(prof.nbytes[j])
    eager = max(end, r[0]) + prof.forward_time
    held = max(r[0] + cycle + cost.time(prof.total_bytes), r[0]) + prof.forward_time
    result = plan(prof, cost, S_p, phase1="batched", cycle_s=cycle, overlap_forward=False)
    assert result.predicted_iteration <= min(eager, held) * (1 + 1e-9) + 1e-12
    # Windows hold whole tensors: what is left for phase 2 is every block of a prefix 0..k-1.
    left = result.phase2_windows
    k = sum(1 for w in left if w)
    assert left == result.blocks_per_tensor[:k] + (0,) * (result.num_tensors - k)


# ---- phase-2 rules under overlap ---------------------------------------------------------------

def test_grouping_sends_small_tensors_with_their_neighbours_when_the_link_decides() -> None:
    # Nothing fits in phase 1 (gradients all ready at once); four tensors left for phase 2, the
    # first three tiny with forward times far shorter than a startup: one window per tensor
    # would spend three extra startups before the big one that gates the rest of the forward.
    p = profile([4, 4, 4, 2560], [0.0, 0.0, 0.0, 0.0], [0.001, 0.001, 0.001, 0.001])
    spec = plan(p, COST, S_P)
    grouped = plan(p, COST, S_P, phase2="grouped")
    assert grouped.windows == spec.windows                       # same blocks in phase 2
    assert len({grouped.phase2_window_of(l) for l in range(4)}) < 4
    assert grouped.predicted_iteration < spec.predicted_iteration
    assert (grouped.phase2, grouped.phase2_depth) == ("grouped", 1)


def test_pipelined_rules_allow_two_windows_in_flight_and_keep_the_windows() -> None:
    p = profile([512, 512, 512], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    spec = plan(p, COST, S_P)
    for rule in ("pipelined", "grouped_pipelined"):
        q = plan(p, COST, S_P, phase2=rule)
        assert q.windows == spec.windows and q.phase2_depth == 2 and q.phase2 == rule
    assert plan(p, COST, S_P, phase2="pipelined").phase2_group == ()


@pytest.mark.parametrize("group, depth", [((1, 1), 1), ((0, 2), 1), ((0, 1, 0), 1), ((0,), 1),
                                          ((0, 1), 0), ((0, 1), True)])
def test_plan_refuses_a_phase_two_layout_that_is_not_consecutive_windows(group, depth) -> None:
    with pytest.raises(ValueError):
        Plan(partition_bytes=4, windows=(0, 1, 1), blocks_per_tensor=(1, 1), phase2_group=group,
             phase2_depth=depth)


def test_unknown_phase_two_rule_is_rejected() -> None:
    with pytest.raises(ValueError, match="phase2"):
        plan(profile([4], [1.0]), COST, S_P, phase2="fifo")


@settings(max_examples=150, deadline=None)
@given(random_cases(), st.sampled_from(["greedy", "batched"]),
       st.sampled_from(["pipelined", "grouped", "grouped_pipelined"]), st.sampled_from([0.0, 1e-3]))
def test_phase_two_rules_keep_the_invariants_and_the_greedy_keeps_its_windows(
        case: tuple[Profile, CostModel, int], phase1: str, phase2: str, cycle: float) -> None:
    prof, cost, S_p = case
    q = plan(prof, cost, S_p, phase1=phase1, phase2=phase2, cycle_s=cycle)
    L = prof.num_tensors
    groups = [q.phase2_window_of(l) for l in range(L)]
    assert groups[0] == 0 and all(b - a in (0, 1) for a, b in zip(groups, groups[1:]))
    assert q.phase2_depth == (2 if phase2.endswith("pipelined") else 1)
    if phase1 == "greedy":
        assert q.windows == plan(prof, cost, S_p, cycle_s=cycle).windows
    # Grouping is the model optimum over cuts, so it never predicts worse than one per tensor.
    if phase2 == "grouped":
        base = plan(prof, cost, S_p, phase1=phase1, cycle_s=cycle)
        if phase1 == "greedy":
            assert q.predicted_iteration <= base.predicted_iteration * (1 + 1e-9) + 1e-12


def test_batched_overlap_search_on_a_grid_finds_the_exhaustive_plan_on_many_tensors(monkeypatch):
    import random

    import dcredit_hvd.planning.phase1 as planner_module
    from dcredit_hvd.planning.costmodel import CostModel
    from dcredit_hvd.planning.planner import plan as make_plan
    from dcredit_hvd.planning.profile import Profile

    for seed in (1, 2, 3):
        rng = random.Random(seed)
        n = 120
        profile = Profile.from_lists(
            [f"t{i}" for i in range(n)],
            [rng.choice([1024, 65536, 1 << 20, 3 << 20]) for _ in range(n)], [4] * n,
            [rng.uniform(1e-4, 2e-3) for _ in range(n)], [rng.uniform(2e-4, 4e-3) for _ in range(n)])
        cost = CostModel(a=5e-4, b=8e-9)
        grid = make_plan(profile, cost, 1 << 22, phase1="batched", phase2="grouped", cycle_s=1e-3)
        monkeypatch.setattr(planner_module, "BATCHED_GRID", 10**6)      # every k
        every = make_plan(profile, cost, 1 << 22, phase1="batched", phase2="grouped", cycle_s=1e-3)
        monkeypatch.undo()
        assert grid.windows == every.windows
        assert grid.predicted_iteration == every.predicted_iteration
