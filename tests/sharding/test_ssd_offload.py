"""The SSD offload tier (issue 22): shards (and optionally optimizer state) in files, paged in around use.

The reference is the plain in-memory path, ``move_params_to_cpu=True`` stepped by the plain optimizer, in the same
2-process gloo group: losses, clip norms, parameters and optimizer state after several AdamW steps must be equal
bit for bit (the SSD tier moves bytes; it computes nothing). Each check also asserts that the tier is really in
use: between steps every shard has no storage and its file exists under this rank's own directory.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import gc
import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from shardfuse import OffloadConfig, OffloadOptimizer
from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding.ssd import _ssd_store
from shardfuse.sharding.ssd._ssd import ssd_host
from tests.sharding._models import batch, build, loss_fn, make_optim

WORLD = 2
STEPS = 3


def _ssd_kwargs(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    oc = OffloadConfig(offload_type="ssd_offload", dir=path, optimizer_state=cfg.get("state", False),
                       read_ahead=cfg.get("read_ahead", 2), direct_io=cfg.get("direct", False))
    return {"offload_config": oc}


def _wrap(path: str | None, cfg: dict[str, Any]) -> FSDP:
    """Blocks, then the whole model; SSD-backed when ``path`` is given, else the plain CPU-offload path."""
    kw: dict[str, Any] = _ssd_kwargs(path, cfg) if path is not None else {"move_params_to_cpu": True}
    if cfg.get("orig"):
        kw["use_orig_params"] = True
    kw.update({k: cfg[k] for k in ("mixed_precision", "compute_dtype") if k in cfg})
    if "reshard" in cfg:
        kw["reshard_after_forward"] = cfg["reshard"]
    model = build(cfg)
    for i in range(len(model.blocks)):
        model.blocks[i] = FSDP(model.blocks[i], **kw)
    return FSDP(model, **kw)


def _flat_handles(model: FSDP) -> list[Any]:
    return [h for m in model._units() for h in m._unit.handles]


def _assert_on_disk(model: FSDP, path: str) -> None:
    """Every shard is evicted (no storage) or kept for the next forward's gather (``OffloadOptimizer``: at most
    ``read_ahead``, equal to its file), and the model's files lie in one folder of this rank under ``path`` (each
    model has its own store and folder: other models of this rank, still alive, have theirs)."""
    mine = [d for d in os.listdir(path) if d.startswith(f"shardfuse-ssd-rank{dist.get_rank()}-pid{os.getpid()}-")]
    folders = {os.path.dirname(page.file.path) for h in _flat_handles(model) if (host := ssd_host(h)) is not None
               for page in host.ssd.pages(state=True)}
    assert len(folders) == 1 and os.path.basename(next(iter(folders))) in mine, (folders, os.listdir(path))
    kept = 0
    for h in _flat_handles(model):
        host = ssd_host(h)
        assert host is not None
        for page in host.ssd.pages(state=True):  # the write-behind and eviction queued on its files (shard, state)
            page.file.then(lambda: None).wait()
        if h.flat.untyped_storage().nbytes():
            kept += 1
            page = host.ssd.param
            assert host.ssd in host.ssd.tier.keep.kept(), "a shard stayed in memory between steps"
            assert page.clean == h.flat._version and not page.writes, "a kept shard differs from its file"
        assert kept <= host.ssd.tier.config.read_ahead, f"{kept} shards kept in memory"
        assert os.path.dirname(host.ssd.param.file.path) == os.path.join(path, os.path.basename(next(iter(folders))))
        nbytes = h.flat.numel() * h.flat.element_size()
        direct = host.ssd.param.file.direct  # O_DIRECT: the file is padded to whole 4096-byte blocks
        assert os.path.getsize(host.ssd.param.file.path) == (-(-nbytes // 4096) * 4096 if direct else nbytes)


def _train(path: str | None, cfg: dict[str, Any], steps: int = STEPS, start: int = 0,
           model: FSDP | None = None, opt: Any = None) -> tuple[FSDP, Any, list[float]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    if model is None:
        model = _wrap(path, cfg)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True) if cfg.get("fused")
               else make_optim(model.parameters(), cfg))
        if cfg.get("overlapped") and path is not None:
            opt = OffloadOptimizer(model, opt, gpu_budget_gib=0, step_in_backward=cfg.get("sib", False))
    micro = cfg.get("micro", 1)
    losses = []
    for step in range(start, start + steps):
        for m in range(micro):
            ctx = model.no_sync() if m < micro - 1 and cfg.get("no_sync") else contextlib.nullcontext()
            with ctx:
                ids, target = batch(step * micro + m, rank, ws)
                loss = loss_fn(model, ids, target, step, cfg)
                loss.backward()
                losses.append(loss.item())
        if cfg.get("clip"):
            losses.append(model.clip_grad_norm_(cfg["clip"]).item())
        if cfg.get("torch_clip_again"):  # sees the gradients the model's clip scaled (its scaling applied first)
            losses.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["torch_clip_again"]).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if path is not None and not isinstance(opt, OffloadOptimizer):
            _assert_on_disk(model, path)
    return model, opt, losses


def _assert_same_model(sd: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sd.keys() == ref.keys()
    for k in ref:
        assert torch.equal(sd[k], ref[k]), f"{k}: max |diff| {(sd[k] - ref[k]).abs().max().item():.3e}"


def _assert_same_optim(osd: dict[str, Any], ref: dict[str, Any]) -> None:
    got, want = osd["state"], ref["state"]
    assert got.keys() == want.keys()
    for i in want:
        for key, value in want[i].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[i][key], value), f"optimizer state {i}.{key} differs"


def check_same_as_plain(path: str, cfg: dict[str, Any]) -> bool:
    model, opt, losses = _train(path, cfg)
    store = ssd_host(_flat_handles(model)[0]).ssd.tier.store  # type: ignore[union-attr]
    if cfg.get("direct"):  # O_DIRECT, or (a file system that refuses it) the fallback, and why
        assert store.io_mode == "direct" or store.io_mode.startswith("buffered (O_DIRECT refused"), store.io_mode
    else:
        assert store.io_mode == "buffered", store.io_mode
    if isinstance(opt, OffloadOptimizer):
        opt.synchronize()
        _assert_on_disk(model, path)
    if cfg.get("state"):  # the optimizer state is on disk too
        st = opt.state[next(iter(model.parameters()))]
        big = [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
        assert big and all(v.untyped_storage().nbytes() == 0 for v in big)
    ref, ref_opt, ref_losses = _train(None, cfg)
    assert losses == ref_losses, f"losses (and clip norms) differ: {losses} vs {ref_losses}"
    _assert_same_model(model.state_dict(), ref.state_dict())
    _assert_same_optim(opt.state_dict(), ref_opt.state_dict())
    with model.summon_full_params(), ref.summon_full_params():
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p, q), n
    # Training on after the state-dict paths paged everything in: back on disk after the next step.
    _, _, more = _train(path, cfg, steps=1, start=STEPS, model=model, opt=opt)
    _, _, ref_more = _train(None, cfg, steps=1, start=STEPS, model=ref, opt=ref_opt)
    assert more == ref_more
    _assert_same_model(model.state_dict(), ref.state_dict())
    if isinstance(opt, OffloadOptimizer):
        opt.close()
    return True


CASES = {
    "offload-optimizer": dict(overlapped=True),
    "offload-optimizer-state-clip": dict(overlapped=True, state=True, clip=0.05),
    "plain-optimizer": dict(),
    "plain-optimizer-state-clip": dict(state=True, clip=0.05),
    "no-sync-accumulation": dict(overlapped=True, state=True, micro=3, no_sync=True, clip=0.05),
    "synced-accumulation": dict(state=True, micro=2, optim="sgd"),
    "read-ahead-1-orig-params": dict(overlapped=True, state=True, read_ahead=1, orig=True),
    "direct-io-offload-optimizer-state-clip": dict(overlapped=True, state=True, clip=0.05, direct=True),
    "direct-io-plain-optimizer-reshard": dict(state=True, reshard=True, direct=True),
    # torch's fused AdamW updates in place without bumping the tensors' version counters, which the tier reads to
    # know what changed since it was last written
    "fused-offload-optimizer-state-clip": dict(overlapped=True, state=True, clip=0.05, fused=True),
    "offload-optimizer-clip-then-torch-clip": dict(overlapped=True, state=True, clip=0.05, torch_clip_again=0.02),
    "fused-plain-optimizer-state": dict(state=True, fused=True),
    "fused-plain-optimizer-params-only": dict(fused=True),
    # updates start as gradients land and run on into the next forward
    "step-in-backward-state": dict(overlapped=True, state=True, sib=True),
    "fused-step-in-backward-params-only": dict(overlapped=True, sib=True, fused=True),
}


@pytest.mark.parametrize("cfg", list(CASES.values()), ids=list(CASES))
def test_training_equals_the_in_memory_path(pool, tmp_path, cfg):
    assert pool.run(check_same_as_plain, str(tmp_path), cfg) == [True] * WORLD


def check_state_dicts_round_trip(path: str) -> bool:
    """Full and local state dicts and a DCP checkpoint of an SSD-backed model (optimizer state on disk) load into
    plain and unwrapped models, and a resumed SSD model trains on exactly like the resumed plain one."""
    cfg = dict(overlapped=True, state=True)
    model, opt, _ = _train(path, cfg)
    full, local, osd = model.state_dict(), model.local_state_dict(), copy.deepcopy(opt.state_dict())
    optim_full = model.gather_full_optim_state_dict(opt, recipient_rank=None)
    plain = build({})
    plain.load_state_dict(full)  # the unwrapped model
    _assert_same_model({k: v for k, v in plain.state_dict().items()}, full)
    ref = _wrap(None, {})
    ref.load_state_dict(full)
    _assert_same_model(ref.state_dict(), full)
    ckpt = os.path.join(path, "dcp")
    dcp.save(model.sharded_state_dict(opt), checkpoint_id=ckpt)
    opt.close()
    results = []
    for kind in ("ssd-local", "ssd-dcp", "plain-full"):
        fresh = _wrap(None if kind == "plain-full" else path, cfg)
        o: Any = make_optim(fresh.parameters(), cfg)
        if kind == "ssd-local":
            fresh.load_local_state_dict(local)
            o.load_state_dict(copy.deepcopy(osd))
        elif kind == "ssd-dcp":
            sd = fresh.sharded_state_dict(o)
            dcp.load(sd, checkpoint_id=ckpt)
            fresh.load_sharded_state_dict(sd, o)
        else:
            fresh.load_state_dict(full)
            o.load_state_dict(fresh.get_shard_from_optim_state_dict(copy.deepcopy(optim_full)))
        if kind != "plain-full":
            o = OffloadOptimizer(fresh, o, gpu_budget_gib=0)
        _, o, losses = _train(None if kind == "plain-full" else path, cfg, steps=2, start=STEPS, model=fresh, opt=o)
        results.append((losses, fresh.state_dict()))
        if isinstance(o, OffloadOptimizer):
            o.close()
    for losses, sd in results[:-1]:
        assert losses == results[-1][0]
        _assert_same_model(sd, results[-1][1])
    return True


def test_state_dicts_and_checkpoints_round_trip(pool, tmp_path):
    assert pool.run(check_state_dicts_round_trip, str(tmp_path)) == [True] * WORLD


def check_refusals_and_cleanup(path: str) -> bool:
    mine = f"shardfuse-ssd-rank{dist.get_rank()}-pid{os.getpid()}-"
    model, opt, _ = _train(path, dict(overlapped=True))
    with pytest.raises(NotImplementedError, match="pickling"):
        pickle.dumps(model)
    with pytest.raises(NotImplementedError, match="half"):
        model.half()
    ids, target = batch(0, dist.get_rank(), dist.get_world_size())
    loss_fn(model, ids, target, 0, {}).backward()  # still trains after the refusals
    opt.step()
    files = [ssd_host(h).ssd.param.file.path for h in _flat_handles(model)]  # type: ignore[union-attr]
    assert all(os.path.exists(f) for f in files)
    opt.close()
    del model, opt
    gc.collect()
    assert not any(os.path.exists(f) for f in files), "the shard files outlived the model"
    assert not any(d.startswith(mine) for d in os.listdir(path)), "this rank's directory outlived its files"
    return True


def test_refusals_and_files_removed_with_the_model(pool, tmp_path):
    assert pool.run(check_refusals_and_cleanup, str(tmp_path)) == [True] * WORLD


# ------------------------------------------------------------------------------------------------------
# bad input, in this process (a one-rank group: FairScale accepts any object with rank()/size())
# ------------------------------------------------------------------------------------------------------


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _one_rank(module: nn.Module, path: str, **kw: Any) -> FSDP:
    return FSDP(module, process_group=_Group(), offload_config=OffloadConfig(offload_type="ssd_offload", dir=path),
                **kw)


def test_bad_directories_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"{missing} does not exist"):
        _one_rank(nn.Linear(3, 4), str(missing))
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match=f"{afile} is a file"):
        _one_rank(nn.Linear(3, 4), str(afile))
    with pytest.raises(PermissionError, match="cannot create files in /proc"):
        _one_rank(nn.Linear(3, 4), "/proc")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match=f"cannot create files in {ro}"):
            _one_rank(nn.Linear(3, 4), str(ro))


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="offload_type='nvme'"):
        OffloadConfig(offload_type="nvme", dir="/tmp")
    with pytest.raises(ValueError, match="needs dir="):
        OffloadConfig(offload_type="ssd_offload")
    with pytest.raises(ValueError, match="read_ahead"):
        OffloadConfig(offload_type="ssd_offload", dir="/tmp", read_ahead=0)
    with pytest.raises(ValueError, match="move_grads_to_cpu=False"):
        _one_rank(nn.Linear(3, 4), "/tmp", move_grads_to_cpu=False)
    with pytest.raises(TypeError, match="offload_config"):
        FSDP(nn.Linear(3, 4), process_group=_Group(), offload_config="ssd")


def test_fairscale_spellings(tmp_path):
    class FairScaleOffloadConfig:  # fairscale.nn.data_parallel.OffloadConfig of 0.4.3: ssd_filepath_dir
        offload_type = "ssd_offload"
        ssd_filepath_dir = str(tmp_path)

    m = FSDP(nn.Linear(3, 4), process_group=_Group(), offload_config=FairScaleOffloadConfig())
    assert m.move_params_to_cpu and m.move_grads_to_cpu  # FairScale: the SSD tier forces both
    assert m.offload_config.dir == str(tmp_path)
    assert OffloadConfig(offload_type="ssd_offload", ssd_filepath_dir="/x").directory == "/x"
    assert not FSDP(nn.Linear(3, 4), process_group=_Group(), offload_config=OffloadConfig()).move_params_to_cpu


def _enospc(*args: Any) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_out_of_space_mid_training_is_raised_and_nothing_is_lost(tmp_path, monkeypatch):
    """A write that fails (no space left) is reported at the next use of the shard, naming its file; the values
    stay in memory, and once space is back training goes on exactly as the in-memory path."""
    def make(ssd: bool) -> tuple[FSDP, torch.optim.Optimizer]:
        torch.manual_seed(7)
        net = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))
        m = _one_rank(net, str(tmp_path)) if ssd else FSDP(net, process_group=_Group(), move_params_to_cpu=True)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    data = [torch.randn(4, 5) for _ in range(3)]
    (m, opt), (ref, ref_opt) = make(True), make(False)
    for model, o in ((m, opt), (ref, ref_opt)):
        model(data[0]).square().sum().backward()
        o.step()
        o.zero_grad()
    # The first step's write-behind may still be queued (a loaded machine): it must land before the disk "fills".
    ssd_host(m._unit.handles[0]).ssd.param.file.then(lambda: None).wait()  # type: ignore[union-attr]
    monkeypatch.setattr(_ssd_store, "_pwrite", _enospc)
    m(data[1]).square().sum().backward()
    opt.step()  # the write-behind fails on an I/O thread
    ssd_host(m._unit.handles[0]).ssd.param.file.then(lambda: None).wait()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=f"No space left on device.*{tmp_path}.*kept in memory"):
        m(data[2])
    monkeypatch.undo()
    ref(data[1]).square().sum().backward()
    ref_opt.step()
    for model, o in ((m, opt), (ref, ref_opt)):
        o.zero_grad()
        model(data[2]).square().sum().backward()
        o.step()
    _assert_same_model(m.state_dict(), ref.state_dict())
    monkeypatch.setattr(_ssd_store, "_pwrite", _enospc)
    with pytest.raises(OSError, match=f"writing .* of {tmp_path}.*No space left"):
        _one_rank(nn.Linear(3, 4), str(tmp_path))  # at wrap time: at once


def test_store_reads_and_writes_in_parallel_chunks(tmp_path):
    """A tensor of several chunks (and an odd tail) round-trips through its file, bf16 included."""
    store = _ssd_store.SsdStore(str(tmp_path), threads=3, chunk_mb=1, rank=0)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(3 * (1 << 18) + 7, dtype=torch.float32).to(dtype)
        f = store.new_file(f"t-{dtype}")
        f.write(t).wait()
        back = torch.full_like(t, float("nan"))
        f.read(back).wait()
        assert torch.equal(back, t)
        assert os.path.getsize(f.path) == t.numel() * t.element_size()
        del f
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_storages_that_cannot_be_evicted_are_copied_once():
    """``pin_memory()`` and numpy-shared storages cannot be resized, a view shares its storage: each gets a storage
    of its own with the same values (on a GPU machine, pinned by torch's caching host allocator)."""
    from shardfuse.sharding.ssd._ssd import own_storage

    shared = torch.from_numpy(torch.randn(11).numpy())
    assert not shared.untyped_storage().resizable()
    base = torch.randn(20)
    for t in (shared, base[3:14]):
        before = t.clone()
        own_storage(t, pin=False)
        assert t.untyped_storage().resizable() and t.untyped_storage().nbytes() == 44
        assert torch.equal(t, before)
    mine = torch.randn(5)
    ptr = mine.data_ptr()
    own_storage(mine, pin=False)
    assert mine.data_ptr() == ptr, "a tensor that owns a resizable storage keeps it"


def test_close_finishes_the_write_backs_and_freeing_the_model_deletes_its_files(tmp_path, monkeypatch):
    """``OffloadOptimizer.close()`` returns with no I/O in flight: the files hold the trained values, and once the
    model is freed nothing (not a queued write, not an I/O thread) keeps them: they are gone at once."""
    import time

    torch.manual_seed(3)
    m = _one_rank(nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 5)), str(tmp_path))
    opt = OffloadOptimizer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), gpu_budget_gib=0)
    real = _ssd_store._pwrite

    def slow(*args: Any) -> int:
        time.sleep(0.3)  # write-backs still running when close() is called
        return real(*args)

    monkeypatch.setattr(_ssd_store, "_pwrite", slow)
    for _ in range(2):
        m(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    files = [ssd_host(h).ssd.param.file for h in _flat_handles(m)]  # type: ignore[union-attr]
    paths = [f.path for f in files]
    opt.close()
    busy = [f.path for f in files if f._last is None or not f._last.done()]
    assert not busy, f"write-backs still in flight after close(): {busy}"
    want = {k: v.clone() for k, v in m.state_dict().items()}
    del files
    for i, p in enumerate(paths):  # what is on disk is what the model holds (nothing lost)
        on_disk = torch.from_file(p, size=os.path.getsize(p) // 4, dtype=torch.float32)
        assert on_disk.numel() == sum(v.numel() for v in want.values()), f"file {i}: {on_disk.numel()} values"
        assert torch.equal(on_disk, torch.cat([v.reshape(-1) for v in want.values()]))
    del m, opt
    gc.collect()
    assert not [p for p in paths if os.path.exists(p)], "the shard files outlived the model"
