"""capture_step in real training loops, on the CPU (2 gloo ranks and one process): many input shapes (one graph
each, a bound, LRU eviction), gradient accumulation inside the step, dropout, and what a failed capture says.

On the host the step runs eagerly under the same contract (signature bookkeeping, bound, eviction), so the
captured loop must equal a plain eager loop bit for bit. tests/sharding/test_capture_gpu.py runs the same
checks with NCCL and real CUDA graphs.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardfuse
from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse import capture_step
from shardfuse._capture_errors import capture_failed
from tests.test_capture import DIM, Block, build, make_step

WORLD = 2


def shaped_batches(seqs: list[int], micro: int, device: torch.device, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """One batch per entry of ``seqs``: ``micro`` stacked micro-batches of that sequence length."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro, s, DIM, generator=g).to(device),
             torch.randint(0, 5, (micro, s), generator=g).to(device)) for s in seqs]


def lru(seqs: list[int], bound: int) -> tuple[list[int], int]:
    """The kept sequence lengths (least recently used first) and the evictions of an LRU of ``bound`` entries."""
    kept: list[int] = []
    evictions = 0
    for s in seqs:
        if s in kept:
            kept.remove(s)
        elif len(kept) == bound:
            kept.pop(0)
            evictions += 1
        kept.append(s)
    return kept, evictions


def train(device: torch.device, data: list, captured: bool, warmup: int, capturable: bool, **kw: Any) -> tuple:
    """Train a fresh model on ``data`` (``data[0]`` is the warm-up batch): eagerly, or through capture_step."""
    model = build(7, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, capturable=capturable)
    step = make_step(model, opt, micro=data[0][0].shape[0])
    losses = []
    run = None
    if captured:
        run = capture_step(step, *data[0], warmup=warmup, **kw)
        losses = [run(*b).clone() for b in data[1:]]
    else:
        for _ in range(warmup):
            step(*data[0])
        losses = [step(*b) for b in data[1:]]
    return torch.stack(losses).cpu(), {k: v.cpu() for k, v in model.state_dict().items()}, run


def check_shapes_equal_eager(device: torch.device, seqs: list[int], micro: int, max_graphs: int,
                             on_new_shape: str) -> dict:
    """Batches of many sequence lengths (accumulated over ``micro`` micro-batches under no_sync): the captured
    loop's losses and parameters equal the eager loop's bit for bit; the kept signatures follow an LRU."""
    data = shaped_batches(seqs, micro, device, seed=200 + dist.get_rank())  # the same shapes on every rank
    capturable = device.type == "cuda"
    eager_losses, eager_sd, _ = train(device, data, False, 2, capturable)
    losses, sd, run = train(device, data, True, 2, capturable, max_graphs=max_graphs, on_new_shape=on_new_shape)
    assert torch.equal(losses, eager_losses), (losses, eager_losses)
    for k, v in eager_sd.items():
        assert torch.equal(sd[k], v), k
    kept, evictions = lru(seqs, max_graphs)
    assert [sig[0][0][1] for sig in run.signatures] == kept
    assert run.evictions == evictions and run.captures == len(kept) + evictions
    assert run.replays == (len(seqs) - 1 - (run.captures - 1) if run.graphed else 0)
    return {"eager_peak": run.eager_peak_bytes, "captured_peak": run.captured_peak_bytes,
            "graph_pool": run.graph_pool_bytes, "graphs": len(run.signatures)}


SHAPES = [5, 5, 9, 5, 13, 9, 9, 17, 5, 13]


def _cpu() -> torch.device:
    return torch.device("cpu")


@pytest.mark.parametrize(("micro", "bound", "policy"), [(1, 8, "error"), (4, 2, "evict")],
                         ids=["kept", "accumulate4-evict"])
def test_many_shapes_equal_eager_cpu(pool, micro, bound, policy):
    out = pool.run(check_shapes_equal_eager, _cpu(), SHAPES, micro, bound, policy)
    assert [o["graphs"] for o in out] == [min(bound, 4)] * WORLD


