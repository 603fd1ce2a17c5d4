"""Train the Llama-style decoder sharded with shardfuse across 2 processes, then check it against unsharded training.

    python examples/train.py                          # spawns 2 processes itself
    torchrun --nproc_per_node 4 examples/train.py     # uses the world torchrun gives it
    python examples/train.py --mesh 2,2               # hybrid sharding: 2 replicas x 2 shards, 4 processes

    # two nodes, 8 GPUs each: shard inside a node, replicate across nodes (on node 0, then --node-rank 1 on node 1)
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint node0:29500 \
        --rdzv-id job1 examples/train.py --mesh 2,8

Needs shardfuse importable (``pip install -e .``, as the README's quickstart does). When it spawns its own
processes, each rank gets ``cores // world_size`` CPU threads (at least 1; ``OMP_NUM_THREADS`` wins when set),
as torchrun's one thread per rank would: N ranks with every core each oversubscribe the CPU several times.

With at least ``--world-size`` CUDA GPUs: NCCL, one GPU per rank, the ~220M-parameter ``small`` config, bf16
mixed precision with fp32 reduce-scatter, 20 steps. Without GPUs: gloo on the CPU, the ``tiny`` config in full
fp32, 8 steps (a few seconds). Each decoder layer is one sharded unit, plus the root (embeddings, final norm,
output). With ``--mesh R,S`` every unit is wrapped with ``device_mesh=`` a 2-D mesh ``(R, S)`` with dims
``("replicate", "shard")`` (hybrid sharding: S shards per replica, R replicas); R * S must be the world size.
The data are seeded random token ids, cycled through a few distinct global batches so that the loss visibly drops
(the model memorises them); the objective is next-token prediction; the optimizer AdamW.

Rank 0 prints one line per step: the loss, tokens/s per GPU (per rank on the CPU), the peak memory, the time so
far and the estimated time left. At the end it writes a plot of the loss and the throughput per step to
``--plot`` (default ``out/train.png``; ``--plot ''`` for none) when matplotlib is installed (``pip install
matplotlib``; without it there is no plot and no complaint) and prints its path.

At the end rank 0 replays the same training on the unsharded model, on the same global batches, each rank's
micro-batch separately with the gradients summed in fp32 and averaged (what sharded data parallelism
computes), and reports the largest difference of the per-step losses and of the final parameters: PASS or FAIL
against the tolerances printed with them (exit code 1 on FAIL). In fp32 the two runs differ only in the order of
floating-point reductions; with mixed precision the reference computes in a bf16 copy of the fp32 parameters,
as the sharded wrapper does, so there the tolerance is looser (kernel choice may differ with alignment).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from shardfuse.sharding._wrap import ModuleClassWrapPolicy, auto_wrap, enable_wrap, wrap

if __package__:  # imported as examples.train (the tests) or run as `python -m examples.train`
    from .llama import DecoderLayer, Llama, LlamaConfig, count_params, next_token_loss
else:  # `python examples/train.py`: Python put this file's folder first on sys.path
    from llama import DecoderLayer, Llama, LlamaConfig, count_params, next_token_loss

# (loss, parameter) tolerances of the parity check; see the module docstring for why they differ.
TOL_FP32 = (1e-5, 1e-5)
TOL_MIXED = (2e-2, 1e-1)  # with mixed precision the parameter check is relative: |p - p_ref| / |p_ref - p0|


def fsdp_class() -> type[torch.nn.Module]:
    """shardfuse's FullyShardedDataParallel (from the package root once exported there)."""
    try:
        from shardfuse import FullyShardedDataParallel
    except ImportError:
        from shardfuse.sharding._fully_sharded import FullyShardedDataParallel
    return FullyShardedDataParallel


