"""pyproject.toml declares what the package needs and describes it.

- Every third-party module that ``shardfuse/`` imports (at the top, inside a function or under
  ``TYPE_CHECKING``; parsed with ``ast``, nothing imported) is a declared dependency, so a fresh
  ``pip install shardfuse`` imports.
- numpy is a dependency although shardfuse never imports it: ``import torch`` warns "Failed to initialize NumPy"
  without it (torch's wheels do not require it) and Triton's interpreter needs it.
- The metadata a package index shows is there: authors, license, keywords, classifiers (the Python versions
  match ``requires-python``).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
# Import name -> distribution name, where they differ.
_DISTRIBUTION = {"yaml": "pyyaml"}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def _third_party_imports(root: Path) -> dict[str, str]:
    """Top-level module -> the first ``file:line`` that imports it, for modules outside the standard library and
    the package itself."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top not in sys.stdlib_module_names and top != root.name:
                    found.setdefault(top, f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_imported_distribution_is_declared() -> None:
    declared = _names(_project()["dependencies"])
    imports = _third_party_imports(REPO / "shardfuse")
    assert "torch" in imports and "triton" in imports, f"the scan found no torch/triton import: {imports}"
    missing = {m: where for m, where in imports.items() if _DISTRIBUTION.get(m, m).lower() not in declared}
    assert not missing, (
        f"shardfuse/ imports {sorted(missing)} (first at {missing}) but pyproject.toml's [project] dependencies "
        f"{sorted(declared)} do not name them: add them there, or move the import behind an optional feature"
    )


def test_numpy_is_declared() -> None:
    declared = _names(_project()["dependencies"])
    assert "numpy" in declared, (
        f"numpy is missing from [project] dependencies {sorted(declared)}: without it `import torch` (so `import "
        "shardfuse`) prints 'Failed to initialize NumPy' and Triton's interpreter cannot run the kernels on the CPU"
    )


def test_metadata_is_complete() -> None:
    project = _project()
    missing = [k for k in ("description", "readme", "license", "authors", "keywords", "classifiers")
               if not project.get(k)]
    assert not missing, f"pyproject.toml's [project] lacks {missing}"
    assert {"name": "shardfuse developers"} in project["authors"], project["authors"]
    low = int(re.fullmatch(r">=3\.(\d+)", project["requires-python"]).group(1))
    listed = sorted(int(m.group(1)) for c in project["classifiers"]
                    if (m := re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c)))
    assert listed and listed[0] == low, (
        f"the classifiers list Python 3.{listed} but requires-python is {project['requires-python']}: "
        "list the versions from the lowest supported one"
    )
