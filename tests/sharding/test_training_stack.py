"""How training stacks call a model besides training it: evaluation first, generate(), save_pretrained()
(2 gloo ranks, against the unsharded model)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse import FullyShardedDataParallel as FSDP
from tests.sharding._models import batch, build, loss_fn, make_optim, wrap_model

WORLD = 2


class TinyLM(nn.Module):
    """Embedding and head owned by the root unit, blocks wrapped on their own; a greedy generate() that calls
    the model itself, as Hugging Face's does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(29, 12)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(3)])
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 29)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(self.norm(x))

    def generate(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        for _ in range(max_new_tokens):
            nxt = self(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids

    def save_pretrained(self, path: str, state_dict: dict[str, torch.Tensor] | None = None,
                        is_main_process: bool = True) -> dict[str, torch.Tensor]:
        # Stands in for transformers' save_pretrained: what it would write.
        return dict(self.state_dict() if state_dict is None else state_dict)


def _wrap_lm(lm: TinyLM) -> FSDP:
    for i, b in enumerate(lm.blocks):
        lm.blocks[i] = FSDP(b)
    return FSDP(lm)


def _train(model: nn.Module, cfg: dict[str, Any], steps: range) -> list[float]:
    opt = make_optim(model.parameters(), cfg)
    losses = []
    for step in steps:
        ids, target = batch(step, dist.get_rank(), dist.get_world_size())
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, ids, target, step, cfg)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_evaluation_first(mode: str) -> bool:
    cfg: dict[str, Any] = {"nested": True, "optim": "adamw"}
    torch.manual_seed(0)
    plain = wrap_model(build(cfg), cfg)
    torch.manual_seed(0)
    evaluated = wrap_model(build(cfg), cfg)
    ids, _ = batch(9, dist.get_rank(), dist.get_world_size())
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        evaluated(ids)
        evaluated(ids)
    assert _train(plain, cfg, range(3)) == _train(evaluated, cfg, range(3))
    for (k, a), b in zip(plain.state_dict().items(), evaluated.state_dict().values()):
        assert torch.equal(a, b), k
    return True


def check_generate(mode: str) -> bool:
    torch.manual_seed(1)
    ref = TinyLM()
    model = _wrap_lm(copy.deepcopy(ref))
    prompt = torch.randint(0, 29, (2, 3))
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        want = ref.generate(prompt, 6)
        got = model.generate(prompt, max_new_tokens=6)
    assert torch.equal(got, want), (got, want)
    # Training afterwards is untouched by the generate calls (no recorded order, nothing left gathered).
    x = torch.randint(0, 29, (2, 5))
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).logsumexp(-1).mean().backward()
            o.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, max_new_tokens=4), ref.generate(prompt, 4))
    return True


def check_save_pretrained() -> bool:
    torch.manual_seed(2)
    ref = TinyLM()
    model = _wrap_lm(copy.deepcopy(ref))
    written = model.save_pretrained("unused", is_main_process=dist.get_rank() == 0)
    want = ref.state_dict()
    assert set(written) == set(want), sorted(set(written) ^ set(want))
    for k, v in want.items():
        assert torch.equal(written[k], v), k
    return True


def check_no_silent_traps() -> bool:
    torch.manual_seed(3)
    lm = TinyLM()
    early = torch.optim.SGD(lm.parameters(), lr=0.1)  # built before wrapping: holds the originals
    model = _wrap_lm(lm)
    model(torch.randint(0, 29, (2, 4))).sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD holds a parameter .* build the optimizer after wrapping"):
        early.step()
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    late.step()  # the right optimizer is not affected
    late.step()
    with pytest.raises(RuntimeError, match="must not be wrapped in DistributedDataParallel"):
        nn.parallel.DistributedDataParallel(model)
    return True


def test_no_silent_traps(pool):
    assert pool.run(check_no_silent_traps) == [True] * WORLD


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_evaluation_before_training(pool, mode):
    assert pool.run(check_evaluation_first, mode) == [True] * WORLD


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_generate_matches_unsharded(pool, mode):
    assert pool.run(check_generate, mode) == [True] * WORLD


def test_save_pretrained_writes_every_tensor(pool):
    assert pool.run(check_save_pretrained) == [True] * WORLD


def check_compile(per_block: bool) -> list[float]:
    """torch.compile of the whole wrapped model (or of each block before wrapping) against eager shardfuse."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg: dict[str, Any] = {"nested": True, "optim": "adamw"}
    eager = wrap_model(build(cfg), cfg)
    inner = build(cfg)
    if per_block:
        for i, b in enumerate(inner.blocks):
            inner.blocks[i] = torch.compile(b)
        compiled = wrap_model(inner, cfg)
        run = compiled
    else:
        compiled = wrap_model(inner, cfg)
        run = torch.compile(compiled)
    opt_e, opt_c = make_optim(eager.parameters(), cfg), make_optim(compiled.parameters(), cfg)
    diffs = []
    for step in range(3):
        ids, target = batch(step, dist.get_rank(), dist.get_world_size())
        losses = []
        for m, o in ((eager, opt_e), (run, opt_c)):
            o.zero_grad(set_to_none=True)
            loss = loss_fn(m, ids, target, step, cfg)
            loss.backward()
            o.step()
            losses.append(loss.item())
        diffs.append(abs(losses[0] - losses[1]))
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    for (k, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    return diffs


@pytest.mark.parametrize("per_block", [False, True], ids=["whole-model", "per-block"])
def test_torch_compile_matches_eager(pool, per_block):
    for diffs in pool.run(check_compile, per_block):
        assert max(diffs) <= 1e-5, diffs


def check_logging() -> list[str]:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname}:{record.getMessage()}")

    log = logging.getLogger("shardfuse")
    handler = Keep()
    log.addHandler(handler)
    old = log.level
    try:
        for _ in range(3):  # three units with the deprecated alias: one warning, on rank 0 only
            FSDP(nn.Linear(2, 2), cpu_offload=True)
        log.setLevel(logging.DEBUG)
        torch.manual_seed(0)
        model = FSDP(nn.Linear(3, 3))
        model(torch.randn(2, 3)).sum().backward()
    finally:
        log.setLevel(old)
        log.removeHandler(handler)
    return records


def test_warnings_once_per_job_and_debug_steps(pool):
    rank0, rank1 = pool.run(check_logging)
    warnings = [r for r in rank0 if r.startswith("WARNING")]
    assert warnings == ["WARNING:cpu_offload is deprecated (as in FairScale); use move_params_to_cpu=True"], rank0
    assert not any(r.startswith("WARNING") for r in rank1), rank1
    for rank, records in ((0, rank0), (1, rank1)):
        assert any(r.startswith(f"DEBUG:rank {rank}: backward finished") for r in records), records
