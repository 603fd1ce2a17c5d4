"""``OffloadOptimizer(speculative_clip=True)`` against the non-speculative clipped path, in a 2-process gloo group.

The
reference is the same wrapped model stepped by ``OffloadOptimizer(speculative_clip=False)`` with the same clip calls:
losses, clip norms, parameters, optimizer state and the gradients left must be equal BIT FOR BIT (NaNs compared by
their bits) over several steps, where the verdict commits (a max norm above the gradient norm, or no clip call),
redoes (a tiny max norm, a non-finite norm, an inf-norm clip that scales the gradients in place) or both in turn; for
fused (chunked) and non-fused AdamW (with ``clip_in_update`` too), Adam with amsgrad, SGD with momentum,
``use_orig_params`` with frozen parameters (gaps in the spare shard), a spare budget that fits only some units,
``no_sync``, ``reshard_after_forward=False`` (a kept full buffer must be gathered again after a commit), bf16 with the
host compute copy (its spare is swapped too), an LR scheduler. Before every backward every spare buffer is poisoned
with NaN, so a commit that swaps in anything the speculation did not write fails the comparison.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardfuse import OffloadOptimizer
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.host import _host_fused, _speculative
from shardfuse.sharding.host._speculative import SpecState
from tests.sharding._models import batch, build, fsdp_kwargs, loss_fn

WORLD = 2
BIG, TINY = 1e6, 1e-3  # max norms: clipping never fires / always fires


def _wrap(cfg: dict[str, Any]) -> FSDP:
    model = build(cfg)
    kw = {**fsdp_kwargs(cfg), "move_params_to_cpu": True, "use_orig_params": bool(cfg.get("orig"))}
    for i in range(len(model.blocks)):
        model.blocks[i] = FSDP(model.blocks[i], **kw)
    if model.extra is not None:
        model.extra = FSDP(model.extra, **kw)
    return FSDP(model, **kw)


def _optimizer(cfg: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    kind = cfg.get("optim", "adamw-fused")
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=kind == "adamw-fused")


def poison_spares(opt: OffloadOptimizer) -> int:
    """Fill every spare buffer with NaN (what a commit swaps in must have been written by the speculation)."""
    spec = opt._spec
    if spec is None:
        return 0
    count = 0
    for rec in spec._records.values():
        spare = rec.spare
        for t in [spare.flat, spare.compute, *(t for e in spare.state.values() for t in e.values())]:
            if t is not None and t.is_floating_point():
                t.fill_(float("nan"))
                count += 1
    return count


def _losses(model: FSDP, opt: Any, cfg: dict[str, Any], step: int) -> list[float]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    out = []
    micro = cfg.get("no_sync_micro", 1)
    for m in range(micro):
        with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
            ids, target = batch(step * micro + m, rank, ws)
            if step in cfg.get("inf_at", ()) and rank == 0 and m == micro - 1:
                target = target.clone()
                target[0, 0, 0] = float("inf")  # an inf loss: non-finite gradients, a NaN global norm
            loss = loss_fn(model, ids, target, step, cfg)
            loss.backward()
            out.append(loss.item())
    return out


def run(cfg: dict[str, Any], speculative: bool) -> tuple[FSDP, Any, list[float]]:
    """Train ``len(cfg['norms'])`` steps; ``norms[i]`` is step i's max norm (None: no clip call)."""
    chunk, spec_chunk = _host_fused.CHUNK_ELEMENTS, _speculative.SPEC_CHUNK_ELEMENTS
    _host_fused.CHUNK_ELEMENTS = _speculative.SPEC_CHUNK_ELEMENTS = cfg.get("host_chunk", chunk)
    try:
        model = _wrap(cfg)
        opt = OffloadOptimizer(model, _optimizer(cfg, model.parameters()), gpu_budget_gib=cfg.get("gpu_budget", 0),
                               accumulate_on_gpu=cfg.get("accumulate_on_gpu", False),
                               host_compute_copy=cfg.get("host_compute_copy", False), speculative_clip=speculative,
                               speculative_clip_gib=cfg.get("spare_gib"),
                               clip_in_update=cfg.get("clip_in_update", False),
                               **({"speculative_backoff": cfg["backoff"]} if "backoff" in cfg else {}))
        if cfg.get("freeze"):  # frozen after wrapping: a view without gradient in a trained shard (a gap)
            for name, p in model.named_parameters():
                if any(part in name for part in cfg["freeze"]):
                    p.requires_grad_(False)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7) if cfg.get("scheduler") else None
        losses: list[float] = []
        for step, max_norm in enumerate(cfg["norms"]):
            poison_spares(opt)
            losses += _losses(model, opt, cfg, step)
            if cfg.get("lr_between") and step % 2:  # after the speculation read the settings, before step()
                opt.param_groups[0]["lr"] *= 0.5
            if max_norm is not None:
                total = model.clip_grad_norm_(max_norm, cfg.get("norm_type", 2.0)).item()
                losses.append(total)
                if step in cfg.get("clip_again", {}):  # a second clip at a fraction of the norm the first returned
                    losses.append(model.clip_grad_norm_(total * cfg["clip_again"][step]).item())
                if step in cfg.get("read_at", ()):  # the clipped gradients read before step()
                    opt.apply_pending_clip()
                    losses.append(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()
                                      if p.grad is not None))
            if step in cfg.get("skip_at", ()):  # the loop drops this step (e.g. a non-finite norm): no verdict
                opt.zero_grad()
                continue
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
        opt.synchronize()
    finally:
        _host_fused.CHUNK_ELEMENTS, _speculative.SPEC_CHUNK_ELEMENTS = chunk, spec_chunk
    return model, opt, losses


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` (NaNs compare equal where their bits are)."""
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_identical(cfg: dict[str, Any], a: tuple[FSDP, Any, list[float]], b: tuple[FSDP, Any, list[float]]):
    (model, opt, losses), (ref, ref_opt, ref_losses) = a, b
    same = [x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(losses, ref_losses)]
    assert len(losses) == len(ref_losses) and all(same), f"losses/norms differ: {losses} vs {ref_losses}"
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for k in ref_sd:
        assert torch.equal(_bits(sd[k]), _bits(ref_sd[k])), f"{k} differs: {sd[k]} vs {ref_sd[k]}"
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        assert got[i].keys() == want[i].keys()
        for key, value in want[i].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(_bits(got[i][key]), _bits(value)), f"optimizer state {i}.{key} differs"
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(_bits(p.grad), _bits(q.grad)), "gradients left after the last step differ"


def check_same_as_clipped(cfg: dict[str, Any]) -> dict[str, float]:
    spec = run(cfg, speculative=True)
    ref = run(cfg, speculative=False)
    assert_bit_identical(cfg, spec, ref)
    stats = spec[1].host_stats()
    spec[1].close()
    ref[1].close()
    return stats


STEPS = 5
# "backoff": OffloadOptimizer's speculative_backoff (unset: the library's default, DEFAULT_BACKOFF; None: never).
DEFAULT_BACKOFF = 3
CASES: dict[str, dict[str, Any]] = {
    "commit-fused": dict(norms=[BIG] * STEPS, host_chunk=4096),
    "redo-fused": dict(norms=[TINY] * STEPS, host_chunk=4096),
    "mixed-fused": dict(norms=[BIG, TINY, None, BIG, TINY], host_chunk=4096),
    "mixed-adamw": dict(norms=[BIG, TINY, BIG, None, TINY], optim="adamw"),
    "mixed-adam-amsgrad": dict(norms=[TINY, BIG, BIG, TINY, None], optim="adam"),
    "mixed-sgd": dict(norms=[BIG, TINY, None, TINY, BIG], optim="sgd"),
    "orig-params-frozen-mixed-fused": dict(norms=[BIG, TINY, BIG, TINY, BIG], orig=True, frozen=True,
                                           host_chunk=4096),
    "orig-params-mixed-adamw": dict(norms=[TINY, BIG, BIG, TINY, BIG], orig=True, optim="adamw"),
    "orig-params-frozen-after-wrap": dict(norms=[BIG, BIG, TINY, BIG], orig=True, freeze=("fc1.weight", "proj"),
                                          host_chunk=4096),
    "orig-params-frozen-after-wrap-sgd": dict(norms=[BIG, BIG, TINY, BIG], orig=True, freeze=("fc2.bias", "head"),
                                              optim="sgd"),
    "nonfinite-fused": dict(norms=[BIG, BIG, BIG, BIG], inf_at=(2,), host_chunk=4096),
    "nonfinite-sgd": dict(norms=[BIG, BIG, TINY], inf_at=(1,), optim="sgd"),
    "inf-norm-type": dict(norms=[BIG, TINY, BIG, BIG], norm_type=float("inf")),
    "no-clip": dict(norms=[None] * 4),
    "no-sync-accumulate-on-gpu": dict(norms=[BIG, TINY, BIG, BIG], no_sync_micro=2, accumulate_on_gpu=True),
    "no-reshard": dict(norms=[BIG, BIG, TINY, BIG], reshard_after_forward=False),
    "unused-unit": dict(norms=[BIG, TINY, BIG, BIG, TINY], extra=True),
    "tied": dict(norms=[BIG, TINY, BIG, BIG], tied=True),
    "scheduler": dict(norms=[BIG, BIG, TINY, BIG], scheduler=True),
    "lr-changed-before-step": dict(norms=[BIG, BIG, BIG, BIG], lr_between=True),
    # A coefficient just under 1 (a second clip at 0.995 the norm) redoes; at 1.5 the norm, 1 exactly, commits.
    "clip-again-just-under": dict(norms=[BIG, BIG, BIG, BIG], clip_again={1: 0.995, 2: 1.5}, host_chunk=4096),
    # The gradients scaled in place for a reader: the speculation read them unscaled, so it is computed again.
    # A step dropped after the clip: its speculations are never committed, the next step's start afresh.
    "step-skipped-after-clip": dict(norms=[BIG, TINY, BIG, BIG, TINY], skip_at=(1, 2), host_chunk=4096),
    "clipped-gradients-read": dict(norms=[BIG, TINY, BIG, TINY], read_at=(0, 1), host_chunk=4096),
    # Speculation pauses after 2 redone steps, stays paused while clipping fires, and resumes the step after one
    # whose norm is under the clip (that one updates after the norm, unspeculated); the library's default of 3.
    "backoff-pauses-and-resumes": dict(norms=[TINY, TINY, TINY, TINY, BIG, BIG, BIG], backoff=2, host_chunk=4096),
    "backoff-default": dict(norms=[TINY, TINY, TINY, TINY, BIG, TINY, BIG], optim="adamw"),
    "backoff-never": dict(norms=[TINY] * 5, backoff=None, host_chunk=4096),
    "bf16-host-compute-copy": dict(norms=[BIG, TINY, BIG, None], mixed_precision=True,
                                   compute_dtype=torch.bfloat16, host_compute_copy=True, host_chunk=4096),
    # clip_in_update: the redo divides inside the fused kernel (or in its own pass for SGD), as the reference does.
    "clip-in-update-mixed-fused": dict(norms=[BIG, TINY, None, BIG, TINY], host_chunk=4096, clip_in_update=True),
    "clip-in-update-mixed-sgd": dict(norms=[TINY, BIG, TINY, BIG], optim="sgd", clip_in_update=True),
    "clip-in-update-gradients-read": dict(norms=[BIG, TINY, BIG, TINY], read_at=(0, 1), host_chunk=4096,
                                          clip_in_update=True),
}


def _verdicts(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(steps committed, steps redone, steps paused) the clip calls of ``cfg`` must give: a tiny max norm redoes (unless
    ``apply_pending_clip`` scaled the gradients before step(): no coefficient is left, the verdict commits and the
    units are computed again, their gradients changed), so does a second clip under the norm, and so does every
    step from a non-finite one on (the parameters are NaN from there). An inf-norm clip (``_plain_clip``)
    scales the gradients in place and leaves no coefficient: its verdict commits, and every unit is then redone
    because its gradients changed since the speculation read them."""
    if cfg.get("norm_type") == float("inf"):
        return len(cfg["norms"]), 0, 0
    nan_from = min(cfg.get("inf_at", ()), default=len(cfg["norms"]))
    steps = [i for i in range(len(cfg["norms"])) if i not in cfg.get("skip_at", ())]  # no verdict without step()
    counts, streak = [0, 0, 0], 0  # committed, redone, paused; consecutive redo verdicts (the back-off's count)
    for i in steps:
        redo = ((cfg["norms"][i] == TINY and i not in cfg.get("read_at", ()))
                or (i >= nan_from and cfg["norms"][i] is not None) or cfg.get("clip_again", {}).get(i, 1) < 1)
        backoff = cfg.get("backoff", DEFAULT_BACKOFF)
        paused = backoff is not None and streak >= backoff
        counts[2 if paused else int(redo)] += 1
        streak = streak + 1 if redo else 0
    return counts[0], counts[1], counts[2]


@pytest.mark.parametrize("cfg", list(CASES.values()), ids=list(CASES))
def test_bit_identical_to_the_clipped_path(pool, cfg):
    stats = pool.run(check_same_as_clipped, cfg)
    commit, redo, paused = _verdicts(cfg)
    for s in stats:
        assert (s["spec_steps_committed"], s["spec_steps_redone"], s["spec_steps_paused"]) == (commit, redo, paused), s
        assert s["spec_spare_bytes"] > 0, s
        if cfg.get("norm_type") == float("inf"):
            assert s["spec_units_committed"] == 0 and s["spec_units_redone"] > 0, s
            continue
        if cfg.get("lr_between"):  # commit verdicts, but units speculated with the old lr are redone
            assert s["spec_units_committed"] > 0 and s["spec_units_redone"] > 0, s
            continue
        assert s["spec_units_committed"] > 0 if commit else s["spec_units_committed"] == 0, s
        assert s["spec_units_redone"] > 0 if redo else s["spec_units_redone"] == 0, s


def check_budget_for_some_units() -> bool:
    """A spare budget that fits the last unit(s) of the forward order only: those speculate, the others update
    after the norm; bit-identical, and the spare bytes stay within the budget."""
    probe = run(dict(norms=[BIG]), speculative=True)[1]
    last = [p.host for p in probe._plans if p.host is not None][-1]
    size = 3 * last.grad_buf.numel() * last.grad_buf.element_size()  # shard + exp_avg + exp_avg_sq
    probe.close()
    gib = (size + 1) / (1 << 30)
    cfg = dict(norms=[BIG, TINY, BIG, BIG], spare_gib=gib, host_chunk=4096)
    spec, ref = run(cfg, speculative=True), run(cfg, speculative=False)
    assert_bit_identical(cfg, spec, ref)
    opt = spec[1]
    assert opt._spec is not None
    eligible, hosts = opt._spec._eligible, [p.host for p in opt._plans if p.host is not None]
    assert eligible == {id(hosts[-1])}, f"{len(eligible)} of {len(hosts)} units speculate: expected the last only"
    stats = opt.host_stats()
    assert 0 < stats["spec_spare_bytes"] < 2 * size, stats  # the last unit's shard and state (+ step scalars)
    assert stats["spec_units_committed"] + stats["spec_units_redone"] + stats["spec_units_late"] <= len(cfg["norms"])
    zero = run(dict(cfg, spare_gib=0.0), speculative=True)
    assert_bit_identical(cfg, zero, ref)
    assert zero[1].host_stats()["spec_spare_bytes"] == 0
    for o in (opt, ref[1], zero[1]):
        o.close()
    return True


def test_spare_budget_limits_the_speculating_units(pool):
    assert pool.run(check_budget_for_some_units) == [True] * WORLD


def _originals(opt: OffloadOptimizer) -> list[torch.Tensor]:
    out = []
    for plan in opt._plans:
        if plan.host is None or plan.handle is None:
            continue
        out.append(plan.handle.flat.detach().clone())
        for _, params in plan.groups:
            for p in params:
                out += [v.clone() for v in opt.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


def check_originals_untouched_until_commit(optim: str) -> bool:
    """After backward, with every speculation done (SPECULATED) and the clip taken, the shards and the optimizer
    state are still the values from before backward; the commit then swaps the spare storage in (no copy)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg: dict[str, Any] = dict(optim=optim)
    chunk, _host_fused.CHUNK_ELEMENTS = _host_fused.CHUNK_ELEMENTS, 4096
    spec_chunk, _speculative.SPEC_CHUNK_ELEMENTS = _speculative.SPEC_CHUNK_ELEMENTS, 4096
    model = _wrap(cfg)
    opt = OffloadOptimizer(model, _optimizer(cfg, model.parameters()), gpu_budget_gib=0, speculative_clip=True)
    assert opt._spec is not None
    try:
        for step in range(4):
            poison_spares(opt)
            before = _originals(opt) if step else []
            ids, target = batch(step, rank, ws)
            loss_fn(model, ids, target, step, cfg).backward()
            model.clip_grad_norm_(BIG if step != 2 else TINY)
            opt.synchronize()  # the speculative updates are done; none may have touched an original
            records = list(opt._spec._records.values())
            assert records and all(r.state is SpecState.SPECULATED for r in records), [r.state for r in records]
            if step:
                after = _originals(opt)
                assert len(after) == len(before) and all(torch.equal(_bits(a), _bits(b))
                                                         for a, b in zip(after, before)), "an original changed"
            spares = {id(r.host): r.spare.flat.data_ptr() for r in records if r.spare.flat is not None}
            versions = {id(p.host): p.handle.flat._version for p in opt._plans if p.handle is not None}
            opt.step()
            opt.synchronize()
            flats = {id(p.host): p.handle.flat.data_ptr() for p in opt._plans if p.handle and id(p.host) in spares}
            if step != 2:  # committed: the shards now live in what were the spares
                assert flats == spares, "the commit copied instead of swapping the spare storage in"
                assert all(p.handle.flat._version > versions[id(p.host)] for p in opt._plans if id(p.host) in spares), \
                    "a commit must move the shard's version counter (it changed the shard's values)"
            else:
                assert not set(flats.values()) & set(spares.values()), "the redo must update the originals in place"
            opt.zero_grad()
    finally:
        _host_fused.CHUNK_ELEMENTS, _speculative.SPEC_CHUNK_ELEMENTS = chunk, spec_chunk
    opt.close()
    return True


@pytest.mark.parametrize("optim", ["adamw-fused", "sgd"])
def test_originals_untouched_until_commit(pool, optim):
    assert pool.run(check_originals_untouched_until_commit, optim) == [True] * WORLD


def check_refusals() -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _wrap({})
    with pytest.raises(ValueError, match="choose one"):
        OffloadOptimizer(model, _optimizer({}, model.parameters()), step_in_backward=True, speculative_clip=True)
    with pytest.raises(ValueError, match="speculative_clip_gib.*-1"):
        OffloadOptimizer(model, _optimizer({}, model.parameters()), speculative_clip=True, speculative_clip_gib=-1)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"speculative_backoff must be a positive int .* got {bad!r}"):
            OffloadOptimizer(model, _optimizer({}, model.parameters()), speculative_clip=True, speculative_backoff=bad)
    opt = OffloadOptimizer(model, _optimizer({}, model.parameters()), gpu_budget_gib=0, speculative_clip=True)
    ids, target = batch(0, rank, ws)
    loss_fn(model, ids, target, 0, {}).backward()
    with pytest.raises(RuntimeError, match="speculative_clip call model.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # it would scale gradients already being read
    with pytest.raises(ValueError, match="zero_grad\\(set_to_none=True\\)"):
        opt.zero_grad(set_to_none=False)
    model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    opt.close()
    return True


def test_refusals(pool):
    assert pool.run(check_refusals) == [True] * WORLD


def check_failed_speculation_surfaces() -> bool:
    """A speculation that raises on the worker surfaces on the main thread (here at step(), which waits for the
    unit), and its record is left idle; nothing of the shard changed."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _wrap({})
    opt = OffloadOptimizer(model, _optimizer({}, model.parameters()), gpu_budget_gib=0, speculative_clip=True)
    real = _speculative.speculate

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("speculation broke")

    _speculative.speculate = broken  # type: ignore[assignment]
    try:
        ids, target = batch(0, rank, ws)
        before = [p.detach().clone() for p in model.parameters()]
        loss_fn(model, ids, target, 0, {}).backward()
        model.clip_grad_norm_(BIG)
        with pytest.raises(RuntimeError, match="overlapped optimizer step.*speculation broke"):
            opt.step()
            opt.synchronize()
        assert opt._spec is not None
        assert all(r.state is SpecState.IDLE for r in opt._spec._records.values())
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    finally:
        _speculative.speculate = real  # type: ignore[assignment]
    return True


def test_failed_speculation_surfaces(pool):
    assert pool.run(check_failed_speculation_surfaces) == [True] * WORLD
