"""The units in force: the state's priority order cut into units and blocks.

``build_layouts`` fills the state's per-parameter maps (unit, offset in the unit's buffer)
that the gradient path reads at every hook; the plan's life cycle calls it whenever the order
or the plan changes, between iterations.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..planning.blocks import TensorLayout, build_layout
from .state import OptimizerState


def element_size(state: OptimizerState, p: torch.Tensor) -> int:
    """Bytes per element as sent, after compression (fp16 compression halves float32)."""
    sample, _ = state.compression.compress(torch.zeros(1, dtype=p.dtype, device=p.device))
    return sample.element_size()


def kind(p: torch.Tensor) -> str:
    """``Profile.kinds``: tensors of one dtype on the CPU may share a flat buffer; CUDA
    gradients are never grouped (their staging path, ``device.py``, is per tensor)."""
    return "" if p.device.type != "cpu" else f"{p.dtype}"


def build_layouts(state: OptimizerState, partition_bytes: Optional[int],
                  groups: tuple[int, ...] = ()) -> list[TensorLayout]:
    """The units of ``state.order`` (``groups``: runs sharing a flat buffer, from the plan);
    records, per parameter, its unit and its offset in the unit's buffer, and forgets the
    buffers of the previous units."""
    order = state.order
    layouts = build_layout([state.names[p] for p in order], [p.numel() for p in order],
                           [element_size(state, p) for p in order],
                           partition_bytes, prefix=state.prefix, groups=groups)
    state.index, state.offset, state.members = {}, {}, []
    for layout in layouts:
        params = [order[i] for i in layout.members]
        offset = 0
        for p, numel in zip(params, layout.member_numels):
            state.index[p], state.offset[p] = layout.index, offset
            offset += numel
        state.members.append(params)
    state.buffers, state.slots, state.arrived = {}, {}, {}
    return layouts
