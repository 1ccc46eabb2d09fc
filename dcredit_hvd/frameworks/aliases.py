"""Names released before the frameworks moved into ``dcredit_hvd.frameworks``.

dcredit_hvd 0.2.0 released ``import dcredit_hvd.lightning`` and
``from dcredit_hvd.hf import DCreditTrainer`` (its README tells users so).  They keep working as
aliases: a finder on ``sys.meta_path`` answers for those two names only, and its loader hands
back the new module object itself, so an alias and the new path are one module (one copy of its
classes, one registration in Lightning's registry), never two.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Optional

#: Released name -> the module it now is.
ALIASES = {
    "dcredit_hvd.lightning": "dcredit_hvd.frameworks.pytorch_lightning",
    "dcredit_hvd.hf": "dcredit_hvd.frameworks.hf",
}


class AliasLoader(importlib.abc.Loader):
    """Loads a released name as the module it now is (imported on first use)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the target ran when it was imported); the import machinery set the
        alias's spec on the module, so its own is put back (``__name__`` stays the new path)."""
        module.__spec__ = self.spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Answers for the names in ``ALIASES``; every other import goes past it."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in ALIASES:
            return None
        return importlib.machinery.ModuleSpec(fullname, AliasLoader(ALIASES[fullname]))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(AliasFinder())
