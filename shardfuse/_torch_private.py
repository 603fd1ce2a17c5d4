"""The private torch functions the host tier calls, behind one capability check, each with a public fallback.

torch's underscore functions carry no compatibility promise. The host tier (``sharding/host/``,
``sharding/host/_offload_optim``) calls them only through this module:

- ``torch._fused_adam_`` / ``torch._fused_adamw_``: the kernel ``torch.optim.Adam(W)(fused=True)`` runs, called
  chunk by chunk by ``_host_fused`` so scaling, update and compute copy share one cache-sized pass.
  :func:`fused_adam_kernels` checks them once per process: present, called with ``_host_fused``'s argument
  convention on tiny random tensors, and equal bit for bit to the public ``torch.optim.Adam``/``AdamW``
  (``fused=True``) step. Where that fails (the signature moved, the kernel is gone) it logs one warning and returns
  None: ``_host_fused.step_in_chunks`` then declines, and each shard is stepped by the optimizer's own public
  ``step()`` (the same values, without the one-pass cache reuse).
  Its ``grad_scale`` argument (the kernel divides each gradient by it and writes the quotient back) is what
  ``OffloadOptimizer(clip_in_update=True)`` scales with: :func:`kernel_divides_by_grad_scale` checks once that it
  equals ``Tensor.div_`` followed by the unscaled kernel, bit for bit, else that option divides in a separate pass.
- ``torch._foreach_norm`` / ``_foreach_mul_`` / ``_foreach_div_`` / ``_foreach_add_``: what
  ``torch.nn.utils.clip_grad_norm_`` and the optimizers themselves run; where absent, :func:`foreach_norm` /
  :func:`foreach_mul_` / :func:`foreach_div_` / :func:`foreach_add_` loop over ``torch.linalg.vector_norm`` /
  ``Tensor.mul_`` / ``Tensor.div_`` / ``Tensor.add_``.
- ``torch._C._storage_Use_Count``: how many tensors (and storage objects) hold a storage; the SSD tier asks before
  it gives a shard's memory back, so a tensor a user took from it keeps valid memory. :func:`storage_use_count`
  returns None where it is gone (the tier then gives the memory back as before that check).

Other private torch calls in shardfuse, outside the host tier, are listed in :data:`OTHER_PRIVATE_USES`
(tests/test_torch_private.py fails on any private call that is neither routed here nor listed there).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

# (file under shardfuse/, private name) -> why it is called directly; to be routed through here in time.
OTHER_PRIVATE_USES: dict[tuple[str, str], str] = {
    ("kernels/_chunk_cat.py", "_chunk_cat"): "torch's own chunk-cat, measured faster for many small CUDA tensors",
    ("kernels/_cast_multi.py", "_foreach_copy_"): "torch's multi-tensor copy, measured faster for many tensors",
    ("kernels/_grad_divide_multi.py", "_foreach_add_"): "rewriting a launch table's changed addresses on the device in "
    "one launch, the values as launch arguments (a copy to the device would queue behind other copies); a loop of "
    "Tensor.add_ where torch lacks it",
    ("kernels/_common.py", "_C"): "the raw current CUDA stream for Triton launches; torch.compile's C++ tensor "
    "guards (`_C._dynamo.guards.TensorGuards`) as the plan caches' layout check, self-checked once at first use "
    "with a Python fallback (`kernels._common.layout_guard`)",
    ("kernels/_launch.py", "_C"): "the raw current CUDA stream for direct Triton launches, as Triton's JIT reads it; "
    "`torch.cuda.current_stream(device).cuda_stream` where torch lacks it",
    ("sharding/core/_runtime.py", "_C"): "whether the autograd engine is running a backward",
    ("sharding/core/_flat_param.py", "_utils"): "pickling a parameter view as torch pickles parameters",
    ("sharding/core/_grad_reduce.py", "_foreach_norm"): "the global gradient norm, as torch.nn.utils computes it",
    ("sharding/core/_grad_reduce.py", "_foreach_mul_"): "scaling gradients by the clip coefficient",
}

_USE_COUNT: Callable[[int], int] | None = getattr(getattr(torch, "_C", None), "_storage_Use_Count", None)


def storage_use_count(storage: torch.UntypedStorage) -> int | None:
    """The holders of ``storage`` (its tensors, its storage objects: this one included), or None if unknown."""
    return _USE_COUNT(storage._cdata) if _USE_COUNT is not None else None


_FOREACH = all(hasattr(torch, n) for n in ("_foreach_norm", "_foreach_mul_", "_foreach_div_", "_foreach_add_"))


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """The norm of each tensor, as ``torch.nn.utils.clip_grad_norm_`` takes it (``torch._foreach_norm``)."""
    if _FOREACH:
        return list(torch._foreach_norm(list(tensors), ord))
    return [torch.linalg.vector_norm(t, ord) for t in tensors]


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: torch.Tensor) -> None:
    """Multiply each tensor in place by the one-element tensor ``scalar`` (``torch._foreach_mul_``)."""
    if _FOREACH:
        torch._foreach_mul_(list(tensors), scalar)
        return
    for t in tensors:
        t.mul_(scalar)


def foreach_div_(tensors: Sequence[torch.Tensor], scalar: torch.Tensor) -> None:
    """Divide each tensor in place by the one-element tensor ``scalar`` (``torch._foreach_div_``)."""
    if _FOREACH:
        torch._foreach_div_(list(tensors), scalar)
        return
    for t in tensors:
        t.div_(scalar)


def foreach_add_(tensors: Sequence[torch.Tensor], value: float) -> None:
    """Add ``value`` to each tensor in place (``torch._foreach_add_``; the fused optimizers' step counters)."""
    if _FOREACH:
        torch._foreach_add_(list(tensors), value)
        return
    for t in tensors:
        t.add_(value)


FusedKernel = Callable[..., Any]


def call_fused_adam(kernel: FusedKernel, params: list[torch.Tensor], grads: list[torch.Tensor],
                    exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor],
                    steps: list[torch.Tensor], kwargs: dict[str, Any]) -> None:
    """One call of torch's fused Adam/AdamW kernel in the convention ``_host_fused`` uses (and the probe checks):
    the state lists positionally, the settings (``amsgrad, lr, beta1, beta2, weight_decay, eps, maximize,
    grad_scale, found_inf``) by keyword; ``steps`` were already incremented."""
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, **kwargs)


