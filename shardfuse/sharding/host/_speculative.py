"""Speculative clipping (``OffloadOptimizer(speculative_clip=True)``): exact global-norm clipping whose host updates
overlap backward.

With clipping by the global norm no update may start before backward ends: the coefficient needs every gradient.
Here each offloaded unit's update starts as its gradient reaches the host (as with ``step_in_backward``), but
OUT OF PLACE: the new parameters, optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``, ...) and compute-dtype copy
are written into spare host buffers (:class:`Spare`) while the originals stay untouched. ``step()`` then knows the
coefficient (from ``model.clip_grad_norm_``) and decides for the whole step (:class:`Verdict`):

- coefficient exactly 1 (or no clipping call): the clipped path would multiply every gradient by 1.0, which changes
  no bit, so the speculated values ARE the clipped path's values: each unit COMMITS, a pointer swap (the shard's
  storage, the views of ``use_orig_params``, the state tensors and the compute copy; no copy; :func:`commit`);
- anything else (clipping fired, a non-finite norm): each speculated unit is REDONE from its untouched originals by
  the ordinary update with the coefficient (``_host_step.step_host_shard``), exactly the non-speculative path.

A unit whose speculative task has not started when the verdict comes runs the ordinary update at once (no
speculation, no waste). A commit also checks that nothing the speculation read changed since (the shard's version,
the gradients' versions, the state tensors, the settings; e.g. ``zero_grad()`` or ``load_state_dict()`` before
``step()``): otherwise the unit is redone. The result is the non-speculative path's, bit for bit, in every case.

Cost: with torch's fused Adam/AdamW the originals' chunk (parameters, moments) is copied into the spare's chunk
right before the fused kernel updates it in place there (``_host_fused._step_one``'s ``before_chunk``;
``SPEC_CHUNK_ELEMENTS`` elements per chunk); the kernel is per element and chunk boundaries fall on multiples of
``ALIGN``, so the values are those of the in-place path. The copy is NOT free: the update writes into freshly
copied buffers, and measured 2026-11-27 on one H100 host (16 cores; logs lost with that submission) a speculated
unit's update took 99-178 ms against 37-41 ms in place; the host step alone (``python -m bench.offload.host_step
--spec --pinned --dma``, fused AdamW over 1B page-locked parameters) took 721 ms out of place against 224 ms in
place (914 against 331 beside 73 GB/s of host<->device copies), and chunks of 1M, 512K and 256K elements were no
faster (766, 750, 1006 ms). Only 3 of the 2.9B decoder's 25 units finished during backward, so a committed step
does NOT cost what a ``step_in_backward`` step costs: speculation only uses the host time backward leaves idle
(with ``keep_params_gib``: 1207 ms against 1411-1439 ms for the clipped step). Other optimizers (and the first
step, which makes the state) copy the shard and its state into the spare and step a temporary optimizer of the
user's class over the spare.

When clipping fires step after step, every speculation is thrown away and the redo waits for the unit being
speculated: after ``speculative_backoff`` consecutive redo verdicts (default 3) speculation pauses until a step's
verdict would commit again (:class:`BackOff`; measured 2026-11-28 on an HF Llama 1B fine-tune at clip 1.0, the
norm stayed 2.6-4.2 and all 200 steps redid).

The spare memory (shard + state + compute copy per unit) is bounded by ``speculative_clip_gib``: the units that
fit, counted in the order their gradients land (the last of the forward order first), speculate; the others update
after the norm as without speculation.

Each offloaded unit's speculation is a :class:`SpecState` (beside its ``HostShard.life``, which its task moves as
any update's). Owners (docs/concurrency.md): the caller side (``_on_grad_sent``, ``step()``) moves IDLE -> QUEUED and
SPECULATED -> IDLE; the worker moves QUEUED -> SPECULATING / IDLE and SPECULATING -> SPECULATED / IDLE.
``Speculation._lock`` makes each check-and-move atomic together with the verdict of the step (a leaf lock).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardfuse._torch_private import FusedKernel, foreach_add_, fused_adam_kernels
from shardfuse._versions import mark_updated
from shardfuse.sharding.core._flat_param import FlatParamHandle
from shardfuse.sharding.core._registry import SHARD_MARK_ATTR
from shardfuse.sharding.host import _host_fused, _host_step
from shardfuse.sharding.host._host_fused import ALIGN, _Group, _group_of, _offset_in, _step_one
from shardfuse.sharding.host._host_shard import HostShard, IllegalTransition, host_buffer
from shardfuse.sharding.host._host_step import ShardPlan, StepWorker, host_task, settings_of

# Elements per chunk of the out-of-place update (copy the originals' chunk into the spare, then update it there):
# the in-place path's size by default; measured on one H100 host, 1M, 512K and 256K were no faster (see the module).
# A multiple of ALIGN (results then match the in-place path bit for bit); the benchmark sets it per row
# (BIG_SPEC_CHUNK in bench/offload/big_impls.py).
SPEC_CHUNK_ELEMENTS = _host_fused.CHUNK_ELEMENTS


class SpecState(enum.Enum):
    """Where one unit's speculation is (see the module)."""

    IDLE = "idle"  # none held (none yet, or the last one committed, redone or dropped)
    QUEUED = "queued"  # submitted when its gradient copy was queued; the worker has not taken it
    SPECULATING = "speculating"  # the worker writes the spare buffers
    SPECULATED = "speculated"  # the spare holds the update; step()'s verdict decides


