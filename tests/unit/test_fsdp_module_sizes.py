"""Layer 3's shape: modules under 600 lines, functions under 80, no import cycle between its
modules (imports under ``if TYPE_CHECKING:`` are annotations only and do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

FSDP = Path(__file__).resolve().parents[2] / "lightning_vescale" / "fsdp"


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(FSDP.glob("*.py"))}


def test_module_and_function_sizes():
    too_long = []
    for path in sorted(FSDP.glob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines >= 600:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n >= 80:
                    too_long.append(f"{path.name}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, too_long


def _runtime_imports(tree: ast.Module) -> set[str]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module \
                and node.module.startswith("lightning_vescale.fsdp."):
            out.add(node.module.rsplit(".", 1)[1])
    return out


def test_no_import_cycles():
    graph = {name: _runtime_imports(tree) for name, tree in _modules().items()}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join(path + [name, dep])}"
            if dep not in state:
                visit(dep, path + [name])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [])
