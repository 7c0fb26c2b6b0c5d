"""The package's shape (issue 22): every module under 600 lines, every function under 80, and no
import cycle between the package's modules, function-level imports included (imports under
``if TYPE_CHECKING:`` are annotations only and do not count). A package ``__init__`` counts as the
package's module, so a submodule importing its own package's ``__init__`` that imports it back
is a cycle too."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "lightning_vescale"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def test_module_and_function_sizes():
    too_long = []
    for path in _modules().values():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PKG.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} "
                                    f"{node.name}: {n} lines")
    assert not too_long, too_long


def _runtime_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module \
                and node.module.startswith("lightning_vescale"):
            for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lightning_vescale"))
    return {m for m in out if m in modules and m != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _runtime_imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join(path + [name, dep])}"
            if dep not in state:
                visit(dep, path + [name])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_the_cycle_check_can_fail(tmp_path):
    """The checker sees a function-level import cycle (so the test above can fail)."""
    (tmp_path / "a.py").write_text("def f():\n    from lightning_vescale.b import g\n")
    (tmp_path / "b.py").write_text("from lightning_vescale.a import f\n")
    modules = {"lightning_vescale.a": tmp_path / "a.py", "lightning_vescale.b": tmp_path / "b.py"}
    graph = {n: _runtime_imports(n, p, modules) for n, p in modules.items()}
    assert graph == {"lightning_vescale.a": {"lightning_vescale.b"},
                     "lightning_vescale.b": {"lightning_vescale.a"}}
