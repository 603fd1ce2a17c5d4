"""The dispatch thresholds of the public kernels are the ones the stored measurements give.

``shardfuse.kernels._crossover.MEASURED`` must be what ``bench.kernels.crossover`` fits from
``bench/results/<gpu>/kernels.json`` and the earlier runs kept beside it (``kernels_runs/``), and the fit must never
send a call measured in any of them to the slower path.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.kernels import crossover as fit_mod
from bench.kernels.cases import FORCED_PATHS
from bench.report._kernels import kernel_summary
from bench.results_io import load_file
from shardfuse.kernels import _crossover
from shardfuse.kernels._crossover import NEVER, Crossover

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
KINDS = sorted(p.parent.name for p in RESULTS.glob("*/kernels.json"))


def test_every_measured_kind_is_in_the_table():
    assert KINDS and set(KINDS) == set(_crossover.MEASURED)


@pytest.mark.parametrize("kind", KINDS)
def test_library_thresholds_are_the_fit_of_the_stored_rows(kind):
    fitted = fit_mod.fit_files(fit_mod.run_files(RESULTS / kind))
    assert fitted == _crossover.MEASURED[kind], (
        f"shardfuse.kernels._crossover.MEASURED[{kind!r}] is not what bench/results/{kind}'s kernel runs give: "
        f"run `python -m bench.kernels.crossover` and copy its table"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_the_library_rule_picks_the_faster_path_on_every_stored_row(kind):
    rows = [r for path in fit_mod.run_files(RESULTS / kind) for r in json.loads(path.read_text())["rows"]]
    for family in fit_mod.ROW_PATHS:
        rule = _crossover.MEASURED[kind].get(family, _crossover.FALLBACK[family])
        for p in fit_mod.points(family, rows):
            if rule.triton(p.num, p.nbytes):
                assert p.triton_ms <= p.torch_ms, (kind, family, p)


@pytest.mark.parametrize("kind", KINDS)
def test_chunk_cat_count_branch_picks_the_faster_path_on_every_stored_row(kind):
    # chunk_cat's count branch (TORCH_MIN_TENSORS tensors or more, less than TORCH_MAX_OUT_BYTES_PER_TENSOR of
    # output each) against the kernel through its plan, both timed forced in the pooled runs' chunk_cat_dispatch
    # rows (bf16, factor 4): the path the threshold picks is never the slower one. At 256 KiB, the value before
    # 2026-11-30, the branch took 1024 x 32K and 1024 x 64K, where the kernel won in every run. Runs of several
    # interleaved rounds only: the H100's one run (b5976d4) timed one round through Triton's JIT, forcing each path
    # inside every call (some 15 us of host time a call on the forced rows alone: docs/kernels.md).
    from shardfuse.kernels import _chunk_cat

    runs = [json.loads(path.read_text()) for path in fit_mod.run_files(RESULTS / kind)]
    rows = [r for run in runs if int(run.get("rounds") or 1) >= 2 for r in run["rows"]]
    judged = 0
    for r in rows:
        base = r.get("baselines", {})
        num = int(r.get("num_tensors", 1))
        if r.get("family") != "chunk_cat_dispatch" or num < _chunk_cat.TORCH_MIN_TENSORS or not (
                {"triton path", "torch path"} <= set(base)):
            continue
        out_bytes = int(r["numel"]) * 2  # bf16 out
        branch = out_bytes < num * _chunk_cat.TORCH_MAX_OUT_BYTES_PER_TENSOR
        picked, other = ("torch path", "triton path") if branch else ("triton path", "torch path")
        assert base[picked]["ms"] <= base[other]["ms"], (kind, r["name"], picked, base[picked], other, base[other])
        judged += 1
    assert judged or kind != "h200", "no 1024-tensor chunk_cat_dispatch row with both paths timed in the pool"


def test_fallback_is_the_merge_of_the_measured_kinds():
    for family in _crossover.FAMILIES:
        measured = [k[family] for k in _crossover.MEASURED.values() if family in k]
        assert _crossover.FALLBACK[family] == _crossover.merge(measured)


def test_fit_on_synthetic_points():
    P = fit_mod.Point
    # The kernel wins from 1000 bytes on, below 8 tensors; loses everywhere else.
    rng = random.Random(0)
    pts = []
    for num in (1, 4, 7, 8, 16):
        for nbytes in (10, 100, 999, 1000, 5000, 10**6):
            wins = nbytes >= 1000 and num < 8
            pts.append(P(num, nbytes, 1.0 if wins else 2.0 + rng.random(), 1.5))
    rule = fit_mod.fit("cast_shards_list", pts)
    assert rule == Crossover(min_bytes=1000, max_tensors=8)
    assert all(rule.triton(p.num, p.nbytes) == (p.triton_ms < p.torch_ms) for p in pts)
    # The kernel loses at every point: never.
    assert fit_mod.fit("concat", [P(4, n, 2.0, 1.0) for n in (10, 100, 1000)]) == NEVER
    # The kernel loses only at the largest size: a size threshold cannot help, never.
    assert fit_mod.fit("concat", [P(4, 10, 1.0, 2.0), P(4, 100, 3.0, 2.0)]) == NEVER
    # No rows: the default.
    assert fit_mod.fit("concat", []) == Crossover()


def test_report_min_speedup_leaves_out_the_forced_paths(tmp_path):
    rows = [
        {"family": "concat", "name": "a", "bytes": 1e6, "shardfuse_ms": 1.0,
         "baselines": {"torch.cat": {"ms": 1.0, "speedup": 1.0}, FORCED_PATHS[0]: {"ms": 0.5, "speedup": 0.5}}},
        {"family": "concat", "name": "b", "bytes": 1e8, "shardfuse_ms": 1.0,
         "baselines": {"torch.cat": {"ms": 1.2, "speedup": 1.2}, FORCED_PATHS[1]: {"ms": 3.0, "speedup": 3.0}}},
    ]
    path = tmp_path / "h100" / "kernels.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"env": {"gpu_key": "h100"}, "copy_bandwidth_gbps": 3000.0, "rows": rows}))
    (summary,) = kernel_summary(load_file(path))
    assert summary[4] == 1.0 and summary[5] == 1.2


def test_fit_pools_every_stored_run(tmp_path):
    """A rule holds on every stored run: a size where the kernel won in one run and lost in another stays PyTorch."""

    def row(nbytes, triton_ms, torch_ms):
        return {"family": "concat", "name": f"bf16 {nbytes}", "bytes": nbytes, "shardfuse_ms": triton_ms,
                "baselines": {"torch.cat(out=)": {"ms": torch_ms, "speedup": torch_ms / triton_ms}}}

    kind = tmp_path / "h200"
    (kind / "kernels_runs").mkdir(parents=True)
    newest = [row(10**6, 1.0, 1.0), row(10**8, 0.8, 1.0), row(10**9, 0.8, 1.0)]
    earlier = [row(10**6, 1.0, 1.0), row(10**8, 1.1, 1.0), row(10**9, 0.7, 1.0)]
    (kind / "kernels.json").write_text(json.dumps({"rows": newest}))
    (kind / "kernels_runs" / "abc1234.json").write_text(json.dumps({"rows": earlier}))
    files = fit_mod.run_files(kind)
    assert files == [kind / "kernels.json", kind / "kernels_runs" / "abc1234.json"]
    assert fit_mod.fit_files(files[:1])["concat"] == Crossover(min_bytes=10**8)
    assert fit_mod.fit_files(files)["concat"] == Crossover(min_bytes=10**9)


def test_points_weigh_the_kernel_against_the_entry_points_own_pytorch_path():
    """Where a row timed the entry point's PyTorch path (behind its plan's key and guard), the fit weighs the kernel
    against that, not the bare sequence: a host slow enough shows the plan's host time on that side too."""
    from bench.kernels.cases import TORCH_PATH, TRITON_PATH

    def row(num, triton_ms, bare_ms, torch_path_ms=None):
        base = {"foreach_copy_(split)": {"ms": bare_ms}, TRITON_PATH: {"ms": triton_ms}}
        if torch_path_ms is not None:
            base[TORCH_PATH] = {"ms": torch_path_ms}
        return {"family": "shard_cast_dispatch", "name": f"flat fp32->bf16 {num} tensors x1024 (torch)",
                "num_tensors": num, "bytes": num * 1024 * 6, "shardfuse_ms": torch_path_ms or bare_ms,
                "baselines": base}

    with_path = fit_mod.points("cast_shards_flat", [row(32, 0.0057, 0.0043, 0.0162)])
    assert [(p.triton_ms, p.torch_ms) for p in with_path] == [(0.0057, 0.0162)]
    bare_only = fit_mod.points("cast_shards_flat", [row(32, 0.0057, 0.0043)])
    assert [(p.triton_ms, p.torch_ms) for p in bare_only] == [(0.0057, 0.0043)]
    # the fit then sends the call to the kernel (it is the faster of the entry point's two paths), not without
    assert fit_mod.fit("cast_shards_flat", with_path).triton(32, 32 * 1024 * 6)
    assert not fit_mod.fit("cast_shards_flat", bare_only).triton(32, 32 * 1024 * 6)


