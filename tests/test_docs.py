"""The documentation stays correct: its code blocks run, its links resolve, and the benchmark report works.

Code blocks in ``docs/*.md`` (convention documented in ``docs/index.md``):

- ```` ```python run ````: executed in a fresh namespace, in this process, on the CPU;
- ```` ```python run-dist ````: the same, inside a one-process gloo group created before the block and
  destroyed after it (in a subprocess when this process already has a process group);
- ```` ```python ````: shown only (needs GPUs, torchrun or another library).

The conftest turns Triton's interpreter on without a GPU, so kernel calls in the blocks run the Triton code.
Heading anchors are computed as ``bench.report`` computes them for the benchmark page; the report and the
regression check themselves are tested under ``tests/bench/``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from bench import report
from tests.dist_pool import free_port

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

RUN = "python run"
RUN_DIST = "python run-dist"
# Every fence info string allowed in the docs: a typo such as "python runn" must not silently skip a block.
KNOWN_INFO = {"", "python", RUN, RUN_DIST, "bash", "text", "console", "json", "toml"}
BLOCK_LIMIT_S = 10.0  # each runnable block must stay quick (a few seconds on CPU; first calls pay imports)

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def doc_files() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def code_blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line number of the opening fence, info string, code)`` for every fenced block of ``path``."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def runnable_blocks() -> list[Any]:
    params = []
    for path in doc_files():
        for line, info, code in code_blocks(path):
            if info in (RUN, RUN_DIST):
                params.append(pytest.param(path, line, info, code, id=f"{path.name}:{line}"))
    return params


def _run_in_subprocess(code: str, filename: str, with_group: bool) -> None:
    """Fallback when this process already belongs to a process group: run the block in a fresh interpreter."""
    prologue = ""
    if with_group:
        prologue = "import torch.distributed as dist\ndist.init_process_group('gloo', rank=0, world_size=1)\n"
    epilogue = "import torch.distributed as dist\nif dist.is_initialized():\n    dist.destroy_process_group()\n"
    script = f"{prologue}exec(compile({code!r}, {filename!r}, 'exec'), {{'__name__': '__docs__'}})\n{epilogue}"
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        TRITON_INTERPRET="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{filename} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize(("path", "line", "info", "code"), runnable_blocks())
def test_doc_block_runs(path: Path, line: int, info: str, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    filename = f"{path.relative_to(REPO)}:{line}"
    compiled = compile(code, filename, "exec")
    with_group = info == RUN_DIST
    start = time.perf_counter()
    if dist.is_available() and dist.is_initialized():
        _run_in_subprocess(code, filename, with_group)
    else:
        # A free port for blocks that create their own group (they use os.environ.setdefault).
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        try:
            if with_group:
                dist.init_process_group("gloo", rank=0, world_size=1)
            exec(compiled, {"__name__": "__docs__"})
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    elapsed = time.perf_counter() - start
    assert elapsed < BLOCK_LIMIT_S, f"{filename} took {elapsed:.1f}s: keep doc examples small"


def test_fence_info_strings_are_known() -> None:
    bad = [
        f"{p.name}:{line}: {info!r}" for p in doc_files() for line, info, _ in code_blocks(p) if info not in KNOWN_INFO
    ]
    assert not bad, f"unknown code fence info strings (allowed: {sorted(KNOWN_INFO)}): {bad}"


def test_docs_have_runnable_blocks() -> None:
    counts = {p.name: sum(info in (RUN, RUN_DIST) for _, info, _ in code_blocks(p)) for p in doc_files()}
    assert sum(counts.values()) >= 25, counts
    for name in ("index.md", "api.md", "kernels.md", "migration.md"):
        assert counts.get(name, 0) >= 1, f"{name} has no runnable example: {counts}"


def test_python_blocks_parse() -> None:
    """Shown-only blocks are not run, but they must at least be valid Python (signatures go in ``text`` blocks)."""
    errors = []
    for p in doc_files():
        for line, info, code in code_blocks(p):
            if info == "python":
                try:
                    ast.parse(code)
                except SyntaxError as exc:
                    errors.append(f"{p.name}:{line + (exc.lineno or 0)}: {exc.msg}")
    assert not errors, errors


def test_api_md_names_every_public_name() -> None:
    import shardfuse
    import shardfuse.kernels

    text = (DOCS / "api.md").read_text()
    names = [*shardfuse.__all__, *shardfuse.kernels.__all__]
    missing = [n for n in names if f"`{n}" not in text and f"`shardfuse.{n}`" not in text]
    assert not missing, f"public names not documented in docs/api.md: {missing}"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    return {report._anchor(re.sub(r"`", "", m)) for m in re.findall(r"^#+\s+(.*)$", text, re.MULTILINE)}


def test_relative_links_resolve() -> None:
    broken = []
    for p in doc_files():
        text = p.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # external
            file_part, _, anchor = target.partition("#")
            dest = (p.parent / file_part).resolve() if file_part else p
            if not dest.exists():
                broken.append(f"{p.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{p.name}: {target} (no such heading)")
    assert not broken, broken


def _library_strings() -> list[str]:
    """Every string literal of the package, f-string placeholders rendered as ``{}``."""
    out = []
    for f in (REPO / "shardfuse").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return out


def test_troubleshooting_quotes_real_messages() -> None:
    """Each entry heading of troubleshooting.md quotes (part of) a message the library really raises."""
    text = (DOCS / "troubleshooting.md").read_text()
    quoted = re.findall(r"^### `(.+)`\s*$", text, re.MULTILINE)
    assert len(quoted) >= 20, quoted
    strings = _library_strings()
    stale = [q for q in quoted if not any(q in s for s in strings)]
    assert not stale, f"troubleshooting.md quotes messages that shardfuse no longer raises: {stale}"



# ------------------------------------------------------------------------------------------------ drift between pages

INSTALL = re.compile(r"^(python3? -m pip install [^&#\n]*?)\s*(?:&&|#|$)", re.MULTILINE)


def _install_commands(path: Path) -> set[str]:
    return {" ".join(m.group(1).split()) for m in INSTALL.finditer(path.read_text())}


def test_install_lines_agree() -> None:
    """Every page that tells a newcomer how to install says what README says (the torch pin included)."""
    readme = _install_commands(REPO / "README.md")
    assert len(readme) == 1, readme
    for path in [REPO / "docs" / "index.md"]:
        found = _install_commands(path)
        assert found == readme, f"{path.name} installs with {sorted(found)}, README with {sorted(readme)}"


def _api_arguments() -> set[str]:
    """The constructor arguments docs/api.md documents in its argument tables (``| `name` | ... |``)."""
    return set(re.findall(r"^\| `([a-z_]+)` \|", (DOCS / "api.md").read_text(), re.MULTILINE))


def test_migration_claims_no_missing_argument_that_exists() -> None:
    """migration.md must not call an argument that shardfuse documents (and accepts) 'no equivalent'."""
    missing = []
    for line in (DOCS / "migration.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1].startswith("no equivalent"):
            missing += re.findall(r"`([a-z_]+)=", cells[0])
    wrong = sorted(set(missing) & _api_arguments())
    assert not wrong, f"migration.md says these have no equivalent, api.md documents them: {wrong}"
    assert "use_orig_params" in _api_arguments()  # the check sees the tables


# ------------------------------------------------------------------------------------ pages agree with the code

# Written ``shardfuse.<name>`` that are not APIs: the sharded checkpoint's metadata key (docs/api.md's dict table).
NOT_API = {"shardfuse.meta"}
# Named in the docs before its branch lands (issue #33's planner): remove once `shardfuse.plan` imports.
PENDING_API: set[str] = set()
DOTTED = re.compile(r"(?<![\w/.-])shardfuse(?:\.[A-Za-z_]\w*)+")
# ``model.<name>`` in inline code: a FullyShardedDataParallel (or OffloadModel) method or attribute, else one of
# the user's own model that the docs show (a Hugging Face model's, the example decoder's layers).
MODEL_ATTR = re.compile(r"\bmodel\.([A-Za-z_]\w*)")
USER_MODEL_ATTRS = {"save_pretrained", "layers", "blocks"}
INSTANCE_ATTRS = {"module"}  # set in FullyShardedDataParallel.__init__ (not on the class)


def _pages() -> list[Path]:
    return [REPO / "README.md", *doc_files()]


def _resolves(dotted: str) -> bool:
    """Whether ``shardfuse.a.b.c`` names a module or an attribute reachable from one."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_pages_name_only_existing_api() -> None:
    """Every ``shardfuse.X`` a page names exists, and every ``model.method`` in its inline code is a method or
    attribute of the wrapper (or of nn.Module)."""
    from torch import nn

    import shardfuse

    known = set(dir(shardfuse.FullyShardedDataParallel)) | set(dir(shardfuse.OffloadModel)) | set(dir(nn.Module))
    missing = []
    for page in _pages():
        text = page.read_text()
        for dotted in sorted(set(DOTTED.findall(text)) - NOT_API - PENDING_API):
            if not _resolves(dotted):
                missing.append(f"{page.name}: {dotted}")
        for code in re.findall(r"`([^`\n]+)`", text):
            for name in MODEL_ATTR.findall(code):
                if name not in known | USER_MODEL_ATTRS | INSTANCE_ATTRS:
                    missing.append(f"{page.name}: model.{name} (in `{code}`)")
    assert not missing, f"pages name APIs that do not exist (rename them, or fix the page): {missing}"


