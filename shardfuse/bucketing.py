"""Pad variable-length token batches to a few fixed lengths, so that a captured step keeps a few graphs.

:func:`shardfuse.capture_step` keeps one CUDA graph per input shape. Real batches (SFT, packed documents cut at
sample ends) come in every length; padding each batch at its end up to the next of a few *bucket* lengths
turns them into a few shapes, one graph each::

    batch = shardfuse.pad_to_bucket(sequences, buckets=(256, 512, 1024, 2048), pad_id=tokenizer.pad_token_id)
    loss = train_step(batch.input_ids, batch.labels)

The loss stays the unpadded one: the padding sits after every real token and a causal model's real positions
never attend to later ones, so their logits keep their values, and the padded positions' labels are
``ignore_index``, so the mean over labelled tokens counts the same tokens. (Not bit for bit: attention and the
loss reduce over the padded length in another order, a float32 rounding difference of about 1e-7.)
No attention mask is needed for that: pass ``attention_mask`` only where a model needs one (left padding, a
non-causal model); Hugging Face models may read a mask's values on the host, which a captured step cannot do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DEFAULT_BUCKETS", "PaddedBatch", "bucket_length", "pad_to_bucket"]

DEFAULT_BUCKETS = (256, 512, 1024, 2048)


@dataclass(frozen=True)
class PaddedBatch:
    """A batch padded at the end of every row to ``bucket`` tokens (tensors of shape ``(batch, bucket)``)."""

    input_ids: torch.Tensor
    """The token ids, ``pad_id`` after each row's end."""
    labels: torch.Tensor
    """The labels (the ids, or the labels given), ``ignore_index`` after each row's end."""
    attention_mask: torch.Tensor
    """1 on real tokens, 0 on padding (int64)."""
    position_ids: torch.Tensor
    """0, 1, 2, ... on every row (what a causal model uses without padding too)."""
    lengths: torch.Tensor
    """Each row's real length (int64, shape ``(batch,)``)."""

    @property
    def bucket(self) -> int:
        """The padded length."""
        return int(self.input_ids.shape[1])


def _check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    values = tuple(buckets)
    if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values) \
            or list(values) != sorted(set(values)):
        raise ValueError(
            f"pad_to_bucket(buckets={buckets!r}): needs increasing positive ints, e.g. {DEFAULT_BUCKETS}"
        )
    return values


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket that holds ``length`` tokens; ValueError past the largest."""
    values = _check_buckets(buckets)
    for bucket in values:
        if length <= bucket:
            return bucket
    raise ValueError(
        f"a sequence of {length} tokens is longer than the largest bucket {values[-1]} (buckets={values}): "
        f"truncate it to {values[-1]} tokens, or add a larger bucket"
    )


def _rows(x: torch.Tensor | Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise ValueError(f"pad_to_bucket: {what} of shape {tuple(x.shape)}: pass a (batch, seq) tensor or a "
                             f"list of 1-D tensors")
        return list(x.unbind(0))
    rows = list(x)
    bad = [i for i, r in enumerate(rows) if not isinstance(r, torch.Tensor) or r.dim() != 1]
    if not rows or bad:
        raise ValueError(f"pad_to_bucket: {what} must be a (batch, seq) tensor or a non-empty list of 1-D tensors; "
                         f"rows {bad} are not 1-D tensors")
    return rows


def _global_max(length: int, group: Any) -> int:
    """The longest row over every rank of ``group`` (one all-reduce of one int)."""
    import torch.distributed as dist

    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    value = torch.tensor([length], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


def pad_to_bucket(input_ids: torch.Tensor | Sequence[torch.Tensor], labels: Any = None, *,
                  buckets: Sequence[int] = DEFAULT_BUCKETS, pad_id: int = 0, ignore_index: int = -100,
                  same_on_all_ranks: bool = False, group: Any = None) -> PaddedBatch:
    """Pad a batch at the end of each row to the smallest of ``buckets`` that holds its longest row.

    ``input_ids``: a ``(batch, seq)`` tensor or a list of 1-D tensors of any lengths (one per row).
    ``labels``: the same shape(s), e.g. ids with ``ignore_index`` on prompt tokens for SFT; default the ids
    (a causal LM's model or loss shifts them). ``pad_id``: any token id (a causal model's real positions
    never see the padding). With ``same_on_all_ranks=True`` every rank of ``group`` (default: the world)
    pads to the same bucket, the one of the longest row over all ranks (one all-reduce): in a multi-rank
    job with :func:`shardfuse.capture_step` every rank then meets a new shape at the same call.

    Returns a :class:`PaddedBatch` on the ids' device.
    """
    values = _check_buckets(buckets)
    ids = _rows(input_ids, "input_ids")
    labs = [r.clone() for r in ids] if labels is None else _rows(labels, "labels")
    if len(labs) != len(ids) or any(a.shape != b.shape for a, b in zip(ids, labs)):
        raise ValueError(
            f"pad_to_bucket: labels {[tuple(r.shape) for r in labs]} do not match input_ids "
            f"{[tuple(r.shape) for r in ids]}: give one label per token"
        )
    longest = max(int(r.shape[0]) for r in ids)
    if same_on_all_ranks:
        longest = _global_max(longest, group)
    bucket = bucket_length(longest, values)
    device = ids[0].device
    lengths = torch.tensor([int(r.shape[0]) for r in ids], dtype=torch.int64)
    out_ids = torch.full((len(ids), bucket), pad_id, dtype=ids[0].dtype, device=device)
    out_labels = torch.full((len(ids), bucket), ignore_index, dtype=labs[0].dtype, device=device)
    for i, (row, lab) in enumerate(zip(ids, labs)):
        out_ids[i, : row.shape[0]] = row
        out_labels[i, : lab.shape[0]] = lab
    positions = torch.arange(bucket, device=device)
    mask = (positions[None, :] < lengths.to(device)[:, None]).to(torch.int64)
    return PaddedBatch(out_ids, out_labels, mask, positions.expand(len(ids), bucket).clone(), lengths.to(device))
