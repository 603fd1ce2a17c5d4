"""The list form of the public ``pre_divide_pad`` (shardfuse.kernels._grad_divide_multi): many gradients in one
launch through a pointer table, against the reference and plain PyTorch.

On CPU the Triton kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardfuse.kernels._grad_divide import pre_divide_pad_ref
from shardfuse.kernels._grad_divide_multi import pre_divide_pad
from tests._asserts import assert_same
from tests.conftest import cuda_kernels, poisoned
from tests.kernels.test_grad_divide import DEVICE, DTYPE_PAIRS, DTYPES, assert_positive_zero, randn, true_div


@pytest.mark.parametrize("factor", [1.0, 3.0], ids=lambda f: f"f{f:g}")
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
@pytest.mark.parametrize(
    "shapes",
    [
        [(7,), (131,), (0,), (4099,), (1,)],
        [(3, 5), (2, 2, 2), (1,)],
        [(8,), (128,), (4096,), (16,)],
        [(0,), (0, 3), (5,)],
        [(0,), (0,)],
    ],
    ids=["odd", "nd", "aligned", "empty-first", "all-empty"],
)
def test_pre_divide_pad_multi(shapes, pair, factor):
    gd, od = DTYPES[pair[0]], DTYPES[pair[1]]
    grads = [randn(s, gd) for s in shapes]
    n = sum(g.numel() for g in grads)
    pad = (-n) % 5 + 4100  # padding spanning more than one block
    out = poisoned((n + pad,), od, DEVICE)
    pre_divide_pad(grads, out, factor)
    flat = torch.cat([g.reshape(-1) for g in grads])
    assert_same(out, F.pad(true_div(flat, factor).to(od), (0, pad)))
    assert_same(out, pre_divide_pad_ref(grads, poisoned((n + pad,), od, DEVICE), factor))
    assert_positive_zero(out[n:])


@pytest.mark.gpu
def test_gpu_pre_divide_pad_thousands_of_tensors_one_launch():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 3000, (3000,), generator=gen).tolist() + [1 << 20, 4099, 0, 1]
    grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in sizes]
    n = sum(sizes)
    out = poisoned((n + 8191,), torch.float32, "cuda")
    pre_divide_pad(grads, out, 3.0)
    torch.testing.assert_close(out, pre_divide_pad_ref(grads, torch.empty_like(out), 3.0), rtol=0, atol=0)
    assert len(cuda_kernels(lambda: pre_divide_pad(grads, out, 3.0))) == 1
