"""The one doorway from the sharding layer to the shardfuse kernels, under the kernels' own names.

Two kinds of kernel call pass through it (docs/kernels.md, "Validated forms and trusted launches"):

- **trusted launches**, on every step: :func:`cast_shard` before every all-gather, :func:`pre_divide_pad` and
  :func:`post_divide` around every reduce-scatter. They check no argument. :func:`check_plan` checked, once
  per flat parameter at lazy init (where the full buffer is made), everything they take for granted; the
  runtime then makes each step's buffers (this rank's slice of the full buffer, the reduce-scatter input and
  output, a new sharded gradient) in the sizes and dtypes that check covered.
- **validated kernels**, at wrap, load and state-dict time: :func:`flatten_pad`, :func:`unflatten_into` and
  :func:`gradient_divide_factors` read the user's tensors and settings, so they check every argument: these
  calls are the wrap-time checks (a float64 parameter is refused here).

The float8 shard cast (``fp8_amax``, ``cast_fp8_shards``, the float8 all-gather of ``_fp8_gather.py``) is a
validated kernel: it checks its arguments at each gather, a few tensors per flat parameter.

:func:`pre_divide_pad_pieces` takes the parameters' gradients of one flat parameter, kept apart by the unflatten
node (``_fused_grads.py``), into its padded reduce-scatter input: the list form of ``pre_divide_pad``, one launch
(validated on its first call with a set of tensors, cached after), or one trusted launch per gradient while a
CUDA graph is captured. The other multi-tensor kernels (``cast_shards``, ``chunk_cat``) are not here: each flat
parameter is one tensor, so the runtime has no list to hand them.
"""

from __future__ import annotations

import math

import torch

from shardfuse.kernels._cast import cast_shard_unchecked as cast_shard
from shardfuse.kernels._common import FLOAT_DTYPES
from shardfuse.kernels._flatten import flatten_pad, unflatten_into
from shardfuse.kernels._fp8 import FP8_DTYPE, cast_fp8_shards, fp8_amax
from shardfuse.kernels._grad_divide import gradient_divide_factors
from shardfuse.kernels._grad_divide import post_divide_unchecked as post_divide
from shardfuse.kernels._grad_divide import pre_divide_pad_unchecked as pre_divide_pad
from shardfuse.kernels._grad_divide_multi import pre_divide_pad as pre_divide_pad_list

__all__ = [
    "FP8_DTYPE",
    "cast_fp8_shards",
    "cast_shard",
    "check_plan",
    "flatten_pad",
    "fp8_amax",
    "gradient_divide_factors",
    "post_divide",
    "pre_divide_pad",
    "pre_divide_pad_pieces",
    "unflatten_into",
]


def check_plan(
    shard: torch.Tensor,
    full: torch.Tensor,
    world_size: int,
    reduce_dtype: torch.dtype,
    predivide: float,
    postdivide: float,
    name: str = "",
) -> None:
    """Check once, where a flat parameter's full buffer is made, what the trusted launches take for granted.

    ``shard`` is this rank's flat shard, ``full`` the (possibly unallocated) padded full buffer in the
    compute dtype; each step the runtime casts the shard into ``full``'s slice of this rank, pre-divides
    the full gradient (``full``'s dtype) into a ``reduce_dtype`` buffer of ``full``'s length, and post-divides
    this rank's reduced slice into a gradient of the shard's dtype and size. ``name`` (a parameter name)
    goes into the errors.
    """
    what = f" of {name}" if name else ""
    for role, dtype in (("flat shard", shard.dtype), ("compute dtype", full.dtype), ("reduce dtype", reduce_dtype)):
        if dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"the {role}{what} is {dtype}, but the shardfuse data path moves only {list(FLOAT_DTYPES)}: "
                f"keep the parameters in fp32, bf16 or fp16 (e.g. module.float() before the first forward)"
            )
    if not shard.is_contiguous():
        raise ValueError(
            f"the flat shard{what} is not contiguous (shape={tuple(shard.shape)} stride={shard.stride()}): "
            f"give the flat parameter contiguous data (load values with load_state_dict)"
        )
    if not full.is_contiguous() or full.numel() != shard.numel() * world_size:
        raise ValueError(
            f"the full buffer{what} holds {full.numel()} elements, but {world_size=} shards of {shard.numel()} "
            f"need {shard.numel() * world_size}: the flat parameter was replaced by one of another size; "
            f"load values with load_state_dict instead"
        )
    for factor_name, factor in (("predivide", predivide), ("postdivide", postdivide)):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(
                f"the gradient {factor_name} factor{what} must be a finite number > 0, got {factor!r}: pass "
                f"finite factors to gradient_predivide_factor or set_gradient_divide_factors"
            )



def pre_divide_pad_pieces(grads: list[torch.Tensor], out: torch.Tensor, factor: float) -> None:
    """``pre_divide_pad(cat(grads), out, factor)`` without the concatenation: each gradient (contiguous, one
    dtype) scaled and cast into its slice of ``out``, the tail after them zero; the same bytes elementwise."""
    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        # The list form copies a table of the gradients' addresses from pinned host memory, which a graph would
        # copy again at every replay, after that memory went back to its pool: per gradient, the addresses are
        # kernel arguments the graph keeps.
        offset = 0
        for g in grads:
            if g.numel():
                pre_divide_pad(g, out.narrow(0, offset, g.numel()), factor)
            offset += g.numel()
        out.narrow(0, offset, out.numel() - offset).zero_()
        return
    pre_divide_pad_list(grads, out, factor)
