"""The runtime's cross-rank checks: this optimizer's state as ``agreement.py`` compares it.

Every rank must send the same blocks under the same names, or the collective library waits for
ever for names some rank never submits; these turn that hang into an error on every rank.
"""
from __future__ import annotations

from . import agreement
from .state import OptimizerState


def construction(state: OptimizerState) -> dict:
    """What must be equal on every rank at construction.  (Its collective's name is not under
    the prefix: the prefix is one of the things compared.)"""
    config = state.config
    return {
        "parameters": [state.describe(p) for p in state.order],
        "model": state.overlap,
        "policy": config.policy,
        "partition_bytes": config.partition_bytes,
        "group_bytes": config.group_bytes,
        "replan": config.replan,
        "backward_passes_per_step": state.passes,
        "op": str(state.op),
        "compression": getattr(state.compression, "__name__",
                               type(state.compression).__name__),
        # Last: it differs whenever the parameters do (its count is agreed: instances.py).
        "prefix": state.prefix,
    }


def check_construction(state: OptimizerState) -> None:
    agreement.check_construction(construction(state), state.transport.allgather_object,
                                 "dcredit.agreement")


def check_layouts(state: OptimizerState, when: str) -> None:
    """Before blocks of a new layout go out, every rank's layout must be rank 0's
    (``agreement.check_layouts``: unit names, members, shapes, dtypes, order, blocks)."""
    members = [[state.describe(p) for p in params] for params in state.members]
    agreement.check_layouts(agreement.describe_layouts(state.layouts, members),
                            state.transport.allgather_object, f"{state.prefix}.layout", when)
