"""Diagnostic for issue 32's compiled float8 mismatch (not a test: run by hand on a GPU machine).

``test_gpu_float8_gather_compiled_equals_compiled_fsdp2`` found ``blocks.0.fc2.bias`` differing from FSDP2's after
3 compiled steps on 2 H200s while the float8 bytes, scales and losses agreed (the CPU run is bit-equal). A bias
of a ``Float8Linear`` is the one gradient of a block that is summed in full precision from the LayerNorm
backward (``fc2.bias``); the weights' gradients go through float8 casts that absorb last-bit differences. This
The likeliest cause, found on the CPU: the test's spy hooks, traced into the compiled blocks, recompile
``Block.forward`` 8 times in 3 steps (per block, side and record size), dynamo's default ``recompile_limit``; the
bf16 check, run after the fp32 one in the same worker, went past it (its warning "hit config.recompile_limit (8)"
in the worker's stderr), and dynamo then runs blocks eagerly without an error, whose reductions add in another
order than inductor's kernels on the GPU (on the CPU they happen to agree). ``check_equals_fsdp2`` now resets
dynamo, raises the limit and fails loudly past it (``every_call_compiled``). If the test still differs with that,
this script says where the difference comes from, in two parts.

Part 1 (one GPU, no process group; about 10 s a variant, each in a fresh process with an empty inductor cache):
one compiled ``Block`` fed twice with the same values, once as FSDP2 hands them (separate tensors, parameters,
float8 weights with their own scales) and once as shardfuse does (the weights over one gathered uint8 buffer,
the scales ``scales[i]`` of one tensor, the biases and norm views of one flat buffer, non-leaf). It prints the
tensors that differ (output, input gradient, each parameter gradient), per variant:

- ``as_in_test``: FSDP2-like compiled first, then shardfuse-like (the order of the test);
- ``aligned_scales``: the same with each scale cloned into its own allocation (inductor assumes 16-byte aligned
  inputs only where the example input was: ``scales[1]`` is 4 bytes in, a different kernel signature);
- ``same_layout_fresh_compile``: FSDP2-like both times, caches disabled (two compiles of one graph: if they
  differ, inductor's on-device benchmarking of reduction configs, which changes the summation order, decides);
- ``deterministic``: ``as_in_test`` under ``torch._inductor.config.deterministic`` (no benchmarking of knobs
  that change numerics).

Part 2 (``--dist``, 2 GPUs): the test's two models step by step, listing after each backward every gradient that
differs (full tensors: FSDP2's DTensor gradients against shardfuse's flat shard gradients by offsets) and after
each step every parameter, with the largest difference: last-bit differences point at summation order, larger
ones at a race. ``--deterministic``: under inductor's deterministic mode; ``--aligned-scales``: shardfuse's layers
get each scale cloned into its own allocation (instead of ``scales[i]``, 4 bytes apart).

    PYTHONPATH=$PWD python tests/float8/diagnose_compiled_bias.py            # part 1, all variants
    PYTHONPATH=$PWD python tests/float8/diagnose_compiled_bias.py --dist     # part 2 (2 GPUs)
    PYTHONPATH=$PWD python tests/float8/diagnose_compiled_bias.py --dist --deterministic
    PYTHONPATH=$PWD python tests/float8/diagnose_compiled_bias.py --dist --aligned-scales
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
from torch import nn

VARIANTS = ("as_in_test", "aligned_scales", "same_layout_fresh_compile", "deterministic")


def _block(device: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig

    from shardfuse.float8 import convert_to_float8_training
    from tests.float8.test_float8_training import Block

    torch.manual_seed(7)
    return convert_to_float8_training(Block().to(device), config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def _cast(w: torch.Tensor, m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    t = hp_tensor_to_float8_dynamic(w, torch.float8_e4m3fn, m.linear_mm_config, gemm_input_role=GemmInputRole.WEIGHT)
    return t._data, t._scale


def _fsdp2_like(block: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Parameters as FSDP2 holds them unsharded: the float8 weights ``nn.Parameter``s of their own
    ``Float8TrainingTensor`` (own data, own scale), the rest plain parameters; a subclass type, as FSDP2's."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    b = copy.deepcopy(block)
    b.__class__ = type("FSDPLike" + type(block).__name__, (type(block),), {})
    leaves = {}
    for name in ("fc1", "fc2"):
        m = getattr(b, name)
        data, scale = _cast(m.weight.detach(), m)
        w = Float8TrainingTensor(data.clone(), scale.clone(), m.weight.dtype, m.linear_mm_config,
                                 gemm_input_role=GemmInputRole.WEIGHT)
        m.weight = nn.Parameter(w)
        leaves[f"{name}.weight"] = m.weight
    for n, p in b.named_parameters():
        leaves.setdefault(n, p)
    return b, leaves


class _Float8Views(torch.autograd.Function):
    """``full`` (compute dtype, never read) -> the float8 weights over ``data``; backward: their gradients flat."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, data: torch.Tensor, scales: list[torch.Tensor],
                modules: list[nn.Module]) -> tuple[torch.Tensor, ...]:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        ctx.shapes = [m.weight_shape for m in modules]
        chunks = torch.split_with_sizes(data.view(torch.float8_e4m3fn), [s.numel() for s in ctx.shapes])
        return tuple(Float8TrainingTensor(c.view(s), sc, full.dtype, m.linear_mm_config,
                                          gemm_input_role=GemmInputRole.WEIGHT)
                     for c, s, sc, m in zip(chunks, ctx.shapes, scales, modules))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return torch.cat([g.reshape(-1) for g in grads]), None, None, None