def check_accumulation_equals_eager(device: torch.device, k: int) -> bool:
    """k micro-batches under no_sync() and one optimizer step, captured as one step over a stacked input,
    against the plain eager loop that calls the model per micro-batch (written out here, not make_step)."""
    data = shaped_batches([6] * 6, k, device, seed=300 + dist.get_rank())
    capturable = device.type == "cuda"
    captured_losses, captured_sd, run = train(device, data, True, 1, capturable)
    model = build(7, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, capturable=capturable)
    losses = []
    for n, (xs, ys) in enumerate([data[0], *data[1:]]):
        total = torch.zeros((), device=device)
        for i in range(k):
            with model.no_sync() if i < k - 1 else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(xs[i]), ys[i]) / k
                loss.backward()
            total = total + loss.detach()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if n:
            losses.append(total)
    assert torch.equal(captured_losses, torch.stack(losses).cpu())
    for key, v in model.state_dict().items():
        assert torch.equal(captured_sd[key], v.cpu()), key
    assert run.signatures == [(((k, 6, DIM), torch.float32), ((k, 6), torch.int64))]
    return True


def test_accumulation_inside_the_step_cpu(pool):
    assert pool.run(check_accumulation_equals_eager, _cpu(), 3) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# dropout: the captured loop draws the eager loop's random numbers
# --------------------------------------------------------------------------------------------------


class DropBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def build_dropout(device: torch.device) -> nn.Module:
    torch.manual_seed(11)
    net = nn.Sequential(FSDP(DropBlock().to(device)), FSDP(DropBlock().to(device)), nn.Linear(DIM, 5).to(device))
    return FSDP(net)


def _dropout_losses(device: torch.device, data: list, captured: bool, lr: float) -> torch.Tensor:
    model = build_dropout(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr) if lr == 0 else torch.optim.AdamW(
        model.parameters(), lr=lr, capturable=device.type == "cuda")
    step = make_step(model, opt, clip=None)
    torch.manual_seed(1234)  # the same random stream for both loops, after building
    if captured:
        run = capture_step(step, *data[0], warmup=2)
        return torch.stack([run(*b).clone() for b in data[1:]]).cpu()
    for _ in range(2):
        step(*data[0])
    return torch.stack([step(*b) for b in data[1:]]).cpu()


def check_dropout_equals_eager(device: torch.device) -> bool:
    """(1) The same batch again and again with lr=0: every call draws fresh masks (losses all differ) and the
    captured sequence equals the eager one. (2) Training over several shapes: the eager loop's losses."""
    same = shaped_batches([7], 1, device, seed=400)[0]
    repeated = [same] * 7
    fresh = _dropout_losses(device, repeated, True, 0.0)
    assert torch.equal(fresh, _dropout_losses(device, repeated, False, 0.0)), fresh
    assert len(set(fresh.tolist())) == len(fresh), f"replays drew the same dropout masks: {fresh}"
    data = shaped_batches([7, 7, 4, 7, 11, 4, 11], 1, device, seed=401)
    assert torch.equal(_dropout_losses(device, data, True, 1e-2), _dropout_losses(device, data, False, 1e-2))
    return True


def test_dropout_equals_eager_cpu(pool):
    assert pool.run(check_dropout_equals_eager, _cpu()) == [True] * WORLD


# --------------------------------------------------------------------------------------------------
# one process: signature bookkeeping, arguments, and what a failed capture says
# --------------------------------------------------------------------------------------------------


def test_signatures_bound_and_eviction_one_process():
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    calls: list[tuple[int, ...]] = []

    def step(x: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(tuple(x.shape))
        loss = net(x).square().mean() * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    run = capture_step(step, torch.randn(4, 3), 1.0, warmup=2, max_graphs=2, on_new_shape="evict")
    assert calls == [(4, 3)] * 2 and run.signatures == [(((4, 3), torch.float32), ("value", 1.0))]
    run(torch.randn(5, 3), 1.0)
    run(torch.randn(4, 3), 0.5)  # another value of a non-tensor leaf: another signature; (4, 3) x 1.0 goes
    assert run.signatures == [(((5, 3), torch.float32), ("value", 1.0)), (((4, 3), torch.float32), ("value", 0.5))]
    assert run.evictions == 1 and run.captures == 3 and len(calls) == 4  # one step per call, nothing extra
    run(torch.randn(5, 3, dtype=torch.float64).float(), 1.0)
    assert run.signatures[-1] == (((5, 3), torch.float32), ("value", 1.0)) and run.evictions == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_graphs": 0}, r"max_graphs=0.*int >= 1"), ({"max_graphs": True}, "max_graphs=True"),
     ({"on_new_shape": "drop"}, r"on_new_shape='drop'.*'error'.*'evict'")],
)
def test_bad_bound_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        capture_step(lambda x: x, torch.zeros(1), **kwargs)


