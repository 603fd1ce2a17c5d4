"""``shardfuse.pad_to_bucket``: variable-length batches padded at the end to a few bucket lengths, with the loss
of the unpadded batch (a Hugging Face Llama and the example decoder), and the same bucket on every rank.

Why a tolerance and not bit equality for the losses: padding at the end leaves a causal model's real positions
mathematically unchanged (they never attend to later positions, and the padded labels are ignored), but the
attention kernels and the loss's mean reduce over the padded length in another order, so float32 results move
by a few ulp (measured: up to 5e-7 on a loss near 4.8, 1.5e-7 on logits). rtol 1e-5 allows ~20x that, while
leaving the padding in the loss (the bug this guards against) moves it by far more; each test checks that too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardfuse
from examples.llama import Llama, LlamaConfig, next_token_loss
from shardfuse import PaddedBatch, bucket_length, pad_to_bucket

WORLD = 2
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _lengths(n: int, lo: int, hi: int) -> list[int]:
    return torch.randint(lo, hi + 1, (n,)).tolist()


def test_layout_of_a_padded_batch():
    """Rows of random lengths: the smallest bucket that holds the longest, ids then pad_id, labels then
    ignore_index, the mask, positions and lengths; given labels (a masked prompt) are kept."""
    lengths = _lengths(5, 3, 40)
    rows = [torch.randint(1, 100, (n,)) for n in lengths]
    labels = [r.clone() for r in rows]
    for lab in labels:
        lab[: len(lab) // 3] = -100  # an SFT prompt: no loss on it
    out = pad_to_bucket(rows, labels, buckets=(8, 16, 32, 48), pad_id=7, ignore_index=-100)
    want = min(b for b in (8, 16, 32, 48) if b >= max(lengths))
    assert isinstance(out, PaddedBatch) and out.bucket == want
    assert out.input_ids.shape == out.labels.shape == out.attention_mask.shape == out.position_ids.shape == (5, want)
    assert out.input_ids.dtype == torch.int64 and out.lengths.tolist() == lengths
    for i, n in enumerate(lengths):
        assert torch.equal(out.input_ids[i, :n], rows[i]) and (out.input_ids[i, n:] == 7).all()
        assert torch.equal(out.labels[i, :n], labels[i]) and (out.labels[i, n:] == -100).all()
        assert out.attention_mask[i].tolist() == [1] * n + [0] * (want - n)
        assert out.position_ids[i].tolist() == list(range(want))
    # A (batch, seq) tensor: every row is real; labels default to the ids.
    ids = torch.randint(0, 50, (3, 11))
    same = pad_to_bucket(ids, buckets=(4, 12))
    assert same.bucket == 12 and torch.equal(same.input_ids[:, :11], ids) and torch.equal(same.labels[:, :11], ids)
    assert (same.labels[:, 11:] == -100).all() and (same.input_ids[:, 11:] == 0).all()


def test_bucket_length_and_errors():
    assert [bucket_length(n, (4, 8, 16)) for n in (1, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 16, 16]
    assert bucket_length(300) == 512 and shardfuse.bucketing.DEFAULT_BUCKETS == (256, 512, 1024, 2048)
    with pytest.raises(ValueError, match=r"17 tokens is longer than the largest bucket 16.*truncate it to 16"):
        pad_to_bucket([torch.zeros(17, dtype=torch.long)], buckets=(8, 16))
    for bad in [(), (8, 4), (0, 8), (8, 8), (4.0, 8)]:
        with pytest.raises(ValueError, match="needs increasing positive ints"):
            bucket_length(3, bad)
    with pytest.raises(ValueError, match=r"labels \[\(4,\)\] do not match input_ids \[\(5,\)\]"):
        pad_to_bucket([torch.zeros(5, dtype=torch.long)], [torch.zeros(4, dtype=torch.long)], buckets=(8,))
    with pytest.raises(ValueError, match=r"rows \[1\] are not 1-D"):
        pad_to_bucket([torch.zeros(5, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)], buckets=(8,))


def _hf_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg)


def test_hf_llama_loss_and_grads_equal_the_unpadded_batch():
    """Equal-length rows padded to a bucket: the loss and every gradient of the unpadded batch."""
    model = _hf_llama()
    ids = torch.randint(0, 96, (3, int(torch.randint(17, 32, ()))))  # padded to 32
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    batch = pad_to_bucket(ids, buckets=(16, 32, 64), pad_id=int(torch.randint(0, 96, ())))
    assert batch.bucket == 32
    loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
    loss.backward()
    torch.testing.assert_close(loss, ref, **LOSS_TOL)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    # The check can fail: with the padding labelled, the loss moves far outside the tolerance.
    wrong = model(input_ids=batch.input_ids, labels=batch.input_ids).loss
    assert not torch.allclose(wrong, ref, **LOSS_TOL)


def test_hf_llama_variable_lengths_loss_equals_per_row_losses():
    """Rows of different lengths in one padded batch: the token-weighted mean of each row's own loss."""
    model = _hf_llama()
    lengths = _lengths(4, 5, 40)
    rows = [torch.randint(0, 96, (n,)) for n in lengths]
    with torch.no_grad():
        per_row = [model(input_ids=r[None], labels=r[None]).loss.double() * (len(r) - 1) for r in rows]
        ref = (torch.stack(per_row).sum() / sum(n - 1 for n in lengths)).float()
        batch = pad_to_bucket(rows, buckets=(16, 32, 48))
        loss = model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids).loss
        # The mask changes nothing for right padding (real positions never see later ones).
        masked = model(input_ids=batch.input_ids, labels=batch.labels, attention_mask=batch.attention_mask).loss
    torch.testing.assert_close(loss, ref, **LOSS_TOL)
    torch.testing.assert_close(masked, ref, **LOSS_TOL)