# Features that exist, how pages name them, and the phrases that would deny them. A page's sentence or table row
# naming a feature with such a phrase within ``_NEAR`` characters contradicts the code.
DENIALS = ("not supported", "no equivalent", "not covered", "not offered", "unsupported", "not available",
           "not implemented")  # fmt: skip
FEATURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "the SSD tier (OffloadConfig)": (r"nvme|ssd[ _-]?offload|ssd tier|zero-infinity", DENIALS),
    "hybrid sharding (2-D mesh, HYBRID_SHARD)": (r"hybrid|hsdp|2-d (?:device )?mesh|\(2, 8\)", DENIALS),
    "OffloadOptimizer (overlapped CPU offload)": (r"offloadoptimizer|cpu offload|zero-offload", DENIALS),
    "sharded checkpoints through DCP": (r"torch\.distributed\.checkpoint\b|\bdcp\b", DENIALS),
    "capture_step (CUDA graphs)": (r"capture_step|cuda graph", DENIALS),
    "torch.compile": (r"torch\.compile\b", DENIALS),
    "torch.nn.utils.clip_grad_norm_ raises under step_in_backward": (
        r"torch\.nn\.utils\.clip_grad_norm_", ("not refused", "is allowed", "silently")),
}
_NEAR = 100


def _statements(text: str) -> list[str]:
    """Table rows and prose sentences (code blocks left out)."""
    text = FENCE.sub("", text)
    out = []
    for para in re.split(r"\n\s*\n", text):
        if para.lstrip().startswith("|"):
            out += [line for line in para.splitlines() if line.strip()]
        else:
            out += re.split(r"(?<=[.:;])\s+(?=[A-Z`*(\[])", " ".join(para.split()))
    return out