def parse_mesh(text: str) -> tuple[int, int]:
    """``"R,S"`` -> ``(R, S)``, both >= 1 (an ``argparse`` type)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected R,S (replicas,shards), two integers >= 1, got {text!r}")
    return int(parts[0]), int(parts[1])


def check_mesh(mesh: tuple[int, int] | None, world: int) -> None:
    """Exit with a message unless the ``--mesh`` shape covers exactly ``world`` ranks."""
    if mesh is not None and mesh[0] * mesh[1] != world:
        raise SystemExit(f"--mesh {mesh[0]},{mesh[1]} needs R * S = {mesh[0] * mesh[1]} processes, "
                         f"but the world size is {world}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments; unset ones get device-dependent defaults in :func:`resolve_defaults`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 20 on GPUs, 8 on CPU)")
    p.add_argument("--config", choices=("tiny", "small", "bench"), default=None,
                   help="model size (default: small on GPUs, tiny on CPU)")
    p.add_argument("--mixed-precision", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 compute with fp32 reduce-scatter (default: on for GPUs, off on CPU)")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes to spawn when not under torchrun (default: R * S with --mesh, else 2)")
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="R,S",
                   help="hybrid sharding on a (replicate, shard) device mesh of R x S ranks (default: flat sharding)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: min(max_seq, 1024))")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: 3e-3 tiny, 3e-4 else)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0 disables)")
    p.add_argument("--num-batches", type=int, default=2, help="distinct synthetic global batches, cycled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-parity", action="store_true", help="skip the unsharded reference run")
    p.add_argument("--cpu", action="store_true", help="use gloo on the CPU even if GPUs are present")
    p.add_argument("--plot", default=os.path.join("out", "train.png"),
                   help="PNG of loss and throughput per step, written at the end if matplotlib is installed "
                        "(default out/train.png; '' for none)")
    args = p.parse_args(argv)
    if args.world_size is None:
        args.world_size = args.mesh[0] * args.mesh[1] if args.mesh else 2
    return args


def resolve_defaults(args: argparse.Namespace, use_cuda: bool) -> argparse.Namespace:
    """Fill the device-dependent defaults and validate the rest."""
    args.steps = args.steps if args.steps is not None else (20 if use_cuda else 8)
    args.config = args.config or ("small" if use_cuda else "tiny")
    args.mixed_precision = use_cuda if args.mixed_precision is None else args.mixed_precision
    cfg = LlamaConfig.named(args.config)
    args.seq_len = args.seq_len or min(cfg.max_seq_len, 1024)
    args.lr = args.lr if args.lr is not None else (3e-3 if args.config == "tiny" else 3e-4)
    for name in ("steps", "world_size", "batch_size", "seq_len", "num_batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len > cfg.max_seq_len:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds the {args.config} config's max_seq_len={cfg.max_seq_len}")
    if args.mixed_precision and not use_cuda and os.environ.get("RANK", "0") == "0":
        print("note: bf16 mixed precision on the CPU is slow and only loosely checked", flush=True)
    return args


def make_batches(args: argparse.Namespace, vocab: int, world: int) -> torch.Tensor:
    """Seeded random token ids: (num_batches, world * batch_size, seq_len + 1), the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed + 12345)
    return torch.randint(0, vocab, (args.num_batches, world * args.batch_size, args.seq_len + 1), generator=gen)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's peak RSS on the CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def strip_wrapper_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove wrapper-inserted name segments, in case a state dict carries them."""
    drop = ("_fsdp_wrapped_module.", "_fpw_module.")
    out = {}
    for key, value in state.items():
        for seg in drop:
            key = key.replace(seg, "")
        out[key] = value
    return out


