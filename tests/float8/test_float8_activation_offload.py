"""``offload_activations`` with torchao float8 and shardfuse's float8 all-gather (one rank, CPU, torchao's emulated
float8 matmuls): the same losses as without the offload, and no offloaded tensor is a gathered float8 weight."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torchao.float8", reason="float8 training needs torchao")

import shardfuse  # noqa: E402
from shardfuse.sharding.host._activations import ActivationOffload  # noqa: E402
from tests.float8.test_float8_all_gather import build, float8_handles  # noqa: E402
from tests.float8.test_float8_training import batch, loss_of, wrap  # noqa: E402
from tests.sharding.test_activation_offload import _Group  # noqa: E402


def _train(offload: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], int, list[int]]:
    model = wrap(build(), process_group=_Group(), mixed_precision=True, compute_dtype=torch.bfloat16)
    packed: list[int] = []
    aliased: list[int] = []
    if offload:
        off = shardfuse.offload_activations(model, 2, min_bytes=0)
        real = ActivationOffload._pack

        def pack(self: ActivationOffload, group: Any, unit: Any, t: torch.Tensor) -> Any:
            out = real(self, group, unit, t)
            if out is not t:
                ptr = t.untyped_storage().data_ptr()
                packed.append(ptr)
                gathered = {h.fp8.data.untyped_storage().data_ptr() for h in float8_handles(model)
                            if h.fp8.data is not None and h.fp8.data.untyped_storage().size() > 0}
                aliased.extend(p for p in [ptr] if p in gathered)
            return out

        monkeypatch.setattr(ActivationOffload, "_pack", pack)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(3):
        loss = loss_of(model, *batch(step, 0, "cpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if offload:
        assert off.stats()["calls"] == 2 and off.stats()["late_fetches"] == 0
    return losses, len(packed), aliased


def test_float8_all_gather_with_activation_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    want, _, _ = _train(False, monkeypatch)
    got, packed, aliased = _train(True, monkeypatch)
    assert got == want
    assert packed > 0 and not aliased, (packed, aliased)
