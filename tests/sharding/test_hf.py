"""A Hugging Face model end to end (tiny random-init LlamaForCausalLM, 2 gloo ranks): auto-wrap from
``_no_split_modules``, training against the unsharded model, generate(), save_pretrained()/from_pretrained(),
torch.compile. Skipped without transformers (an optional test dependency)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from shardfuse import FullyShardedDataParallel as FSDP  # noqa: E402
from shardfuse import auto_wrap, enable_wrap, no_split_modules_policy, wrap  # noqa: E402

WORLD = 2


def _tiny_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _wrap(model: torch.nn.Module, **kw) -> FSDP:
    with enable_wrap(wrapper_cls=FSDP, **kw):
        return wrap(auto_wrap(model, auto_wrap_policy=no_split_modules_policy(model)))


def check_hf_llama(save_dir: str) -> bool:
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = _tiny_llama()
    model = _wrap(copy.deepcopy(ref))
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    assert len(units) == 3, "one unit per LlamaDecoderLayer plus the root"
    prompt = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(1))
    # Evaluation first: generate (KV cache, many forwards under no_grad) equals the unsharded model's tokens.
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=5, do_sample=False)
        got = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want), (got, want)
    # Training equals unsharded training on the union of the ranks' batches.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(2):
        batches = [torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(10 * step + r))
                   for r in range(ws)]
        opt.zero_grad()
        loss = model(input_ids=batches[rank], labels=batches[rank]).loss
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        for b in batches:
            (ref(input_ids=b, labels=b).loss / ws).backward()
        ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    # save_pretrained writes every tensor (the root's own embeddings, norm and head too); from_pretrained
    # weights load back into a wrapped model.
    model.save_pretrained(save_dir, is_main_process=rank == 0)
    dist.barrier()
    loaded = transformers.LlamaForCausalLM.from_pretrained(save_dir)
    want_sd = ref.state_dict()
    assert set(loaded.state_dict()) == set(want_sd)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want_sd[k]), k
    fresh = _wrap(_tiny_llama())
    fresh.load_state_dict(loaded.state_dict())
    ids = batches[rank]
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)
    # torch.compile of the wrapped model gives the eager losses.
    compiled = torch.compile(model)
    eager_loss = model(input_ids=ids, labels=ids).loss
    compiled_loss = compiled(input_ids=ids, labels=ids).loss
    assert abs(eager_loss.item() - compiled_loss.item()) <= 1e-5
    compiled_loss.backward()
    return True


def test_hf_llama_end_to_end(pool, tmp_path):
    assert pool.run(check_hf_llama, str(tmp_path / "llama")) == [True] * WORLD


def test_no_split_modules_policy_errors():
    with pytest.raises(ValueError, match="has no _no_split_modules"):
        no_split_modules_policy(torch.nn.Linear(2, 2))