def train_reference(
    model: torch.nn.Module, batches: torch.Tensor, args: argparse.Namespace, world: int, device: torch.device
) -> list[float]:
    """Unsharded training of ``model`` in place on the same global batches; returns the per-step losses.

    Each rank's micro-batch runs separately and the fp32 gradients are summed and divided by the world size,
    which is what the sharded run computes; with mixed precision the micro-batches run in a bf16 copy.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = list(model.parameters())
    compute = copy.deepcopy(model).to(torch.bfloat16) if args.mixed_precision else model
    compute_params = list(compute.parameters())
    losses = []
    for step in range(args.steps):
        batch = batches[step % args.num_batches].to(device)
        if compute is not model:
            with torch.no_grad():
                for cp, p in zip(compute_params, params):
                    cp.copy_(p)
        grads = [torch.zeros_like(p) for p in params]
        step_loss = 0.0
        for r in range(world):
            micro = batch[r * args.batch_size:(r + 1) * args.batch_size]
            loss = next_token_loss(compute(micro[:, :-1]), micro[:, 1:])
            loss.backward()
            with torch.no_grad():
                for g, cp in zip(grads, compute_params):
                    g.add_(cp.grad.float())
                    cp.grad = None
            step_loss += loss.item()
        for p, g in zip(params, grads):
            p.grad = g.div_(world)
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss / world)
    return losses


def compare(
    losses: list[float], ref_losses: list[float], state: dict[str, torch.Tensor], ref_model: torch.nn.Module,
    init: dict[str, torch.Tensor], mixed: bool,
) -> bool:
    """Print the parity report; True on PASS."""
    state = strip_wrapper_names(state)
    ref_state = {k: v for k, v in ref_model.state_dict().items() if k in init}
    if set(state) != set(ref_state):
        print(f"FAIL: state dict names differ: only sharded {sorted(set(state) - set(ref_state))[:5]}, "
              f"only reference {sorted(set(ref_state) - set(state))[:5]}")
        return False
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    abs_diff = {}  # name -> max |p - p_ref|
    rel_diff = {}  # name -> |p - p_ref| / |p_ref - p_init|: the error relative to how far training moved it
    for name, ref in ref_state.items():
        err = state[name].to(ref.device, torch.float32) - ref.float()
        abs_diff[name] = err.abs().max().item()
        rel_diff[name] = err.norm().item() / max((ref.float() - init[name].float()).norm().item(), 1e-30)
    metric = rel_diff if mixed else abs_diff
    worst = max(metric, key=lambda k: metric[k] if math.isfinite(metric[k]) else math.inf)
    tol_loss, tol_param = TOL_MIXED if mixed else TOL_FP32
    values = [loss_diff, metric[worst], *losses]
    ok = all(math.isfinite(v) for v in values) and loss_diff <= tol_loss and metric[worst] <= tol_param
    what = "max relative update diff" if mixed else "max abs param diff"
    print(f"parity vs unsharded ({'bf16 mixed precision' if mixed else 'fp32'}): "
          f"max abs loss diff {loss_diff:.3e} (tol {tol_loss:g}), {what} {metric[worst]:.3e} (tol {tol_param:g}, "
          f"at {worst})" + (f", max abs param diff {max(abs_diff.values()):.3e}" if mixed else ""))
    print("PASS" if ok else "FAIL")
    return ok


def wrap_sharded(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """Each decoder layer, then the root, as a shardfuse unit (on the ``--mesh`` device mesh when given)."""
    fsdp = fsdp_class()
    extra: dict[str, object] = {}
    if args.mixed_precision:
        extra.update(compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    if args.mesh is not None:  # hybrid sharding: every unit on the same (replicate, shard) mesh
        extra["device_mesh"] = init_device_mesh(device.type, args.mesh, mesh_dim_names=("replicate", "shard"))
    with enable_wrap(wrapper_cls=fsdp, mixed_precision=args.mixed_precision, **extra):
        model = auto_wrap(model, auto_wrap_policy=ModuleClassWrapPolicy({DecoderLayer}))
        model = wrap(model)
    return model


def fmt_seconds(s: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: short, for a progress line."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def progress_line(step: int, steps: int, loss: float, tok_s: float, unit: str, peak: str, times: list[float]) -> str:
    """One compact line per step: loss, throughput, peak memory, elapsed and the time left (from the steps after
    the first, which pays for warm-up, when there are any)."""
    elapsed = sum(times)
    recent = times[1:] if len(times) > 1 else times
    eta = (steps - step) * sum(recent) / len(recent)
    return (f"step {step:3d}/{steps}  loss {loss:.4f}  {tok_s:10,.0f} tok/s/{unit}  {peak}  "
            f"elapsed {fmt_seconds(elapsed)}  eta {fmt_seconds(eta)}")


def write_plot(path: str, losses: list[float], tok_s: list[float], unit: str) -> str | None:
    """Loss and throughput per step as a PNG at ``path``; None (nothing written) without matplotlib or path."""
    if not path:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    steps = list(range(1, len(losses) + 1))
    fig, (ax_loss, ax_tok) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, losses, marker="o")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("examples/train.py")
    ax_tok.plot(steps, tok_s, marker="o", color="tab:green")
    ax_tok.set_ylabel(f"tokens/s/{unit}")
    ax_tok.set_xlabel("step")
    ax_tok.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def train_sharded(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batches: torch.Tensor, args: argparse.Namespace, rank: int,
    world: int, device: torch.device,
) -> tuple[list[float], list[float]]:
    """The sharded training loop on this rank's micro-batches; returns the global batch's loss per step and this
    rank's tokens/s per step."""
    use_cuda = device.type == "cuda"
    losses: list[float] = []
    rates: list[float] = []
    times: list[float] = []
    tokens_per_rank = args.batch_size * args.seq_len
    unit = "GPU" if use_cuda else "rank"
    for step in range(args.steps):
        micro = batches[step % args.num_batches, rank * args.batch_size:(rank + 1) * args.batch_size]
        if use_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = next_token_loss(model(micro[:, :-1]), micro[:, 1:])
        loss.backward()
        if args.max_grad_norm > 0:
            model.clip_grad_norm_(args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if use_cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        # Equal micro-batch sizes: the mean of the ranks' losses is the loss of the global batch.
        global_loss = loss.detach().float().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        rates.append(tokens_per_rank / dt)
        times.append(dt)
        if rank == 0:
            peak = f"peak {'mem' if use_cuda else 'RSS'} {peak_memory_gib(device):.2f} GiB"
            print(progress_line(step + 1, args.steps, losses[-1], rates[-1], unit, peak, times), flush=True)
    if rank == 0:
        later = rates[1:] or rates
        print(f"trained {args.steps} steps in {fmt_seconds(sum(times))}: {sum(later) / len(later):,.0f} tok/s/{unit} "
              f"on average{' after the first step' if len(rates) > 1 else ''}", flush=True)
    return losses, rates


def run(rank: int, world: int, local_rank: int, args: argparse.Namespace) -> bool:
    """Train on this rank (the process group is up); returns False if the parity check failed (rank 0)."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    cfg = LlamaConfig.named(args.config)
    with torch.device(device):
        model = Llama(cfg)
    model.init_weights(args.seed)
    parity = not args.no_parity
    ref_model = copy.deepcopy(model) if parity and rank == 0 else None
    init = {k: v.detach().clone() for k, v in model.state_dict().items()} if ref_model is not None else {}
    batches = make_batches(args, cfg.vocab_size, world).to(device)

    model = wrap_sharded(model, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        layout = f"mesh {args.mesh[0]} replicas x {args.mesh[1]} shards" if args.mesh else "flat sharding"
        print(f"shardfuse FSDP on {world} x {device.type} ({dist.get_backend()}, {layout}): {args.config} config, "
              f"{count_params(model):,} params on this rank, {cfg.num_params():,} in all, "
              f"{cfg.n_layers} decoder layers + root as units, "
              f"{'bf16 mixed precision, fp32 reduce-scatter' if args.mixed_precision else 'fp32'}, "
              f"batch {args.batch_size} x {args.seq_len} per rank, {torch.get_num_threads()} CPU thread(s) per rank",
              flush=True)

    losses, rates = train_sharded(model, opt, batches, args, rank, world, device)
    plot = write_plot(args.plot, losses, rates, "GPU" if use_cuda else "rank") if rank == 0 else None

    ok = True
    if parity:
        state = model.state_dict()  # a full state dict: collective, every rank takes part
        if rank == 0:
            state = {k: v.detach().clone() for k, v in state.items()}
            del model, opt
            ref_losses = train_reference(ref_model, batches, args, world, device)
            ok = compare(losses, ref_losses, state, ref_model, init, args.mixed_precision)
        dist.barrier()
    if plot is not None:
        print(f"plot of loss and throughput: {plot}", flush=True)
    return ok


def threads_per_rank(world: int) -> int:
    """CPU threads for each of ``world`` processes: ``OMP_NUM_THREADS`` if set, else cores // world, at least 1."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world)


def _spawned(local_rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world))  # OMP_NUM_THREADS was set before the spawn
    use_cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=local_rank, world_size=world)
    try:
        ok = run(local_rank, world, local_rank, args)
    finally:
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def _free_port() -> int:
    # Kept here rather than imported: the example stays one self-contained script beside its model.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """Entry point: run under torchrun, or spawn ``--world-size`` processes; returns the exit code."""
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        check_mesh(args.mesh, world)
        use_cuda = torch.cuda.is_available() and not args.cpu
        args = resolve_defaults(args, use_cuda)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        try:
            ok = run(rank, world, local_rank, args)
        finally:
            dist.destroy_process_group()
        return 0 if ok else 1
    check_mesh(args.mesh, args.world_size)
    use_cuda = torch.cuda.device_count() >= args.world_size and not args.cpu
    if torch.cuda.is_available() and not use_cuda and not args.cpu:
        print(f"note: {torch.cuda.device_count()} GPU(s) < --world-size {args.world_size}: using gloo on the CPU")
        args.cpu = True
    args = resolve_defaults(args, use_cuda)
    # Threads per rank, as torchrun limits them: the children read OMP_NUM_THREADS when OpenMP starts.
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(args.world_size))
    try:
        mp.spawn(_spawned, args=(args.world_size, _free_port(), args), nprocs=args.world_size, join=True)
    except mp.ProcessExitedException as exc:
        print(f"a training process exited with code {exc.exit_code}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as exc:
        print(f"a training process raised:\n{exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
