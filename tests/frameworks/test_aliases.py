"""The names 0.2.0 released (``dcredit_hvd.lightning``, ``dcredit_hvd.hf``) are the new modules
themselves, not copies: one class, one registration in Lightning's registry."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

ALIASES = {"dcredit_hvd.lightning": "dcredit_hvd.frameworks.pytorch_lightning",
           "dcredit_hvd.hf": "dcredit_hvd.frameworks.hf"}
_FRESH = """
import sys, importlib
old = importlib.import_module(sys.argv[1])
new = importlib.import_module(sys.argv[2])
assert old is new, (old, new)
assert sys.modules[sys.argv[1]] is new and new.__name__ == sys.argv[2], new.__name__
assert new.__spec__.name == sys.argv[2], new.__spec__
print("same")
"""


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_a_released_name_is_the_new_module_itself(old: str) -> None:
    pytest.importorskip("pytorch_lightning" if old.endswith("lightning") else "transformers")
    done = subprocess.run([sys.executable, "-c", _FRESH, old, ALIASES[old]],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]


def test_the_released_names_of_0_2_0_import_as_the_readme_says() -> None:
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("transformers")
    lightning = importlib.import_module("dcredit_hvd.lightning")
    from dcredit_hvd.frameworks.hf import DCreditTrainer as new
    from dcredit_hvd.hf import DCreditTrainer
    assert DCreditTrainer is new
    from pytorch_lightning.strategies import StrategyRegistry
    assert StrategyRegistry["dcredit"]["strategy"] is lightning.DCreditStrategy


def test_an_unknown_framework_name_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dcredit_hvd.keras")
