"""Hybrid sharding on 4 gloo ranks: 2x2, (1, 4) and (4, 1) meshes and FSDP1's HYBRID_SHARD spelling against
unsharded data-parallel training (AdamW with clipping, with and without accumulation), and the refusals.

One 4-rank pool for the module; each check trains and then inspects many things, to keep the suite fast.
Hybrid sums gradients in another order than the reference (within a shard group, then across replicas), so
losses and parameters agree within 1e-5, not bit-exactly; a (1, 4) mesh is flat sharding, bit for bit.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardfuse import FullyShardedDataParallel as FSDP
from shardfuse import ShardingStrategy
from shardfuse.sharding.core import _collectives as coll
from tests.dist_pool import DistPool
from tests.sharding._models import Net, batch, build, loss_fn

STEPS, MICRO, CLIP, TOL = 4, 2, 0.05, dict(rtol=1e-5, atol=1e-5)
DIMS = ("replicate", "shard")


def _wrap(model: Net, **kw: Any) -> FSDP:
    for i in range(len(model.blocks)):
        model.blocks[i] = FSDP(model.blocks[i], **kw)
    return FSDP(model, **kw)


def _optim(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(model: FSDP, accumulate: str, opt: torch.optim.Optimizer | None = None) -> tuple[list[float], list[float]]:
    """AdamW steps with clipping; ``accumulate``: "none", "no_sync" or "all_reduce" (set_requires_all_reduce)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    opt = _optim(model.parameters()) if opt is None else opt
    micro = 1 if accumulate == "none" else MICRO
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            last = m == micro - 1
            if accumulate == "all_reduce":
                model.set_requires_all_reduce(last)
            ids, target = batch(step * micro + m, rank, ws)
            if accumulate == "no_sync" and not last:
                with model.no_sync():
                    loss = loss_fn(model, ids, target, step, {})
                    loss.backward()
            else:
                loss = loss_fn(model, ids, target, step, {})
                loss.backward()
            if not last:  # accumulated locally (full under no_sync, a held shard sum otherwise): .grad unwritten
                assert all(p.grad is None for p in model.parameters())
            losses.append(loss.item())
        norms.append(model.clip_grad_norm_(CLIP).item())
        opt.step()
    return losses, norms


def _reference(micro: int) -> tuple[Net, list[list[float]], list[float]]:
    """Unsharded data parallelism in one process: the mean over ranks of each rank's summed micro-batch gradients."""
    ws = dist.get_world_size()
    model = build({})
    opt = _optim(model.parameters())
    losses: list[list[float]] = [[] for _ in range(ws)]
    norms = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for r in range(ws):
            for m in range(micro):
                ids, target = batch(step * micro + m, r, ws)
                loss = loss_fn(model, ids, target, step, {}) / ws
                loss.backward()
                losses[r].append(loss.item() * ws)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return model, losses, norms


def _mesh(shape: tuple[int, int]) -> DeviceMesh:
    return init_device_mesh("cpu", shape, mesh_dim_names=DIMS)


def check_hybrid_parity(shape: tuple[int, int], spelling: str, accumulate: str, extra: dict[str, Any]) -> bool:
    rank = dist.get_rank()
    mesh = _mesh(shape)
    if spelling == "mesh":
        kw: dict[str, Any] = dict(device_mesh=mesh)
    else:  # FSDP1's spelling, with the string form of the strategy
        groups = (mesh.get_group("shard"), mesh.get_group("replicate"))
        kw = dict(sharding_strategy="hybrid_shard", process_group=groups)
    kw.update(extra)
    model = _wrap(build({}), **kw)
    assert model.world_size == shape[1], model.world_size
    assert model.gradient_predivide_factor * model.gradient_postdivide_factor == dist.get_world_size()
    calls: list[Any] = []
    all_reduce = coll.all_reduce_

    def counting(t: torch.Tensor, group: Any, world: int, op: str = "sum") -> torch.Tensor:
        calls.append(group)
        return all_reduce(t, group, world, op)

    coll.all_reduce_ = counting
    try:
        losses, norms = _train(model, accumulate)
    finally:
        coll.all_reduce_ = all_reduce
    # One replica all-reduce per flat parameter per optimizer step, whatever the accumulation; the norm of
    # clip_grad_norm_ is one all-reduce over the shard group per step.
    replicas = mesh.get_group("replicate")
    flats = sum(len(u._unit.handles) for u in model._units())
    assert sum(g is replicas for g in calls) == STEPS * flats, len(calls)
    assert sum(g is not replicas for g in calls) == STEPS, len(calls)
    ref, ref_losses, ref_norms = _reference(1 if accumulate == "none" else MICRO)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[rank]), **TOL)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd), (list(sd), list(ref_sd))
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    with model.summon_full_params():
        torch.testing.assert_close(model.module.head.weight, ref.head.weight, **TOL)
        torch.testing.assert_close(model.module.blocks[0].module.fc1.weight, ref.blocks[0].fc1.weight, **TOL)
    # Ranks built with different seeds: each replica starts from global rank 0's values (shard group, then
    # replicas); then a full state dict loads into a model on the same mesh.
    torch.manual_seed(rank)
    fresh = _wrap(Net(), **kw)
    replicas = mesh.get_group("replicate")
    for s in (p.detach().clone() for p in fresh.parameters()):
        peers = [torch.empty_like(s) for _ in range(shape[0])]
        dist.all_gather(peers, s, group=replicas)
        assert all(torch.equal(p, s) for p in peers), "replicas hold different shards"
    fresh.load_state_dict(ref_sd)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, ref_sd[k]), k
    return True


