"""What crosses between host and device under OffloadOptimizer, and that it changes no value.

1. Gradients cross in the compute dtype (bf16/fp16) where the reduction is the identity (one rank, divide
   factors 1, a reduce dtype that holds the compute dtype, no gradient held to accumulate into) and are widened to
   fp32 on the host; everywhere else the fp32 gradient crosses, as before.
2. ``keep_params_gib``: offloaded units keep their gathered parameters from forward to backward, which then
   gathers nothing.

The reference is the same run on the fp32 path (``SHARDFUSE_LOWP_GRADS=0``, ``keep_params_gib=0``): losses and clip
norms, parameters, optimizer state and the gradients left after the last step must be equal bit for bit. Spies
record which path ran: the dtype of the host buffer each gradient copy wrote (``HostShard.grad_copy.target``),
the bytes counted by ``host_stats()``, and the gathers of offloaded shards made inside backward.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardfuse import OffloadOptimizer
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.core._runtime import inside_backward
from shardfuse.sharding.core._tree import units_below
from shardfuse.sharding.host._host_keep import choose_kept
from shardfuse.sharding.host._host_shard import HostShard
from shardfuse.sharding.host._offload_optim import LOWP_GRADS_ENV
from tests.dist_pool import DistPool
from tests.sharding._models import batch, build, loss_fn, make_optim, wrap_model

WORLD = 1
STEPS = 4
BF16 = dict(mixed_precision=True, compute_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def pool2():
    with DistPool(world_size=2) as p:
        yield p


@contextlib.contextmanager
def _spies(record: dict[str, list[Any]], labels: dict[int, str]) -> Any:
    """Record the dtype of the host buffer every gradient copy writes, and every gather made inside backward."""
    real_send, real_source = HostShard.send_grad, HostShard.source_for_gather

    def send(self: HostShard, *args: Any, **kwargs: Any) -> None:
        real_send(self, *args, **kwargs)
        target = self.grad_copy.target
        assert target is not None, "send_grad queued no copy"
        record["sent"].append(target.dtype)

    def source(self: HostShard, flat: torch.Tensor) -> torch.Tensor:
        if inside_backward():
            record["bwd_gathers"].append(labels[id(self)])
        return real_source(self, flat)

    HostShard.send_grad = send  # type: ignore[method-assign]
    HostShard.source_for_gather = source  # type: ignore[method-assign]
    try:
        yield
    finally:
        HostShard.send_grad, HostShard.source_for_gather = real_send, real_source  # type: ignore[method-assign]


def _optimizer(model: FSDP, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    if cfg.get("fused"):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return make_optim(model.parameters(), cfg)


def train(cfg: dict[str, Any], lowp: bool, keep_gib: float | None) -> dict[str, Any]:
    """STEPS steps of ``cfg`` through OffloadOptimizer; what the run produced and what the spies saw."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    record: dict[str, list[Any]] = {"sent": [], "bwd_gathers": [], "sent_per_step": [], "gathers_per_step": []}
    old = os.environ.get(LOWP_GRADS_ENV)
    os.environ[LOWP_GRADS_ENV] = "1" if lowp else "0"  # read when the OffloadOptimizer is made
    try:
        model = wrap_model(build(cfg), {**cfg, "move_params_to_cpu": True})
        if cfg.get("divide_factors"):
            model.set_gradient_divide_factors(*cfg["divide_factors"])
        opt = OffloadOptimizer(model, _optimizer(model, cfg), gpu_budget_gib=0,
                               accumulate_on_gpu=cfg.get("accumulate_on_gpu", False),
                               step_in_backward=cfg.get("step_in_backward", False), keep_params_gib=keep_gib)
    finally:
        if old is None:
            del os.environ[LOWP_GRADS_ENV]
        else:
            os.environ[LOWP_GRADS_ENV] = old
    # units_below: the root, then blocks[0], blocks[1] (the extra block, if any)
    labels = {id(h.host): f"unit{i}" for i, u in enumerate(units_below(model._unit)) for h in u.handles}
    losses: list[float] = []
    micro = cfg.get("no_sync_micro", 1)
    with _spies(record, labels):
        for step in range(STEPS):
            for m in range(micro):
                ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
                with ctx:
                    ids, target = batch(step * micro + m, rank, ws)
                    loss = loss_fn(model, ids, target, step, cfg)
                    loss.backward()
                    losses.append(loss.item())
            record["sent_per_step"].append(list(record["sent"]))
            record["sent"].clear()
            record["gathers_per_step"].append(list(record["bwd_gathers"]))
            record["bwd_gathers"].clear()
            if cfg.get("clip"):
                losses.append(model.clip_grad_norm_(cfg["clip"]).item())
            opt.step()
            if not cfg.get("keep_grads"):
                opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
        opt.synchronize()
    # A forward without grad (no backward can follow) frees what it gathered, kept units included.
    with torch.no_grad():
        model(batch(0, rank, ws)[0])
    full = [u.name for u in units_below(model._unit) for h in u.handles if u.reshard_after_forward and h.step.is_full]
    assert not full, f"full buffers left after a no-grad forward: {full}"
    kept = [labels[id(h.host)] for u in units_below(model._unit) for h in u.handles
            if isinstance(h.host, HostShard) and h.host.keep_for_backward]
    out = {"losses": losses, "state": model.state_dict(), "opt": opt.state_dict()["state"],
           "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
           "stats": opt.host_stats(), "record": record, "kept": kept}
    opt.close()
    return out


