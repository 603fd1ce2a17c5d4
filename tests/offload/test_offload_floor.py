"""The offload bench's PCIe floor (``bench/offload/floor.py``): its bytes are the engine's, term for term.

On the CPU the engine counts every parameter, master, shadow and gradient copy as it would on a GPU (activations
are not moved there, so the comparison leaves them out); the floor's bytes must equal what one steady-state step
moves, for every schedule the bench runs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.offload.floor import Variant, floor, necessary_bytes
from shardfuse.offload import OffloadModel

WIDTH = 16  # every parameter a multiple of 16 elements: no alignment padding in the slices


def bench_like(layers: int = 10) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def variant_of(off: OffloadModel, base: nn.Sequential, with_acts: bool) -> Variant:
    layers = list(base)
    return Variant(
        slice_params=[sum(p.numel() for m in layers[a:b] for p in m.parameters()) for a, b in off.slice_ranges],
        slice_linears=[sum(isinstance(m, nn.Linear) for m in layers[a:b]) for a, b in off.slice_ranges],
        act_numel=6 * WIDTH,
        compute_bytes=(off.compute_dtype or torch.float32).itemsize,
        opt_in_backward=bool(off.optimizers),
        checkpoint=off.checkpoint_activation and with_acts,
        offload_activations=off.offload_activations and with_acts,
    )


@pytest.mark.parametrize("checkpoint", [False, True], ids=["keep-acts", "checkpoint"])
@pytest.mark.parametrize("opt_in_bwd", [False, True], ids=["host-step", "opt-in-bwd"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_slices", [1, 2, 4, 5], ids=lambda n: f"slices{n}")
def test_floor_bytes_are_what_a_steady_step_moves(num_slices, dtype, opt_in_bwd, checkpoint):
    base = bench_like()
    opt_fn = (lambda ps: torch.optim.SGD(ps, lr=0.01)) if opt_in_bwd else None
    off = OffloadModel(bench_like(), "cpu", num_slices=num_slices, checkpoint_activation=checkpoint,
                       num_microbatches=2, compute_dtype=dtype, optimizer_in_backward=opt_fn)  # fmt: skip
    host_opt = None if opt_in_bwd else torch.optim.SGD(off.parameters(), lr=0.01)
    for _ in range(3):  # the first step loads stale shadows, the second may find carried slices: the third is steady
        off.transfer_stats(reset=True)
        off(torch.randn(6, WIDTH)).float().pow(2).mean().backward()
        if host_opt is not None:
            host_opt.step()
            host_opt.zero_grad()
    need = necessary_bytes(variant_of(off, base, with_acts=False))
    assert off.transfer_stats() == {"h2d": need["h2d"], "d2h": need["d2h"]}, need["terms"]


def test_floor_terms_of_the_bench_model():
    # 16 x Linear(8192) + ReLU in 4 slices, batch 4096, bf16, checkpointing, optimizer in backward
    per_slice = 4 * (8192 * 8192 + 8192)
    v = Variant(slice_params=[per_slice] * 4, slice_linears=[4] * 4, act_numel=4096 * 8192, compute_bytes=2,
                opt_in_backward=True, checkpoint=True)  # fmt: skip
    need = necessary_bytes(v)
    acts = 4 * 4096 * 8192 * 2
    assert need["h2d"] == 2 * per_slice + 4 * per_slice + 3 * 4 * per_slice + acts  # slice 2, last, 3 masters
    assert need["d2h"] == 4 * 4 * per_slice + 2 * per_slice + acts  # masters, slice 2's shadow, slice inputs
    assert round(need["h2d"] / 1e9, 2) == round(need["d2h"] / 1e9, 2) == 5.10
    assert need["forward_h2d"] == 6 * per_slice and need["forward_d2h"] == acts


def test_floor_arithmetic():
    need = {"h2d": 5e9, "d2h": 2.5e9, "forward_h2d": 1e9, "forward_d2h": 0.5e9, "terms": {"h2d": {}, "d2h": {}}}
    link = {"h2d_gbps": 50.0, "d2h_gbps": 25.0, "duplex_gbps": 20.0}
    f = floor(need, link, compute_ms=40.0)
    assert f["floor_ms"] == pytest.approx(100.0) and f["floor_bound"] == "h2d"
    assert f["floor_h2d_ms"] == pytest.approx(100.0) and f["floor_d2h_ms"] == pytest.approx(100.0)
    # forward 20 ms (h2d) + backward max(80 ms h2d, 80 ms d2h)
    assert f["phase_floor_ms"] == pytest.approx(100.0)
    assert floor(need, link, compute_ms=150.0)["floor_bound"] == "compute"
    assert floor(need, link, compute_ms=None)["floor_compute_ms"] is None


def test_report_renders_the_floor_table():
    from bench.report._offload import _floor_table
    from bench.results_io import OffloadFile

    row = {"step_ms": 150.0, "peak_gib": 4.8, "h2d_gbps": 34.0, "d2h_gbps": 34.0, "floor_ms": 93.1,
           "floor_bound": "h2d", "vs_floor": 150.0 / 93.1, "phase_floor_ms": 117.6, "vs_phase_floor": 150.0 / 117.6,
           "floor_h2d_gb": 5.10, "floor_d2h_gb": 5.10}  # fmt: skip
    data = {"config": {"layers": 16, "link": {"h2d_gbps": 54.8, "d2h_gbps": 55.3, "duplex_gbps": 50.1}},
            "variants": {"plain": {"step_ms": 509.6}, "shardfuse_bf16_opt_in_bwd": row}}  # fmt: skip
    f = OffloadFile.parse(data)
    text = "\n".join(_floor_table(f.config, f.variants))
    assert "pinned host->device 54.8 GB/s, device->host 55.3 GB/s, 50.1 GB/s each way at once" in text
    assert "| shardfuse `OffloadModel`, bf16 + `optimizer_in_backward` | 150.0 | 5.10 | 5.10 | 93.1 (h2d) | 1.61x |" \
        " 117.6 | 1.28x |" in text
    assert "plain GPU" not in text  # no floor: not in this table
    # a file from before the floor: no table at all
    old = OffloadFile.parse({"variants": {"shardfuse": {"step_ms": 898.5}}})
    assert _floor_table(old.config, old.variants) == []
