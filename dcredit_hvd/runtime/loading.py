"""``optimizer.load_state_dict`` of the wrapper: what is in flight is settled first, the
scheduler's step state is reset, and the user's param-group dicts survive the load.

torch's ``Optimizer.load_state_dict`` builds new param-group dicts.  The wrapper keeps its old
ones instead, filled with the loaded values, because the user's optimizer and any LR scheduler
built on it hold those very dicts: a scheduler built before the wrap (Lightning, the HF
Trainer, Accelerate) keeps setting the learning rate the wrapper uses, after a resume too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from .assembly import Parts
    from .state import OptimizerState


def load_state_dict(opt: torch.optim.Optimizer, base: type, state: OptimizerState,
                    parts: Optional[Parts], args: tuple, kwargs: dict) -> Any:
    """Restore ``opt``'s state (``base``: the user's optimizer class)."""
    if parts is not None:
        parts.overlap.settle_for_load()
        parts.lifecycle.discard_in_flight()
    state.synchronized = False
    state.should_synchronize = True
    if state.sharded is not None:
        args = (state.sharded.load_state_dict(args[0]), *args[1:])
    groups = list(opt.param_groups)
    result = base.load_state_dict(opt, *args, **kwargs)
    for index, (old, new) in enumerate(zip(groups, opt.param_groups)):
        if old is not new:
            old.clear()
            old.update(new)
            opt.param_groups[index] = old
    return result
