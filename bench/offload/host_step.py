"""The host optimizer step of offloaded shards on this machine's CPU: separate passes against the chunked pass.

    python -m bench.offload.host_step [--params 1.0] [--shards 8] [--chunks 524288,2097152,8388608,33554432]
                                      [--rounds 3] [--threads 8,16,31] [--dma] [--pinned] [--spec]
                                      [--out host_step.json]

Per variant and round, one step of torch's fused AdamW over ``--params`` billion fp32 parameters in ``--shards``
flat shards, as OffloadOptimizer steps a host shard:
- ``separate``: clipping's scale (``_foreach_mul_``), ``optimizer.step()``, then the bf16 compute copy, each a pass
  over the whole shard (the path before the chunked one);
- ``chunk=C``: ``_host_fused.step_in_chunks`` with C elements per chunk (the three in one cache-sized pass); in
  ``plain`` it runs one kernel call per shard whatever C (no pass shares the cache), so those rows time that path.
- ``spec chunk=C`` (with ``--spec``, ``plain`` setting only): the speculative out-of-place update of
  ``OffloadOptimizer(speculative_clip=True)`` (``_speculative.update_out_of_place``): per C-element chunk the
  originals' chunk (parameters, moments) is copied into spare buffers, then the fused kernel updates the spares;
  the originals stay untouched. Beside it, ``chunk=C`` in ``plain`` is the in-place update it is compared with.
Each in the settings ``--settings`` names: ``clip+copy`` (scale and compute copy), ``clip`` (the scale alone: the
clipped step of ``OffloadOptimizer`` without ``host_compute_copy``) and ``plain`` (neither: step_in_backward without
the host compute copy). Under ``clip`` one more variant, ``kernel-scale``: the fused kernel's own ``grad_scale``
argument divides each gradient by ``1 / coef`` inside the update (one pass, whole shard): not the bits of clipping's
multiply: ``OffloadOptimizer(clip_in_update=True)``'s update. Rounds interleave the variants; medians and ranges
are printed with ms per billion parameters and the host-memory bandwidth each implies (bytes the passes must move /
time). CPU only: no GPU needed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import threading
import time
from typing import Any

import torch

from bench.common import env_info
from shardfuse._torch_private import call_fused_adam, foreach_add_, fused_adam_kernels
from shardfuse.sharding.host import _host_fused, _speculative
from shardfuse.sharding.host._host_shard import host_buffer
from shardfuse.sharding.host._host_tiles import TilePool


def _shards(params: float, shards: int, pinned: bool = False) -> list[tuple[torch.Tensor, torch.optim.Optimizer,
                                                                            torch.Tensor]]:
    """``pinned``: the parameters and gradients page-locked as OffloadOptimizer keeps them (the shard through
    ``pin_memory()``, the gradient buffer registered with the driver); the optimizer state stays pageable."""
    per = int(params * 1e9 / shards) // _host_fused.ALIGN * _host_fused.ALIGN
    out = []
    for _ in range(shards):
        p = torch.empty(per).normal_(0, 0.02)
        if pinned:
            p = p.pin_memory()
        p.grad = host_buffer(per, torch.float32, pinned).normal_(0, 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True)
        opt.step()  # the state exists, as after an offloaded run's first step
        out.append((p, opt, torch.empty(per, dtype=torch.bfloat16)))
    return out


def _separate(shards: list, clip: bool, copy: bool) -> None:
    coef = torch.tensor(0.5)
    for p, opt, buf in shards:
        if clip:
            torch._foreach_mul_([p.grad], coef)
        opt.step()
        if copy:
            buf.copy_(p)


def _kernel_scale(shards: list) -> None:
    """The fused kernel divides each gradient by ``grad_scale`` (= 1 / coef) itself: one call per shard."""
    kernels = fused_adam_kernels()
    inverse = torch.tensor(2.0)  # 1 / 0.5, the coefficient the other variants multiply by
    for p, opt, _ in shards:
        settings = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        group = _host_fused._group_of(opt, [p], settings)
        if kernels is None or group is None:
            raise RuntimeError("kernel-scale needs torch's private fused Adam kernel and a fused AdamW with state")
        foreach_add_(group.steps, 1)
        with torch.no_grad():
            call_fused_adam(kernels[1] if group.decoupled else kernels[0], group.params, group.grads,
                            group.exp_avgs, group.exp_avg_sqs, [], group.steps, dict(group.kwargs, grad_scale=inverse))


def _chunked(shards: list, clip: bool, copy: bool, chunk: int) -> None:
    coef = torch.tensor(0.5)
    for p, opt, buf in shards:
        settings = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        if not _host_fused.step_in_chunks([(opt, [p], settings)], coef if clip else None, p,
                                          buf if copy else None, chunk):
            raise RuntimeError("the chunked path refused a fused AdamW with state")


def _tiled(shards: list, clip: bool, copy: bool, tile: int, pool: TilePool) -> None:
    """``step_in_chunks`` on a TilePool: the chunks as tiles of ``tile`` elements, each on one core."""
    coef = torch.tensor(0.5)
    for p, opt, buf in shards:
        settings = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        if not _host_fused.step_in_chunks([(opt, [p], settings)], coef if clip else None, p,
                                          buf if copy else None, tile, pool=pool):
            raise RuntimeError("the tiled path refused a fused AdamW with state")


_SCRATCH = threading.local()


def _tiled_scratch(shards: list, copy: bool, tile: int, pool: TilePool) -> None:
    """As :func:`_tiled` with clipping, the scaled gradient written to a per-thread scratch tile (hot in that core's
    cache) instead of back into the gradient: the update reads the scratch; the gradient stays unscaled."""
    coef = torch.tensor(0.5)
    kernels = fused_adam_kernels()
    assert kernels is not None
    items = []
    for p, opt, buf in shards:
        settings = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        group = _host_fused._group_of(opt, [p], settings)
        assert group is not None
        foreach_add_(group.steps, 1)

        def one(a: int, b: int, group: Any = group, buf: torch.Tensor = buf) -> None:
            scratch = getattr(_SCRATCH, "buf", None)
            if scratch is None or scratch.numel() < tile:
                scratch = _SCRATCH.buf = torch.empty(tile)
            g = torch.mul(group.grads[0].view(-1)[a:b], coef, out=scratch[:b - a])
            call_fused_adam(kernels[1], [group.params[0].view(-1)[a:b]], [g], [group.exp_avgs[0].view(-1)[a:b]],
                            [group.exp_avg_sqs[0].view(-1)[a:b]], [], group.steps, group.kwargs)
            if copy:
                buf[a:b].copy_(group.params[0].view(-1)[a:b])

        items += [functools.partial(one, a, b) for a, b in _host_fused._pieces(p.numel(), tile)]
    with torch.no_grad():
        pool.run(items)


Spare = dict[str, torch.Tensor]  # the out-of-place update's buffers of one shard: param, exp_avg, exp_avg_sq, step


def _spares(shards: list, pinned: bool) -> list[Spare]:
    """Per shard, spare buffers as the speculation keeps them: the parameter's pinned like the shard's, the
    moments' like the optimizer state (pageable), the step a copy."""
    out = []
    for p, opt, _ in shards:
        state = opt.state[p]
        out.append({"param": host_buffer(p.numel(), p.dtype, pinned).view(p.shape),
                    "exp_avg": torch.empty_like(state["exp_avg"]), "exp_avg_sq": torch.empty_like(state["exp_avg_sq"]),
                    "step": state["step"].clone()})
    return out


