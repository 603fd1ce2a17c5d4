"""Render the stored benchmark results as ``docs/benchmarks.md`` (tables and PNG plots) and a README summary.

    python -m bench.report                            # docs/benchmarks.md + docs/img/*.png from bench/results
    python -m bench.report --results DIR --out FILE --img-dir DIR      # other places (e.g. a scratch copy)
    python -m bench.report --summary                  # print only the README's headline table
    python -m bench.report --readme README.md         # also rewrite the README's headline table
    python -m bench.report --compare NEW.json         # regression check of an e2e/offload file, see bench.regress

Run from the repository root (``python -m`` puts it on ``sys.path``).

Inputs are the JSON files the benchmark runners write through ``bench.common.write_result``, one folder per
GPU architecture: ``bench/results/<gpu>/kernels.json`` (``bench.kernels.run``),
``bench/results/<gpu>/e2e_<N>gpu.json`` (``bench.e2e.run``; ``e2e_hf_<N>gpu.json`` and ``e2e_7b_<N>gpu.json`` for
its other models, named in their rows and sections from the file's ``config.model_kind`` and ``config.model``,
see ``e2e_model``) and ``bench/results/<gpu>/offload.json`` (``bench.offload.run``), read through
``bench.results_io``. Every file carries an ``"env"`` entry (GPU, versions, date, commit) that is printed above
each table. Missing files and keys are tolerated; with no results at all the page says so. ``NOTES.md`` beside
the GPU folders (optional) holds what the files cannot say about where their rows come from; the page shows it
under its summary.

The page opens with the full summary table (every file and regime, ``_readme``) and the provenance of its rows;
the README gets the short headline table (``_headline``: at most ten chosen rows, each with its GPUs, tokens per
GPU, commit and speedup over the best peer of the same job) between the lines ``<!-- results:start -->`` and
``<!-- results:end -->``; a README that has neither marker but a line that is exactly ``RESULTS_TABLE`` gets that
line replaced by the markers and the table, so the next run finds the markers.

Plots need matplotlib (``pip install -e .[plot]``); without it the page is written without them and says
so. Only the standard library is needed otherwise (no torch import), so the report runs anywhere.

Results measured without a GPU (``env.gpu_key`` "cpu", or an e2e file whose ``config.device`` is not "cuda": smoke
runs of the runners, not measurements) are left out of the page and the table.

The package, by section: ``_common`` (names, orders, markdown), ``_models`` (what an e2e file trained),
``_plots``, ``_e2e`` / ``_e2e_common`` / ``_rounds`` (end-to-end files), ``_kernels``, ``_offload``, ``_readme``
(the full summary table and the README's markers), ``_headline`` (the README's table) and ``_page`` (the whole
page); every file is read through the typed
records of ``bench.results_io``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.report._common import REGIME_LABEL, REGIME_ORDER, anchor, ordered, rel
from bench.report._headline import HEADLINES, headline_rows, headline_table
from bench.report._models import E2EModel, e2e_model
from bench.report._page import NOTES_FILE, render
from bench.report._plots import Plotter
from bench.report._readme import END_MARK, PLACEHOLDER, START_MARK, summary_table, update_readme
from bench.report._scale import load_scale
from bench.results_io import DEFAULT_RESULTS, REPO, Result, load_results

# Kept under their former names: tests/test_docs.py computes heading anchors as the page does.
_anchor = anchor
_ordered = ordered

__all__ = [
    "DEFAULT_IMG",
    "DEFAULT_OUT",
    "END_MARK",
    "HEADLINES",
    "PLACEHOLDER",
    "REGIME_LABEL",
    "REGIME_ORDER",
    "START_MARK",
    "E2EModel",
    "Plotter",
    "e2e_model",
    "gpu_results",
    "headline_rows",
    "headline_table",
    "main",
    "parse_args",
    "render",
    "summary_table",
    "update_readme",
]

DEFAULT_OUT = REPO / "docs" / "benchmarks.md"
DEFAULT_IMG = REPO / "docs" / "img"


def gpu_results(results: dict[str, list[Result]]) -> dict[str, list[Result]]:
    """``results`` without the files measured without a GPU (and without folders left empty by that)."""
    kept = {gpu: [r for r in rs if r.is_gpu] for gpu, rs in results.items()}
    return {gpu: rs for gpu, rs in kept.items() if rs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="folder of <gpu>/*.json result files")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the markdown page to write")
    p.add_argument("--img-dir", type=Path, default=None, help="where PNG plots go (default: img/ beside --out)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--readme", type=Path, default=None, help="also rewrite the results table of this README")
    p.add_argument("--summary", action="store_true", help="print the short table only; write nothing")
    p.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="NEW.json",
        help="regression check of an e2e, offload or offload_big NEW.json against the stored result "
        "(python -m bench.regress)",
    )
    p.add_argument("--noise", type=float, default=0.05, help="noise band of --compare (fraction, default 0.05)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare is not None:
        from bench import regress  # only here: the report itself needs none of it

        return regress.main([str(args.compare), "--results", str(args.results), "--noise", str(args.noise)])
    loaded = load_results(args.results)
    results = gpu_results(loaded)
    skipped = sum(len(v) for v in loaded.values()) - sum(len(v) for v in results.values())
    if args.summary:
        print("\n".join(headline_table(results)))
        return 0
    img_dir = args.img_dir if args.img_dir is not None else args.out.parent / "img"
    plots = Plotter(img_dir, enabled=not args.no_plots)
    notes = args.results / NOTES_FILE
    text = render(results, args.out, plots, load_scale(args.results), notes.read_text() if notes.is_file() else None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text if text.endswith("\n") else text + "\n")
    n_files = sum(len(v) for v in results.values())
    print(f"wrote {args.out} ({n_files} result files, {len(results)} GPUs, {len(plots.written)} plots)")
    if skipped:
        print(f"left out {skipped} result file(s) measured without a GPU (smoke runs)")
    if not plots.available and results:
        print(f"plots skipped: {plots.reason}")
    readme_link = rel(args.out, args.readme.parent) if args.readme is not None else "docs/benchmarks.md"
    table_lines = headline_table(results, readme_link)
    if args.readme is not None:
        args.readme.write_text(update_readme(args.readme.read_text(), table_lines))
        print(f"updated the results table of {args.readme}")
    else:
        print("\n".join(table_lines))
    return 0
