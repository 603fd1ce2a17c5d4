"""OffloadModel and checkpoint_wrapper on a CUDA device: parity, memory bound, copy/compute overlap.

Parity is exact: the reference is the plain model on the same GPU running the same GEMM shapes in the same
order (slice by slice, microbatch by microbatch), with the same CUDA RNG draws for dropout. TF32 is switched
off so that the fp32 GEMMs are the same kernels in both (it is off by default in PyTorch; made explicit).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardfuse.offload import OffloadModel, checkpoint_wrapper
from tests.offload.test_offload_model import assert_params_equal, loss_of, reference_step

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def wide(seed=0, width=96, depth=6, p=0.1):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(p)]
    return nn.Sequential(*layers)


MODES = {
    "keep-acts": {"checkpoint_activation": False},
    "checkpoint": {"checkpoint_activation": True},
    "offload-acts": {"checkpoint_activation": False, "offload_activations": True},
}


@pytest.fixture
def park_small(monkeypatch):
    # the parity tests' activations are small: park them all, as the benchmark's large ones are
    from shardfuse.offload import _model as offload_model

    monkeypatch.setattr(offload_model, "MIN_OFFLOAD_BYTES", 0)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("mb", [1, 3], ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("num_slices", [1, 4, 6], ids=lambda n: f"slices{n}")
def test_cuda_training_parity(park_small, num_slices, mb, mode):
    ref = wide().to(CUDA)
    off = OffloadModel(wide(), CUDA, num_slices=num_slices, num_microbatches=mb, **MODES[mode])
    assert all(s.flat.is_pinned() for s in off._slices)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_off = torch.optim.SGD(off.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, w = torch.randn(31, 96, device=CUDA), torch.randn(31, 96, device=CUDA)
        torch.manual_seed(step)
        out_ref = reference_step(ref, off.slice_ranges, (x,), [w], mb)
        torch.manual_seed(step)
        out = off(x.cpu())  # inputs may come from the host
        loss_of(out, [w]).backward()
        assert out.is_cuda and torch.equal(out, out_ref[0])
        for (n, p), q in zip(off.named_parameters(), ref.parameters()):
            assert p.device.type == "cpu" and p.grad.device.type == "cpu"
            assert torch.equal(p.grad, q.grad.cpu()), n
        opt_ref.step()
        opt_off.step()
        opt_ref.zero_grad()
        opt_off.zero_grad()
    for p, q in zip(off.parameters(), ref.parameters()):
        assert torch.equal(p, q.cpu())


def test_cuda_bf16_exact_against_bf16_copy():
    ref = wide(p=0.0)
    off = OffloadModel(wide(p=0.0), CUDA, num_slices=3, checkpoint_activation=True, compute_dtype=torch.bfloat16)
    opt_ref, opt_off = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(off.parameters(), lr=0.1)
    for _ in range(3):
        x, w = torch.randn(16, 96), torch.randn(16, 96, dtype=torch.bfloat16, device=CUDA)
        low = copy.deepcopy(ref).to(CUDA, torch.bfloat16)
        out_ref = low(x.to(CUDA, torch.bfloat16))
        (out_ref * w).sum().backward()
        out = off(x)
        (out * w).sum().backward()
        assert torch.equal(out, out_ref)
        for p, q, r in zip(off.parameters(), low.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad.float().cpu())
            r.grad = q.grad.float().cpu()
        for o in (opt_ref, opt_off):
            o.step()
            o.zero_grad()
        assert_params_equal(off, ref, grads=False)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_optimizer_in_backward_adam(compute_dtype):
    # Adam keeps state: it must live on the host between steps and come back for the step. Reference: the
    # same model with one Adam on the GPU. Per-element Adam math is identical, but foreach kernels may fuse
    # differently over one list vs. per-slice lists, so 1 ulp-level tolerance (rtol 1e-6).
    # bf16 with one microbatch: the bf16 reference would accumulate microbatch gradients in bf16, ours in fp32
    mb = 2 if compute_dtype is None else 1
    ref = wide(p=0.0).to(CUDA)
    off = OffloadModel(wide(p=0.0), CUDA, num_slices=3, checkpoint_activation=True, num_microbatches=mb,
                       compute_dtype=compute_dtype, optimizer_in_backward=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for _ in range(3):
        x, w = torch.randn(12, 96, device=CUDA), torch.randn(12, 96, device=CUDA)
        if compute_dtype is None:
            reference_step(ref, off.slice_ranges, (x,), [w], mb)
        else:
            low = copy.deepcopy(ref).to(torch.bfloat16)
            reference_step(low, off.slice_ranges, (x.bfloat16(),), [w.bfloat16()], mb)
            for p, q in zip(ref.parameters(), low.parameters()):
                p.grad = q.grad.float()
        opt_ref.step()
        opt_ref.zero_grad()
        loss_of(off(x), [w.to(compute_dtype or torch.float32)]).backward()
        assert all(p.grad is None for p in off.parameters())
    for opt in off.optimizers:
        for st in opt.state.values():
            assert all(not v.is_cuda for v in st.values() if isinstance(v, torch.Tensor))
    for (n, p), q in zip(off.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.cpu(), rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_carried_schedule_equals_old_schedule(park_small, compute_dtype, mode):
    # The optimizer-in-backward schedule that keeps the first slices on the device between steps and loads the
    # last one with its master in the forward, against the schedule before it (Engine.carry off), bit for bit,
    # with streams and events for real: large enough slices that copies are still running while compute goes on.
    width = 1024

    def make(carry):
        off = OffloadModel(wide(width=width, depth=8, p=0.0), CUDA, num_slices=4, num_microbatches=2,
                           compute_dtype=compute_dtype, **MODES[mode],
                           optimizer_in_backward=lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))  # fmt: skip
        off._engine.carry = carry
        return off

    new, old = make(True), make(False)
    for step in range(4):
        x, w = torch.randn(256, width, device=CUDA), torch.randn(256, width, device=CUDA)
        outs = []
        for off in (new, old):
            out = off(x)
            loss_of(out, [w.to(out.dtype)]).backward()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1]), f"step {step}"
        for (n, p), q in zip(new.named_parameters(), old.parameters()):
            assert torch.equal(p, q), f"step {step}: {n}"
        if step == 1:  # an eval in between drops the carried copies; the next step loads everything again
            with torch.no_grad():
                assert torch.equal(new(x), old(x))
    assert sorted(new._engine._prefetched) == [0, 1] and old._engine._prefetched == {}


def test_peak_memory_bounded_by_slices():
    width, depth, batch = 1024, 16, 64
    off = OffloadModel(wide(width=width, depth=depth, p=0.0), CUDA, num_slices=8, checkpoint_activation=True,
                       num_microbatches=2)  # fmt: skip
    slice_bytes = max(s.numel for s in off._slices) * 4
    model_bytes = sum(s.numel for s in off._slices) * 4
    x = torch.randn(batch, width, device=CUDA)
    loss_of(off(x), [x]).backward()  # warm-up: streams, caching allocator
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss_of(off(x), [x]).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # 2 parameter slots + 2 gradient slots, plus activations (a few batch x width tensors per layer)
    acts = 3 * depth * batch * width * 4 * 4
    assert peak <= 4 * slice_bytes + acts, f"peak {peak / 2**20:.1f} MiB, slice {slice_bytes / 2**20:.1f} MiB"
    assert peak < 2 * model_bytes  # the resident model (weights + grads) would need this much
    assert torch.cuda.memory_allocated() - base == 0  # nothing left on the device between steps


def test_offloaded_activations_leave_the_device():
    # Same model as above without recompute: keeping activations costs two batch x width tensors per layer;
    # offloading them leaves about three slices' worth (forward: one being made, one or two on the bus;
    # backward: the last slice's own, the current one and the next one being restored).
    width, depth, batch, slices = 1024, 16, 1024, 8
    x = torch.randn(batch, width, device=CUDA)
    peaks = {}
    for offload in (False, True):
        off = OffloadModel(wide(width=width, depth=depth, p=0.0), CUDA, num_slices=slices,
                           checkpoint_activation=False, offload_activations=offload)  # fmt: skip
        loss_of(off(x), [x]).backward()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss_of(off(x), [x]).backward()
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated() - base
        assert torch.cuda.memory_allocated() - base == 0
        del off
    act = batch * width * 4  # one saved activation per Linear and one per GELU
    layers_per_slice = depth // slices
    assert peaks[False] - peaks[True] >= (depth - 4 * layers_per_slice) * 2 * act, {
        k: v / 2**20 for k, v in peaks.items()
    }


def _bench_peak(make: object, x: torch.Tensor, steps: int) -> tuple[int, list[int]]:
    """Peak bytes above what was allocated before ``make()``, and the bytes left allocated after each step."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model, opt = make()
    after = []
    for _ in range(steps):
        model(x).float().pow(2).mean().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated() - base)
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt
    return peak, after