def _speculative_update(shards: list, spares: list[Spare], chunk: int) -> None:
    """The speculative update of every shard into its spares (the originals only read), per ``chunk`` elements."""
    kernels = fused_adam_kernels()
    for (p, opt, _), spare in zip(shards, spares):
        settings = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        group = _host_fused._group_of(opt, [p], settings)
        if kernels is None or group is None:
            raise RuntimeError("the speculative path refused a fused AdamW with state (torch's private fused kernel "
                               "is missing, or the optimizer is not fused)")
        spare["step"].copy_(group.steps[0])
        target = _host_fused._Group([spare["param"]], group.grads, [spare["exp_avg"]], [spare["exp_avg_sq"]], [],
                                    [spare["step"]], group.kwargs, group.decoupled)
        foreach_add_(target.steps, 1)
        with torch.no_grad():
            _speculative.update_out_of_place(target, 0, kernels[1] if group.decoupled else kernels[0],
                                             [p, group.exp_avgs[0], group.exp_avg_sqs[0]],
                                             [spare["param"], spare["exp_avg"], spare["exp_avg_sq"]], chunk=chunk)


def _bytes_per_param(clip: bool, copy: bool, chunked: bool, spec: bool = False, kernel_scale: bool = False,
                     scratch: bool = False) -> int:
    """Host-memory bytes per parameter the passes must move: the update's 28, and when separate the scale's 8 and
    the copy's 4+2; chunked, the scaled gradient is written back once (4) and the copy writes 2. Out of place
    (``spec``): the copy of the parameter and both moments (read 12, write 12) and the update's 28 (as if each
    copied chunk left the cache before the kernel read it: an upper bound of the traffic)."""
    if spec:
        return 24 + 28
    if kernel_scale:  # the kernel reads the gradient and writes the divided one back
        return 32
    if scratch:  # the scaled gradient stays in the core's cache: the update's bytes and the copy's
        return 28 + (2 if copy else 0)
    if chunked:
        return 28 + (4 if clip else 0) + (2 if copy else 0)
    return 28 + (8 if clip else 0) + (6 if copy else 0)


