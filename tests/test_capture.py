"""capture_step's contract on the CPU (2 gloo ranks and one process): the step runs eagerly, equal to a plain
eager loop, with the same warm-up, input checks and refusals that the CUDA graph path has.

tests/sharding/test_capture_gpu.py runs the same checks with NCCL and real CUDA graphs.
"""

from __future__ import annotations

import copy
import gc
import pickle
import re
import traceback
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardfuse
from shardfuse import CaptureError, capture_step
from shardfuse import FullyShardedDataParallel as FSDP

WORLD = 2
DIM = 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 3 * DIM)
        self.down = nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build(seed: int, device: torch.device, nested: bool = True, **fsdp: Any) -> nn.Module:
    """A small residual model, wrapped per block and at the root (nested units)."""
    torch.manual_seed(seed)
    blocks = [Block() for _ in range(3)]
    head = nn.Linear(DIM, 5)
    net = nn.Sequential(*[FSDP(b.to(device), **fsdp) if nested else b.to(device) for b in blocks], head.to(device))
    return FSDP(net, **fsdp)


def make_step(model: nn.Module, opt: torch.optim.Optimizer, micro: int = 1, clip: float | None = 1.0):
    """One training step over ``micro`` micro-batches (no_sync for all but the last), clipping and AdamW."""

    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=xs.device)
        for i in range(micro):
            ctx = model.no_sync() if i < micro - 1 else torch.enable_grad()
            with ctx:
                loss = nn.functional.cross_entropy(model(xs[i]), ys[i]) / micro
                loss.backward()
            total = total + loss.detach()
        if clip is not None:
            model.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def batches(n: int, micro: int, device: torch.device, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro, 4, DIM, generator=g).to(device),
             torch.randint(0, 5, (micro, 4), generator=g).to(device)) for _ in range(n)]


def train(step, data: list[tuple[torch.Tensor, torch.Tensor]], captured: bool, graphed: bool = True):
    """Three warm-up steps on ``data[0]``, then one step per later batch, eager or through ``capture_step``
    (whose ``graphed`` must be as given): the losses, on the CPU, and the captured step (None eager)."""
    if captured:
        run = capture_step(step, *data[0], warmup=3)
        assert run.graphed == graphed
        return torch.stack([run(x, y).clone() for x, y in data[1:]]).cpu(), run
    for _ in range(3):
        step(*data[0])
    return torch.stack([step(x, y) for x, y in data[1:]]).cpu(), None


def check_captured_equals_eager(device: torch.device, cfg: dict[str, Any], micro: int, steps: int = 20) -> dict:
    """Captured and eager training from the same init on the same batches: losses and final parameters."""
    rank = dist.get_rank()
    data = batches(steps + 1, micro, device, seed=100 + rank)
    capturable = device.type == "cuda"
    results = []
    for captured in (False, True):
        model = build(7, device, **cfg)
        init = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, capturable=capturable)
        losses, run = train(make_step(model, opt, micro), data, captured, graphed=device.type == "cuda")
        results.append((losses, {k: v.cpu() for k, v in model.state_dict().items()}, run))
    (eager_losses, eager_sd, _), (cap_losses, cap_sd, run) = results
    assert torch.equal(cap_losses, eager_losses), (cap_losses, eager_losses)
    for k, v in eager_sd.items():
        assert torch.equal(cap_sd[k], v), k
    moved = [k for k, v in eager_sd.items() if not torch.equal(v, init[k])]
    assert len(moved) == len(eager_sd), sorted(set(eager_sd) - set(moved))  # every parameter trained
    return {"eager_peak": run.eager_peak_bytes, "captured_peak": run.captured_peak_bytes,
            "graph_pool": run.graph_pool_bytes}


