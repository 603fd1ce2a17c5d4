"""No import cycles among the modules of ``shardfuse/``, ``bench/`` and ``examples/``.

Every ``.py`` file is parsed (``ast``, nothing is imported) and every import statement counts, wherever it
stands: at the top, inside a function (a "lazy" import), under ``if TYPE_CHECKING:``, in ``try``/``except``.
A lazy or type-checking import does not fail at import time, but it still ties the two modules together:
the dependency arrows must point one way (kernels <- sharding <- offload, bench -> shardfuse).

How an import becomes edges of the module graph (importer -> imported):

- ``import a.b.c`` -> ``a.b.c``; ``from a.b import c`` -> ``a.b.c`` when ``c`` is a submodule (a file or
  package of the scanned tree), else -> ``a.b`` (``c`` is a name defined in ``a/b/__init__.py`` or ``a/b.py``);
  ``from . import x`` / ``from ..m import x`` are resolved against the importer's package first. Modules
  outside the scanned roots (torch, the standard library) are ignored.
- Importing ``a.b.c`` first runs the ``__init__`` of ``a`` and ``a.b``. Those implicit parent imports are
  edges too, except to the importer's own ancestors: when ``shardfuse.sharding._wrap`` runs, ``shardfuse`` and
  ``shardfuse.sharding`` have already started, so importing them again does nothing. That is why a package
  ``__init__`` that imports its submodules is not a cycle, as long as the submodules do not import the
  package back.
- Importing the package back *explicitly* is an edge, even from inside it: ``from shardfuse.sharding import
  FullyShardedDataParallel`` in ``shardfuse/sharding/checkpoint/_optim_state.py`` reads a name that only exists once
  ``shardfuse/sharding/__init__.py`` got far enough, and that ``__init__`` imports ``_optim_state``'s
  importers: a cycle through ``__init__`` (import the name from its defining submodule instead). But
  ``from shardfuse.sharding import _collectives`` names a submodule and goes straight to it: no cycle.
- A module importing itself is a cycle of one.

The test fails with one cycle path per strongly connected component (with the file and line of every import
on it), checked per root, so a cycle inside one root does not fail the others' tests.

Beyond cycles, the parts of ``shardfuse.sharding`` import one way (:data:`ALLOWED`): ``core`` imports no other
part, ``host`` and ``checkpoint`` import the core, ``ssd`` the core and the host tier, and the face
(``shardfuse/sharding/__init__.py``, ``_fully_sharded.py``, ``_wrap.py``) any part; nothing imports the face back.
Every import statement counts here as above (lazy, ``TYPE_CHECKING``); an edge the table does not allow fails
with the importing module, its file and line, the imported module and the rule.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("shardfuse", "bench", "examples")


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    rel: str  # the path relative to the scanned base, for messages
    is_package: bool

    @property
    def package(self) -> str:
        """The package its relative imports start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Edge:
    target: str
    lineno: int
    statement: str  # the import as written, for the failure message
    implicit: bool  # a parent package's __init__ run on the way to the target