TRANSITIONS: dict[SpecState, frozenset[SpecState]] = {
    SpecState.IDLE: frozenset({SpecState.QUEUED}),
    SpecState.QUEUED: frozenset({SpecState.SPECULATING, SpecState.IDLE}),
    SpecState.SPECULATING: frozenset({SpecState.SPECULATED, SpecState.IDLE}),
    SpecState.SPECULATED: frozenset({SpecState.IDLE}),
}


@dataclass(frozen=True)
class Verdict:
    """What ``step()`` decided for the updates of one backward."""

    commit: bool  # the clipping coefficient is exactly 1 (or there was none): speculated values stand
    coef: torch.Tensor | None  # the coefficient on the host (None: no clipping call), for redone/late updates


@dataclass(eq=False)
class Round:
    """The speculations of one backward (until its ``step()``), and that step's verdict once decided;
    ``speculate``: False while the back-off pauses speculation (:class:`BackOff`)."""

    verdict: Verdict | None = None
    submitted: int = 0
    speculate: bool = True


@dataclass
class BackOff:
    """When speculation pauses: after ``after`` consecutive steps whose verdict was to redo (clipping fired, or a
    non-finite norm), the next backwards speculate nothing (their units update after the norm, as without
    speculation: no spare work that a redo throws away); the first step whose verdict would commit resumes it
    for the step after. The verdict of every step is known whether it speculated or not, so no probing is needed.
    ``after=None``: never pause. Results are the same bits either way; only where the host time goes changes."""

    after: int | None
    streak: int = 0  # consecutive steps with a redo verdict

    def record(self, committed: bool) -> None:
        self.streak = 0 if committed else self.streak + 1

    def allows(self) -> bool:
        return self.after is None or self.streak < self.after