def assert_same_values(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == want["losses"], f"losses (and clip norms) differ: {got['losses']} vs {want['losses']}"
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), f"{k}: max |diff| {(got['state'][k] - v).abs().max().item():.3e}"
    assert got["opt"].keys() == want["opt"].keys()
    for i, entry in want["opt"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got["opt"][i][key], value), f"optimizer state {i}.{key} differs"
    for g, w in zip(got["grads"], want["grads"]):
        assert (g is None) == (w is None), "a gradient left after the last step is missing in one run"
        if w is not None:
            assert g.dtype == w.dtype == torch.float32 and torch.equal(g, w), "gradients after the last step differ"


def check_lowp(cfg: dict[str, Any], expect: str) -> bool:
    """The compute-dtype gradient path against the fp32 one: same values; ``expect`` says which crossed where
    (``lowp`` every copy, ``fp32`` every copy, ``first``: the first step's copies in the compute dtype, then fp32
    ones, which accumulate into the gradient held)."""
    got = train(cfg, lowp=True, keep_gib=0.0)
    ref = train(cfg, lowp=False, keep_gib=0.0)
    assert_same_values(got, ref)
    dtype = cfg.get("compute_dtype", torch.float32) if cfg.get("mixed_precision") else torch.float32
    for step, sent in enumerate(ref["record"]["sent_per_step"]):
        assert sent and all(d == torch.float32 for d in sent), f"fp32 path, step {step}: copies into {sent}"
    for step, sent in enumerate(got["record"]["sent_per_step"]):
        want = dtype if expect == "lowp" or (expect == "first" and step == 0) else torch.float32
        assert sent and all(d == want for d in sent), f"step {step}: copies into {sent}, expected {want}"
    ratio = got["stats"]["grad_d2h_bytes"] / ref["stats"]["grad_d2h_bytes"]
    if expect == "lowp":
        assert ratio == 0.5, f"gradient bytes to the host: {ratio} of the fp32 path's"
    elif expect == "fp32":
        assert ratio == 1.0, f"gradient bytes to the host: {ratio} of the fp32 path's"
    return True


LOWP_ON = {
    "bf16-adamw-fused-clip": dict(BF16, fused=True, clip=0.05),
    "bf16-adamw-clip-fp32-reduce": dict(BF16, clip=0.05, fp32_reduce_scatter=True),
    "bf16-sgd": dict(BF16, optim="sgd"),
    "bf16-step-in-backward": dict(BF16, fused=True, step_in_backward=True),
    # no_sync accumulates the full gradient in bf16 on the device; the synced backward sends that sum
    "bf16-no-sync-clip": dict(BF16, no_sync_micro=3, clip=0.05),
    "bf16-no-sync-accumulate-on-gpu": dict(BF16, no_sync_micro=2, accumulate_on_gpu=True, fused=True),
    "fp16-adamw-clip": dict(mixed_precision=True, compute_dtype=torch.float16, clip=0.05),
    "bf16-root-only-checkpoint": dict(BF16, nested=False, ckpt=True, clip=0.05),
}
LOWP_OFF = {
    "fp32-compute": (dict(fused=True, clip=0.05), "fp32"),
    "bf16-predivide-2": (dict(BF16, gradient_predivide_factor=2.0, clip=0.05), "fp32"),
    "bf16-postdivide-2": (dict(BF16, divide_factors=(1.0, 2.0), clip=0.05), "fp32"),
    # the second backward's gradient is added to the one held: that sum is fp32
    "bf16-keep-grads": (dict(BF16, optim="sgd", keep_grads=True), "first"),
    "bf16-zero-not-none": (dict(BF16, set_to_none=False, clip=0.05), "first"),
}