def _shardfuse_like(block: nn.Module, aligned_scales: bool) -> tuple[nn.Module, dict[str, torch.Tensor], Any]:
    """The layout shardfuse's gather hands the layers: float8 bytes of both weights in one uint8 buffer, their
    scales ``scales[i]`` of one float32 tensor, the other parameters views of one flat buffer (non-leaf)."""
    b = copy.deepcopy(block)
    mods = [b.fc1, b.fc2]
    casts = [_cast(m.weight.detach(), m) for m in mods]
    for m in mods:
        m.weight_shape = m.weight.shape
    data = torch.cat([d.view(torch.uint8).reshape(-1) for d, _ in casts])
    scales = torch.stack([s for _, s in casts])
    scale_list = [scales[i].clone() if aligned_scales else scales[i] for i in range(len(mods))]
    full8 = torch.zeros(data.numel(), dtype=torch.float32, device=data.device, requires_grad=True)
    names = [n for n, _ in b.named_parameters() if n not in ("fc1.weight", "fc2.weight")]
    params = dict(b.named_parameters())
    flat = torch.cat([params[n].detach().reshape(-1) for n in names]).requires_grad_(True)

    def install() -> None:
        for m, w in zip(mods, _Float8Views.apply(full8, data, scale_list, mods)):
            m._parameters.pop("weight", None)
            m.weight = w
        views = torch.split_with_sizes(flat, [params[n].numel() for n in names])
        for n, v in zip(names, views):
            mod_name, attr = n.rsplit(".", 1)
            m = b.get_submodule(mod_name)
            m._parameters.pop(attr, None)
            setattr(m, attr, v.view(params[n].shape))

    def grads() -> dict[str, torch.Tensor]:
        out = {}
        g8 = torch.split_with_sizes(full8.grad, [m.weight_shape.numel() for m in mods])
        for name, g, m in zip(("fc1.weight", "fc2.weight"), g8, mods):
            out[name] = g.view(m.weight_shape)
        for n, g in zip(names, torch.split_with_sizes(flat.grad, [params[n].numel() for n in names])):
            out[n] = g.view(params[n].shape)
        full8.grad = flat.grad = None
        return out

    return b, {"install": install, "grads": grads}, None


def _run_side(model: nn.Module, install: Any, grads: Any, inputs: list) -> list[dict[str, torch.Tensor]]:
    model.forward = torch.compile(model.forward)
    out = []
    for x, tangent in inputs:
        install()
        x = x.clone().requires_grad_(True)
        y = model(x)
        y.backward(tangent)
        rec = {"output": y.detach().clone(), "input.grad": x.grad.clone()}
        rec.update({k: v.detach().clone() for k, v in grads().items()})
        out.append(rec)
    return out


def part1(variant: str, device: str = "cuda", steps: int = 3) -> list[str]:
    """One variant; returns a line per differing tensor per step (empty: bit-equal)."""
    import torch._inductor.config as inductor_config

    if variant == "deterministic":
        inductor_config.deterministic = True
    if variant == "same_layout_fresh_compile":
        inductor_config.force_disable_caches = True
    block = _block(device)
    g = torch.Generator().manual_seed(11)
    inputs = [(torch.randn(16, 32, generator=g).to(device), torch.randn(16, 32, generator=g).to(device))
              for _ in range(steps)]
    sides = []
    for k in range(2):
        if k == 0 or variant == "same_layout_fresh_compile":
            model, leaves = _fsdp2_like(block)

            def grads(leaves: dict = leaves) -> dict[str, torch.Tensor]:
                out = {}
                for n, p in leaves.items():
                    out[n] = p.grad
                    p.grad = None
                return out

            sides.append(_run_side(model, lambda: None, grads, inputs))
        else:
            model, fns, _ = _shardfuse_like(block, aligned_scales=variant == "aligned_scales")
            sides.append(_run_side(model, fns["install"], fns["grads"], inputs))
    lines = []
    for step, (a, b) in enumerate(zip(*sides)):
        for key, want in a.items():
            got = b[key]
            if not torch.equal(got, want):
                d = (got.double() - want.double()).abs()
                lines.append(f"step {step} {key}: {int((d > 0).sum())} of {d.numel()} differ, max {float(d.max()):.3g}")
    return lines