@dataclass
class Spare:
    """A unit's spare host buffers: the shard (pinned like the shard), its compute copy, and per parameter the
    spare of each state tensor. After a commit they hold the previous originals (double buffering)."""

    flat: torch.Tensor | None = None
    compute: torch.Tensor | None = None
    state: dict[torch.Tensor, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [self.flat, self.compute, *(t for entries in self.state.values() for t in entries.values())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class Outcome:
    """What a speculation wrote (per updated parameter, its new state entries) and what it read from."""

    new_state: list[tuple[torch.Tensor, dict[str, Any]]]
    read_state: list[tuple[torch.Tensor, dict[str, Any]]]
    grads: list[tuple[int, int] | None]  # per parameter of the plan: its gradient's (data_ptr, version)
    flat_version: int
    flat_ptr: int
    settings: list[dict[str, Any]]

    def still_valid(self, plan: ShardPlan, flat: torch.Tensor, settings: list[dict[str, Any]]) -> bool:
        """Whether the originals, gradients and settings are still those the speculation started from."""
        if flat._version != self.flat_version or flat.data_ptr() != self.flat_ptr:
            return False
        if _grad_marks(plan) != self.grads or not _same(settings, self.settings):
            return False
        state = plan.subs[0].state
        for p, read in self.read_state:
            now = state.get(p, {})
            if now.keys() != read.keys() or any(now[k] is not v if isinstance(v, torch.Tensor) else not _same(now[k], v)
                                                for k, v in read.items()):
                return False
        return True


@dataclass(eq=False)
class SpecRecord:
    """One offloaded unit's speculation."""

    host: HostShard
    spare: Spare = field(default_factory=Spare)
    state: SpecState = SpecState.IDLE
    round: Round | None = None
    settings: list[dict[str, Any]] = field(default_factory=list)  # step()'s (the backward's until step() sets them)
    outcome: Outcome | None = None

    def move(self, to: SpecState) -> None:
        """Called under ``Speculation._lock``."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"speculative update {self.host.life.name}: {self.state.name} -> {to.name} is not "
                                    f"allowed; a speculation was queued twice, or moved by the wrong thread")
        self.state = to


@dataclass
class SpecCounts:
    """``OffloadOptimizer.host_stats()``'s speculative counters."""

    steps_committed: int = 0  # steps whose verdict was commit (with at least one speculated unit)
    steps_redone: int = 0  # steps whose verdict was redo (clipping fired, or a non-finite norm)
    units_committed: int = 0  # unit updates committed by a pointer swap
    units_redone: int = 0  # unit updates speculated, then computed again from the originals
    units_late: int = 0  # submitted in backward, but the verdict came first: updated in place at once
    steps_paused: int = 0  # steps without speculation: the back-off paused it after a run of redo verdicts


class Speculation:
    """The speculative updates of one ``OffloadOptimizer`` (its ``_spec``)."""

    def __init__(self, budget_gib: float | None, backoff: int | None = None) -> None:
        self.budget_bytes = None if budget_gib is None else float(budget_gib) * (1 << 30)
        self._lock = threading.Lock()  # guards records' states and settings, the round and its verdict, counts
        self._records: dict[int, SpecRecord] = {}  # by id(host)
        self._eligible: set[int] = set()
        self._backoff = BackOff(backoff)  # main thread only (step())
        self._round = Round()
        self.counts = SpecCounts()

    def choose(self, plans: list[ShardPlan], state_bytes_per_element: int) -> None:
        """The units that may speculate within the budget, in the order their gradients land (``plans`` is in
        forward order), as a prefix. Records of shards no longer offloaded, or idle and no longer eligible, are
        dropped (with their spares); one in flight stays, for step() to resolve."""
        eligible: set[int] = set()
        used = 0.0
        for plan in reversed(plans):
            host, handle = plan.host, plan.handle
            if host is None or handle is None or type(host) is not HostShard:  # SSD-backed shards: not here
                continue
            numel = handle.flat.numel()
            cost = numel * (handle.flat.element_size() + state_bytes_per_element)
            cost += numel * host.compute_buf.element_size() if host.compute_buf is not None else 0
            if self.budget_bytes is not None and used + cost > self.budget_bytes:
                break
            used += cost
            eligible.add(id(host))
        offloaded = {id(plan.host) for plan in plans if plan.host is not None}
        with self._lock:
            self._eligible = eligible
            self._records = {k: r for k, r in self._records.items()
                             if k in offloaded and (k in eligible or r.state is not SpecState.IDLE)}

    @property
    def backoff_after(self) -> int | None:
        """``speculative_backoff``: redo verdicts in a row before speculation pauses (None: never)."""
        return self._backoff.after

    def spare_bytes(self) -> int:
        with self._lock:
            return sum(r.spare.nbytes for r in self._records.values())

    def submitted(self) -> bool:
        """Whether this backward queued any speculation (step() then need not wait for the updates in flight)."""
        with self._lock:
            return self._round.submitted > 0

    def submit(self, plan: ShardPlan, settings: list[dict[str, Any]]) -> Callable[[], None] | None:
        """Caller side, when ``plan``'s gradient copy is queued: the task's update (None: no spare room; it updates
        after the norm)."""
        host = plan.host
        with self._lock:
            if host is None or id(host) not in self._eligible or not self._round.speculate:
                return None
            rec = self._records.get(id(host))
            if rec is None or rec.host is not host:
                rec = self._records[id(host)] = SpecRecord(host)
            if rec.state is SpecState.SPECULATED:  # speculated in an earlier backward that no step() followed
                rec.move(SpecState.IDLE)
            rec.move(SpecState.QUEUED)
            rec.round, rec.settings, rec.outcome = self._round, settings, None
            self._round.submitted += 1
        return functools.partial(self._update, plan, rec)

    def _update(self, plan: ShardPlan, rec: SpecRecord) -> None:
        """Worker, under the step lock, in ``UPDATING``: speculate, unless the verdict is known already; a verdict
        that comes while speculating is applied here."""
        host, handle = plan.host, plan.handle
        assert host is not None and handle is not None and rec.round is not None
        with self._lock:
            verdict, settings = rec.round.verdict, rec.settings
            rec.move(SpecState.SPECULATING if verdict is None else SpecState.IDLE)
            if verdict is not None:
                self.counts.units_late += 1
        if verdict is not None:
            _host_step.step_host_shard(plan, host, handle, settings, verdict.coef, plan.pool)
            return
        try:
            outcome = speculate(plan, rec.spare, host, handle, settings)
        except BaseException:
            with self._lock:  # the task fails (raised at the next wait); step() then treats the unit as unspeculated
                rec.move(SpecState.IDLE)
            raise
        with self._lock:
            verdict, settings = rec.round.verdict, rec.settings
            if verdict is None:
                rec.outcome = outcome
                rec.move(SpecState.SPECULATED)
                return
            rec.move(SpecState.IDLE)
        self._resolve(plan, rec, outcome, verdict, settings)

    def _resolve(self, plan: ShardPlan, rec: SpecRecord, outcome: Outcome | None, verdict: Verdict,
                 settings: list[dict[str, Any]]) -> None:
        """Commit the speculated update, or compute it again from the originals with the coefficient."""
        host, handle = plan.host, plan.handle
        assert host is not None and handle is not None
        if verdict.commit and outcome is not None and outcome.still_valid(plan, handle.flat, settings):
            commit(plan, host, handle, rec.spare, outcome)
            counter = "units_committed"
        else:
            _host_step.step_host_shard(plan, host, handle, settings, verdict.coef, plan.pool)
            counter = "units_redone"
        with self._lock:
            setattr(self.counts, counter, getattr(self.counts, counter) + 1)

    def step(self, plans: list[ShardPlan], optimizer: torch.optim.Optimizer, coef: torch.Tensor | None,
             lock: threading.Lock, worker: StepWorker) -> None:
        """Main thread, ``OffloadOptimizer.step()``: the verdict for this backward's speculations, applied to
        those already done; the other host shards are queued as without speculation (``coef``: on the host)."""
        verdict = Verdict(commit=coef is None or bool(coef == 1.0), coef=coef)
        settings = {id(plan): settings_of(optimizer, plan) for plan in plans if plan.host is not None}
        self._backoff.record(verdict.commit)
        with self._lock:
            rnd, self._round = self._round, Round(speculate=self._backoff.allows())
            mine = {id(r.host): r for r in self._records.values() if r.round is rnd and r.state is not SpecState.IDLE}
            for plan in plans:
                if plan.host is not None and id(plan.host) in mine:
                    mine[id(plan.host)].settings = settings[id(plan)]
            rnd.verdict = verdict
            held = {k for k, r in mine.items() if r.state is SpecState.SPECULATED}
            if rnd.submitted:
                self.counts.steps_committed += verdict.commit
                self.counts.steps_redone += not verdict.commit
            elif not rnd.speculate:
                self.counts.steps_paused += 1
        for i, plan in enumerate(plans):  # forward order
            host = plan.host
            if host is None or (id(host) in mine and id(host) not in held):
                continue  # on the GPU; or its task, queued or running, applies the verdict itself
            host.wait_ready()  # a speculation just done, or (a unit without gradient) an update of the last step
            if id(host) in held:
                rec, handle = mine[id(host)], plan.handle
                outcome, rec.outcome = rec.outcome, None
                valid = (verdict.commit and outcome is not None and handle is not None
                         and outcome.still_valid(plan, handle.flat, settings[id(plan)]))
                if valid and outcome is not None and handle is not None:  # settled: committed here at once
                    # A first step adds entries to the optimizer's state dict, which the process-wide step hooks of
                    # an update running on the worker iterate: that commit waits for the step lock.
                    fresh = any(p not in plan.subs[0].state for p, _ in outcome.new_state)
                    with lock if fresh else contextlib.nullcontext():
                        commit(plan, host, handle, rec.spare, outcome)
                with self._lock:
                    rec.move(SpecState.IDLE)
                    self.counts.units_committed += valid
                    self.counts.units_redone += not valid
                if valid:
                    continue
            host.queue()
            worker.submit(host_task(plan, settings[id(plan)], coef, lock), key=i, tag=plan)


def _grad_marks(plan: ShardPlan) -> list[tuple[int, int] | None]:
    return [None if p.grad is None else (p.grad.data_ptr(), p.grad._version) for _, ps in plan.groups for p in ps]


def _same(a: Any, b: Any) -> bool:
    """Settings (and non-tensor state) equal: tensors by value, sequences and dicts element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


# ------------------------------------------------------------------------------------------------------------------
# the out-of-place update, and the commit
# ------------------------------------------------------------------------------------------------------------------


def speculate(plan: ShardPlan, spare: Spare, host: HostShard, handle: FlatParamHandle,
              settings: list[dict[str, Any]]) -> Outcome | None:
    """Write the update of ``plan``'s shard into ``spare`` (worker, under the step lock); the originals are only
    read. None: parameters that are no view of the shard (then the unit is redone at step())."""
    flat = handle.flat.detach()
    params = [p for _, ps in plan.groups for p in ps]
    if any(_offset_in(flat, p) is None for p in params):
        return None
    state = plan.subs[0].state
    read = [(p, dict(state[p]) if p in state else {}) for p in params if p.grad is not None]
    _make_spare(spare, flat, host, handle)
    with torch.no_grad():
        new_state = _speculate_chunked(plan, spare, flat, settings)
        if new_state is None:
            new_state = _speculate_stepped(plan, spare, flat, settings)
    return Outcome(new_state, read, _grad_marks(plan), handle.flat._version, flat.data_ptr(), settings)


def _make_spare(spare: Spare, flat: torch.Tensor, host: HostShard, handle: FlatParamHandle) -> None:
    """The spare shard and compute copy, pinned like the host shard's buffers; registered under the unit's CUDA
    device (this runs on the worker thread, whose current device is not the rank's)."""
    full = handle.full_param
    device = full.device if full is not None and full.device.type == "cuda" else None
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        if spare.flat is None or spare.flat.shape != flat.shape or spare.flat.dtype != flat.dtype:
            spare.flat = host_buffer(flat.numel(), flat.dtype, host.pin)
        if host.compute_buf is None:
            spare.compute = None
        elif spare.compute is None or spare.compute.shape != host.compute_buf.shape:
            spare.compute = host_buffer(flat.numel(), host.compute_buf.dtype, host.pin)


def _spare_of(spare: Spare, p: torch.Tensor, key: str, like: torch.Tensor) -> torch.Tensor:
    """The spare of state tensor ``key`` of ``p`` (made, or made again, to match ``like``)."""
    entries = spare.state.setdefault(p, {})
    t = entries.get(key)
    if t is None or t is like or t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        t = entries[key] = torch.empty_like(like, memory_format=torch.contiguous_format)
    return t


def _speculate_chunked(plan: ShardPlan, spare: Spare, flat: torch.Tensor,
                       settings: list[dict[str, Any]]) -> list[tuple[torch.Tensor, dict[str, Any]]] | None:
    """torch's fused Adam/AdamW with state made: per chunk, the originals' chunk is copied into the spare's, then
    the fused kernel updates the spare's chunk in place (and writes the spare compute copy). None: not this path."""
    kernels = fused_adam_kernels()
    if kernels is None:
        return None
    groups = [_group_of(sub, params, s) for sub, (_, params), s in zip(plan.subs, plan.groups, settings)]
    if any(g is None for g in groups):
        return None
    assert spare.flat is not None
    new_state: list[tuple[torch.Tensor, dict[str, Any]]] = []
    covered: list[tuple[int, int]] = []
    for group in groups:
        assert group is not None
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.max_exp_avg_sqs else [])
        target = _Group([], group.grads, [], [], [], [], group.kwargs, group.decoupled)
        sources = []
        for i, p in enumerate(group.params):
            offset = _offset_in(flat, p)
            assert offset is not None
            covered.append((offset, p.numel()))
            originals = [group.exp_avgs[i], group.exp_avg_sqs[i]] + ([group.max_exp_avg_sqs[i]] if "max_exp_avg_sq"
                                                                     in names else [])
            spares = [_spare_of(spare, p, n, t) for n, t in zip(names, originals)]
            target.params.append(spare.flat.narrow(0, offset, p.numel()).view(p.shape))
            target.exp_avgs.append(spares[0])
            target.exp_avg_sqs.append(spares[1])
            target.max_exp_avg_sqs.extend(spares[2:])
            step = _spare_of(spare, p, "step", group.steps[i])
            step.copy_(group.steps[i])
            target.steps.append(step)
            sources.append((offset, [p, *originals], [target.params[i], *spares]))
            new_state.append((p, {"step": step, **dict(zip(names, spares))}))
        if not group.params:
            continue
        foreach_add_(target.steps, 1)  # as step_in_chunks does to the originals' steps
        kernel = kernels[1] if group.decoupled else kernels[0]
        for i, (offset, src, dst) in enumerate(sources):
            update_out_of_place(target, i, kernel, src, dst, spare.compute, offset)
    _copy_rest(flat, spare, covered)
    return new_state


def update_out_of_place(target: _Group, i: int, kernel: FusedKernel, src: list[torch.Tensor], dst: list[torch.Tensor],
                        compute: torch.Tensor | None = None, offset: int | None = None,
                        chunk: int | None = None) -> None:
    """Parameter ``i`` of ``target`` (whose tensors are the spares ``dst``), chunk by chunk: the originals' chunk
    (``src``: parameter, moments) copied into ``dst``'s, then the fused kernel updates it there; ``src`` is only
    read. ``chunk``: elements per chunk (None: ``SPEC_CHUNK_ELEMENTS``). ``bench.offload.host_step --spec``
    measures this against the in-place update."""
    chunk = SPEC_CHUNK_ELEMENTS if chunk is None else chunk
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"the speculative update's chunk must be a positive multiple of {ALIGN} elements (so its "
                         f"values match the in-place update's), got {chunk}; set SPEC_CHUNK_ELEMENTS (or "
                         f"BIG_SPEC_CHUNK) to such a multiple")
    _step_one(target, i, kernel, None, compute, offset, chunk, before_chunk=functools.partial(_copy_chunk, src, dst))


def _copy_chunk(src: list[torch.Tensor], dst: list[torch.Tensor], a: int, b: int) -> None:
    for s, d in zip(src, dst):
        d.view(-1)[a:b].copy_(s.view(-1)[a:b])


def _copy_rest(flat: torch.Tensor, spare: Spare, covered: list[tuple[int, int]]) -> None:
    """Copy what no update wrote (parameters without gradient, the padding) into the spare shard and its compute
    copy, so the spare is the whole shard after the update."""
    assert spare.flat is not None
    pos = 0
    gaps = []
    for a, n in sorted(covered):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, a + n)
    if pos < flat.numel():
        gaps.append((pos, flat.numel()))
    for a, b in gaps:
        spare.flat[a:b].copy_(flat[a:b])
        if spare.compute is not None:
            spare.compute[a:b].copy_(spare.flat[a:b])


