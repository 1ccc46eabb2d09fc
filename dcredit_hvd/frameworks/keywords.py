"""The ``dcredit=`` / ``dcredit_policy=`` keywords of the HF Trainer and of Accelerate, checked
at construction: both reduce over Accelerate's torch.distributed group and set the same three
``DistributedOptimizer`` arguments themselves."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Optional

import dcredit_hvd
from dcredit_hvd.config import SchedulerConfig

#: ``DistributedOptimizer`` keywords the integration sets (the model, the accumulation).
OWN = ("named_parameters", "model", "backward_passes_per_step")
#: The ones a ``dcredit=`` mapping may set.
KEYWORDS = tuple(name for name in inspect.signature(dcredit_hvd.DistributedOptimizer).parameters
                 if name not in OWN and name != "optimizer")


def dcredit_keywords(dcredit: Optional[Mapping[str, Any] | SchedulerConfig],
                     policy: Optional[str], *, who: str, set_by: str,
                     transport_refusal: str) -> dict[str, Any]:
    """``DistributedOptimizer`` keywords from ``dcredit=`` and ``dcredit_policy=``; the
    transport is torch.distributed.  ``who`` starts each message, ``set_by`` says who sets
    ``OWN``, ``transport_refusal`` is the error for another transport."""
    if dcredit is None:
        settings: dict[str, Any] = {}
    elif isinstance(dcredit, SchedulerConfig):
        settings = {name: getattr(dcredit, name) for name in KEYWORDS if hasattr(dcredit, name)}
    elif isinstance(dcredit, Mapping):
        settings = dict(dcredit)
    else:
        raise TypeError(f"{who}: dcredit= takes a mapping of DistributedOptimizer keywords or "
                        f"a SchedulerConfig, got {type(dcredit).__name__}")
    own = sorted(set(settings) & set(OWN))
    if own:
        raise ValueError(f"{who}: dcredit= cannot set {', '.join(own)}: {set_by}")
    unknown = sorted(set(settings) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"{who}: unknown dcredit= keyword(s) {', '.join(unknown)}; "
                        f"known: {', '.join(KEYWORDS)}")
    if policy is not None:
        settings["policy"] = policy
    settings.setdefault("transport", "torch.distributed")
    if settings["transport"] not in (None, "torch.distributed"):
        raise ValueError(transport_refusal)
    return settings
