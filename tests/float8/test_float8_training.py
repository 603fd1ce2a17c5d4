"""torchao float8 training on shardfuse-wrapped models (shardfuse.float8; docs/recipes.md), 2 gloo ranks on CPU
against the unsharded float8 model in one process.

torchao's ``Float8Linear`` runs on CPU tensors here (``torch._scaled_mm`` has a CPU kernel in the installed
torch), so the whole training path is checked: nested wrapping, forward/backward parity to the last bit,
mixed precision, ``summon_full_params``, full and local state dicts, ``clip_grad_norm_``. Skipped without torchao
(``pip install torchao==0.18.0``); tests/float8/test_float8_gpu.py runs the parity check on GPUs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchao.float8", reason="float8 training needs torchao")

from shardfuse import FullyShardedDataParallel as FSDP  # noqa: E402
from shardfuse.float8 import convert_to_float8_training, float8_compatible  # noqa: E402

WORLD = 2
DIM, HID = 32, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HID)
        self.fc2 = nn.Linear(HID, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


class Net(nn.Module):
    """Two blocks (wrapped on their own when nested), an odd-sized head that stays nn.Linear (13 outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(device: str = "cpu", recipe: str | None = None) -> Net:
    """The model converted with torchao's default config, or with its named recipe ("tensorwise", "rowwise")."""
    torch.manual_seed(7)
    if recipe is None:
        return convert_to_float8_training(Net().to(device))
    from torchao.float8 import Float8LinearConfig

    return convert_to_float8_training(Net().to(device), config=Float8LinearConfig.from_recipe_name(recipe))


def wrap(model: Net, **kw) -> FSDP:
    for i in range(len(model.blocks)):
        model.blocks[i] = FSDP(model.blocks[i], **kw)
    return FSDP(model, **kw)


def batch(step: int, rank: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + 10 * step + rank)
    # 16 rows: the weight gradient's float8 matmul contracts over the batch, and torch._scaled_mm on the GPU wants
    # that dimension a multiple of 16
    return torch.randn(16, 16, generator=g).to(device), torch.randn(16, 13, generator=g).to(device)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def reference_step(ref: Net, opt: torch.optim.Optimizer, step: int, world: int, device: str) -> list[float]:
    """One step of the unsharded model on every rank's batch, gradients combined as the sharded path does."""
    from shardfuse.kernels import gradient_divide_factors

    pre, post = gradient_divide_factors(world)
    params = [p for p in ref.parameters()]
    total: list[torch.Tensor | None] = [None] * len(params)
    losses = []
    for r in range(world):
        for p in params:
            p.grad = None
        loss = loss_of(ref, *batch(step, r, device))
        loss.backward()
        losses.append(loss.item())
        for i, p in enumerate(params):
            g = p.grad / pre
            total[i] = g if total[i] is None else total[i] + g
    for p, g in zip(params, total):
        p.grad = g / post
    opt.step()
    return losses


def check_parity(device: str = "cpu", steps: int = 3, recipe: str | None = None) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build(device, recipe)
    model = wrap(build(device, recipe))
    assert type(model.module.blocks[0].module.fc1).__name__ == "Float8Linear"
    assert type(model.module.head) is nn.Linear  # 13 outputs: not a multiple of 16, left alone
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        want = reference_step(ref, ref_opt, step, world, device)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, *batch(step, rank, device))
        loss.backward()
        opt.step()
        assert loss.item() == want[rank], (step, loss.item(), want[rank])
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k].to(v.device), v), k
    return True