def discover(base: Path, roots: tuple[str, ...]) -> dict[str, Module]:
    """Every module under ``base/<root>/`` by its dotted name (``pkg/__init__.py`` is ``pkg``)."""
    modules: dict[str, Module] = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if any(not p.isidentifier() for p in parts):
                continue  # not importable under a dotted name (e.g. a folder with a dash)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = Module(name, path, path.relative_to(base).as_posix(), is_package)
    return modules


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _known_prefix(name: str, modules: dict[str, Module]) -> str | None:
    """The longest prefix of ``name`` that is a scanned module (None for torch, os...)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in modules:
            return cand
    return None


def _resolve_from(mod: Module, node: ast.ImportFrom) -> str | None:
    """The absolute module that ``from <...> import`` names (None when the dots leave the tree)."""
    if not node.level:
        return node.module
    parts = mod.package.split(".") if mod.package else []
    up = node.level - 1
    if up > len(parts):
        return None
    base = ".".join(parts[: len(parts) - up])
    if node.module:
        base = f"{base}.{node.module}" if base else node.module
    return base or None


def imports_of(mod: Module, modules: dict[str, Module]) -> list[Edge]:
    """The edges of one module: every import statement anywhere in its file (see the module docstring)."""
    tree = ast.parse(mod.path.read_text(), filename=str(mod.path))
    src_lines = mod.path.read_text().splitlines()
    own_ancestors = set(_ancestors(mod.name))
    edges: list[Edge] = []

    def add(target: str | None, node: ast.stmt) -> None:
        if target is None:
            return
        known = _known_prefix(target, modules)
        if known is None:
            return
        text = src_lines[node.lineno - 1].strip() if node.lineno <= len(src_lines) else ""
        for parent in _ancestors(known):
            if parent in modules and parent not in own_ancestors and parent != mod.name:
                edges.append(Edge(parent, node.lineno, text, implicit=True))
        edges.append(Edge(known, node.lineno, text, implicit=False))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(mod, node)
            if base is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # A submodule goes straight to the submodule; any other name is read from `base` itself.
                add(sub if alias.name != "*" and sub in modules else base, node)
    return edges


def module_graph(base: Path, roots: tuple[str, ...]) -> tuple[dict[str, Module], dict[str, dict[str, Edge]]]:
    """The modules and ``{importer: {imported: first edge}}``."""
    modules = discover(base, roots)
    graph: dict[str, dict[str, Edge]] = {name: {} for name in modules}
    for name, mod in modules.items():
        for edge in imports_of(mod, modules):
            current = graph[name].get(edge.target)
            if current is None or (current.implicit and not edge.implicit):  # prefer the explicit statement
                graph[name][edge.target] = edge
    return modules, graph


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                out.append(sorted(comp))
    return sorted(out)


def cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """The components that are cycles: more than one module, or one module importing itself."""
    return [c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]]]


def cycle_path(component: list[str], graph: dict[str, dict[str, Edge]]) -> list[str]:
    """A shortest cycle through the component's first module, as ``[m0, m1, ..., m0]``."""
    start, members = component[0], set(component)
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if nxt in members and nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {component}")  # a component always has one


def describe(component: list[str], modules: dict[str, Module], graph: dict[str, dict[str, Edge]]) -> str:
    path = cycle_path(component, graph)
    lines = [f"import cycle among {len(component)} module(s): {', '.join(component)}", f"  {path[0]}"]
    for a, b in zip(path, path[1:]):
        e = graph[a][b]
        where = modules[a].rel
        how = "runs the __init__ of" if e.implicit else "imports"
        lines.append(f"    {how} -> {b}    ({where}:{e.lineno}: {e.statement})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the repository


@pytest.fixture(scope="module")
def repo_graph() -> tuple[dict[str, Module], dict[str, dict[str, Edge]]]:
    return module_graph(REPO, ROOTS)


@pytest.mark.parametrize("root", ROOTS)
def test_no_import_cycles(root: str, repo_graph: tuple[dict[str, Module], dict[str, dict[str, Edge]]]) -> None:
    modules, graph = repo_graph
    assert any(m.split(".")[0] == root for m in modules), f"no modules found under {root}/"
    found = [c for c in cycles(graph) if any(m.split(".")[0] == root for m in c)]
    assert not found, "\n\n".join(describe(c, modules, graph) for c in found)


def test_the_graph_sees_the_repository(repo_graph: tuple[dict[str, Module], dict[str, dict[str, Edge]]]) -> None:
    """Sanity: known edges are there, so an empty result means no cycles rather than a blind scan."""
    modules, graph = repo_graph
    assert "shardfuse.kernels" in graph["shardfuse"]  # from shardfuse import kernels (a submodule)
    assert "bench.results_io" in graph["bench.regress"] and "bench.results_io" in graph["bench.report"]
    assert "bench.regress" in graph["bench.report"]  # the lazy import inside main() is seen
    assert "bench.report" not in graph["bench.regress"]  # ... and the cycle it formed is gone
    assert "shardfuse.sharding" not in graph["shardfuse.sharding.core._collectives"]
    assert "shardfuse.sharding.core._flat_param" in graph["shardfuse.sharding.host._host_step"]
    assert "shardfuse.sharding.host._host_shard" in graph["shardfuse.sharding.ssd._ssd_shard"]


# ------------------------------------------------------------------------------------------------ sharding's parts

SHARDING = "shardfuse.sharding"
FACE = "face"  # shardfuse/sharding/__init__.py, _fully_sharded.py, _wrap.py: the public names on top
# The sub-packages of shardfuse/sharding/, each with its one job (see its __init__.py).
PARTS = ("core", "host", "ssd", "checkpoint")
# Which part may import which (besides itself); any other edge between two parts fails.
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "host": frozenset({"core"}),
    "checkpoint": frozenset({"core"}),
    "ssd": frozenset({"core", "host"}),
    FACE: frozenset({"core", "host", "ssd", "checkpoint"}),
}
RULES = {
    "core": "the core knows no part above it: the host tier only through core/_host_protocol.HostSide, the SSD "
            "settings as the opaque core/_config.TierSettings, the checkpoint's resume guard as a callable "
            "handed to _process_hooks.install()",
    "host": "the host tier builds on the core only; a store below host memory (the SSD tier) reaches it through "
            "host/_backing.BackingStore, which that store implements and registers",
    "checkpoint": "the checkpoint layer reads and writes the core's shards; it imports no tier and not the face",
    "ssd": "the SSD tier is a backing store for the host tier's shards: it may import the core and the host tier "
           "(HostShard, host/_backing), not the checkpoint layer or the face",
    FACE: "the face sits on top and may import every part",
}


