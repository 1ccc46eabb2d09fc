"""Parity grids shared by tests/multirank and tests/torchrun (importable from both folders)."""
from __future__ import annotations

import itertools

import pytest


def alternating_model_grid(names: list[str], policies: list[str],
                           middle: tuple[list[str], ...] = ()) -> list:
    """Parameters ``(name, policy, *middle, with_model)`` for a parity grid: every cell, each
    with ``with_model`` alternating over (name, policy), so that make test proves each name and
    each policy with and without ``model=``; the other half is marked ``full`` (make test-full).
    """
    cells = []
    for (i, name), (j, policy) in itertools.product(enumerate(names), enumerate(policies)):
        for rest in itertools.product(*middle):
            for with_model in (True, False):
                marks = () if with_model == ((i + j) % 2 == 0) else (pytest.mark.full,)
                cells.append(pytest.param(
                    name, policy, *rest, with_model, marks=marks,
                    id="-".join([name, policy, *rest, "model" if with_model else "no-model"])))
    return cells
