"""Cross-rank agreement logic (``dcredit_hvd.runtime.agreement``), with the collectives played by lists:
``allgather`` returns every simulated rank's object, ``broadcast`` rank 0's."""
from __future__ import annotations

import pytest

from dcredit_hvd.planning.blocks import build_layout
from dcredit_hvd.runtime import agreement


def _layout(names, numels, partition=64, prefix="dcredit.x", groups=()):
    layouts = build_layout(names, numels, [4] * len(names), partition, prefix=prefix,
                           groups=groups)
    members = [[(names[i], (numels[i],), "torch.float32") for i in layout.members]
               for layout in layouts]
    return agreement.describe_layouts(layouts, members)


def _ranks(*descriptions):
    """An allgather over simulated ranks whose objects for each name are given in order."""
    calls = []

    def allgather(obj, name):
        calls.append(name)
        if name.endswith(".digest"):
            return [agreement.digest(d) for d in descriptions]
        return list(descriptions)
    return allgather, calls


def test_identical_layouts_pass_with_one_digest_gather():
    same = _layout(["a", "b"], [10, 40])
    allgather, calls = _ranks(same, same)
    agreement.check_layouts(same, allgather, "p.layout", "at construction")
    assert calls == ["p.layout.digest"]


def test_a_different_order_names_the_first_differing_unit_and_both_ranks():
    rank0 = _layout(["a", "b", "c"], [10, 40, 8])
    rank1 = _layout(["a", "c", "b"], [10, 8, 40])
    allgather, calls = _ranks(rank0, rank1)
    with pytest.raises(agreement.LayoutMismatchError) as info:
        agreement.check_layouts(rank1, allgather, "p.layout", "after the forward order was agreed")
    message = str(info.value)
    assert "unit #1 is 'b'" in message and "on rank 0 but 'c'" in message and "on rank 1" in message
    assert "after the forward order was agreed" in message
    assert calls == ["p.layout.digest", "p.layout.units"]


def test_a_different_grouping_is_a_difference():
    rank0 = _layout(["a", "b", "c"], [4, 4, 4], groups=(2, 1))
    rank1 = _layout(["a", "b", "c"], [4, 4, 4], groups=(1, 2))
    allgather, _ = _ranks(rank0, rank1)
    with pytest.raises(agreement.LayoutMismatchError, match=r"unit #0 is 'a\+1'"):
        agreement.check_layouts(rank0, allgather, "p.layout", "when the plan was installed")


def test_a_different_partition_or_prefix_is_a_difference():
    base = _layout(["a"], [100], partition=64)
    for other in (_layout(["a"], [100], partition=128), _layout(["a"], [100], prefix="dcredit.y")):
        allgather, _ = _ranks(base, other)
        with pytest.raises(agreement.LayoutMismatchError, match="unit #0"):
            agreement.check_layouts(base, allgather, "p.layout", "now")


def test_a_rank_with_fewer_units_is_named():
    allgather, _ = _ranks(_layout(["a", "b"], [4, 4]), _layout(["a"], [4]))
    with pytest.raises(agreement.LayoutMismatchError, match="rank 0 has 2 units but rank 1 has 1"):
        agreement.check_layouts([], allgather, "p.layout", "now")


def test_every_rank_adopts_rank_0s_order_and_appends_the_unread():
    def broadcast_from(root_value):
        return lambda obj, name: root_value
    # rank 1 read other tensors first; rank 0's first reads win, the rest follow in order
    assert agreement.agree_order([3, 1], 5, False, broadcast_from([2, 0]), "o") == [2, 0, 1, 3, 4]
    assert agreement.agree_order([2, 0], 5, True, lambda obj, name: obj, "o") == [2, 0, 1, 3, 4]


def test_an_order_that_is_not_a_set_of_positions_is_refused():
    with pytest.raises(ValueError, match="not a set of positions"):
        agreement.agree_order([], 3, False, lambda obj, name: [0, 0], "o")
    with pytest.raises(ValueError, match="not a set of positions"):
        agreement.agree_order([], 3, False, lambda obj, name: [3], "o")


def test_construction_check_names_the_first_differing_field():
    rank0 = {"parameters": [("w", (4,), "f32")], "policy": "dcredit", "prefix": "a"}
    rank1 = {"parameters": [("w", (4,), "f32")], "policy": "wfbp", "prefix": "b"}
    with pytest.raises(ValueError, match="policy is 'dcredit' on rank 0 but 'wfbp' on rank 1"):
        agreement.check_construction(rank0, lambda obj, name: [rank0, rank1], "c")
    agreement.check_construction(rank0, lambda obj, name: [rank0, rank0], "c")