@pytest.mark.parametrize("cfg", list(LOWP_ON.values()), ids=list(LOWP_ON))
def test_compute_dtype_gradients_where_exact(pool, cfg):
    assert pool.run(check_lowp, cfg, "lowp") == [True] * WORLD


@pytest.mark.parametrize("cfg,expect", list(LOWP_OFF.values()), ids=list(LOWP_OFF))
def test_fp32_gradients_where_not_exact(pool, cfg, expect):
    assert pool.run(check_lowp, cfg, expect) == [True] * WORLD


def check_keep(cfg: dict[str, Any], keep_gib: float | None, kept_names: list[str], chosen_at: int = 1) -> bool:
    """keep_params_gib against the run that regathers in backward: same values; no gather in backward of the
    kept units once a step() chose them (the first one, after the first iteration recorded the forward order;
    ``chosen_at``: the backward from which they are kept, 2 for the automatic room, measured at the second)."""
    got = train(cfg, lowp=True, keep_gib=keep_gib)
    ref = train(cfg, lowp=True, keep_gib=0.0)
    assert_same_values(got, ref)
    assert sorted(got["kept"]) == sorted(kept_names), f"kept {got['kept']}, expected {kept_names}"
    assert ref["kept"] == []
    ref_gathers, gathers = ref["record"]["gathers_per_step"], got["record"]["gathers_per_step"]
    assert all(ref_gathers), "the reference gathered nothing in some backward: the check would prove nothing"
    # Backward passes before a step() chose gather as the reference does; later ones skip the kept units.
    want = ref_gathers[:chosen_at] + [[n for n in step if n not in kept_names] for step in ref_gathers[chosen_at:]]
    assert gathers == want, f"gathers in backward {gathers}, expected {want}"
    assert got["stats"]["param_h2d_bytes"] < ref["stats"]["param_h2d_bytes"]
    return True


ROOT, BLOCK0 = "unit0", "unit1"  # the root unit, blocks[0]; blocks[1] is the last of the forward order
BLOCK_BYTES = 1038 * 2  # Block: fc1 13x37+37, fc2 37x13+13, LayerNorm 2x13 parameters, bf16 (one rank: no padding)
KEEP = {
    # the root regathers too: candidates from the end of the forward order are blocks[0], then the root
    "all": (dict(BF16, disable_reshard_on_root=False, clip=0.05, fused=True), 1.0, [ROOT, BLOCK0]),
    "only-the-last-fits": (dict(BF16, disable_reshard_on_root=False, clip=0.05), BLOCK_BYTES / 2**30, [BLOCK0]),
    "step-in-backward-no-sync": (dict(BF16, disable_reshard_on_root=False, step_in_backward=True, no_sync_micro=2,
                                      accumulate_on_gpu=True), 1.0, [ROOT, BLOCK0]),
    "fp32-checkpoint": (dict(ckpt=True, clip=0.05), 1.0, [BLOCK0]),
    "automatic-off-cuda": (dict(BF16, disable_reshard_on_root=False), None, []),
}


@pytest.mark.parametrize("cfg,keep_gib,kept", list(KEEP.values()), ids=list(KEEP))
def test_keep_params_between_forward_and_backward(pool, cfg, keep_gib, kept):
    if not kept:  # nothing to keep: the run must equal the reference and regather as it does
        assert pool.run(check_keep_nothing, cfg, keep_gib) == [True] * WORLD
        return
    assert pool.run(check_keep, cfg, keep_gib, kept) == [True] * WORLD


def check_keep_automatic(cfg: dict[str, Any]) -> bool:
    """keep_params_gib=None measures the room once the budget placements are final (with gpu_budget_gib=0: at the
    second step(); the room is faked here, as on a GPU with room for everything) and keeps from the next backward,
    also while step_in_backward updates queued with the current plans are still in flight: from the second step
    on those are held here until the zero_grad() that follows their step() (which they apply, deferred)."""
    import time

    from shardfuse.sharding.host import _offload_optim

    cls = _offload_optim.OffloadOptimizer
    real = (_offload_optim.keep_room, HostShard.queue, HostShard.before_step, cls.__init__, cls.step, cls.zero_grad)
    calls = {"step": 0, "zero": 0}  # of the last OffloadOptimizer made
    release: dict[int, int] = {}  # id(host) -> the zero_grad() count its queued update waits for

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.update(step=0, zero=0)
        real[3](self, *args, **kwargs)

    def queue(self: HostShard) -> None:  # caller side, as the update is queued
        release[id(self)] = calls["zero"] + 1 if calls["step"] else 0  # the first step() waits for its updates
        real[1](self)

    def held(self: HostShard, in_backward: bool) -> None:  # the worker, before it takes the step lock
        deadline = time.monotonic() + 10
        while calls["zero"] < release.get(id(self), 0) and time.monotonic() < deadline:
            time.sleep(0.002)
        real[2](self, in_backward)

    def opt_step(self: Any, *args: Any, **kwargs: Any) -> None:
        real[4](self, *args, **kwargs)
        calls["step"] += 1

    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> None:
        real[5](self, *args, **kwargs)
        calls["zero"] += 1

    _offload_optim.keep_room = lambda device, budget: float(1 << 30)  # type: ignore[assignment]
    HostShard.queue, HostShard.before_step = queue, held  # type: ignore[method-assign]
    cls.__init__, cls.step, cls.zero_grad = init, opt_step, zero_grad  # type: ignore[method-assign]
    try:
        return check_keep(cfg, None, [ROOT, BLOCK0], chosen_at=2)
    finally:
        _offload_optim.keep_room, HostShard.queue, HostShard.before_step = real[:3]  # type: ignore[method-assign]
        cls.__init__, cls.step, cls.zero_grad = real[3:]  # type: ignore[method-assign]