def probe_fused_adam(kernel: FusedKernel, decoupled: bool, amsgrad: bool) -> str | None:
    """Run ``kernel`` on tiny random tensors as ``_host_fused`` does and compare with the public optimizer's
    ``fused=True`` step; None when equal bit for bit, else what differs or what raised."""
    try:
        return _probe(kernel, decoupled, amsgrad)
    except Exception as err:  # noqa: BLE001 - a moved signature raises TypeError/RuntimeError: reported
        return f"calling it raised {type(err).__name__}: {err}"


def _probe(kernel: FusedKernel, decoupled: bool, amsgrad: bool) -> str | None:
    gen = torch.Generator().manual_seed(1234)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    lr, beta1, beta2, eps, wd = 3e-3, 0.85, 0.97, 1e-7, 0.05
    ref = torch.nn.Parameter(torch.randn(37, generator=gen))
    mine = torch.nn.Parameter(ref.detach().clone())
    ref_opt = cls([ref], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, amsgrad=amsgrad, fused=True)
    own_opt = cls([mine], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, amsgrad=amsgrad, fused=True)
    for step in range(2):  # the first step makes the state (on both), the second is compared
        g = torch.randn(37, generator=gen)
        ref.grad, mine.grad = g.clone(), g.clone()
        ref_opt.step()
        if step == 0:
            own_opt.step()
            continue
        st = own_opt.state[mine]
        foreach_add_([st["step"]], 1)
        kwargs = dict(amsgrad=amsgrad, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, maximize=False,
                      grad_scale=None, found_inf=None)
        with torch.no_grad():
            call_fused_adam(kernel, [mine], [mine.grad], [st["exp_avg"]], [st["exp_avg_sq"]],
                            [st["max_exp_avg_sq"]] if amsgrad else [], [st["step"]], kwargs)
    names = ["exp_avg", "exp_avg_sq", "step"] + (["max_exp_avg_sq"] if amsgrad else [])
    for name, a, b in [("param", mine, ref)] + [(n, own_opt.state[mine][n], ref_opt.state[ref][n]) for n in names]:
        if not torch.equal(a, b):
            return f"{name} differs from torch.optim.{cls.__name__}(fused=True)'s step"
    return None


