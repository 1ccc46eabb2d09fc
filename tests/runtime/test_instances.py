"""Prefixes and parameter ownership of live optimizers (``dcredit_hvd.runtime.instances``)."""
from __future__ import annotations

import gc

import torch

from dcredit_hvd.runtime import instances


class _Opt:
    """Stands for an optimizer: anything weakly referenceable."""


def _described(*names):
    return [(n, (4,)) for n in names]


def test_the_prefix_is_a_function_of_the_process_set_and_the_parameters():
    def name(*args):
        return instances.prefix_for(*args).name

    a = name(0, _described("w", "b"))
    assert a == name(0, _described("w", "b"))
    assert a != name(1, _described("w", "b"))
    assert a != name(0, _described("w", "c"))
    assert a != name(0, [("w", (5,)), ("b", (4,))])
    assert a.startswith("dcredit.") and len(a.split(".")) == 2


def test_each_built_optimizer_with_the_same_parameters_gets_the_next_suffix():
    described = _described("unique.suffix.test")
    first = instances.prefix_for(0, described)
    opt1 = _Opt()
    instances.register(opt1, first, [])
    second = instances.prefix_for(0, described)
    assert second.name == f"{first.name}.1"
    instances.register(_Opt(), second, [])
    assert instances.prefix_for(0, described).name == f"{first.name}.2"
    # Closing (or collecting) an optimizer does not free its suffix: the count is of creations,
    # which ranks agree on, not of survivors, which depend on each rank's collector.
    instances.unregister(opt1)
    assert instances.prefix_for(0, described).name == f"{first.name}.2"


def test_a_construction_that_never_registered_does_not_count():
    described = _described("never.registered")
    assert instances.prefix_for(0, described) == instances.prefix_for(0, described)


def test_holders_are_the_live_optimizers_that_hook_any_of_the_parameters():
    p, q, r = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    old, other = _Opt(), _Opt()
    instances.register(old, instances.Prefix("dcredit.old", 0), [p, q])
    instances.register(other, instances.Prefix("dcredit.other", 0), [r])
    assert instances.holders([q]) == [old]
    assert instances.holders([r, p]) == [old, other]
    instances.unregister(old)
    assert instances.holders([p, q]) == []
    del other
    gc.collect()
    assert instances.holders([r]) == []


def test_the_count_is_the_largest_over_the_ranks_and_later_creations_count_from_it():
    """A rank whose process is younger (Fabric's script launcher starts a fresh rank-1 process
    for each ``launch()``) has built fewer optimizers: the agreed count is the ranks' largest,
    so both name their collectives alike, and this process counts on from there."""
    described = _described("agreed.count")
    base = instances.prefix_for(0, described)
    seen = []
    agreed = instances.prefix_for(0, described, agree=lambda k: seen.append(k) or [k, 3])
    assert seen == [0] and agreed.name == f"{base.name}.3"
    instances.register(_Opt(), agreed, [])
    assert instances.prefix_for(0, described).name == f"{base.name}.4"
    assert instances.prefix_for(0, described, agree=lambda k: [k, 1]).name == f"{base.name}.4"
