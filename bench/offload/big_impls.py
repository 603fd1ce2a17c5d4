"""The implementations of ``bench.offload.big``: each one builds the decoder, wraps it and returns a trainer.

Runs inside the child process of one (configuration, implementation) measurement (``bench.offload.big_child``);
nothing here starts processes. A trainer does one micro-batch's forward and backward (``micro``) and the end of
an optimizer step (``finish``: gradient clipping at 1.0, the optimizer step, ``zero_grad``); the child times
them. Every implementation sees the same model shape, the same seeded weights and the same token batches:

* ``resident``: the fp32 model on the GPU under bf16 autocast, fused AdamW on the GPU;
* ``shardfuse`` / ``shardfuse-budget``: ``FullyShardedDataParallel`` per decoder block + root, world size 1,
  ``mixed_precision=True`` (bf16 compute, fp32 reduce), ``move_params_to_cpu=True``, torch's fused CPU AdamW,
  wrapped in ``shardfuse.OffloadOptimizer`` where it exists (``gpu_budget_gib=0`` for full offload, the
  budget for ``shardfuse-budget``; ``accumulate_on_gpu`` under accumulation unless told otherwise);
* ``shardfuse-ssd``: as ``shardfuse`` (full offload through ``OffloadOptimizer``), with the fp32 shards and the
  AdamW state in files under ``$BIG_SSD_DIR`` (default ``/tmp/shardfuse-ssd``), FairScale's
  ``OffloadConfig(offload_type="ssd_offload")``; ``BIG_SSD_OPTIM_STATE=0`` keeps the optimizer state in host
  memory, ``BIG_SSD_RESHARD=1`` regathers (re-reads) the parameters for backward instead of keeping the bf16
  full parameters on the GPU from forward to backward (the default here: it saves a read of every shard);
  ``BIG_SSD_DIRECT=0`` uses buffered file I/O instead of ``OffloadConfig(direct_io=True)`` (``O_DIRECT``, the
  default here: reads come from the disk, not the page cache); the row's ``ssd_io_mode`` is the mode the store
  actually used (``direct``, or buffered and why where the file system refuses ``O_DIRECT``);
* ``fairscale``: FairScale 0.4.13's FSDP with the same flags (its parameters must be on the CPU at wrap time);
* ``fsdp2``: ``fully_shard`` per block + root, ``CPUOffloadPolicy(pin_memory=True)``, bf16 params / fp32 reduce,
  fused CPU AdamW;
* ``shardfuse-spec`` / ``shardfuse-spec-nofire``: as ``shardfuse`` with ``OffloadOptimizer(speculative_clip=True)``:
  each unit's host update runs during backward out of place, committed at ``step()`` where the clip coefficient is
  exactly 1, else redone (the row counts both over the timed steps: ``spec_steps_committed``/``spec_steps_redone``,
  per unit ``spec_units_*``, and the spare host memory ``spec_spare_gib``). ``-spec`` clips at ``MAX_NORM`` like
  every other row (on this random-weight decoder clipping may fire every step: all redone, the worst case);
  ``-spec-nofire`` clips at ``NOFIRE_MAX_NORM``, which never fires (every step commits: the case of fine-tuning,
  where clipping rarely fires; compare it with ``shardfuse-nofire``); ``BIG_SPEC_GIB=N`` passes
  ``speculative_clip_gib=N`` (default: every unit, 12 B/param more host memory: ~35 GB for the 2.9B decoder, too
  much for the 6.7B one on a 128 GiB host);
  ``BIG_SPEC_CHUNK=N`` sets the out-of-place update's elements per chunk (``_speculative.SPEC_CHUNK_ELEMENTS``, a
  multiple of 4096) in the row's process; the rows record ``spec_chunk_elements``;
* ``shardfuse-nofire`` / ``shardfuse-budget-nofire``: ``shardfuse`` / ``shardfuse-budget`` clipping at
  ``NOFIRE_MAX_NORM``: the clipped step where the clip does not fire (the host updates then skip the scaling);
* ``BIG_HOST_THREADS=N`` (a diagnostic): ``OffloadOptimizer(host_threads=N)`` in every shardfuse row but
  ``-allcores`` (the rows record ``host_threads``); ``BIG_TRACE=1`` (a diagnostic): the last timed step's host
  timeline (``OffloadOptimizer.trace_host``, ``bench.offload.host_timeline``) in each shardfuse row, printed;
  ``BIG_KEEP_GIB=X`` (``auto``: None): ``OffloadOptimizer(keep_params_gib=X)`` in every shardfuse row, the gathered
  bf16 parameters kept from forward to backward within X GiB (rows record ``keep_params_gib``); rows record
  ``lowp_grads`` too (bf16 gradients to the host where exact, off with ``SHARDFUSE_LOWP_GRADS=0``);
* ``torchao``: torchao's ``CPUOffloadOptimizer`` (0.18, ``torchao.optim``) over the resident fp32 model (bf16
  autocast, as ``resident``): the AdamW state and step on the host (torch's fused CPU AdamW), parameters and
  gradients on the GPU too; it cannot clip (each parameter's host step is its own), so this row trains WITHOUT
  clipping, as issue 30 measured it; skipped with the reason when torchao is not importable;
* ``shardfuse-budget-ao`` / ``shardfuse-budget-ao-sib``: ``shardfuse-budget`` (clipped; ``-sib``: step_in_backward,
  no clipping) with ``gpu_budget_gib`` = the ``torchao`` row's GPU peak in the same job (``bench.offload.big``
  runs ``torchao`` first), or ``AO_FALLBACK_BUDGET_GIB`` where that row did not measure one: the same GPU memory
  as torchao's, for a "speed vs torchao" ratio;
* ``deepspeed-zero2`` / ``deepspeed-zero3``: ZeRO-2 with the optimizer offloaded (its DeepSpeedCPUAdam), ZeRO-3
  with parameters and optimizer offloaded, bf16, gradient accumulation and clipping through its config.

Accumulation: all micro-batches but the last under ``no_sync`` (shardfuse, FairScale), without gradient sync
(FSDP2's ``set_requires_gradient_sync(False)``), DeepSpeed's own ``gradient_accumulation_steps``; the loss is
divided by the number of micro-batches (DeepSpeed does that itself).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from bench.offload.big_knobs import Skip, set_host_chunk, set_host_tile, set_spec_chunk
from bench.offload.big_rows import AO_FALLBACK_BUDGET_GIB, AO_VARIANT, IMPLS, VARIANTS  # noqa: F401 (re-exported)
from examples.llama import DecoderLayer, Llama, LlamaConfig, next_token_loss

GPU_ONLY = frozenset({"fairscale", "fsdp2", "deepspeed-zero2", "deepspeed-zero3", "torchao"})
MAX_NORM = 1.0
LOWP_GRADS_ENV = "SHARDFUSE_LOWP_GRADS"  # shardfuse.sharding.host._offload_optim's switch (not imported: older trees)
HOST_TILES_ENV = "SHARDFUSE_HOST_TILES"  # _offload_optim's switch of the tile pool (not imported: older trees)
NOFIRE_MAX_NORM = 1e9  # ``shardfuse-spec-nofire``: above any gradient norm here, so clipping never fires
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: a model shape and the tokens of one optimizer step (batch x seq x accum)."""

    name: str
    model: str  # a key of MODELS
    batch: int
    seq: int
    accum: int = 1  # micro-batches per optimizer step

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq * self.accum


