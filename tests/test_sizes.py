"""Sizes a reader can hold: the controller under 200 lines of logic (code lines
that are not blank, comments or docstrings), and no function of the package
over 60 lines (docstring included)."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import hybrid_engine.controller


def parse_source(src: str) -> ast.Module:
    """ast.parse with the garbage collector off: on CPython 3.11, a collection
    that runs finalizers while the tree is converted can raise a spurious
    "SystemError: AST constructor recursion depth mismatch" (cpython#106905);
    late in a long pytest process, with many objects waiting, it did."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(src)
    finally:
        if enabled:
            gc.enable()


def logic_lines(path: Path) -> int:
    src = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(parse_source(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i, line in enumerate(src.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def test_counter_counts_only_logic(tmp_path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""Doc\n\nmore."""\n\n# comment\ndef f():\n    """Doc."""\n    return 1\n')
    assert logic_lines(f) == 2


def test_controller_under_200_lines_of_logic() -> None:
    assert logic_lines(Path(hybrid_engine.controller.__file__)) < 200


MAX_FUNCTION_LINES = 60


def long_functions(root: Path) -> list[str]:
    """'path:line name (n lines)' of every function under root longer than the limit."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(parse_source(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_60_lines(tmp_path) -> None:
    package = Path(hybrid_engine.controller.__file__).parent
    assert long_functions(package) == []
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions(tmp_path) == ["m.py:1 f (61 lines)"]  # the check sees one
