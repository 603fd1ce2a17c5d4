"""Supervised fine-tuning of a Hugging Face Llama on variable-length samples with a captured step (docs/recipes.md).

    torchrun --standalone --nproc_per_node 2 examples/sft_buckets.py                 # CPU (gloo): tiny config
    torchrun --standalone --nproc_per_node 2 examples/sft_buckets.py --config 1b     # 2 GPUs (NCCL), ~1B params

Every sample is a prompt and an answer of random lengths; the loss counts the answer only (the prompt's labels
are -100). Batches group samples of similar lengths (sorted, then shuffled batch by batch) and are padded at
their end to one of four bucket lengths (``shardfuse.pad_to_bucket``, the same bucket on every rank), so
``shardfuse.capture_step`` keeps four CUDA graphs, one per bucket, captured the first time each bucket comes;
the padded positions' labels are -100 too, so the loss is the unpadded batch's. The script trains twice from
the same weights on the same batches, eagerly and captured, and checks that the losses are equal bit for bit
(exit code 1 if not). On the CPU the captured step runs eagerly under the same contract. Data are random
tokens: this shows the mechanics, not a language model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import shardfuse
from shardfuse import FullyShardedDataParallel as FSDP

CONFIGS = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048),
}
BUCKETS = {"tiny": (16, 32, 48, 64), "1b": (256, 512, 1024, 2048)}


def build(cfg: LlamaConfig, device: torch.device, bf16: bool = False) -> FSDP:
    """The model, one unit per decoder layer; every rank starts from the same weights. ``bf16``: compute in
    bfloat16 on fp32 shards (mixed precision), as fine-tuning runs for real."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    precision = dict(mixed_precision=True, compute_dtype=torch.bfloat16) if bf16 else {}
    with shardfuse.enable_wrap(wrapper_cls=FSDP, **precision):
        return shardfuse.wrap(shardfuse.auto_wrap(model, auto_wrap_policy=shardfuse.no_split_modules_policy(model)))


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; on the GPU capturable (a graph steps it) and fused."""
    on_gpu = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, capturable=on_gpu, fused=on_gpu)


def samples(n: int, vocab: int, max_len: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (ids, labels) pairs of random lengths up to ``max_len``: a prompt (labels -100) and an answer."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, max_len + 1, (), generator=gen))
        prompt = int(torch.randint(1, length, (), generator=gen))
        ids = torch.randint(1, vocab, (length,), generator=gen)
        labels = ids.clone()
        labels[:prompt] = -100
        out.append((ids, labels))
    return out


def batches(data: list[tuple[torch.Tensor, torch.Tensor]], batch: int, buckets: tuple[int, ...],
            device: torch.device, seed: int = 0) -> list[shardfuse.PaddedBatch]:
    """This rank's batches, grouped by length: the samples (the same list on every rank) sorted by length and cut
    into global batches of ``batch`` per rank, in a shuffled order (the same on every rank); each rank pads its
    part at the end to the bucket of the longest on any rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    by_length = sorted(data, key=lambda s: len(s[0]))
    size = batch * world
    groups = [by_length[i: i + size] for i in range(0, len(by_length) - size + 1, size)]
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for g in order:
        part = groups[g][rank * batch: (rank + 1) * batch]
        ids, labels = [i.to(device) for i, _ in part], [lab.to(device) for _, lab in part]
        out.append(shardfuse.pad_to_bucket(ids, labels, buckets=buckets, pad_id=0, same_on_all_ranks=True))
    return out


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    """One training step on a padded batch: no host synchronisation inside, so it can be captured."""

    def step(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=input_ids, use_cache=False).logits
        # Next-token loss over the labelled tokens only: the prompt's and the padding's labels are -100.
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def train(cfg: LlamaConfig, device: torch.device, data: list[shardfuse.PaddedBatch], captured: bool,
          warmup: int = 2) -> tuple[list[float], list[tuple]]:
    """Train a fresh model: ``warmup`` steps on the first batch, then one step per batch. Returns the losses and
    (captured) the signatures kept."""
    model = build(cfg, device)
    opt = make_optimizer(model, device)
    step = make_step(model, opt)
    first = data[0]
    if not captured:
        for _ in range(warmup):
            step(first.input_ids, first.labels)
        return [step(b.input_ids, b.labels).item() for b in data[1:]], []
    with shardfuse.capture_step(step, first.input_ids, first.labels, warmup=warmup, max_graphs=4) as train_step:
        losses = [train_step(b.input_ids, b.labels).item() for b in data[1:]]
        return losses, train_step.signatures


@contextlib.contextmanager
def exact_attention(device: torch.device) -> Iterator[None]:
    """On CUDA, attention through SDPA's math backend: the fused kernels' backward accumulates with atomics, so
    two runs (eager and captured) would differ in the last bits. Drop it when training for real."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def compare(config: str, device: torch.device, steps: int = 12, batch: int = 4) -> dict[str, Any]:
    """The eager and the captured run on the same batches (every rank calls it)."""
    cfg = LlamaConfig(**CONFIGS[config], attn_implementation="sdpa")
    buckets = BUCKETS[config]
    world = dist.get_world_size()
    data = batches(samples((steps + 1) * batch * world, cfg.vocab_size, buckets[-1], seed=100), batch, buckets, device)
    with exact_attention(device):
        eager, _ = train(cfg, device, data, captured=False)
        captured, signatures = train(cfg, device, data, captured=True)
    return {"eager": eager, "captured": captured, "signatures": signatures,
            "buckets": [b.bucket for b in data]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    out = compare(args.config, device, args.steps, args.batch)
    same = out["eager"] == out["captured"]
    if dist.get_rank() == 0:
        print(f"buckets per step: {out['buckets'][1:]}; graphs kept: {len(out['signatures'])}")
        for i, (a, b) in enumerate(zip(out["eager"], out["captured"])):
            print(f"step {i + 1:2d}  bucket {out['buckets'][i + 1]:5d}  eager {a:.6f}  captured {b:.6f}")
        print(f"captured losses equal the eager loop's: {'PASS' if same else 'FAIL'}")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