MODELS: dict[str, LlamaConfig] = {
    "2.9b": LlamaConfig(dim=3072, n_layers=24, n_heads=24, ffn_dim=8192, vocab_size=32000, max_seq_len=2048),
    "6.7b": LlamaConfig.llama_7b(),
    "tiny": LlamaConfig.tiny(),
}
CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig("2.9b-4k", "2.9b", 2, 2048),
        BenchConfig("2.9b-32k", "2.9b", 2, 2048, accum=8),
        BenchConfig("6.7b-2k", "6.7b", 1, 2048),
        # CPU plumbing only (tests/bench/test_offload_big.py)
        BenchConfig("tiny", "tiny", 2, 32),
        BenchConfig("tiny-acc", "tiny", 2, 32, accum=2),
    )
}
DEFAULT_CONFIGS = ("2.9b-4k", "2.9b-32k", "6.7b-2k")


@dataclass
class Job:
    """What the driver asks one child to measure (travels as JSON)."""

    impl: str
    config: str
    steps: int = 3
    warmup: int = 1
    lr: float = 1e-4
    seed: int = 0
    device: str = "cuda"
    budget_gib: float | None = None  # shardfuse-budget's gpu_budget_gib
    accumulate_on_gpu: bool | None = None  # shardfuse rows; None: True when the configuration accumulates
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def cfg(self) -> BenchConfig:
        return CONFIGS[self.config]


