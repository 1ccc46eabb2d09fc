"""``shards``: which slice of a flat vector each rank owns (pure: no torch, no wire)."""
from __future__ import annotations

import pytest

from dcredit_hvd.transports.shards import chunk, padded, shard_bounds


def slices(numel: int, size: int) -> list[tuple[int, int]]:
    return [shard_bounds(numel, size, rank) for rank in range(size)]


def check_partition(numel: int, size: int) -> None:
    """Every element in exactly one slice, in rank order; every slice inside one chunk."""
    bounds = slices(numel, size)
    owners = [0] * numel
    for start, stop in bounds:
        assert 0 <= start <= stop <= numel
        for i in range(start, stop):
            owners[i] += 1
    assert owners == [1] * numel
    assert [start for start, _ in bounds] == sorted(start for start, _ in bounds)
    width = chunk(numel, size)
    for rank, (start, stop) in enumerate(bounds):
        assert stop - start <= width
        if stop > start:
            assert start == rank * width
    assert padded(numel, size) % size == 0 and 0 <= padded(numel, size) - numel < size


def test_an_even_vector_is_cut_into_equal_slices() -> None:
    assert slices(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert chunk(8, 4) == 2 and padded(8, 4) == 8


def test_an_uneven_vector_leaves_the_padding_on_the_last_rank() -> None:
    # 10 over 4: chunks of 3, the padded vector has 12, the last rank owns 1 element
    assert slices(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunk(10, 4) == 3 and padded(10, 4) == 12


def test_not_horovods_split_which_gives_the_first_ranks_an_extra_element() -> None:
    # 5 over 4: Horovod's unpadded reducescatter gives 2, 1, 1, 1; equal chunks of the padded
    # vector give 2, 2, 1, 0 (the transports pad, so both libraries cut like this)
    assert [stop - start for start, stop in slices(5, 4)] == [2, 2, 1, 0]


def test_fewer_elements_than_ranks_leaves_the_high_ranks_empty() -> None:
    assert slices(3, 5) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    assert slices(1, 2) == [(0, 1), (1, 1)]


def test_an_empty_vector_gives_every_rank_an_empty_slice() -> None:
    assert slices(0, 3) == [(0, 0)] * 3
    assert chunk(0, 3) == 0 and padded(0, 3) == 0


def test_one_rank_owns_everything() -> None:
    assert slices(7, 1) == [(0, 7)] and slices(0, 1) == [(0, 0)]


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 5, 999, 1000, 1001])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 8])
def test_every_element_is_owned_exactly_once(numel: int, size: int) -> None:
    check_partition(numel, size)


def test_the_slices_concatenate_to_the_vector() -> None:
    vector = list(range(1001))
    for size in (2, 3, 8):
        assert sum((vector[a:b] for a, b in slices(1001, size)), []) == vector


@pytest.mark.parametrize("args", [(5, 0, 0), (5, 2, 2), (5, 2, -1), (-1, 2, 0)])
def test_impossible_arguments_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        shard_bounds(*args)


try:
    from hypothesis import given
    from hypothesis import strategies as st
except ImportError:          # hypothesis is a test extra; the cases above cover the rule
    given = None

if given is not None:
    @given(st.integers(0, 5000), st.integers(1, 64))
    def test_property_every_element_owned_once_in_rank_order(numel: int, size: int) -> None:
        check_partition(numel, size)

    @given(st.integers(0, 5000), st.integers(1, 64), st.data())
    def test_property_a_slice_is_the_ranks_chunk_without_the_padding(
            numel: int, size: int, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, size - 1))
        width = -(-numel // size)
        start, stop = shard_bounds(numel, size, rank)
        assert stop == min((rank + 1) * width, numel)
        assert stop - start == max(0, min(width, numel - rank * width))
