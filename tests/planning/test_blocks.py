"""Blocks cover every element of every gradient exactly once, in priority order."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcredit_hvd.planning.blocks import build_layout, group_runs, partition


@given(numel=st.integers(0, 10_000), esize=st.sampled_from([1, 2, 4, 8]),
       part=st.one_of(st.none(), st.integers(1, 50_000)))
def test_partition_covers_every_element_exactly_once(numel, esize, part):
    ranges = partition(numel, esize, part)
    covered = [i for a, b in ranges for i in range(a, b)]
    assert covered == list(range(numel))
    if part is not None and numel:
        per_block = max(1, part // esize)
        assert all(b - a <= per_block for a, b in ranges)
        assert all(b - a == per_block for a, b in ranges[:-1])


def test_tensor_that_divides_exactly_has_a_full_last_block():
    (layout,) = build_layout(["w"], [1000], [4], 400)     # 100 elements per block
    assert len(layout.blocks) == 10
    assert layout.last_fraction == 1.0


def test_last_fraction_is_the_share_of_a_full_block():
    (layout,) = build_layout(["w"], [250], [4], 400)
    assert [b.numel for b in layout.blocks] == [100, 100, 50]
    assert layout.last_fraction == 0.5


def test_row_major_tensor_with_many_blocks_loses_no_rows():
    # The authors' row slicing dropped 79 rows of a [4096, 25088] tensor (spec defect 7).
    numel = 4096 * 25088
    ranges = partition(numel, 4, 4_000_000)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a2 == b1 for (_, b1), (a2, _) in zip(ranges, ranges[1:]))


def test_priority_keys_never_leak_into_the_next_tensor():
    # More than 1000 blocks in tensor 0 must still sort before tensor 1 (spec defect 8).
    layouts = build_layout(["a", "b"], [5000, 10], [4, 4], 4)
    keys = [b.key for t in layouts for b in t.blocks]
    assert keys == sorted(keys)
    assert max(b.key for b in layouts[0].blocks) < min(b.key for b in layouts[1].blocks)


def test_block_names_are_unique_and_deterministic():
    a = build_layout(["x", "y"], [300, 7], [4, 4], 400)
    b = build_layout(["x", "y"], [300, 7], [4, 4], 400)
    names = [blk.name for t in a for blk in t.blocks]
    assert names == [blk.name for t in b for blk in t.blocks]
    assert len(set(names)) == len(names)
    assert names[0] == "dcredit.x.0of3"


# ---- units: runs of small tensors sharing one flat buffer ------------------------------------

def test_group_runs_joins_consecutive_small_tensors_up_to_the_limit_and_keeps_large_ones_alone():
    sizes = [100, 200, 5000, 300, 400, 500, 50]
    kinds = ["f32"] * len(sizes)
    # 100+200 <= 1000; 5000 alone; 300+400 = 700, + 500 would pass 1000: a new run, + 50.
    assert group_runs(sizes, kinds, 1000) == (2, 1, 2, 2)
    assert group_runs(sizes, kinds, 0) == (1,) * len(sizes)
    assert group_runs(sizes, kinds, None) == (1,) * len(sizes)


def test_group_runs_never_mixes_kinds_and_never_groups_a_kind_of_none():
    sizes = [10, 10, 10, 10, 10]
    assert group_runs(sizes, ["f32", "f32", "f16", "f16", "f32"], 1000) == (2, 2, 1)
    assert group_runs(sizes, ["f32", None, None, "f32", "f32"], 1000) == (1, 1, 1, 2)


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40), st.integers(0, 8000))
def test_group_runs_covers_every_tensor_once_in_order(sizes, limit):
    counts = group_runs(sizes, ["f32"] * len(sizes), limit)
    assert sum(counts) == len(sizes) and all(c >= 1 for c in counts)
    first = 0
    for c in counts:
        run = sizes[first:first + c]
        if c > 1:
            assert sum(run) <= limit and all(s < limit for s in run)
        first += c


def test_grouped_layout_lays_members_end_to_end_and_cuts_the_unit_like_one_tensor():
    layouts = build_layout(["a", "b", "c", "d"], [3, 5, 100, 2], [4, 4, 4, 4], 16,
                           groups=(2, 1, 1))
    unit = layouts[0]
    assert unit.grouped and unit.members == (0, 1) and unit.member_numels == (3, 5)
    assert unit.numel == 8 and [(b.start, b.stop) for b in unit.blocks] == [(0, 4), (4, 8)]
    assert unit.name == "a+1" and all(b.tensor == 0 for b in unit.blocks)
    assert [layout.index for layout in layouts] == [0, 1, 2]
    assert not layouts[1].grouped and layouts[1].members == (2,)
    assert len({b.name for layout in layouts for b in layout.blocks}) == sum(
        len(layout.blocks) for layout in layouts)


def test_grouped_layout_refuses_mixed_element_sizes_and_groups_that_do_not_cover():
    with pytest.raises(ValueError, match="one dtype"):
        build_layout(["a", "b"], [3, 5], [4, 2], None, groups=(2,))
    with pytest.raises(ValueError, match="sum to the 2 tensors"):
        build_layout(["a", "b"], [3, 5], [4, 4], None, groups=(1,))
