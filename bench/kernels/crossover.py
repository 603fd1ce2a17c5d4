"""Fit the per-GPU dispatch thresholds of the public kernels from stored kernel measurements.

    python -m bench.kernels.crossover [bench/results/h100 ...]

(from the repository root). Prints, for each GPU kind's results folder, the
:class:`~shardfuse.kernels._crossover.Crossover` of every dispatching entry point, as it must appear in
``shardfuse.kernels._crossover.MEASURED``; the test ``tests/bench/test_kernel_crossover.py`` holds the library's
table to what this fit gives for the stored runs. A kind's runs are its ``kernels.json`` (the newest, the one the
report shows) and the earlier ones kept under ``kernels_runs/`` beside it, those timed in several interleaved
rounds where there are any (:func:`run_files`): the fit pools their points, so a rule must hold on every such run
(the host-bound rows of small calls move from run to run by tens of percent, and a rule fitted to one run's noise
would flip at the next).

The fit, per family: every row of ``bench/kernels/run.py`` that timed both the Triton kernel and the PyTorch
sequence the entry point would run instead (``ROW_PATHS``) and that the count rules of the launchers send to
the kernel (``_prekey_triton``) is a point (tensor count, bytes moved, Triton ms, PyTorch ms). The PyTorch side is
the entry point's own PyTorch path (``torch path``: the sequence behind its launch plan's key and guard) where the
row timed it, else the bare sequence: the rule chooses between the entry point's two paths, and on a host slow
enough the plan's host time shows (the flat ``cast_shards`` of 32 tensors x 1024 at f19e517: 16.2 us through its
plan's PyTorch path, 4.3 bare, 5.7 through the kernel). Among the rules of
the family's shape (``FITTED``), with thresholds taken from the measured points themselves, the fit keeps those
under which every row sent to the kernel was at least as fast there as the PyTorch sequence, and of them the one
that saves the most time over all rows (ties: the one sending fewer rows to the kernel, then the one whose
thresholds lie nearest the rows it sends to the kernel: the largest ``min_bytes``, the smallest ``max_tensors``).
A family with no row that may run the kernel keeps the default ``Crossover()``, and a family whose every rule
loses somewhere is ``NEVER`` (the PyTorch sequence at every size).

``chunk_cat`` is not fitted (``shardfuse.kernels._crossover``'s docstring says why: behind a launch plan its PyTorch
pair is never the cheaper path); its ``chunk_cat_dispatch`` rows time the count rule that skips the plan.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import re
import sys
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.kernels.cases import TORCH_PATH, TRITON_PATH
from shardfuse.kernels import _crossover
from shardfuse.kernels._cast_multi import (
    FOREACH_LARGE_MIN_NUMEL,
    FOREACH_MIN_TENSORS,
    FOREACH_SMALL_MAX_NUMEL,
    FOREACH_SMALL_MIN_TENSORS,
)
from shardfuse.kernels._crossover import NEVER, Crossover

# family of the library -> (bench family, row-name prefix, label of the PyTorch sequence's time)
ROW_PATHS: dict[str, tuple[str, str, str]] = {
    "cast_shards_list": ("shard_cast_dispatch", "list ", "foreach_copy_"),
    "cast_shards_flat": ("shard_cast_dispatch", "flat ", "foreach_copy_(split)"),
    "concat": ("concat", "", "torch.cat(out=)"),
}
# The Crossover fields each family's rule is fitted on (the others keep their defaults).
FITTED: dict[str, tuple[str, ...]] = {
    "cast_shards_list": ("max_tensors", "min_bytes", "big_tensor_bytes"),
    "cast_shards_flat": ("many_tensors", "min_bytes"),
    "concat": ("min_bytes",),
}


@dataclass(frozen=True)
class Point:
    num: int
    nbytes: int
    triton_ms: float
    torch_ms: float


def _prekey_triton(family: str, num: int, nbytes: int) -> bool:
    """Whether the launchers' count rules (applied before the crossover, machine-independent) send a call of
    ``num`` tensors moving ``nbytes`` to the kernel. The list rows are fp32 -> bf16 (6 bytes an element) of near-even
    sizes: their mean size stands for the first and last tensors the launcher samples."""
    if family == "cast_shards_list":
        mean_numel = nbytes / max(num, 1) / 6
        small = mean_numel <= FOREACH_SMALL_MAX_NUMEL
        return (num < FOREACH_SMALL_MIN_TENSORS or (num < FOREACH_MIN_TENSORS and not small)
                or mean_numel >= FOREACH_LARGE_MIN_NUMEL)
    return True


def _bare_torch(family: str, num: int) -> bool:
    """Whether the entry point's PyTorch side of such a call is the bare sequence, not its plan's PyTorch path: the
    list form's large calls from ``FOREACH_MIN_TENSORS`` tensors, which ``use_foreach`` sends to
    ``_foreach_copy_`` itself where the rule does not take the kernel."""
    return family == "cast_shards_list" and num >= FOREACH_MIN_TENSORS


def points(family: str, rows: Iterable[dict]) -> list[Point]:
    """The measured points of ``family`` in a kernels file's rows."""
    bench_family, prefix, torch_label = ROW_PATHS[family]
    out = []
    for r in rows:
        base = r.get("baselines", {})
        if r.get("family") != bench_family or not r.get("name", "").startswith(prefix) or torch_label not in base:
            continue
        # A row's own time is the kernel's where no forced path was timed beside it (runs before the dispatch).
        triton_ms = base[TRITON_PATH]["ms"] if TRITON_PATH in base else r["shardfuse_ms"]
        if TORCH_PATH in base and TRITON_PATH not in base:
            continue  # the row's own time may be either path
        num, nbytes = int(r.get("num_tensors", 1)), int(r["bytes"])
        own = TORCH_PATH in base and not _bare_torch(family, num)
        torch_ms = base[TORCH_PATH]["ms"] if own else base[torch_label]["ms"]
        if _prekey_triton(family, num, nbytes):
            out.append(Point(num, nbytes, float(triton_ms), float(torch_ms)))
    return out


