"""Blocks cover every element of every gradient exactly once, in priority order."""
from hypothesis import given
from hypothesis import strategies as st

from dcredit_hvd.blocks import build_layout, partition


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
