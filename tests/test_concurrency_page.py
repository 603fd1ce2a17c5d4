"""docs/concurrency.md names every lock, condition, event, thread and thread pool shardfuse constructs.

Each ``.py`` file under ``shardfuse/`` is parsed (``ast``; nothing is imported) and every call that constructs one
(``threading.Lock/RLock/Condition/Event/Semaphore/BoundedSemaphore/Barrier/Thread/Timer``, imported either way, and
``ThreadPoolExecutor``) is named after what it is assigned to, by the page's convention:
``path: Owner.attribute`` (path under ``shardfuse/``; ``Owner`` the class whose method assigns ``self.attribute``),
``path: NAME`` at module level, ``path: function.variable`` for a local, ``path: Owner.method()`` when it is not
assigned. The page must contain each as `` `path: name` ``, and every such entry on the page must still exist.

The SSD tier's section (``## SSD tier``) is written separately: until the page has that heading, the SSD modules'
constructions are not required (the heading's arrival makes them so).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "shardfuse"
PAGE = REPO / "docs" / "concurrency.md"
KINDS = {"Lock", "RLock", "Condition", "Event", "Semaphore", "BoundedSemaphore", "Barrier", "Thread", "Timer"}
POOLS = {"ThreadPoolExecutor"}
SSD_HEADING = "## SSD tier"
ENTRY = re.compile(r"`([\w/]+\.py): ([\w.()]+)`")


def _kind(call: ast.Call, from_threading: set[str]) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "threading" and f.attr in KINDS:
        return f"threading.{f.attr}"
    if isinstance(f, ast.Attribute) and f.attr in POOLS:
        return f.attr
    if isinstance(f, ast.Name) and (f.id in POOLS or f.id in from_threading):
        return f.id
    return None


def _name(target: ast.expr | None, scope: list[ast.AST]) -> str:
    owner = next((n.name for n in reversed(scope) if isinstance(n, ast.ClassDef)), None)
    func = next((n.name for n in reversed(scope) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return f"{owner}.{target.attr}" if owner else target.attr
    if isinstance(target, ast.Name):
        return target.id if func is None else f"{func}.{target.id}"
    where = f"{owner}.{func}" if owner and func else (func or owner or "<module>")
    return f"{where}()"


def constructions() -> list[tuple[str, str, str, int]]:
    """``(path under shardfuse/, name by the convention, kind, line)`` of every construction."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        from_threading = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                          and n.module == "threading" for a in n.names if a.name in KINDS}

        def visit(node: ast.AST, scope: list[ast.AST], target: ast.expr | None, rel: str = rel,
                  from_threading: set[str] = from_threading) -> None:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                tgt = node.targets[0] if isinstance(node, ast.Assign) else node.target
                visit(node.value, scope, tgt)
                return
            if isinstance(node, ast.Call):
                kind = _kind(node, from_threading)
                if kind is not None:
                    found.append((rel, _name(target, scope), kind, node.lineno))
            inner = [*scope, node] if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                else scope
            for child in ast.iter_child_nodes(node):
                visit(child, inner, target if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)

        visit(tree, [], None)
    return found


def test_the_scan_finds_the_host_tier() -> None:
    names = {(rel, name) for rel, name, _, _ in constructions()}
    for want in [("sharding/host/_host_step.py", "StepWorker._cond"),
                 ("sharding/host/_host_step.py", "StepWorker._thread"),
                 ("sharding/host/_offload_optim.py", "OffloadOptimizer._lock"),
                 ("sharding/host/_host_shard.py", "UpdateLifecycle.settled")]:
        assert want in names, f"the scan missed {want}: {sorted(names)}"


def test_page_names_every_lock_and_thread() -> None:
    page = PAGE.read_text()
    ssd_written = SSD_HEADING in page
    missing = [(rel, name, kind, line) for rel, name, kind, line in constructions()
               if f"`{rel}: {name}`" not in page and (ssd_written or not rel.startswith("sharding/ssd/"))]
    assert not missing, "docs/concurrency.md does not name:\n" + "\n".join(
        f"  shardfuse/{rel}:{line} constructs a {kind}: add the line\n"
        f"    - `{rel}: {name}` — <which threads take it, what it guards, what it may take while held>\n"
        f"  to its tier's section (and to '## Lock order' if it nests)" for rel, name, kind, line in missing)


def test_page_names_nothing_that_is_gone() -> None:
    real = {(rel, name) for rel, name, _, _ in constructions()}
    stale = sorted({m.groups() for m in ENTRY.finditer(PAGE.read_text())} - real)
    assert not stale, (f"docs/concurrency.md names {stale}, which shardfuse no longer constructs: drop or rename "
                       f"those entries")