def _candidates(field: str, pts: Sequence[Point]) -> list[float]:
    if field in ("max_tensors",):
        return [math.inf, *sorted({p.num + 1 for p in pts})]
    if field == "many_tensors":
        return [math.inf, *sorted({p.num for p in pts})]
    if field == "big_tensor_bytes":
        return [math.inf, *sorted({p.nbytes // p.num for p in pts})]
    return [0, *sorted({p.nbytes for p in pts}), math.inf]  # min_bytes; inf: never by size


def _caution(rule: Crossover) -> tuple[float, ...]:
    """Between rules picking the same rows, the one with thresholds nearest the kernel's winning rows."""
    return (rule.min_bytes, -rule.max_tensors, rule.many_tensors, rule.big_tensor_bytes)


def fit(family: str, pts: Sequence[Point]) -> Crossover:
    """The rule of ``family``'s shape that never sends a measured row to a slower kernel and saves the most."""
    if not pts:
        return Crossover()
    fields = FITTED[family]
    best: tuple | None = None
    chosen = NEVER
    for values in itertools.product(*(_candidates(f, pts) for f in fields)):
        rule = replace(Crossover(), **dict(zip(fields, values)))
        picked = [p for p in pts if rule.triton(p.num, p.nbytes)]
        if any(p.triton_ms > p.torch_ms for p in picked):
            continue
        score = (sum(p.torch_ms - p.triton_ms for p in picked), -len(picked), _caution(rule))
        if best is None or score > best:
            best, chosen = score, rule
    return chosen if best is not None and best[0] > 0 else NEVER


KERNELS_DIR = Path(_crossover.__file__).resolve().parent
# Not part of the digest: the dispatch table itself (refitting it changes no forced path's time).
DIGEST_SKIPS = ("_crossover.py",)
# Nor the values of the launchers' count rules: they only choose between the two paths, which the runs time apart
# with the rules forced off (``forced_path``), and the fit applies the current values (``_prekey_triton``), so moving
# a count threshold must not split the runs of one code into two pools. The names stay in the digest.
COUNT_RULES = (
    "FOREACH_MIN_TENSORS", "FOREACH_SMALL_MIN_TENSORS", "FOREACH_SMALL_MAX_NUMEL", "FOREACH_LARGE_MIN_NUMEL",
    "TORCH_MIN_TENSORS", "TORCH_MAX_OUT_BYTES_PER_TENSOR",
)
_COUNT_RULE_LINE = re.compile(rf"^({'|'.join(COUNT_RULES)})\s*=.*$")


def _code_text(source: bytes) -> bytes:
    """``source`` without its comments and blank lines, and with the values of the module-level ``COUNT_RULES`` left
    out: an edit of a comment (or a blank line, or a count threshold) changes no path a run times, so it must not
    split the runs of one code into two pools. The comments are found by Python's tokenizer and
    cut out of the text (the tokens themselves differ between Python versions: 3.12 splits f-strings, 3.11 does not;
    the text left is the same on both). Source that does not tokenize is taken as it is."""
    try:
        comments = [tok.start for tok in tokenize.tokenize(io.BytesIO(source).readline) if tok.type == tokenize.COMMENT]
        lines = source.decode("utf-8").replace("\r\n", "\n").split("\n")
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return source
    for row, col in comments:  # a comment runs to the end of its line
        lines[row - 1] = lines[row - 1][:col]
    lines = [_COUNT_RULE_LINE.sub(r"\1 = ...", line) for line in lines]
    return "\n".join(line.rstrip() for line in lines if line.strip()).encode()


def kernels_source_digest(sources: dict[str, bytes] | None = None) -> str:
    """A digest of the kernels' code (``shardfuse/kernels/*.py`` but the dispatch table; comments and blank lines left
    out): runs with the same digest timed the same Triton and PyTorch paths. ``sources``: file name -> content
    (default: this tree's files)."""
    if sources is None:
        sources = {p.name: p.read_bytes() for p in KERNELS_DIR.glob("*.py")}
    h = hashlib.sha256()
    for name in sorted(n for n in sources if n not in DIGEST_SKIPS):
        h.update(name.encode() + b"\0" + _code_text(sources[name]) + b"\0")
    return h.hexdigest()[:16]


def run_files(kind_dir: Path) -> list[Path]:
    """A GPU kind's stored kernel runs the fit pools: ``kernels.json`` and the earlier ones under ``kernels_runs/``,
    only those timed in several interleaved rounds (each row a median) where any is, and of them, where the newest
    run records the kernels' code (``kernels_source``), only those of the same code. A one-round run's host-bound
    rows move from run to run by up to 3x (on the H200 the Triton ``chunk_cat`` of 16 tensors x 256K took 23.4 and
    36.0 us in two one-round runs, 10.2 and 10.8 in two three-round ones), and a run of older code times paths that
    have changed since (the same call of 16 tensors x 1024K: 60.4 us at cb974af, 25.1 at ce469c0, after the plan
    caches' keys and guards changed): either would veto a rule the current code's medians hold."""
    runs = [kind_dir / "kernels.json", *sorted((kind_dir / "kernels_runs").glob("*.json"))]
    data = {p: json.loads(p.read_text()) for p in runs}
    medians = [p for p in runs if int(data[p].get("rounds") or 1) >= 2] or runs
    newest = data[runs[0]].get("kernels_source")
    if newest and runs[0] in medians:
        return [p for p in medians if data[p].get("kernels_source") == newest]
    return medians


def fit_files(paths: Sequence[Path]) -> dict[str, Crossover]:
    """Every family's rule fitted on the pooled points of ``paths`` (families with no rows left out)."""
    rows = [r for path in paths for r in json.loads(path.read_text())["rows"]]
    out = {}
    for family in ROW_PATHS:
        pts = points(family, rows)
        if pts:
            out[family] = fit(family, pts)
    return out


def main(argv: Sequence[str]) -> None:
    dirs = [Path(a) for a in argv] or sorted(p.parent for p in Path("bench/results").glob("*/kernels.json"))
    for kind_dir in dirs:
        files = run_files(kind_dir)
        print(f"{kind_dir.name}: {{  # {len(files)} run(s)")
        for family, rule in fit_files(files).items():
            print(f"    {family!r}: {_crossover.describe(rule)},")
        print("}")


if __name__ == "__main__":
    main(sys.argv[1:])