def _torch_internal(source: str, name: str) -> Any:
    """A function whose frames read as torch's own (its file sits in torch's directory), as a C++ op's
    Python caller would: the message must point past it, at the step's line."""
    namespace: dict[str, Any] = {}
    exec(compile(source, os.path.join(os.path.dirname(torch.__file__), "_fake_op.py"), "exec"), namespace)
    return namespace[name]


_CAPTURING = "CUDA error: operation not permitted when stream is capturing\\nCUDA kernel errors might be reported"
_item = _torch_internal(f"def item(self):\n    raise RuntimeError('{_CAPTURING}')\n", "item")
_bool = _torch_internal(f"def __bool__(self):\n    raise RuntimeError('{_CAPTURING}')\n", "__bool__")
_step_health = _torch_internal(
    "def _cuda_graph_capture_health_check(self):\n"
    "    raise RuntimeError('Attempting CUDA graph capture of step() for an instance of AdamW but param_groups\\' "
    "capturable is False.')\n", "_cuda_graph_capture_health_check")


class FakeTensor:
    item = _item
    step = _step_health
    __bool__ = _bool


def _failed_capture(step: Any) -> str:
    """The message for ``step`` failing inside a capture whose end then fails too (the error chain torch makes)."""
    try:
        try:
            step(FakeTensor())
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from None
    except RuntimeError as err:
        err.__context__ = err.__context__ or err.__cause__
        return str(capture_failed(err))
    raise AssertionError("the step did not fail")


def _host_sync_step(t: Any) -> None:
    loss_value = t.item()  # the line the message must name
    del loss_value


def _branch_step(t: Any) -> None:
    if t:  # a data-dependent branch
        pass


def _optimizer_step(t: Any) -> None:
    t.step()


def _unknown_step(t: Any) -> None:
    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


def test_capture_failure_names_the_line_the_op_and_the_fix():
    msg = _failed_capture(_host_sync_step)
    assert "could not capture the step (RuntimeError: CUDA error: operation not permitted when stream is " \
           "capturing)" in msg, msg
    line = _host_sync_step.__code__.co_firstlineno + 1
    assert f"test_capture_shapes.py:{line} in _host_sync_step (`loss_value = t.item()  # the line the message " \
           "must name`), inside item (_fake_op.py:2)" in msg, msg
    assert "a host synchronisation" in msg and "loss = train_step(batch); loss.item()" in msg, msg
    msg = _failed_capture(_branch_step)
    assert "in _branch_step (`if t:  # a data-dependent branch`)" in msg and "data-dependent branch" in msg, msg
    assert "torch.where" in msg, msg
    msg = _failed_capture(_optimizer_step)
    assert "in _optimizer_step (`t.step()`), inside _cuda_graph_capture_health_check" in msg, msg
    assert "an optimizer built without capturable=True: build it with capturable=True" in msg, msg
    msg = _failed_capture(_unknown_step)
    assert "in _unknown_step" in msg and "common causes: anything that waits for the GPU" in msg, msg


def test_the_package_exports_the_bucketing_helpers():
    assert shardfuse.pad_to_bucket is shardfuse.bucketing.pad_to_bucket
    assert {"pad_to_bucket", "bucket_length", "PaddedBatch"} <= set(shardfuse.__all__)


# --------------------------------------------------------------------------------------------------
# examples/sft_buckets.py: an HF Llama SFT loop over variable lengths, 4 buckets, captured = eager
# --------------------------------------------------------------------------------------------------


def check_sft_example(device: torch.device, steps: int) -> dict:
    from examples.sft_buckets import compare

    return compare("tiny", device, steps=steps)


def test_sft_example_captured_equals_eager_cpu(pool):
    pytest.importorskip("transformers")
    out = pool.run(check_sft_example, _cpu(), 12)
    for o in out:
        assert o["captured"] == o["eager"] and len(o["eager"]) == 12
        assert sorted(set(o["buckets"])) == [16, 32, 48, 64]  # real variable lengths: every bucket comes
        assert sorted(sig[0][0][1] for sig in o["signatures"]) == [16, 32, 48, 64]
    assert out[0]["buckets"] == out[1]["buckets"]  # the same bucket on both ranks at every step