Variant = tuple[str, bool, bool, "int | None", int, bool]  # (name, clip, copy, chunk or None, threads, dma)


class _CopyLoad:
    """Pinned host<->device copies of 1 GiB each way, run back to back on a side thread while active."""

    def __init__(self) -> None:
        n = 1 << 28  # fp32 elements: 1 GiB
        self.host_src = torch.empty(n, pin_memory=True).fill_(1.0)
        self.host_dst = torch.empty(n, pin_memory=True)
        self.dev_src = torch.ones(n, device="cuda")
        self.dev_dst = torch.empty(n, device="cuda")
        self.h2d, self.d2h = torch.cuda.Stream(), torch.cuda.Stream()
        self.bytes, self.seconds = 0, 0.0
        self._on = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        start = time.perf_counter()
        while self._on.is_set():
            with torch.cuda.stream(self.h2d):
                self.dev_dst.copy_(self.host_src, non_blocking=True)
            with torch.cuda.stream(self.d2h):
                self.host_dst.copy_(self.dev_src, non_blocking=True)
            self.h2d.synchronize()
            self.d2h.synchronize()
            self.bytes += 2 * self.host_src.numel() * 4
        self.seconds += time.perf_counter() - start

    def __enter__(self) -> _CopyLoad:
        self._on.set()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._on.clear()
        if self._thread is not None:
            self._thread.join()

    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def _measure(shards: list, variants: list[Variant], rounds: int, load: _CopyLoad | None,
             spares: list[Spare] | None = None, pool: TilePool | None = None) -> dict[Variant, list[float]]:
    """Seconds per step of each variant, rounds interleaving the variants (``spares``: for the ``spec`` ones)."""
    times: dict[Variant, list[float]] = {}
    for _ in range(rounds):
        for v in variants:
            name, clip, copy, chunk, threads, dma = v
            torch.set_num_threads(threads)
            with load if dma and load is not None else contextlib.nullcontext():
                start = time.perf_counter()
                if name == "kernel-scale":
                    _kernel_scale(shards)
                elif name.startswith("tiles"):
                    assert pool is not None and chunk is not None
                    if name.startswith("tiles-scratch"):
                        _tiled_scratch(shards, copy, chunk, pool)
                    else:
                        _tiled(shards, clip, copy, chunk, pool)
                elif chunk is None:
                    _separate(shards, clip, copy)
                elif name.startswith("spec"):
                    assert spares is not None
                    _speculative_update(shards, spares, chunk)
                else:
                    _chunked(shards, clip, copy, chunk)
                times.setdefault(v, []).append(time.perf_counter() - start)
    return times


def _report(times: dict[Variant, list[float]], n: int) -> list[dict[str, Any]]:
    rows = []
    print(f"{'setting':10} {'variant':16} {'threads':>7} {'copies':>6} {'ms/B params':>12} {'range':>15} {'GB/s':>7}")
    for (name, clip, copy, _, threads, dma), ts in times.items():
        med = statistics.median(ts) * 1e9 / n
        moved = _bytes_per_param(clip, copy, name != "separate", name.startswith("spec"), name == "kernel-scale",
                                 name.startswith("tiles-scratch")) * n
        gbps = moved / statistics.median(ts) / 1e9
        setting = ("clip+copy" if copy else "clip") if clip else "plain"
        lo, hi = min(ts) * 1e12 / n, max(ts) * 1e12 / n
        print(f"{setting:10} {name:16} {threads:7d} {'yes' if dma else 'no':>6} {med * 1e3:12.0f} "
              f"{lo:7.0f}-{hi:<7.0f} {gbps:7.1f}")
        rows.append({"setting": setting, "variant": name, "threads": threads, "with_copies": dma,
                     "ms_per_billion": med * 1e3, "runs_s": ts, "host_gbps": gbps})
    return rows


SETTINGS = {"clip+copy": (True, True), "clip": (True, False), "plain": (False, False)}  # (clip, copy)


def _variants(counts: list[int], chunks: list[int], dma: bool, spec: bool,
              settings: tuple[str, ...] = ("clip+copy", "plain"), tiles: tuple[int, ...] = ()) -> list[Variant]:
    variants: list[Variant] = []
    for copies in (False, True) if dma else (False,):
        for setting in settings:
            clip, copy = SETTINGS[setting]
            variants += [("separate", clip, copy, None, t, copies) for t in counts]
            variants += [(f"chunk={c}", clip, copy, c, counts[0], copies) for c in chunks]
            variants += [(f"tiles={c}", clip, copy, c, counts[0], copies) for c in tiles]
            if clip:
                variants += [(f"tiles-scratch={c}", clip, copy, c, counts[0], copies) for c in tiles]
            if setting == "clip":
                variants.append(("kernel-scale", True, False, None, counts[0], copies))
        if spec:  # the speculation neither clips (the norm is not known yet) nor, here, writes a compute copy
            variants += [(f"spec chunk={c}", False, False, c, counts[0], copies) for c in chunks]
    return variants