def part_of(module: str) -> str | None:
    """The part of ``shardfuse.sharding`` a module belongs to (None outside it)."""
    if module == SHARDING:
        return FACE
    if not module.startswith(SHARDING + "."):
        return None
    head = module[len(SHARDING) + 1:].split(".")[0]
    return head if head in PARTS else FACE


def layering_violations(modules: dict[str, Module], graph: dict[str, dict[str, Edge]]) -> list[str]:
    """One line per import between two parts of ``shardfuse.sharding`` that :data:`ALLOWED` does not allow.

    Implicit edges (a parent ``__init__`` run on the way) are left out: each comes with the explicit import of a
    module of the same part, which is reported instead."""
    out = []
    for importer in sorted(graph):
        src = part_of(importer)
        if src is None:
            continue
        for target, edge in sorted(graph[importer].items()):
            dst = part_of(target)
            if edge.implicit or dst is None or dst == src or dst in ALLOWED[src]:
                continue
            may = ", ".join(sorted(ALLOWED[src])) or "no other part"
            out.append(f"{importer} ({modules[importer].rel}:{edge.lineno}: {edge.statement}) imports {target}: "
                       f"{src} -> {dst} is not allowed ({src} may import {may}; rule: {RULES[src]})")
    return out


def test_sharding_parts_import_one_way(repo_graph: tuple[dict[str, Module], dict[str, dict[str, Edge]]]) -> None:
    modules, graph = repo_graph
    found = layering_violations(modules, graph)
    assert not found, "imports against the layering of shardfuse.sharding:\n" + "\n".join(found)


def test_every_sharding_subpackage_has_a_rule() -> None:
    subs = sorted(p.parent.name for p in (REPO / "shardfuse" / "sharding").glob("*/__init__.py"))
    assert subs == sorted(PARTS), (
        f"shardfuse/sharding/ has sub-packages {subs}, the layering table knows {sorted(PARTS)}: give each new "
        f"sub-package a row in ALLOWED and RULES (tests/test_import_cycles.py)")
    for part in PARTS:
        doc = ast.get_docstring(ast.parse((REPO / "shardfuse" / "sharding" / part / "__init__.py").read_text()))
        assert doc, f"shardfuse/sharding/{part}/__init__.py needs a docstring saying the sub-package's one job"


