"""The package's shape: no module in ``shardfuse/`` over 600 lines, no function body over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardfuse"
MAX_MODULE_LINES = 600
MAX_BODY_LINES = 60
# Files others are still cutting down (issue 19): the lead empties this list at the merge.


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body after its docstring, from the first statement to the last line."""
    body = fn.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1  # type: ignore[operator]


def too_long(path: Path) -> list[str]:
    """``name (n lines)`` of each function in ``path`` whose body is over the limit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{node.name} at line {node.lineno} ({body_lines(node)} lines)" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > MAX_BODY_LINES]


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_module_and_function_length(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_rel(path)} has {lines} lines (limit {MAX_MODULE_LINES}): split it"
    assert not too_long(path), f"{_rel(path)}: function bodies over {MAX_BODY_LINES} lines: {too_long(path)}"


def test_the_check_catches_a_long_function(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    doc = '    """' + "doc\n" * 30 + '    """\n'
    src.write_text("def f():\n" + "    x = 1\n" * (MAX_BODY_LINES + 1) + "\n\ndef g():\n" + doc
                   + "    x = 1\n" * MAX_BODY_LINES)
    assert [s.split(" ")[0] for s in too_long(src)] == ["f"]