def unavailable_reason(impl: str, device: str) -> str | None:
    """Why ``impl`` is skipped in this environment, without importing it (the driver asks before spawning)."""
    if impl in GPU_ONLY and device != "cuda":
        return "needs a CUDA GPU"
    module = {"fairscale": "fairscale", "deepspeed-zero2": "deepspeed", "deepspeed-zero3": "deepspeed",
              "torchao": "torchao"}.get(
        impl, "shardfuse" if impl.startswith("shardfuse") else None)
    if module is not None and importlib.util.find_spec(module) is None:
        return f"not installed (no module named {module!r})"
    return None


# ------------------------------------------------------------------------------------------------ model, data


def build_model(cfg: BenchConfig, device: torch.device, seed: int) -> Llama:
    """The decoder built and initialised on ``device`` in fp32 (fast on a GPU; move it after if needed)."""
    with torch.device(device):
        model = Llama(MODELS[cfg.model])
    return model.init_weights(seed)


def make_batches(cfg: BenchConfig, device: torch.device, seed: int, count: int = 4) -> list[torch.Tensor]:
    """Seeded random token batches, (batch, seq + 1) each, cycled through the micro-batches."""
    gen = torch.Generator().manual_seed(seed * 7919 + 1)
    vocab = MODELS[cfg.model].vocab_size
    return [torch.randint(0, vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(device) for _ in range(count)]


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return next_token_loss(logits, tokens[:, 1:])


def init_world_of_one(device: torch.device, backend: str | None = None) -> None:
    """A process group of one rank (gloo for CPU tensors, NCCL for CUDA ones, or ``backend``)."""
    import torch.distributed as dist

    from bench.common import free_port

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = backend or ("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, rank=0, world_size=1)


# ------------------------------------------------------------------------------------------------ trainers


class Trainer:
    """One implementation's training step, split where the child times it."""

    def __init__(self, model: Any, opt: Any, accum: int, info: dict[str, Any] | None = None):
        # Any: a wrapper (FSDP, a DeepSpeed engine) whose own methods (no_sync, backward) the trainers call
        self.model: Any = model
        self.opt, self.accum = opt, accum
        self.info: dict[str, Any] = info or {}  # recorded in the row (what was really run)

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of a micro-batch's forward and backward: no gradient sync but for the last one."""
        return contextlib.nullcontext()

    def forward_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return loss_of(self.model(tokens[:, :-1]), tokens)

    def micro(self, tokens: torch.Tensor, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the detached loss."""
        with self.sync_context(last):
            loss = self.forward_loss(tokens)
            (loss / self.accum if self.accum > 1 else loss).backward()
        return loss.detach()

    def clip(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)

    def finish(self) -> None:
        """Clip, step, zero the gradients."""
        self.clip()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class ResidentTrainer(Trainer):
    def forward_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits = self.model(tokens[:, :-1])
        return loss_of(logits, tokens)


class FairScaleStyleTrainer(Trainer):
    """shardfuse and FairScale: ``no_sync`` for the accumulating micro-batches, the wrapper's own clipping."""

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last else self.model.no_sync()

    max_norm = MAX_NORM

    def clip(self) -> None:
        self.model.clip_grad_norm_(self.max_norm)


class NoClipTrainer(FairScaleStyleTrainer):
    """The ``-sib`` variants: no clipping (the host update of a unit starts before the global norm is known)."""

    def clip(self) -> None:
        return None


class Fsdp2Trainer(Trainer):
    @contextlib.contextmanager
    def _no_grad_sync(self) -> Any:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last else self._no_grad_sync()


class DeepSpeedTrainer(Trainer):
    """The engine scales by its accumulation steps, clips and steps at the boundary by itself."""

    def micro(self, tokens: torch.Tensor, last: bool) -> torch.Tensor:
        loss = self.forward_loss(tokens)
        self.model.backward(loss)
        self.model.step()
        return loss.detach()

    def finish(self) -> None:
        return None


def fused_adamw(params: Any, job: Job, *, fused: bool = True) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=job.lr, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=fused)


def make_resident(job: Job, device: torch.device) -> Trainer:
    model = build_model(job.cfg, device, job.seed)
    return ResidentTrainer(model, fused_adamw(model.parameters(), job), job.cfg.accum,
                           {"optimizer": f"AdamW fused on {device.type}", "autocast": "bf16"})  # fmt: skip


SSD_DIR = "/tmp/shardfuse-ssd"


def ssd_settings() -> dict[str, Any]:
    """``shardfuse-ssd``'s directory and choices, from the environment (see the module docstring)."""
    return {"ssd_dir": os.environ.get("BIG_SSD_DIR", SSD_DIR),
            "ssd_optimizer_state": os.environ.get("BIG_SSD_OPTIM_STATE", "1") != "0",
            "reshard_after_forward": os.environ.get("BIG_SSD_RESHARD", "0") == "1",
            "ssd_direct_io": os.environ.get("BIG_SSD_DIRECT", "1") != "0"}  # fmt: skip


def _offload_config_fields() -> set[str]:
    import dataclasses

    import shardfuse

    return {f.name for f in dataclasses.fields(shardfuse.OffloadConfig)}


def ssd_io_modes(model: Any) -> dict[str, str]:
    """Each SSD store of ``model``: its folder and its I/O mode (an older shardfuse: every store of the process;
    without ``direct_io``: none)."""
    try:
        from shardfuse.sharding.ssd._ssd import io_modes  # one store per model
    except ImportError:
        try:
            from shardfuse.sharding.ssd._ssd_store import io_modes as every_store  # type: ignore[attr-defined]
        except ImportError:
            return {}
        return every_store()  # type: ignore[no-any-return]
    return io_modes(model)


def ssd_io_mode(directory: str, modes: dict[str, str]) -> str:
    """How the SSD stores under ``directory`` (``modes``: :func:`ssd_io_modes`) read and write their files
    (``direct``, ``buffered``, or buffered because the file system refused ``O_DIRECT``, and why); ``buffered`` in a
    shardfuse without ``direct_io``."""
    if not modes:
        return "buffered"
    root = os.path.abspath(directory)
    found = [m for d, m in modes.items() if os.path.abspath(os.path.dirname(d)) == root]
    return " / ".join(sorted(set(found))) or "unknown"


def _wrap_shardfuse(model: nn.Module, device: torch.device, ssd: dict[str, Any] | None = None,
                    keep: bool = False) -> nn.Module:
    import shardfuse

    kwargs: dict[str, Any] = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True,
                                  move_params_to_cpu=True, compute_device=device)  # fmt: skip
    if keep:
        kwargs["reshard_after_forward"] = False
    if ssd is not None:
        os.makedirs(ssd["ssd_dir"], exist_ok=True)
        direct = {"direct_io": ssd["ssd_direct_io"]} if "direct_io" in _offload_config_fields() else {}
        kwargs.update(reshard_after_forward=ssd["reshard_after_forward"], offload_config=shardfuse.OffloadConfig(
            offload_type="ssd_offload", dir=ssd["ssd_dir"], optimizer_state=ssd["ssd_optimizer_state"], **direct))
    policy = shardfuse.ModuleClassWrapPolicy(frozenset({DecoderLayer}))
    with shardfuse.enable_wrap(wrapper_cls=shardfuse.FullyShardedDataParallel, **kwargs):
        model = shardfuse.auto_wrap(model, auto_wrap_policy=policy)
        return shardfuse.wrap(model)


def _offload_extras(job: Job, offload_optimizer: Any, info: dict[str, Any], sib: bool) -> dict[str, Any]:
    """The ``OffloadOptimizer`` settings of ``job``'s row beyond the budget (its variant's and the ``BIG_*``
    diagnostics'), raising ``Skip`` where this shardfuse lacks one; ``info`` gets the chunk sizes in force."""
    extra: dict[str, Any] = {"step_in_backward": True} if sib else {}
    if job.impl.endswith("-allcores"):
        extra["host_threads"] = len(os.sched_getaffinity(0))
    elif os.environ.get("BIG_HOST_THREADS"):  # a diagnostic: the row records host_threads
        extra["host_threads"] = int(os.environ["BIG_HOST_THREADS"])
    if job.impl.endswith("-hcc"):
        extra["host_compute_copy"] = True
    if "-cu" in job.impl:
        if "clip_in_update" not in inspect.signature(offload_optimizer).parameters:
            raise Skip(f"OffloadOptimizer(clip_in_update=) is not in this shardfuse ({job.impl} needs it)")
        extra["clip_in_update"] = True
    if "-gs" in job.impl:
        if "gpu_update_share" not in inspect.signature(offload_optimizer).parameters:
            raise Skip(f"OffloadOptimizer(gpu_update_share=) is not in this shardfuse ({job.impl} needs it)")
        extra["gpu_update_share"] = float(os.environ.get("BIG_GPU_SHARE", "0.5"))
    info["host_chunk_elements"] = set_host_chunk(os.environ.get("BIG_HOST_CHUNK"))
    if "-spec" in job.impl:
        if "speculative_clip" not in inspect.signature(offload_optimizer).parameters:
            raise Skip(f"OffloadOptimizer(speculative_clip=) is not in this shardfuse ({job.impl} needs it)")
        extra["speculative_clip"] = True
        if os.environ.get("BIG_SPEC_GIB"):
            extra["speculative_clip_gib"] = float(os.environ["BIG_SPEC_GIB"])
        if os.environ.get("BIG_SPEC_BACKOFF"):  # a count, or "none": speculate on every step (the row says)
            value = os.environ["BIG_SPEC_BACKOFF"]
            extra["speculative_backoff"] = None if value == "none" else int(value)
        info["spec_chunk_elements"] = set_spec_chunk(os.environ.get("BIG_SPEC_CHUNK"))
    keep_gib = os.environ.get("BIG_KEEP_GIB")  # a diagnostic: the row records keep_params_gib
    if job.impl.endswith("-kl"):
        keep_gib = "auto"
    _row_environment(job, info)
    if keep_gib:
        extra["keep_params_gib"] = None if keep_gib == "auto" else float(keep_gib)
    return extra


def _row_environment(job: Job, info: dict[str, Any]) -> None:
    """The switches ``OffloadOptimizer.__init__`` reads from the environment, set for ``job``'s row in its own
    child process: ``-kl`` bf16 gradients to the host, ``-tl`` / ``-ntl`` the host tile pool on / off."""
    if job.impl.endswith("-kl"):
        os.environ[LOWP_GRADS_ENV] = "1"
    from shardfuse.sharding.host import _host_fused

    has_tiles = hasattr(_host_fused, "TILE_ELEMENTS")
    if ("-tl" in job.impl or "-ntl" in job.impl) and not has_tiles:
        raise Skip(f"the host tile pool is not in this shardfuse ({job.impl} needs it)")
    if "-tl" in job.impl or "-ntl" in job.impl:
        os.environ[HOST_TILES_ENV] = "0" if "-ntl" in job.impl else "1"
    if has_tiles and os.environ.get(HOST_TILES_ENV, "1") != "0":
        info["host_tile_elements"] = set_host_tile(os.environ.get("BIG_HOST_TILE"))


def make_shardfuse(job: Job, device: torch.device) -> Trainer:
    """Full offload (``gpu_budget_gib=0``), or the budget of ``shardfuse-budget``, through OffloadOptimizer."""
    import shardfuse

    init_world_of_one(device)
    has_api = hasattr(shardfuse, "OffloadOptimizer")
    if job.impl != "shardfuse" and not has_api:
        raise Skip(f"shardfuse.OffloadOptimizer is not in this shardfuse ({job.impl} needs it)")
    sib = "-sib" in job.impl
    ssd = ssd_settings() if job.impl == "shardfuse-ssd" else None
    if ssd is not None and not hasattr(shardfuse, "OffloadConfig"):
        raise Skip("shardfuse.OffloadConfig (the SSD tier) is not in this shardfuse")
    model = _wrap_shardfuse(build_model(job.cfg, device, job.seed), device, ssd, keep="-keep" in job.impl)
    opt: Any = fused_adamw(model.parameters(), job)
    info: dict[str, Any] = {"optimizer": "AdamW fused on cpu", "offload_optimizer": has_api, **(ssd or {})}
    if ssd is not None:
        info["ssd_io_mode"] = ssd_io_mode(ssd["ssd_dir"], ssd_io_modes(model))
    if has_api:
        budget = job.budget_gib if job.impl.startswith("shardfuse-budget") else 0.0
        on_gpu = job.accumulate_on_gpu if job.accumulate_on_gpu is not None else job.cfg.accum > 1
        if job.impl == "shardfuse-host-accum":
            on_gpu = False
        offload_optimizer = getattr(shardfuse, "OffloadOptimizer")  # noqa: B009 (absent from older shardfuse)
        extra = _offload_extras(job, offload_optimizer, info, sib)
        opt = offload_optimizer(model, opt, gpu_budget_gib=budget, accumulate_on_gpu=on_gpu, **extra)
        info.update(gpu_budget_gib=budget, accumulate_on_gpu=on_gpu, step_in_backward=sib, clipping=not sib,
                    host_threads=getattr(opt, "host_threads", None),
                    host_compute_copy=bool(getattr(opt, "host_compute_copy", False)),
                    speculative_clip=bool(getattr(opt, "speculative_clip", False)),
                    speculative_clip_gib=extra.get("speculative_clip_gib"),
                    speculative_backoff=getattr(getattr(opt, "_spec", None), "backoff_after", None),
                    keep_params_gib=getattr(opt, "keep_params_gib", 0.0),
                    clip_in_update=bool(getattr(opt, "clip_in_update", False)),
                    lowp_grads=bool(getattr(opt, "_lowp_grads", False)),
                    host_tiles=getattr(getattr(opt, "_worker", None), "pool", None) is not None,
                    gpu_update_share=float(getattr(opt, "gpu_update_share", 0.0)))
    trainer = (NoClipTrainer if sib else FairScaleStyleTrainer)(model, opt, job.cfg.accum, info)
    if job.impl.endswith("-nofire"):
        trainer.max_norm = NOFIRE_MAX_NORM
    if not sib:
        info["max_norm"] = trainer.max_norm
    return trainer


def make_fairscale(job: Job, device: torch.device) -> Trainer:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FairScaleFSDP

    init_world_of_one(device)
    model = build_model(job.cfg, device, job.seed).cpu()  # FairScale asserts the fp32 shards are on the CPU
    kwargs = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True,
                  move_params_to_cpu=True, compute_device=device)  # fmt: skip
    for i, layer in enumerate(model.layers):
        model.layers[i] = FairScaleFSDP(layer, **kwargs)
    wrapped = FairScaleFSDP(model, **kwargs)
    return FairScaleStyleTrainer(wrapped, fused_adamw(wrapped.parameters(), job), job.cfg.accum,
                                 {"optimizer": "AdamW fused on cpu"})  # fmt: skip


