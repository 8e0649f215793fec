"""The package's structure (docs/architecture.md): imports go one way, down the layers

    errors, _table, _native  ->  codec  ->  config  ->  ops  ->  optim  ->  nn  ->  memory  ->  study, bench  ->  cli

with no import cycle anywhere in qconf/ -- lazy imports (inside functions) and ``TYPE_CHECKING``
imports included, and importing ``a.b.c`` counting as importing the packages ``a.b`` too -- and
modules and functions that fit on a screen (~500 and ~80 lines) unless their docstring says why
not. The imports are read from the source (ast), not by importing anything.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qconf"

#: layer of each top-level part of the package; a module may import only from layers <= its own
LAYERS = {
    "qconf.errors": 0, "qconf._table": 0, "qconf._native": 0,
    "qconf.codec": 1,
    "qconf.config": 2,
    "qconf.ops": 3,
    "qconf.optim": 4,
    "qconf.nn": 5,
    "qconf.memory": 6, "qconf": 6,  # the package itself re-exports codec .. memory
    "qconf.study": 7, "qconf.bench": 7,
    "qconf.cli": 8,
}
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80
LONG_FILE_MARK, LONG_FUNCTION_MARK = "Why this module is long:", "Why this function is long:"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every qconf module ``name`` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in MODULES else base)
    out = set()
    for t in targets:
        parts = t.split(".")
        # importing a.b.c also runs the package a.b (the top package is being imported already)
        for candidate in [t] + [".".join(parts[:i]) for i in range(2, len(parts))]:
            if candidate in MODULES and candidate != name and not name.startswith(candidate + "."):
                out.add(candidate)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def _layer(name: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{name} is in no layer of tests/test_layers.py LAYERS (add it there and to docs)")


def test_the_walker_sees_lazy_and_relative_imports():
    # optim.base imports the config layer at the top; the CLI imports bench inside a function
    assert "qconf.config" in GRAPH["qconf.optim.base"]
    assert any(m.startswith("qconf.bench") for m in GRAPH["qconf.cli"])
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_imports_go_down_the_layers():
    upward = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
              for m, targets in GRAPH.items() for t in targets if _layer(t) > _layer(m)]
    assert upward == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_functions_fit_on_a_screen(name):
    source = MODULES[name].read_text()
    tree = ast.parse(source)
    lines = source.count("\n")
    if lines > MAX_FILE_LINES:
        assert LONG_FILE_MARK in (ast.get_docstring(tree) or ""), f"{name}: {lines} lines"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                assert LONG_FUNCTION_MARK in (ast.get_docstring(node) or ""), f"{name}.{node.name}: {length} lines"


def test_importing_the_cli_leaves_out_torch_compile_and_dtensor():
    """``qconf`` starts on torch alone: torch._dynamo and torch.distributed.tensor, 0.7 s each of
    every start (every CLI command, every child process of the suite), load only when a user's
    code uses them (a DTensor exists only once its module is imported)."""
    code = ("import sys, qconf.cli; print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"