def test_example_decoder_loss_equals_the_unpadded_batch():
    """examples/llama.py's decoder (SDPA, is_causal) with next_token_loss: F.cross_entropy ignores -100."""
    cfg = LlamaConfig.tiny()
    model = Llama(cfg).init_weights(int(torch.randint(0, 1000, ())))
    ids = torch.randint(0, cfg.vocab_size, (2, int(torch.randint(5, 24, ()))))
    ref = next_token_loss(model(ids)[:, :-1], ids[:, 1:])
    batch = pad_to_bucket(ids, buckets=(24, 32))
    logits = model(batch.input_ids)
    loss = next_token_loss(logits[:, :-1], batch.labels[:, 1:])
    torch.testing.assert_close(loss, ref, **LOSS_TOL)
    torch.testing.assert_close(logits[:, : ids.shape[1]], model(ids), rtol=1e-5, atol=1e-5)
    wrong = next_token_loss(logits[:, :-1], batch.input_ids[:, 1:])
    assert not torch.allclose(wrong, ref, **LOSS_TOL)


def check_same_bucket_on_all_ranks(lengths_by_rank: list[list[int]]) -> tuple[int, int]:
    rank = dist.get_rank()
    rows = [torch.zeros(n, dtype=torch.long) for n in lengths_by_rank[rank]]
    local = pad_to_bucket(rows, buckets=(8, 16, 32, 64)).bucket
    shared = pad_to_bucket(rows, buckets=(8, 16, 32, 64), same_on_all_ranks=True).bucket
    return local, shared


def test_same_bucket_on_all_ranks(pool):
    lengths = [_lengths(3, 1, 8), _lengths(3, 20, 60)]
    out = pool.run(check_same_bucket_on_all_ranks, lengths)
    want = [bucket_length(max(ls), (8, 16, 32, 64)) for ls in lengths]
    assert [local for local, _ in out] == want
    assert [shared for _, shared in out] == [max(want)] * WORLD
    # The longest over the ranks, not their sum: 9 and 10 share 16 (19 would take 32).
    assert pool.run(check_same_bucket_on_all_ranks, [[9, 3], [10]]) == [(16, 16), (16, 16)]