@functools.cache
def fused_adam_kernels() -> tuple[FusedKernel, FusedKernel] | None:
    """``(torch._fused_adam_, torch._fused_adamw_)`` if both are present and match the public optimizers' fused
    step on a probe (checked once per process); else None, after one warning (the caller falls back to the
    optimizer's own public step)."""
    adam, adamw = getattr(torch, "_fused_adam_", None), getattr(torch, "_fused_adamw_", None)
    problem = None if adam is not None and adamw is not None else "not present in this torch"
    for name, kernel, decoupled in (("_fused_adam_", adam, False), ("_fused_adamw_", adamw, True)):
        for amsgrad in (False, True):
            if problem is None and kernel is not None:
                found = probe_fused_adam(kernel, decoupled, amsgrad)
                problem = f"torch.{name} (amsgrad={amsgrad}): {found}" if found else None
    if problem is not None or adam is None or adamw is None:
        logger.warning("shardfuse: torch's private fused Adam kernel cannot be used (%s, torch %s): the host "
                       "optimizer steps each shard with the optimizer's own fused step instead (same values, one "
                       "more pass over host memory)", problem, torch.__version__)
        return None
    return adam, adamw


@functools.cache
def kernel_divides_by_grad_scale() -> bool:
    """Whether the fused Adam and AdamW kernels' ``grad_scale`` gives, bit for bit, what dividing each gradient by it
    (``Tensor.div_``) and then running the kernel without it gives, the quotient written back into the gradient
    (checked once per process on tiny random tensors). False (after one warning) where it does not or the kernel
    is unusable: ``OffloadOptimizer(clip_in_update=True)`` then divides in a pass of its own (same values)."""
    kernels = fused_adam_kernels()
    problem = "the fused kernel is unusable" if kernels is None else (
        _probe_grad_scale(kernels[0]) or _probe_grad_scale(kernels[1]))
    if problem is not None:
        logger.warning("shardfuse: torch's fused Adam kernel's grad_scale cannot scale clipping (%s, torch %s): "
                       "clip_in_update divides the gradients in a separate pass instead (same values, one more "
                       "pass over host memory)", problem, torch.__version__)
    return problem is None


def _probe_grad_scale(kernel: FusedKernel) -> str | None:
    n = 257
    inverse = torch.reciprocal(torch.tensor(0.3183, dtype=torch.float32))  # 1 / coef, not a power of two
    runs = []
    for in_kernel in (True, False):
        gen = torch.Generator().manual_seed(4321)  # both runs see the same values
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
        step = torch.tensor(3.0)
        if not in_kernel:
            g.div_(inverse)
        kwargs = dict(amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False,
                      grad_scale=inverse if in_kernel else None, found_inf=None)
        try:
            with torch.no_grad():
                call_fused_adam(kernel, [p], [g], [m], [v], [], [step], kwargs)
        except Exception as err:  # noqa: BLE001 - a moved signature raises TypeError/RuntimeError: reported
            return f"calling it with grad_scale raised {type(err).__name__}: {err}"
        runs.append((p, g, m, v))
    for name, a, b in zip(("param", "gradient", "exp_avg", "exp_avg_sq"), *runs):
        if not torch.equal(a, b):
            return f"its {name} differs from dividing first"
    return None
