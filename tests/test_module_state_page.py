"""Every module-level name in ``shardfuse/`` that is changed after import is listed, with why it stays, in
docs/process-wide.md ("Module-level state"); anything else that holds live state belongs to the object that owns it
(issue 29: no module-level registries of live objects).

The scanner reads the source (``ast``), no import: a module-level name counts as changed after import when code in a
function or method assigns it under ``global``, assigns or deletes an item of it (``NAME[k] = v``, ``del NAME[k]``,
``NAME[k] += v``), sets an attribute on it, or calls a mutating method on it (``NAME.append(...)``, ``.add``,
``.update``, ``.setdefault``, ``.pop``, ``.clear``, ...), in its own module or through an import of it
(``_capture._OPEN.add(...)``, ``from ... import _OPEN``). Changes at import time (module-level statements) do not
count.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardfuse"
PAGE = ROOT / "docs" / "process-wide.md"
SECTION = "## Module-level state"

MUTATORS = frozenset({
    "append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "insert", "remove", "discard",
    "appendleft", "extendleft", "popleft", "sort", "reverse", "move_to_end", "__setitem__", "__delitem__",
    "difference_update", "intersection_update", "symmetric_difference_update", "rotate",
})


@dataclass
class _Module:
    name: str  # dotted, e.g. shardfuse.sharding.core._registry
    tree: ast.Module
    top: set[str] = field(default_factory=set)  # module-level names bound by assignment
    aliases: dict[str, str] = field(default_factory=dict)  # local name -> dotted module it stands for
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name there)
    instances: dict[str, str] = field(default_factory=dict)  # module-level name -> the class it was made from


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _assigned_names(node: ast.AST) -> list[str]:
    """Plain names bound by an assignment target (tuples unpacked)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _assigned_names(elt)]
    if isinstance(node, ast.Starred):
        return _assigned_names(node.value)
    return []


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Module-level statements, looking inside top-level if/try/with blocks."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        stmt = todo.pop(0)
        out.append(stmt)
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for attr in ("body", "orelse", "finalbody", "handlers"):
                for sub in getattr(stmt, attr, []):
                    todo.extend(sub.body if isinstance(sub, ast.ExceptHandler) else [sub])
    return out


def _collect(mod: _Module, package: str) -> None:
    for stmt in _top_level(mod.tree):
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                mod.top.update(_assigned_names(t))
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and isinstance(stmt.target, ast.Name):
            mod.top.add(stmt.target.id)
        value = getattr(stmt, "value", None)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Call):
            func = value.func
            cls = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                if isinstance(t, ast.Name) and cls is not None:
                    mod.instances[t.id] = cls
    for node in ast.walk(mod.tree):  # imports anywhere (a function may import a module to change it)
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(package):
                    mod.aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(package):
            for a in node.names:
                mod.aliases.setdefault(a.asname or a.name, f"{node.module}.{a.name}")
                mod.imported[a.asname or a.name] = (node.module, a.name)