@pytest.mark.parametrize("sib", [False, True], ids=["after-backward", "step-in-backward"])
def test_keep_params_automatic_room(pool, sib):
    cfg = dict(BF16, disable_reshard_on_root=False, fused=True, **({"step_in_backward": True} if sib else {}))
    assert pool.run(check_keep_automatic, cfg) == [True] * WORLD


def check_keep_nothing(cfg: dict[str, Any], keep_gib: float | None) -> bool:
    got = train(cfg, lowp=True, keep_gib=keep_gib)
    ref = train(cfg, lowp=True, keep_gib=0.0)
    assert_same_values(got, ref)
    assert got["kept"] == [] and got["record"]["gathers_per_step"] == ref["record"]["gathers_per_step"]
    return True


def check_two_ranks() -> bool:
    """Two ranks: the reduce-scatter is no identity, so fp32 gradients cross; keeping parameters still applies."""
    cfg = dict(BF16, disable_reshard_on_root=False, clip=0.05, fused=True)
    got = train(cfg, lowp=True, keep_gib=1.0)
    ref = train(cfg, lowp=False, keep_gib=0.0)
    assert_same_values(got, ref)
    assert all(d == torch.float32 for sent in got["record"]["sent_per_step"] for d in sent)
    assert got["stats"]["grad_d2h_bytes"] == ref["stats"]["grad_d2h_bytes"]
    assert sorted(got["kept"]) == sorted([ROOT, BLOCK0])
    ref_gathers = ref["record"]["gathers_per_step"]
    assert all(ref_gathers) and got["record"]["gathers_per_step"] == ref_gathers[:1] + [[]] * (STEPS - 1)
    return True


def test_two_ranks_send_fp32_and_keep(pool2):
    assert pool2.run(check_two_ranks) == [True] * 2


def _fake_unit(numels: list[int], reshard: bool = True) -> Any:
    from types import SimpleNamespace

    handles = []
    for n in numels:
        host = HostShard(torch.zeros(n), torch.bfloat16, pin=False)
        handles.append(SimpleNamespace(host=host, nbytes=2 * n))
    return SimpleNamespace(gather_handles=handles, reshard_after_forward=reshard)


def test_choose_kept_counts_from_the_end_of_the_forward_order():
    from types import SimpleNamespace

    a, b, c, last = _fake_unit([10]), _fake_unit([20, 5]), _fake_unit([30], reshard=False), _fake_unit([40])
    rs = SimpleNamespace(order_recorded=True, fwd_order=[a, b, c, a, last])  # a twice: counted once

    def flags() -> list[bool]:
        return [h.host.keep_for_backward for u in (a, b, c, last) for h in u.gather_handles]

    # reversed: last (kept by the runtime), a, c (reshard_after_forward=False: kept by the runtime), b
    assert choose_kept(rs, 0) == [] and flags() == [False] * 5
    choose_kept(rs, 2 * 10)
    assert flags() == [True, False, False, False, False]
    choose_kept(rs, 2 * (10 + 5))  # b's second handle would fit after a, but the run stops at its first
    assert flags() == [True, False, False, False, False]
    assert len(choose_kept(rs, 2 * (10 + 20 + 5))) == 3
    assert flags() == [True, True, True, False, False]
    choose_kept(rs, 2 * (10 + 20))  # a smaller room unmarks what no longer fits
    assert flags() == [True, True, False, False, False]
    assert choose_kept(SimpleNamespace(order_recorded=False, fwd_order=[]), 1e18) == []


def test_bad_keep_params_gib(pool):
    assert pool.run(check_bad_keep) == [True] * WORLD