def _speculate_stepped(plan: ShardPlan, spare: Spare, flat: torch.Tensor,
                       settings: list[dict[str, Any]]) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """Any per-element optimizer (and the first step, which makes the state): the shard and the state are copied
    into the spare, and a temporary optimizer of the user's class and settings steps the spare."""
    assert spare.flat is not None
    spare.flat.copy_(flat)
    new_state: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for sub, (_, params), group_settings in zip(plan.subs, plan.groups, settings):
        pairs, temp = [], {}
        for p in params:
            if p.grad is None:
                continue
            offset = _offset_in(flat, p)
            assert offset is not None
            sp = spare.flat.narrow(0, offset, p.numel()).view(p.shape)
            sp.grad = p.grad
            # The process-wide step hooks see the spare as the parameter (they mark its state with the shard)
            setattr(sp, SHARD_MARK_ATTR, getattr(p, SHARD_MARK_ATTR, None))
            entries = {}
            for k, v in (sub.state[p].items() if p in sub.state else ()):
                entries[k] = _spare_of(spare, p, k, v).copy_(v) if isinstance(v, torch.Tensor) else v
            temp[sp] = entries
            pairs.append((p, sp))
        if not pairs:
            continue
        stepper = type(sub)([{"params": [sp for _, sp in pairs], **group_settings}])  # type: ignore[call-arg]
        stepper.state = defaultdict(dict, temp)
        stepper.step()
        for p, sp in pairs:
            new_state.append((p, stepper.state[sp]))
            sp.grad = None
    if spare.compute is not None:
        spare.compute.copy_(spare.flat)
    return new_state


