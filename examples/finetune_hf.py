"""Fine-tune a Hugging Face Llama with shardfuse under torchrun (the recipe of docs/recipes.md).

    torchrun --standalone --nproc_per_node 2 examples/finetune_hf.py                 # CPU (gloo): tiny config
    torchrun --standalone --nproc_per_node 2 examples/finetune_hf.py --config 1b     # 2 GPUs (NCCL), ~1B params

The model is built on the meta device and each decoder layer (from the model's ``_no_split_modules``) becomes
one unit that materialises and initialises only its own parameters, so the model never exists whole on a rank.
Original parameter names stay (``use_orig_params=True``), so the optimizer skips weight decay on norms and
biases. The training step is compiled; the model is evaluated before training and every ``--eval-every``
steps; halfway a sharded checkpoint goes through ``torch.distributed.checkpoint``, and a fresh model and
optimizer resume from it with the same losses as the run that goes on (the script checks, exit code 1 if not);
the end generates a few tokens. Data are random tokens: this shows the mechanics, not a language model.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from transformers import LlamaConfig, LlamaForCausalLM

import shardfuse
from shardfuse import FullyShardedDataParallel as FSDP

CONFIGS = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048),
}


def build(cfg: LlamaConfig, device: torch.device) -> torch.nn.Module:
    """The model on the meta device, wrapped one unit per decoder layer; each unit initialises its own part."""
    torch.manual_seed(0)  # every rank must start from the same values (the first forward checks)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    init_module = model._init_weights  # transformers' initialiser of one module

    def param_init_fn(module: torch.nn.Module) -> None:
        module.to_empty(device=device, recurse=False)
        init_module(module)

    mixed = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    with shardfuse.enable_wrap(wrapper_cls=FSDP, use_orig_params=True, param_init_fn=param_init_fn,
                               **(mixed if device.type == "cuda" else {})):
        policy = shardfuse.no_split_modules_policy(model)
        return shardfuse.wrap(shardfuse.auto_wrap(model, auto_wrap_policy=policy))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with no weight decay on norms and biases, chosen by the original parameter names."""
    no_decay = [p for n, p in model.named_parameters() if "norm" in n or n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not any(p is q for q in no_decay)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-3)


def batches(cfg: LlamaConfig, args: argparse.Namespace, rank: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
            for _ in range(args.steps)]


def train_step(step_model: torch.nn.Module, model: FSDP, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = step_model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.clip_grad_norm_(1.0)  # the global norm over every rank's shards
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


@torch.inference_mode()
def evaluate(model: torch.nn.Module, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss.float()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def parse_args() -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--no-compile", action="store_true", help="train eagerly")
    p.add_argument("--checkpoint-dir", default=None, help="where the sharded checkpoint goes (default: a temp dir)")
    return p.parse_args()


def init_distributed() -> tuple[int, int, torch.device]:
    """Join torchrun's process group (NCCL on GPUs, else gloo); returns (rank, world size, this rank's device)."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        # Deterministic kernels (cuBLAS workspace, cuDNN attention's backward, no atomics in compiled code), so
        # the resumed run can match the run it resumes to 1e-5: without them bf16 training drifts 1e-4..1e-3 in a
        # few steps from summation order alone.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def resume_and_replay(
    cfg: LlamaConfig, device: torch.device, ckpt: str, data: list[torch.Tensor], args: argparse.Namespace
) -> list[float]:
    """A fresh model and optimizer loaded from the checkpoint (no dummy step) train the second half again."""
    half = args.steps // 2
    fresh = build(cfg, device)
    fresh_opt = make_optimizer(fresh)
    state = fresh.sharded_state_dict(fresh_opt)
    dcp.load(state, checkpoint_id=ckpt)
    fresh.load_sharded_state_dict(state, fresh_opt)
    fresh_step = fresh if args.no_compile else torch.compile(fresh)  # the same kernels as the run it resumes
    return [train_step(fresh_step, fresh, fresh_opt, data[step]) for step in range(half, args.steps)]


def main() -> int:
    """Train, check a run resumed from the halfway checkpoint against it, generate; returns the exit code."""
    args = parse_args()
    rank, world, device = init_distributed()
    cfg = LlamaConfig(**CONFIGS[args.config])
    data = batches(cfg, args, rank, device)
    held_out = batches(cfg, args, rank + world, device)[0]

    model = build(cfg, device)
    opt = make_optimizer(model)
    step_model = model if args.no_compile else torch.compile(model)
    say = print if rank == 0 else (lambda *a, **k: None)
    total = torch.tensor(sum(p.numel() for p in model.parameters()), device=device)
    dist.all_reduce(total)  # each rank holds its pieces of the original parameters
    say(f"{world} x {device.type}: {total.item():,} parameters in {sum(isinstance(m, FSDP) for m in model.modules())} "
        f"units")
    say(f"eval before training: {evaluate(model, held_out):.4f}")

    ckpt = args.checkpoint_dir or tempfile.mkdtemp(prefix="shardfuse-ckpt-") if rank == 0 else None
    box = [ckpt]
    dist.broadcast_object_list(box)
    ckpt = box[0]
    half = args.steps // 2
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        losses.append(train_step(step_model, model, opt, data[step]))
        took = time.perf_counter() - start
        say(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  {took:.2f} s  "
            f"{args.batch * args.seq / took:,.0f} tok/s/{device.type}")
        if (step + 1) % args.eval_every == 0:
            say(f"eval after step {step + 1}: {evaluate(model, held_out):.4f}")
        if step + 1 == half:
            dcp.save(model.sharded_state_dict(opt), checkpoint_id=ckpt)  # each rank writes its own shards

    resumed = resume_and_replay(cfg, device, ckpt, data, args)
    diffs = [abs(a - b) for a, b in zip(resumed, losses[half:])]
    diff = max(diffs)
    ok = diff <= (1e-5 if not args.no_compile else 0.0) + 1e-6
    say(f"resumed from the checkpoint: loss differences {' '.join(f'{d:.1e}' for d in diffs)} over "
        f"{len(resumed)} steps (max {diff:.2e}): {'PASS' if ok else 'FAIL'}")

    with torch.no_grad():
        prompt = data[0][:1, :8]
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    say(f"generated: {tokens[0, 8:].tolist()}")
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # main()'s models are gone once collected: a gloo group still held by them at interpreter exit can abort the
    # process ("terminate called without an active exception"; docs/troubleshooting.md).
    gc.collect()
    dist.destroy_process_group()
    raise SystemExit(code)