def check_bad_keep() -> bool:
    model = wrap_model(build({}), {"move_params_to_cpu": True})
    with pytest.raises(ValueError, match="keep_params_gib.*-1"):
        OffloadOptimizer(model, make_optim(model.parameters(), {}), keep_params_gib=-1)
    return True


def _host_sent_once(n: int = 4099) -> tuple[HostShard, torch.nn.Parameter, torch.Tensor, list[Any], list[str]]:
    """A host shard sent one compute-dtype gradient (on the CPU the copy is done when send_grad returns); the
    widening tasks it queued, and its timeline's events."""
    flat = torch.nn.Parameter(torch.randn(n))
    host = HostShard(flat.detach(), torch.float32, pin=False)
    host.lowp_grads = True
    events: list[str] = []
    host.trace = events.append
    queued: list[Any] = []
    host.on_lowp_sent = lambda h, event, copy: queued.append(h.widen_task(event, copy))
    g = torch.randn(n).bfloat16()
    host.send_grad(flat, g.float(), None, g)
    return host, flat, g, queued, events


@pytest.mark.parametrize("who", ["landing", "worker-first", "concurrent"])
def test_a_compute_dtype_gradient_is_widened_once(who):
    import threading

    for _ in range(5 if who == "concurrent" else 1):
        host, flat, g, queued, events = _host_sent_once()
        assert host.grad_copy.target is host.lowp_buf and host.lowp_buf.dtype == torch.bfloat16
        assert host.stats.grad_d2h_bytes == 2 * g.numel()
        assert len(queued) == 1
        if who == "worker-first":
            queued[0]()
        worker = threading.Thread(target=queued[0]) if who == "concurrent" else None
        if worker is not None:
            worker.start()
        host.land_grad(flat)
        if worker is not None:
            worker.join()
        if who == "landing":
            queued[0]()  # late: finds nothing to do
        assert flat.grad is host.grad_buf and flat.grad.dtype == torch.float32
        assert torch.equal(flat.grad, g.float()), "the landed gradient is not the exact fp32 cast"
        assert events.count("widened") == 1, events


def test_a_stale_widening_leaves_the_next_copy_alone():
    host, flat, g1, queued, _ = _host_sent_once()
    host.land_grad(flat)
    flat.grad = None  # zero_grad(set_to_none=True)
    g2 = torch.randn(g1.numel()).bfloat16()
    host.send_grad(flat, g2.float(), None, g2)
    queued[0]()  # the first copy's task, run late: on a GPU the second copy may still be writing lowp_buf
    assert torch.equal(host.grad_buf, g1.float()), "a stale task widened a copy it was not queued for"
    queued[1]()
    assert torch.equal(host.grad_buf, g2.float())
    host.land_grad(flat)
    assert torch.equal(flat.grad, g2.float())


def test_a_held_gradient_takes_the_fp32_copy_and_accumulates():
    host, flat, g1, queued, _ = _host_sent_once()
    host.land_grad(flat)
    g2 = torch.randn(g1.numel()).bfloat16()
    host.send_grad(flat, g2.float(), None, g2)  # flat.grad is held: the sum must be formed in fp32
    assert host.grad_copy.target is host.stage_buf and host.stage_buf.dtype == torch.float32
    assert len(queued) == 1, "no widening is queued for an fp32 copy"
    host.land_grad(flat)
    assert torch.equal(flat.grad, g1.float() + g2.float())


def check_opt_in() -> list[bool]:
    """Without SHARDFUSE_LOWP_GRADS (and with it 0) gradients cross in fp32; with 1 in the compute dtype."""
    old = os.environ.pop(LOWP_GRADS_ENV, None)
    try:
        seen = []
        for value in (None, "0", "1"):
            if value is not None:
                os.environ[LOWP_GRADS_ENV] = value
            model = wrap_model(build(BF16), {**BF16, "move_params_to_cpu": True})
            opt = OffloadOptimizer(model, _optimizer(model, BF16), gpu_budget_gib=0)
            hosts = [h.host for u in units_below(model._unit) for h in u.handles if h.host is not None]
            seen.append(bool(hosts) and all(h.lowp_grads for h in hosts))
            opt.close()
        return seen
    finally:
        os.environ.pop(LOWP_GRADS_ENV, None)
        if old is not None:
            os.environ[LOWP_GRADS_ENV] = old


def test_compute_dtype_gradients_are_opt_in(pool):
    # measured no faster with 12% more host memory (docs/api.md, What crosses PCIe): off unless asked for
    assert pool.run(check_opt_in) == [[False, False, True]] * WORLD