def _write_run(path: Path, rounds: int | None, source: str | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict = {"rows": [], **({"rounds": rounds} if rounds else {})}
    if source:
        data["kernels_source"] = source
    path.write_text(json.dumps(data))
    return path


def test_run_files_pool_multi_round_runs_of_the_newest_code(tmp_path):
    """Only runs timed in several rounds and, where the newest records it, of the same kernel code are pooled."""
    newest = _write_run(tmp_path / "kernels.json", 3, "aaa")
    same = _write_run(tmp_path / "kernels_runs" / "b.json", 3, "aaa")
    _write_run(tmp_path / "kernels_runs" / "c.json", 3, "old")  # older code
    _write_run(tmp_path / "kernels_runs" / "d.json", None, "aaa")  # one round
    assert fit_mod.run_files(tmp_path) == [newest, same]
    # A newest run that records no code: every multi-round run; no multi-round run at all: every run.
    _write_run(newest, 3, None)
    assert fit_mod.run_files(tmp_path) == [newest, same, tmp_path / "kernels_runs" / "c.json"]
    for p in (tmp_path / "kernels.json", *sorted((tmp_path / "kernels_runs").glob("*.json"))):
        _write_run(p, None, None)
    assert len(fit_mod.run_files(tmp_path)) == 4


def test_kernels_source_digest_follows_the_kernels_but_not_the_table():
    base = {"_cast.py": b"a", "_crossover.py": b"table", "_chunk_cat.py": b"b"}
    digest = fit_mod.kernels_source_digest(base)
    assert fit_mod.kernels_source_digest({**base, "_crossover.py": b"refitted"}) == digest
    assert fit_mod.kernels_source_digest({**base, "_cast.py": b"a2"}) != digest
    assert fit_mod.kernels_source_digest({**base, "_new.py": b""}) != digest
    # Comments and blank lines are not code: editing them keeps the digest (and the pool of runs); code does not.
    code = b"N = 96  # the count\n\n\ndef f(x):\n    return x * N\n"
    one = fit_mod.kernels_source_digest({**base, "_chunk_cat.py": code})
    reworded = code.replace(b"# the count", b"# the count rule, measured\n# on two hosts")
    assert fit_mod.kernels_source_digest({**base, "_chunk_cat.py": reworded}) == one
    assert fit_mod.kernels_source_digest({**base, "_chunk_cat.py": code.replace(b"\n\n\n", b"\n")}) == one
    assert fit_mod.kernels_source_digest({**base, "_chunk_cat.py": code.replace(b"96", b"1024")}) != one
    assert fit_mod.kernels_source_digest({**base, "_chunk_cat.py": code.replace(b"x * N", b"x + N")}) != one
    # A count rule's value is not code either (its paths are timed apart); its name, or another constant's value, is.
    rule = b"FOREACH_LARGE_MIN_NUMEL = 1 << 19\nK = 96\n"
    base_rule = fit_mod.kernels_source_digest({**base, "_cast_multi.py": rule})
    assert fit_mod.kernels_source_digest({**base, "_cast_multi.py": rule.replace(b"1 << 19", b"1 << 18")}) == base_rule
    assert fit_mod.kernels_source_digest({**base, "_cast_multi.py": rule.replace(b"96", b"97")}) != base_rule
    assert fit_mod.kernels_source_digest({**base, "_cast_multi.py": rule.replace(b"LARGE", b"BIG")}) != base_rule
    indented = b"def f():\n    TORCH_MIN_TENSORS = 3\n"  # only module-level assignments
    assert fit_mod._code_text(indented) == indented.rstrip()
    fstr = b'A = 1\nS = f"{A}#kept"  # said\n'  # a '#' inside a string (an f-string: tokenized apart on 3.12) stays
    assert fit_mod._code_text(fstr) == b'A = 1\nS = f"{A}#kept"'
    assert fit_mod._code_text(fstr.replace(b"said", b"unsaid")) == fit_mod._code_text(fstr)
    assert fit_mod._code_text(fstr.replace(b"#kept", b"#gone")) != fit_mod._code_text(fstr)
    broken = b'X = """never closed\n'  # does not tokenize: its bytes are digested as they are
    assert fit_mod._code_text(broken) == broken
    assert fit_mod.kernels_source_digest({**base, "_chunk_cat.py": broken}) != one
    assert fit_mod.kernels_source_digest() == fit_mod.kernels_source_digest(
        {p.name: p.read_bytes() for p in fit_mod.KERNELS_DIR.glob("*.py")})


def test_count_rules_name_the_launchers_constants():
    # A renamed count rule would silently enter the digest again: every listed name is a constant of the kernels.
    from shardfuse.kernels import _cast_multi, _chunk_cat

    for name in fit_mod.COUNT_RULES:
        assert isinstance(getattr(_cast_multi, name, None) or getattr(_chunk_cat, name, None), int), name