def make_fsdp2(job: Job, device: torch.device) -> Trainer:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    init_world_of_one(device)
    model = build_model(job.cfg, device, job.seed)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=True)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mp_policy=mp, offload_policy=policy)
    return Fsdp2Trainer(model, fused_adamw(model.parameters(), job), job.cfg.accum,
                        {"optimizer": "AdamW fused on cpu"})  # fmt: skip


class NoClipResidentTrainer(ResidentTrainer):
    """``torchao``: its ``CPUOffloadOptimizer`` steps each parameter on its own and offers no global-norm clip."""

    def clip(self) -> None:
        return None


def make_torchao(job: Job, device: torch.device) -> Trainer:
    """The fp32 model on the GPU, torchao's ``CPUOffloadOptimizer`` (fused AdamW on the host), no clipping."""
    try:
        import torchao
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as exc:  # find_spec found it, but it does not import (e.g. built for another torch)
        raise Skip(f"torchao is not importable here ({exc}); install torchao 0.18 (pip install torchao==0.18.0, "
                   f"or carry its wheel in .whl/) to run the torchao row") from exc
    model = build_model(job.cfg, device, job.seed)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=job.lr, betas=BETAS,
                              weight_decay=WEIGHT_DECAY, fused=True)
    return NoClipResidentTrainer(model, opt, job.cfg.accum,
                                 {"optimizer": "torchao CPUOffloadOptimizer (AdamW fused on cpu)", "autocast": "bf16",
                                  "clipping": False, "torchao": getattr(torchao, "__version__", "?")})