def test_detects_an_edge_against_the_layering(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "shardfuse/__init__.py": "",
        "shardfuse/sharding/__init__.py": "from shardfuse.sharding._face import F\n",
        "shardfuse/sharding/_face.py": "from shardfuse.sharding.ssd.s import S\nclass F: ...\n",
        "shardfuse/sharding/core/__init__.py": "",
        "shardfuse/sharding/core/c.py": "def f():\n    from shardfuse.sharding.checkpoint import k  # lazy\n",
        "shardfuse/sharding/host/__init__.py": "",
        "shardfuse/sharding/host/h.py": "from shardfuse.sharding.core import c\n",
        "shardfuse/sharding/ssd/__init__.py": "",
        "shardfuse/sharding/ssd/s.py": "from shardfuse.sharding.host.h import x\nclass S: ...\n",
        "shardfuse/sharding/checkpoint/__init__.py": "",
        "shardfuse/sharding/checkpoint/k.py": "from shardfuse.sharding import F\n",
    })  # fmt: skip
    modules, graph = module_graph(tmp_path, ("shardfuse",))
    found = layering_violations(modules, graph)
    assert len(found) == 2, found  # host -> core, ssd -> host and face -> ssd are allowed
    from_ckpt, from_core = sorted(found)
    assert from_ckpt.startswith("shardfuse.sharding.checkpoint.k (shardfuse/sharding/checkpoint/k.py:1: from "), found
    assert "imports shardfuse.sharding: checkpoint -> face is not allowed (checkpoint may import core;" in from_ckpt
    assert from_core.startswith("shardfuse.sharding.core.c (shardfuse/sharding/core/c.py:2: from shardfuse.sharding."
                           "checkpoint import k  # lazy) imports shardfuse.sharding.checkpoint.k: core -> "
                           "checkpoint is not allowed (core may import no other part; rule: the core knows"), found


# ------------------------------------------------------------------------------------------------ the detector


def _tree(base: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base


def _cycles_in(base: Path, roots: tuple[str, ...] = ("pkg",)) -> tuple[list[list[str]], str]:
    modules, graph = module_graph(base, roots)
    found = cycles(graph)
    return found, "\n\n".join(describe(c, modules, graph) for c in found)


def test_detects_a_planted_cycle_through_a_lazy_import(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import helper\n",
        "pkg/b.py": "def helper():\n    from pkg import a  # lazy\n    return a\n",
        "pkg/c.py": "import pkg.a\n",  # depends on the cycle, is not part of it
    })  # fmt: skip
    found, text = _cycles_in(tmp_path)
    assert found == [["pkg.a", "pkg.b"]]
    assert "pkg.a\n    imports -> pkg.b" in text and "imports -> pkg.a" in text
    assert "pkg/b.py:2: from pkg import a  # lazy" in text and "pkg/a.py:1" in text


def test_type_checking_and_relative_imports_count(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..d import D\nclass C: ...\n",
        "pkg/d.py": "from .sub.c import C\nclass D(C): ...\n",
    })  # fmt: skip
    found, text = _cycles_in(tmp_path)
    assert found == [["pkg.d", "pkg.sub.c"]], text


def test_package_init_importing_its_submodules_is_not_a_cycle(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\nfrom . import b\nfrom .b import *\n",
        "pkg/a.py": "from pkg import b\nfrom pkg.b import B\nclass A(B): ...\n",  # submodules, not the package
        "pkg/b.py": "import os\nclass B: ...\n",
    })  # fmt: skip
    found, text = _cycles_in(tmp_path)
    assert found == [], text


def test_importing_a_name_from_the_own_package_init_is_a_cycle(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
        "pkg/a.py": "class A: ...\n",
        "pkg/b.py": "def make():\n    from pkg import A  # a name of pkg/__init__.py\n    return A()\n",
    })  # fmt: skip
    found, text = _cycles_in(tmp_path)
    assert found == [["pkg", "pkg.b"]], text
    assert "pkg/b.py:2" in text


def test_cycle_through_another_package_init(tmp_path: Path) -> None:
    # Importing lib.k first runs lib/__init__.py, which imports lib.j, which imports app.x back.
    _tree(tmp_path, {
        "app/__init__.py": "",
        "app/x.py": "from lib.k import f\n",
        "lib/__init__.py": "from lib import j\n",
        "lib/j.py": "import app.x\n",
        "lib/k.py": "def f(): ...\n",
    })  # fmt: skip
    found, text = _cycles_in(tmp_path, ("app", "lib"))
    assert found == [["app.x", "lib", "lib.j"]], text
    assert "runs the __init__ of -> lib" in text


def test_self_import_is_a_cycle(tmp_path: Path) -> None:
    _tree(tmp_path, {"pkg/__init__.py": "", "pkg/e.py": "import pkg.e\n", "pkg/f.py": "import json\n"})
    found, text = _cycles_in(tmp_path)
    assert found == [["pkg.e"]], text
