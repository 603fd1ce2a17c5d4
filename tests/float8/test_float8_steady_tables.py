"""A float8 model with shardfuse's float8 all-gather builds no kernel launch table once training runs steadily (one
rank: on the GPU where there is one, else on the CPU through Triton's interpreter with torchao's emulated float8
matmuls; CPU tensors on a GPU machine take the references, which build no table). Every table is a host-to-device
copy on the GPU, and copies to the device queue behind other copies (activation offload, offloaded parameters), so a
table built every step can stall the step. The gather buffer's storage is freed and allocated again every step, and
autograd's gradients are new tensors: both come back at other addresses (on the CPU at once; on the GPU when the
allocator hands out other blocks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torchao.float8", reason="float8 training needs torchao")

from shardfuse.kernels import _common  # noqa: E402
from tests.float8.test_float8_all_gather import build  # noqa: E402
from tests.float8.test_float8_training import batch, loss_of, wrap  # noqa: E402
from tests.sharding.test_activation_offload import _Group  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_no_table_built_in_steady_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    _common.clear_plan_caches()
    built: list[str] = []
    real = _common.block_table

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        import traceback

        built.append(traceback.extract_stack(limit=3)[0].name)  # the launcher's plan builder
        return real(*args, **kwargs)

    monkeypatch.setattr(_common, "block_table", counting)
    model = wrap(build(device=DEVICE), process_group=_Group(), mixed_precision=True, compute_dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    per_step = []
    for step in range(4):
        built.clear()
        loss_of(model, *batch(step, 0, DEVICE)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        per_step.append(list(built))
    assert per_step[0], "no launch table in the first step: the float8 gather or the fused gradients did not run"
    assert not per_step[2] and not per_step[3], f"tables built in steady steps (by plan builder): {per_step}"
