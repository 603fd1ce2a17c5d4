"""The code's shape: no module over 600 lines, no function body over 60 lines.

Checked in the package ``shardfuse/`` (test ids relative to it) and in ``bench/`` and ``examples/`` (test ids
relative to the repository root), every ``.py`` file under them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "shardfuse"
# The benchmarks and the examples beside the package: the same limits, so they stay as readable.
OTHER_ROOTS = ("bench", "examples")
MAX_MODULE_LINES = 600
MAX_BODY_LINES = 60
# Files others are still cutting down (issue 19): the lead empties this list at the merge.


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _other_modules() -> list[Path]:
    """Every module under ``OTHER_ROOTS``."""
    return sorted(path for root in OTHER_ROOTS for path in (REPO / root).rglob("*.py"))


def _repo_rel(path: Path) -> str:
    """The path relative to the repository root, e.g. ``bench/e2e/run.py``."""
    return path.relative_to(REPO).as_posix()


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


def check_shape(path: Path, name: str) -> None:
    """Fail, naming the module ``name``, if ``path`` is over the module limit or has a function over the body limit."""
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines (limit {MAX_MODULE_LINES}): split it"
    assert not too_long(path), f"{name}: function bodies over {MAX_BODY_LINES} lines: {too_long(path)}"


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_module_and_function_length(path: Path) -> None:
    check_shape(path, _rel(path))


@pytest.mark.parametrize("path", _other_modules(), ids=_repo_rel)
def test_bench_and_examples_module_and_function_length(path: Path) -> None:
    check_shape(path, _repo_rel(path))


def test_other_roots_are_scanned() -> None:
    names = [_repo_rel(p) for p in _other_modules()]
    assert "bench/e2e/run.py" in names and "examples/train.py" in names, names


def test_the_check_catches_a_long_function(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    doc = '    """' + "doc\n" * 30 + '    """\n'
    src.write_text("def f():\n" + "    x = 1\n" * (MAX_BODY_LINES + 1) + "\n\ndef g():\n" + doc
                   + "    x = 1\n" * MAX_BODY_LINES)
    assert [s.split(" ")[0] for s in too_long(src)] == ["f"]
