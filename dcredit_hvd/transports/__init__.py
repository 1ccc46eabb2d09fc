"""One module per collective library, each implementing ``transport.Transport``.

A module here provides ``accepts(group) -> bool`` (whether ``group``, the factory's
``process_set`` argument, is one of its groups) and ``transport(group)``; ``for_group`` asks
each module in turn, so a new library is a new module here and nothing else.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ..transport import Transport


def names() -> list[str]:
    """The transport modules present, Horovod's first (it is the factory's default)."""
    found = sorted(info.name for info in pkgutil.iter_modules(__path__))
    return sorted(found, key=lambda name: name != "horovod")


def for_group(group: Any) -> Transport:
    """The transport of the first module that accepts ``group``."""
    for name in names():
        module = importlib.import_module(f"{__name__}.{name}")
        if module.accepts(group):
            return module.transport(group)
    raise TypeError(f"process_set must be a group of one of the transports ({', '.join(names())}), "
                    f"got {type(group).__name__}")
