"""torchao float8 training on shardfuse-wrapped models on 2 GPUs (NCCL), against the unsharded float8 model:
the checks of tests/float8/test_float8_training.py with CUDA tensors, where ``Float8Linear`` runs
``torch._scaled_mm`` on the GPU's float8 tensor cores (H100/H200). Skipped without 2 GPUs or torchao.

The float8 all-gather (tests/float8/test_float8_all_gather.py) against FSDP2 + torchao's float8 all-gather, eager
and with every block ``torch.compile``d on both sides: bytes, scales, losses and parameters bit-equal, in fp32
and in bf16 mixed precision (on the GPU the bf16 cast of the other parameters rounds as torch's does). Compiled,
the first forward's bytes and scales are bit-equal and the rest agrees within summation order: two compiles of
one block on a GPU need not sum in the same order (``_equals_fsdp2`` says more).

    PYTHONPATH=$PWD python -m pytest -q tests/float8/test_float8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.float8", reason="float8 training needs torchao")

from tests.float8.test_float8_all_gather import check_equals_fsdp2  # noqa: E402
from tests.float8.test_float8_training import check_mixed_precision, check_parity  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
WORLD = 2


def test_gpu_parity_nested(pool):
    assert all(pool.run(check_parity, "cuda", 5))


def test_gpu_mixed_precision_bf16(pool):
    assert all(pool.run(check_mixed_precision, "cuda"))


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
def test_gpu_float8_gather_equals_fsdp2(pool, dtype):
    assert all(pool.run(check_equals_fsdp2, dtype, "cuda"))


@DTYPES
def test_gpu_float8_gather_compiled_equals_compiled_fsdp2(pool, dtype):
    assert all(pool.run(check_equals_fsdp2, dtype, "cuda", 3, True))
