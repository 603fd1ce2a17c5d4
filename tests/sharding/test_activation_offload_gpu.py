"""``offload_activations`` on one GPU (one rank): bf16 mixed precision, eager and with ``torch.compile``d layers,
trains to the same bits as without it, lowers the peak of the step by the offloaded groups the backward does not
need at its start, and fetches nothing late."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardfuse
from shardfuse import FullyShardedDataParallel as FSDP
from tests.sharding.test_activation_offload import _Group

pytestmark = pytest.mark.gpu

D, TOKENS, LAYERS = 1024, 4096, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(seed: int, compiled: bool) -> FSDP:
    torch.manual_seed(seed)
    net = Net().cuda()
    kw: dict[str, Any] = dict(process_group=_Group(), mixed_precision=True, compute_dtype=torch.bfloat16)
    for i, b in enumerate(net.blocks):
        if compiled:
            b.compile()
        net.blocks[i] = FSDP(b, **kw)
    return FSDP(net, **kw)


def run(model: FSDP, data: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Three SGD steps; the parameters after them and each step's peak allocated bytes above its start."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    peaks = []
    for x in data:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(x).float().square().mean().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with model.summon_full_params():
        return [p.detach().clone() for p in model.parameters()], peaks


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_same_bits_lower_peak_no_late_fetch(compiled: bool) -> None:
    seed = int(torch.randint(0, 1 << 30, ()).item())
    data = [torch.randn(TOKENS // 512, 512, D, device="cuda") for _ in range(3)]
    want, ref_peaks = run(build(seed, compiled), data)
    model = build(seed, compiled)
    off = shardfuse.offload_activations(model, 4, prefetch_ahead=1)
    got, peaks = run(model, data)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stats = off.stats()
    assert stats["calls"] == 4 and stats["late_fetches"] == 0, stats
    per_group = stats["bytes"] / 4
    assert per_group > 40 * 2**20, stats  # the block's saved activations went: norm, fc1 and fc2 inputs, gelu's
    # At the backward's start the top unit fetches block 3; blocks 0-2 are still on the host.
    assert max(peaks[1:]) <= max(ref_peaks[1:]) - 2.5 * per_group, (peaks, ref_peaks, stats)
