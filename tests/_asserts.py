"""Tensor comparisons shared by the test modules: bit patterns, ulp distances, exact equality.

One rule runs through all of them: Triton's CPU interpreter truncates a down-cast to bf16 instead of rounding
to nearest-even, so under the interpreter a bf16 result made from a wider dtype may sit one step of the bit
pattern (1 ulp) away from PyTorch's ``Tensor.to``; everything else, and everything on the GPU, is bit-exact.

``shardfuse.kernels._common`` is imported inside the functions: ``tests/conftest.py`` must switch the interpreter
on before Triton is first imported, and this module may be imported before it runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["assert_bits", "assert_near", "assert_same", "max_ulp"]

_BITS = {4: torch.int32, 2: torch.int16}


def _interpreting() -> bool:
    from shardfuse.kernels._common import interpreting

    return interpreting()


def max_ulp(src_dtypes: torch.dtype | Iterable[torch.dtype], dst_dtype: torch.dtype) -> int:
    """How many ulp a result cast from ``src_dtypes`` (one dtype or several) to ``dst_dtype`` may sit from
    PyTorch's: 1 for a down-cast to bf16 under the interpreter, else 0."""
    srcs = (src_dtypes,) if isinstance(src_dtypes, torch.dtype) else tuple(src_dtypes)
    down = any(d != torch.bfloat16 for d in srcs)
    return 1 if _interpreting() and dst_dtype == torch.bfloat16 and down else 0


def assert_bits(actual: torch.Tensor, expected: torch.Tensor, ulp: int = 0) -> None:
    """Bitwise equality (NaN where NaN, whatever the payload), or within ``ulp`` steps of the bit pattern."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.reshape(-1), expected.reshape(-1)
    nan_a, nan_e = a.isnan(), e.isnan()
    assert torch.equal(nan_a, nan_e), f"NaN positions differ at {(nan_a != nan_e).nonzero()[:4].tolist()}"
    bits = _BITS[a.element_size()]
    diff = (a[~nan_a].view(bits).long() - e[~nan_e].view(bits).long()).abs()
    if diff.numel():
        worst = int(diff.argmax())
        assert diff[worst] <= ulp, (
            f"{int((diff > ulp).sum())} elements differ by more than {ulp} ulp, e.g. got {a[~nan_a][worst]} "
            f"expected {e[~nan_e][worst]}"
        )


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact equality (NaN where NaN), except bf16 under the interpreter: 1 ulp (see the module docstring)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.bfloat16 and _interpreting():
        assert torch.equal(actual.isnan(), expected.isnan()), "NaN positions differ"
        a = actual.view(torch.int16).int()
        e = expected.view(torch.int16).int()
        close = ((a - e).abs() <= 1) | (actual == expected) | actual.isnan()
        assert close.all(), f"{(~close).sum()} bf16 elements more than 1 ulp off, e.g. {actual[~close][:4]}"
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def assert_near(actual: torch.Tensor, expected: torch.Tensor, what: str, *, rtol: float, atol: float) -> None:
    """``torch.testing.assert_close`` within ``rtol``/``atol``, its message prefixed with ``what``."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_same_training_state(model: torch.nn.Module, ref: torch.nn.Module, opt: torch.optim.Optimizer,
                               ref_opt: torch.optim.Optimizer) -> None:
    """``model`` and ``opt`` hold the bits of ``ref`` and ``ref_opt``: every state-dict entry, every optimizer state
    tensor (keyed as the reference's)."""
    sd, ref_sd = model.state_dict(), ref.state_dict()
    for k in ref_sd:
        assert torch.equal(sd[k], ref_sd[k]), f"{k}: max |diff| {(sd[k] - ref_sd[k]).abs().max().item():.3e}"
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for key, value in want[i].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[i][key], value), f"optimizer state {i}.{key} differs"
