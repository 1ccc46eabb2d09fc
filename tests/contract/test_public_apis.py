"""The framework integrations use torch's and the frameworks' public APIs only: no private
attribute (``._name``, or ``getattr``/``setattr``/``hasattr`` with ``"_name"``) of an object
they do not own is read, set or overridden.  A name the module itself defines (a method, or an
attribute it assigns on ``self``) is its own; dunders are Python's."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

FRAMEWORKS = Path(__file__).resolve().parents[2] / "dcredit_hvd" / "frameworks"
#: Private Trainer methods still overridden, with the reason; the issue note names them.
KNOWN: dict[str, set[str]] = {
    "hf.py": {"_wrap_model", "_get_grad_norm"},   # dcredit_overlap=True only (checked there)
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.AST) -> set[str]:
    """Methods and classes the module defines, and attributes it assigns on ``self``/``cls``
    or sets on an object with ``setattr(obj, CONSTANT, ...)`` of its own constants."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
    return own


def _overrides(tree: ast.AST) -> set[str]:
    """Private methods defined in a class that subclasses something (an override, unless the
    name is the module's own: ``_dcredit_*``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.bases:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and _private(item.name) \
                        and not item.name.startswith("_dcredit"):
                    found.add(item.name)
    return found


def foreign_private(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    own = _own_names(tree) - _overrides(tree)
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            used.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            used.add(node.args[1].value)
    return {name for name in used if name not in own} | (_overrides(tree) & used)


@pytest.mark.parametrize("path", sorted(FRAMEWORKS.glob("*.py")), ids=lambda p: p.name)
def test_an_integration_module_touches_no_private_attribute_it_does_not_own(path: Path) -> None:
    assert foreign_private(path) <= KNOWN.get(path.name, set())


def test_the_check_finds_a_private_attribute_of_a_foreign_object(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("def f(opt, trainer):\n    opt._opt_called = True\n"
                      "    return getattr(trainer, '_scheduler', None)\n"
                      "class T(Base):\n    def _wrap_model(self, m):\n"
                      "        return super()._wrap_model(m)\n")
    assert foreign_private(module) == {"_opt_called", "_scheduler", "_wrap_model"}