def _part1_all(device: str) -> None:
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
            code = ("import sys; from tests.float8.diagnose_compiled_bias import part1; "
                    f"lines = part1({variant!r}, {device!r}); print('\\n'.join(lines) or 'bit-equal')")
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            body = res.stdout.strip() if res.returncode == 0 else res.stderr.strip()[-3000:]
            print(f"== {variant}\n{body}", flush=True)


def part2(deterministic: bool, aligned_scales: bool = False, steps: int = 3) -> list[str]:
    """In a pool rank: the test's two models, gradients after each backward and parameters after each step."""
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from tests.float8 import test_float8_all_gather as fa
    from tests.float8.test_float8_training import batch, loss_of

    inductor_config.deterministic = deterministic
    torch._dynamo.config.recompile_limit = 32  # as every_call_compiled: no block run eagerly
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if aligned_scales:
        from shardfuse.float8._gather import TorchaoFloat8Weights

        weight = TorchaoFloat8Weights.weight
        TorchaoFloat8Weights.weight = staticmethod(  # type: ignore[method-assign]
            lambda data, scale, dtype, module: weight(data, scale.clone(), dtype, module))
    rank = dist.get_rank()
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    theirs = fa.fsdp2_model(torch.float32, device.split(":")[0], True)
    ours = fa.wrap(fa.compile_blocks(fa.build(device=device.split(":")[0])))
    seen = [fa.spy_weights(theirs), fa.spy_weights(ours)]  # as the test does: the hooks are traced into the graphs
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    lines = []
    for step in range(steps):
        x, y = batch(step, rank, device.split(":")[0])
        grads = []
        for model, opt, read in ((theirs, opts[0], _dtensor_grads), (ours, opts[1], _flat_grads)):
            opt.zero_grad(set_to_none=True)
            loss_of(model, x, y).backward()
            grads.append(read(model))
            opt.step()
        precompute_float8_dynamic_scale_for_fsdp(theirs)
        try:
            fa.assert_same_float8(seen[1], seen[0])
        except AssertionError as e:
            lines.append(f"step {step} float8 bytes or scales differ: {e}")
        lines += [f"step {step} grad {r}" for r in _diff(grads[1], grads[0])]
        lines += [f"step {step} param {r}" for r in _diff(fa.full_params(ours), fa.full_params(theirs))]
    from torch._dynamo.utils import counters

    lines.append(f"dynamo: {dict(counters['stats'])} (recompile_limit {torch._dynamo.config.recompile_limit})")
    return lines


def _dtensor_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[n] = g.detach().cpu().clone()
    return out


def _flat_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every flat shard gradient all-gathered and cut back into the parameters by their offsets."""
    import torch.distributed as dist

    from shardfuse import FullyShardedDataParallel as FSDP
    from shardfuse.sharding.core._tree import require_unit

    out = {}
    for mname, m in model.named_modules():
        if not isinstance(m, FSDP):
            continue
        prefix = mname.replace("_fsdp_wrapped_module.", "").replace("module.", "")
        prefix = prefix + "." if prefix else ""
        for h in require_unit(m).handles:
            g = h.flat.grad
            if g is None:
                continue
            full = torch.empty(h.shard_numel * h.world_size, dtype=g.dtype, device=g.device)
            dist.all_gather_into_tensor(full, g.detach().contiguous())
            offset = 0
            for name, n, shape in zip(h.names, h.numels, h.shapes):
                out[prefix + name] = full[offset:offset + n].view(shape).cpu().clone()
                offset += n
    return out


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    rows = []
    for k, v in want.items():
        if k not in got:
            rows.append(f"{k}: missing")
        elif not torch.equal(got[k], v):
            d = (got[k].double() - v.double()).abs()
            rows.append(f"{k}: {int((d > 0).sum())} of {d.numel()} differ, max {float(d.max()):.3g} "
                        f"(|value| max {float(v.abs().max()):.3g})")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist", action="store_true", help="part 2 on 2 GPUs (gloo on CPU without them)")
    parser.add_argument("--deterministic", action="store_true", help="part 2 under inductor's deterministic mode")
    parser.add_argument("--aligned-scales", action="store_true", help="part 2 with each scale in its own tensor")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if not args.dist:
        _part1_all(args.device)
        return
    from tests.dist_pool import DistPool

    backend = "nccl" if args.device == "cuda" else "gloo"
    with DistPool(world_size=2, backend=backend, timeout_s=600) as pool:
        for rank, lines in enumerate(pool.run(part2, args.deterministic, args.aligned_scales)):
            print(f"== rank {rank}\n" + ("\n".join(lines) or "bit-equal"), flush=True)


if __name__ == "__main__":
    main()