def check_flat_equals_one_by_four() -> bool:
    """A (1, 4) mesh is today's flat sharding: the same shards and losses, bit for bit."""
    flat = _wrap(build({}))
    meshed = _wrap(build({}), device_mesh=_mesh((1, 4)))
    assert _train(flat, "none") == _train(meshed, "none")
    for a, b in zip(flat.parameters(), meshed.parameters()):
        assert torch.equal(a, b)
    return True


def check_refusals() -> bool:
    mesh = _mesh((2, 2))
    model = _wrap(build({}), device_mesh=mesh)
    loss_fn(model, *batch(0, dist.get_rank(), 4), 0, {}).backward()
    for call in (lambda: pickle.dumps(model), lambda: get_model_state_dict(model)):
        with pytest.raises(NotImplementedError, match="hybrid"):
            call()
    return True


def _one_step(model: FSDP, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    opt.zero_grad(set_to_none=True)
    loss_fn(model, *batch(99, dist.get_rank(), 4), 0, {}).backward()
    model.clip_grad_norm_(CLIP)
    opt.step()
    return list(model.state_dict().values())


def _files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")


def check_dcp_across_meshes(root: str) -> bool:
    """A DCP checkpoint saved at 2x2 (replicas write no duplicate bytes) resumes at (1, 4), (4, 1) and at flat
    sharding over 2 ranks."""
    path = Path(root)
    saved = _wrap(build({}), device_mesh=_mesh((2, 2)))
    opt = _optim(saved.parameters())
    _train(saved, "none", opt)
    dcp.save(saved.sharded_state_dict(opt), checkpoint_id=path / "2x2")
    want = saved.state_dict()
    # Optimizer-state consolidation: gathered over the shard group, handed to replica 0's recipient only.
    full_optim = saved.gather_full_optim_state_dict(opt)
    assert (full_optim is not None) == (dist.get_rank() == 0)
    after = _one_step(saved, opt)
    for shape in ((1, 4), (4, 1)):
        torch.manual_seed(7)
        model = _wrap(Net(), device_mesh=_mesh(shape))
        opt2 = _optim(model.parameters())
        sd = model.sharded_state_dict(opt2)
        dcp.load(sd, checkpoint_id=path / "2x2")
        model.load_sharded_state_dict(sd, opt2)
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), (shape, k)
        got_optim = model.gather_full_optim_state_dict(opt2)
        if dist.get_rank() == 0:
            assert got_optim is not None and full_optim is not None
            for i, st in full_optim["state"].items():
                for name, t in st.items():
                    assert torch.equal(torch.as_tensor(got_optim["state"][i][name]), torch.as_tensor(t)), (i, name)
        if shape == (1, 4):
            dcp.save(model.sharded_state_dict(opt2), checkpoint_id=path / "1x4")
        for a, b in zip(_one_step(model, opt2), after):  # the optimizer state came back too
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, s=shape: f"{s}: {m}")
    # ... and at flat sharding over 2 of the ranks (a process group of its own; the other ranks take no part).
    pair = dist.new_group([0, 1])
    if dist.get_rank() < 2:
        torch.manual_seed(7)
        flat = _wrap(Net(), process_group=pair)
        opt2 = _optim(flat.parameters())
        sd = flat.sharded_state_dict(opt2)
        dcp.load(sd, checkpoint_id=path / "2x2", process_group=pair)
        flat.load_sharded_state_dict(sd, opt2)
        for k, v in flat.state_dict().items():
            assert torch.equal(v, want[k]), ("flat 2", k)
    dist.barrier()
    # DCP writes each chunk once: the replicated 2x2 checkpoint is no larger than the unreplicated 1x4 one.
    assert _files_bytes(path / "2x2") <= _files_bytes(path / "1x4") * 1.05, (
        _files_bytes(path / "2x2"), _files_bytes(path / "1x4"))
    return True


def _raises(exc: type[Exception], match: str, fn: Any) -> None:
    with pytest.raises(exc, match=match):
        fn()


