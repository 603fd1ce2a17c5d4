"""The README's headline table: at most ten chosen results, each against the best peer measured in the same job.

The full table (every file, every regime) is the benchmarks page's summary (``_readme.summary_table``). Here
each row is one entry of ``HEADLINES``: a stored file (GPU folder and name), what in it to show, and which other
implementations ran in the same job as that row. A row gives the GPUs, the tokens (or samples) per GPU and step,
shardfuse's number, the best of those peers, shardfuse's speedup over it (above 1.00x: shardfuse is faster) and
the commit and host (CPU cores) the row was measured on. An entry whose file or row is not stored is left out, so
the table shrinks rather than fails when results are replaced.

"Same job" is what a ratio may compare: an e2e file runs every implementation one after another in one job; an
offload file too, except variants carried over from another run (they carry their own ``commit``); the rows of a
merged ``offload_big`` file come from separate calls, so each entry names the peers of its own call (from the
run's log under ``bench/results/logs/``), and a peer row of another commit is never used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.report._common import CAPTURED, DASH, IMPL_SHORT, table
from bench.results_io import Result

MAX_ROWS = 10
HEADER = ["GPUs", "setup", "tokens/GPU/step", "shardfuse", "best peer, same job", "speedup", "commit, host"]
ALIGN = ["l", "l", "r", "r", "r", "r", "l"]
NO_PEER = "none in the same job"
E2E_PEERS = ("fairscale", "fsdp2", "fsdp1")
OFFLOAD_PEERS = {"fairscale": "FairScale OffloadModel", "fsdp2_cpu_offload": "FSDP2 CPUOffloadPolicy"}
OFFLOAD_BIG_PEERS = {
    "fairscale": "FairScale", "fsdp2": "FSDP2 CPUOffloadPolicy",
    "deepspeed-zero2": "DeepSpeed ZeRO-2", "deepspeed-zero3": "DeepSpeed ZeRO-3",
}  # fmt: skip


@dataclass(frozen=True)
class Cells:
    """What a headline row shows, before formatting (times in ms or throughputs, as ``higher_is_better`` says)."""

    gpus: str
    tokens: str
    ours: float
    unit: str  # "tok/s/GPU" or "ms/step"
    higher_is_better: bool
    peer: tuple[str, float] | None  # (name, value) of the best peer in the same job
    commit: str | None
    host_cores: int | None = None  # the measuring host's CPU cores (hosts differ, e.g. in host optimizer speed)


@dataclass(frozen=True)
class Headline:
    gpu: str  # folder under bench/results/
    file: str  # the file's name without .json
    setup: str  # the row's "setup" text
    pick: Callable[[Result], Cells | None]


def _gpus(res: Result, n: int | None) -> str:
    return f"{n or '?'}x {res.gpu.upper()}"


def _file_cores(res: Result) -> int | None:
    """The CPU cores of the host a result file was measured on, where it recorded them."""
    host = res.data.get("host")
    cores = host.get("cpu_count") if isinstance(host, dict) else None
    return cores if isinstance(cores, int) and cores > 0 else None


def e2e(regime: str, impl: str = "shardfuse") -> Callable[[Result], Cells | None]:
    """``impl``'s tokens/s/GPU in ``regime`` (medians over rounds where the file has them) against the best of
    FairScale, FSDP2 and FSDP1 in the same file."""

    def pick(res: Result) -> Cells | None:
        f = res.e2e()
        summary = [e for e in f.summary if e.regime == regime]
        tok = ({e.impl: e.tok_s_gpu_median for e in summary} if summary
               else {r.impl: r.tok_s_gpu for r in f.rows if r.regime == regime})  # fmt: skip
        ours = tok.get(impl)
        if ours is None:
            return None
        shape = next((r for r in f.rows if r.regime == regime and r.batch and r.seq), None)
        peers = [(IMPL_SHORT.get(p, p), v) for p in E2E_PEERS if (v := tok.get(p))]
        best = max(peers, key=lambda x: x[1], default=None)
        tokens = f"{shape.batch * shape.seq:,}" if shape and shape.batch and shape.seq else DASH
        return Cells(_gpus(res, f.config.world_size), tokens, ours, "tok/s/GPU", True, best, res.env.commit,
                     _file_cores(res))

    return pick


def offload(variant: str) -> Callable[[Result], Cells | None]:
    """An ``OffloadModel`` variant's step time against FairScale's and FSDP2's offload, where measured in the same
    job (not carried over from another commit)."""

    def pick(res: Result) -> Cells | None:
        f = res.offload()
        v = f.variants.get(variant)
        if v is None or v.step_ms is None:
            return None
        commit = v.commit or res.env.commit
        peers = [(name, p.step_ms) for key, name in OFFLOAD_PEERS.items()
                 if (p := f.variants.get(key)) and p.step_ms and (p.commit or res.env.commit) == commit]  # fmt: skip
        best = min(peers, key=lambda x: x[1], default=None)
        samples = f"{f.config.batch:,} samples" if f.config.batch else DASH
        return Cells(_gpus(res, 1), samples, v.step_ms, "ms/step", False, best, commit, _file_cores(res))

    return pick


def offload_big(config: str, impl: str, peers: Sequence[str] = ()) -> Callable[[Result], Cells | None]:
    """An ``offload_big`` row (plain, no variant) against the best of ``peers``: the implementations its own call
    measured (a merged file joins calls); rows of another commit are never compared."""

    def pick(res: Result) -> Cells | None:
        f = res.offload_big()
        row = f.find(config, impl)
        if row is None or row.step_ms is None:
            return None
        commit = row.commit or res.env.commit
        found = [(OFFLOAD_BIG_PEERS.get(p, p), r.step_ms) for p in peers
                 if (r := f.find(config, p)) and r.step_ms and (r.commit or res.env.commit) == commit]  # fmt: skip
        best = min(found, key=lambda x: x[1], default=None)
        tokens = f"{row.tokens_per_step:,}" if row.tokens_per_step else DASH
        return Cells(_gpus(res, 1), tokens, row.step_ms, "ms/step", False, best, commit,
                     row.host_cores or _file_cores(res))

    return pick


# The decoder (953M) and 7B rows use the Llama-style decoder of bench/e2e; the 1.07B MLP is bench.offload.run's model.
HEADLINES = (
    Headline("h200", "e2e_2gpu", "training, 953M decoder, sharded", e2e("8k")),
    Headline("h200", "e2e_2gpu", "training, 953M decoder, sharded, small batch", e2e("1k")),
    Headline("h200", "e2e_2gpu", "training, 953M decoder, small batch, `capture_step`", e2e("1k", CAPTURED)),
    Headline("h200", "e2e_hf_2gpu", "training, HF LlamaForCausalLM 853M, `capture_step`", e2e("1k", CAPTURED)),
    Headline("h200", "e2e_7b_fused_2gpu", "training, 6.7B decoder (Llama-2-7B shape), fused AdamW", e2e("4k")),
    Headline("h200", "e2e_4gpu", "training, 953M decoder, 4 GPUs", e2e("8k")),
    Headline("h100", "offload", "`OffloadModel`, 1.07B MLP, activations on the host, optimizer in backward",
             offload("shardfuse_offload_acts_opt_in_bwd")),
    # bench/results/logs/h200x2-offload-big-4k-deepspeed-3be0589.log: shardfuse and both DeepSpeed stages, one call
    Headline("h200", "offload_big", "`OffloadOptimizer`, 2.9B decoder on one GPU, full offload",
             offload_big("2.9b-4k", "shardfuse", ("deepspeed-zero2", "deepspeed-zero3"))),
    # its call measured shardfuse alone (FairScale, FSDP2 and DeepSpeed ran in other calls: see the page)
    Headline("h100", "offload_big", "`OffloadOptimizer` with a 40 GiB GPU budget, 2.9B decoder on one GPU",
             offload_big("2.9b-4k", "shardfuse-budget")),
    Headline("h200", "offload_big", "SSD tier (`OffloadConfig`), 6.7B decoder on one GPU, 39 GiB host RSS",
             offload_big("6.7b-2k", "shardfuse-ssd")),
)
assert len(HEADLINES) <= MAX_ROWS, "the README shows at most MAX_ROWS headline results"


def _row(h: Headline, c: Cells) -> list[str]:
    spec = ",.0f" if c.ours >= 100 else ",.1f"
    ours = f"{format(c.ours, spec)} {c.unit}"
    where = (f"`{c.commit}`" if c.commit else DASH) + (f", {c.host_cores} cores" if c.host_cores else "")
    if c.peer is None:
        return [c.gpus, h.setup, c.tokens, ours, NO_PEER, DASH, where]
    name, value = c.peer
    speedup = c.ours / value if c.higher_is_better else value / c.ours
    peer = f"{name} {format(value, ',.0f' if value >= 100 else ',.1f')}"
    return [c.gpus, h.setup, c.tokens, ours, peer, f"{speedup:.2f}x", where]


def headline_rows(results: dict[str, list[Result]]) -> list[list[str]]:
    """The rows of ``HEADLINES`` whose file and row are stored, in ``HEADLINES`` order."""
    files = {(gpu, r.name): r for gpu, rs in results.items() for r in rs}
    rows = []
    for h in HEADLINES:
        res = files.get((h.gpu, h.file))
        cells = h.pick(res) if res is not None else None
        if cells is not None:
            rows.append(_row(h, cells))
    return rows


def headline_table(results: dict[str, list[Result]], link: str = "docs/benchmarks.md") -> list[str]:
    """The README's results block: the headline rows, what the columns mean, and where the rest is."""
    rows = headline_rows(results)
    if not rows:
        return [f"No benchmark results are stored yet (see [{link.rsplit('/', 1)[-1]}]({link}) for how to make them)."]
    return [
        *table(HEADER, rows, ALIGN),
        "",
        "Speedup: the best peer's step time over shardfuse's (above 1.00x: shardfuse is faster), both from the same "
        f'job on the same machine; "{NO_PEER}": no other implementation ran in that call. Training: tokens/s per '
        "GPU (medians over interleaved rounds where the job ran several), peers FairScale, FSDP2 and FSDP1. "
        f"Offload: one GPU, step time. Every number is from `bench/results/`; all results, environments, spreads "
        f"and provenance notes: [benchmarks]({link}).",
    ]