def commit(plan: ShardPlan, host: HostShard, handle: FlatParamHandle, spare: Spare, outcome: Outcome) -> None:
    """Swap the speculated update in: the shard's storage (and its ``use_orig_params`` views), the state tensors,
    the compute copy; the replaced originals become the spare. No copy. The shard's version counter moves (a
    gathered full buffer kept for the next forward is gathered again)."""
    assert spare.flat is not None
    flat = handle.flat
    with torch.no_grad():
        old = flat.data  # an alias with a counter of its own: writing the spare later does not move flat's
        flat.data = spare.flat  # flat keeps its version counter (shared with its views)
        if handle.orig_views is not None:
            for v, (a, n) in zip(handle.orig_views, handle.view_ranges):
                v.data = spare.flat.narrow(0, a, n).view(v.shape)
    spare.flat = old
    mark_updated([flat])
    state = plan.subs[0].state
    for p, new in outcome.new_state:
        entries = state[p]
        for k, t in new.items():
            was = entries.get(k)
            entries[k] = t
            if isinstance(was, torch.Tensor) and was is not t:
                spare.state.setdefault(p, {})[k] = was
    if host.compute_buf is not None and spare.compute is not None:
        host.compute_buf, spare.compute = spare.compute, host.compute_buf
    host.copy_version = flat._version