def check_contract_errors(device: torch.device) -> bool:
    """What every signature shares is checked (structure, tensor or not, device, requires_grad); a new shape is
    a new graph, up to max_graphs, past which the error names the new signature, the bound and the fixes."""
    model = build(3, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = make_step(model, opt)
    x, y = batches(1, 1, device, seed=5)[0]
    run = capture_step(step, x, y, warmup=1, max_graphs=2)
    with pytest.raises(CaptureError, match="structured as"):
        run(x, [y])
    with pytest.raises(CaptureError, match=r"input leaf #0 is tensor\(1, 4, 12\) torch.float32 on .* with "
                                           r"requires_grad=True, but the step was captured for a tensor on .* "
                                           r"with requires_grad=False"):
        run(x.clone().requires_grad_(), y)
    with pytest.raises(CaptureError, match=r"input leaf #1 is 3, but the step was captured for a tensor"):
        run(x, 3)
    x6, y6 = torch.randn(1, 6, DIM, device=device), torch.randint(0, 5, (1, 6), device=device)
    run(x6, y6)  # a new shape: a second graph
    sig4, sig6 = [((1, 4, DIM), torch.float32), ((1, 4), torch.int64)], [((1, 6, DIM), torch.float32),
                                                                         ((1, 6), torch.int64)]
    assert run.signatures == [tuple(sig4), tuple(sig6)] and run.captures == 2
    with pytest.raises(CaptureError, match=r"a new input signature \(tensor\(1, 8, 12\) torch.float32 on .*, "
                                           r"tensor\(1, 8\) torch.int64 on .*\) would be graph #3, over "
                                           r"max_graphs=2 .*shardfuse.pad_to_bucket.*on_new_shape='evict'"):
        run(torch.randn(1, 8, DIM, device=device), torch.randint(0, 5, (1, 8), device=device))
    run(x, y)  # the kept shapes still work after refused calls; x's is now the most recently used
    assert run.signatures == [tuple(sig6), tuple(sig4)] and run.captures == 2 and run.evictions == 0
    return True


def check_offload_refused(device: torch.device) -> bool:
    model = build(3, device, move_params_to_cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1, 1, device, seed=5)[0]
    with pytest.raises(CaptureError, match=r"cannot capture FullyShardedDataParallel\(Sequential\) with "
                                           r"move_params_to_cpu=True.*train it eagerly"):
        capture_step(make_step(model, opt), x, y)
    # The refusal does not outlive the call: the same model trains eagerly.
    make_step(model, opt)(x, y)
    return True


def _cpu() -> torch.device:
    return torch.device("cpu")


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("cfg", [{}, {"reshard_after_forward": False}, {"mixed_precision": True}],
                         ids=["reshard", "keep", "mixed"])
def test_captured_equals_eager_cpu(pool, cfg, micro):
    out = pool.run(check_captured_equals_eager, _cpu(), cfg, micro, 6)
    assert out == [{"eager_peak": None, "captured_peak": None, "graph_pool": None}] * WORLD


def test_contract_errors_cpu(pool):
    assert pool.run(check_contract_errors, _cpu()) == [True] * WORLD


def test_offload_refused_cpu(pool):
    assert pool.run(check_offload_refused, _cpu()) == [True] * WORLD


def test_offload_model_refused():
    model = shardfuse.OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), device="cpu",
                                   offload_device="cpu", num_slices=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    with pytest.raises(CaptureError, match="cannot capture an OffloadModel.*run it eagerly"):
        capture_step(step, torch.randn(3, 4))
    step(torch.randn(3, 4))


def test_warmup_steps_are_real_steps():
    """capture_step runs ``warmup`` steps on the example inputs at capture time, on the host too."""
    net = nn.Linear(3, 1)
    ref = copy.deepcopy(net)
    seen: list[torch.Tensor] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            net.weight.add_(x.sum())
        seen.append(x)
        return net.weight.sum()

    x = torch.randn(2, 3)
    run = capture_step(step, x, warmup=2)
    assert not run.graphed and len(seen) == 2
    torch.testing.assert_close(net.weight, ref.weight + 2 * x.sum(), rtol=0, atol=1e-6)
    out = run(x * 0)
    assert len(seen) == 3 and torch.equal(out, net.weight.sum())


@pytest.mark.parametrize(
    ("args", "kwargs", "err", "match"),
    [
        ((None, torch.zeros(1)), {}, TypeError, "needs a callable step_fn, got NoneType"),
        ((lambda x: x, torch.zeros(1)), {"warmup": 0}, ValueError, r"warmup=0.*int >= 1"),
        ((lambda x: x, torch.zeros(1)), {"warmup": 1.5}, ValueError, r"warmup=1.5"),
        ((lambda x: x, 3), {}, ValueError, r"at least one tensor.*\['3'\]"),
        ((lambda x, y: x, torch.zeros(1), torch.zeros(1, device="meta")), {}, ValueError,
         r"on \['cpu', 'meta'\]: put the batch on one device"),
    ],
)
def test_bad_arguments(args, kwargs, err, match):
    with pytest.raises(err, match=match):
        capture_step(*args, **kwargs)


def test_capture_error_is_public_shardfuse_capture_error():
    """Tracebacks, reprs and pickles name the public ``shardfuse.CaptureError``, not the private module."""
    err = CaptureError("boom")
    assert f"{type(err).__module__}.{type(err).__qualname__}" == "shardfuse.CaptureError"
    assert shardfuse.CaptureError is CaptureError and "CaptureError" in shardfuse.__all__
    assert traceback.format_exception_only(err) == ["shardfuse.CaptureError: boom\n"]
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is CaptureError and again.args == ("boom",)
    doc = CaptureError.__doc__ or ""
    assert "_wrap" not in doc and "capture_step" in doc


