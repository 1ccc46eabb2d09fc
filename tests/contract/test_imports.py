"""One idea per module, one concern per folder, and no import circles: every module of the
package imports alone; the graph of imports among them (lazy and type-only imports included) has
no cycle; the library never imports the bench; only a transport module imports its library;
``import dcredit_hvd`` stays cheap; the old module paths name the new ones."""
import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "dcredit_hvd"
#: The one transport module of each library; the tools beside the runtime that drive each
#: library themselves (benchmarks of plain Horovod and DDP); and the frameworks' entry points,
#: which start the launcher's library as the framework's own strategies do.
LIBRARY_USERS = {
    "horovod": {"dcredit_hvd.transports.horovod", "dcredit_hvd.bench.sidebyside",
                "dcredit_hvd.bench.emulate", "dcredit_hvd.frameworks.horovod_env"},
    "torch.distributed": {"dcredit_hvd.transports.torch_distributed",
                          "dcredit_hvd.bench.sidebyside", "dcredit_hvd.frameworks.lightning_steps",
                          "dcredit_hvd.frameworks.hf", "dcredit_hvd.frameworks.hf_setup",
                          "dcredit_hvd.frameworks.accelerate",
                          "dcredit_hvd.frameworks.accelerate_setup",
                          "dcredit_hvd.frameworks.accelerate_unowned",
                          "dcredit_hvd.frameworks.fabric", "dcredit_hvd.frameworks.fabric_launch",
                          "dcredit_hvd.frameworks.rank0"},
}
#: The folders of the library proper, which must never import the measuring tools (bench/).
LIBRARY_FOLDERS = ("runtime", "planning", "policies", "liveness", "transports")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Package modules ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            # A package imports its own submodules (re-exports): not a circle through it.
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_package_modules():
    edges = graph()
    assert edges["dcredit_hvd.config"] >= {"dcredit_hvd.liveness.heartbeat", "dcredit_hvd.policies"}
    assert _cycle(edges) == []


def _library_users(library: str) -> set[str]:
    users = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n == library or n.startswith(library + ".") for n in names):
                users.add(name)
    return users


@pytest.mark.parametrize("library", sorted(LIBRARY_USERS))
def test_only_a_transport_module_imports_its_library(library):
    users = _library_users(library)
    assert users <= LIBRARY_USERS[library], sorted(users - LIBRARY_USERS[library])


def test_the_library_folders_never_import_the_bench():
    edges = graph()
    bad = {(name, dep) for name, deps in edges.items()
           if name.split(".")[1:2] and name.split(".")[1] in LIBRARY_FOLDERS
           for dep in deps if dep == "dcredit_hvd.bench" or dep.startswith("dcredit_hvd.bench.")}
    assert bad == set()


def test_every_module_lives_in_its_concerns_folder():
    """The top level holds the contract only: what a user imports or runs (the optimizer, its
    configuration and errors, the command lines); the frameworks' entry points have a folder."""
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top <= {"__init__", "__main__", "arguments", "config", "emulate", "errors",
                   "optimizer"}
    for folder in (*LIBRARY_FOLDERS, "bench", "frameworks"):
        init = ROOT / folder / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), folder


_CHEAP = """
import sys, dcredit_hvd
heavy = [m for m in sys.modules if m.split(".")[0] in ("torch", "horovod", "numpy")
         or m.startswith(("dcredit_hvd.bench", "dcredit_hvd.planning", "dcredit_hvd.runtime",
                          "dcredit_hvd.transports"))]
print(heavy)
"""


def test_importing_the_package_loads_no_library_and_no_tool():
    done = subprocess.run([sys.executable, "-c", _CHEAP], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_module_path_from_before_0_2_is_simply_absent():
    """0.1's flat paths were never aliased (two names would give two copies of a module's
    classes); with the shim gone they fail as any missing module does."""
    import dcredit_hvd  # noqa: F401
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dcredit_hvd.planner")
    assert importlib.import_module("dcredit_hvd.planning").__name__ == "dcredit_hvd.planning"


def test_the_released_commands_still_run():
    """``python -m dcredit_hvd.emulate`` (0.2.0's README) is kept at the top as an alias of
    ``dcredit_hvd.bench.emulate``; ``python -m dcredit_hvd.bench`` is the bench folder."""
    for module in ("dcredit_hvd.emulate", "dcredit_hvd.bench"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr[-2000:]


_ALONE = """
import importlib, sys
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "dcredit_hvd" or m.startswith("dcredit_hvd.")]:
        del sys.modules[loaded]
    importlib.import_module(name)
"""


def test_each_module_imports_alone():
    """Each module first, with no package module imported before it (one fresh interpreter;
    torch and Horovod stay loaded between them), so that no earlier import hides a circle."""
    done = subprocess.run([sys.executable, "-c", _ALONE, *sorted(_modules())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_module_stays_within_the_size_targets(module):
    path = _modules()[module]
    lines = path.read_text().splitlines()
    limit = {"dcredit_hvd.optimizer": 350, "dcredit_hvd.planning.planner": 500}.get(module, 650)
    assert len(lines) <= limit
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= 300, node.name
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno + 1 <= 80, node.name


def test_the_transports_package_lists_horovod_first():
    transports = importlib.import_module("dcredit_hvd.transports")
    assert transports.names()[0] == "horovod"


def _imported_names(path: pathlib.Path, module: str | None) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every ``from dcredit_hvd... import name`` in ``path``, at any
    depth (imports inside functions run only when the function does)."""
    package = module if path.name == "__init__.py" else (module or "").rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
        else:
            target = node.module or ""
        if target.split(".")[0] == "dcredit_hvd":
            found.extend((node.lineno, target, alias.name) for alias in node.names)
    return found


def test_every_import_of_the_package_names_something_that_exists():
    """A moved module leaves no import behind that fails only when its function runs (the
    side-by-side bench's model zoo import did, after the 0.2 layout)."""
    repo = ROOT.parent
    sources = [(p, m) for m, p in _modules().items()]
    sources += [(p, None) for folder in ("scripts", "examples") for p in (repo / folder).glob("*.py")]
    broken = []
    for path, module in sources:
        for line, target, name in _imported_names(path, module):
            try:
                loaded = importlib.import_module(target)
                if not hasattr(loaded, name):
                    importlib.import_module(f"{target}.{name}")
            except ImportError as exc:
                broken.append(f"{path.relative_to(repo)}:{line}: from {target} import {name} ({exc})")
    assert not broken, "\n".join(broken)