def check_bad_input() -> bool:
    mesh = _mesh((2, 2))
    _raises(ValueError, "mesh_dim_names", lambda: FSDP(Net(), device_mesh=init_device_mesh("cpu", (4,))))
    _raises(ValueError, "mesh_dim_names", lambda: FSDP(Net(), device_mesh=init_device_mesh(
        "cpu", (2, 2), mesh_dim_names=("dp", "tp"))))
    small = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=DIMS)
    _raises(ValueError, "world_size=4", lambda: FSDP(Net(), device_mesh=small))
    _raises(ValueError, "not both", lambda: FSDP(Net(), device_mesh=mesh, process_group=mesh.get_group("shard")))
    _raises(ValueError, "needs two groups", lambda: FSDP(Net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD))
    _raises(ValueError, "needs two groups", lambda: FSDP(
        Net(), sharding_strategy="hybrid_shard", process_group=mesh.get_group("shard")))
    _raises(ValueError, "HYBRID_SHARD", lambda: FSDP(
        Net(), process_group=(mesh.get_group("shard"), mesh.get_group("replicate"))))
    _raises(ValueError, "SHARD_GRAD_OP", lambda: FSDP(Net(), sharding_strategy="shard_grad_op"))
    _raises(ValueError, "FULL_SHARD", lambda: FSDP(Net(), device_mesh=mesh, sharding_strategy="full_shard"))
    # Nested units on different meshes: refused at the first forward, naming the fix.
    model = build({})
    model.blocks[0] = FSDP(model.blocks[0], device_mesh=mesh)
    outer = FSDP(model, device_mesh=_mesh((1, 4)))
    _raises(ValueError, "different meshes", lambda: outer(batch(0, 0, 4)[0]))
    return True


@pytest.mark.parametrize(
    "shape,spelling,accumulate,extra",
    [((2, 2), "mesh", "none", {}), ((2, 2), "mesh", "no_sync", dict(use_orig_params=True)),
     ((2, 2), "hybrid_shard", "all_reduce", {}), ((4, 1), "mesh", "all_reduce", dict(reshard_after_forward=False))],
    ids=["2x2", "2x2-no_sync-orig_params", "2x2-hybrid_shard-requires_all_reduce", "4x1-requires_all_reduce"],
)
def test_hybrid_matches_data_parallel(pool4, shape, spelling, accumulate, extra):
    assert pool4.run(check_hybrid_parity, shape, spelling, accumulate, extra) == [True] * 4


@pytest.fixture(scope="module")
def pool8():
    """Eight gloo ranks (a 2x4 mesh: issue 21's larger CPU case); one pool for the module's one 8-rank test."""
    with DistPool(world_size=8, timeout_s=300) as p:
        yield p


def test_2x4_matches_data_parallel(pool8):
    assert pool8.run(check_hybrid_parity, (2, 4), "mesh", "all_reduce", {}) == [True] * 8


def check_capture_step_under_a_mesh() -> bool:
    """``capture_step`` over a 2x2-mesh model follows the eager loop exactly (on the host the step runs eagerly
    under the capture contract: warm-up steps on the example batch, then one call per batch)."""
    import shardfuse

    rank, ws = dist.get_rank(), dist.get_world_size()
    results = []
    for captured in (True, False):
        model = _wrap(build({}), device_mesh=_mesh((2, 2)))
        opt = _optim(model.parameters())

        def step(ids: torch.Tensor, target: torch.Tensor, model: FSDP = model,
                 opt: torch.optim.Optimizer = opt) -> torch.Tensor:
            loss = loss_fn(model, ids, target, 0, {})
            loss.backward()
            model.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        batches = [batch(k, rank, ws) for k in range(3)]
        if captured:
            with shardfuse.capture_step(step, *batches[0], warmup=1) as train_step:
                losses = [train_step(*b).item() for b in batches[1:]]
        else:
            step(*batches[0])
            losses = [step(*b).item() for b in batches[1:]]
        results.append((losses, model.state_dict()))
    (losses, sd), (ref_losses, ref_sd) = results
    assert losses == ref_losses, (losses, ref_losses)
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    return True


def test_capture_step_under_a_mesh(pool4):
    assert pool4.run(check_capture_step_under_a_mesh) == [True] * 4


def test_one_by_four_is_flat_sharding(pool4):
    assert pool4.run(check_flat_equals_one_by_four) == [True] * 4


def test_dcp_saved_at_2x2_loads_at_1x4_and_4x1(pool4, tmp_path):
    assert pool4.run(check_dcp_across_meshes, str(tmp_path)) == [True] * 4


def test_hybrid_refusals_and_bad_input(pool4):
    assert pool4.run(check_refusals) == [True] * 4
    assert pool4.run(check_bad_input) == [True] * 4