def test_offload_activations_opt_in_backward_peak_vs_resident():
    # The offload bench (16 x Linear + ReLU, fp32, SGD, 8 slices, one microbatch), smaller. Since 2329e7b the
    # last slice's retained graph leaked its activations every step (issue 20, item 6: 9.19 GiB peak on the
    # full bench against 8.94 GiB resident; 3.69 GiB before). The budget of the issue: <= 0.45x resident.
    width, depth, batch, steps = 4096, 16, 2048, 8
    base = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    x = torch.randn(batch, width, device=CUDA)

    def resident():
        model = copy.deepcopy(base).to(CUDA)
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    def offloaded():
        model = OffloadModel(copy.deepcopy(base), CUDA, num_slices=8, checkpoint_activation=False,
                             offload_activations=True,
                             optimizer_in_backward=lambda ps: torch.optim.SGD(ps, lr=1e-3))  # fmt: skip
        return model, None

    peak_res, _ = _bench_peak(resident, x, steps)
    peak_off, after = _bench_peak(offloaded, x, steps)
    ratio = peak_off / peak_res
    assert ratio <= 0.45, f"offload peak {peak_off / 2**30:.2f} GiB = {ratio:.2f}x resident {peak_res / 2**30:.2f} GiB"
    # nothing piles up from step to step (the leak grew by the last slice's activations each step)
    assert after[-1] <= after[1], [a / 2**20 for a in after]


