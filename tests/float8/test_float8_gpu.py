"""torchao float8 training on shardfuse-wrapped models on 2 GPUs (NCCL), against the unsharded float8 model:
the checks of tests/float8/test_float8_training.py with CUDA tensors, where ``Float8Linear`` runs
``torch._scaled_mm`` on the GPU's float8 tensor cores (H100/H200). Skipped without 2 GPUs or torchao.

    PYTHONPATH=$PWD python -m pytest -q tests/float8/test_float8_gpu.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchao.float8", reason="float8 training needs torchao")

from tests.float8.test_float8_training import check_mixed_precision, check_parity  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
WORLD = 2


def test_gpu_parity_nested(pool):
    assert all(pool.run(check_parity, "cuda", 5))


def test_gpu_mixed_precision_bf16(pool):
    assert all(pool.run(check_mixed_precision, "cuda"))