def denied_features(text: str) -> list[str]:
    found = []
    for statement in _statements(text):
        low = statement.lower()
        for feature, (pattern, phrases) in FEATURES.items():
            names = [m.start() for m in re.finditer(pattern, low)]
            denials = [low.find(p) for p in phrases if p in low]
            if any(abs(n - d) <= _NEAR for n in names for d in denials if d >= 0):
                found.append(f"{feature}: {statement.strip()[:200]}")
    return found


def test_pages_do_not_deny_existing_features() -> None:
    wrong = [f"{page.name}: {hit}" for page in _pages() for hit in denied_features(page.read_text())]
    assert not wrong, "pages call an existing feature unsupported or missing (fix the page):\n" + "\n".join(wrong)


def test_denial_check_catches_the_old_contradictions() -> None:
    """The check itself: the sentences these pages used to say are caught, their corrections are not."""
    old = [
        "| tensor/pipeline parallelism, NVMe offload, DTensor-based composition | not covered by shardfuse |",
        "| `device: nvme` (ZeRO-Infinity) | not supported |",
        "| `mesh=` a 1-D device mesh | `process_group=` the group; 2-D (HSDP) meshes have no equivalent |",
        "Clipping needs every gradient, and `torch.nn.utils.clip_grad_norm_` would come too late (it is not "
        "refused: do not call it).",
    ]
    assert [len(denied_features(s)) for s in old] == [1, 1, 1, 1], [denied_features(s) for s in old]
    fixed = [
        "| tensor/pipeline parallelism, DTensor-based composition (FSDP2 with TP) | not covered by shardfuse |",
        "| `device: nvme` (ZeRO-Infinity) | the SSD tier: `OffloadConfig(offload_type=\"ssd_offload\")` |",
    ]
    assert [denied_features(s) for s in fixed] == [[], []]
    assert _resolves("shardfuse.kernels.cast_shard") and not _resolves("shardfuse.kernels.cast_shardz")


def test_readme_stays_short_and_its_snippets_parse() -> None:
    """README is the first page a user reads: under 150 lines (the full results are on the benchmarks page), a
    "Choose your setup" section, and Python snippets that are valid Python (their names are checked above)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 150, f"README.md has {len(text.splitlines())} lines: move detail to docs/"
    assert re.search(r"^## Choose your setup$", text, re.MULTILINE), "README.md lost its 'Choose your setup'"
    blocks = [code for _, info, code in code_blocks(REPO / "README.md") if info == "python"]
    assert len(blocks) >= 6, len(blocks)
    for code in blocks:
        ast.parse(code)
