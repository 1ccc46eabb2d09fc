"""The transports: one module per collective library, each implementing ``base.Transport``,
and what they share: the issue order that torch.distributed needs (``ordering``) and rank 0's
authenticated lines to the other ranks that carry it (``sidechannel``).

A module here provides ``accepts(group) -> bool`` (whether ``group``, the factory's
``process_set`` / ``process_group`` argument, is one of its groups), ``transport(group)``,
``is_initialized()`` and ``default_group()``, and the defaults of the factory's signature
(``AVERAGE``, ``COMPRESSION_NONE``).  ``select`` finds the module, so a new library is a new
module here and its line in ``NAMES`` and ``LIBRARIES``.  A module whose library is not
installed is skipped (Horovod is optional: ``torchrun`` users need only torch).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Optional

from .base import Transport

#: The names users pass as ``transport=`` / ``DCREDIT_TRANSPORT``, and their modules.
NAMES = {"horovod": "horovod", "torch.distributed": "torch_distributed"}
#: What each library's module needs installed (a missing one makes its module unavailable).
LIBRARIES = {"horovod": "horovod.torch", "torch_distributed": "torch.distributed"}

NOTHING_INITIALIZED = (
    "dcredit_hvd: no collective library is initialised. With Horovod: call hvd.init() first and "
    "launch with horovodrun or mpirun. With torch.distributed: call "
    "torch.distributed.init_process_group('gloo') (or 'nccl' for CUDA) first and launch with "
    "torchrun. Or name one: transport='horovod' / 'torch.distributed' (DCREDIT_TRANSPORT)")


def names() -> list[str]:
    """The transport modules, Horovod's first (the default when it is initialised).  The folder
    also holds what the transports share (``base``, ``ordering``, ``sidechannel``): only the
    modules ``LIBRARIES`` names are transports."""
    return sorted(LIBRARIES, key=lambda name: (name != "horovod", name))


def module(name: str) -> Optional[ModuleType]:
    """The transport module ``name``, or None when its library is not installed."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name and LIBRARIES.get(name, "").startswith(exc.name):
            return None
        raise


def for_group(group: Any) -> Transport:
    """The transport of the module that accepts ``group`` (``select`` by the group alone)."""
    return select(None, group).transport(group)


def select(name: Optional[str], group: Any = None) -> ModuleType:
    """The module the factory uses: ``name`` (``transport=``/``DCREDIT_TRANSPORT``) if given,
    else the one that accepts ``group`` if given, else Horovod when it is initialised, else
    ``torch.distributed`` when it is."""
    if name:
        if name not in NAMES:
            raise ValueError(f"dcredit_hvd: transport={name!r} is not one of "
                             f"{', '.join(map(repr, NAMES))} (DCREDIT_TRANSPORT)")
        found = module(NAMES[name])
        if found is None:
            raise ValueError(f"dcredit_hvd: transport={name!r}, but {LIBRARIES[NAMES[name]]} is "
                             "not installed: install it, or pick the other transport")
        if group is not None and not found.accepts(group):
            raise TypeError(f"dcredit_hvd: transport={name!r} cannot use a "
                            f"{type(group).__name__} as its group")
        return found
    for candidate in names():
        found = module(candidate)
        if found is None:
            continue
        if group is not None:
            if found.accepts(group):
                return found
        elif found.is_initialized():
            return found
    if group is not None:
        raise TypeError(f"process_set must be a group of one of the transports "
                        f"({', '.join(NAMES)}), got {type(group).__name__}: a Horovod process set "
                        "as process_set, or a torch.distributed group as process_group")
    raise RuntimeError(NOTHING_INITIALIZED)


def for_optimizer(name: str, process_set: Any, process_group: Any) -> tuple[Any, Any]:
    """The transport module (``select``) for an optimizer given ``process_set`` (Horovod) or
    ``process_group`` (torch.distributed), and the group it reduces over."""
    if process_set is not None and process_group is not None:
        raise ValueError("dcredit_hvd: pass process_set (Horovod) or process_group "
                         "(torch.distributed), not both")
    group = process_set if process_set is not None else process_group
    library = select(name, group)
    return library, library.default_group() if group is None else group
