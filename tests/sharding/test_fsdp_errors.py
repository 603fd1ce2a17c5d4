"""World size 1 (parity with the plain model) and one test per misuse error, in a gloo group of 1."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardfuse.sharding import FullyShardedDataParallel as FSDP
from shardfuse.sharding import TrainingState
from tests.dist_pool import DistPool
from tests.sharding._models import batch, build, loss_fn, make_optim, reference_train, wrap_model


@pytest.fixture(scope="module")
def pool():
    with DistPool(world_size=1) as p:
        yield p


def test_needs_a_process_group():
    # In the test process itself: no process group exists here.
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group"):
        FSDP(nn.Linear(3, 5))


def check_world_size_1_parity() -> bool:
    cfg: dict[str, Any] = dict(nested=True)
    model = wrap_model(build(cfg), cfg)
    opt = make_optim(model.parameters(), cfg)
    losses = []
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        ids, target = batch(step, 0, 1)
        loss = loss_fn(model, ids, target, step, cfg)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ref, ref_losses, _ = reference_train(cfg, 1, 5)
    assert losses == [x[0] for x in ref_losses]
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    assert model.is_root and not model.module.blocks[0].is_root
    assert model.training_state == TrainingState.IDLE
    return True


def test_world_size_1_parity(pool):
    assert pool.run(check_world_size_1_parity) == [True]


def _raises(exc: type[BaseException], match: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


class _CallsSummonInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.owner: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.owner.summon_full_params():
            pass
        return self.lin(x)


class _CallsStateDictInForward(_CallsSummonInForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.owner.state_dict()
        return self.lin(x)


def check_errors() -> bool:
    # Wrapping twice.
    m = nn.Linear(3, 5)
    w = FSDP(m)
    _raises(ValueError, "already a FullyShardedDataParallel instance", FSDP, w)
    # Wrapping the module itself again is allowed (FairScale): the first wrapper gives its parameters back.
    w2 = FSDP(m)
    _raises(RuntimeError, "gave its parameters to a newer FullyShardedDataParallel", w, torch.randn(2, 3))
    assert w2(torch.randn(2, 3)).shape == (2, 5)
    # A part built on the meta device is materialised on the others' device (meta-device init), not rejected.
    mixed = FSDP(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta")))
    assert not any(v.is_meta for v in mixed.state_dict().values())
    # Unsupported or inconsistent arguments.
    _raises(ValueError, "fp32_reduce_scatter=True only applies with mixed_precision=True", FSDP, nn.Linear(3, 3),
            fp32_reduce_scatter=True)
    _raises(ValueError, "compute_dtype=torch.bfloat16 without mixed_precision computes in the parameters. own",
            FSDP, nn.Linear(3, 3), compute_dtype=torch.bfloat16)
    _raises(ValueError, "compute_dtype=torch.int8 is not supported", FSDP, nn.Linear(3, 3),
            mixed_precision=True, compute_dtype=torch.int8)
    _raises(ValueError, "move_grads_to_cpu=True needs move_params_to_cpu=True", FSDP, nn.Linear(3, 3),
            move_grads_to_cpu=True)
    _raises(NotImplementedError, "move_grads_to_cpu=False is not supported", FSDP, nn.Linear(3, 3),
            move_params_to_cpu=True, move_grads_to_cpu=False)
    _raises(ValueError, "gradient_predivide_factor must be > 0", FSDP, nn.Linear(3, 3), gradient_predivide_factor=0)
    _raises(ValueError, "process_group_reduce_scatter=.x.: pass a ProcessGroup", FSDP, nn.Linear(3, 3),
            process_group_reduce_scatter="x")
    _raises(TypeError, "wraps an nn.Module, got int", FSDP, 3)
    # Integer parameter.
    bad = nn.Linear(3, 3)
    bad.count = nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)
    _raises(TypeError, r"parameter count has dtype torch.int64; only floating-point", FSDP, bad)
    # A parameter shared across two units.
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    seq = nn.Sequential(a, b)
    seq[0] = FSDP(a)
    _raises(ValueError, "shared with a module already wrapped by another", FSDP, seq)
    # summon_full_params / state_dict during forward.
    for cls, match in ((_CallsSummonInForward, r"summon_full_params\(\) is not allowed .* running its forward"),
                       (_CallsStateDictInForward, r"state_dict\(\) is not allowed .* running its forward")):
        inner = cls()
        model = FSDP(inner)
        inner.owner = model
        _raises(RuntimeError, match, model, torch.randn(2, 3))
    # clip_grad_norm_ on a nested unit.
    model = wrap_model(build({}), {})
    _raises(RuntimeError, "must be called on the root", model.module.blocks[0].clip_grad_norm_, 1.0)
    # Backward reaching a unit's parameters without going through its outputs.
    model = wrap_model(build({}), {})
    model(batch(0, 0, 1)[0])
    view = model.module.head.weight  # the view used by the last forward
    _raises(RuntimeError, "without its pre-backward hook", view.sum().backward)
    # reset_parameters after wrapping.
    model = FSDP(nn.Linear(3, 3))
    _raises(RuntimeError, "pass allow_reset_parameters=True", model.module.reset_parameters)
    # Replacing a Parameter inside summon_full_params without allow_reset_parameters.
    model = FSDP(nn.Linear(3, 3))

    def replace() -> None:
        with model.summon_full_params():
            model.module.weight = nn.Parameter(torch.zeros(3, 3))

    _raises(RuntimeError, "was replaced by a new tensor inside summon_full_params", replace)
    # ... which allow_reset_parameters=True permits (and copies back).
    model = FSDP(nn.Linear(3, 3), allow_reset_parameters=True)
    with model.summon_full_params():
        model.module.reset_parameters()
        model.module.weight = nn.Parameter(torch.full((3, 3), 2.0))
    assert torch.equal(model.state_dict()["weight"], torch.full((3, 3), 2.0))
    # State dict loading errors.
    model = FSDP(nn.Linear(3, 3))
    _raises(RuntimeError, r"missing keys \['bias'\]", model.load_state_dict, {"weight": torch.zeros(3, 3)})
    _raises(RuntimeError, r"unexpected keys \['extra'\]", model.load_state_dict,
            {"weight": torch.zeros(3, 3), "bias": torch.zeros(3), "extra": torch.zeros(1)})
    _raises(RuntimeError, r"size mismatch for weight: the state dict has shape \(4, 3\)", model.load_state_dict,
            {"weight": torch.zeros(4, 3), "bias": torch.zeros(3)})
    res = model.load_state_dict({"weight": torch.ones(3, 3)}, strict=False)
    assert res.missing_keys == ["bias"] and torch.equal(model.state_dict()["weight"], torch.ones(3, 3))
    _raises(ValueError, "needs a dict made by gather_full_optim_state_dict", model.get_shard_from_optim_state_dict, {})
    _raises(ValueError, r"set_gradient_divide_factors needs pre > 0, got pre=-1", model.set_gradient_divide_factors,
            -1, 1)
    opt = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(1))], lr=0.1)
    _raises(ValueError, "not flat parameters of this FullyShardedDataParallel tree",
            model.gather_full_optim_state_dict, opt)
    return True


def test_misuse_errors(pool):
    assert pool.run(check_errors) == [True]


def _root_flat_grad_vs_ref(model: FSDP, ref: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    h = model._unit.handles[0]
    ref_params = dict(ref.named_parameters())
    want = torch.cat([ref_params[n].grad.reshape(-1) for n in h.names])
    return model.flat_param_0.grad[: h.numel], want


def check_set_factors_and_repr() -> bool:
    for (pre, post), scale in (((2.0, 0.5), 1.0), ((4.0, 1.0), 0.25)):
        model = wrap_model(build({}), {})
        model.set_gradient_divide_factors(pre, post)
        assert all(u.gradient_predivide_factor == pre for u in model._units())
        loss_fn(model, *batch(0, 0, 1), 0, {}).backward()
        ref = build({})
        loss_fn(ref, *batch(0, 0, 1), 0, {}).backward()
        got, want = _root_flat_grad_vs_ref(model, ref)
        # Powers of two: division is exact, so the scaled gradient matches bit for bit.
        assert torch.equal(got, want * scale), (pre, post)
    assert "world_size=1" in repr(model)
    verbose = FSDP(nn.Linear(3, 3), verbose=True)
    assert "reshard_after_forward=True" in repr(verbose)
    return True


def test_set_gradient_divide_factors(pool):
    assert pool.run(check_set_factors_and_repr) == [True]


def check_move_params_to_cpu_eval() -> bool:
    model = FSDP(build({}), move_params_to_cpu=True)
    ref = build({})
    with torch.no_grad():
        out = model(batch(0, 0, 1)[0])
    assert torch.equal(out, ref(batch(0, 0, 1)[0]))
    return True


def test_move_params_to_cpu_forward(pool):
    assert pool.run(check_move_params_to_cpu_eval) == [True]



def check_optimizer_step_misuse() -> bool:
    cfg: dict[str, Any] = dict(nested=True, optim="sgd")
    model = wrap_model(build(cfg), cfg)
    opt = make_optim(model.parameters(), cfg)
    ids, target = batch(0, 0, 1)
    loss_fn(model, ids, target, 0, cfg).backward()  # gradients, so that a step changes the shards
    # A step between forward and backward: backward would compute gradients of other parameters.
    loss = loss_fn(model, ids, target, 1, cfg)
    opt.step()
    _raises(RuntimeError, r"changed between its forward and its backward .* step the optimizer after backward",
            loss.backward)
    assert all(u.training_state == TrainingState.IDLE for u in model._units())
    # The tree stays usable: a correct step afterwards trains as usual.
    opt.zero_grad(set_to_none=True)
    loss_fn(model, ids, target, 2, cfg).backward()
    opt.step()
    # A step inside summon_full_params(): the write-back on exit would overwrite it.
    loss_fn(model, ids, target, 3, cfg).backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def step_inside_summon(volatile: bool) -> None:
        with model.summon_full_params(volatile=volatile):
            opt.step()

    _raises(RuntimeError, r"changed inside summon_full_params\(\) .* step the optimizer outside", step_inside_summon,
            False)
    after = model.state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before), "the step inside the block was lost"
    step_inside_summon(True)  # volatile: nothing is written back, so nothing is lost
    assert all(u.training_state == TrainingState.IDLE for u in model._units())
    return True


def test_optimizer_step_misuse(pool):
    assert pool.run(check_optimizer_step_misuse) == [True]


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (stands in for an out-of-memory error mid-backward)."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailingBackward.armed:
            raise RuntimeError("simulated failure in backward")
        return grad


class _Tripwire(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailingBackward.apply(x)


def check_recovers_after_failed_backward() -> bool:
    def make() -> FSDP:
        torch.manual_seed(0)
        seq = nn.Sequential(FSDP(nn.Linear(4, 4)), _Tripwire(), FSDP(nn.Linear(4, 4)), nn.Linear(4, 2))
        return FSDP(seq)

    failed, clean = make(), make()
    opt_f = torch.optim.SGD(failed.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(clean.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for model, opt in ((failed, opt_f), (clean, opt_c)):  # the first step records the order
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _FailingBackward.armed = True
    try:
        _raises(RuntimeError, "simulated failure in backward", lambda: failed(x).sum().backward())
    finally:
        _FailingBackward.armed = False
    assert failed._unit.root_state.in_backward, "the failure must interrupt the backward (else this tests nothing)"
    for model, opt in ((failed, opt_f), (clean, opt_c)):
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()
        assert all(u.training_state == TrainingState.IDLE for u in model._units())
        assert not model._unit.root_state.in_backward
    for (k, a), b in zip(failed.state_dict().items(), clean.state_dict().values()):
        assert torch.equal(a, b), k
    return True


def test_training_recovers_after_a_failed_backward(pool):
    # A backward that raises (out of memory, say) never reaches the root's final callback; the next forward
    # must reset the sharding state instead of treating itself as a checkpoint recompute.
    assert pool.run(check_recovers_after_failed_backward) == [True]