def check_mixed_precision(device: str = "cpu") -> bool:
    from tests._asserts import assert_same

    rank = dist.get_rank()
    plain = build(device)
    model = wrap(build(device), mixed_precision=True, compute_dtype=torch.bfloat16)
    gathered: dict[str, torch.Tensor] = {}

    def keep(mod: nn.Module, args: object, key: str) -> None:
        for p in ("weight", "bias"):  # what the layer computes with: the bf16 values of its unit's all-gather
            gathered.setdefault(f"{key}.{p}", getattr(mod, p).detach().clone())

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            key = name.replace("_fsdp_wrapped_module.", "").replace("module.", "")
            m.register_forward_pre_hook(lambda mod, args, key=key: keep(mod, args, key))
    x, y = batch(0, rank, device)
    out = model(x)
    ref = copy.deepcopy(plain).to(torch.bfloat16)
    for key, w in gathered.items():
        target = ref.get_parameter(key)
        assert w.dtype == torch.bfloat16
        assert_same(w, target.detach())  # fp32 -> bf16 (1 ulp under Triton's interpreter)
        with torch.no_grad():
            target.copy_(w)
    # The same float8 layers with those weights and a bf16 input compute the same bits; the fp32 model does not.
    want = ref(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert not torch.equal(out.float(), plain(x))
    (out.float() - y).pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and g.isfinite().all() for g in grads)
    return True


def check_summon_and_state_dicts() -> bool:
    ref = build()
    model = wrap(build())
    names = list(ref.state_dict())
    full = model.state_dict()
    assert list(full) == names, (list(full), names)  # Float8Linear keeps nn.Linear's names
    plain = Net()  # an unconverted model loads the checkpoint as it is
    plain.load_state_dict(full)
    with model.summon_full_params():
        fc1 = model.module.blocks[1].module.fc1
        assert type(fc1).__name__ == "Float8Linear" and torch.equal(fc1.weight, ref.blocks[1].fc1.weight)
        with torch.no_grad():
            fc1.weight.mul_(0.5)  # written back to the shard on exit
    assert torch.equal(model.state_dict()["blocks.1.fc1.weight"], ref.blocks[1].fc1.weight * 0.5)
    # Full state dict round trip into a fresh wrapped float8 model, then local (sharded) round trip.
    other = wrap(build())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.load_state_dict(model.state_dict())
    x, _ = batch(1, dist.get_rank(), "cpu")
    assert torch.equal(other(x), model(x))
    local = model.local_state_dict()
    third = wrap(build())
    third.load_local_state_dict(local)
    assert torch.equal(third(x), model(x))
    return True


def check_clip_grad_norm() -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build()
    model = wrap(build())
    reference_step(ref, torch.optim.SGD(ref.parameters(), lr=0.0), 0, world, "cpu")  # combined grads, lr 0
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    loss_of(model, *batch(0, rank, "cpu")).backward()
    got = model.clip_grad_norm_(0.01)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    return True


def test_parity_nested(pool):
    assert all(pool.run(check_parity))


def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes per-row scales (torch 2.13 does; 2.11's mkldnn path
    takes per-tensor scales only)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def test_parity_nested_rowwise_recipe(pool):
    """torchao's rowwise recipe (per-row scales, computed by each layer from its gathered weight)."""
    if not cpu_rowwise_scaled_mm():
        pytest.skip(f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only (2.13 takes rows)")
    assert all(pool.run(check_parity, "cpu", 2, "rowwise"))


def test_mixed_precision(pool):
    assert all(pool.run(check_mixed_precision))


def test_summon_and_state_dicts(pool):
    assert all(pool.run(check_summon_and_state_dicts))


def test_clip_grad_norm(pool):
    assert all(pool.run(check_clip_grad_norm))


def test_convert_refuses_a_wrapped_model(pool):
    assert all(pool.run(check_refuses_wrapped))


def check_refuses_wrapped() -> bool:
    with pytest.raises(ValueError, match="convert the model before wrapping it"):
        convert_to_float8_training(FSDP(Net()))
    return True


def test_default_filter_converts_only_what_scaled_mm_takes():
    model = convert_to_float8_training(Net())
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {"inp": "Float8Linear", "blocks.0.fc1": "Float8Linear", "blocks.0.fc2": "Float8Linear",
                     "blocks.1.fc1": "Float8Linear", "blocks.1.fc2": "Float8Linear", "head": "Linear"}
    assert float8_compatible(nn.Linear(16, 32)) and not float8_compatible(nn.Linear(16, 13))
    assert not float8_compatible(nn.LayerNorm(16))