def test_prefetch_overlaps_compute():
    width, depth = 4096, 8
    off = OffloadModel(wide(width=width, depth=depth, p=0.0), CUDA, num_slices=4, checkpoint_activation=True)
    x = torch.randn(4096, width, device=CUDA)
    loss_of(off(x), [x]).backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        loss_of(off(x), [x]).backward()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    h2d = [(e.time_range.start, e.time_range.end) for e in events if "HtoD" in e.name]
    kernels = [(e.time_range.start, e.time_range.end) for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    assert h2d and kernels
    overlap = 0.0
    for a0, a1 in h2d:
        for b0, b1 in kernels:
            overlap += max(0.0, min(a1, b1) - max(a0, b0))
    copy_time = sum(b - a for a, b in h2d)
    assert overlap > 0.3 * copy_time, f"only {overlap:.0f} of {copy_time:.0f} us of H2D copies overlap compute"


def test_cuda_checkpoint_wrapper_dropout_exact():
    def build(wrap):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 64)).to(CUDA)
        return checkpoint_wrapper(m, offload_to_cpu=True) if wrap else m

    ref, ck = build(False), build(True)
    x = torch.randn(8, 64, device=CUDA)
    torch.manual_seed(1)
    out_ref = ref(x)
    out_ref.sum().backward()
    torch.manual_seed(1)
    out = ck(x)
    out.sum().backward()
    assert torch.equal(out, out_ref)
    for p, q in zip(ck.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_cuda_no_grad_eval():
    ref = wide().to(CUDA).eval()
    off = OffloadModel(wide(), CUDA, num_slices=3).eval()
    x = torch.randn(5, 96, device=CUDA)
    with torch.no_grad():
        assert torch.equal(off(x), ref(x))
    assert off._engine.param_pool._made == 0


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("mb", [1, 3], ids=lambda m: f"mb{m}")
def test_cuda_second_backward(park_small, mode, mb):
    # backward(retain_graph=True) twice: parked activations and stashed inputs come back from pinned host
    # memory a second time; gradients equal the plain model's after each backward
    ref = wide().to(CUDA)
    off = OffloadModel(wide(), CUDA, num_slices=4, num_microbatches=mb, **MODES[mode])
    x, w = torch.randn(19, 96, device=CUDA), torch.randn(19, 96, device=CUDA)
    torch.manual_seed(5)
    reference_step(ref, off.slice_ranges, (x,), [w], mb)
    first = [q.grad.clone() for q in ref.parameters()]
    for q in ref.parameters():
        q.grad = None
    torch.manual_seed(5)
    out = off(x)
    loss = loss_of(out, [w])
    loss.backward(retain_graph=True)
    for p, g in zip(off.parameters(), first):
        assert torch.equal(p.grad, g.cpu())
    loss.backward()
    for p, g in zip(off.parameters(), first):
        assert torch.equal(p.grad, 2 * g.cpu())
    torch.cuda.synchronize()
    assert off._engine.param_pool._made == 0


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload-to-cpu"])
def test_cuda_checkpoint_wrapper_batchnorm_and_second_backward(offload):
    # cuDNN batch norm: the recompute leaves the running statistics alone and its gradients equal the plain
    # module's, over two backwards through one retained graph
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
                             nn.Conv2d(8, 4, 3)).to(CUDA)  # fmt: skip

    ref, ck = build(), checkpoint_wrapper(build(), offload_to_cpu=offload)
    x = torch.randn(6, 3, 12, 12, device=CUDA)
    w = torch.randn(6, 4, 8, 8, device=CUDA)
    losses = []
    for m in (ref, ck):
        torch.manual_seed(2)
        loss = (m(x) * w).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (n, p), q in zip(ck.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    for (k, v), r in zip(ck.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(v, r), k
