"""Triton kernels for the sharded data path, each beside its plain-PyTorch reference.

Importable on their own: nothing here knows about process groups. CUDA tensors take the Triton path; CPU
tensors take the reference unless Triton's interpreter is on (``TRITON_INTERPRET=1``).

These are the validated forms: every argument is checked on every call. The sharding runtime calls the
trusted launches instead (``_cast.cast_shard_unchecked``, ``_grad_divide.pre_divide_pad_unchecked`` and
``post_divide_unchecked``), with arguments it checked once where it made the buffers (docs/kernels.md).
"""

from shardfuse.kernels._cast import cast_shard, cast_shard_ref
from shardfuse.kernels._cast_multi import cast_shards, cast_shards_ref
from shardfuse.kernels._chunk_cat import chunk_cat, chunk_cat_ref
from shardfuse.kernels._concat import concat_microbatches, concat_microbatches_ref, split_microbatches
from shardfuse.kernels._flatten import flatten_pad, flatten_pad_ref, padded_numel, unflatten_into, unflatten_into_ref
from shardfuse.kernels._fp8 import amax_to_scale, cast_fp8_shards, cast_fp8_shards_ref, fp8_amax, fp8_amax_ref
from shardfuse.kernels._grad_divide import gradient_divide_factors, post_divide, post_divide_ref, pre_divide_pad_ref
from shardfuse.kernels._grad_divide_multi import pre_divide_pad

__all__ = [
    "amax_to_scale",
    "cast_shard",
    "cast_shard_ref",
    "cast_shards",
    "cast_shards_ref",
    "chunk_cat",
    "chunk_cat_ref",
    "concat_microbatches",
    "cast_fp8_shards",
    "cast_fp8_shards_ref",
    "concat_microbatches_ref",
    "flatten_pad",
    "flatten_pad_ref",
    "fp8_amax",
    "fp8_amax_ref",
    "gradient_divide_factors",
    "padded_numel",
    "post_divide",
    "post_divide_ref",
    "pre_divide_pad",
    "pre_divide_pad_ref",
    "split_microbatches",
    "unflatten_into",
    "unflatten_into_ref",
]
