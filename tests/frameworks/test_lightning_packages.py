"""``strategy="dcredit"`` with either Lightning package installed alone, and with both: each
entry point registers its own class in its own package's registry and imports nothing of the
other package (the other is made unimportable in a fresh interpreter, as if not installed)."""
from __future__ import annotations

import subprocess
import sys

import pytest

_ALONE = """
import sys
sys.modules[sys.argv[2]] = None          # the other package: not installed
for name in [m for m in sys.modules if m.startswith(sys.argv[2] + ".")]:
    del sys.modules[name]
import importlib
entry = importlib.import_module(sys.argv[1])
package = importlib.import_module(sys.argv[3])
registered = package.StrategyRegistry["dcredit"]["strategy"]
assert registered is entry.DCreditStrategy, registered
assert not [m for m in sys.modules if m.split(".")[0] == sys.argv[2] and sys.modules[m]]
print("alone")
"""
_BOTH = """
import dcredit_hvd.frameworks.lightning as unified, dcredit_hvd.frameworks.pytorch_lightning as pl
import lightning.pytorch.strategies as a, pytorch_lightning.strategies as b
assert a.StrategyRegistry["dcredit"]["strategy"] is unified.DCreditStrategy
assert b.StrategyRegistry["dcredit"]["strategy"] is pl.DCreditStrategy
assert unified.DCreditStrategy is not pl.DCreditStrategy
assert issubclass(unified.DCreditStrategy, a.DDPStrategy)
assert not issubclass(unified.DCreditStrategy, b.DDPStrategy)
assert issubclass(pl.DCreditStrategy, b.DDPStrategy)
assert not issubclass(pl.DCreditStrategy, a.DDPStrategy)
print("both")
"""
CASES = {
    "lightning": ("dcredit_hvd.frameworks.lightning", "pytorch_lightning",
                  "lightning.pytorch.strategies"),
    "pytorch_lightning": ("dcredit_hvd.frameworks.pytorch_lightning", "lightning",
                          "pytorch_lightning.strategies"),
}


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("package", sorted(CASES))
def test_the_strategy_registers_with_one_lightning_package_installed_alone(package: str) -> None:
    pytest.importorskip(package)
    done = _python(_ALONE, *CASES[package])
    assert done.returncode == 0 and done.stdout.strip() == "alone", done.stderr[-3000:]


def test_with_both_packages_each_registry_holds_its_own_strategy_class() -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("pytorch_lightning")
    done = _python(_BOTH)
    assert done.returncode == 0 and done.stdout.strip() == "both", done.stderr[-3000:]