def _spec_summary(rows: list[dict[str, Any]], dma: bool) -> int | None:
    """Print the out-of-place update against the in-place one per chunk; returns the fastest out-of-place chunk
    (beside the copies where they ran, as in training)."""
    plain = {(r["variant"], r["with_copies"]): r["ms_per_billion"] for r in rows if r["setting"] == "plain"}
    best: tuple[float, int] | None = None
    for (variant, copies), ms in plain.items():
        if not variant.startswith("spec "):
            continue
        chunk = int(variant.split("=")[1])
        in_place = plain.get((f"chunk={chunk}", copies))
        ratio = f", {ms / in_place:.2f}x the in-place update ({in_place:.0f} ms)" if in_place else ""
        print(f"out of place, chunk {chunk}{' beside copies' if copies else ''}: {ms:.0f} ms per billion{ratio}")
        if copies == dma and (best is None or ms < best[0]):
            best = (ms, chunk)
    if best is not None:
        print(f"fastest out-of-place chunk: {best[1]} elements")
    return None if best is None else best[1]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1.0, help="billions of fp32 parameters")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--chunks", default="524288,2097152,8388608,33554432")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="", help="intra-op thread counts, comma-separated (default: the cores "
                    "less one, OffloadOptimizer's default); the chunk variants run at the first count only")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "host_step.json"))
    ap.add_argument("--dma", action="store_true", help="also run every variant under pinned host<->device copies "
                    "(needs a GPU)")
    ap.add_argument("--pinned", action="store_true", help="parameters and gradients page-locked, as OffloadOptimizer "
                    "keeps them (needs a GPU)")
    ap.add_argument("--spec", action="store_true", help="also the speculative out-of-place update per chunk "
                    "(copy into spare buffers, then update there), beside the in-place one")
    ap.add_argument("--tiles", default="", help="also run the update as tiles of these many elements on a "
                    "TilePool of the first thread count (comma-separated; clipped settings add tiles-scratch)")
    ap.add_argument("--settings", default="clip+copy,plain",
                    help=f"comma-separated, of {', '.join(SETTINGS)} (``clip`` adds the kernel-scale variant)")
    args = ap.parse_args(argv)
    settings = tuple(x for x in args.settings.split(",") if x)
    unknown = [x for x in settings if x not in SETTINGS]
    if unknown or not settings:
        raise SystemExit(f"--settings {args.settings!r}: unknown {unknown or 'empty'}; choose from "
                         f"{', '.join(SETTINGS)}")
    if args.pinned and not torch.cuda.is_available():
        raise SystemExit("--pinned page-locks host memory through CUDA: it needs a CUDA device, none is visible")
    if args.dma and not torch.cuda.is_available():
        raise SystemExit("--dma runs host<->device copies beside the update: it needs a CUDA device, none is visible")
    load = _CopyLoad() if args.dma else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    counts = [int(t) for t in args.threads.split(",") if t] or [max(1, cores - 1)]
    torch.set_num_threads(counts[0])
    shards = _shards(args.params, args.shards, args.pinned)
    n = sum(p.numel() for p, _, _ in shards)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    spares = _spares(shards, args.pinned) if args.spec else None
    tiles = tuple(int(c) for c in args.tiles.split(",") if c)
    pool = TilePool(counts[0]) if tiles else None
    try:
        times = _measure(shards, _variants(counts, chunks, args.dma, args.spec, settings, tiles), args.rounds, load,
                         spares, pool)
    finally:
        if pool is not None:
            pool.close()
    print(f"host step: {n / 1e9:.2f}B fp32 params in {len(shards)} shards ({'pinned' if args.pinned else 'pageable'}), "
          f"{cores} cores, torch {torch.__version__}")
    rows = _report(times, n)
    result = {"kind": "host_step", "env": env_info(), "params": n, "threads": counts, "cores": cores,
              "torch": torch.__version__, "rows": rows, "pinned": args.pinned}
    if args.spec:
        result["spec_fastest_chunk"] = _spec_summary(rows, args.dma)
    if load is not None:
        print(f"copies beside the update: {load.gbps():.1f} GB/s (host->device + device->host, 1 GiB pinned each)")
        result["copies_gbps"] = load.gbps()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