def deepspeed_config(job: Job, stage: int) -> dict[str, Any]:
    """ZeRO-2 with the optimizer on the CPU, or ZeRO-3 with parameters and optimizer there; bf16; clipping."""
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": job.cfg.batch,
        "gradient_accumulation_steps": job.cfg.accum,
        "gradient_clipping": MAX_NORM,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": job.lr, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY},
        },  # fmt: skip
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def make_deepspeed(job: Job, device: torch.device) -> Trainer:
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")  # a minor CUDA version apart from torch's must not stop it
    import deepspeed

    init_world_of_one(device, backend="nccl")  # DeepSpeed's usual setup; it adopts the initialised group
    stage = 3 if job.impl == "deepspeed-zero3" else 2
    model = build_model(job.cfg, device, job.seed)
    config = deepspeed_config(job, stage)
    engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return DeepSpeedTrainer(engine, None, job.cfg.accum,
                            {"optimizer": type(engine.optimizer).__name__, "deepspeed": deepspeed.__version__,
                             "zero_stage": stage, "ds_config": config})  # fmt: skip


MAKERS: dict[str, Callable[[Job, torch.device], Trainer]] = {
    "resident": make_resident,
    **{impl: make_shardfuse for impl in IMPLS if impl.startswith("shardfuse")},
    "torchao": make_torchao,
    "fairscale": make_fairscale,
    "fsdp2": make_fsdp2,
    "deepspeed-zero2": make_deepspeed,
    "deepspeed-zero3": make_deepspeed,
}


def make_trainer(job: Job, device: torch.device) -> Trainer:
    """Build, wrap and set up ``job.impl``; raises :class:`Skip` when it cannot run here."""
    reason = unavailable_reason(job.impl, device.type)
    if reason is not None:
        raise Skip(reason)
    return MAKERS[job.impl](job, device)