def test_fsdp_docstring_names_public_wrap_helpers_and_the_init_broadcast():
    """The wrapper's docstring points to the public wrap helpers, and says what happens to ranks whose initial
    values differ (they get the first rank's, with a warning), not that they must not differ."""
    doc = " ".join((FSDP.__doc__ or "").split())
    assert "sharding._wrap" not in doc and "shardfuse.auto_wrap" in doc
    assert "must be initialised identically" not in doc and "first rank's values with a warning" in doc


# --------------------------------------------------------------------------------------------------
# releasing a captured step: close(), with, garbage collection, destroy_process_group()
# --------------------------------------------------------------------------------------------------


def check_close_releases_and_refuses(device: torch.device) -> bool:
    """close() is idempotent and a closed step refuses to run with a clear error; ``with`` closes too; so does
    garbage collection (the step leaves the set of open steps)."""
    from shardfuse._capture import _OPEN

    model = build(3, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = make_step(model, opt)
    x, y = batches(1, 1, device, seed=5)[0]
    run = capture_step(step, x, y, warmup=1)
    run(x, y)
    assert not run.closed and run in _OPEN
    run.close()
    run.close()
    assert run.closed and run not in _OPEN
    with pytest.raises(CaptureError, match=r"this CapturedStep was closed .*capture the step again"):
        run(x, y)
    with capture_step(step, x, y, warmup=1) as run2:
        run2(x, y)
    assert run2.closed
    with pytest.raises(CaptureError, match="was closed"):
        run2(x, y)
    run3 = capture_step(step, x, y, warmup=1)
    before = len(_OPEN)
    del run3
    assert len(_OPEN) == before - 1
    step(x, y)  # the model and the optimizer still train eagerly
    return True


def test_close_releases_and_refuses_cpu(pool):
    assert pool.run(check_close_releases_and_refuses, _cpu()) == [True] * WORLD


def test_destroy_process_group_closes_captured_steps(tmp_path):
    """torch.distributed.destroy_process_group() closes the open captured steps first (on CUDA, NCCL waits for
    the graphs that captured a communicator to be destroyed before it destroys the communicator)."""
    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = build(3, _cpu())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = batches(1, 1, _cpu(), seed=5)[0]
        run = capture_step(make_step(model, opt), x, y, warmup=1)
        run(x, y)
        sub = dist.new_group([0])
        dist.destroy_process_group(sub)  # another group: the step stays open
        assert not run.closed
    finally:
        dist.destroy_process_group()
    assert run.closed
    with pytest.raises(CaptureError, match="was closed"):
        run(x, y)


def _train_and_drop(device: torch.device) -> Any:
    """Wrap and train a model, leave it in a reference cycle, drop it; returns a weak reference to it."""
    model = build(3, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1, 1, device, seed=5)[0]
    make_step(model, opt)(x, y)
    model.cycle = [model, opt]  # only a collection frees it
    return weakref.ref(model)


def test_destroy_process_group_collects_what_a_run_left_in_cycles(tmp_path):
    """A finished run's model in a reference cycle holds its process groups; destroying the default group collects
    it first, so no gloo group outlives the destroy into interpreter exit (the exit abort of
    docs/troubleshooting.md). Destroying another group collects nothing."""
    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    gc.disable()
    try:
        dropped = _train_and_drop(_cpu())
        sub = dist.new_group([0])
        dist.destroy_process_group(sub)
        assert dropped() is not None, "destroying a subgroup ran a collection"
    finally:
        dist.destroy_process_group()
        gc.enable()
    assert dropped() is None, "the default group was destroyed while a dropped model in a cycle still held it"


def test_documented_snippet_runs_on_the_host():
    """docs/api.md's capture_step example builds the optimizer for the device it runs on: torch refuses
    ``capturable=True`` for CPU tensors, and the host needs no capturable optimizer (the step runs eagerly)."""
    net = nn.Linear(4, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, capturable=True)
    net(torch.randn(3, 4)).sum().backward()
    with pytest.raises(AssertionError, match="capturable=True"):
        opt.step()  # why the docs do not write capturable=True unconditionally
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    section = text.split("## `capture_step`", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python run-dist\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert blocks and "capturable=device.type == \"cuda\"" in blocks[0], "the example is a runnable, device-aware block"