def _self_mutators(modules: dict[str, _Module]) -> dict[str, set[str]]:
    """Class name -> its methods that change ``self`` (assign or delete an attribute or item of it, or call a
    mutating method on one of its attributes)."""
    out: dict[str, set[str]] = {}
    for mod in modules.values():
        for cls in ast.walk(mod.tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for fn in cls.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name != "__init__" \
                        and _changes_self(fn):
                    out.setdefault(cls.name, set()).add(fn.name)
    return out


def _on_self(node: ast.expr) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _changes_self(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        if any(isinstance(t, (ast.Attribute, ast.Subscript)) and _on_self(t) for t in targets):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and isinstance(node.func.value, (ast.Attribute, ast.Subscript)) and _on_self(node.func.value)):
            return True
    return False


def _locals(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> tuple[set[str], set[str]]:
    """(names local to ``fn``: its parameters and what it binds without ``global``, names it declares global)."""
    args = fn.args
    local = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    local.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
    declared: set[str] = set()
    body = fn.body if isinstance(fn.body, list) else [fn.body]
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                declared.update(node.names)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                local.add(node.id)
            elif isinstance(node, (ast.For, ast.comprehension)):
                local.update(_assigned_names(node.target))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                local.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                local.add(node.name)
    return local - declared, declared


def _target(node: ast.expr, mod: _Module, local: set[str], modules: dict[str, _Module]) -> tuple[str, str] | None:
    """The (module, name) a changed expression's base stands for: ``NAME`` (this module's, or imported by
    ``from m import NAME``) or ``alias.NAME`` with ``alias`` a shardfuse module."""
    if isinstance(node, ast.Name) and node.id not in local:
        if node.id in mod.top:
            return mod.name, node.id
        if node.id in mod.imported:
            return mod.imported[node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id not in local:
        owner = mod.aliases.get(node.value.id)
        if owner in modules:
            return owner, node.attr
    return None


def _changes_in(fn: ast.AST, mod: _Module, modules: dict[str, _Module],
                mutating: dict[str, set[str]]) -> set[tuple[str, str]]:
    local, declared = _locals(fn)  # type: ignore[arg-type]
    found: set[tuple[str, str]] = set()
    body = fn.body if isinstance(fn.body, list) else [fn.body]  # type: ignore[attr-defined]
    for stmt in body:
        for node in ast.walk(stmt):
            targets: list[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for name in _assigned_names(t):
                    if name in declared and name in mod.top:
                        found.add((mod.name, name))
                if isinstance(t, (ast.Subscript, ast.Attribute)):
                    hit = _target(t.value, mod, local, modules)
                    if hit is None and isinstance(t, ast.Attribute):  # alias.NAME = v: a module global set
                        hit = _target(t, mod, local, modules)
                    if hit is not None:
                        found.add(hit)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                hit = _target(node.func.value, mod, local, modules)
                if hit is not None and (node.func.attr in MUTATORS or node.func.attr in mutating.get(
                        modules[hit[0]].instances.get(hit[1], ""), set())):
                    found.add(hit)
    return found


def changed_after_import(sources: dict[str, str], package: str = "shardfuse") -> set[str]:
    """``module.NAME`` (the module's last dotted part) of every module-level name of ``sources`` (dotted module
    name -> source) changed after import."""
    modules = {name: _Module(name, ast.parse(src)) for name, src in sources.items()}
    for mod in modules.values():
        _collect(mod, package)
    mutating = _self_mutators(modules)
    found: set[tuple[str, str]] = set()
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                found |= _changes_in(node, mod, modules, mutating)
    out = set()
    for owner, name in found:
        target = modules.get(owner)
        if target is not None and name in target.top:  # a module-level name of a scanned module
            out.add(f"{owner.rsplit('.', 1)[-1]}.{name}")
    return out


def _package_sources() -> dict[str, str]:
    return {_module_name(p, PACKAGE): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def listed_on_page() -> set[str]:
    text = PAGE.read_text()
    assert SECTION in text, f"{PAGE.name} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for line in section.splitlines() if (m := re.match(r"\|\s*`([\w.]+)`\s*\|", line))}


# ------------------------------------------------------------------------------------------------------
# the scanner itself: it must see each kind of change (else the page check below could never fail)
# ------------------------------------------------------------------------------------------------------

_SCRATCH = {
    "shardfuse.a._registry": '''
import weakref
_HANDLES: dict = {}
_SEEN = weakref.WeakSet()
_ORDER = []
_COUNT = 0
_CONST = {"a": 1}
_FILLED_AT_IMPORT = {}
_FILLED_AT_IMPORT["x"] = 1


class Cache:
    def __init__(self):
        self._d = {}

    def get(self, k):
        return self._d.get(k)

    def put(self, k, v):
        self._d[k] = v


_PLANS = Cache()
_READ_ONLY = Cache()

def register(p, h):
    _HANDLES[id(p)] = h

def see(o):
    _SEEN.add(o)

def bump():
    global _COUNT
    _COUNT += 1

def read(k, _ORDER=()):
    _ORDER.append(k)  # a parameter of that name: not the module's
    _PLANS.put(k, 1)
    return _CONST[k] or _READ_ONLY.get(k)
''',
    "shardfuse.b.user": '''
from shardfuse.a import _registry
from shardfuse.a._registry import _ORDER

def go(x):
    _registry._CONST["b"] = 2
    _ORDER.extend([x])
''',
}


def test_scanner_finds_each_kind_of_change():
    assert changed_after_import(_SCRATCH) == {"_registry._HANDLES", "_registry._SEEN", "_registry._COUNT",
                                              "_registry._CONST", "_registry._ORDER", "_registry._PLANS"}


def test_scanner_fails_on_the_old_registry():
    """The old ``_registry.py`` (module-level ``_HANDLES``/``_FLATTENED`` dicts) would be caught."""
    old = '''
import weakref
_HANDLES = {}
_FLATTENED = {}

def _forget(table, key):
    return lambda _: table.pop(key, None)

def register_handle(p, handle):
    key = id(p)
    _HANDLES[key] = (weakref.ref(p, _forget(_HANDLES, key)), weakref.ref(handle))

def register_flattened(p, handle, index):
    _FLATTENED[id(p)] = (weakref.ref(p), weakref.ref(handle), index)
'''
    found = changed_after_import({"shardfuse.sharding.core._registry": old})
    assert found == {"_registry._HANDLES", "_registry._FLATTENED"}
    assert not found <= listed_on_page()


# ------------------------------------------------------------------------------------------------------
# the page against the code
# ------------------------------------------------------------------------------------------------------


def test_every_module_level_name_changed_after_import_is_on_the_page():
    found = changed_after_import(_package_sources())
    missing = sorted(found - listed_on_page())
    assert not missing, (
        f"module-level names changed after import but not listed in {PAGE.name} ({SECTION!r}): {missing}. Make "
        f"the state an attribute of the object that owns it (the model, the root wrapper's state, the optimizer), "
        f"or list it there with why it stays"
    )


def test_the_page_lists_no_name_that_is_gone():
    """A listed name whose module exists must still be one of its module-level names (a module not written yet,
    announced on the page, is skipped)."""
    sources = _package_sources()
    tops: dict[str, set[str]] = {}
    for name, src in sources.items():
        mod = _Module(name, ast.parse(src))
        _collect(mod, "shardfuse")
        tops.setdefault(name.rsplit(".", 1)[-1], set()).update(mod.top)
    stale = [entry for entry in sorted(listed_on_page())
             if (stem := entry.rsplit(".", 1)[0]) in tops and entry.rsplit(".", 1)[1] not in tops[stem]]
    assert not stale, f"{PAGE.name} ({SECTION!r}) lists names their modules no longer have: {stale}"
