"""The sharding layer's doorway to the kernels (shardfuse/sharding/core/_data_path.py): the kernels under their own
names, trusted launches for the per-step calls, and the plan-time check that stands in for their checks."""

from __future__ import annotations

import pytest
import torch

from shardfuse.kernels import _cast, _flatten, _grad_divide
from shardfuse.sharding.core import _data_path as dp


def test_per_step_calls_are_the_trusted_launches_under_the_kernels_names():
    assert dp.cast_shard is _cast.cast_shard_unchecked
    assert dp.pre_divide_pad is _grad_divide.pre_divide_pad_unchecked
    assert dp.post_divide is _grad_divide.post_divide_unchecked
    # Wrap-, load- and state-dict-time calls see the user's tensors: the validated forms.
    assert dp.flatten_pad is _flatten.flatten_pad and dp.unflatten_into is _flatten.unflatten_into
    assert dp.gradient_divide_factors is _grad_divide.gradient_divide_factors


def _plan(**overrides):
    args = dict(shard=torch.randn(6), full=torch.empty(12, dtype=torch.bfloat16), world_size=2,
                reduce_dtype=torch.float32, predivide=2.0, postdivide=1.0, name="layer.weight")
    args.update(overrides)
    return args


def test_check_plan_accepts_what_the_runtime_makes():
    dp.check_plan(**_plan())
    full = torch.empty(12, dtype=torch.float16)
    full.untyped_storage().resize_(0)  # lazy init's full buffer has no storage yet
    dp.check_plan(**_plan(full=full, reduce_dtype=torch.float16, predivide=1, postdivide=2))


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"shard": torch.randn(6, dtype=torch.float64)}, TypeError, r"flat shard of layer.weight is torch.float64"),
        ({"full": torch.empty(12, dtype=torch.int32)}, TypeError, r"compute dtype of layer.weight is torch.int32"),
        ({"reduce_dtype": torch.float64}, TypeError, r"reduce dtype .* torch.float64"),
        ({"shard": torch.randn(12)[::2]}, ValueError, r"not contiguous .*stride=\(2,\)"),
        ({"full": torch.empty(14, dtype=torch.bfloat16)}, ValueError, r"holds 14 elements.* need 12"),
        ({"predivide": float("inf")}, ValueError, r"predivide factor of layer.weight .* got inf"),
        ({"postdivide": 0.0}, ValueError, r"postdivide factor .* got 0.0"),
        ({"postdivide": True}, ValueError, r"postdivide factor .* got True"),
    ],
    ids=["fp64-shard", "int-compute", "fp64-reduce", "strided-shard", "wrong-size", "inf-pre", "zero-post", "bool"],
)
def test_check_plan_names_the_value_and_the_fix(overrides, error, match):
    with pytest.raises(error, match=match):
        dp.check_plan(**_plan(**overrides))
